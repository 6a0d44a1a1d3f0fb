"""Bad inputs to iter_jax_batches in one process: each one a clear error, nothing silent, no thread left behind.

Table-driven: each row is a call and the error it must raise, with text that
names the parameter or column, the bad value and the fix. (Hosts that
disagree are in test_data_multihost.py; option properties in
test_data_options.py.)
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

jax = pytest.importorskip("jax")

from rayslice.data import iter_jax_batches  # noqa: E402
from rayslice.errors import InvalidArgument  # noqa: E402


def src(n: int = 16, **extra):
    return [{"id": np.arange(n), "x": np.arange(n, dtype=np.float64), **extra}]


# (name, call, exception type, regex the message must match). Raised when the iterator is built.
AT_CONSTRUCTION = [
    (
        "float batch_size",
        lambda: iter_jax_batches(src(), batch_size=4.0),
        InvalidArgument,
        r"^batch_size=4\.0 is not valid: expected an integer >= 1, got float$",
    ),
    ("string batch_size", lambda: iter_jax_batches(src(), batch_size="8"), InvalidArgument, r"^batch_size='8'"),
    ("bool batch_size", lambda: iter_jax_batches(src(), batch_size=True), InvalidArgument, r"^batch_size=True"),
    (
        "lone column name",
        lambda: iter_jax_batches(src(), batch_size=8, columns="id"),
        InvalidArgument,
        r"^columns='id' is not valid: expected a list of strings, e\.g\. \['id'\]$",
    ),
    (
        "negative resume rows",
        lambda: iter_jax_batches(src(), batch_size=8, state={"rows": -8, "batches": 1}),
        InvalidArgument,
        r"^state\['rows'\]=-8 .* >= 0",
    ),
    (
        "negative resume batches",
        lambda: iter_jax_batches(src(), batch_size=8, state={"batches": -1}),
        InvalidArgument,
        r"^state\['batches'\]=-1",
    ),
    (
        "resume state of another kind",
        lambda: iter_jax_batches(src(), batch_size=8, state={"step": 3}),
        InvalidArgument,
        r"^state=\{'step': 3\} .*unknown: \['step'\]",
    ),
    (
        "unknown policy",
        lambda: iter_jax_batches(src(), batch_size=8, ragged="truncate"),
        InvalidArgument,
        r"^ragged='truncate' .*'raise', 'drop', 'pad', 'keep'",
    ),
    (
        "string dtype target",
        lambda: iter_jax_batches(src(), batch_size=8, dtypes=str),
        InvalidArgument,
        r"^dtypes=<class 'str'> .*numeric or bool dtype",
    ),
    (
        "sharding as a string",
        lambda: iter_jax_batches(src(), batch_size=8, sharding="data"),
        InvalidArgument,
        r"^sharding='data' .*NamedSharding",
    ),
    (
        "zero timeout",
        lambda: iter_jax_batches(src(), batch_size=8, agreement_timeout_s=0),
        InvalidArgument,
        r"^agreement_timeout_s=0 .*> 0",
    ),
    (
        "a numpy array as source",
        lambda: iter_jax_batches(np.zeros(8), batch_size=8),
        TypeError,
        r"got ndarray .*\[\{'x': array\}\]",
    ),
    ("an int as source", lambda: iter_jax_batches(3, batch_size=8), TypeError, r"got int"),
    (
        "one batch as source",
        lambda: iter_jax_batches({"x": np.zeros(8)}, batch_size=8),
        TypeError,
        r"wrap it in a list",
    ),
    (
        "drop_last with pad",
        lambda: iter_jax_batches(src(), batch_size=8, drop_last=True, ragged="pad"),
        InvalidArgument,
        r"^drop_last=True .*ragged='pad'",
    ),
    (
        "options and keywords",
        lambda: iter_jax_batches(src(), options=__import__("rayslice").data.FeederOptions(), batch_size=8),
        InvalidArgument,
        r"^batch_size=8 .*options=",
    ),
    (
        "batch not divisible over devices",
        lambda: iter_jax_batches(src(), batch_size=6),
        ValueError,
        r"global batch 6 .* not divisible by 4",
    ),
]


def _feeder_threads() -> set[threading.Thread]:
    # The feeder's own threads only: the process's count moves with other tests' threads ending meanwhile.
    return {t for t in threading.enumerate() if t.name.startswith(("rayslice-feeder", "rayslice-h2d"))}


@pytest.mark.parametrize("name, call, exc, pattern", AT_CONSTRUCTION, ids=[r[0] for r in AT_CONSTRUCTION])
def test_refused_when_built_and_no_thread_is_started(name, call, exc, pattern):
    before = _feeder_threads()
    with pytest.raises(exc, match=pattern):
        call()
    assert _feeder_threads() <= before


def test_a_bad_call_does_not_poison_the_next_good_one():
    with pytest.raises(InvalidArgument):
        iter_jax_batches(src(), batch_size=4.0)
    assert [b["id"].shape for b in iter_jax_batches(src(), batch_size=8)] == [(8,), (8,)]


# Raised at the first next(): the data itself is wrong (seen on the prefetch thread, before any transfer).
AT_FIRST_BATCH = [
    (
        "string column",
        dict(source=src(name=np.array([f"r{i}" for i in range(16)]))),
        TypeError,
        r"column 'name' holds strings, which cannot go to devices; pass host_columns=\['name'\]",
    ),
    (
        "object column",
        dict(source=src(obj=np.array([{"a": i} for i in range(16)], dtype=object))),
        TypeError,
        r"column 'obj' holds object values.*host_columns=\['obj'\]",
    ),
    (
        "NaN cast to int32",
        dict(source=src(v=np.array([1.0, np.nan] * 8)), dtypes={"v": np.int32}),
        ValueError,
        r"column 'v': 4 value\(s\) of float64 are NaN or infinite and have no int32 value",
    ),
    (
        "inf cast to int32",
        dict(source=src(v=np.array([np.inf] * 16)), dtypes=np.int32),
        ValueError,
        r"column 'v': 8 value\(s\) .*\(e\.g\. inf\)",
    ),
    (
        "float past int32",
        dict(source=src(v=np.full(16, 3e9)), dtypes={"v": np.int32}),
        ValueError,
        r"column 'v': values from 3000000000\.0 to 3000000000\.0 do not fit int32",
    ),
    (
        "int64 ids past int32",
        dict(source=src(big=np.arange(16) + 2**40), dtypes={"big": "int32"}),
        ValueError,
        r"column 'big': values from 1099511627776 .* do not fit int32 .*host_columns",
    ),
    (
        "float64 overflowing float16",
        dict(source=src(v=np.full(16, 1e6)), dtypes={"v": np.float16}),
        ValueError,
        r"column 'v': values of float64 overflow float16",
    ),
    (
        "string cast to float",
        dict(source=src(s=np.array(["a"] * 16)), dtypes={"s": np.float32}),
        TypeError,
        r"column 's' holds <U1 values, which cannot be cast to float32",
    ),
    (
        "dtype for a column that is not there",
        dict(source=src(), dtypes={"nope": np.float32}),
        InvalidArgument,
        r"^dtypes=\{'nope': .*unknown: \['nope'\]",
    ),
    (
        "selected column that is not there",
        dict(source=src(), columns=["id", "label"]),
        InvalidArgument,
        r"^columns=\['id', 'label'\] .*missing: \['label'\]",
    ),
    (
        "batches with different columns",
        dict(source=[{"x": np.zeros(5)}, {"y": np.zeros(5)}]),
        ValueError,
        r"source batches have different columns: \['x'\] and \['y'\]",
    ),
    (
        "a column that changes dtype",
        dict(source=[{"x": np.zeros(8, np.int64)}, {"x": np.zeros(8)}], skip=1),
        ValueError,
        r"column 'x' changed from int64\[\] to float64\[\] between batches",
    ),
    (
        "pad value that does not fit",
        dict(source=[{"u": np.arange(6, dtype=np.uint8)}], paddings=-1),
        ValueError,
        r"pad value -1 does not fit column 'u' of dtype uint8",
    ),
    (
        "fractional pad for ints",
        dict(source=src(6), ragged="pad", pad_value={"id": 0.5, "x": 0}),
        ValueError,
        r"pad value 0\.5 does not fit column 'id' of dtype int64",
    ),
    (
        "collate_fn returning a list",
        dict(source=src(), collate_fn=lambda b: [1, 2]),
        TypeError,
        r"collate_fn returned list; expected a np\.ndarray or dict",
    ),
    (
        "mask name clash",
        dict(source=[{"mask": np.zeros(8)}], ragged="pad"),
        ValueError,
        r"column 'mask' clashes with the pad mask; pass mask_key=",
    ),
]


@pytest.mark.parametrize("name, kwargs, exc, pattern", AT_FIRST_BATCH, ids=[r[0] for r in AT_FIRST_BATCH])
def test_bad_data_is_named_at_the_first_batch(name, kwargs, exc, pattern):
    kwargs = dict(kwargs)
    source, skip = kwargs.pop("source"), kwargs.pop("skip", 0)
    with iter_jax_batches(source, batch_size=8, **kwargs) as it:
        for _ in range(skip):
            next(it)
        with pytest.raises(exc, match=pattern):
            next(it)


def test_lossless_casts_still_pass():
    b = next(iter_jax_batches(src(v=np.arange(16, dtype=np.float64)), batch_size=8, dtypes={"v": np.int32}))
    assert np.asarray(b["v"]).tolist() == list(range(8))


def test_bad_input_count():
    # Recorded for the hardening report: every row above is a distinct bad input.
    assert len(AT_CONSTRUCTION) + len(AT_FIRST_BATCH) + 1 >= 30


class _FakeDataset:
    def streaming_split(self, n, equal=False):  # never reached: arguments are refused first
        raise AssertionError("reached the reservation")


def _held_slice(released: bool):
    from rayslice.placement import SlicePlacementGroup
    from rayslice.request import SliceRequest

    # A handle as slice_placement_group returns it, without a cluster behind it (never used: refused first).
    return (
        SlicePlacementGroup._held(SliceRequest.parse("2x2x2", "TPU-V4"), (), "held", 0.0)
        if not released
        else _released(SlicePlacementGroup._held(SliceRequest.parse("2x2x2", "TPU-V4"), (), "held", 0.0))
    )


def _released(spg):
    spg._released = True
    return spg


BATCH_PREDICT = [
    (dict(batch_size=4.0), r"^batch_size=4\.0"),
    (dict(keep_columns="id"), r"^keep_columns='id' .*\['id'\]"),
    (dict(input_columns=[1]), r"^input_columns=\[1\]"),
    (dict(output_column=""), r"^output_column=''"),
    (dict(timeout_s=-1), r"^timeout_s=-1"),
    (dict(dtypes="text"), r"^dtypes='text'"),
    (dict(topology=None), r"^topology=None .*tpu_slice="),
    (dict(topology="2x2x2", accelerator_type="TPU-V99"), r"V99|v99"),
    (dict(topology=None, accelerator_type=None, tpu_slice="slice-a"), r"^tpu_slice='slice-a' .*SlicePlacementGroup"),
    (dict(tpu_slice=_held_slice(False)), r"^topology='2x2x2' .*left out when tpu_slice= is given"),
    (dict(topology=None, accelerator_type=None, tpu_slice=_held_slice(True)), r"^tpu_slice=.* still held"),
    (dict(predict_fn=lambda state, batch: batch), r"^setup=None .*\(state, batch\)"),
    (dict(predict_fn=5), r"^predict_fn=5"),
    (dict(dataset=[1, 2]), r"^dataset=\[1, 2\] .*ray\.data\.Dataset"),
]


@pytest.mark.parametrize("kwargs, pattern", BATCH_PREDICT, ids=[p for _, p in BATCH_PREDICT])
def test_batch_predict_refuses_bad_arguments_before_reserving(kwargs, pattern):
    from rayslice.data import batch_predict

    args = {
        "dataset": _FakeDataset(),
        "predict_fn": lambda b: b["x"],
        "batch_size": 8,
        "topology": "2x2x2",
        "accelerator_type": "TPU-V4",
        **kwargs,
    }
    if "tpu_slice" in kwargs and "topology" not in kwargs:
        args.pop("accelerator_type")
    with pytest.raises(InvalidArgument, match=pattern):
        batch_predict(args.pop("dataset"), args.pop("predict_fn"), **args)
