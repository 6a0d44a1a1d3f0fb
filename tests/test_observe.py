"""Metrics on Ray's real Prometheus endpoint, and JAX traces from every host, during a real run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from rayslice.metrics import HostSampler
from rayslice.train import JaxTrainer, RunConfig, ScalingConfig

from . import train_loops
from .conftest import SLICE_A, SLICE_B

pytestmark = [pytest.mark.ray, pytest.mark.slow]


class _Background:
    """A training run in a thread, stopped through a file (how the loop knows to end)."""

    def __init__(self, name: str, tmp_path, **config):
        self.stop_file = str(tmp_path / f"{name}.stop")
        self.stepping = threading.Event()  # set by the first report that reaches the driver
        self.trainer = JaxTrainer(
            train_loops.busy_loop,
            train_loop_config={"stop_file": self.stop_file, **config},
            scaling_config=ScalingConfig(topology="2x2x2", accelerator_type="TPU-V4"),
            run_config=RunConfig(
                name=name, storage_path=str(tmp_path), progress=False, callbacks=[lambda report: self.stepping.set()]
            ),
        )
        self.result = None
        self.thread = threading.Thread(target=self._run)

    def _run(self):
        self.result = self.trainer.fit()

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        open(self.stop_file, "w").close()
        self.thread.join(timeout=120)
        assert not self.thread.is_alive()
        assert self.result.error is None, self.result.error


def _scrape() -> str:
    import ray

    texts = []
    for n in ray.nodes():
        if n["Alive"] and n.get("MetricsExportPort"):
            try:
                texts.append(requests.get(f"http://127.0.0.1:{n['MetricsExportPort']}/metrics", timeout=5).text)
            except requests.RequestException:
                continue
    return "\n".join(texts)


def _series(text: str, name: str) -> list[dict[str, str]]:
    out = []
    for line in text.splitlines():
        if line.startswith(f"ray_{name}{{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("{", 1)[1].rsplit("}", 1)[0]))
            labels["_value"] = line.rsplit(" ", 1)[1]
            out.append(labels)
    return out


def test_prometheus_endpoint_has_rayslice_series_with_tags(ray_cluster, tmp_path):
    with _Background("observed", tmp_path):
        deadline = time.monotonic() + 60
        found: dict[str, list] = {}
        wanted = (
            "rayslice_step_time_seconds",
            "rayslice_duty_cycle",
            "rayslice_process_memory_bytes",
            "rayslice_goodput_seconds",
            "rayslice_metric_source_available",
        )
        while time.monotonic() < deadline:
            text = _scrape()
            found = {w: _series(text, w) for w in wanted}
            mine = [s for s in found["rayslice_step_time_seconds"] if s.get("run") == "observed"]
            if {s.get("worker_id") for s in mine} == {"0", "1"} and found["rayslice_goodput_seconds"]:
                break
            time.sleep(1)
    steps = [s for s in found["rayslice_step_time_seconds"] if s.get("run") == "observed"]
    assert {s["worker_id"] for s in steps} == {"0", "1"}
    assert {s["slice"] for s in steps} <= {SLICE_A, SLICE_B} and len({s["slice"] for s in steps}) == 1
    assert all(s["device"] == "host" and float(s["_value"]) > 0 for s in steps)
    duty = [s for s in found["rayslice_duty_cycle"] if s.get("run") == "observed"]
    assert duty and all(0 <= float(s["_value"]) <= 1 for s in duty)
    assert any(s.get("run") == "observed" for s in found["rayslice_process_memory_bytes"])
    components = {s["component"] for s in found["rayslice_goodput_seconds"] if s.get("run") == "observed"}
    assert {"startup", "compile", "productive"} <= components
    # On CPU, JAX exposes no device memory stats: reported as unavailable, not an error.
    sources = {
        (s["source"], s["_value"]) for s in found["rayslice_metric_source_available"] if s.get("run") == "observed"
    }
    assert ("tpu-info", "0.0") in sources


def test_profile_writes_a_trace_for_every_host(ray_cluster, tmp_path):
    with _Background("profiled", tmp_path, profiler_server=True) as bg:
        assert bg.stepping.wait(timeout=90), "the run never reported a step"
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "rayslice.cli",
                "profile",
                "profiled",
                "--seconds",
                "1",
                "--address",
                ray_cluster.address,
            ],
            capture_output=True,
            text=True,
            timeout=180,
        )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "-host-0:" in out.stdout and "-host-1:" in out.stdout
    root = tmp_path / "profiled" / "profiles"
    (stamp,) = os.listdir(root)
    hosts = sorted(os.listdir(root / stamp))
    assert [h.rsplit("-", 1)[1] for h in hosts] == ["0", "1"] and len({h.split("-")[0] for h in hosts}) == 1
    for host in hosts:
        files = [f for _, _, fs in os.walk(root / stamp / host) for f in fs]
        assert any(f.endswith(".xplane.pb") for f in files), files
    assert bg.result.error is None


def test_profile_of_an_unknown_job_is_a_clear_error(ray_cluster):
    out = subprocess.run(
        [sys.executable, "-m", "rayslice.cli", "profile", "nope", "--address", ray_cluster.address],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1 and "error: no running gang named 'nope'" in out.stderr


def test_sampler_without_sources_degrades_quietly(monkeypatch):
    import rayslice.metrics as m

    set_calls = []

    class FakeGauge:
        def __init__(self, *a, **k):
            pass

        def set(self, value, tags=None):
            set_calls.append((value, dict(tags)))

    monkeypatch.setattr("ray.util.metrics.Gauge", FakeGauge)
    monkeypatch.setattr(m._Gauges, "_instance", None)
    monkeypatch.setattr(m, "tpu_chip_usage", lambda: None)
    monkeypatch.setattr(m, "jax_memory_stats", lambda: None)
    t = iter([0.0, 10.0, 20.0, 30.0])
    s = HostSampler({"slice": "s", "worker_id": "0", "run": "r"}, clock=lambda: next(t))
    s.record_step(4.0)
    s.sample()  # 4 s busy of 10 s
    assert s.sources == {"tpu-info": False, "jax-memory-stats": False}
    host = {"slice": "s", "worker_id": "0", "run": "r", "device": "host"}
    assert (0.4, host) in set_calls and (4.0, host) in set_calls
    # Each window exports only its own steps: the last step's time, and busy time / window.
    s.record_step(1.0)
    s.record_step(2.0)
    set_calls.clear()
    s.sample()  # 3 s busy of 10 s
    assert [v for v, tags in set_calls if tags == host][:2] == [2.0, 0.3]  # then the process's memory
    set_calls.clear()
    s.sample()  # no step: no step time, duty 0
    assert [v for v, tags in set_calls if tags == host][:1] == [0.0]
    monkeypatch.setattr(m._Gauges, "_instance", None)


def test_grafana_dashboard_queries_the_exported_series():
    import json

    from rayslice import metrics

    path = os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "observability", "grafana-dashboard.json"
    )
    dash = json.loads(Path(path).read_text())
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p["targets"])
    names = set(re.findall(r'"(rayslice_[a-z_]+)"', Path(metrics.__file__).read_text()))
    assert names and all(f"ray_{n}" in exprs for n in names), names - set(re.findall(r"ray_(rayslice_[a-z_]+)", exprs))
    assert {v["name"] for v in dash["templating"]["list"]} == {"datasource", "run", "slice"}
