"""DMA straight from Ray's object store (private): CUDA host registration of the store's shared memory.

A batch inside one Ray block is a zero-copy view of the object store, which
every worker maps as one shared-memory region. Pageable memory reaches a GPU
at a fraction of the wire's rate (the runtime copies it into pinned memory
first, on one thread), and copying it into pinned staging buffers costs as
much host memory bandwidth as the DMA itself. Registering the whole store
mapping with CUDA (``cudaHostRegister``, once per process) makes every
object in it pinned memory: ``device_put`` of a view is then a DMA at the
wire's rate, with no host copy at all.

Only shared mappings (the object store's) of at most 32 GiB are registered
(registering commits every page of the mapping), whole, and only once;
anything else (a private numpy array, a store this process cannot register)
is reported as not covered and the feeder copies it into pinned
staging buffers instead. The CUDA runtime is the one JAX's CUDA plugin has
loaded (found among this process's mappings), so no other GPU library is
needed. The store stays registered for the life of the process: its
memory is the store's, mapped for as long as the worker lives.

Example:
    >>> m = parse_maps_line("7f00a0000000-7f00b0000000 rw-s 00000000 00:1a 42 /dev/shm/plasmaXyZ (deleted)")
    >>> hex(m.start), m.size >> 20, m.shared, m.path
    ('0x7f00a0000000', 256, True, '/dev/shm/plasmaXyZ (deleted)')
"""

from __future__ import annotations

import ctypes
import dataclasses
import threading
import time
from typing import Any

import numpy as np

_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context of the process
_ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered
#: A larger mapping is not registered: registering pins (and so commits) all of its pages.
MAX_BYTES = 32 << 30


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


def mapping_of(address: int) -> Mapping | None:
    """The mapping of this process holding ``address`` (None where none does, or not on Linux)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                m = parse_maps_line(line)
                if m.start <= address < m.end:
                    return m
    except OSError:
        return None
    return None


def _cudart() -> Any:
    """The CUDA runtime this process has loaded (JAX's), else one the loader finds; None without CUDA."""
    paths: list[str] = []
    try:
        with open("/proc/self/maps") as f:
            paths = [p for p in (line.split(maxsplit=5)[-1].strip() for line in f) if "libcudart.so" in p]
    except OSError:
        pass
    for name in [*dict.fromkeys(paths), "libcudart.so.13", "libcudart.so.12", "libcudart.so"]:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        lib.cudaHostRegister.restype = ctypes.c_int
        lib.cudaGetErrorString.argtypes = [ctypes.c_int]
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        return lib
    return None


class StorePinning:
    """Registers whole shared mappings with CUDA on first use; says whether an array lies in one.

    Attributes:
        registered: ``(start, end)`` of every mapping registered by this process.
        seconds: Time spent registering, in all.
        failure: The last reason a mapping was not registered (None while every one was).
    """

    def __init__(self, register: Any = None, max_bytes: int = MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._register = register  # (address, size) -> error code; None: the CUDA runtime's, loaded lazily
        self._lock = threading.Lock()
        self.registered: list[tuple[int, int]] = []
        self._refused: set[tuple[int, int]] = set()
        self.seconds = 0.0
        self.failure: str | None = None
        self._off = False  # no CUDA runtime in this process: nothing can be registered

    def _registrar(self) -> Any:
        if self._register is None:
            lib = _cudart()
            if lib is None:
                self.failure, self._off = "no CUDA runtime loaded in this process", True
                return None

            def register(address: int, size: int) -> int:
                return int(lib.cudaHostRegister(ctypes.c_void_p(address), size, _PORTABLE))

            self._register = register
            self._error = lambda code: lib.cudaGetErrorString(code).decode()
        return self._register

    def covers(self, a: np.ndarray) -> bool:
        """Whether ``a`` lies in registered (pinned) memory, registering its shared mapping if needed."""
        if self._off or not a.flags.c_contiguous or a.nbytes == 0:
            return False
        lo = a.ctypes.data
        hi = lo + a.nbytes
        for s, e in self.registered:  # a handful of mappings at most: the store's
            if s <= lo and hi <= e:
                return True
        with self._lock:
            m = mapping_of(lo)
            if m is None or not m.shared or hi > m.end or (m.start, m.end) in self._refused:
                return False
            if any(s == m.start for s, _ in self.registered):
                return True
            if m.size > self.max_bytes:
                self._refused.add((m.start, m.end))
                self.failure = f"{m.path or 'a shared mapping'} is {m.size >> 20} MiB (> {self.max_bytes >> 20} MiB)"
                return False
            register = self._registrar()
            if register is None:
                return False
            t0 = time.perf_counter()
            code = register(m.start, m.size)
            self.seconds += time.perf_counter() - t0
            if code not in (0, _ALREADY_REGISTERED):
                self._refused.add((m.start, m.end))
                err = getattr(self, "_error", lambda c: f"error {c}")(code)
                self.failure = f"cudaHostRegister of {m.path or 'a shared mapping'} ({m.size >> 20} MiB): {err}"
                return False
            self.registered.append((m.start, m.end))
            return True


_PINNING: StorePinning | None = None


def store_pinning() -> StorePinning:
    """The process's one :class:`StorePinning` (registrations are per process)."""
    global _PINNING
    if _PINNING is None:
        _PINNING = StorePinning()
    return _PINNING
