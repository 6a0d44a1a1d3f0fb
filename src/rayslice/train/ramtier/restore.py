"""The worker's side of a RAM restore: :class:`RamCheckpoint`, rebuilt from the stores' shards.

Example:
    >>> c = ram_checkpoint("ab12", {"step": 40, "attempt": 1, "sources": {"0": ["s0", "s1"]}})
    >>> c.path, c.step, c.sources[0], c.from_attempt, c.tier
    ('ram://ab12/40', 40, ('s0', 's1'), 1, 'ram')
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from rayslice.errors import GangError, Outcome
from rayslice.train.checkpoint import Checkpoint, restore_timer
from rayslice.train.ramtier.writer import _index_key

__all__ = ["RamCheckpoint", "ram_checkpoint"]


def _deadline_get(refs: Sequence[Any], timeout: float) -> list[Any]:
    import ray

    return list(ray.get(list(refs), timeout=timeout))


class _Fetcher:
    """Fetches payloads of one RAM step from the stores, each rank's best source first."""

    def __init__(self, step: int, attempt: int, sources: Mapping[int, Sequence[str]], timeout_s: float) -> None:
        self.step, self.attempt, self.sources, self.timeout_s = step, attempt, sources, timeout_s
        self._cache: dict[int, dict[str, Any]] = {}

    def payload(self, rank: int) -> dict[str, Any]:
        if rank in self._cache:
            return self._cache[rank]
        import ray

        from rayslice.gang import NAMESPACE

        tried = []
        for name in self.sources.get(rank, ()):
            try:
                actor = ray.get_actor(name, namespace=NAMESPACE)
                got = _deadline_get([actor.get.remote(rank, self.attempt, self.step)], self.timeout_s)[0]
            except Exception as e:
                tried.append(f"{name}: {type(e).__name__}")
                continue
            if got is not None:
                self._cache[rank] = got
                return got
            tried.append(f"{name}: not held")
        # A store vanished between the driver's choice and this restore: a lost host, so a preemption
        # (the next attempt chooses again, without it), never an error in the user's code.
        raise GangError(
            f"RAM checkpoint step {self.step}: rank {rank}'s shards are no longer reachable "
            f"({', '.join(tried) or 'no store'}); the run restarts and chooses again",
            Outcome.PREEMPTED,
        )


@dataclasses.dataclass(frozen=True)
class RamCheckpoint(Checkpoint):
    """A checkpoint held in the RAM tier: the :class:`Checkpoint` interface, restored from the stores.

    ``get_checkpoint()`` returns one when the driver chose the RAM tier.
    ``path`` is ``ram://<run id>/<step>``; :attr:`tier` is ``"ram"``;
    :meth:`restore`, :meth:`metadata` and :meth:`data_state` work as for a
    storage checkpoint (files do not: the RAM tier holds arrays only).

    Example:
        >>> c = RamCheckpoint("ram://ab12/40", 40, sources={0: ("s0",)}, from_attempt=1)
        >>> c.step, c.tier, c.kind
        (40, 'ram', 'arrays')
    """

    sources: Mapping[int, tuple[str, ...]] = dataclasses.field(default_factory=dict, repr=False, compare=False)
    from_attempt: int = 0
    timeout_s: float = 120.0
    _fetcher: Any = dataclasses.field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "_fetcher", _Fetcher(self.step or 0, self.from_attempt, self.sources, self.timeout_s))

    @property
    def tier(self) -> str:
        return "ram"

    @property
    def kind(self) -> str:
        return "arrays"

    @property
    def directory(self) -> str:
        return self.path.rstrip("/").rsplit("/", 1)[0]

    def _own_rank(self) -> int:
        from rayslice.train.context import current_context

        ctx = current_context()
        return 0 if ctx is None else ctx.world_rank

    def metadata(self) -> dict[str, Any]:
        """Step, metrics and every host's data iterator states, as saved with the step."""
        own = self._own_rank()
        return dict(self._fetcher.payload(own if own in self.sources else min(self.sources, default=0))["meta"])

    def _no_files(self, *_: Any, **__: Any) -> Any:
        raise ValueError(
            f"{self.path} is a RAM checkpoint (arrays only, no files): restore it with restore(target); "
            "directory checkpoints are kept on storage only"
        )

    to_directory = _no_files
    as_directory = _no_files
    get_metadata = _no_files
    set_metadata = _no_files
    update_metadata = _no_files

    def restore(self, target: Any = None) -> Any:
        """Rebuilds ``target``'s leaves from the stored shards, placed like ``target`` (bitwise identical).

        Raises:
            ValueError: no ``target`` (the shards need a placement), or a leaf
                the RAM step cannot serve (another structure, shape or sharding).
        """
        if target is None:
            raise ValueError(
                f"restoring RAM checkpoint step {self.step} needs a target: ckpt.restore(state) with the tree "
                "to restore into (its shardings place the shards)"
            )
        with restore_timer():
            return self._restore(target)

    def _restore(self, target: Any) -> Any:
        import jax
        import numpy as np

        own = self._own_rank()
        fetch = self._fetcher
        # This host's own saved shards first; then the others' (a host of another world size, or a shard
        # this host did not hold, is served from theirs).
        ranks = ([own] if own in self.sources else []) + [r for r in sorted(self.sources) if r != own]

        def records(path: str) -> Any:
            for r in ranks:
                rec = fetch.payload(r)["leaves"].get(path)
                if rec is None:
                    raise ValueError(
                        f"RAM checkpoint step {self.step} has no leaf {path}: the target's structure differs from "
                        "the reported tree's"
                    )
                yield rec

        def find(path: str, key: tuple[tuple[int, int], ...] | None) -> Any:
            if key is None:
                return next(iter(records(path)))
            seen = []
            for rec in records(path):
                if rec["kind"] != "array":
                    raise ValueError(f"RAM checkpoint step {self.step}: leaf {path} was saved as a value, not an array")
                if key in rec["shards"]:
                    return rec["shards"][key]
                seen.append(rec)
            # No host held this exact shard: the target is sharded otherwise (another world size after an
            # elastic resize). Assemble it from the saved shards that overlap it.
            got = assemble(key, ((k, v) for rec in seen for k, v in rec["shards"].items()))
            if got is None:
                raise ValueError(
                    f"RAM checkpoint step {self.step}: the saved shards of leaf {path} do not cover the target's "
                    f"shard {key}"
                )
            return got

        def build(kpath: Any, leaf: Any) -> Any:
            path = jax.tree_util.keystr(kpath)
            sharding: Any = getattr(leaf, "sharding", None)
            if sharding is not None and hasattr(leaf, "shape"):
                shape = tuple(leaf.shape)
                saved = find(path, None)
                if saved["kind"] != "array" or tuple(saved["shape"]) != shape:
                    raise ValueError(
                        f"RAM checkpoint step {self.step}: leaf {path} has shape {saved.get('shape')}, "
                        f"the target {shape}"
                    )
                parts = []
                for device, index in sharding.addressable_devices_indices_map(shape).items():
                    data = np.asarray(find(path, _index_key(index, shape)))
                    if data.dtype != leaf.dtype:
                        data = data.astype(leaf.dtype)
                    parts.append(jax.device_put(data, device))
                return jax.make_array_from_single_device_arrays(shape, sharding, parts)
            saved = find(path, None)
            if saved["kind"] == "value":
                value = saved["value"]
                return np.array(value, copy=True) if isinstance(value, np.ndarray) else value
            raise ValueError(
                f"RAM checkpoint step {self.step}: leaf {path} was saved as a jax.Array; restore it into a "
                "jax.Array (or a jax.ShapeDtypeStruct with a sharding)"
            )

        return jax.tree_util.tree_map_with_path(build, target)


def assemble(box: tuple[tuple[int, int], ...], pieces: Iterable[tuple[Any, Any]]) -> Any:
    """The block ``box`` (``((start, stop), ...)`` per dimension) of an array, from saved pieces; None if uncovered.

    ``pieces`` are ``(piece box, numpy array)``; only those overlapping ``box``
    are copied, and the pieces are read until the block is covered.

    Example:
        >>> import numpy as np
        >>> a = np.arange(8.0).reshape(4, 2)
        >>> halves = [(((0, 2), (0, 2)), a[:2]), (((2, 4), (0, 2)), a[2:])]
        >>> assemble(((1, 3), (0, 2)), halves).tolist()  # a block across both halves
        [[2.0, 3.0], [4.0, 5.0]]
        >>> assemble(((0, 4), (0, 2)), halves[:1]) is None  # half of it was never saved
        True
    """
    import numpy as np

    shape = tuple(hi - lo for lo, hi in box)
    out = None
    covered = np.zeros(shape, dtype=bool)
    for piece_box, data in pieces:
        overlap = [(max(a, c), min(b, d)) for (a, b), (c, d) in zip(box, piece_box, strict=True)]
        if any(lo >= hi for lo, hi in overlap):
            continue
        data = np.asarray(data)
        if out is None:
            out = np.empty(shape, dtype=data.dtype)
        dst = tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(overlap, box, strict=True))
        src = tuple(slice(lo - c, hi - c) for (lo, hi), (c, _) in zip(overlap, piece_box, strict=True))
        out[dst] = data[src]
        covered[dst] = True
        if covered.all():
            return out
    return out if out is not None and covered.all() else None


def ram_checkpoint(run_id: str, restore: Mapping[str, Any]) -> RamCheckpoint:
    """The :class:`RamCheckpoint` a worker restores from, out of the driver's ``info["restore"]``."""
    sources = {int(r): tuple(s) for r, s in restore["sources"].items()}
    return RamCheckpoint(
        f"ram://{run_id}/{restore['step']}", int(restore["step"]), sources=sources, from_attempt=int(restore["attempt"])
    )
