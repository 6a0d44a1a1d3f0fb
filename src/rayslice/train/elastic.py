"""Elastic multi-slice training: the sizes a run may take, the global batch, and exact data across resizes.

An elastic run (``ScalingConfig(num_slices=4, min_slices=2)``) trains on as
many whole slices as are free, between ``min_slices`` and ``num_slices``.
When a slice is lost it restarts at once on the survivors (no waiting for a
replacement) from the newest checkpoint; when free slices appear it grows
back at a checkpoint boundary, no more often than ``regrow_every_s``. Each
span of the run on one size and one data split is an *elastic epoch*.

This module holds the pure rules, each tested on its own:

- which sizes a run may take (:func:`elastic_sizes`) and which one to take
  given what is free (:class:`SizePolicy`);
- the global-batch contract (:func:`grad_accum_steps`): with the global batch
  kept constant (the default) a run on ``k`` of ``N`` slices runs ``N / k``
  gradient-accumulation micro-steps of the same per-host batch per step, so
  only sizes that divide ``N`` are taken; with ``keep_global_batch=False``
  every size is allowed and the global batch shrinks with the world;
- the mesh the function should build on each size (:func:`mesh_shape`);
- exactly-once data (:func:`resplit`): the rows each old host has not yet
  consumed are split again over the new hosts, so every row of the epoch is
  consumed once by the run as a whole, whatever the resizes;
- a resize as a value (:class:`ResizeEvent`) for ``Result.resizes``.

Example:
    >>> elastic_sizes(4, 2), grad_accum_steps(4, 2)
    ((2, 4), 2)
    >>> layout = initial_layout(16, 2)           # two hosts: rows 0-7 and 8-15
    >>> resplit(layout, [4, 2], 1)               # host 0 read 4 rows, host 1 read 2; now one host
    (((4, 8), (10, 16)),)
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from rayslice._validate import fail

__all__ = [
    "GROW_REASON",
    "ElasticEpoch",
    "ResizeEvent",
    "SizePolicy",
    "check_mesh",
    "elastic_sizes",
    "grad_accum_steps",
    "initial_layout",
    "mesh_shape",
    "num_rows",
    "remaining",
    "resplit",
]

#: The notice reason of the clean stop before a grow-back (every host saves the agreed step, then stops).
GROW_REASON = "elastic-grow"

Ranges = tuple[tuple[int, int], ...]  # one host's rows: half-open [start, end) ranges of the dataset, in order
Layout = tuple[Ranges, ...]  # every host's rows, by world rank


# -- sizes and the global batch ---------------------------------------------------
def elastic_sizes(num_slices: int, min_slices: int, keep_global_batch: bool = True) -> tuple[int, ...]:
    """The slice counts a run may train on, ascending.

    With the global batch kept constant a size must divide ``num_slices``
    (the accumulation steps ``num_slices / size`` are whole); otherwise every
    size from ``min_slices`` to ``num_slices``.

    Example:
        >>> elastic_sizes(6, 2), elastic_sizes(6, 2, keep_global_batch=False), elastic_sizes(3, 3)
        ((2, 3, 6), (2, 3, 4, 5, 6), (3,))
    """
    return tuple(k for k in range(min_slices, num_slices + 1) if not keep_global_batch or num_slices % k == 0)


def grad_accum_steps(num_slices: int, slices: int, keep_global_batch: bool = True) -> int:
    """Gradient-accumulation micro-steps per step on ``slices`` of ``num_slices`` slices.

    Each micro-step feeds every host the same per-host batch as the full run,
    so a step on fewer slices consumes the same global batch. 1 without
    ``keep_global_batch``.

    Example:
        >>> grad_accum_steps(4, 4), grad_accum_steps(4, 1), grad_accum_steps(4, 2, keep_global_batch=False)
        (1, 4, 1)
        >>> grad_accum_steps(4, 3)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        rayslice.errors.InvalidArgument: slices=3 is not valid: expected a divisor of num_slices=4 ...
    """
    if not 1 <= slices <= num_slices:
        raise fail("slices", slices, f"1..{num_slices} (num_slices)")
    if not keep_global_batch:
        return 1
    if num_slices % slices:
        raise fail(
            "slices",
            slices,
            f"a divisor of num_slices={num_slices} (the global batch is kept constant by whole accumulation steps)",
        )
    return num_slices // slices


def check_mesh(mesh: Mapping[str, int], num_slices: int, devices_per_slice: int, elastic: bool) -> dict[str, int]:
    """The full-size mesh ``{axis: size}`` with a ``-1`` axis filled in, checked; raises on a bad one.

    The first axis is the one across slices (data parallel over the
    data-center network, as ``jax.make_mesh`` / ``create_hybrid_device_mesh``
    order it); an elastic run shrinks only that axis, so the other axes
    together must fit within one slice.

    Example:
        >>> check_mesh({"data": -1, "model": 4}, 2, 8, elastic=True)
        {'data': 4, 'model': 4}
        >>> check_mesh({"data": 2, "model": 8}, 2, 8, elastic=True)
        {'data': 2, 'model': 8}
        >>> check_mesh({"data": 1, "model": 16}, 2, 8, elastic=True)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        rayslice.errors.InvalidArgument: mesh={'data': 1, 'model': 16} is not valid: ... 'model' spans slices ...
    """
    if not isinstance(mesh, Mapping) or not mesh:
        raise fail("mesh", mesh, "a non-empty dict of axis name -> size (one size may be -1)", got_type=True)
    total = num_slices * devices_per_slice
    fill = [k for k, v in mesh.items() if v == -1]
    for k, v in mesh.items():
        if not isinstance(k, str) or not k or isinstance(v, bool) or not isinstance(v, int) or (v < 1 and v != -1):
            raise fail("mesh", dict(mesh), "axis names (strings) -> sizes (ints >= 1, or -1 for one axis)")
    known = math.prod(v for v in mesh.values() if v != -1)
    if len(fill) > 1 or total % known:
        raise fail("mesh", dict(mesh), f"sizes whose product is {total} (the devices of {num_slices} slice(s))")
    out = {k: (total // known if v == -1 else v) for k, v in mesh.items()}
    if math.prod(out.values()) != total:
        raise fail("mesh", dict(mesh), f"sizes whose product is {total} (the devices of {num_slices} slice(s))")
    if elastic:
        first, *rest = out
        inner = math.prod(out[k] for k in rest)
        if devices_per_slice % inner:
            acc, spanning = 1, first
            for k in reversed(rest):
                acc *= out[k]
                if devices_per_slice % acc:
                    spanning = k
                    break
            raise fail(
                "mesh",
                dict(mesh),
                f"a mesh an elastic run can shrink: axis {spanning!r} spans slices (the axes after the first, "
                f"{inner} devices, must fit within one slice of {devices_per_slice}); only the first axis "
                f"{first!r} may cross slices (or set min_slices=num_slices)",
            )
    return out


def mesh_shape(mesh: Mapping[str, int] | None, num_slices: int, slices: int, devices_per_slice: int) -> dict[str, int]:
    """The mesh the training function should build on ``slices`` slices.

    Without a declared mesh: one data-parallel axis over every device. With
    one (checked by :func:`check_mesh`): its first axis scaled by
    ``slices / num_slices``, the others unchanged.

    Example:
        >>> mesh_shape(None, 4, 2, 8), mesh_shape({"data": 8, "model": 4}, 4, 2, 8)
        ({'data': 16}, {'data': 4, 'model': 4})
    """
    if mesh is None:
        return {"data": slices * devices_per_slice}
    full = check_mesh(mesh, num_slices, devices_per_slice, elastic=slices != num_slices)
    first = next(iter(full))
    return {**full, first: full[first] * slices // num_slices}


@dataclasses.dataclass(frozen=True)
class SizePolicy:
    """How many slices to take given what is free, and when to grow back.

    Attributes:
        sizes: The allowed slice counts, ascending (:func:`elastic_sizes`).
        regrow_every_s: Least seconds between two resizes before a grow-back
            (a grow right after a shrink would thrash a flapping slice).

    Example:
        >>> p = SizePolicy((2, 4), regrow_every_s=60)
        >>> p.choose(free=3), p.choose(free=9), p.choose(free=1)
        (2, 4, None)
        >>> p.grow_to(current=2, free=2, since_resize_s=61), p.grow_to(current=2, free=2, since_resize_s=5)
        (4, None)
    """

    sizes: tuple[int, ...]
    regrow_every_s: float = 60.0

    def __post_init__(self) -> None:
        if not self.sizes or list(self.sizes) != sorted(set(self.sizes)) or self.sizes[0] < 1:
            raise fail("sizes", self.sizes, "distinct slice counts >= 1, ascending")

    @property
    def min_slices(self) -> int:
        return self.sizes[0]

    @property
    def max_slices(self) -> int:
        return self.sizes[-1]

    def choose(self, free: int) -> int | None:
        """The largest allowed size that ``free`` slices can hold (None: fewer than the smallest)."""
        fits = [k for k in self.sizes if k <= free]
        return fits[-1] if fits else None

    def grow_to(self, current: int, free: int, since_resize_s: float) -> int | None:
        """The size to grow to now (running on ``current``, ``free`` more free), or None to stay."""
        if since_resize_s < self.regrow_every_s:
            return None
        target = self.choose(current + free)
        return target if target is not None and target > current else None


# -- exactly-once data across resizes ---------------------------------------------
def num_rows(ranges: Ranges) -> int:
    """Rows in a host's ranges.

    Example:
        >>> num_rows(((0, 4), (10, 12)))
        6
    """
    return sum(end - start for start, end in ranges)


def initial_layout(rows: int, world: int) -> Layout:
    """Contiguous equal shards, as ``Dataset.split(world, equal=True)``: at most ``world - 1`` rows dropped.

    Example:
        >>> initial_layout(10, 3)
        (((0, 3),), ((3, 6),), ((6, 9),))
    """
    if rows < 0 or world < 1:
        raise fail("world", world, "an int >= 1 (and rows >= 0)")
    per = rows // world
    return tuple(((i * per, (i + 1) * per),) if per else () for i in range(world))


def remaining(ranges: Ranges, consumed: int) -> Ranges:
    """The rows of ``ranges`` after the first ``consumed``.

    Example:
        >>> remaining(((0, 4), (10, 14)), 5)
        ((11, 14),)
    """
    out: list[tuple[int, int]] = []
    skip = max(0, consumed)
    for start, end in ranges:
        n = end - start
        if skip >= n:
            skip -= n
            continue
        out.append((start + skip, end))
        skip = 0
    return tuple(out)


def _take(ranges: Sequence[tuple[int, int]], count: int) -> tuple[Ranges, list[tuple[int, int]]]:
    head: list[tuple[int, int]] = []
    rest = list(ranges)
    while count > 0 and rest:
        start, end = rest.pop(0)
        n = min(count, end - start)
        head.append((start, start + n))
        if start + n < end:
            rest.insert(0, (start + n, end))
        count -= n
    return tuple(head), rest


def resplit(layout: Layout, positions: Sequence[int], world: int) -> Layout:
    """Each new host's rows: what the old hosts had not consumed, split over ``world`` hosts.

    Args:
        layout: The old world's rows per host (rank order).
        positions: Rows each old host had consumed at the checkpoint
            (``JaxBatchIterator.state()["rows"]``).
        world: Hosts of the new world.

    Returns:
        ``world`` hosts' ranges: the old hosts' remaining rows in rank order,
        cut into contiguous pieces whose sizes differ by at most one (the
        first hosts take the extra rows). No row is dropped or repeated.

    Example:
        >>> resplit((((0, 4),), ((4, 8),)), [1, 3], 3)
        (((1, 3),), ((3, 4),), ((7, 8),))
    """
    if len(positions) != len(layout):
        raise fail("positions", list(positions), f"one position per old host ({len(layout)})")
    if world < 1:
        raise fail("world", world, "an int >= 1")
    left: list[tuple[int, int]] = []
    for ranges, pos in zip(layout, positions):
        if pos < 0 or pos > num_rows(ranges):
            raise fail("positions", list(positions), "rows consumed, each within 0..rows of its host's shard")
        left.extend(r for r in remaining(ranges, pos) if r[1] > r[0])
    total = sum(e - s for s, e in left)
    out: list[Ranges] = []
    for i in range(world):
        head, left = _take(left, total // world + (1 if i < total % world else 0))
        out.append(head)
    return tuple(out)


# -- the run's elastic epochs ------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ElasticEpoch:
    """One span of a run on one size with one data split.

    Attributes:
        index: 0 for the first, +1 per resize.
        start_step: The checkpoint step it started from (0: the start of the run).
        slices: Slices it trained on.
        world_size: Hosts it trained on.
        layouts: Per dataset name, every host's rows (rank order).

    Example:
        >>> e = ElasticEpoch(1, 8, 1, 2, {"train": (((4, 8),), ((12, 16),))})
        >>> ElasticEpoch.from_json(e.to_json()) == e
        True
    """

    index: int
    start_step: int
    slices: int
    world_size: int
    layouts: Mapping[str, Layout]

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "start_step": self.start_step,
            "slices": self.slices,
            "world_size": self.world_size,
            "layouts": {k: [[list(r) for r in host] for host in v] for k, v in self.layouts.items()},
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ElasticEpoch:
        layouts = {k: tuple(tuple((int(a), int(b)) for a, b in host) for host in v) for k, v in d["layouts"].items()}
        return cls(int(d["index"]), int(d["start_step"]), int(d["slices"]), int(d["world_size"]), layouts)


def owner(epochs: Sequence[ElasticEpoch], step: int | None) -> ElasticEpoch:
    """The epoch that wrote checkpoint ``step`` (None: the start of the run, the first epoch).

    An epoch that started from step ``s`` writes the checkpoints after ``s``;
    ``s`` itself is its predecessor's.

    Example:
        >>> es = [ElasticEpoch(0, 0, 2, 4, {}), ElasticEpoch(1, 6, 1, 2, {})]
        >>> [owner(es, s).index for s in (None, 3, 6, 7)]
        [0, 0, 0, 1]
    """
    if step is None:
        return epochs[0]
    return [e for e in epochs if e.start_step < step or e.index == 0][-1]


def next_epoch(
    epochs: Sequence[ElasticEpoch],
    restore_step: int | None,
    slices: int,
    world_size: int,
    positions: Callable[[str, ElasticEpoch], Sequence[int] | None],
) -> ElasticEpoch:
    """The epoch an attempt on ``slices`` slices restoring ``restore_step`` runs in (the last one, or a new one).

    The current epoch goes on when it has the same world and its split
    still holds at ``restore_step`` (it wrote that checkpoint, or started
    from it). Otherwise the rows the owner of ``restore_step`` had not
    consumed there (``positions(name, owner)``; None: unknown, taken as none
    consumed) are split again over ``world_size`` hosts.
    """
    last = epochs[-1]
    mine = owner(epochs, restore_step)
    if last.world_size == world_size and (mine is last or last.start_step == (restore_step or 0)):
        return last
    layouts = {}
    for name, layout in mine.layouts.items():
        pos = positions(name, mine)
        layouts[name] = resplit(layout, list(pos) if pos is not None else [0] * len(layout), world_size)
    return ElasticEpoch(last.index + 1, restore_step or 0, slices, world_size, layouts)


def dumps_epochs(epochs: Iterable[ElasticEpoch]) -> str:
    """The epochs as JSON text (the run keeps them in ``<run path>/elastic.json``)."""
    return json.dumps([e.to_json() for e in epochs])


def loads_epochs(text: str) -> list[ElasticEpoch]:
    """Epochs from :func:`dumps_epochs` text."""
    return [ElasticEpoch.from_json(d) for d in json.loads(text)]


# -- resizes as values ---------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ResizeEvent:
    """One resize of an elastic run (in ``Result.resizes``).

    Attributes:
        at_s: Seconds since ``fit()`` started when the resize began.
        step: The checkpoint step the new size restored (0: none).
        slices_before: Slices before.
        slices_after: Slices after.
        reason: ``"lost"`` (a slice was lost: continue on the survivors),
            ``"grow"`` (free slices came back), or ``"restart"`` (a restart
            found another number of slices free).
        lost_s: Seconds from the last step completed before the resize to the
            first step completed after it (detection, reservation, start-up,
            restore, compile and recomputed steps included).
        elastic_epoch: The epoch the resize started.

    Example:
        >>> str(ResizeEvent(12.5, 40, 3, 2, "lost", 2.25, 1))
        '3 -> 2 slices at 12.5 s (lost; step 40, 2.25 s lost)'
    """

    at_s: float
    step: int
    slices_before: int
    slices_after: int
    reason: str
    lost_s: float | None = None
    elastic_epoch: int = 0

    def __str__(self) -> str:
        lost = "" if self.lost_s is None else f", {self.lost_s:.2f} s lost"
        return (
            f"{self.slices_before} -> {self.slices_after} slices at {self.at_s:.1f} s "
            f"({self.reason}; step {self.step}{lost})"
        )
