"""iter_jax_batches in one process with 4 CPU devices: exactness, policies, sharding, resume."""

from __future__ import annotations

import contextlib
import gc
import json
import threading
import time
import weakref

import numpy as np
import pyarrow as pa
import pytest

jax = pytest.importorskip("jax")
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from rayslice.data import RaggedBatchError, iter_jax_batches  # noqa: E402
from rayslice.errors import InvalidArgument  # noqa: E402


def chunks(n: int, sizes=(7, 3, 11, 1)):
    """n rows of (id, x) cut into uneven source batches."""
    out, start, i = [], 0, 0
    while start < n:
        size = min(sizes[i % len(sizes)], n - start)
        ids = np.arange(start, start + size)
        out.append({"id": ids, "x": np.stack([ids, -ids], axis=1).astype(np.float64)})
        start += size
        i += 1
    return out


def ids_of(batches, mask_key="mask"):
    seen = []
    for b in batches:
        ids = np.asarray(b["id"])
        if mask_key in b:
            ids = ids[np.asarray(b[mask_key])]
        seen.extend(ids.tolist())
    return seen


def test_four_devices():
    assert jax.device_count() == 4


@pytest.mark.parametrize("ragged", ["drop", "pad"])
def test_every_row_once_in_order(ragged):
    n = 103
    batches = list(iter_jax_batches(chunks(n), batch_size=8, ragged=ragged))
    seen = ids_of(batches)
    expected = list(range(n)) if ragged == "pad" else list(range(96))
    assert seen == expected
    assert all(b["id"].shape == (8,) and b["x"].shape == (8, 2) for b in batches)


def test_batches_are_sharded_over_all_devices_by_default():
    b = next(iter(iter_jax_batches(chunks(16), batch_size=8)))
    assert b["x"].sharding.spec == P("data") and len(b["x"].sharding.device_set) == 4
    assert [s.data.shape for s in b["x"].addressable_shards] == [(2, 2)] * 4
    np.testing.assert_array_equal(np.asarray(b["x"])[:, 0], np.arange(8))


def test_pad_mask_is_exact_and_every_batch_has_it():
    batches = list(iter_jax_batches(chunks(19), batch_size=8, ragged="pad", pad_value=-7))
    assert len(batches) == 3
    masks = [np.asarray(b["mask"]).tolist() for b in batches]
    assert masks[0] == masks[1] == [True] * 8
    assert masks[2] == [True] * 3 + [False] * 5
    last = batches[2]
    assert np.asarray(last["id"]).tolist() == [16, 17, 18, -7, -7, -7, -7, -7]
    assert last["mask"].sharding == last["id"].sharding
    assert last["mask"].dtype == np.bool_


def test_drop_counts():
    assert len(list(iter_jax_batches(chunks(19), batch_size=8, ragged="drop"))) == 2
    assert len(list(iter_jax_batches(chunks(16), batch_size=8, ragged="drop"))) == 2


@pytest.mark.parametrize("pipeline", ["sync", "thread"])
def test_drop_neither_collates_nor_joins_the_partial_batch_it_drops(pipeline):
    # As Ray's drop_last: the dropped rows never reach collate_fn, nor a staging buffer.
    seen = []

    def collate(batch):
        seen.append(len(batch["id"]))
        return {"id": batch["id"], "x": batch["x"] * 2}

    src = chunks(19, sizes=(8, 8, 2, 1))  # two whole batches (views), then 3 rows across two blocks
    it = iter_jax_batches(src, batch_size=8, ragged="drop", collate_fn=collate, pipeline=pipeline)
    got = list(it)
    assert ids_of(got) == list(range(16)) and seen == [8, 8]
    np.testing.assert_array_equal(np.asarray(got[1]["x"])[:, 0], 2 * np.arange(8, 16))
    assert it._feeder._ring.allocated == 0  # nothing was joined
    assert it.state()["finished"] and it.state()["rows"] == 16
    kept = iter_jax_batches(chunks(19, sizes=(8, 8, 2, 1)), batch_size=8, ragged="pad", collate_fn=collate)
    assert len(list(kept)) == 3 and seen[2:] == [8, 8, 3]  # under "pad" the same rows are joined and collated


@pytest.mark.parametrize("agree", [False, True])
@pytest.mark.parametrize("pipeline", ["sync", "thread"])
def test_a_stream_shorter_than_one_batch_collates_nothing_under_drop_and_raise(pipeline, agree):
    def collate(batch):
        raise AssertionError(f"collate_fn called on {len(batch['id'])} dropped row(s)")

    src = [{"id": np.arange(2)}, {"id": np.arange(2, 3)}]  # 3 rows across two blocks, batch_size 8
    kw = dict(batch_size=8, collate_fn=collate, pipeline=pipeline, agree=agree)
    it = iter_jax_batches(src, ragged="drop", **kw)
    assert list(it) == [] and it.state()["finished"] and it.state()["rows"] == 0
    # Under "raise", the documented error, not collate_fn's on rows that would never be yielded:
    with pytest.raises(RaggedBatchError, match=r"3 row\(s\) left for batch_size 8"):
        list(iter_jax_batches(src, ragged="raise", **kw))
    with pytest.raises(RaggedBatchError, match=r"3 row\(s\) left for batch_size 8"):
        list(
            iter_jax_batches(
                chunks(19), ragged="raise", **{**kw, "collate_fn": lambda b: b if len(b["id"]) == 8 else 1 / 0}
            )
        )


@pytest.mark.parametrize("ragged", ["drop", "raise"])
@pytest.mark.parametrize("pipeline", ["sync", "thread"])
def test_a_stream_that_ends_at_a_partial_batch_lets_go_of_its_source(pipeline, ragged):
    # The source is paused at its last batch when the stream ends there: closed, so the blocks it
    # holds (Ray object-store memory, for a Dataset) are freed while the caller keeps the iterator.
    # 60 rows: 7 batches of 8, then 4 (the sync pipeline reads up to 8 ahead on CPU devices: the
    # source is paused after the partial batch, not run out).
    src = [{"id": np.arange(i * 5, i * 5 + 5)} for i in range(12)]
    alive = [weakref.ref(b["id"]) for b in src]
    it = iter_jax_batches(iter(src), batch_size=8, ragged=ragged, pipeline=pipeline)
    del src
    got = []
    with contextlib.suppress(RaggedBatchError):
        for b in it:
            got.append(np.asarray(b["id"]).tolist())
    assert got == [list(range(i * 8, i * 8 + 8)) for i in range(7)]
    gc.collect()
    assert [r() is None for r in alive] == [True] * 12, "a source block outlived its stream"


def test_a_threaded_stream_dropped_midway_closes_its_source_without_waiting_for_the_garbage_collector():
    # A caller that breaks out of the loop and drops the iterator: the prefetch thread, the only one
    # that runs the steps, closes them as it stops, so the source (a Ray DataIterator's epoch, say)
    # ends now, not whenever a collection frees the feeder (maybe during the next epoch).
    closed = threading.Event()

    def source():
        try:
            yield from chunks(400)
        finally:
            closed.set()

    gc.disable()  # nothing is freed by a collection meanwhile
    try:
        it = iter_jax_batches(source(), batch_size=8, pipeline="thread", prefetch=2)
        next(it)
        full = time.monotonic() + 10
        while it._feeder._queue.qsize() < 2 and time.monotonic() < full:  # the thread waits to put a batch
            time.sleep(0.01)
        del it  # its __del__ stops the thread without waiting for it
        assert closed.wait(10), "the source stayed open after its stream was dropped"
    finally:
        gc.enable()


def test_raise_names_rows_left_and_comes_before_any_partial_batch():
    it = iter_jax_batches(chunks(19), batch_size=8)
    got = [next(it), next(it)]
    assert all(np.asarray(b["mask"] if "mask" in b else b["id"]).shape == (8,) for b in got)
    with pytest.raises(RaggedBatchError, match=r"3 row\(s\) left for batch_size 8; pass ragged='drop' or ragged='pad'"):
        next(it)
    with pytest.raises(StopIteration):
        next(it)


def test_exact_multiple_does_not_raise():
    assert len(list(iter_jax_batches(chunks(24), batch_size=8))) == 3


def test_sharding_mismatch_names_both_numbers_before_the_first_batch():
    consumed = []

    def source():
        consumed.append(1)
        yield from chunks(16)

    with pytest.raises(ValueError, match=r"global batch 6 .* not divisible by 4"):
        iter_jax_batches(source(), batch_size=6)
    assert consumed == []
    mesh = jax.make_mesh((2, 2), ("data", "model"))
    with pytest.raises(ValueError, match="does not split the batch"):
        iter_jax_batches(chunks(8), batch_size=8, sharding=NamedSharding(mesh, P(None, "data")))


def test_two_axis_sharding_of_the_batch():
    mesh = jax.make_mesh((2, 2), ("data", "fsdp"))
    sharding = NamedSharding(mesh, P(("data", "fsdp")))
    b = next(iter(iter_jax_batches(chunks(16), batch_size=8, sharding=sharding)))
    assert b["x"].sharding.spec == P(("data", "fsdp"))
    assert sorted(s.index[0].start for s in b["x"].addressable_shards) == [0, 2, 4, 6]
    # Only the batch axis is split over "data": 2 shards of 4 rows, each on 2 devices.
    b2 = next(iter(iter_jax_batches(chunks(16), batch_size=8, sharding=NamedSharding(mesh, P("data")))))
    assert sorted({s.index[0].start for s in b2["x"].addressable_shards}) == [0, 4]


def test_dtypes_cast_on_host():
    import ml_dtypes

    # One dtype casts every device column, as Ray's iter_jax_batches does (ids too).
    b = next(iter(iter_jax_batches(chunks(8), batch_size=8, dtypes=np.float32)))
    assert b["x"].dtype == np.float32 and b["id"].dtype == np.float32
    # A mapping casts only the columns it names: ids keep an integer type.
    b = next(iter(iter_jax_batches(chunks(8), batch_size=8, dtypes={"x": ml_dtypes.bfloat16})))
    assert b["x"].dtype == jax.numpy.bfloat16 and b["id"].dtype == np.int32
    with pytest.raises(InvalidArgument, match=r"unknown: \['nope'\]"):
        next(iter(iter_jax_batches(chunks(8), batch_size=8, dtypes={"nope": np.float32})))


def test_columns_and_arrow_tables():
    tables = [
        pa.table(
            {
                "id": pa.array(np.arange(i, i + 4)),
                "v": pa.FixedSizeListArray.from_arrays(pa.array(np.arange(8 * i, 8 * i + 8, dtype=np.float32)), 2),
                "skip": pa.array(["s"] * 4),
            }
        )
        for i in range(0, 12, 4)
    ]
    batches = list(iter_jax_batches(tables, batch_size=4, columns=["id", "v"]))
    assert [sorted(b) for b in batches] == [["id", "v"]] * 3
    assert batches[1]["v"].shape == (4, 2)
    assert ids_of(batches) == list(range(12))


@pytest.mark.parametrize("ragged", ["drop", "pad"])
def test_resume_from_every_step_is_identical(ragged):
    source = chunks(45)
    full = [{k: np.asarray(v) for k, v in b.items()} for b in iter_jax_batches(source, batch_size=8, ragged=ragged)]
    for k in range(len(full) + 1):
        it = iter_jax_batches(source, batch_size=8, ragged=ragged)
        for _ in range(k):
            next(it)
        state = json.loads(json.dumps(it.state()))  # JSON-able, as a checkpoint stores it
        it.close()
        rest = [
            {kk: np.asarray(v) for kk, v in b.items()}
            for b in iter_jax_batches(source, batch_size=8, ragged=ragged, state=state)
        ]
        assert len(rest) == len(full) - k
        for a, b in zip(rest, full[k:]):
            assert a.keys() == b.keys()
            for key in a:
                np.testing.assert_array_equal(a[key], b[key])


def test_prefetch_keeps_batches_ahead_on_device():
    it = iter_jax_batches(chunks(64), batch_size=8, prefetch=3, pipeline="thread")
    first = next(it)
    deadline = __import__("time").monotonic() + 10
    while it._queue.qsize() < 3 and __import__("time").monotonic() < deadline:
        __import__("time").sleep(0.01)
    assert it._queue.qsize() == 3  # three more batches already transferred while we hold the first
    assert first["x"].is_fully_addressable
    it.close()
    assert not it._thread.is_alive()


def test_source_errors_surface_in_order():
    def bad():
        yield {"id": np.arange(8)}
        raise OSError("disk gone")

    it = iter_jax_batches(bad(), batch_size=8)
    next(it)
    with pytest.raises(OSError, match="disk gone"):
        next(it)


@pytest.mark.parametrize("ragged", ["drop", "keep", "pad", "raise"])
def test_grouped_transfers_on_cpu_give_the_same_batches_as_one_at_a_time(ragged, monkeypatch):
    from rayslice.data import _pipeline

    source = chunks(204)  # 25 full batches of 8 and 4 rows left (they split over the 4 devices)
    calls = []
    put = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda *a, **k: calls.append(a[0]) or put(*a, **k))

    def run(**kw):
        out = []
        try:
            for b in iter_jax_batches(source, batch_size=8, ragged=ragged, host_columns=["id"], **kw):
                out.append({k: np.asarray(v) for k, v in b.items()})
        except RaggedBatchError as e:
            out.append(str(e))
        return out

    grouped = run()
    n_grouped = len(calls)
    calls.clear()
    monkeypatch.setattr(_pipeline, "GROUP_MAX_BATCHES", 1)
    single = run()
    assert len(grouped) == len(single) and len(grouped) in (25, 26)
    for a, b in zip(grouped, single):
        if isinstance(a, str):
            assert a == b and "4 row" in a  # the error comes after every full batch, in both
            continue
        assert a.keys() == b.keys()
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])
    # 25 full batches in groups of 8: 4 device_put calls instead of 25 (a padded last batch and its
    # mask are transfers of their own).
    full = 25 if ragged != "keep" else 26
    assert len(calls) >= full and n_grouped <= len(calls) - full + 4 + 1


def test_a_source_error_comes_after_every_batch_read_before_it():
    def bad():
        for i in range(5):
            yield {"x": np.full(8, i, np.float32)}
        raise OSError("disk gone")

    it = iter_jax_batches(bad(), batch_size=8)
    assert it._feeder._group == 8  # CPU, sync: transfers in groups
    assert [float(next(it)["x"][0]) for _ in range(5)] == [0.0, 1.0, 2.0, 3.0, 4.0]
    with pytest.raises(OSError, match="disk gone"):
        next(it)


def test_large_batches_are_transferred_one_by_one():
    rows = [{"x": np.zeros((4096, 256), np.float32)}] * 3  # 4 MiB a batch: the per-call cost is small
    it = iter_jax_batches(rows, batch_size=4096)
    assert sum(1 for _ in it) == 3 and it._feeder._group == 1


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"ragged": "truncate"}, "ragged='truncate' is not valid: expected one of 'raise', 'drop', 'pad', 'keep'"),
        ({"batch_size": 0}, "batch_size=0 is not valid: expected an integer >= 1"),
        ({"prefetch": 0}, "prefetch=0 is not valid: expected an integer >= 1 and <= 1024"),
    ],
)
def test_bad_arguments(kwargs, message):
    args = {"batch_size": 8, **kwargs}
    with pytest.raises(InvalidArgument) as info:
        iter_jax_batches(chunks(8), **args)
    assert str(info.value) == message and isinstance(info.value, ValueError)


def test_a_single_batch_is_not_a_source():
    with pytest.raises(TypeError, match="wrap it in a list"):
        list(iter_jax_batches({"id": np.arange(8)}, batch_size=8))


def test_host_columns_stay_on_the_host_exactly():
    ids = np.arange(2**40, 2**40 + 12, dtype=np.int64)
    src = [{"id": ids, "x": np.ones((12, 2), np.float32), "name": np.array([f"r{i}" for i in range(12)])}]
    batches = list(iter_jax_batches(src, batch_size=8, ragged="pad", host_columns=["id", "name"]))
    assert isinstance(batches[0]["id"], np.ndarray) and batches[0]["id"].dtype == np.int64
    assert not isinstance(batches[0]["x"], np.ndarray)  # a jax.Array on the devices
    real = np.concatenate([b["id"][np.asarray(b["mask"])] for b in batches])
    np.testing.assert_array_equal(real, ids)  # no int32 truncation
    assert batches[1]["name"][:4].tolist() == ["r8", "r9", "r10", "r11"]


def test_close_ends_the_iterator_and_dropping_it_stops_the_thread():
    import gc
    import time

    it = iter_jax_batches(chunks(400), batch_size=8, prefetch=2)
    next(it)
    it.close()
    with pytest.raises(StopIteration):
        next(it)  # ends at once, never blocks
    it = iter_jax_batches(chunks(400), batch_size=8, prefetch=2, pipeline="thread")
    next(it)
    thread = it._thread
    del it  # e.g. `break` out of a loop and move on
    gc.collect()
    deadline = time.monotonic() + 10
    while thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not thread.is_alive()
