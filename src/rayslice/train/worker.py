"""The worker side of a training run: what ``train_loop_per_worker`` calls.

Runs inside gang processes only (one per host, ``jax.distributed`` already
up). ``report`` is called on every host, as SPMD code does. A checkpoint is
either a pytree of arrays (saved with Orbax: a collective over all hosts,
asynchronous by default) or, as in Ray Train, ``Checkpoint.from_directory(d)``
for files you wrote (copied into run storage before ``report`` returns; any
host may pass one, the files of all hosts are merged into one step).

Example (inside ``train_loop_per_worker``)::

    ctx = get_context()                       # world rank/size, slice, worker id
    ckpt = get_checkpoint()                   # latest complete checkpoint, or None
    if ckpt:
        state = ckpt.restore(state)           # onto the current mesh
        data_state = ckpt.data_state("data")
    it = iter_jax_batches(get_dataset_shard("train"), batch_size=32, state=data_state)
    for batch in it:
        state, loss = step(state, batch)
        report({"loss": loss}, checkpoint={"params": state, "data": it})
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import json
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from rayslice._validate import fail
from rayslice.train import _values
from rayslice.train import context as _context
from rayslice.train._compile import compile_clock, enable_compilation_cache
from rayslice.train._values import (
    _PLAIN_TYPES,
    _checkpointable,
    _is_ready,
    _jax_array_types,
    _json_safe,
    _plain,
    _read_jax,
    _wait_until_ready,
)
from rayslice.train.checkpoint import (
    Checkpoint,
    CheckpointWriter,
    split_data_iterators,
    step_dir,
    take_restore_seconds,
    write_pending,
)
from rayslice.train.context import TrainContext
from rayslice.train.heartbeat import HeartbeatPublisher

__all__ = [
    "PreemptionStop",
    "TrainContext",
    "get_checkpoint",
    "get_context",
    "get_dataset_shard",
    "report",
    "save_requested",
]


class PreemptionStop(BaseException):
    """Raised by ``report()`` after the emergency save of a preemption notice: the attempt ends here.

    A ``BaseException`` (like ``KeyboardInterrupt``), so that a loop's
    ``except Exception`` does not swallow it; the trainer catches it, waits
    for the save to complete, and restarts from that step.
    """


class _Session:
    def __init__(self, ctx: TrainContext, info: Mapping[str, Any], shards: Mapping[str, Any]) -> None:
        self.ctx = ctx
        self.shards = dict(shards)
        self.info = dict(info)
        self.checkpoint_dir = info["checkpoint_dir"]
        # The driver chose the step for every host: listings can lag on shared
        # storage, and hosts restoring different steps would silently diverge.
        step = info["restore_step"]
        restore = info.get("restore") or {}
        self.checkpoint: Checkpoint | None = None
        if restore.get("tier") == "ram":  # the RAM tier: every shard was reachable when the driver chose
            from rayslice.train.ramtier import ram_checkpoint

            self.checkpoint = ram_checkpoint(ctx.run_id, restore)
        elif step is not None:
            self.checkpoint = Checkpoint(step_dir(self.checkpoint_dir, step), step)
        self.step: int = 0 if step is None else step
        self.ram_every: int | None = info.get("ram_every_steps")
        self.storage_every: int | None = info.get("storage_every_steps")
        self.ram: Any = None  # a rayslice.train.ramtier.RamWriter when the RAM tier is on
        ram = info.get("ram")
        if ram and self.ram_every:
            from rayslice.train.ramtier import RamWriter

            self.ram = RamWriter(ctx.world_rank, ctx.attempt, ctx.world_size, ram["primary"], ram.get("replica"))
        take_restore_seconds()  # restores of an earlier attempt in this process are not this one's
        # JAX's compile timings: each report sends what changed since the previous one (this attempt's only).
        self.compile_clock = compile_clock()
        self.compile_seen = self.compile_clock.totals
        self._writer: CheckpointWriter | None = None  # made on the first array checkpoint (same step on every host)
        self.drain_lock = threading.Lock()  # never taken by report(): the step's thread does not wait on a drain
        self.last_gather: str | None = None
        # Reports not yet drained, oldest first: report() appends on the right, the drain (one at a
        # time) takes from the left and puts back on the left what it cannot read yet, so neither
        # needs a lock (a deque's appends and pops are atomic). A report holding device values
        # still being computed when reported carries the key _RAW.
        self.reports: collections.deque[dict[str, Any]] = collections.deque()
        # Metrics of the steps not yet computed when reported, oldest first (at most a few):
        # report() checks these, never every report since the last drain.
        self.in_flight: list[dict[str, Any]] = []
        self.started = time.perf_counter()
        self.last = self.started
        self.first = True
        self.agreement: Any = None  # a rayslice.train.notice.NoticeAgreement while notices are watched
        self.decided: tuple[int, bool] = (-1, False)  # (step, whether it is the agreed emergency-save step)
        self.stopped: dict[str, Any] | None = None  # the notice this host stopped on
        self.warned_no_tree = False
        self.saved_once = False  # a report has saved a tree or directory (see _freeze_heap)
        from rayslice.metrics import HostSampler

        self.sampler = HostSampler(
            {"slice": ctx.slice_name, "worker_id": str(ctx.worker_id), "run": ctx.experiment_name}
        ).start()

    @property
    def writer(self) -> CheckpointWriter:
        if self._writer is None:
            i = self.info
            self._writer = CheckpointWriter(
                self.checkpoint_dir,
                i["num_to_keep"],
                i["async_save"],
                i.get("score_attribute"),
                i.get("score_order", "max"),
            )
        return self._writer


_SESSION: _Session | None = None


def _session() -> _Session:
    if _SESSION is None:
        raise RuntimeError("this function is only available inside train_loop_per_worker of a rayslice JaxTrainer")
    return _SESSION


def get_context() -> TrainContext:
    """This worker's :class:`TrainContext` (Ray Train's getters included)."""
    return _session().ctx


def get_checkpoint() -> Checkpoint | None:
    """The latest complete checkpoint when this attempt started (None on a fresh run)."""
    return _session().checkpoint


def get_dataset_shard(name: str) -> Any:
    """This host's shard of ``datasets[name]``, ready for ``iter_jax_batches``."""
    shards = _session().shards
    if name not in shards:
        raise KeyError(f"no dataset {name!r}; datasets: {sorted(shards) or 'none'}")
    return shards[name]


_MAX_STEPS_IN_FLIGHT = 4
_RAW = "_raw"  # a report's key while its metrics may hold device values (removed by the drain)


def _gather_states(s: _Session, step: int, states: dict[str, Any]) -> dict[str, list[Any]]:
    """Every host's data iterator states, gathered on every host through the coordination service."""
    if s.ctx.world_size == 1 or not states:
        return {k: [v] for k, v in states.items()}
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("jax.distributed is not initialised in this worker (its coordination service is needed)")
    key = f"rayslice/ckpt/{s.ctx.attempt}/{step}"
    client.key_value_set(f"{key}/{s.ctx.world_rank}", json.dumps(states))
    per_rank = [
        states if r == s.ctx.world_rank else json.loads(client.blocking_key_value_get(f"{key}/{r}", 600_000))
        for r in range(s.ctx.world_size)
    ]
    if s.last_gather is not None:  # every host has posted this one, so all have read the previous
        try:
            client.key_value_delete(s.last_gather)
        except Exception:
            pass
    s.last_gather = f"{key}/{s.ctx.world_rank}"
    return {k: [p.get(k) for p in per_rank] for k in states}


def _save_decision(s: _Session, step: int) -> bool:
    """Whether ``step`` is the agreed step of an emergency save (the same answer on every host)."""
    if s.agreement is None:
        return False
    if s.decided[0] != step:
        s.decided = (step, s.agreement.claim(step))
    return s.decided[1]


def _ram_step(s: _Session, step: int) -> bool:
    return s.ram is not None and s.ram_every is not None and step % s.ram_every == 0


def _storage_step(s: _Session, step: int) -> bool:
    return s.storage_every is None or step % s.storage_every == 0


def save_requested() -> bool:
    """True when the step about to be reported needs a checkpoint, for any reason.

    The reasons: a preemption notice was agreed for this step (the emergency
    save), a RAM-tier step (``CheckpointConfig.ram_every_steps``), or a
    storage step when ``CheckpointConfig.storage_every_steps`` is set. Every
    host gets the same answer for the same step. A loop that checkpoints
    only now and then calls it::

        report(metrics, checkpoint=state if save_requested() else None)

    ``report()`` of an emergency step saves, waits until the save is
    complete, and ends the training function (:class:`PreemptionStop`); the
    next attempt resumes from it. A loop that passes a checkpoint at every
    step needs no call (the config picks the steps it keeps).
    """
    s = _session()
    step = s.step + 1
    if _save_decision(s, step) or _ram_step(s, step):
        return True
    return s.storage_every is not None and _storage_step(s, step)


def report(metrics: Mapping[str, Any], checkpoint: Any = None) -> None:
    """Reports this step's metrics, and optionally a checkpoint (call on every host, once per step).

    Args:
        metrics: A dict of metrics of any JSON-like type (numbers, strings,
            lists, dicts; numpy/jax values become Python numbers and lists).
            Values still being computed on the device do not block the step.
            Every host's metrics reach the driver (``UserCallback.after_report``
            gets them all; ``Result.metrics`` is rank 0's).
        checkpoint: ``Checkpoint.from_directory(d)`` (files you wrote; copied to
            run storage before this returns, so ``d`` may be a temporary
            directory), or a pytree of ``jax.Array`` / numpy / Python numbers,
            saved with Orbax on every host (pass the same tree structure on
            all hosts). In a top-level dict, data iterators (anything with
            ``state()``, e.g. a :class:`~rayslice.data.JaxBatchIterator`) are
            saved as their per-host state for :meth:`Checkpoint.data_state`.
            A tree is saved on the steps ``CheckpointConfig`` picks (its RAM
            and storage cadences, or a preemption notice's step); handed over
            on any other step it costs nothing, so a loop may pass its state
            every step and let the config decide.

    Raises:
        InvalidArgument: bad metrics, a missing checkpoint directory, a leaf
            Orbax cannot save (named by its path), or a missing score metric.
    """
    # On the step's path: right after a step the host's thread runs cold (its
    # caches taken by the step; 5-10x slower than in a tight loop), so the
    # usual metrics (plain numbers, jax scalars) take the shortest path.
    s = _SESSION if _SESSION is not None else _session()
    if type(metrics) is not dict and not isinstance(metrics, Mapping):
        raise fail("metrics", metrics, "a dict with string keys", got_type=True)
    now = time.perf_counter()
    step = s.step + 1
    # Computed values become plain Python now (cheap, and no device buffer is
    # kept alive: a later step may donate or delete it); values still being
    # computed stay as they are, since reading them would wait for the step:
    # the driver's drain converts them later.
    clean: dict[str, Any] = {}
    computing = False
    jax_types = _values._JAX_ARRAY_TYPES or _jax_array_types()
    for k, v in metrics.items():
        if type(k) is not str and not isinstance(k, str):
            raise fail("metrics", metrics, "a dict with string keys")
        kind_of = type(v)
        if kind_of in _PLAIN_TYPES:
            clean[k] = v
        elif kind_of in jax_types:  # the usual metric: a jax scalar, computed or not
            if v.is_ready():
                clean[k] = _read_jax(v)
            else:
                clean[k], computing = v, True
        elif _is_ready(v):
            clean[k] = _plain(v)
        else:
            clean[k], computing = v, True
    stall = 0.0
    kind = None
    ram_saved: int | None = None
    emergency = _save_decision(s, step)
    if emergency and checkpoint is None and not s.warned_no_tree:
        s.warned_no_tree = True
        import logging

        logging.getLogger(__name__).warning(
            "a preemption notice was agreed for step %d but the loop reported no checkpoint there: no emergency "
            "save (pass checkpoint=... when rayslice.train.save_requested() is True)",
            step,
        )
    # What this step saves: a directory checkpoint always; a tree only on a RAM-tier or storage step, or
    # at the agreed step of a notice (the same decision on every host: the state gather and Orbax's save
    # are collectives). A tree handed over on any other step costs nothing: not even the wait for its
    # metrics, which stay with the drain like those of a report without a checkpoint.
    is_directory = isinstance(checkpoint, Checkpoint)
    to_ram = to_storage = False
    if checkpoint is not None and not is_directory:
        to_ram = _ram_step(s, step)
        to_storage = emergency or _storage_step(s, step)
    saving = is_directory or to_ram or to_storage
    if saving:
        clean = {k: _plain(v) for k, v in clean.items()}  # the checkpoint's metrics: computed now
        computing = False
        score = s.info.get("score_attribute")
        if score is not None and not isinstance(clean.get(score), int | float):
            raise fail(
                f"metrics[{score!r}]",
                clean.get(score),
                "a number reported with every checkpoint (CheckpointConfig.checkpoint_score_attribute)",
            )
    if is_directory:
        try:
            stall = write_pending(s.checkpoint_dir, step, s.ctx.attempt, checkpoint.path)
        except FileNotFoundError:
            raise fail(
                "report(checkpoint=...)", checkpoint, "Checkpoint.from_directory(d) of an existing directory"
            ) from None
        kind = "directory"
    elif saving:
        arrays, states = split_data_iterators(checkpoint)
        arrays = _checkpointable(arrays)
        meta = {
            "step": step,
            "metrics": _json_safe(clean),
            "data_states": _gather_states(s, step, states),
            "world_size": s.ctx.world_size,
        }
        if to_ram:
            stall += s.ram.save(step, arrays, meta)
            ram_saved = step
        if to_storage:
            stall += s.writer.save(step, arrays, meta)
            kind = "arrays"
    end = time.perf_counter()
    s.sampler.record_step(max(0.0, now - s.last))
    # step_s covers the whole interval (the save included), so work = step_s - stall_s.
    record = {
        "step": step,
        "metrics": clean,
        "step_s": end - s.last,
        "stall_s": stall,
        "first": s.first,
        "checkpoint": kind,
        "attempt": s.ctx.attempt,
        "rank": s.ctx.world_rank,
        "restore_s": take_restore_seconds(),
    }
    compiled = s.compile_clock.totals
    if compiled is not s.compile_seen:  # compiled during this step: (xla_s, trace_lower_s, cache hits, misses)
        seen, s.compile_seen = s.compile_seen, compiled
        record["compile"] = tuple(now_ - then for now_, then in zip(compiled, seen, strict=True))
    elif s.first:
        record["compile"] = (0.0, 0.0, 0, 0)
    if s.ram is not None:  # the RAM tier: this step's save, and the newest one both stores hold
        record.update(ram=ram_saved, ram_acked=s.ram.acked, ram_bytes=s.ram.bytes_held)
    if emergency and kind is not None:
        s.stopped = {
            **(s.agreement.notice or {}),
            "step": step,
            "save_stall_s": stall,
            "noticed_at": s.agreement.noticed_at,
        }
        record["notice"] = dict(s.stopped)
    if s.first or (saving and not s.saved_once):
        s.saved_once = s.saved_once or saving
        _freeze_heap()  # what the compile or the first save left behind stays: keep it out of full collections
    s.step, s.first = step, False
    s.last = end
    in_flight = s.in_flight
    if computing:
        record[_RAW] = True
        in_flight.append(clean)
    s.reports.append(record)
    while in_flight and _is_ready(in_flight[0]):
        in_flight.pop(0)
    if len(in_flight) > _MAX_STEPS_IN_FLIGHT:
        # Bound how far the host runs ahead of its device: a loop that never
        # reads a value would otherwise queue steps without limit, and on CPU
        # every queued step with a cross-host collective holds a runtime thread
        # until its peers arrive (enough of them deadlock the process).
        in_flight[:] = [m for m in in_flight if not _is_ready(m)]
        if len(in_flight) > _MAX_STEPS_IN_FLIGHT:
            _wait_until_ready(in_flight[0])
    if s.stopped is not None:
        raise PreemptionStop(f"preemption notice ({s.stopped.get('reason')}): saved step {step}")


def drain_reports() -> list[dict[str, Any]]:
    """Reports since the last drain (the driver polls every host with this)."""
    s = _SESSION
    if s is None:
        return []
    with s.drain_lock:  # one drain at a time: reports leave in the order they were made
        return _drain(s)


def _drain(s: _Session) -> list[dict[str, Any]]:
    reports = s.reports
    taken = [reports.popleft() for _ in range(len(reports))]  # what was reported until now
    if not any(_RAW in r for r in taken):  # every metric was made plain by report(): nothing to wait for
        return taken
    # Only reports whose device values are computed: reading one that is not
    # would block this thread behind the step (forever, if a peer host died
    # mid-collective). The rest wait for the next drain, in order, ahead of
    # what was reported meanwhile.
    ready = 0
    for r in taken:
        if _RAW in r and not _is_ready(r["metrics"]):
            break
        ready += 1
    out, rest = taken[:ready], taken[ready:]
    reports.extendleft(reversed(rest))
    for r in out:
        if r.pop(_RAW, False):
            r["metrics"] = {k: _plain(v) for k, v in r["metrics"].items()}
    return out


def wait_for_checkpoints() -> float:
    """Blocks until this host's asynchronous array saves are complete; returns the seconds waited."""
    s = _session()
    return 0.0 if s._writer is None else s._writer.wait()


def _freeze_heap() -> None:
    """Moves every object alive now out of the garbage collector's reach (``gc.freeze``).

    A full collection holds the GIL while it scans every tracked object: with
    JAX, Orbax and a compiled step loaded that is several hundred thousand
    objects, 0.3 s on an idle core and over a second on a busy machine,
    during which the heartbeat thread cannot beat and the driver would take
    the host for lost. Objects alive at the start and after the first step
    and first save are long-lived (modules, jit caches, checkpointers);
    frozen, they are still freed by reference counting, only cycles among
    them are never collected.
    """
    gc.freeze()


def _takes_an_argument(fn: Callable[..., Any]) -> bool:
    import inspect

    try:
        return bool(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # builtins without a signature: pass the config
        return True


def run_worker(
    train_fn: Callable[..., Any], config: Any, ctx: TrainContext, info: Mapping[str, Any], shards: Mapping[str, Any]
) -> dict[str, Any]:
    """Entry point in each gang process for one attempt."""
    global _SESSION
    import jax

    ctx = dataclasses.replace(ctx, local_device_count=jax.local_device_count())
    if info.get("compilation_cache"):
        enable_compilation_cache(info["compilation_cache"])
    _SESSION = session = _Session(ctx, info, shards)
    _context._set_current(ctx)
    phase = "step"
    beat = info.get("heartbeat")
    heart = None
    if beat:  # liveness and progress for the driver's monitor (see rayslice.train.heartbeat)
        heart = HeartbeatPublisher(
            beat["key"], beat["period_s"], lambda: (session.step, phase), watch=threading.get_ident()
        ).start()
    sources = _watch_notices(session, info.get("notices"))
    _freeze_heap()  # the imports and the session: long-lived
    try:
        try:
            if config is None and not _takes_an_argument(train_fn):
                value = train_fn()
            else:
                value = train_fn(config)
        except PreemptionStop:
            value = None
        phase = "finishing"  # the final checkpoint wait is not a step: not timed by step_timeout_s
        final_wait = wait_for_checkpoints()  # the last async save must be complete before success
    finally:
        if sources is not None:
            sources.stop()
        if session.agreement is not None:
            session.agreement.stop()
        if heart is not None:
            heart.stop()
            phase = "done"  # stopping on purpose: the driver must not take the silence for a loss
            heart.beat()
        _SESSION.sampler.stop()
        if _SESSION._writer is not None:
            _SESSION._writer.close()
        _context._set_current(None)
    if ctx.world_rank != 0:
        value = None  # Ray's Result.return_value is rank 0's
    out = {"steps": _SESSION.step, "final_wait_s": final_wait, "return_value": value}
    if session.stopped is not None:  # ended on a preemption notice, after a complete emergency save
        noticed = session.stopped.pop("noticed_at", None)
        out["notice"] = {
            **session.stopped,
            "save_s": session.stopped["save_stall_s"] + final_wait,
            "notice_to_saved_s": None if noticed is None else time.monotonic() - noticed,
        }
    return out


def _watch_notices(session: _Session, options: Mapping[str, Any] | None) -> Any:
    """Starts the notice agreement and this host's notice sources (None when notices are off)."""
    if not options:
        return None
    from rayslice.train.notice import NoticeAgreement, NoticeSources

    ctx = session.ctx
    client = None
    if ctx.world_size > 1:
        from jax._src import distributed

        client = distributed.global_state.client
    if client is None:
        from rayslice.train.notice import MemoryKV

        client = MemoryKV()  # one host: agreeing with itself
    session.agreement = agreement = NoticeAgreement(
        client, f"{ctx.run_id}/{ctx.attempt}", rank=ctx.world_rank, world_size=ctx.world_size
    ).start(claimed=session.step)
    node_id = None
    try:
        import ray

        node_id = ray.get_runtime_context().get_node_id()
    except Exception:
        pass
    return NoticeSources(agreement.announce, node_id=node_id, poll_s=float(options.get("poll_s", 1.0))).start()
