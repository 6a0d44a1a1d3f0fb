"""Registering Ray's object store for DMA (rayslice.data._storepin): which memory is covered, once, and failures."""

from __future__ import annotations

import mmap

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rayslice.data._storepin import StorePinning, mapping_of, parse_maps_line


class _Register:
    def __init__(self, code: int = 0) -> None:
        self.code, self.calls = code, []

    def __call__(self, address: int, size: int) -> int:
        self.calls.append((address, size))
        return self.code


def _shared(nbytes: int) -> tuple[mmap.mmap, np.ndarray]:
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_SHARED)  # shared memory, as Ray's object store is
    return mm, np.frombuffer(mm, dtype=np.uint8)


def test_a_view_in_a_shared_mapping_registers_the_whole_mapping_once():
    reg = _Register()
    pin = StorePinning(register=reg)
    mm, arr = _shared(1 << 20)
    m = mapping_of(arr.ctypes.data)
    assert m is not None and m.shared and m.start <= arr.ctypes.data and arr.ctypes.data + arr.nbytes <= m.end
    assert pin.covers(arr[4096:8192]) and pin.covers(arr[100:200]) and pin.covers(arr)
    assert reg.calls == [(m.start, m.size)] and pin.registered == [(m.start, m.end)]
    assert pin.failure is None
    del arr
    mm.close()


def test_private_memory_and_strided_views_are_never_registered():
    reg = _Register()
    pin = StorePinning(register=reg)
    private = np.ones(1 << 16, np.uint8)  # the heap: registering its mapping would pin what is not ours
    assert not pin.covers(private)
    mm, arr = _shared(1 << 16)
    assert not pin.covers(arr[::2])  # not one contiguous range
    assert not pin.covers(arr[:0])
    assert reg.calls == [] and pin.failure is None
    del arr
    mm.close()


def test_a_refused_mapping_is_not_asked_again_and_others_still_are():
    reg = _Register(code=1)
    pin = StorePinning(register=reg)
    mm, arr = _shared(1 << 16)
    assert not pin.covers(arr)
    assert pin.failure is not None and "cudaHostRegister" in pin.failure and pin.registered == []
    assert not pin.covers(arr) and len(reg.calls) == 1  # refused once: its batches go through pinned_host memory
    reg.code = 0
    mm2, other = _shared(1 << 16)  # e.g. Ray's main store after a refused fallback allocation
    assert pin.covers(other) and len(reg.calls) == 2
    del arr, other
    mm.close()
    mm2.close()


def test_without_a_cuda_runtime_nothing_is_registered(monkeypatch):
    from rayslice.data import _storepin

    monkeypatch.setattr(_storepin, "_cudart", lambda: None)
    pin = StorePinning()
    mm, arr = _shared(1 << 16)
    assert not pin.covers(arr) and pin.failure == "no CUDA runtime loaded in this process"
    del arr
    mm.close()


def test_a_mapping_larger_than_the_limit_is_not_registered():
    reg = _Register()
    pin = StorePinning(register=reg, max_bytes=1 << 12)
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
    pin = StorePinning(register=reg)
    assert pin.covers(batch) and reg.calls == [(m.start, m.size)]
