"""Checkpoints of a training run: the storage layout, and the :class:`Checkpoint` handle.

This module owns the layout; nothing else builds or parses these paths::

    <storage_path>/<run name>/checkpoints/<step>/state/...          arrays (Orbax StandardSave)
    <storage_path>/<run name>/checkpoints/<step>/meta/...           JSON: step, metrics, data iterator states
    <storage_path>/<run name>/checkpoints/<step>/<your files>       a directory checkpoint (Checkpoint.from_directory)
    <storage_path>/<run name>/checkpoints/<step>/.rayslice/meta.json  its step and metrics

Array checkpoints are an ordinary Orbax ``CheckpointManager`` directory: Orbax
writes each step into a temporary directory and renames it when every host
has finished, so a crash mid-save leaves the previous checkpoint intact.
Directory checkpoints are copied by each reporting host into a temporary
directory that the driver renames once every host has passed the step. Only
numbered directories are complete (on object stores, which cannot rename
atomically, only those holding a commit marker). :func:`latest_complete_step`
reads that without importing JAX, so the driver stays JAX-free.

Restoring elsewhere with plain Orbax (here as host numpy arrays, in any
process, whatever topology saved it; pass shardings instead to place them)::

    import jax, numpy as np, orbax.checkpoint as ocp
    step = ocp.CheckpointManager(f"{run_path}/checkpoints").latest_step()
    path = f"{run_path}/checkpoints/{step}/state"
    ckptr = ocp.PyTreeCheckpointer()
    tree = ckptr.metadata(path).item_metadata.tree
    state = ckptr.restore(path, args=ocp.args.PyTreeRestore(
        restore_args=jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)))

Example:
    >>> root = checkpoints_dir(run_dir("/data/results", "run-a"))
    >>> root, step_dir(root, 8), step_of(step_dir(root, 8))
    ('/data/results/run-a/checkpoints', '/data/results/run-a/checkpoints/8', 8)
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping
from typing import Any

from rayslice._validate import check_choice, check_int, fail
from rayslice.train.context import current_context

STATE_ITEM = "state"
META_ITEM = "meta"
COMMIT_MARKER = "commit_success.txt"
DIR_META = ".rayslice/meta.json"  # inside a directory checkpoint's step directory
USER_METADATA = ".metadata.json"  # Checkpoint.set_metadata(), as Ray names it
_PENDING = ".rayslice-tmp-"  # <step>.rayslice-tmp-<attempt>: a directory checkpoint being written


def _path(directory: str) -> Any:
    # etils.epath: local paths and gs:// / s3:// alike (object stores need gcsfs/s3fs),
    # without importing JAX, so the driver can read it.
    from etils import epath

    return epath.Path(directory)


def _is_local(path: str) -> bool:
    return "://" not in path


# -- layout ------------------------------------------------------------------
def run_dir(storage_path: str, name: str) -> str:
    """``<storage_path>/<name>``; ``~`` expanded and ``file://`` dropped for local paths.

    Example:
        >>> run_dir("file:///data/", "r1")
        '/data/r1'
    """
    base = storage_path[len("file://") :] if storage_path.startswith("file://") else storage_path
    if _is_local(base):
        base = os.path.abspath(os.path.expanduser(base))
    return f"{base.rstrip('/')}/{name}"


def checkpoints_dir(run_path: str) -> str:
    """Where a run's checkpoint steps live."""
    return f"{run_path.rstrip('/')}/checkpoints"


def step_dir(root: str, step: int) -> str:
    """The directory of checkpoint ``step`` under ``root`` (:func:`checkpoints_dir`)."""
    return f"{root.rstrip('/')}/{check_int('step', step, minimum=0)}"


def step_of(path: str) -> int | None:
    """The step a step directory holds (None when ``path`` is not one)."""
    name = str(path).rstrip("/").rsplit("/", 1)[-1]
    return int(name) if name.isdigit() else None


def pending_dir(root: str, step: int, attempt: int) -> str:
    """Where hosts copy a directory checkpoint of ``step`` before the driver commits it."""
    return f"{step_dir(root, step)}{_PENDING}{attempt}"


def checkpoint_steps(root: str) -> list[int]:
    """Complete checkpoint steps under ``root``, oldest first (a storage listing, no JAX)."""
    base = _path(root)
    if not base.exists():
        return []
    local = _is_local(str(root))
    steps = []
    for p in base.iterdir():
        # Temporary directories carry a suffix, so on a local disk a plain
        # number is a committed (renamed) step; object stores have no atomic
        # rename, and a finished step holds a commit file instead.
        if p.name.isdigit() and p.is_dir() and (local or (p / COMMIT_MARKER).exists()):
            steps.append(int(p.name))
    return sorted(steps)


def latest_complete_step(root: str) -> int | None:
    """The newest complete step under ``root``, or None."""
    steps = checkpoint_steps(root)
    return steps[-1] if steps else None


def latest_checkpoint(root: str) -> Checkpoint | None:
    """The newest complete checkpoint under ``root``, or None."""
    step = latest_complete_step(root)
    return None if step is None else Checkpoint(step_dir(root, step), step)


# -- restore time --------------------------------------------------------------
_RESTORE_S = [0.0]


@contextlib.contextmanager
def restore_timer() -> Iterator[None]:
    """Adds the time of the block to this process's restore time (see :func:`take_restore_seconds`)."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        _RESTORE_S[0] += time.perf_counter() - t0


def take_restore_seconds() -> float:
    """Seconds spent in ``restore()`` in this process since the last call (the worker books them as "restore").

    Example:
        >>> with restore_timer():
        ...     pass
        >>> take_restore_seconds() >= 0.0, take_restore_seconds()
        (True, 0.0)
    """
    seconds, _RESTORE_S[0] = _RESTORE_S[0], 0.0
    return seconds


# -- the handle --------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A checkpoint directory: one complete step of a run, or a directory you wrote.

    Like Ray Train's ``Checkpoint``: :meth:`from_directory` wraps a directory
    you wrote for ``report(metrics, checkpoint=...)``; :meth:`as_directory`
    and :meth:`to_directory` give its files; :meth:`get_metadata` /
    :meth:`set_metadata` keep a small JSON dict with it. Checkpoints of arrays
    (``report(checkpoint=pytree)``) also :meth:`restore` onto the current
    mesh, even after a restart on another slice.

    Args:
        path: The directory (a local path or a ``gs://`` / ``s3://`` URL).
        step: The run's step it holds (read from the path when it is a step directory).

    Example:
        >>> Checkpoint("/data/results/run-a/checkpoints/12").step
        12
        >>> Checkpoint.from_directory("/tmp/my_ckpt").step is None
        True
    """

    path: str
    step: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.path, str | os.PathLike) or not str(self.path).strip():
            raise fail("path", self.path, "a directory path or URL (str or os.PathLike)", got_type=True)
        object.__setattr__(self, "path", os.fspath(self.path))
        if self.step is None:
            object.__setattr__(self, "step", step_of(self.path))
        else:
            check_int("step", self.step, minimum=0)

    @classmethod
    def from_directory(cls, path: str | os.PathLike[str]) -> Checkpoint:
        """A checkpoint of the files in a local directory (copied to run storage by ``report``)."""
        if not isinstance(path, str | os.PathLike) or not str(path).strip():
            raise fail("path", path, "a local directory path", got_type=True)
        return cls(os.path.abspath(os.path.expanduser(os.fspath(path))))

    @property
    def directory(self) -> str:
        """The directory that holds this step directory (the run's checkpoints)."""
        return self.path.rstrip("/").rsplit("/", 1)[0]

    @property
    def filesystem(self) -> Any:
        """A ``pyarrow.fs.FileSystem`` for :attr:`path` (as Ray's ``Checkpoint.filesystem``)."""
        import pyarrow.fs

        return pyarrow.fs.FileSystem.from_uri(self.path if not _is_local(self.path) else os.path.abspath(self.path))[0]

    @property
    def tier(self) -> str:
        """``"storage"``: run storage (a :class:`~rayslice.train.ramtier.RamCheckpoint` says ``"ram"``)."""
        return "storage"

    @property
    def kind(self) -> str:
        """``"arrays"`` (an Orbax checkpoint of a pytree) or ``"directory"`` (files)."""
        return "arrays" if (_path(self.path) / STATE_ITEM).exists() else "directory"

    # -- files (Ray's API) ----------------------------------------------------
    def to_directory(self, path: str | os.PathLike[str] | None = None) -> str:
        """Copies the checkpoint's files into ``path`` (a new temporary directory if None); returns it."""
        target = tempfile.mkdtemp(prefix="rayslice-checkpoint-") if path is None else os.fspath(path)
        target = os.path.abspath(os.path.expanduser(target))
        _copy_tree(self.path, target)
        return target

    @contextlib.contextmanager
    def as_directory(self) -> Iterator[str]:
        """The checkpoint's files as a local directory, for a ``with`` block.

        A local checkpoint is yielded in place (treat it as read-only); a
        remote one is downloaded to a temporary directory removed afterwards.
        """
        if _is_local(self.path):
            yield self.path
            return
        local = self.to_directory()
        try:
            yield local
        finally:
            shutil.rmtree(local, ignore_errors=True)

    def get_metadata(self) -> dict[str, Any]:
        """The JSON dict stored with :meth:`set_metadata` (``{}`` if none)."""
        p = _path(self.path) / USER_METADATA
        return json.loads(p.read_text()) if p.exists() else {}

    def set_metadata(self, metadata: Mapping[str, Any]) -> None:
        """Stores a JSON-serializable dict with the checkpoint (replacing any)."""
        if not isinstance(metadata, Mapping):
            raise fail("metadata", metadata, "a dict", got_type=True)
        (_path(self.path) / USER_METADATA).write_text(json.dumps(dict(metadata)))

    def update_metadata(self, metadata: Mapping[str, Any]) -> None:
        """Merges ``metadata`` into the stored dict."""
        self.set_metadata({**self.get_metadata(), **dict(metadata)})

    # -- rayslice's run metadata ----------------------------------------------
    def metadata(self) -> dict[str, Any]:
        """Step, metrics (and, for arrays, data iterator states) saved with this step."""
        base = _path(self.path)
        candidates = [base / META_ITEM / n for n in ("metadata", "meta.json", "metadata.json")] + [base / DIR_META]
        for p in candidates:
            if p.exists():
                return json.loads(p.read_text())
        raise FileNotFoundError(f"no rayslice metadata in {self.path}: not a step of a rayslice run")

    def data_state(self, key: str = "data", rank: int | None = None) -> dict[str, Any] | None:
        """The saved state of data iterator ``key`` for this host (or ``rank``).

        Inside a training worker ``rank`` defaults to this host's rank;
        elsewhere pass it. In an elastic run whose data was split again at
        or after this step (a resize), None: the host's new shard holds just
        the rows not yet consumed, read from its start.
        """
        meta = self.metadata()
        states = meta.get("data_states", {}).get(key)
        if states is None:
            return None
        world = None
        if rank is None:
            ctx = current_context()
            if ctx is None:
                raise fail("rank", rank, "a host rank (an int >= 0) outside a training worker")
            rank, world = ctx.world_rank, ctx.world_size
            if ctx.data_resplit_step is not None and self.step is not None and self.step <= ctx.data_resplit_step:
                return None  # an elastic resize split the rows left again: this host's shard starts fresh
        rank = check_int("rank", rank, minimum=0)
        if rank >= len(states) or (world is not None and world != meta.get("world_size", len(states))):
            # A restart on more hosts than the checkpoint was written by: the
            # data split changed, so no saved position is this host's.
            raise ValueError(
                f"checkpoint {self.step} holds data states for {len(states)} host(s); "
                f"rank {rank} has none (the run's world size changed)"
            )
        return states[rank]

    def restore(self, target: Any = None) -> Any:
        """Restores an array checkpoint (call inside a worker, on every host), placed like ``target``."""
        if self.kind != "arrays":
            raise ValueError(
                f"checkpoint {self.path} is a directory checkpoint (files, no arrays): "
                "read it with as_directory() or to_directory()"
            )
        import orbax.checkpoint as ocp

        with restore_timer(), ocp.StandardCheckpointer() as ckptr:
            return ckptr.restore(f"{self.path.rstrip('/')}/{STATE_ITEM}", target)


def _copy_tree(src: str, dst: str) -> None:
    """Copies the files under ``src`` into ``dst`` (merging; either side local or remote)."""
    if _is_local(src) and _is_local(dst):
        if not os.path.isdir(src):
            raise FileNotFoundError(f"checkpoint directory {src} does not exist")
        shutil.copytree(src, dst, dirs_exist_ok=True)
        return
    s, d = _path(src), _path(dst)
    if not s.is_dir():
        raise FileNotFoundError(f"checkpoint directory {src} does not exist")
    d.mkdir(parents=True, exist_ok=True)
    for p in s.iterdir():
        if p.is_dir():
            _copy_tree(str(p), str(d / p.name))
        else:
            p.copy(d / p.name, overwrite=True)


# -- directory checkpoints: hosts write, the driver commits -------------------
def write_pending(root: str, step: int, attempt: int, source: str) -> float:
    """Copies a host's directory checkpoint next to ``step``'s directory; returns the seconds it took."""
    t0 = time.perf_counter()
    _copy_tree(source, pending_dir(root, step, attempt))
    return time.perf_counter() - t0


def commit_pending(root: str, step: int, attempt: int, meta: Mapping[str, Any]) -> Checkpoint:
    """Makes a directory checkpoint complete (driver side): metadata, then rename, then marker."""
    pending = _path(pending_dir(root, step, attempt))
    meta_file = pending / DIR_META
    meta_file.parent.mkdir(parents=True, exist_ok=True)
    meta_file.write_text(json.dumps(dict(meta), default=str))
    final = step_dir(root, step)
    if _path(final).exists():  # a step of an earlier attempt that this one recomputed
        _path(final).rmtree()
    pending.rename(final)
    if not _is_local(root):
        (_path(final) / COMMIT_MARKER).write_text("committed by rayslice")
    return Checkpoint(final, step)


def discard_pending(root: str) -> None:
    """Removes directory checkpoints that were never committed (a failed attempt's)."""
    base = _path(root)
    if base.exists():
        for p in base.iterdir():
            if _PENDING in p.name:
                p.rmtree()


def prune_directories(
    root: str, num_to_keep: int | None, score_attribute: str | None = None, score_order: str = "max"
) -> list[int]:
    """Deletes directory checkpoints beyond the best ``num_to_keep`` (the newest is always kept)."""
    if num_to_keep is None:
        return []
    check_choice("checkpoint_score_order", score_order, ("max", "min"))
    steps = [s for s in checkpoint_steps(root) if (_path(step_dir(root, s)) / DIR_META).exists()]
    if len(steps) <= num_to_keep:
        return []

    def score(step: int) -> float:
        if score_attribute is None:
            return float(step)
        value = Checkpoint(step_dir(root, step), step).metadata().get("metrics", {}).get(score_attribute)
        return float(value) if isinstance(value, int | float) else float("-inf" if score_order == "max" else "inf")

    ranked = sorted(steps, key=score, reverse=score_order == "max" or score_attribute is None)
    keep = set(ranked[:num_to_keep]) | {steps[-1]}
    dropped = [s for s in steps if s not in keep]
    for s in dropped:
        _path(step_dir(root, s)).rmtree()
    return dropped


# -- array checkpoints --------------------------------------------------------
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

    def __init__(
        self,
        directory: str,
        num_to_keep: int | None,
        async_save: bool,
        score_attribute: str | None = None,
        score_order: str = "max",
    ) -> None:
        import orbax.checkpoint as ocp

        _path(directory).mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self._ocp = ocp
        self.score_attribute = score_attribute
        best = (
            {}
            if score_attribute is None
            else {
                "best_fn": lambda metrics: float(metrics[score_attribute]),
                "best_mode": score_order,
                "keep_checkpoints_without_metrics": False,
            }
        )
        self._mngr = ocp.CheckpointManager(
            directory,
            item_names=(STATE_ITEM, META_ITEM),
            options=ocp.CheckpointManagerOptions(
                max_to_keep=num_to_keep, enable_async_checkpointing=async_save, create=True, **best
            ),
        )

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> float:
        """Starts saving ``step``; returns the seconds the caller was blocked."""
        t0 = time.perf_counter()
        metrics = None
        if self.score_attribute is not None:
            metrics = {self.score_attribute: meta["metrics"][self.score_attribute]}
        self._mngr.save(
            step,
            args=self._ocp.args.Composite(
                **{
                    STATE_ITEM: self._ocp.args.StandardSave(state),
                    META_ITEM: self._ocp.args.JsonSave(meta),
                }
            ),
            metrics=metrics,
        )
        return time.perf_counter() - t0

    def wait(self) -> float:
        t0 = time.perf_counter()
        self._mngr.wait_until_finished()
        return time.perf_counter() - t0

    def close(self) -> None:
        self._mngr.close()
