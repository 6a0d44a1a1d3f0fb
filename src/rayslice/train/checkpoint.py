"""Orbax checkpoints for training runs: asynchronous, atomic, restorable with plain Orbax.

Layout (an ordinary Orbax ``CheckpointManager`` directory)::

    <storage_path>/<run name>/checkpoints/<step>/state/...   arrays (StandardSave)
    <storage_path>/<run name>/checkpoints/<step>/meta/...    JSON: step, metrics, data iterator states

Orbax writes each step into a temporary directory and renames it when every
host has finished, so a crash mid-save leaves the previous checkpoint intact:
only numbered directories are complete. :func:`latest_complete_step` reads
that without importing JAX, so the driver stays JAX-free.

Restoring elsewhere with plain Orbax (here as host numpy arrays, in any
process, whatever topology saved it; pass shardings instead to place them)::

    import jax, numpy as np, orbax.checkpoint as ocp
    step = ocp.CheckpointManager(f"{run_path}/checkpoints").latest_step()
    path = f"{run_path}/checkpoints/{step}/state"
    ckptr = ocp.PyTreeCheckpointer()
    tree = ckptr.metadata(path).item_metadata.tree
    state = ckptr.restore(path, args=ocp.args.PyTreeRestore(
        restore_args=jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)))
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Mapping
from typing import Any

STATE_ITEM = "state"
META_ITEM = "meta"


COMMIT_MARKER = "commit_success.txt"


def _path(directory: str) -> Any:
    # etils.epath: local paths and gs:// / s3:// alike (object stores need gcsfs/s3fs),
    # without importing JAX, so the driver can read it.
    from etils import epath

    return epath.Path(directory)


def checkpoint_steps(directory: str) -> list[int]:
    """Complete checkpoint steps under ``directory``, oldest first (a storage listing, no JAX)."""
    root = _path(directory)
    if not root.exists():
        return []
    local = "://" not in str(directory)
    steps = []
    for p in root.iterdir():
        # Orbax's temporary directories carry a suffix, so on a local disk a plain
        # number is a committed (renamed) step; object stores have no atomic
        # rename, and Orbax marks a finished step with a commit file instead.
        if p.name.isdigit() and p.is_dir() and (local or (p / COMMIT_MARKER).exists()):
            steps.append(int(p.name))
    return sorted(steps)


def latest_complete_step(directory: str) -> int | None:
    steps = checkpoint_steps(directory)
    return steps[-1] if steps else None


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint of a run.

    ``restore(target)`` (inside a worker) returns the array pytree placed
    like ``target`` (arrays or ``jax.ShapeDtypeStruct`` with shardings), so it
    lands on the current mesh even after a restart on another slice.
    """

    path: str  # the step directory
    step: int

    @property
    def directory(self) -> str:
        return self.path.rstrip("/").rsplit("/", 1)[0]

    def metadata(self) -> dict[str, Any]:
        """Step, metrics and data iterator states saved with the arrays."""
        meta_dir = _path(self.path) / META_ITEM
        for name in ("metadata", "meta.json", "metadata.json"):
            p = meta_dir / name
            if p.exists():
                return json.loads(p.read_text())
        raise FileNotFoundError(f"no metadata in {meta_dir}")

    def data_state(self, key: str = "data", rank: int | None = None) -> dict[str, Any] | None:
        """The saved state of data iterator ``key`` for this host (or ``rank``)."""
        meta = self.metadata()
        states = meta.get("data_states", {}).get(key)
        if states is None:
            return None
        world = None
        if rank is None:
            from rayslice.train.worker import get_context

            rank, world = get_context().world_rank, get_context().world_size
        if rank >= len(states) or (world is not None and world != meta.get("world_size", len(states))):
            # A restart on more hosts than the checkpoint was written by: the
            # data split changed, so no saved position is this host's.
            raise ValueError(f"checkpoint {self.step} holds data states for {len(states)} host(s); "
                             f"rank {rank} has none (the run's world size changed)")
        return states[rank]

    def restore(self, target: Any = None) -> Any:
        """Restores the arrays (call inside a worker, on every host)."""
        import orbax.checkpoint as ocp

        with ocp.StandardCheckpointer() as ckptr:
            return ckptr.restore(f"{self.path.rstrip('/')}/{STATE_ITEM}", target)


def split_data_iterators(tree: Any) -> tuple[Any, dict[str, dict[str, Any]]]:
    """Separates data iterators (objects with ``state()``) from a top-level dict of arrays."""
    if not isinstance(tree, Mapping):
        return tree, {}
    arrays, states = {}, {}
    for k, v in tree.items():
        if hasattr(v, "state") and callable(v.state) and not hasattr(v, "shape"):
            states[k] = v.state()
        else:
            arrays[k] = v
    return arrays, states


class CheckpointWriter:
    """One per worker process: saves through Orbax on every host (a collective)."""

    def __init__(self, directory: str, num_to_keep: int | None, async_save: bool) -> None:
        import orbax.checkpoint as ocp

        _path(directory).mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self._ocp = ocp
        self._mngr = ocp.CheckpointManager(
            directory,
            item_names=(STATE_ITEM, META_ITEM),
            options=ocp.CheckpointManagerOptions(max_to_keep=num_to_keep, enable_async_checkpointing=async_save,
                                                 create=True),
        )

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> float:
        """Starts saving ``step``; returns the seconds the caller was blocked."""
        t0 = time.perf_counter()
        self._mngr.save(step, args=self._ocp.args.Composite(**{
            STATE_ITEM: self._ocp.args.StandardSave(state),
            META_ITEM: self._ocp.args.JsonSave(meta),
        }))
        return time.perf_counter() - t0

    def wait(self) -> float:
        t0 = time.perf_counter()
        self._mngr.wait_until_finished()
        return time.perf_counter() - t0

    def close(self) -> None:
        self._mngr.close()
