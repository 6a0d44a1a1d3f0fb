"""DMA straight from Ray's object store (private): CUDA host registration of the store's shared memory.

A batch inside one Ray block is a zero-copy view of the object store, which
every worker maps as one shared-memory region (``/dev/shm/plasma…``).
Pageable memory reaches a GPU at a fraction of the wire's rate (the runtime
copies it into pinned memory first, on one thread), and copying it into
pinned staging buffers costs as much host memory bandwidth as the DMA
itself. Registering the whole store mapping with CUDA (``cudaHostRegister``,
portable, once per process) makes every object in it pinned memory:
``device_put`` of a view is then a DMA at the wire's rate, with no host copy.

What is registered: only Ray's main store mapping (a shared ``plasma…``
file, in ``/dev/shm`` unless that is too small, see :func:`is_ray_store`;
Ray keeps it mapped for as long as the worker lives), whole, once, and only up to 64 GiB
(registering commits every page of it; Ray has already set that memory
aside for the store). Nothing else is: not Ray's fallback allocations
(files elsewhere, unmapped once unused), not a user's ``np.memmap`` or
shared memory. Anything not covered is reported as such and the feeder
sends it another way. The CUDA runtime is the one JAX's CUDA plugin has
loaded (found among this process's mappings), so no other GPU library is
needed. Any failure (no runtime, a refused registration) only turns the
fast path off, with the reason kept in :attr:`StorePinning.failure`.

Example:
    >>> m = parse_maps_line("7f00a0000000-7f00b0000000 rw-s 00000000 00:1a 42 /dev/shm/plasmaXyZ (deleted)")
    >>> hex(m.start), m.size >> 20, m.shared, is_ray_store(m)
    ('0x7f00a0000000', 256, True, True)
    >>> is_ray_store(parse_maps_line("7f00a0000000-7f00b0000000 rw-s 00000000 00:1a 42 /data/rows.npy"))
    False
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import threading
import time
from typing import Any

import numpy as np

_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context of the process
#: A larger store is not registered: registering pins (and so commits) all of its pages, ~20 GB/s.
MAX_BYTES = 64 << 30


@dataclasses.dataclass(frozen=True)
class Mapping:
    """One line of ``/proc/self/maps``."""

    start: int
    end: int
    shared: bool
    path: str

    @property
    def size(self) -> int:
        return self.end - self.start


def parse_maps_line(line: str) -> Mapping:
    fields = line.split(maxsplit=5)
    lo, hi = fields[0].split("-")
    return Mapping(int(lo, 16), int(hi, 16), fields[1][3:4] == "s", fields[5].strip() if len(fields) > 5 else "")


def _plasma(m: Mapping) -> bool:
    return m.shared and os.path.basename(m.path.removesuffix(" (deleted)")).startswith("plasma")


def is_ray_store(m: Mapping, others: list[Mapping] | None = None) -> bool:
    """Whether ``m`` is Ray's main object store mapping.

    That is a shared ``plasma…`` file in ``/dev/shm``; where ``/dev/shm`` is too
    small Ray puts it elsewhere (e.g. ``/tmp``), beside its fallback allocations
    (also ``plasma…`` files, made when the store is full and unmapped once
    unused): then it is the one at least twice as large as every other
    ``plasma…`` mapping in ``others`` (this process's mappings).
    """
    if not _plasma(m):
        return False
    if m.path.startswith("/dev/shm/"):
        return True
    rivals = [o for o in (others or []) if _plasma(o) and (o.start, o.end) != (m.start, m.end)]
    return all(m.size >= 2 * o.size for o in rivals)


def all_mappings() -> list[Mapping]:
    """This process's mappings (none where ``/proc/self/maps`` cannot be read)."""
    try:
        with open("/proc/self/maps") as f:
            return [parse_maps_line(line) for line in f]
    except OSError:
        return []


def mapping_of(address: int, maps: list[Mapping] | None = None) -> Mapping | None:
    """The mapping holding ``address`` among ``maps`` (default: this process's; None where none does)."""
    return next((m for m in (all_mappings() if maps is None else maps) if m.start <= address < m.end), None)


def _cudart() -> Any:
    """The CUDA runtime this process has loaded (JAX's), else one the loader finds; None without CUDA."""
    paths = [m.path for m in all_mappings() if "libcudart.so" in m.path]
    for name in [*dict.fromkeys(paths), "libcudart.so.13", "libcudart.so.12", "libcudart.so"]:
        try:
            lib = ctypes.CDLL(name)
            lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
            lib.cudaHostRegister.restype = ctypes.c_int
            lib.cudaSetDevice.argtypes = [ctypes.c_int]
            lib.cudaSetDevice.restype = ctypes.c_int
            lib.cudaGetErrorString.argtypes = [ctypes.c_int]
            lib.cudaGetErrorString.restype = ctypes.c_char_p
            lib.cudaGetLastError.restype = ctypes.c_int
        except (OSError, AttributeError):  # not there, or not a CUDA runtime
            continue
        return lib
    return None


def _cuda_register(lib: Any, address: int, size: int, device: int | None) -> str | None:
    """Registers ``size`` bytes at ``address`` on ``device``'s context; None, or the error."""
    if device is not None:
        code = lib.cudaSetDevice(device)  # this thread's device: no context made on another GPU
        if code:
            lib.cudaGetLastError()
            return f"cudaSetDevice({device}): {lib.cudaGetErrorString(code).decode()}"
    code = lib.cudaHostRegister(ctypes.c_void_p(address), size, _PORTABLE)
    if code:
        lib.cudaGetLastError()  # leave no sticky error behind for other CUDA users of this thread
        return f"cudaHostRegister: {lib.cudaGetErrorString(code).decode()}"
    return None


def _owns_its_memory(a: np.ndarray) -> bool:
    """Whether ``a``'s memory is a numpy allocation (never the store's: store views wrap a foreign buffer)."""
    base: Any = a
    while isinstance(base, np.ndarray):
        if base.flags.owndata:
            return True
        base = base.base
    return False


class StorePinning:
    """Registers Ray's store mapping with CUDA on first use; says whether an array lies in it.

    Args:
        register: ``(address, size, device) -> None or an error`` (None: the CUDA
            runtime's ``cudaHostRegister``, loaded on first use); for tests.
        accept: ``(mapping, all of this process's mappings) -> bool``: which mappings may
            be registered (default: Ray's main store, :func:`is_ray_store`).
        max_bytes: The largest mapping registered.

    Attributes:
        registered: ``(start, end)`` of every mapping registered by this process.
        seconds: Time spent registering, in all.
        failure: The last reason a mapping was not registered (None while every one was).
    """

    def __init__(self, register: Any = None, accept: Any = None, max_bytes: int = MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._register = register
        self._accept = accept or is_ray_store
        self._lock = threading.Lock()
        self.registered: list[tuple[int, int]] = []
        self._elsewhere: list[tuple[int, int]] = []  # mappings seen and not registered (private, refused...)
        self.seconds = 0.0
        self.failure: str | None = None
        self._off = False  # no CUDA runtime in this process: nothing can be registered

    def _registrar(self) -> Any:
        if self._register is None:
            lib = _cudart()
            if lib is None:
                self.failure, self._off = "no CUDA runtime loaded in this process", True
                return None
            self._register = lambda address, size, device: _cuda_register(lib, address, size, device)
        return self._register

    def covers(self, a: np.ndarray, device: int | None = None) -> bool:
        """Whether ``a`` lies in registered (pinned) memory, registering the store if needed.

        Args:
            a: A host array about to be transferred.
            device: The CUDA device ordinal to register on (the feeder's first local device).
        """
        if self._off or not a.flags.c_contiguous or a.nbytes == 0 or _owns_its_memory(a):
            return False
        lo = a.ctypes.data
        hi = lo + a.nbytes
        for s, e in self.registered:  # one mapping, the store's
            if s <= lo and hi <= e:
                return True
        for s, e in self._elsewhere:  # known not to be the store: no /proc read per batch
            if s <= lo < e:
                return False
        with self._lock:
            if any(s <= lo and hi <= e for s, e in self.registered):
                return True
            maps = all_mappings()
            m = mapping_of(lo, maps)
            if m is None:
                return False
            if not self._accept(m, maps) or hi > m.end:
                self._elsewhere.append((m.start, m.end))
                return False
            if m.size > self.max_bytes:
                return self._refuse(m, f"{m.path} is {m.size >> 20} MiB (> {self.max_bytes >> 20} MiB)")
            register = self._registrar()
            if register is None:
                return False
            t0 = time.perf_counter()
            try:
                error = register(m.start, m.size, device)
            except Exception as e:  # an optimisation only: never the stream's failure
                error = f"{type(e).__name__}: {e}"
            self.seconds += time.perf_counter() - t0
            if error is not None:  # including memory another user registered: not ours to trust
                return self._refuse(m, f"{error} ({m.path}, {m.size >> 20} MiB)")
            self.registered.append((m.start, m.end))
            return True

    def _refuse(self, m: Mapping, why: str) -> bool:
        self._elsewhere.append((m.start, m.end))
        self.failure = why
        return False


_PINNING: StorePinning | None = None
_PINNING_LOCK = threading.Lock()


def store_pinning() -> StorePinning:
    """The process's one :class:`StorePinning` (registrations are per process)."""
    global _PINNING
    with _PINNING_LOCK:
        if _PINNING is None:
            _PINNING = StorePinning()
        return _PINNING
