"""The worker side of a training run: what ``train_loop_per_worker`` calls.

Runs inside gang processes only (one per host, ``jax.distributed`` already
up). ``report`` is called on every host, as SPMD code does; saving a
checkpoint is a collective over all hosts (Orbax), asynchronous by default.

Example (inside ``train_loop_per_worker``)::

    ctx = get_context()                       # world rank/size, slice, worker id
    ckpt = get_checkpoint()                   # latest complete checkpoint, or None
    if ckpt:
        state = ckpt.restore(state)           # onto the current mesh
        data_state = ckpt.data_state("data")
    it = iter_jax_batches(get_dataset_shard("train"), batch_size=32, state=data_state)
    for batch in it:
        state, loss = step(state, batch)
        report({"loss": float(loss)}, checkpoint={"params": state, "data": it})
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from rayslice.train.checkpoint import Checkpoint, CheckpointWriter, split_data_iterators


@dataclasses.dataclass(frozen=True)
class TrainContext:
    """Where this worker sits. ``world_rank`` equals ``jax.process_index()``."""

    world_rank: int
    world_size: int
    slice_index: int
    num_slices: int
    worker_id: int
    hosts_per_slice: int
    local_device_count: int
    experiment_name: str
    run_path: str
    attempt: int
    slice_name: str = ""
    local_rank: int = 0  # one process per host

    # Ray Train style getters, for code written against ray.train.get_context().
    def get_world_rank(self) -> int:
        return self.world_rank

    def get_world_size(self) -> int:
        return self.world_size

    def get_local_rank(self) -> int:
        return self.local_rank

    def get_experiment_name(self) -> str:
        return self.experiment_name


class _Session:
    def __init__(self, ctx: TrainContext, info: Mapping[str, Any], shards: Mapping[str, Any]) -> None:
        self.ctx = ctx
        self.shards = dict(shards)
        self.checkpoint_dir = info["checkpoint_dir"]
        # The driver chose the step for every host: listings can lag on shared
        # storage, and hosts restoring different steps would silently diverge.
        step = info["restore_step"]
        self.checkpoint = None if step is None else Checkpoint(f"{self.checkpoint_dir}/{step}", step)
        self.step = 0 if self.checkpoint is None else self.checkpoint.step
        self.writer = CheckpointWriter(self.checkpoint_dir, info["num_to_keep"], info["async_save"])
        self.lock = threading.Lock()
        self.last_gather: str | None = None
        self.reports: list[dict[str, Any]] = []
        self.started = time.perf_counter()
        self.last = self.started
        self.first = True
        from rayslice.metrics import HostSampler

        self.sampler = HostSampler({"slice": ctx.slice_name, "worker_id": str(ctx.worker_id),
                                    "run": ctx.experiment_name}).start()


_SESSION: _Session | None = None


def _session() -> _Session:
    if _SESSION is None:
        raise RuntimeError("this function is only available inside train_loop_per_worker of a rayslice JaxTrainer")
    return _SESSION


def get_context() -> TrainContext:
    """This worker's :class:`TrainContext`."""
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


def _scalar(v: Any) -> Any:
    if isinstance(v, bool | int | float | str) or v is None:
        return v
    try:
        return v.item()  # numpy / jax scalars
    except (AttributeError, ValueError, TypeError):
        return str(v)


def _gather_states(s: _Session, step: int, states: dict[str, Any]) -> dict[str, list[Any]]:
    """Every host's data iterator states, gathered on every host through the coordination service."""
    if s.ctx.world_size == 1 or not states:
        return {k: [v] for k, v in states.items()}
    from jax._src import distributed

    client = distributed.global_state.client
    key = f"rayslice/ckpt/{s.ctx.attempt}/{step}"
    client.key_value_set(f"{key}/{s.ctx.world_rank}", json.dumps(states))
    per_rank = [states if r == s.ctx.world_rank else json.loads(client.blocking_key_value_get(f"{key}/{r}", 600_000))
                for r in range(s.ctx.world_size)]
    if s.last_gather is not None:  # every host has posted this one, so all have read the previous
        try:
            client.key_value_delete(s.last_gather)
        except Exception:
            pass
    s.last_gather = f"{key}/{s.ctx.world_rank}"
    return {k: [p.get(k) for p in per_rank] for k in states}


def report(metrics: Mapping[str, Any], checkpoint: Any = None) -> None:
    """Reports this step's metrics, and optionally saves a checkpoint (call on every host).

    Args:
        metrics: Scalars (Python, numpy or jax); rank 0's reach the driver.
        checkpoint: A pytree of (possibly sharded) ``jax.Array``s to save. In a
            top-level dict, data iterators (anything with ``state()``, e.g. a
            :class:`~rayslice.data.JaxBatchIterator`) are saved as their state,
            for :meth:`Checkpoint.data_state`.
    """
    s = _session()
    now = time.perf_counter()
    step = s.step + 1
    # Computed values become Python scalars now (cheap, and no device buffer is
    # kept alive); values still being computed stay as they are, since reading
    # them would wait for the step: the driver's drain converts them later.
    clean = {k: (_scalar(v) if _is_ready(v) else v) for k, v in metrics.items()}
    stall = 0.0
    if checkpoint is not None:
        clean = {k: _scalar(v) for k, v in clean.items()}
        arrays, states = split_data_iterators(checkpoint)
        meta = {"step": step, "metrics": clean, "data_states": _gather_states(s, step, states),
                "world_size": s.ctx.world_size}
        stall = s.writer.save(step, arrays, meta)
    end = time.perf_counter()
    s.sampler.record_step(max(0.0, now - s.last))
    # step_s covers the whole interval (the save included), so work = step_s - stall_s.
    record = {"step": step, "metrics": clean, "step_s": end - s.last, "stall_s": stall,
              "first": s.first, "checkpointed": checkpoint is not None, "attempt": s.ctx.attempt}
    s.step, s.first = step, False
    s.last = end
    with s.lock:
        s.reports.append(record)


def drain_reports() -> list[dict[str, Any]]:
    """Reports since the last drain (the driver polls rank 0 with this)."""
    s = _SESSION
    if s is None:
        return []
    with s.lock:
        # Only reports whose device values are computed: reading one that is
        # not would block this thread behind the step (forever, if a peer host
        # died mid-collective). The rest wait for the next drain, in order.
        ready = 0
        for r in s.reports:
            if not all(_is_ready(v) for v in r["metrics"].values()):
                break
            ready += 1
        out, s.reports = s.reports[:ready], s.reports[ready:]
    for r in out:
        r["metrics"] = {k: _scalar(v) for k, v in r["metrics"].items()}
    return out


def _is_ready(v: Any) -> bool:
    is_ready = getattr(v, "is_ready", None)
    return is_ready() if callable(is_ready) else True


def _takes_an_argument(fn: Callable[..., Any]) -> bool:
    import inspect

    try:
        return bool(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # builtins without a signature: pass the config
        return True


def run_worker(train_fn: Callable[..., Any], config: Any, ctx: TrainContext, info: Mapping[str, Any],
               shards: Mapping[str, Any]) -> dict[str, Any]:
    """Entry point in each gang process for one attempt."""
    global _SESSION
    import jax

    ctx = dataclasses.replace(ctx, local_device_count=jax.local_device_count())
    _SESSION = _Session(ctx, info, shards)
    try:
        if config is None and not _takes_an_argument(train_fn):
            train_fn()
        else:
            train_fn(config)
        final_wait = _SESSION.writer.wait()  # the last async save must be complete before success
    finally:
        _SESSION.sampler.stop()
        _SESSION.writer.close()
    return {"steps": _SESSION.step, "final_wait_s": final_wait}
