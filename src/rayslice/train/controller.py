"""The training controller: reserve, start the gang, watch, classify, restart.

``JaxTrainer.fit()`` runs in the driver, which never imports JAX. Each
attempt reserves whole slices (the :class:`~rayslice.request.SliceRequest`
built once by :class:`ScalingConfig`), starts fresh gang processes
(``jax.distributed`` cannot be initialised twice in one process), runs
``train_loop_per_worker`` on every host, and watches every host's reports.
When a host is lost the attempt is torn down, the slices released, and a new
attempt reserves again (possibly other, intact slices) and resumes from the
latest complete checkpoint. Errors in user code and lost hosts have separate
budgets. Each attempt ends as a :class:`~rayslice.errors.RunOutcome` value.

Given a reservation the caller already holds (``tpu_slice=``), the trainer
runs on it and neither reserves nor releases it. Restarts after an error in
user code run on the same slice; a lost host ends ``fit()`` with a
:class:`~rayslice.errors.GangError` (outcome ``PREEMPTED``) saying so, since
the trainer does not reserve behind the caller's back.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

from rich.console import Console

from rayslice._deadline import Deadline
from rayslice._validate import check_callable, check_instance, fail
from rayslice.errors import GangError, Outcome, ReservationError, ReservationTimeout, RunOutcome, describe
from rayslice.gang import SliceGang
from rayslice.placement import SlicePlacementGroup, slice_placement_group
from rayslice.train.checkpoint import (
    Checkpoint,
    checkpoint_steps,
    checkpoints_dir,
    commit_pending,
    discard_pending,
    latest_complete_step,
    prune_directories,
    step_dir,
)
from rayslice.train.config import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from rayslice.train.context import TrainContext
from rayslice.train.elastic import GROW_REASON, ElasticRun, request_grow
from rayslice.train.goodput import AttemptEnd, GoodputTracker
from rayslice.train.heartbeat import (
    HeartbeatMonitor,
    Verdict,
    delete_beats,
    heartbeat_key,
    period_for,
    read_beats,
)
from rayslice.train.liveness import NodeProbe, raylet_addresses
from rayslice.train.ramtier import RamTier, RestoreChoice
from rayslice.train.result import Result, TrainRunContext
from rayslice.train.worker import drain_reports, run_worker
from rayslice.warm import WarmPool, spare_hosts

logger = logging.getLogger(__name__)
_POLL_S = 0.2
_QUICK_POLL_S = 0.05  # the driver's poll while a host's heartbeat is overdue
#: The goodput gauges and the live status line are refreshed at most this often while steps flow.
_SHOW_EVERY_S = 0.5
# What a warm spare process imports ahead of an attempt: JAX, Orbax (restores), the worker side and what
# it starts (metrics, notices, the RAM tier, the feeder); and, where installed, the usual JAX training libraries.
_WARM_IMPORTS = (
    "jax",
    "orbax.checkpoint",
    "rayslice.train.worker",
    "rayslice.metrics",
    "rayslice.train.notice",
    "rayslice.train.ramtier",
    "rayslice.data",
)
_WARM_OPTIONAL = ("flax.linen", "optax")
_WARM_DATA = ("ray.data",)  # what a host needs to unpickle its Ray Data shards
_WARM_REFRESH_S = 5.0  # how often a running attempt looks for new spare hosts to warm
_ELASTIC_TRY_S = 10.0  # how long an elastic reservation waits for the size it counted before counting again
_GROW_WARM_WAIT_S = 30.0  # the longest an elastic grow waits for warm processes on the new hosts


class _CallbackFailed(Exception):
    def __init__(self, error: BaseException) -> None:
        super().__init__(describe(error))
        self.error = error


def _budget_left(used: int, limit: int) -> bool:
    return limit < 0 or used <= limit


def fresh_run_name() -> str:
    """A new unique run name: ``rayslice_run-<UTC time>-<6 hex>``."""
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d_%H-%M-%S")
    return f"rayslice_run-{stamp}-{uuid.uuid4().hex[:6]}"


class JaxTrainer:
    """Runs ``train_loop_per_worker`` once per host of reserved slices, with restarts.

    Args:
        train_loop_per_worker: ``fn(config)`` (or ``fn()``), run on every host
            with ``jax.distributed`` up. Import JAX inside it.
        train_loop_config: Passed to the function.
        scaling_config: Slices to train on (optional with ``tpu_slice``).
        run_config: Name, storage, checkpoints, failure budgets, callbacks.
        datasets: Ray Datasets (or functions returning one); each host gets
            ``get_dataset_shard(name)``, an equal, deterministic split
            (materialized once per ``fit``, in source order; at most
            ``world_size - 1`` rows are dropped to equalize), so a restart
            resumes the same rows from the iterator state in the checkpoint,
            and two runs over the same data see the same rows.
        tpu_slice: A :class:`~rayslice.placement.SlicePlacementGroup` the
            caller holds: train on it, never reserve or release it.
        console: Where progress goes (default: stderr).

    Example:
        >>> trainer = JaxTrainer(loop, scaling_config=ScalingConfig(topology="2x2x2",
        ...                      accelerator_type="TPU-V4"))  # doctest: +SKIP
        >>> result = trainer.fit()  # doctest: +SKIP
    """

    def __init__(
        self,
        train_loop_per_worker: Callable[..., Any],
        *,
        train_loop_config: Any = None,
        scaling_config: ScalingConfig | None = None,
        run_config: RunConfig | None = None,
        datasets: Mapping[str, Any] | None = None,
        tpu_slice: SlicePlacementGroup | None = None,
        console: Console | None = None,
    ) -> None:
        self.train_fn = check_callable("train_loop_per_worker", train_loop_per_worker)
        self.config = train_loop_config
        if tpu_slice is not None:
            check_instance("tpu_slice", tpu_slice, SlicePlacementGroup, "a rayslice SlicePlacementGroup (held)")
        if scaling_config is None:
            if tpu_slice is None:
                raise fail(
                    "scaling_config",
                    None,
                    "a rayslice.train.ScalingConfig(topology=..., accelerator_type=...)"
                    " (or pass tpu_slice=<a held SlicePlacementGroup>)",
                )
            scaling_config = ScalingConfig(topology=tpu_slice.request)
        check_instance(
            "scaling_config",
            scaling_config,
            ScalingConfig,
            "a rayslice.train.ScalingConfig(topology=..., accelerator_type=...)",
        )
        if tpu_slice is not None:
            held, wanted = tpu_slice.request, scaling_config.request
            if held.topology != wanted.topology or held.num_slices != wanted.num_slices:
                raise fail(
                    "tpu_slice",
                    f"<SlicePlacementGroup {held}>",
                    f"a reservation of {wanted} (what scaling_config asks for)",
                )
            if scaling_config.elastic:
                raise fail(
                    "tpu_slice",
                    f"<SlicePlacementGroup {held}>",
                    "None for an elastic run (min_slices < "
                    "num_slices): it reserves and gives back slices as they come and go",
                )
        self.run_config = check_instance(
            "run_config",
            RunConfig() if run_config is None else run_config,
            RunConfig,
            "a rayslice.train.RunConfig or None",
        )
        if datasets is not None and not isinstance(datasets, Mapping):
            raise fail("datasets", datasets, "a dict of name -> Ray Dataset", got_type=True)
        for key, ds in (datasets or {}).items():
            if not isinstance(key, str) or not key:
                raise fail("datasets", datasets, "dataset names as non-empty strings")
            if not (hasattr(ds, "materialize") or callable(ds)):
                raise fail(f"datasets[{key!r}]", ds, "a Ray Dataset (or a function returning one)", got_type=True)
        if console is not None:
            check_instance("console", console, Console, "a rich.console.Console or None")
        self.scaling = scaling_config
        self.tpu_slice = tpu_slice
        # RunConfig normalized these on construction (None -> defaults).
        self._fc = cast(FailureConfig, self.run_config.failure_config)
        self._cc = cast(CheckpointConfig, self.run_config.checkpoint_config)
        self._callbacks = cast(tuple[Any, ...], self.run_config.callbacks)
        self.datasets = dict(datasets or {})
        self.console = console or Console(stderr=True)

    # -- public --------------------------------------------------------
    def fit(self) -> Result:
        """Trains until the loop returns on every host, or the budgets run out.

        Each call without ``RunConfig(name=...)`` is a fresh run under a new
        name; with a name, a run that already has checkpoints there resumes
        from the latest one.
        """
        from rayslice.metrics import GoodputExporter

        rc = self.run_config
        name = rc.name or fresh_run_name()
        path = rc.run_path_for(name)
        self._root = checkpoints_dir(path)
        self._run = TrainRunContext(uuid.uuid4().hex, name, path, rc, self.scaling, self.config)
        tracker = GoodputTracker()
        self._exporter = GoodputExporter(name)
        history: list[dict[str, Any]] = []
        materialized = {
            k: _materialize_in_order(ds() if not hasattr(ds, "materialize") else ds) for k, ds in self.datasets.items()
        }
        attempt, preemptions, failures = 0, 0, 0
        error: BaseException | None = None
        self._return_value = None
        self._avoid: set[str] = set()  # slices with a host that just stopped answering
        # Slices avoided only because a process of theirs died or went silent (their hosts may be up).
        self._suspect: set[str] = set()
        self._silent_nodes: set[str] = set()  # nodes of the hosts whose heartbeats stopped, among the suspects
        self._hosts: dict[str, list[str]] = {}  # the last attempt's slices -> their hosts' nodes
        self._warm: WarmPool | None = None  # pre-started processes on spare hosts (FailureConfig.warm_spares)
        self._grow_wait_since: float | None = None  # an elastic grow waiting for warm processes, since
        self._detection_s = 0.0
        self._elastic = ElasticRun(self.scaling, path, self._say) if self.scaling.elastic else None
        # The RAM tier (CheckpointConfig.ram_every_steps): its stores live for the whole fit().
        every = self._cc.ram_every_steps
        self._ram = RamTier(self._run.run_id, every) if every else None
        self._restores: list[RestoreChoice] = []
        self._next_restore: RestoreChoice | None = None  # chosen when an attempt failed (None: choose at start)
        self._lost_nodes: set[str] = set()  # nodes of hosts found lost: their RAM stores are gone
        status = self.console.status("starting") if rc.progress else None
        if status:
            status.start()
        try:
            while True:
                attempt += 1
                self._detection_s = 0.0
                self._notice: dict[str, Any] | None = None
                tracker.begin_attempt()
                out = self._attempt(attempt, tracker, history, materialized, status, preemptions + failures)
                notice = self._notice
                if notice is not None:
                    tracker.end_attempt(
                        AttemptEnd(
                            attempt,
                            out.outcome.value,
                            "notice",
                            step=notice["step"],
                            emergency_save_s=notice["save_s"],
                            notice=notice.get("reason"),
                        )
                    )
                else:
                    reason = "" if out.ok else ("lost" if out.outcome is Outcome.PREEMPTED else "error")
                    tracker.end_attempt(AttemptEnd(attempt, out.outcome.value, reason))
                if out.ok:
                    break
                if self._elastic is not None:  # why the next attempt may take another size
                    grow = notice is not None and notice.get("reason") == GROW_REASON
                    self._elastic.reason = "grow" if grow else "lost" if out.outcome is Outcome.PREEMPTED else "restart"
                    if grow and notice is not None:  # a clean stop at a saved step, not a failure
                        self._say(f"attempt {attempt}: saved step {notice['step']}; growing back onto free slices")
                        continue
                if self._elastic is not None:  # before the restore choice and the count of free slices
                    self._confirm_hosts()
                self._next_restore = choice = self._choose_restore(attempt + 1)
                restore = choice.step
                tracker.on_failure(restore, out.lost_s, self._detection_s)
                self._after_exception(out)
                if out.outcome is Outcome.PREEMPTED:
                    preemptions += 1
                    ok = _budget_left(preemptions, cast(int, self._fc.max_preemptions))
                    if ok and self.tpu_slice is not None:
                        error = GangError(
                            f"a host of the held slice {self.tpu_slice.name!r} was lost "
                            f"({out.message}); JaxTrainer(tpu_slice=...) never reserves another "
                            "slice: reserve again and fit() with the new one, or omit tpu_slice "
                            "so the trainer reserves and restarts by itself",
                            Outcome.PREEMPTED,
                            rank=out.rank,
                        )
                        error.__cause__ = out.error
                        self._say(f"attempt {attempt}: preempted: {out.message}; giving up (held slice)")
                        break
                else:
                    failures += 1
                    ok = out.outcome is not Outcome.CANCELLED and _budget_left(failures, self._fc.max_failures)
                self._say(
                    f"attempt {attempt}: {out.outcome.value}: {out.message}"
                    + (f"; restarting from {_from(choice)}" if ok else "; giving up")
                )
                if not ok:
                    error = out.error
                    break
        except ReservationError as e:
            error = e
        except _CallbackFailed as e:
            error = e.error
            self._say(f"a callback failed, stopping the run: {describe(e.error)}")
        finally:
            if status:
                status.stop()
            if self._warm is not None:
                self._warm.shutdown()
            if self._ram is not None:
                self._ram.close()
            discard_pending(self._root)
        if self._elastic is not None:  # every resize is an event in the goodput too
            tracker.resizes = list(self._elastic.resizes)
        goodput = tracker.finish()
        self._exporter.export(goodput.seconds, goodput.fraction)
        step = latest_complete_step(self._root)
        result = Result(
            metrics=history[-1]["metrics"] if history else None,
            metrics_history=[{"step": h["step"], **h["metrics"]} for h in history],
            checkpoint=None if step is None else Checkpoint(step_dir(self._root, step), step),
            path=path,
            error=error,
            goodput=goodput,
            attempts=attempt,
            preemptions=preemptions,
            failures=failures,
            name=name,
            return_value=self._return_value if error is None else None,
            best_checkpoints=_scored_checkpoints(self._root),
            resizes=list(self._elastic.resizes) if self._elastic is not None else [],
            restores=list(self._restores),
            ram_tier_bytes=self._ram.peak_bytes if self._ram is not None else 0,
        )
        if rc.progress:
            self.console.print(goodput.table())
        return result

    # -- one attempt -------------------------------------------------------
    def _attempt(
        self,
        attempt: int,
        tracker: GoodputTracker,
        history: list[dict[str, Any]],
        datasets: Mapping[str, Any],
        status: Any,
        restarts: int,
    ) -> RunOutcome:
        sc, rc, run = self.scaling, self.run_config, self._run
        t0 = time.monotonic()
        discard_pending(self._root)
        if self.tpu_slice is not None:
            spg = self.tpu_slice
        else:
            self._status(status, f"attempt {attempt}: reserving {sc.request}")
            with tracker.timed("reservation"):
                spg = self._reserve(f"{run.name}-{attempt}")
            self._avoid, self._suspect, self._silent_nodes = set(), set(), set()
        options: dict[str, Any] = {"max_concurrency": 2}
        if rc.worker_runtime_env:
            options["runtime_env"] = dict(rc.worker_runtime_env)
        if self._fc.warm_spares and self._warm is None:
            # With Ray Data input, each attempt's first call brings the hosts their dataset shards:
            # unpickling them imports ray.data (and pyarrow), 1-2 s on a busy host. Warm processes
            # take that import before they are needed, so a restart does not wait for it.
            imports = _WARM_IMPORTS + (_WARM_DATA if self.datasets else ())
            self._warm = WarmPool(imports, options, optional_imports=_WARM_OPTIONAL)
        gang = SliceGang(
            spg,
            init_timeout_s=sc.init_timeout_s,
            actor_options=options,
            name=run.name,
            artifacts_dir=run.path,
            warm=self._warm,
        )
        last_report: float | None = None  # set once the loop runs: start-up time is "startup", not "lost"
        keys = [heartbeat_key(run.run_id, attempt, rank) for rank in range(spg.num_hosts)]
        try:
            self._status(
                status,
                f"attempt {attempt}: starting {spg.num_hosts} host processes on "
                f"{', '.join(s.name for s in spg.slices)}",
            )
            with tracker.timed("startup"):
                gang.start()
            ram_info = self._begin_restore(attempt, gang, tracker, status)
            restore_step = self._restores[-1].step if self._restores else None
            ram_meta = self._ram.meta(self._restores[-1]) if self._ram is not None and self._restores else None
            el = self._elastic and self._elastic.begin(restore_step, spg, datasets, self._root, ram_meta)
            splits = el.shards if el else {k: ds.split(spg.num_hosts, equal=True) for k, ds in datasets.items()}
            cc = self._cc
            info: dict[str, Any] = {
                "checkpoint_dir": self._root,
                "num_to_keep": cc.num_to_keep,
                "async_save": cc.async_save,
                "score_attribute": cc.checkpoint_score_attribute,
                "score_order": cc.checkpoint_score_order,
                "restore_step": restore_step,
                "restore": self._restore_info(),
                "ram_every_steps": cc.ram_every_steps,
                "storage_every_steps": cc.storage_every_steps,
                "compilation_cache": rc.compilation_cache_dir(run.path),
            }
            fc = self._fc
            info["notices"] = {"poll_s": fc.notice_poll_s} if fc.preemption_notices else None
            period = period_for(fc.heartbeat_timeout_s)
            refs = []
            for rank, (actor, hc) in enumerate(zip(gang.actors, gang.contexts)):
                ctx = TrainContext(
                    world_rank=rank,
                    world_size=len(gang.actors),
                    slice_index=hc.slice_index,
                    slice_name=hc.slice_name,
                    num_slices=hc.num_slices,
                    worker_id=hc.worker_id,
                    hosts_per_slice=hc.hosts_per_slice,
                    local_device_count=hc.devices_per_host,
                    experiment_name=run.name,
                    run_path=run.path,
                    attempt=attempt,
                    run_id=run.run_id,
                    **(el.context if el else {}),
                )
                shards = {k: v[rank] for k, v in splits.items()}
                host_info = {**info, "heartbeat": {"key": keys[rank], "period_s": period}}
                host_info["ram"] = ram_info[rank] if ram_info else None
                refs.append(actor.call.remote(run_worker, (self.train_fn, self.config, ctx, host_info, shards), {}))
            last_report = time.monotonic()
            # A host silent past the timeout is lost unless its machine still answers (a busy process).
            nodes = [c.node_id for c in gang.contexts]
            probe = NodeProbe(raylet_addresses(nodes))  # read now, not when the GCS may be in trouble

            def answering(ranks: Sequence[int]) -> set[int]:
                up = probe.answering(nodes[r] for r in ranks)
                return {r for r in ranks if nodes[r] in up}

            monitor = HeartbeatMonitor(
                len(refs),
                fc.heartbeat_timeout_s,
                fc.step_timeout_s,
                start_step=info["restore_step"] or 0,
                reachable=answering,
            )
            return self._watch(gang, refs, tracker, history, status, attempt, restarts, t0, monitor, keys)
        except _CallbackFailed:
            raise
        except Exception as e:  # start-up or split failed: a value, like any other failure
            lost = 0.0 if last_report is None else time.monotonic() - last_report
            return RunOutcome.of(e, elapsed_s=time.monotonic() - t0, lost_s=lost)
        finally:
            gang.shutdown()
            if self.tpu_slice is None:
                spg.release()
            delete_beats(keys)

    def _watch(
        self,
        gang: SliceGang,
        refs: list[Any],
        tracker: GoodputTracker,
        history: list[dict[str, Any]],
        status: Any,
        attempt: int,
        restarts: int,
        t0: float,
        monitor: HeartbeatMonitor,
        keys: list[str],
    ) -> RunOutcome:
        import ray

        pending = dict(enumerate(refs))
        el = self._elastic
        last = time.monotonic()
        warm_next = last
        world = len(gang.actors)
        fc = self._fc
        # Reports per step from every rank, until every rank has reported the step.
        steps: dict[int, dict[int, dict[str, Any]]] = {}
        # One drain call in flight per rank: a host that does not answer (dead,
        # and not yet declared dead by Ray) never blocks the others' reports.
        draining: dict[int, Any] = {}
        died: list[int] = []  # ranks whose drain call found their process dead
        # Hosts that stopped after the emergency save of a preemption notice.
        noticed: dict[int, dict[str, Any]] = {}
        shown_next = 0.0  # when the goodput gauges and the status line are next refreshed

        def where(rank: int) -> str:
            hc = gang.contexts[rank]
            return f"host rank {rank} ({hc.slice_name} worker {hc.worker_id})"

        def complete(step: int, by_rank: dict[int, dict[str, Any]]) -> None:
            kinds = {r["checkpoint"] for r in by_rank.values()} - {None}
            rank0 = by_rank[0]
            ckpt = None
            if "directory" in kinds:
                ckpt = commit_pending(
                    self._root,
                    step,
                    attempt,
                    {"step": step, "metrics": rank0["metrics"], "world_size": world, "attempt": attempt},
                )
                cc = self._cc
                prune_directories(self._root, cc.num_to_keep, cc.checkpoint_score_attribute, cc.checkpoint_score_order)
            elif "arrays" in kinds:
                ckpt = Checkpoint(step_dir(self._root, step), step)  # may still be being written (async save)
            per_rank = [by_rank[r]["metrics"] for r in range(world)]
            for cb in self._callbacks:
                try:
                    if callable(getattr(cb, "after_report", None)):
                        cb.after_report(self._run, per_rank, ckpt)
                    elif callable(cb) and not hasattr(cb, "after_exception"):
                        cb({"step": step, "metrics": rank0["metrics"], "attempt": attempt})
                except Exception as e:
                    raise _CallbackFailed(e) from e

        def drain(timeout: float, skip: frozenset[int] = frozenset()) -> None:
            nonlocal last, shown_next
            for rank, a in enumerate(gang.actors):
                if rank not in draining and rank not in skip:
                    draining[rank] = a.call.remote(drain_reports, (), {})
            waiting = [ref for rank, ref in draining.items() if rank not in skip]
            ready, _ = ray.wait(waiting, num_returns=len(waiting), timeout=timeout)
            got: dict[int, list[dict[str, Any]]] = {}
            error: BaseException | None = None
            for rank, ref in sorted(draining.items()):
                if ref in ready:
                    del draining[rank]
                    try:
                        got[rank] = ray.get(ref)
                    except Exception as e:  # the host died (Ray noticed it): raised once the others are booked
                        error = error or e
                        if isinstance(e, ray.exceptions.RayActorError):  # its process gone, maybe its host
                            suspect(rank)
                            died.append(rank)
            for rank, reports in got.items():
                for r in reports:
                    steps.setdefault(r["step"], {})[rank] = r
                    if self._ram is not None:
                        self._ram.observe(attempt, rank, r)
                    if rank == 0 and r.get("restore_s"):
                        self._restore_seconds(attempt, r["restore_s"])
            rank0 = got.get(0)
            if rank0:
                last = time.monotonic()
                if self._elastic is not None:
                    self._elastic.on_step()
                tracker.on_reports(rank0)
                history.extend(rank0)
                if last >= shown_next:  # the gauges and the status line, a few times a second at most
                    shown_next = last + _SHOW_EVERY_S
                    snap = tracker.snapshot()
                    self._exporter.export(snap.seconds, snap.fraction)
                    if status:
                        latest = rank0[-1]
                        shown = ", ".join(
                            f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                            for k, v in list(latest["metrics"].items())[:4]
                        )
                        size = (
                            f"{world // gang.contexts[0].hosts_per_slice}/{self.scaling.num_slices} slices, "
                            if el
                            else ""
                        )
                        self._status(
                            status, f"step {latest['step']} | {shown} | {size}attempt {attempt}, restarts {restarts}"
                        )
            for step in sorted(s for s in steps if len(steps[s]) == world):
                complete(step, steps.pop(step))
            if error is not None:
                raise error

        self._hosts = {}
        for hc in gang.contexts:
            self._hosts.setdefault(hc.slice_name, []).append(hc.node_id)

        def suspect(rank: int, silent: bool = False) -> None:
            # Reserve elsewhere if possible; an elastic run checks before it counts (see _confirm_hosts).
            name = gang.contexts[rank].slice_name
            self._avoid.add(name)
            self._suspect.add(name)
            if silent:
                self._silent_nodes.add(gang.contexts[rank].node_id)

        def quietest() -> float:
            # How long the quietest host still running has been silent (driver clock).
            return max((monitor.silent_s(r) for r in range(world) if r not in monitor.finished), default=0.0)

        def silent(ranks: Sequence[int] = ()) -> float:
            # The detection delay of a loss Ray reported: how long the hosts whose processes died
            # (``ranks``, when known) had been silent, i.e. since their last sign of life; else how
            # long the quietest host had been, counted only beyond a normal gap between beats.
            # Read first, so that hosts still alive count as fresh even if the driver was busy
            # (e.g. in a callback) and stale records are not taken for silence.
            try:
                monitor.observe(read_beats(keys))
            except Exception:
                pass
            if ranks:
                return max(monitor.silent_s(r) for r in ranks)
            quiet = quietest()
            return quiet if quiet > 2 * period_for(fc.heartbeat_timeout_s) else 0.0

        def salvage(skip: frozenset[int]) -> None:
            try:  # hosts may still hold reports of steps done before the failure
                drain(timeout=2.0, skip=skip)
            except _CallbackFailed:
                raise
            except Exception:
                pass

        def failed(e: BaseException, rank: int | None) -> RunOutcome:
            outcome = RunOutcome.of(e).outcome
            # A process Ray reported dead: its silence is the detection delay (another error: none).
            self._detection_s = silent([rank] if outcome is Outcome.PREEMPTED and rank is not None else [])
            if outcome is not Outcome.PREEMPTED:
                # The error may be the echo of a lost host (a collective broke
                # because its peer died): a preemption, not a bug. The
                # heartbeats tell within heartbeat_timeout_s; a ping confirms.
                timeout = fc.heartbeat_timeout_s
                until = time.monotonic() + timeout + 2 * period_for(timeout)
                while time.monotonic() < until:
                    try:
                        monitor.observe(read_beats(keys))
                    except Exception:
                        break
                    verdict = monitor.check(probe=False)  # a peer's error is evidence enough: silence decides
                    if verdict is not None and verdict.kind == "lost":
                        out = detected(verdict)
                        if out.error is not None:
                            out.error.__cause__ = e
                        return out
                    time.sleep(_QUICK_POLL_S)
                lost_ranks = gang.lost_hosts(timeout_s=1.0)
                self._lost_nodes.update(gang.contexts[r].node_id for r in lost_ranks)
                if lost_ranks:
                    outcome = Outcome.PREEMPTED
                    self._detection_s = silent(lost_ranks)
                    # Ray may list the node as alive for a while yet: reserve elsewhere if possible.
                    self._avoid |= {gang.contexts[r].slice_name for r in lost_ranks}
            elif rank is not None and 0 <= rank < len(gang.contexts):  # Ray saw the process die, maybe its host
                # Reserve elsewhere if possible. Its node is not taken for lost: a process also dies alone (a
                # collective aborted by a peer's loss), and its node's RAM store may hold the replicas needed.
                suspect(rank)
            salvage(frozenset())
            return RunOutcome(
                outcome,
                e,
                time.monotonic() - t0,
                time.monotonic() - last,
                rank if rank is not None else getattr(e, "rank", None),
            )

        def detected(verdict: Verdict) -> RunOutcome:
            message = verdict.message(fc.heartbeat_timeout_s, fc.step_timeout_s, where)
            if verdict.kind == "lost":
                outcome = Outcome.PREEMPTED
                self._detection_s = verdict.silent_s
                if self._elastic is not None and self._ram is not None:
                    # A silent process, maybe a lost host: the hosts' RAM stores tell before the count.
                    self._avoid = set()
                    for r in verdict.ranks:
                        suspect(r, silent=True)
                else:
                    # Their RAM stores went with them, unless their machine answered (a stuck process: keep them).
                    gone = [r for r in verdict.ranks if r not in verdict.answering]
                    self._lost_nodes.update(gang.contexts[r].node_id for r in gone)
                    # Ray may list the node as alive for a while yet: reserve elsewhere if possible.
                    self._avoid = {gang.contexts[r].slice_name for r in verdict.ranks}
            else:
                outcome = Outcome.TIMEOUT
                self._detection_s = max(0.0, verdict.silent_s - cast(float, fc.step_timeout_s))
            error = GangError(message, outcome, rank=verdict.ranks[0])
            salvage(frozenset(verdict.ranks) if verdict.kind == "lost" else frozenset())
            return RunOutcome(outcome, error, time.monotonic() - t0, time.monotonic() - last, verdict.ranks[0])

        poll = _POLL_S
        period = period_for(fc.heartbeat_timeout_s)
        told_busy: set[int] = set()  # the hosts spared for a busy process, said once
        while True:
            try:
                drain(timeout=min(0.1, poll))
            except _CallbackFailed:
                raise
            except Exception as e:  # a host gone: it was lost
                self._detection_s = silent(died)
                return RunOutcome.of(e, elapsed_s=time.monotonic() - t0, lost_s=time.monotonic() - last)
            ready, _ = ray.wait(list(pending.values()), num_returns=len(pending), timeout=poll)
            for rank, ref in list(pending.items()):
                if ref not in ready:
                    continue
                del pending[rank]
                monitor.finish(rank)
                try:
                    out = ray.get(ref)
                except Exception as e:
                    return failed(e, rank)
                if out.get("notice"):
                    noticed[rank] = out["notice"]
                elif rank == 0:
                    self._return_value = out.get("return_value")
            if not pending:
                try:  # every host returned: collect the last reports
                    drain(timeout=30)  # calls in flight from before (they may have missed the last ones)
                    drain(timeout=30)  # fresh calls, made after every host returned
                except _CallbackFailed:
                    raise
                except Exception as e:
                    return RunOutcome.of(e, elapsed_s=time.monotonic() - t0, lost_s=time.monotonic() - last)
                if noticed:
                    return self._stopped_on_notice(noticed, gang, tracker, t0)
                return RunOutcome.success(time.monotonic() - t0)
            try:
                monitor.observe(read_beats(keys))
            except Exception as e:  # the GCS is unreachable: Ray's own errors will tell
                logger.debug("heartbeats unreadable: %s", e)
            verdict = monitor.check()
            if verdict is not None:
                return detected(verdict)
            for rank in monitor.spared.keys() - told_busy:
                told_busy.add(rank)
                logger.info(
                    "attempt %d: %s is silent but its machine answers: a busy process (its GIL held), "
                    "not a lost host; it is given up to %g s",
                    attempt,
                    where(rank),
                    monitor.live_grace_s,
                )
            # A host's beat is overdue: look again soon, so that a loss is declared close to
            # heartbeat_timeout_s after its last beat rather than up to a poll period later.
            poll = _QUICK_POLL_S if quietest() > 1.5 * period else _POLL_S
            if time.monotonic() >= warm_next and history and history[-1].get("attempt") == attempt:
                # Once this attempt has compiled (its first report), so that imports on the spare hosts do not
                # compete with it; again every few seconds: spare slices come and go (a node pool replaces one).
                warm_next = time.monotonic() + _WARM_REFRESH_S
                self._warm_spares(gang.spg)
            if el is not None and (target := el.grow_target()) is not None and self._grow_ready(gang.spg, target):
                el.grow_asked = True  # free slices, and processes warm on every host of the bigger size: grow
                try:
                    asked = ray.get(gang.actors[0].call.remote(request_grow, (target,), {}), timeout=10)
                except Exception:  # rank 0 is gone: the loss is found by the usual path
                    asked = True
                el.grow_off = not asked
                self._say(
                    f"elastic: slices free for {target}: saving at the next step to grow"
                    if asked
                    else "elastic: slices are free, but notices are off (FailureConfig.preemption_notices): "
                    "the run grows at its next restart"
                )

    def _stopped_on_notice(
        self, noticed: dict[int, dict[str, Any]], gang: SliceGang, tracker: GoodputTracker, t0: float
    ) -> RunOutcome:
        """Every host saved the agreed step of a preemption notice and stopped: a preemption, nothing lost."""
        first = noticed[min(noticed)]
        step = first["step"]
        save_s = max(n["save_s"] for n in noticed.values())
        # The save's wait after the step's report (its stall is in the report) is checkpoint time too.
        tracker.add("checkpoint_stall", max(n["save_s"] - n["save_stall_s"] for n in noticed.values()))
        self._notice = {**first, "save_s": save_s}
        rank = first.get("rank")
        rank = rank if isinstance(rank, int) and 0 <= rank < len(gang.contexts) else min(noticed)
        hc = gang.contexts[rank]
        if first.get("reason") != GROW_REASON:
            self._avoid = {hc.slice_name}  # the noticed host is about to go: reserve elsewhere if possible
        error = GangError(
            f"preemption notice ({first.get('reason')}) on host rank {rank} ({hc.slice_name} worker "
            f"{hc.worker_id}): every host saved step {step} ({save_s:.2f} s) and stopped",
            Outcome.PREEMPTED,
            rank=rank,
        )
        return RunOutcome(Outcome.PREEMPTED, error, time.monotonic() - t0, 0.0, rank)

    # -- where an attempt resumes from ----------------------------------------
    def _choose_restore(self, attempt: int, world: int | None = None) -> RestoreChoice:
        """The RAM step if every shard is reachable and it is not older than storage, else storage."""
        storage = latest_complete_step(self._root)
        if self._ram is None:
            tier, reason = ("storage", f"storage step {storage}") if storage is not None else ("none", "fresh start")
            return RestoreChoice(attempt, tier, storage, reason)
        size = world if world is not None else cast(int, self.scaling.num_workers)
        return dataclasses.replace(self._ram.choose(size, storage, self._lost_nodes), attempt=attempt)

    def _begin_restore(
        self, attempt: int, gang: SliceGang, tracker: GoodputTracker, status: Any
    ) -> list[dict[str, Any]] | None:
        """Fixes the attempt's restore choice (its world is known now); starts its RAM stores."""
        choice = self._next_restore or self._choose_restore(attempt)
        self._next_restore = None
        if choice.tier == "ram" and len(choice.sources) != len(gang.actors):  # another size (an elastic resize)
            choice = self._choose_restore(attempt, world=len(gang.actors))
        choice = dataclasses.replace(choice, attempt=attempt)
        if attempt > 1 or choice.tier != "none":
            self._restores.append(choice)
        tracker.note_restore(choice.tier)
        if choice.tier != "none":
            self._status(status, f"attempt {attempt}: restoring from {_from(choice)}")
        if self._ram is None:
            return None
        with tracker.timed("startup"):
            return self._ram.start_attempt(attempt, gang.contexts)

    def _restore_info(self) -> dict[str, Any] | None:
        """What the workers need to restore from the RAM tier (None: storage or nothing)."""
        choice = self._restores[-1] if self._restores else None
        if choice is None or choice.tier != "ram":
            return None
        return {
            "tier": "ram",
            "step": choice.step,
            "attempt": choice.from_attempt,
            "sources": {r: list(s) for r, s in choice.sources.items()},
        }

    def _restore_seconds(self, attempt: int, seconds: float) -> None:
        for i, c in enumerate(self._restores):
            if c.attempt == attempt:
                self._restores[i] = dataclasses.replace(c, seconds=(c.seconds or 0.0) + float(seconds))

    def _reserve(self, name: str) -> SlicePlacementGroup:
        """The attempt's slices; an elastic run counts the free ones again when a bigger size does not come.

        A slice counted free may never come (a host of it died and Ray does not list it dead yet): an elastic
        size above ``min_slices`` is tried for at most ``_ELASTIC_TRY_S`` at a time, then chosen again from a
        fresh count, until the reservation timeout.
        """
        sc, el = self.scaling, self._elastic
        deadline = Deadline(sc.reservation_timeout_s)
        while True:
            request = el.request(sc.request, self._avoid) if el is not None else sc.request
            bigger = el is not None and request.num_slices > el.policy.min_slices
            wait = min(deadline.remaining, _ELASTIC_TRY_S) if bigger else deadline.remaining
            timeout = sc.reservation_timeout_s if el is None else max(wait, 0.5)  # (a retry may find little left)
            try:
                return slice_placement_group(
                    request, timeout_s=timeout, name=name, progress=False, avoid_slices=sorted(self._avoid)
                )
            except ReservationTimeout:
                if not bigger or deadline.expired:
                    raise
                logger.debug("elastic: %d slices did not come within %.1f s; counting again", request.num_slices, wait)

    def _confirm_hosts(self) -> None:
        """After an elastic attempt failed: which of its hosts are up, asked of their RAM stores (0.5 s).

        A gang process also dies alone, e.g. aborted with its collective when a peer host (holding JAX's
        coordination service) went down, and Ray may report that death before the lost host's: a slice
        avoided for its process alone would shrink the run further than the loss, and a lost host not named
        would be counted free. Each host's RAM store is a process of its own there: a host whose store
        answers is up (its slice stays in the count), one whose store does not is lost (its slice is
        avoided, its stores are not asked again). Without the RAM tier nothing on the host can be asked:
        the slices of dead processes stay avoided.
        """
        hosts, self._hosts = self._hosts, {}
        suspects, self._suspect = self._suspect, set()
        silent, self._silent_nodes = self._silent_nodes, set()
        nodes = {n for ns in hosts.values() for n in ns}
        up: set[str] | None = None
        if self._ram is not None and nodes:
            try:
                up = self._ram.answering(nodes)
            except Exception as e:  # the loss is still handled: slices avoided, stores asked again later
                logger.debug("could not ask the RAM stores of %s: %s", sorted(hosts), e)
        if up is None:
            self._lost_nodes |= silent
            return
        self._lost_nodes |= nodes - up
        for name, ns in hosts.items():
            if set(ns) & self._lost_nodes:
                self._avoid.add(name)
            elif name in suspects:
                self._avoid.discard(name)
                logger.debug("elastic: %s stays in the count: a process died but every host of it is up", name)

    def _prewarm(self, spg: SlicePlacementGroup, max_slices: int | None = None) -> list[str]:
        """Warm processes on the hosts a next attempt would take; returns those hosts.

        The hosts of free slices of the shape (at most ``max_slices`` of them) get a warm process and, with
        the RAM tier, their RAM store. An elastic run's next attempt may also run on this one's hosts (a
        shrink onto the survivors, a grow): they get a warm process too (no chips held: this attempt's
        processes keep theirs).
        """
        assert self._warm is not None
        spare = spare_hosts(self.scaling.request, exclude=[s.name for s in spg.slices], max_slices=max_slices)
        hosts = spare + ([h.node_id for _, h in spg.hosts()] if self._elastic is not None else [])
        self._warm.warm(hosts)
        if self._ram is not None:  # the RAM stores a restart there needs, up before it
            self._ram.prestart(spare)
        return hosts

    def _warm_spares(self, spg: SlicePlacementGroup) -> None:
        """Pre-starts gang processes on the hosts the next attempt would get (see :meth:`_prewarm`)."""
        if self._warm is None or self.tpu_slice is not None:
            return
        try:
            self._prewarm(spg)
        except Exception as e:  # an optimisation only: never fails the attempt
            logger.debug("could not pre-start spare gang processes: %s", e)

    def _grow_ready(self, spg: SlicePlacementGroup, target: int) -> bool:
        """Whether to stop now to grow to ``target`` slices: once every host of that size has a warm process.

        Training goes on meanwhile (the imports of the new hosts cost no step); after ``_GROW_WARM_WAIT_S`` the
        run grows anyway (cold processes where warm ones never came).
        """
        if self._warm is None or self.tpu_slice is not None:
            return True
        now = time.monotonic()
        if self._grow_wait_since is None:
            self._grow_wait_since = now
        try:
            ready = self._warm.ready(self._prewarm(spg, max_slices=target - spg.num_slices))
        except Exception as e:  # an optimisation only
            logger.debug("could not pre-start gang processes for a grow: %s", e)
            ready = True
        if ready or now - self._grow_wait_since >= _GROW_WARM_WAIT_S:
            self._grow_wait_since = None
            return True
        return False

    def _after_exception(self, out: RunOutcome) -> None:
        for cb in self._callbacks:
            hook = getattr(cb, "after_exception", None)
            if callable(hook):
                try:
                    hook(self._run, {out.rank if out.rank is not None else -1: out.error})
                except Exception as e:
                    raise _CallbackFailed(e) from e

    # -- output --------------------------------------------------------------
    def _status(self, status: Any, text: str) -> None:
        if status:
            status.update(text)

    def _say(self, text: str) -> None:
        if self.run_config.progress:
            self.console.print(text)
        else:
            logger.warning(text)


def _from(choice: RestoreChoice) -> str:
    return "the beginning (no checkpoint)" if choice.tier == "none" else choice.reason


def _scored_checkpoints(root: str) -> list[tuple[Checkpoint, dict[str, Any]]]:
    out = []
    for step in checkpoint_steps(root):
        ckpt = Checkpoint(step_dir(root, step), step)
        try:
            metrics = ckpt.metadata().get("metrics", {})
        except (FileNotFoundError, ValueError):
            metrics = {}
        out.append((ckpt, metrics))
    return out


def _materialize_in_order(ds: Any) -> Any:
    # Source order, so that two runs over the same dataset (and every restart
    # of one run) give each host the same rows in the same order.
    ds.context.execution_options.preserve_order = True
    return ds.materialize()


__all__ = ["JaxTrainer", "Result", "TrainRunContext", "fresh_run_name"]
