"""Host staging buffers for the feeder (private): 64-byte-aligned allocations and a reuse ring.

A batch that spans several source blocks is assembled by writing each block's
rows straight into one staging buffer (no ``np.concatenate`` of the pieces).
The buffers are 64-byte aligned (:func:`aligned_empty`): on the CPU platform
JAX then aliases a host buffer instead of copying it (``np.empty`` alone
gives 16-byte alignment for large arrays, which JAX copies).

A :class:`StagingRing` lends the same few buffers again once nothing
references them any more: not a batch the consumer holds (on CPU devices the
``jax.Array`` *is* the staging buffer), nor a transfer still reading it. JAX
holds the host array it copies from until that copy is done: on a TPU v5e
``device_put`` returns in ~0.5 ms and reads the buffer for up to ~20 ms
after (rewriting it at once corrupted 15-20 batches of 20), and its
reference to the buffer goes once the copy is done, whether the batch was
kept or donated to a step. The ring never asks the
consumer's arrays anything: a consumer may delete or donate them on its
own thread at any moment (asking a deleted array whether it is ready
crashes jaxlib 0.10).

Once a stream is under way, batches are written into memory
already paged in: writing a 32 MB batch into a fresh buffer took ~4 ms on a
2-core VM against ~1.8 ms into a reused one, and 15-25 ms at times when the
kernel compacted memory for huge pages. Columns of Python objects get a
plain ``np.empty`` (never aliased, never reused).

When a stream ends on an accelerator, the buffers of its ring are kept
for the next streams of the process, each lent once nothing references it (:data:`SPARES`, at most ``SPARE_BYTES``,
or the MiB that the environment variable ``RAYSLICE_STAGING_SPARES_MB``
gives, read at the process's first feeder; 0 keeps none): fresh memory
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
    >>> np.shares_memory(ring.alloc((4,), np.dtype("int32")), b)  # still referenced: never lent twice
    False
    >>> ptr = b.ctypes.data
    >>> del b  # its last reader is gone
    >>> ring.alloc((4,), np.dtype("int32")).ctypes.data == ptr
    True
    >>> ring.release()  # the stream is over: its buffers are kept for the next one
    >>> StagingRing(depth=2).alloc((4,), np.dtype("int32")).ctypes.data == ptr
    True
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator

import numpy as np

ALIGN = 64  # bytes; what JAX's CPU client needs to alias a host buffer instead of copying it

#: Staging buffers of finished streams a process keeps for its next streams, in bytes (the oldest are freed first).
SPARE_BYTES = 1 << 30
#: The environment variable that sets that, in MiB (0: none kept).
SPARES_ENV = "RAYSLICE_STAGING_SPARES_MB"


def spare_limit() -> int:
    """Bytes of finished streams' staging buffers to keep: ``RAYSLICE_STAGING_SPARES_MB`` MiB, else ``SPARE_BYTES``.

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

        raise fail(SPARES_ENV, raw, "a whole number of MiB >= 0 (0 keeps no staging buffers between streams)")
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


class Spares:
    """Staging buffers of finished streams, lent to the next streams of the process (thread-safe).

    Holds at most ``limit`` bytes; past that the oldest are dropped (freed by
    the garbage collector). A finished stream hands over all its buffers,
    also those something still references (a transfer still reading one):
    :meth:`take` lends only a buffer nothing references any more, as
    :meth:`StagingRing.alloc` does.

    Args:
        limit: Bytes kept at most (None: :func:`spare_limit`, read on first use).

    Example:
        >>> spares = Spares(limit=64)
        >>> i8 = np.dtype("int64")
        >>> a, b = aligned_empty((6,), i8), aligned_empty((6,), i8)  # 48 bytes each
        >>> spares.give(a); spares.give(b)  # the oldest goes: 96 bytes > 64
        >>> spares.nbytes, spares.take((6,), i8) is b, spares.take((6,), i8)
        (48, True, None)
        >>> spares.give(a); reader = a[2:]  # a reader still holds part of it
        >>> spares.take((6,), i8) is None, spares.nbytes
        (True, 48)
        >>> del reader
        >>> spares.take((6,), i8) is a, spares.nbytes
        (True, 0)
    """

    def __init__(self, limit: int | None = None) -> None:
        self._limit = limit
        self.nbytes = 0
        self._bufs: list[np.ndarray] = []  # oldest first
        # Re-entrant, with a flag: the garbage collector may run an iterator's finalizer (which hands its
        # ring's buffers over) on a thread inside take() or give(), at any allocation there. That call
        # keeps nothing (it neither waits for the lock this thread holds nor changes the list in use).
        self._lock = threading.RLock()
        self._busy = False

    @property
    def limit(self) -> int:
        """Bytes kept at most (the environment's is checked here: a bad value raises, naming it)."""
        if self._limit is None:
            self._limit = spare_limit()
        return self._limit

    @contextlib.contextmanager
    def _held(self) -> Iterator[bool]:
        """The lock, and whether this call may use the list: False where it re-entered (see __init__)."""
        with self._lock:
            if self._busy:
                yield False
                return
            self._busy = True
            try:
                yield True
            finally:
                self._busy = False

    def give(self, buf: np.ndarray) -> None:
        """Keeps ``buf`` (a finished stream's staging buffer) for a later stream (not when re-entered)."""
        limit = self.limit
        with self._held() as usable:
            if not usable:
                return
            self._bufs.append(buf)
            self.nbytes += buf.nbytes
            while self.nbytes > limit:
                self.nbytes -= self._bufs.pop(0).nbytes

    def take(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray | None:
        """A kept buffer of ``shape`` and ``dtype`` that nothing else references (the most recent), or None."""
        with self._held() as usable:
            if not usable:
                return None
            for i in range(len(self._bufs) - 1, -1, -1):
                buf = self._bufs[i]
                if buf.shape == shape and buf.dtype == dtype and _unreferenced(buf):
                    del self._bufs[i]
                    self.nbytes -= buf.nbytes
                    return buf
        return None

    def clear(self) -> None:
        """Frees every kept buffer."""
        with self._lock:
            self._bufs.clear()
            self.nbytes = 0


#: The process's staging buffers of finished streams (see the module docstring).
SPARES = Spares()


class StagingRing:
    """Up to ``depth`` reusable aligned buffers per (shape, dtype), lent again once nothing references them.

    Every view of a buffer (the batch's arrays, those through which JAX
    aliases it on CPU devices, and the host arrays a transfer still reads)
    holds a reference to the buffer's memory, so its reference count says
    when the last reader is gone: ``alloc`` lends such a buffer again (no page
    faults of fresh memory, which cost a large batch several times its
    copy), else one from ``spares`` (buffers of finished streams), else a
    fresh one. Thread-safe: the feeder's thread allocates, the consumer's
    may release. :meth:`release` hands the buffers to ``spares`` once the
    stream is over.

    Example:
        >>> ring = StagingRing(depth=2, spares=None)
        >>> a = ring.alloc((4,), np.dtype("int32"))
        >>> view = a[1:]  # a reader of part of it
        >>> ptr = a.ctypes.data
        >>> del a
        >>> ring.alloc((4,), np.dtype("int32")).ctypes.data == ptr  # still read through the view
        False
        >>> del view
        >>> ring.alloc((4,), np.dtype("int32")).ctypes.data == ptr
        True
    """

    def __init__(self, depth: int, spares: Spares | None = SPARES) -> None:
        self.depth = max(1, depth)
        self.spares = spares
        if spares is not None:
            spares.limit  # noqa: B018  # a bad RAYSLICE_STAGING_SPARES_MB is refused now, before any stream starts
        self._pools: dict[tuple, list[np.ndarray]] = {}  # aligned buffers per (shape, dtype), oldest first
        self._lock = threading.Lock()
        self.allocated = 0  # new buffers in this ring: fresh or spare (for tests and benchmarks)
        self.from_spares = 0  # of which a finished stream's
        self.reused = 0  # buffers lent again

    def alloc(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        shape, dtype = tuple(shape), np.dtype(dtype)
        if dtype.hasobject:  # references, not data: never aliased, never reused
            return np.empty(shape, dtype)
        key = (shape, dtype)  # the dtype itself: ml_dtypes' float8/int4 kinds share one dtype.str ('<V1')
        with self._lock:
            out, tracked = self._idle(key), bool(self._pools.get(key))
        if out is None and (tracked or (self.spares is not None and self.spares.nbytes)):
            # JAX drops its references to host arrays (finished copies, freed arrays) in batches, at the
            # next garbage collection or when asked: ask (outside the lock: what that frees may run code
            # that reaches this ring), then look again (a few microseconds).
            _release_jax_references()
            with self._lock:
                out = self._idle(key)
        if out is None:
            with self._lock:
                out = self._new(key)
        return out

    def _idle(self, key: tuple) -> np.ndarray | None:
        """A view of an unreferenced buffer of ``key``, now the newest (call with the lock held)."""
        pool = self._pools.get(key, [])
        free = self._free(pool)
        if free is None:
            return None
        buf = pool.pop(free)
        pool.append(buf)
        self.reused += 1
        return buf.view()  # see _new

    def _new(self, key: tuple) -> np.ndarray:
        """A view of a spare buffer of ``key``, else of a fresh one (call with the lock held)."""
        spare = self.spares.take(*key) if self.spares is not None else None
        buf = spare if spare is not None else aligned_empty(*key)
        self.allocated += 1
        self.from_spares += spare is not None
        pool = self._pools.setdefault(key, [])
        pool.append(buf)
        if len(pool) > self.depth:
            pool.pop(0)  # stop tracking the oldest: freed once its last reader is gone
        # A new array object over the same memory, made under the lock (a reference before any release() could
        # hand the buffer on): JAX caches some conversions (e.g. int64 -> int32) by the array object, and must
        # not see the old batch again (nor a spare's other stream).
        return buf.view()

    def _free(self, pool: list[np.ndarray]) -> int | None:
        for i, buf in enumerate(pool):  # oldest first
            if _unreferenced(buf):
                return i
        return None

    def release(self) -> None:
        """The stream is over: its buffers go to ``spares``; the ring forgets them all.

        A buffer still referenced (a transfer still reading it) goes too:
        ``spares`` lends it only once its last reader is gone. Idempotent;
        the ring may still lend fresh buffers.
        """
        with self._lock:
            pools, self._pools = self._pools, {}
        if self.spares is None:
            return
        for pool in pools.values():
            for buf in pool:
                self.spares.give(buf)


def _memory_refs(buf: np.ndarray) -> int:
    """The reference count of the memory behind ``buf`` (an :func:`aligned_empty` view): its views and holders."""
    memory = buf.base
    return sys.getrefcount(memory)


_UNREFERENCED = _memory_refs(aligned_empty((1,), np.dtype("uint8")))  # the count of memory only its buffer holds


def _unreferenced(buf: np.ndarray) -> bool:
    """Whether nothing but ``buf`` itself (an :func:`aligned_empty` view) references its memory."""
    return _memory_refs(buf) == _UNREFERENCED


def _release_jax_references() -> None:
    """Has jaxlib drop the Python references it still holds for arrays already freed."""
    xla_client = sys.modules.get("jaxlib.xla_client")  # never imported here (nor at the interpreter's exit)
    if xla_client is None:  # no JAX in this process: nothing can hold a buffer
        return
    collect = getattr(getattr(xla_client, "_xla", None), "collect_garbage", None)
    if collect is not None:
        collect()
