"""Accelerator metrics from every gang process, through ``ray.util.metrics``.

Each gang process (training worker or serving host) runs a :class:`HostSampler`
that exports, tagged with ``slice``, ``worker_id``, ``device`` and ``run`` (the
run or deployment name):

* ``rayslice_device_memory_used_bytes`` / ``rayslice_device_memory_total_bytes``
  per device;
* ``rayslice_duty_cycle`` (0..1) per device where the backend measures it
  (TPU), else per host derived from step timing (time in steps / wall time);
* ``rayslice_step_time_seconds`` per host (last step);
* ``rayslice_process_memory_bytes`` per host (resident memory of the process).

The training controller exports ``rayslice_goodput_seconds{component=...}`` and
``rayslice_goodput_fraction`` per run. Ray's metrics agent on each node serves
them on its Prometheus endpoint (``ray.nodes()[i]["MetricsExportPort"]``, names
prefixed ``ray_``), so they appear in Prometheus, the Ray dashboard and Grafana
(``observability/grafana-dashboard.json``).

Sources, by backend: TPU - libtpu's runtime metrics through the ``tpu-info``
package when it is installed; GPU - ``jax.Device.memory_stats()``; CPU (the
simulator) - ``memory_stats()`` when JAX exposes it, else the process's memory,
and duty cycle from step timing. A missing source is reported once (a log line
and ``rayslice_metric_source_available{source=...} 0``) and never breaks a job.

Example (inside a gang process)::

    sampler = HostSampler({"slice": "s", "worker_id": "0", "run": "r"}).start()
    sampler.record_step(0.12)
    sampler.stop()
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

logger = logging.getLogger(__name__)

TAG_KEYS = ("slice", "worker_id", "device", "run")
_WARNED: set[str] = set()


def _warn_once(source: str, why: str) -> None:
    if source not in _WARNED:
        _WARNED.add(source)
        logger.warning("rayslice metrics: %s not available (%s); continuing without it", source, why)


class _Gauges:
    """The metric objects, created once per process (Ray registers them by name)."""

    _instance: _Gauges | None = None

    def __init__(self) -> None:
        from ray.util.metrics import Gauge

        def g(name: str, doc: str, keys: tuple[str, ...] = TAG_KEYS) -> Any:
            return Gauge(name, doc, tag_keys=keys)

        self.mem_used = g("rayslice_device_memory_used_bytes", "Accelerator memory in use, per device.")
        self.mem_total = g("rayslice_device_memory_total_bytes", "Accelerator memory, per device.")
        self.duty = g("rayslice_duty_cycle", "Fraction of time the accelerator is busy (0..1).")
        self.step = g("rayslice_step_time_seconds", "Duration of the last step, per host.")
        self.rss = g("rayslice_process_memory_bytes", "Resident memory of the host process.")
        self.available = g(
            "rayslice_metric_source_available",
            "1 when a metric source works, 0 when it is absent.",
            ("slice", "worker_id", "run", "source"),
        )

    @classmethod
    def get(cls) -> _Gauges:
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance


def tpu_chip_usage() -> list[dict[str, float]] | None:
    """Per-chip memory and duty cycle from libtpu's metrics service (``tpu-info``), or None."""
    try:
        from tpu_info import device as tpu_device
        from tpu_info import metrics as tpu_metrics
    except ImportError:
        return None
    try:
        chip_type, _count = tpu_device.get_local_chips()
        if chip_type is None:
            return None
        usage = tpu_metrics.get_chip_usage(chip_type)
        return [
            {
                "memory_used": float(u.memory_usage),
                "memory_total": float(u.total_memory),
                "duty_cycle": float(u.duty_cycle_pct) / 100.0,
            }
            for u in usage
        ]
    except Exception as e:  # the service is down or the API changed: degrade, never fail
        _warn_once("tpu-info", str(e))
        return None


def jax_memory_stats() -> list[dict[str, float]] | None:
    """Per-device ``memory_stats()`` of this process's JAX devices, or None when JAX has none."""
    import jax

    out = []
    for d in jax.local_devices():
        stats = d.memory_stats()
        if not stats:
            return None
        out.append(
            {"memory_used": float(stats.get("bytes_in_use", 0)), "memory_total": float(stats.get("bytes_limit", 0))}
        )
    return out


class HostSampler:
    """Samples one host's accelerators every ``interval_s`` and records step times.

    Args:
        tags: ``slice``, ``worker_id`` and ``run`` (device is added per series).
        interval_s: Sampling period.
        clock: Monotonic clock (injectable).
    """

    def __init__(
        self, tags: Mapping[str, str], *, interval_s: float = 2.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.tags = {k: str(tags.get(k, "")) for k in ("slice", "worker_id", "run")}
        self.interval_s = interval_s
        self._clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Written by the step's thread only (record_step), read by the sampling thread: running totals,
        # not counters the reader resets, so neither side needs a lock on the step's path.
        self._busy_total_s = 0.0
        self._steps = 0
        self._last_step = 0.0
        self._busy_seen_s = 0.0  # the sampler's own marks of what it has exported
        self._steps_seen = 0
        self._window_start = clock()
        self._lock = threading.Lock()
        self.sources: dict[str, bool] = {}

    def _t(self, device: str) -> dict[str, str]:
        return {**self.tags, "device": device}

    def _source(self, name: str, ok: bool, why: str = "") -> None:
        if self.sources.get(name) != ok:
            self.sources[name] = ok
            _Gauges.get().available.set(1.0 if ok else 0.0, tags={**self.tags, "source": name})
            if not ok:
                _warn_once(name, why or "no data")

    def record_step(self, seconds: float) -> None:
        """One step took ``seconds`` on this host (feeds step time and the derived duty cycle).

        On the hot path: it only updates three numbers, without a lock (one
        thread reports steps); the sampling thread exports them, so a step
        never waits on the metrics pipeline.
        """
        self._last_step = seconds
        self._busy_total_s += max(0.0, seconds)
        self._steps += 1  # last: a reader that sees the new count also sees this step's time

    def sample(self) -> None:
        """Takes one sample now."""
        g = _Gauges.get()
        chips = tpu_chip_usage()
        self._source("tpu-info", chips is not None, "tpu-info not installed or libtpu metrics service unreachable")
        devices = chips if chips is not None else jax_memory_stats()
        self._source(
            "jax-memory-stats",
            chips is not None or devices is not None,
            "JAX exposes no memory_stats() on this backend",
        )
        for i, d in enumerate(devices or []):
            g.mem_used.set(d["memory_used"], tags=self._t(str(i)))
            g.mem_total.set(d["memory_total"], tags=self._t(str(i)))
            if "duty_cycle" in d:
                g.duty.set(d["duty_cycle"], tags=self._t(str(i)))
        now = self._clock()
        with self._lock:  # one sampler at a time (the thread, or a direct call)
            steps, total = self._steps, self._busy_total_s
            last = self._last_step if steps != self._steps_seen else None
            busy, self._busy_seen_s, self._steps_seen = total - self._busy_seen_s, total, steps
            span, self._window_start = now - self._window_start, now
        if last is not None:
            g.step.set(float(last), tags=self._t("host"))
        if chips is None and span > 0:
            # Derived duty cycle: the share of wall time this host spent in steps.
            g.duty.set(min(1.0, busy / span), tags=self._t("host"))
        try:
            import psutil

            g.rss.set(float(psutil.Process(os.getpid()).memory_info().rss), tags=self._t("host"))
        except Exception as e:
            _warn_once("process-memory", str(e))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sample()
            except Exception as e:  # never let sampling kill the process or the job
                _warn_once("sampler", str(e))

    def start(self) -> HostSampler:
        try:
            self.sample()
        except Exception as e:
            _warn_once("sampler", str(e))
        self._thread = threading.Thread(target=self._loop, name="rayslice-metrics", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


class GoodputExporter:
    """Exports a run's goodput components from the driver."""

    def __init__(self, run: str) -> None:
        from ray.util.metrics import Gauge

        self.run = run
        self.seconds = Gauge(
            "rayslice_goodput_seconds", "Wall time of a run by goodput component.", tag_keys=("run", "component")
        )
        self.fraction = Gauge("rayslice_goodput_fraction", "Productive share of a run's wall time.", tag_keys=("run",))

    def export(self, seconds: Mapping[str, float], fraction: float) -> None:
        try:
            for component, value in seconds.items():
                self.seconds.set(float(value), tags={"run": self.run, "component": component})
            self.fraction.set(float(fraction), tags={"run": self.run})
        except Exception as e:
            _warn_once("goodput", str(e))
