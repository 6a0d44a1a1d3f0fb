"""Batches joined on the device (private): a column still in its source pieces, and the join.

A batch that spans several source blocks can reach the devices two ways:

* **joined on the host**: each block's rows written into one staging buffer,
  then one transfer of that buffer (:func:`~rayslice.data._rebatch._assemble`);
* **joined on the device** (:class:`Pieces`): each block's piece transferred
  as it is (a view of the block: no host copy), then the pieces concatenated
  on the device by a jitted ``concatenate`` (:func:`join_on_device`).

On an accelerator the second reads every byte from host memory once
instead of three times (read the block, write the buffer, read the buffer
for the transfer; JAX's own host-side conversions, such as int64 to int32
without x64, aside). Measured on a TPU v5e host (docs/performance.md, *TPU
host*), 8k-row blocks into 8-32 MB batches in the feeder: joined on the host
4.7-5.3 GB/s, joined on the device 10.7-13.6 GB/s, 0.84-1.01 of the fastest
``device_put`` of a contiguous batch. On the CPU platform a 64-byte-aligned
staging buffer is aliased by the device array, not copied, so the host join
is already the one copy; there the device join only adds one.

Every column in pieces of one batch is cut at the same rows; each distinct
cut (piece lengths per device: the batch's layout) costs one compilation of
the join per column kind and device (0.15-0.75 s on that TPU host), so a
stream joins on the device only layouts that recur, at most ``MAX_LAYOUTS``
(:class:`Layouts`). Uniform blocks give one or a few layouts, joined on the
device from their second batch on; blocks whose size is unrelated to the
batch size (files of any length) cut every batch at another place.

Where no layout recurs, a batch can still be joined on the device **on a
grid** (:func:`grid_cuts`, :func:`grid_chunks`): each device's rows cut into
``k`` equal chunks of at least ``GRID_MIN_BYTES``, whatever the blocks; a
chunk inside one block is transferred as it is (a view), a chunk across a
block's end is joined on the host (only its rows), and the ``k`` equal chunks
are concatenated on the device: one compilation per column kind and device,
whatever the cuts. That pays where blocks are larger than chunks (few chunks cross an end).
On the TPU v5e host, in a probe, 20 MB blocks into 16-32 MB batches went from
0.56-0.60 of a contiguous ``device_put`` joined on the host to 0.98-1.00 on a
grid of 4 MB chunks; 5 MB blocks gained nothing (most chunks cross an end),
and smaller chunks cost more than they save (1 MB: 0.54-0.58, 0.5 MB: 0.28).
In the feeder (docs/performance.md, *TPU host*), 51 MB blocks into 32 MB
batches: 0.88 against 0.65; into 16 MB batches 0.96 against 0.93. Where one device's
rows give fewer than two chunks, or more than one chunk in four crosses an
end, the column is joined on the host, unless **whole blocks** fit
(:meth:`Pieces.blocks`, :func:`join_on_device` with ``at``): the whole source
blocks that hold a device's rows are transferred as they are and the rows
cut out of them on the device at a dynamic offset, one compilation per
device and block shapes (a stream admits those that recur, as layouts).
That sends up to twice a batch's bytes, so it is used where every block is
at least ``GRID_MIN_BYTES`` and a device receives at most twice its rows:
blocks of one size smaller than a batch. TPU v5e, 10,000-row (5 MB) blocks
into 8 / 16 / 32 MB batches in the feeder: 0.54 / 0.77 / 0.83 of the limit
against 0.38-0.46 joined on the host (4 MB batches, 2.5 times the bytes,
stay on the host: 0.37).

Example:
    >>> import numpy as np
    >>> col = Pieces([np.arange(3.0), np.arange(3.0, 5.0)])
    >>> col.shape, col.dtype, len(col), col.nbytes
    ((5,), dtype('float64'), 5, 40)
    >>> [p.tolist() for p in col.rows(2, 4)]
    [[2.0], [3.0]]
    >>> col.join(np.empty).tolist()
    [0.0, 1.0, 2.0, 3.0, 4.0]
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

#: Distinct batch layouts (piece lengths per device, or whole blocks' shapes) one stream compiles, of each kind;
#: a batch of neither kind compiled is joined on a grid or on the host.
MAX_LAYOUTS = 16

#: Smallest chunk of a grid join (bytes of one column on one device): smaller transfers cost more than
#: their bytes (TPU v5e: chunks of 4 MB moved at 0.81-1.00 of a contiguous batch, of 1 MB at 0.54-0.58).
GRID_MIN_BYTES = 4 << 20


def write_rows(buf: np.ndarray, parts: Sequence[np.ndarray]) -> np.ndarray:
    """``buf`` with ``parts``' rows written into it one after another (a host join, no concatenate)."""
    at = 0
    for p in parts:
        buf[at : at + len(p)] = p
        at += len(p)
    return buf


class Pieces:
    """One column of a host batch kept as its consecutive source pieces (row ranges of source blocks).

    It has the ``shape``, ``dtype``, ``nbytes`` and length of the batch's
    column; :meth:`join` writes it into one buffer, and any numpy use of it
    (``np.asarray``, indexing) sees the joined rows.

    Args:
        parts: Arrays of one dtype and trailing shape, in row order (at least one).
        origins: For each part, the whole source block it is a row range of and
            the block row it starts at (None: unknown; see :meth:`blocks`).
    """

    __slots__ = ("dtype", "origins", "parts", "shape")

    def __init__(self, parts: Sequence[np.ndarray], origins: Sequence[tuple[np.ndarray, int]] | None = None) -> None:
        self.parts = list(parts)
        self.origins = list(origins) if origins is not None else None
        first = self.parts[0]
        self.shape = (sum(len(p) for p in self.parts), *first.shape[1:])
        self.dtype = first.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"Pieces({[len(p) for p in self.parts]} rows, {self.dtype}{list(self.shape[1:])})"

    def rows(self, start: int, stop: int) -> list[np.ndarray]:
        """The pieces (views) covering rows ``[start, stop)`` of the column, in order."""
        out, at = [], 0
        for p in self.parts:
            lo, hi = max(start, at), min(stop, at + len(p))
            if lo < hi:
                out.append(p[lo - at : hi - at])
            at += len(p)
            if at >= stop:
                break
        return out

    def blocks(self, start: int, stop: int) -> tuple[list[np.ndarray], int] | None:
        """The whole source blocks that hold rows ``[start, stop)``, and where row ``start`` is in the first.

        Their concatenation holds those rows from that offset on; None where
        the origins are unknown or the pieces are not consecutive rows of
        their blocks (a piece before another ends its block, which starts at
        its first row).

        Example:
            >>> a, b = np.arange(10), np.arange(10, 20)
            >>> col = Pieces([a[6:], b[:5]], origins=[(a, 6), (b, 0)])
            >>> blocks, at = col.blocks(1, 7)  # rows 7..12 of the source
            >>> [len(x) for x in blocks], at, np.concatenate(blocks)[at : at + 6].tolist()
            ([10, 10], 7, [7, 8, 9, 10, 11, 12])
        """
        if self.origins is None:
            return None
        out: list[np.ndarray] = []
        first = at = ends_at = 0
        for p, (block, s) in zip(self.parts, self.origins):
            lo, hi = max(start, at), min(stop, at + len(p))
            if lo < hi:
                if not out:
                    first = s + lo - at
                elif s != 0 or ends_at != len(out[-1]):  # not where the last block's rows go on
                    return None
                out.append(block)
                ends_at = s + hi - at
            at += len(p)
            if at >= stop:
                break
        return out, first

    def join(self, alloc: Callable[[tuple[int, ...], np.dtype], np.ndarray]) -> np.ndarray:
        """The column as one array: each piece written into a buffer from ``alloc``."""
        return write_rows(alloc(self.shape, self.dtype), self.parts)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        if copy is False:
            raise ValueError("a column in pieces has no array without a copy (join it)")
        out = self.join(np.empty)
        return out if dtype is None else out.astype(dtype, copy=False)

    def __getitem__(self, index: Any) -> Any:
        return np.asarray(self)[index]


def device_spans(sharding: Any, global_shape: tuple[int, ...]) -> list[tuple[Any, int, int]] | None:
    """``(device, first, stop)`` rows of this process's data that each addressable device holds.

    As ``jax.make_array_from_process_local_data`` maps them: the distinct global
    row ranges of this process's devices, in order, are consecutive in its local
    data. None where a device's shard is not a plain row range.
    """
    ranges: dict[Any, tuple[int, int]] = {}
    for device, index in sharding.addressable_devices_indices_map(global_shape).items():
        first, *rest = index if index is not None else (slice(None),)
        if first.step not in (None, 1) or any(s != slice(None) for s in rest):
            return None
        ranges[device] = (first.start or 0, global_shape[0] if first.stop is None else first.stop)
    local, at = {}, 0
    for lo, hi in sorted(set(ranges.values())):
        local[(lo, hi)] = (at, at + hi - lo)
        at += hi - lo
    return [(d, *local[r]) for d, r in sorted(ranges.items(), key=lambda kv: kv[0].id)]


@functools.cache
def _concatenate() -> Any:
    import jax
    import jax.numpy as jnp

    return jax.jit(lambda *xs: jnp.concatenate(xs, axis=0))


@functools.cache
def _window(rows: int) -> Any:
    import jax
    import jax.numpy as jnp
    from jax import lax

    return jax.jit(lambda at, *xs: lax.dynamic_slice_in_dim(jnp.concatenate(xs, axis=0), at, rows, 0))


def join_on_device(parts: list[np.ndarray], device: Any, at: int | None = None, rows: int = 0) -> Any:
    """One array on ``device`` from host ``parts``: each transferred as it is, then concatenated there.

    With ``at``, ``parts`` are whole blocks (:meth:`Pieces.blocks`): the array
    is their ``rows`` rows from row ``at`` on, cut on the device (compiled
    once per block shapes, whatever ``at``).
    """
    import jax

    arrays = jax.device_put(parts, device)
    if at is not None:
        return _window(rows)(np.int32(at), *arrays)
    return arrays[0] if len(arrays) == 1 else _concatenate()(*arrays)


def grid_cuts(rows: int, row_bytes: int, min_bytes: int = GRID_MIN_BYTES) -> int:
    """Into how many equal chunks a grid join cuts ``rows`` rows (1: too few bytes for a grid).

    The most chunks, a power of two dividing ``rows``, each of at least ``min_bytes``.

    Example:
        >>> grid_cuts(32768, 512), grid_cuts(32768, 512, min_bytes=1 << 20)  # 16 MB of rows
        (4, 16)
        >>> grid_cuts(8192, 512), grid_cuts(999, 1 << 20)  # 2 MB chunks would be too small; an odd count
        (1, 1)
    """
    k = 1
    while rows % (2 * k) == 0 and rows // (2 * k) * row_bytes >= min_bytes:
        k *= 2
    return k


def grid_chunks(col: Pieces, start: int, stop: int, k: int) -> list[list[np.ndarray]]:
    """Rows ``[start, stop)`` of ``col`` as ``k`` equal chunks, each the pieces (views) that cover it.

    Example:
        >>> col = Pieces([np.arange(5), np.arange(5, 8)])
        >>> [[p.tolist() for p in chunk] for chunk in grid_chunks(col, 0, 8, 4)]
        [[[0, 1]], [[2, 3]], [[4], [5]], [[6, 7]]]
    """
    size = (stop - start) // k
    return [col.rows(start + i * size, start + (i + 1) * size) for i in range(k)]


class Layouts:
    """Which join layouts a stream compiles: those that recur (see the module docstring).

    A layout is compiled (admitted) once it has been seen twice and accounts
    for at least ``1/limit`` of the batches so far, while fewer than ``limit``
    are compiled: uniform blocks compile one or a few layouts from the second
    batch on; a batch size unrelated to the block size, whose layouts rarely
    repeat, compiles none (each compilation costs 0.15-0.75 s on a TPU v5e host).

    Example:
        >>> seen = Layouts(limit=2)
        >>> [seen.admit("a") for _ in range(3)]  # the second sighting compiles it
        [False, True, True]
        >>> [seen.admit("b") for _ in range(3)]  # once it is 1/2 of the batches so far
        [False, False, True]
        >>> [seen.admit("c") for _ in range(4)], seen.refused  # two compiled already: the limit
        ([False, False, False, False], 7)
    """

    def __init__(self, limit: int = MAX_LAYOUTS, track: int = 4096) -> None:
        self.limit = limit
        self.track = track  # distinct layouts counted at most (others count towards the total only)
        self._known: set[Any] = set()
        self._seen: dict[Any, int] = {}
        self._total = 0
        self.refused = 0  # batches of no compiled layout: joined on a grid or on the host (for tests and benchmarks)

    @property
    def mostly_refused(self) -> bool:
        """Whether most batches so far had no compiled layout (past the first few): a stream to join on a grid."""
        return self.refused >= 4 and 2 * self.refused > self._total

    @property
    def compiled(self) -> int:
        """Layouts admitted (each one compilation of the join, per device that joins)."""
        return len(self._known)

    def admit(self, key: Any) -> bool:
        """Whether to join a batch of layout ``key`` on the device (compiling it if new)."""
        self._total += 1
        if key in self._known:
            return True
        seen = self._seen.get(key, 0) + 1
        if seen > 1 or len(self._seen) < self.track:
            self._seen[key] = seen
        if seen >= 2 and seen * self.limit >= self._total and len(self._known) < self.limit:
            self._known.add(key)
            return True
        self.refused += 1
        return False
