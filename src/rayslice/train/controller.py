"""The training controller: reserve, start the gang, watch, classify, restart.

``JaxTrainer.fit()`` runs in the driver, which never imports JAX. Each
attempt reserves whole slices, starts fresh gang processes (``jax.distributed``
cannot be initialised twice in one process), runs ``train_loop_per_worker`` on
every host, and watches rank 0's reports. When a host is lost the attempt is
torn down, the slices released, and a new attempt reserves again (possibly
other, intact slices) and resumes from the latest complete checkpoint. Errors
in user code and lost hosts have separate budgets.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from rich.console import Console

from rayslice.errors import Outcome, ReservationError, classify, describe
from rayslice.gang import SliceGang
from rayslice.placement import slice_placement_group
from rayslice.train.checkpoint import Checkpoint, latest_complete_step
from rayslice.train.config import RunConfig, ScalingConfig
from rayslice.train.goodput import Goodput, GoodputTracker
from rayslice.train.worker import TrainContext, drain_reports, run_worker

logger = logging.getLogger(__name__)
_POLL_S = 0.2


@dataclasses.dataclass
class Result:
    """What ``fit()`` returns."""

    metrics: dict[str, Any] | None
    metrics_history: list[dict[str, Any]]
    checkpoint: Checkpoint | None
    path: str
    error: BaseException | None
    goodput: Goodput
    attempts: int
    preemptions: int
    failures: int


def _budget_left(used: int, limit: int) -> bool:
    return limit < 0 or used <= limit


class JaxTrainer:
    """Runs ``train_loop_per_worker`` once per host of reserved slices, with restarts.

    Args:
        train_loop_per_worker: ``fn(config)`` (or ``fn()``), run on every host
            with ``jax.distributed`` up. Import JAX inside it.
        train_loop_config: Passed to the function.
        scaling_config: Slices to train on.
        run_config: Name, storage, checkpoints, failure budgets.
        datasets: Ray Datasets; each host gets ``get_dataset_shard(name)``, an
            equal, deterministic split (materialized once per ``fit``, in source
            order; at most ``world_size - 1`` rows are dropped to equalize), so
            a restart resumes the same rows from the iterator state in the
            checkpoint, and two runs over the same data see the same rows.

    Example:
        >>> trainer = JaxTrainer(loop, scaling_config=ScalingConfig(topology="2x2x2",
        ...                      accelerator_type="TPU-V4"))  # doctest: +SKIP
        >>> result = trainer.fit()  # doctest: +SKIP
    """

    def __init__(self, train_loop_per_worker: Callable[..., Any], *, train_loop_config: Any = None,
                 scaling_config: ScalingConfig, run_config: RunConfig | None = None,
                 datasets: Mapping[str, Any] | None = None, console: Console | None = None) -> None:
        if not callable(train_loop_per_worker):
            raise TypeError("train_loop_per_worker must be callable")
        self.train_fn = train_loop_per_worker
        self.config = train_loop_config
        self.scaling = scaling_config
        self.run_config = run_config or RunConfig()
        self.datasets = dict(datasets or {})
        self.console = console or Console(stderr=True)

    # -- public --------------------------------------------------------
    def fit(self) -> Result:
        """Trains until the loop returns on every host, or the budgets run out."""
        from rayslice.metrics import GoodputExporter

        rc = self.run_config
        tracker = GoodputTracker()
        self._exporter = GoodputExporter(rc.name)
        history: list[dict[str, Any]] = []
        materialized = {k: _materialize_in_order(ds) for k, ds in self.datasets.items()}
        attempt, preemptions, failures = 0, 0, 0
        error: BaseException | None = None
        status = self.console.status("starting") if rc.progress else None
        if status:
            status.start()
        try:
            while True:
                attempt += 1
                outcome, exc, unreported = self._attempt(attempt, tracker, history, materialized, status,
                                                         preemptions + failures)
                if outcome is Outcome.OK:
                    break
                restore = latest_complete_step(rc.checkpoint_path)
                tracker.on_failure(restore, unreported)
                if outcome is Outcome.PREEMPTED:
                    preemptions += 1
                    ok = _budget_left(preemptions, rc.failure_config.max_preemptions)
                else:
                    failures += 1
                    ok = outcome is not Outcome.CANCELLED and _budget_left(failures, rc.failure_config.max_failures)
                self._say(f"attempt {attempt}: {outcome.value}: {describe(exc)}"
                          + (f"; restarting from checkpoint {restore}" if ok else "; giving up"))
                if not ok:
                    error = exc
                    break
        except ReservationError as e:
            error = e
        finally:
            if status:
                status.stop()
        goodput = tracker.finish()
        self._exporter.export(goodput.seconds, goodput.fraction)
        step = latest_complete_step(rc.checkpoint_path)
        result = Result(
            metrics=history[-1]["metrics"] if history else None,
            metrics_history=[{"step": h["step"], **h["metrics"]} for h in history],
            checkpoint=None if step is None else Checkpoint(f"{rc.checkpoint_path}/{step}", step),
            path=rc.run_path, error=error, goodput=goodput, attempts=attempt,
            preemptions=preemptions, failures=failures,
        )
        if rc.progress:
            self.console.print(goodput.table())
        return result

    # -- one attempt -------------------------------------------------------
    def _attempt(self, attempt: int, tracker: GoodputTracker, history: list[dict[str, Any]],
                 datasets: Mapping[str, Any], status: Any, restarts: int) -> tuple[Outcome, BaseException | None, float]:
        sc, rc = self.scaling, self.run_config
        self._status(status, f"attempt {attempt}: reserving {sc.num_slices} x {sc.topology_info}")
        with tracker.timed("reservation"):
            spg = slice_placement_group(sc.topology, sc.accelerator_type, num_slices=sc.num_slices,
                                        chips_per_host=sc.chips_per_host, resources_per_host=sc.resources_per_host,
                                        timeout_s=sc.reservation_timeout_s, name=f"{rc.name}-{attempt}",
                                        progress=False)
        gang = SliceGang(spg, init_timeout_s=sc.init_timeout_s, actor_options={"max_concurrency": 2}, name=rc.name)
        last_report: float | None = None  # set once the loop runs: start-up time is "startup", not "lost"
        try:
            self._status(status, f"attempt {attempt}: starting {spg.num_hosts} host processes on "
                                 f"{', '.join(s.name for s in spg.slices)}")
            with tracker.timed("startup"):
                gang.start()
            splits = {k: ds.split(spg.num_hosts, equal=True) for k, ds in datasets.items()}
            info = {"checkpoint_dir": rc.checkpoint_path, "num_to_keep": rc.checkpoint_config.num_to_keep,
                    "async_save": rc.checkpoint_config.async_save,
                    "restore_step": latest_complete_step(rc.checkpoint_path)}
            refs = []
            for rank, (actor, hc) in enumerate(zip(gang.actors, gang.contexts)):
                ctx = TrainContext(world_rank=rank, world_size=len(gang.actors), slice_index=hc.slice_index,
                                   slice_name=hc.slice_name,
                                   num_slices=hc.num_slices, worker_id=hc.worker_id,
                                   hosts_per_slice=hc.hosts_per_slice, local_device_count=hc.devices_per_host,
                                   experiment_name=rc.name, run_path=rc.run_path, attempt=attempt)
                shards = {k: v[rank] for k, v in splits.items()}
                refs.append(actor.call.remote(run_worker, (self.train_fn, self.config, ctx, info, shards), {}))
            last_report = time.monotonic()
            return self._watch(gang, refs, tracker, history, status, attempt, restarts)
        except Exception as e:  # start-up or split failed: a value, like any other failure
            return classify(e), e, 0.0 if last_report is None else time.monotonic() - last_report
        finally:
            gang.shutdown()
            spg.release()

    def _watch(self, gang: SliceGang, refs: list[Any], tracker: GoodputTracker, history: list[dict[str, Any]],
               status: Any, attempt: int, restarts: int) -> tuple[Outcome, BaseException | None, float]:
        import ray

        pending = list(refs)
        last = time.monotonic()

        def drain(timeout: float) -> None:
            nonlocal last
            reports = ray.get(gang.actors[0].call.remote(drain_reports, (), {}), timeout=timeout)
            if not reports:
                return
            last = time.monotonic()
            tracker.on_reports(reports)
            history.extend(reports)
            snap = tracker.snapshot()
            self._exporter.export(snap.seconds, snap.fraction)
            for r in reports:
                for cb in self.run_config.callbacks:
                    cb({"step": r["step"], "metrics": r["metrics"], "attempt": attempt})
            latest = reports[-1]
            shown = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                              for k, v in list(latest["metrics"].items())[:4])
            self._status(status, f"step {latest['step']} | {shown} | attempt {attempt}, restarts {restarts}")

        def failed(e: BaseException) -> tuple[Outcome, BaseException, float]:
            outcome = classify(e)
            if outcome is not Outcome.PREEMPTED and gang.lost_hosts():
                # The error is the echo of a lost host (a collective broke
                # because its peer died): a preemption, not a bug.
                outcome = Outcome.PREEMPTED
            try:  # rank 0 may still hold reports of steps done before the failure
                drain(timeout=2.0)
            except Exception:
                pass
            return outcome, e, time.monotonic() - last

        while True:
            try:
                drain(timeout=30)
            except Exception as e:  # rank 0 gone: its host was lost
                return classify(e), e, time.monotonic() - last
            if not pending:
                return Outcome.OK, None, 0.0
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=_POLL_S)
            for ref in ready:
                try:
                    ray.get(ref)
                except Exception as e:
                    return failed(e)

    # -- output --------------------------------------------------------------
    def _status(self, status: Any, text: str) -> None:
        if status:
            status.update(text)

    def _say(self, text: str) -> None:
        if self.run_config.progress:
            self.console.print(text)
        else:
            logger.warning(text)


def _materialize_in_order(ds: Any) -> Any:
    # Source order, so that two runs over the same dataset (and every restart
    # of one run) give each host the same rows in the same order.
    ds.context.execution_options.preserve_order = True
    return ds.materialize()


