"""Registering Ray's object store for DMA (rayslice.data._storepin): which memory is covered, once, and failures."""

from __future__ import annotations

import mmap

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rayslice.data._storepin import StorePinning, is_ray_store, mapping_of, parse_maps_line


class _Register:
    """Stands in for cudaHostRegister: records (address, size, device); ``error`` is what it answers."""

    def __init__(self, error: str | None = None) -> None:
        self.error, self.calls, self.devices = error, [], []

    def __call__(self, address: int, size: int, device: int | None) -> str | None:
        self.calls.append((address, size))
        self.devices.append(device)
        return self.error


def _pinning(reg: _Register, **kw) -> StorePinning:
    # Anonymous shared mappings stand in for Ray's /dev/shm/plasma... store.
    return StorePinning(register=reg, accept=lambda m, maps: m.shared, **kw)


def _shared(nbytes: int) -> tuple[mmap.mmap, np.ndarray]:
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_SHARED)  # shared memory, as Ray's object store is
    return mm, np.frombuffer(mm, dtype=np.uint8)


def test_a_view_in_a_shared_mapping_registers_the_whole_mapping_once():
    reg = _Register()
    pin = _pinning(reg)
    mm, arr = _shared(1 << 20)
    m = mapping_of(arr.ctypes.data)
    assert m is not None and m.shared and m.start <= arr.ctypes.data and arr.ctypes.data + arr.nbytes <= m.end
    assert pin.covers(arr[4096:8192], device=3) and pin.covers(arr[100:200]) and pin.covers(arr)
    assert reg.calls == [(m.start, m.size)] and pin.registered == [(m.start, m.end)]
    assert reg.devices == [3]  # registered on the feeder's device (no context made on another GPU)
    assert pin.failure is None
    del arr
    mm.close()


def test_private_memory_and_strided_views_are_never_registered():
    reg = _Register()
    pin = _pinning(reg)
    private = np.ones(1 << 16, np.uint8)  # numpy's own memory: never the store's, no /proc read
    assert not pin.covers(private) and not pin.covers(private[10:20])
    foreign = np.frombuffer(bytearray(1 << 16), np.uint8)  # not numpy's, not shared: looked up once
    assert not pin.covers(foreign) and not pin.covers(foreign[1:])
    mm, arr = _shared(1 << 16)
    assert not pin.covers(arr[::2])  # not one contiguous range
    assert not pin.covers(arr[:0])
    assert reg.calls == [] and pin.failure is None
    del arr
    mm.close()


def test_a_refused_mapping_is_not_asked_again_and_others_still_are():
    reg = _Register(error="cudaHostRegister: host memory already registered")  # someone else's: not trusted
    pin = _pinning(reg)
    mm, arr = _shared(1 << 16)
    assert not pin.covers(arr)
    assert "already registered" in (pin.failure or "") and pin.registered == []
    assert not pin.covers(arr) and len(reg.calls) == 1  # refused once: its batches go the pageable way
    reg.error = None
    mm2, other = _shared(1 << 16)  # another mapping is still asked
    assert pin.covers(other) and len(reg.calls) == 2
    del arr, other
    mm.close()
    mm2.close()


def test_only_rays_store_and_nothing_else_shared_is_registered_by_default():
    def line(path, perms="rw-s"):
        return parse_maps_line(f"7f0000000000-7f0010000000 {perms} 00000000 00:1a 7 {path}")

    assert is_ray_store(line("/dev/shm/plasmaAb12Cd (deleted)")) and is_ray_store(line("/dev/shm/plasmaAb12Cd"))
    # A store outside /dev/shm (too small there) is told from Ray's fallback files by its size.
    main = parse_maps_line("7f0000000000-7f0100000000 rw-s 00000000 00:1a 7 /tmp/plasmaMain (deleted)")
    fallback = parse_maps_line("7f0200000000-7f0210000000 rw-s 00000000 00:1a 8 /tmp/plasmaFb (deleted)")
    assert is_ray_store(main, [main, fallback]) and is_ray_store(main, [main])
    assert not is_ray_store(fallback, [main, fallback])
    for m in (
        line("/tmp/ray/session_1/plasmaQw3 (deleted)", perms="rw-p"),
        line("/dev/shm/psm_1234"),  # multiprocessing.shared_memory
        line("/data/rows.npy"),  # np.memmap
        line("/dev/shm/plasmaAb12Cd", perms="rw-p"),
        line(""),
    ):
        assert not is_ray_store(m), m
    reg = _Register()
    mm, arr = _shared(1 << 16)  # shared, but not the store
    assert not StorePinning(register=reg).covers(arr) and reg.calls == []
    del arr
    mm.close()


def test_a_failing_registrar_is_a_refusal_not_an_error():
    def boom(address, size, device):
        raise AttributeError("no cudaHostRegister in this library")

    pin = StorePinning(register=boom, accept=lambda m, maps: m.shared)
    mm, arr = _shared(1 << 16)
    assert not pin.covers(arr) and "AttributeError" in (pin.failure or "")
    del arr
    mm.close()


def test_without_a_cuda_runtime_nothing_is_registered(monkeypatch):
    from rayslice.data import _storepin

    monkeypatch.setattr(_storepin, "_cudart", lambda: None)
    pin = StorePinning(accept=lambda m, maps: m.shared)
    mm, arr = _shared(1 << 16)
    assert not pin.covers(arr) and pin.failure == "no CUDA runtime loaded in this process"
    del arr
    mm.close()


def test_a_mapping_larger_than_the_limit_is_not_registered():
    reg = _Register()
    pin = _pinning(reg, max_bytes=1 << 12)
    mm, arr = _shared(1 << 20)
    assert not pin.covers(arr)
    assert reg.calls == [] and "MiB" in (pin.failure or "")
    del arr
    mm.close()


@given(
    st.integers(0, 2**47 - 4096).map(lambda a: a & ~4095),
    st.integers(1, 2**20).map(lambda n: n * 4096),
    st.sampled_from(["rw-s", "rw-p", "r--s", "r-xp"]),
    st.sampled_from(["", "/dev/shm/plasmaAbC (deleted)", "[heap]", "/usr/lib/libc.so.6"]),
)
def test_maps_lines_parse(start, size, perms, path):
    line = f"{start:x}-{start + size:x} {perms} 00000000 00:1a 42 {path}".rstrip()
    m = parse_maps_line(line + "\n")
    assert (m.start, m.size, m.shared, m.path) == (start, size, perms[3] == "s", path)


@pytest.mark.ray
def test_rays_object_store_is_one_shared_mapping_holding_the_feeders_views(ray_cluster):
    # What StorePinning relies on: a batch inside a block is a view of the store's shared mapping.
    import ray

    from rayslice.data._rebatch import host_batches

    ds = ray.data.from_numpy(np.ones((4096, 32), np.float32)).materialize()
    batch = next(host_batches(ds, 1024))["data"]
    m = mapping_of(batch.ctypes.data)
    assert m is not None and m.shared and batch.flags.c_contiguous
    reg = _Register()
    pin = _pinning(reg)
    assert pin.covers(batch) and reg.calls == [(m.start, m.size)]
