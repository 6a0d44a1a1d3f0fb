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
from rayslice.train._elastic_run import ElasticRun
from rayslice.train._hosts import HostLedger
from rayslice.train._watch import AttemptWatch, CallbackFailed, RunParts
from rayslice.train.checkpoint import (
    Checkpoint,
    checkpoint_steps,
    checkpoints_dir,
    discard_pending,
    latest_complete_step,
    step_dir,
)
from rayslice.train.config import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from rayslice.train.context import TrainContext
from rayslice.train.elastic import GROW_REASON
from rayslice.train.goodput import AttemptEnd, GoodputTracker
from rayslice.train.heartbeat import (
    HeartbeatMonitor,
    delete_beats,
    heartbeat_key,
    period_for,
)
from rayslice.train.liveness import NodeProbe, raylet_addresses
from rayslice.train.ramtier import RamTier, RestoreChoice
from rayslice.train.result import Result, TrainRunContext
from rayslice.train.worker import run_worker
from rayslice.warm import WarmPool, spare_hosts

logger = logging.getLogger(__name__)
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
_ELASTIC_TRY_S = 10.0  # how long an elastic reservation waits for the size it counted before counting again
_GROW_WARM_WAIT_S = 30.0  # the longest an elastic grow waits for warm processes on the new hosts


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
        self._ledger = HostLedger()  # the slices to avoid, the hosts known lost
        self._warm: WarmPool | None = None  # pre-started processes on spare hosts (FailureConfig.warm_spares)
        self._grow_wait_since: float | None = None  # an elastic grow waiting for warm processes, since
        self._detection_s = 0.0
        self._elastic = ElasticRun(self.scaling, path, self._say) if self.scaling.elastic else None
        # The RAM tier (CheckpointConfig.ram_every_steps): its stores live for the whole fit().
        every = self._cc.ram_every_steps
        self._ram = RamTier(self._run.run_id, every) if every else None
        self._restores: list[RestoreChoice] = []
        self._next_restore: RestoreChoice | None = None  # chosen when an attempt failed (None: choose at start)
        status = self.console.status("starting") if rc.progress else None
        if status:
            status.start()
        self._parts = RunParts(
            run=self._run,
            root=self._root,
            failure=self._fc,
            checkpoint=self._cc,
            callbacks=self._callbacks,
            exporter=self._exporter,
            num_slices=cast(int, self.scaling.num_slices),  # normalized on construction
            ledger=self._ledger,
            ram=self._ram,
            elastic=self._elastic,
            status=status,
            say=self._say,
            restore_seconds=self._restore_seconds,
            warm_spares=self._warm_spares,
            grow_ready=self._grow_ready,
        )
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
                    self._ledger.confirm(self._ram.answering if self._ram is not None else None)
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
        except CallbackFailed as e:
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
            self._ledger.reserved()
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
            watch = AttemptWatch(
                self._parts,
                gang,
                refs,
                monitor,
                keys,
                attempt=attempt,
                restarts=restarts,
                t0=t0,
                tracker=tracker,
                history=history,
            )
            try:
                return watch.run()
            finally:
                self._detection_s, self._notice = watch.detection_s, watch.notice
                self._return_value = watch.return_value
        except CallbackFailed:
            raise
        except Exception as e:  # start-up or split failed: a value, like any other failure
            lost = 0.0 if last_report is None else time.monotonic() - last_report
            return RunOutcome.of(e, elapsed_s=time.monotonic() - t0, lost_s=lost)
        finally:
            gang.shutdown()
            if self.tpu_slice is None:
                spg.release()
            delete_beats(keys)

    # -- where an attempt resumes from ----------------------------------------
    def _choose_restore(self, attempt: int, world: int | None = None) -> RestoreChoice:
        """The RAM step if every shard is reachable and it is not older than storage, else storage."""
        storage = latest_complete_step(self._root)
        if self._ram is None:
            tier, reason = ("storage", f"storage step {storage}") if storage is not None else ("none", "fresh start")
            return RestoreChoice(attempt, tier, storage, reason)
        size = world if world is not None else cast(int, self.scaling.num_workers)
        return dataclasses.replace(self._ram.choose(size, storage, self._ledger.lost), attempt=attempt)

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
            request = el.request(sc.request, self._ledger.avoid) if el is not None else sc.request
            bigger = el is not None and request.num_slices > el.policy.min_slices
            wait = min(deadline.remaining, _ELASTIC_TRY_S) if bigger else deadline.remaining
            timeout = sc.reservation_timeout_s if el is None else max(wait, 0.5)  # (a retry may find little left)
            try:
                return slice_placement_group(
                    request, timeout_s=timeout, name=name, progress=False, avoid_slices=sorted(self._ledger.avoid)
                )
            except ReservationTimeout:
                if not bigger or deadline.expired:
                    raise
                logger.debug("elastic: %d slices did not come within %.1f s; counting again", request.num_slices, wait)

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
                    raise CallbackFailed(e) from e

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
