"""Host staging buffers for the feeder (private): 64-byte-aligned allocations and a reuse ring.

A batch that spans several source blocks is assembled by writing each block's
rows straight into one staging buffer (no ``np.concatenate`` of the pieces).
Two kinds of buffer:

* **aligned, lent again once unreferenced** (:class:`AliasPool`): on the CPU
  platform JAX aliases a host buffer that is 64-byte aligned
  (:func:`aligned_empty`) instead of copying it, so the ``jax.Array`` the
  consumer gets *is* the staging buffer; it must not be written again while
  anything references it, which its reference count tells. ``np.empty``
  alone gives 16-byte alignment for large arrays, which JAX copies.
* **reused after the copy** (:class:`StagingRing`): where the transfer copies
  the buffer (accelerators, or pinned staging), the same few buffers are
  reused once the copy that read them has finished (a TPU reads the buffer
  after ``device_put`` returns), also where the step donated the batch.

Either way, once a stream is under way, batches are written into memory
already paged in: writing a 32 MB batch into a fresh buffer took ~4 ms on a
2-core VM against ~1.8 ms into a reused one, and 15-25 ms at times when the
kernel compacted memory for huge pages. Columns of Python objects get a
plain ``np.empty`` (never aliased, never reused).

When a stream ends, the idle buffers of its ring are kept for the next
stream of the process (:data:`SPARES`, at most ``SPARE_BYTES``, or the MiB
that the environment variable ``RAYSLICE_STAGING_SPARES_MB`` gives, read at
the process's first feeder; 0 keeps none): fresh memory
costs far more than its copy on some hosts. On a TPU v5e host (no
transparent huge pages) writing 32 MB into fresh memory took 38-45 ms
against 2.5-3.7 ms into memory already paged in (16 MB: 5.5 against 1.5 ms;
``MAP_POPULATE`` only moved the cost: 27 ms), so a short stream spent most of
its time faulting in its ring (docs/performance.md, *TPU host*).

Example:
    >>> import numpy as np
    >>> a = aligned_empty((3, 5), np.dtype("float32"))
    >>> a.ctypes.data % ALIGN, a.shape, a.flags.c_contiguous
    (0, (3, 5), True)
    >>> ring = StagingRing(depth=2)
    >>> b = ring.alloc((4,), np.dtype("int32"))
    >>> np.shares_memory(ring.alloc((4,), np.dtype("int32")), b)  # lent, not sealed: never lent twice
    False
    >>> ring.seal({"x": b}, {"x": None})  # its copy is done (None: nothing to wait for)
    >>> np.shares_memory(ring.alloc((4,), np.dtype("int32")), b)
    True
    >>> ring.seal({"x": b}, {"x": None})
    >>> ring.release()  # the stream is over: its idle buffers are kept for the next one
    >>> np.shares_memory(StagingRing(depth=2).alloc((4,), np.dtype("int32")), b)
    True
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np

ALIGN = 64  # bytes; what JAX's CPU client needs to alias a host buffer instead of copying it

#: Idle staging buffers a process keeps for its next stream, in bytes (the oldest are freed first).
SPARE_BYTES = 1 << 30
#: The environment variable that sets that, in MiB (0: none kept).
SPARES_ENV = "RAYSLICE_STAGING_SPARES_MB"


def spare_limit() -> int:
    """Bytes of idle staging buffers to keep: ``RAYSLICE_STAGING_SPARES_MB`` MiB, else ``SPARE_BYTES``.

    Example:
        >>> spare_limit() == SPARE_BYTES or SPARES_ENV in os.environ
        True
    """
    raw = os.environ.get(SPARES_ENV)
    if raw is None:
        return SPARE_BYTES
    try:
        mb = int(raw)
    except ValueError:
        mb = -1
    if mb < 0:
        from rayslice._validate import fail

        raise fail(SPARES_ENV, raw, "a whole number of MiB >= 0 (0 keeps no idle staging buffers between streams)")
    return mb << 20


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype, align: int = ALIGN) -> np.ndarray:
    """An uninitialized C-contiguous array whose data starts on an ``align``-byte boundary."""
    dtype = np.dtype(dtype)
    if dtype.hasobject:  # references, not data: no byte buffer can hold them (nor can a device)
        return np.empty(shape, dtype)
    return _aligned_view(_raw(shape, dtype, align), shape, dtype, align)


def _raw(shape: tuple[int, ...], dtype: np.dtype, align: int = ALIGN) -> np.ndarray:
    """The bytes behind an aligned array of ``shape`` and ``dtype`` (``align`` bytes of slack)."""
    return np.empty(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize + align, dtype=np.uint8)


def _aligned_view(raw: np.ndarray, shape: tuple[int, ...], dtype: np.dtype, align: int = ALIGN) -> np.ndarray:
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    off = (-raw.ctypes.data) % align
    return raw[off : off + nbytes].view(dtype).reshape(shape)


def is_aligned(a: np.ndarray, align: int = ALIGN) -> bool:
    return a.ctypes.data % align == 0


class _Entry:
    __slots__ = ("buf", "guard", "lent", "orphan")

    def __init__(self, buf: np.ndarray) -> None:
        self.buf, self.lent = buf, True
        self.guard: tuple[Any, ...] = ()  # the handles of the transfer that reads buf (see _readers)
        self.orphan = False  # its batch was deleted before its copy was seen done (see StagingRing._state)


# What the ring knows of the transfer that reads a buffer (:func:`_state`).
_RUNNING, _DONE, _DELETED = "running", "done", "deleted"


def _readers(guard: Any) -> tuple[Any, ...]:
    """The ring's own handles on the transfer ``guard`` (a ``jax.Array``; None: nothing to wait for).

    Never the consumer's array object itself: a consumer may donate or delete
    that array on its own thread at any moment, also between two questions
    of the ring (``is_deleted``, then ``is_ready``), and in jaxlib 0.10 asking
    a donated array whether it is ready raises, and asking one deleted by
    ``delete()`` crashes the process. Views of the array's per-device buffers
    see the deletion too, but as an error the ring catches. Objects without
    shards (tests' stand-ins) are asked as they are.
    """
    if guard is None:
        return ()
    shards = getattr(guard, "addressable_shards", None)
    if shards is None:
        return (guard,)
    return tuple(s.data for s in shards)


def _state(readers: tuple[Any, ...]) -> str:
    """Whether the transfer read by ``readers`` is running, done, or deleted (e.g. donated to a step).

    A deleted transfer says nothing of its state any more (see
    :meth:`StagingRing._state` for what the ring does then).
    """
    running = False
    for r in readers:
        deleted = getattr(r, "is_deleted", None)
        try:
            if deleted is not None and deleted():
                return _DELETED
            ready = getattr(r, "is_ready", None)
            running = running or (ready is not None and not ready())
        except RuntimeError:  # deleted between the two questions (jax.errors.JaxRuntimeError)
            return _DELETED
    return _RUNNING if running else _DONE


class Spares:
    """Idle staging buffers of finished streams, lent to the next streams of the process (thread-safe).

    Holds at most ``limit`` bytes; past that the oldest are dropped (freed by
    the garbage collector). A buffer is handed over only once nothing reads
    or writes it (see :meth:`StagingRing.release`).

    Args:
        limit: Bytes kept at most (None: :func:`spare_limit`, read on first use).

    Example:
        >>> spares = Spares(limit=64)
        >>> a, b = np.zeros(6, np.int64), np.ones(6, np.int64)  # 48 bytes each
        >>> spares.give(a); spares.give(b)  # the oldest goes: 96 bytes > 64
        >>> spares.nbytes, spares.take((6,), np.dtype("int64")) is b, spares.take((6,), np.dtype("int64"))
        (48, True, None)
    """

    def __init__(self, limit: int | None = None) -> None:
        self._limit = limit
        self.nbytes = 0
        self._bufs: list[np.ndarray] = []  # oldest first
        self._lock = threading.Lock()

    @property
    def limit(self) -> int:
        """Bytes kept at most (the environment's is checked here: a bad value raises, naming it)."""
        if self._limit is None:
            self._limit = spare_limit()
        return self._limit

    def give(self, buf: np.ndarray) -> None:
        """Keeps ``buf`` (an idle staging buffer) for a later stream."""
        limit = self.limit
        with self._lock:
            self._bufs.append(buf)
            self.nbytes += buf.nbytes
            while self.nbytes > limit:
                self.nbytes -= self._bufs.pop(0).nbytes

    def take(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray | None:
        """A kept buffer of ``shape`` and ``dtype`` (the most recently used), or None."""
        with self._lock:
            for i in range(len(self._bufs) - 1, -1, -1):
                buf = self._bufs[i]
                if buf.shape == shape and buf.dtype == dtype:
                    del self._bufs[i]
                    self.nbytes -= buf.nbytes
                    return buf
        return None

    def clear(self) -> None:
        """Frees every kept buffer."""
        with self._lock:
            self._bufs.clear()
            self.nbytes = 0


#: The process's idle staging buffers (see the module docstring).
SPARES = Spares()


class StagingRing:
    """Up to ``depth`` reusable aligned buffers per (shape, dtype).

    ``alloc`` lends a buffer; ``seal`` says which transfer (a ``jax.Array``
    with ``is_ready()``) reads it; the buffer is lent again only once that
    transfer is done (or, where the consumer deleted or donated the batch
    before that was seen, once nothing references the buffer any more:
    :meth:`_state`). A buffer never sealed (e.g. a cast replaced it) is
    simply forgotten when the ring is full, never reused.
    A new buffer comes from ``spares`` (buffers of finished streams) where
    one fits, else from fresh memory; :meth:`release` hands the ring's idle
    buffers back there once its stream is over.
    """

    def __init__(self, depth: int, spares: Spares | None = SPARES) -> None:
        self.depth = max(1, depth)
        self.spares = spares
        if spares is not None:
            spares.limit  # noqa: B018  # a bad RAYSLICE_STAGING_SPARES_MB is refused now, before any stream starts
        self._pools: dict[tuple, list[_Entry]] = {}
        self._lock = threading.Lock()  # the feeder's thread allocates; the consumer's may release
        self._unreferenced = _memory_refs(aligned_empty((1,), np.dtype("uint8")))  # of memory only its buffer holds
        self.allocated = 0  # new buffers in this ring: fresh or spare (for tests and benchmarks)
        self.from_spares = 0  # of which a finished stream's

    def _state(self, e: _Entry) -> str:
        """Whether the copy that reads the idle buffer of ``e`` is done (then the buffer may be written again).

        Asked of the copy's own handles while its batch lives; once it was seen
        done, that is remembered (the batch may be donated later). A batch
        deleted or donated (``donate_argnums``) before its copy was seen done
        no longer tells: then the buffer is done once nothing references it.
        JAX holds a reference to the host array it copies from until the copy
        is done (on a TPU v5e it reads the buffer after ``device_put``
        returns, and lets go of it once the copy is done, donated or not).
        """
        if not e.orphan:
            state = _state(e.guard)
            if state != _DELETED:
                if state == _DONE:
                    e.guard = ()  # known done: a later deletion of its batch changes nothing
                return state
            e.guard, e.orphan = (), True
        if e.buf.base is None:  # not one of aligned_empty's views: no reference count to go by
            return _RUNNING
        if _memory_refs(e.buf) == self._unreferenced:
            return _DONE
        _release_jax_references()  # JAX lets go of finished copies' arrays in batches: now, then look again
        return _DONE if _memory_refs(e.buf) == self._unreferenced else _RUNNING

    def alloc(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        shape, dtype = tuple(shape), np.dtype(dtype)
        with self._lock:
            # Keyed by the dtype itself: ml_dtypes' float8/int4 kinds share one dtype.str ('<V1').
            pool = self._pools.setdefault((shape, dtype), [])
            idle = None
            for e in pool:  # oldest first; every copy is asked, so that one done is known done before it is deleted
                if not e.lent and (idle is None or not e.orphan) and self._state(e) == _DONE:
                    idle = idle or e
            if idle is not None:
                pool.remove(idle)
                pool.append(idle)
                idle.lent, idle.guard, idle.orphan = True, (), False
                # A new array object over the same memory: JAX caches some conversions (e.g.
                # int64 -> int32) by the array object, and must not see the old batch again.
                return idle.buf.view()
            spare = self.spares.take(shape, dtype) if self.spares is not None else None
            buf = spare if spare is not None else aligned_empty(shape, dtype)
            self.allocated += 1
            self.from_spares += spare is not None
            pool.append(_Entry(buf))
            if len(pool) > self.depth:
                pool.pop(0)  # stop tracking the oldest: the garbage collector frees it once unused
            return buf.view()  # a spare was another stream's batch: a new array object too, as above

    def seal(self, batch: Mapping[str, np.ndarray], guards: Mapping[str, Any]) -> None:
        """Marks the buffers of ``batch`` as read by ``guards[column]`` (a transfer, or None when done)."""
        for k, a in batch.items():
            self.read_by(a, guards.get(k))

    def read_by(self, buf: np.ndarray, guard: Any) -> None:
        """Marks ``buf``, if it is a buffer this ring lent, as read by ``guard`` (None: done).

        Call it before the consumer can see ``guard`` (see :func:`_readers`).
        """
        with self._lock:
            for e in self._pools.get((buf.shape, buf.dtype), ()):
                if e.lent and e.buf.ctypes.data == buf.ctypes.data:
                    e.lent, e.guard = False, _readers(guard)
                    break

    def release(self) -> None:
        """The stream is over: idle buffers whose transfer is done go to ``spares``; the ring forgets them all.

        A buffer still lent (being written, or never sealed) or whose
        transfer is unfinished or was deleted stays out of ``spares``: it is
        freed once unused. Idempotent; the ring may still lend fresh buffers.
        """
        with self._lock:
            pools, self._pools = self._pools, {}
        if self.spares is None:
            return
        for pool in pools.values():
            for e in pool:
                if not e.lent and self._state(e) == _DONE:
                    self.spares.give(e.buf)


def _memory_refs(buf: np.ndarray) -> int:
    """The reference count of the memory behind ``buf`` (an :func:`aligned_empty` view): its views and holders."""
    memory = buf.base
    return sys.getrefcount(memory)


def _refs(pool: list[np.ndarray], i: int) -> int:
    return sys.getrefcount(pool[i])


def _release_jax_references() -> None:
    """Has jaxlib drop the Python references it still holds for arrays already freed."""
    try:
        from jaxlib import xla_client
    except ImportError:  # no JAX here: nothing can hold a buffer
        return
    collect = getattr(getattr(xla_client, "_xla", None), "collect_garbage", None)
    if collect is not None:
        collect()


class AliasPool:
    """Up to ``depth`` aligned buffers per (shape, dtype), for devices that alias host memory (CPU).

    There the ``jax.Array`` a consumer gets *is* the staging buffer, held for as
    long as the consumer keeps it, so a buffer cannot be lent again after a
    fixed number of batches. Every view of a buffer (the batch's arrays, and
    those through which JAX aliases it) holds a reference to the buffer's base
    array, so the base's reference count says when the last reader is gone:
    ``alloc`` lends such a buffer again (no page faults of fresh memory, which
    cost a large batch several times its copy), else a fresh one.

    Example:
        >>> pool = AliasPool(depth=2)
        >>> a = pool.alloc((4,), np.dtype("int32"))
        >>> np.shares_memory(pool.alloc((4,), np.dtype("int32")), a)  # still referenced: never lent twice
        False
        >>> ptr = a.ctypes.data
        >>> del a  # its last reader is gone
        >>> pool.alloc((4,), np.dtype("int32")).ctypes.data == ptr
        True
    """

    def __init__(self, depth: int) -> None:
        self.depth = max(1, depth)
        self._pools: dict[tuple, list[np.ndarray]] = {}
        self.allocated = 0  # fresh buffers made (for tests and benchmarks)
        self.reused = 0
        probe = [np.empty(1, dtype=np.uint8)]
        self._idle = _refs(probe, 0)  # the count of a base that only the pool references

    def alloc(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        shape = tuple(shape)
        if dtype.hasobject:
            return aligned_empty(shape, dtype)
        pool = self._pools.setdefault((shape, dtype), [])
        free = self._free(pool)
        if free is None and pool:
            # JAX drops its references to the host buffers of freed arrays in batches (at the next
            # garbage collection, or when asked): ask, then look again (a few microseconds).
            _release_jax_references()
            free = self._free(pool)
        if free is not None:
            raw = pool.pop(free)
            pool.append(raw)
            self.reused += 1
            return _aligned_view(raw, shape, dtype)
        raw = _raw(shape, dtype)
        self.allocated += 1
        pool.append(raw)
        if len(pool) > self.depth:
            pool.pop(0)  # stop tracking the oldest: freed once its last reader is gone
        return _aligned_view(raw, shape, dtype)

    def clear(self) -> None:
        """Forgets every buffer (the stream is over): each is freed once its last reader is gone."""
        self._pools.clear()

    def _free(self, pool: list[np.ndarray]) -> int | None:
        for i in range(len(pool)):  # oldest first
            if _refs(pool, i) == self._idle:
                return i
        return None
