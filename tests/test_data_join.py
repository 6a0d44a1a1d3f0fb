"""Batches spanning source blocks joined on the device (``assemble="device"``), against the host join.

On CPU devices ``"auto"`` joins on the host, so these tests ask for ``"device"``: the same
batches, states and errors must come out either way, on one device or split over several."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rayslice.data import FeederOptions, iter_jax_batches
from rayslice.data._pieces import Pieces, device_spans
from rayslice.data._pipeline import _assembly
from rayslice.data._rebatch import host_batches
from rayslice.errors import InvalidArgument

from .test_data_staging import blocks, wait_unreferenced  # blocks: consecutive ids in blocks of the given sizes


def _all(it):
    out = [{k: np.asarray(v) for k, v in b.items()} for b in it]
    return out, it


def _same(got, want):
    assert len(got) == len(want) and got
    for a, b in zip(got, want):
        assert a.keys() == b.keys()
        for k in a:
            assert a[k].dtype == b[k].dtype, k
            np.testing.assert_array_equal(a[k], b[k])


@settings(max_examples=100, deadline=None)
@given(parts=st.lists(st.integers(1, 9), min_size=1, max_size=6), data=st.data())
def test_pieces_cover_any_row_range_and_join_in_order(parts, data):
    arrays, at = [], 0
    for n in parts:
        arrays.append(np.arange(at, at + n).reshape(n, 1) * np.ones((1, 2)))
        at += n
    col = Pieces(arrays)
    whole = np.concatenate(arrays)
    assert col.shape == whole.shape and len(col) == at and col.nbytes == whole.nbytes
    np.testing.assert_array_equal(col.join(np.empty), whole)
    np.testing.assert_array_equal(np.asarray(col), whole)
    lo = data.draw(st.integers(0, at - 1))
    hi = data.draw(st.integers(lo + 1, at))
    sub = col.rows(lo, hi)
    assert all(len(p) for p in sub) and all(any(np.shares_memory(p, a) for a in arrays) for p in sub)  # views
    np.testing.assert_array_equal(np.concatenate(sub), whole[lo:hi])


def test_only_pieces_of_one_device_dtype_are_kept_apart():
    src = [
        {"a": np.arange(3), "b": np.arange(3.0), "s": np.array(list("abc"))},
        {"a": np.arange(3, 6), "b": np.arange(3, 6), "s": np.array(list("def"))},
    ]
    b = next(host_batches(src, 6, lazy=True))
    assert isinstance(b["a"], Pieces)  # one dtype: joined on the device later
    assert isinstance(b["b"], np.ndarray) and b["b"].dtype == np.float64  # float64 and int64: promoted on the host
    assert isinstance(b["s"], np.ndarray)  # strings never reach a device
    one = next(host_batches([{"a": np.arange(8)}], 4, lazy=True))
    assert isinstance(one["a"], np.ndarray)  # inside one block: a view, as ever


def test_device_spans_map_a_process_s_shards_onto_its_local_rows():
    # As jax.make_array_from_process_local_data documents: slices (8, 12) and (24, 28) of the
    # global array are rows (0, 4) and (4, 8) of this process's data.
    class Dev:
        def __init__(self, i):
            self.id = i

    class Sharding:
        def __init__(self, index):
            self.index = index

        def addressable_devices_indices_map(self, shape):
            return self.index

    d = [Dev(i) for i in range(3)]
    spans = device_spans(Sharding({d[1]: (slice(24, 28),), d[0]: (slice(8, 12),), d[2]: (slice(8, 12),)}), (32,))
    assert [(x.id, a, b) for x, a, b in spans] == [(0, 0, 4), (1, 4, 8), (2, 0, 4)]  # d[2] replicates d[0]
    assert device_spans(Sharding({d[0]: (slice(None), slice(0, 2))}), (4, 4)) is None  # not a row range
    real = iter_jax_batches(blocks([8]), batch_size=8)._feeder.sharding  # over every CPU device
    got = device_spans(real, (8, 3))
    assert [(a, b) for _, a, b in got] == [(2 * i, 2 * i + 2) for i in range(len(jax.devices()))]


@pytest.mark.parametrize("ragged", ["pad", "drop", "keep"])
@pytest.mark.parametrize(
    "kw",
    [
        dict(pipeline="sync"),
        dict(pipeline="thread"),
        dict(pipeline="thread", transfer_threads=3),
        dict(pipeline="sync", transfer_threads=0),
    ],
)
def test_the_device_join_yields_the_host_join_s_batches(ragged, kw):
    sizes = [8] * 8 + ([3, 1] if ragged == "keep" else [5, 1])  # uniform blocks, then a tail of 8 or 10 rows
    base = FeederOptions(batch_size=12, ragged=ragged, **kw)
    want, _ = _all(iter_jax_batches(blocks(sizes), options=base.replace(assemble="host")))
    got, it = _all(iter_jax_batches(blocks(sizes), options=base.replace(assemble="device")))
    _same(got, want)
    t = it._feeder._transfers
    assert it._feeder.assemble == "device" and t.device_joins > 0  # the device path was taken
    assert it.state()["finished"]


def test_a_device_joined_array_has_the_host_join_s_sharding_and_shards():
    src = blocks([6, 10, 16], width=4)
    a = next(iter_jax_batches(src, batch_size=32, assemble="device", transfer_threads=4))
    b = next(iter_jax_batches(src, batch_size=32, assemble="host"))
    for k in ("id", "x"):
        assert a[k].sharding == b[k].sharding
        assert [(s.device, s.index) for s in a[k].addressable_shards] == [
            (s.device, s.index) for s in b[k].addressable_shards
        ]
        for sa, sb in zip(a[k].addressable_shards, b[k].addressable_shards):
            np.testing.assert_array_equal(np.asarray(sa.data), np.asarray(sb.data))


def test_a_device_joined_stream_resumes_exactly():
    sizes = [7] * 12  # 84 rows: every batch of 8 but a few spans two blocks
    it = iter_jax_batches(blocks(sizes), batch_size=8, assemble="device", ragged="keep")
    first = [np.asarray(next(it)["id"]) for _ in range(4)]
    state = it.state()
    it.close()
    rest = [
        np.asarray(b["id"])
        for b in iter_jax_batches(blocks(sizes), batch_size=8, assemble="device", state=state, ragged="keep")
    ]
    np.testing.assert_array_equal(np.concatenate(first + rest), np.arange(84))


def test_columns_that_host_work_reads_are_joined_on_the_host_first():
    src = blocks([8] * 6)  # 48 rows, batches of 12: every other batch spans two blocks
    for kw in (
        dict(dtypes={"id": np.int16}),  # a cast: checked and done on the host
        dict(collate_fn=lambda b: {"id": b["id"] * 2, "x": b["x"] + 1}),
        dict(host_columns=["id"]),
    ):
        want, _ = _all(iter_jax_batches(src, batch_size=12, assemble="host", **kw))
        got, it = _all(iter_jax_batches(src, batch_size=12, assemble="device", **kw))
        _same(got, want)
        joins = it._feeder._transfers.device_joins
        assert joins == (0 if "collate_fn" in kw else 2), kw  # "x" of the 2 batches from their 2nd


def test_a_stream_compiles_only_layouts_that_recur():
    uniform = iter_jax_batches(blocks([8] * 24), batch_size=12, assemble="device", pipeline="sync")
    _all(uniform)
    layouts = uniform._feeder._transfers.layouts
    assert layouts.compiled == 2 and layouts.refused == 2  # 2 layouts (8+4, 4+8 rows), each 1st joined on the host
    assert uniform._feeder._transfers.device_joins == 2 * 14  # both columns of the other 14 batches
    # Block ends at 40k + 1, 12, 23, 34, 5, 16, 27, 38, 9, 30: each batch of 40 rows (10 per device)
    # is cut once, on another device or at another row of it (no layout recurs), the last one
    # between two devices' rows (each device takes one piece: nothing to join there).
    sizes = [1, 51, 51, 51, 11, 51, 51, 51, 11, 61, 10]
    uneven = iter_jax_batches(blocks(sizes), batch_size=40, assemble="device", ragged="drop")
    want, _ = _all(iter_jax_batches(blocks(sizes), batch_size=40, ragged="drop"))
    got, _ = _all(uneven)
    _same(got, want)
    t = uneven._feeder._transfers
    assert t.layouts.compiled == 0 and t.layouts.refused > 0  # no layout recurs: joined on the host, nothing compiled
    assert t.device_joins == 2  # the last batch's 2 columns: no join to compile


def test_assemble_choices_and_their_checks():
    assert _assembly("auto", "tpu", pinned=False) == "device"  # measured there
    assert _assembly("auto", "gpu", pinned=False) == "host"  # not measured there yet
    assert _assembly("auto", "cpu", pinned=False) == "host" and _assembly("auto", "tpu", pinned=True) == "host"
    assert _assembly("host", "tpu", pinned=False) == "host" and _assembly("device", "cpu", pinned=False) == "device"
    assert iter_jax_batches(blocks([4]), batch_size=4)._feeder.assemble == "host"  # CPU devices: aliased, no copy
    with pytest.raises(InvalidArgument, match=r"assemble='gpu' is not valid: expected one of"):
        FeederOptions(assemble="gpu")
    with pytest.raises(InvalidArgument, match=r"assemble='device' is not valid: .*staging='pinned'"):
        iter_jax_batches(blocks([4]), batch_size=4, assemble="device", staging="pinned")


def test_pieces_of_ray_s_store_register_it_for_dma_as_views_do():
    # Ray's object store stood in for by a shared mapping, "registered" by a fake cudaHostRegister.
    import mmap

    from rayslice.data._storepin import StorePinning
    from rayslice.data._transfer import Transfers

    sharding = iter_jax_batches(blocks([8]), batch_size=8)._feeder.sharding  # 4 CPU devices, 2 rows each
    store = StorePinning(register=lambda address, size, device: None, accept=lambda m, maps: m.shared)
    t = Transfers(sharding, store=store)
    mm = mmap.mmap(-1, 1 << 16, flags=mmap.MAP_SHARED)
    x = np.frombuffer(mm, dtype=np.float32)[:32].reshape(8, 4)
    x[:] = np.arange(32).reshape(8, 4)
    out = t.put({"x": Pieces([x[:4], x[4:]])}, 8)  # cut between devices: each device one piece
    assert store.registered and t.device_joins == 1
    np.testing.assert_array_equal(np.asarray(out["x"]), x)
    t.close()


def test_a_wide_schema_shares_one_layout_per_batch():
    # 17 columns of different kinds, cut alike: one layout per batch, not one per column kind.
    src = [{f"c{j}": np.full((8, j + 1), i, np.float32) for j in range(17)} for i in range(40)]
    it = iter_jax_batches(src, batch_size=12, assemble="device", ragged="drop")
    got, _ = _all(it)
    want, _ = _all(iter_jax_batches(src, batch_size=12, assemble="host", ragged="drop"))
    _same(got, want)
    layouts = it._feeder._transfers.layouts
    assert layouts.compiled == 2 and it._feeder._transfers.device_joins == 17 * (len(got) - 2)


def test_staging_buffers_of_dtypes_with_one_byte_string_are_never_confused():
    import ml_dtypes

    from rayslice.data._staging import StagingRing

    a, b = np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e4m3fnuz)
    assert a.str == b.str and a != b  # the case: one dtype.str ('<V1'), two dtypes
    ring = StagingRing(depth=2, spares=None)
    first = ring.alloc((4,), a)
    del first
    assert ring.alloc((4,), b).dtype == b


# One device join's settings: no thread, the prefetch thread with a transfer pool, and no pool.
PIPELINES = [
    dict(pipeline="sync"),
    dict(pipeline="thread", transfer_threads=3),
    dict(pipeline="sync", transfer_threads=0),
]


def _device_stream(sizes, batch_size, grid_bytes, **kw):
    it = iter_jax_batches(blocks(sizes, width=4), batch_size=batch_size, assemble="device", ragged="drop", **kw)
    it._feeder._transfers.grid_bytes = grid_bytes  # before the first batch: the test's rows are small
    return it


@pytest.mark.parametrize("kw", PIPELINES)
def test_blocks_larger_than_the_batch_join_on_a_grid_once_no_layout_recurs(kw):
    # Blocks of 151-383 rows, batches of 128 (32 rows per device): 9 batches span two blocks, each cut
    # at another row (no layout recurs), inside one chunk of one device's rows: 8 chunks of 4 rows of
    # "x" (4 float32, 16 bytes a row), 4 of 8 rows of "id" (8 bytes a row), at least 64 bytes each.
    sizes = [367, 163, 190, 206, 190, 364, 383, 303, 151, 166]
    want, _ = _all(iter_jax_batches(blocks(sizes, width=4), batch_size=128, assemble="host", ragged="drop"))
    got, it = _all(_device_stream(sizes, 128, grid_bytes=64, **kw))
    _same(got, want)
    t = it._feeder._transfers
    assert t.layouts.compiled == 0 and t.layouts.refused == 9  # nothing recurs ...
    assert t.grid_joins == 2 * (9 - 3)  # ... so from the 4th such batch on, both columns on a grid
    assert t.device_joins == t.grid_joins  # never a compiled layout


def test_a_grid_join_never_cuts_into_chunks_smaller_than_its_minimum_nor_mostly_across_ends():
    sizes = [367, 163, 190, 206, 190, 364, 383, 303, 151, 166]
    _, big = _all(_device_stream(sizes, 128, grid_bytes=1 << 20))  # 1 MB chunks: none in 32 rows
    assert big._feeder._transfers.layouts.refused == 9 and big._feeder._transfers.grid_joins == 0
    small = [3, 5, 4, 6, 7, 2, 5, 3, 4, 6] * 16  # every 4-row chunk but a few crosses a block's end
    want, _ = _all(iter_jax_batches(blocks(small, width=4), batch_size=128, ragged="drop"))
    got, it = _all(_device_stream(small, 128, grid_bytes=64))
    _same(got, want)
    assert it._feeder._transfers.layouts.mostly_refused and it._feeder._transfers.grid_joins == 0


def test_grid_chunks_across_block_ends_are_staged_in_reused_buffers():
    from rayslice.data._transfer import Transfers

    sharding = iter_jax_batches(blocks([8]), batch_size=8)._feeder.sharding  # 4 CPU devices
    t = Transfers(sharding, reuse_staging=True, ring_depth=2, grid_bytes=32)
    for _ in range(4):
        t.layouts.admit(object())  # a stream of layouts that never recur
    x = np.arange(64 * 2, dtype=np.float32).reshape(64, 2)
    buffers = set()
    # 16 rows per device (8 bytes each): 4 chunks of 4 rows; a block ends inside one chunk of device 1's,
    # at another row each time (no layout recurs), and that chunk alone is staged.
    for cut in (17, 18, 19, 21, 22, 23):
        wait_unreferenced(t.ring)  # the last join is done (and JAX has let go of its chunk)
        out = t.put({"x": Pieces([x[:cut], x[cut:]])}, 64)
        np.testing.assert_array_equal(np.asarray(out["x"]), x)
        assert t.ring is not None
        buffers |= {buf.ctypes.data for pool in t.ring._pools.values() for buf in pool}
    assert t.grid_joins == 6 and t.ring.allocated == 1 and len(buffers) == 1  # one buffer, lent again
    out["x"].delete()  # the consumer donated the last batch to its step
    wait_unreferenced(t.ring)
    out = t.put({"x": Pieces([x[:25], x[25:]])}, 64)  # a cut not seen before: on the grid again
    np.testing.assert_array_equal(np.asarray(out["x"]), x)
    assert t.ring.allocated == 1  # its buffer is lent again: nothing references it any more
    t.close()


@settings(max_examples=100, deadline=None)
@given(sizes=st.lists(st.integers(1, 9), min_size=1, max_size=8), batch=st.integers(1, 20), data=st.data())
def test_whole_blocks_hold_any_row_range_of_a_batch_from_where_they_say(sizes, batch, data):
    src = blocks(sizes, width=2)
    for b in host_batches(src, batch, lazy=True, skip_rows=data.draw(st.integers(0, 3))):
        col = b["x"]
        if not isinstance(col, Pieces):
            continue
        rows = np.asarray(col)
        lo = data.draw(st.integers(0, len(col) - 1))
        hi = data.draw(st.integers(lo + 1, len(col)))
        found = col.blocks(lo, hi)
        assert found is not None
        whole, at = found
        assert all(any(w is s["x"] for s in src) for w in whole)  # the source's own arrays, no copy
        np.testing.assert_array_equal(np.concatenate(whole)[at : at + hi - lo], rows[lo:hi])
    a = np.arange(10)
    assert Pieces([a[2:5], a[6:]], origins=[(a, 2), (a, 6)]).blocks(0, 5) is None  # a gap: not consecutive
    assert Pieces([a[2:5]]).blocks(0, 3) is None  # origins unknown


@pytest.mark.parametrize("kw", PIPELINES)
def test_small_blocks_whose_cuts_never_recur_are_joined_from_whole_blocks(kw):
    # 30-row blocks into 256-row batches (64 rows per device): every batch is cut at other rows (no layout
    # recurs in 15 batches), each device's rows lie in 3 or 4 blocks (90 or 120 rows sent for 64), and
    # 32-row grid chunks (512 bytes of "x") would mostly cross an end: the whole blocks go as they are.
    sizes = [30] * 120
    want, _ = _all(iter_jax_batches(blocks(sizes, width=4), batch_size=256, assemble="host", ragged="drop"))
    got, it = _all(_device_stream(sizes, 256, grid_bytes=400, **kw))
    _same(got, want)
    t = it._feeder._transfers
    assert t.layouts.compiled == 0 and t.grid_joins == 0
    assert 1 <= t.block_layouts.compiled <= 2 and t.block_joins == t.device_joins >= len(got) - 4  # 3 or 4 blocks
    # Blocks under the minimum, or more than twice a device's rows, are joined on the host.
    _, small = _all(_device_stream(sizes, 256, grid_bytes=1 << 20, **kw))
    _, few = _all(_device_stream([100] * 36, 128, grid_bytes=400, **kw))  # 32 rows per device, 100-row blocks
    for it in (small, few):
        assert it._feeder._transfers.block_joins == 0 and it._feeder._transfers.layouts.refused > 0
