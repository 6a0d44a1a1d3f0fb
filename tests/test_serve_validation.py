"""Serve's pure validation: HTTP bodies (Hypothesis properties), configs and options (tables).

No Ray: these run in milliseconds. Every bad input tried is counted; the count
is printed at the end of the module (``pytest -s``) and checked to be large.
"""

from __future__ import annotations

import json
import math
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rayslice.errors import InvalidArgument, Outcome, RunOutcome
from rayslice.request import SliceRequest
from rayslice.serve import (
    ColumnSpec,
    InputSpec,
    RequestError,
    SliceServeConfig,
    build,
    deployment,
    http_status,
    parse_accelerator_config,
    start_http,
)
from rayslice.serve.schema import column_array, parse_body, validate_untyped
from rayslice.topology import Topology

BAD_INPUTS = {"http": 0, "config": 0}
V4 = {"kind": "tpu", "topology": "2x2x2"}


@pytest.fixture(scope="module", autouse=True)
def _report_count():
    yield
    print(f"\nserve bad inputs tried: HTTP bodies {BAD_INPUTS['http']}, configs {BAD_INPUTS['config']}")


def _bad_body(body: bytes, spec: InputSpec | None, expect: str, status: tuple[int, ...] = (400, 413, 422)) -> None:
    """``body`` must be refused with a 4xx RequestError whose message contains ``expect``."""
    BAD_INPUTS["http"] += 1
    with pytest.raises(RequestError) as info:
        inputs = parse_body(body, 1 << 20)
        spec.validate(inputs) if spec is not None else validate_untyped(inputs)
    assert info.value.status in status, (body[:200], info.value.status, str(info.value))
    assert expect in str(info.value), (body[:200], str(info.value))


# ---------------------------------------------------------------- HTTP bodies: tables

SPEC = InputSpec.parse({"x": ((3,), "float32"), "k": ((), "int32"), "m": ((2,), "bool")})
GOOD = {"x": [[1, 2, 3]], "k": [7], "m": [[True, False]]}


def _with(**cols) -> bytes:
    return json.dumps({"inputs": {**GOOD, **cols}}).encode()


BODIES = [
    # (body, substring of the error, statuses)
    (b"", "body is empty", (400,)),
    (b"   ", "body is empty", (400,)),
    (b"{not json", "malformed JSON", (400,)),
    (b"\xff\xfe\x00", "malformed JSON", (400,)),
    (b"[1, 2]", 'JSON object with "inputs"', (400,)),
    (b'"inputs"', 'JSON object with "inputs"', (400,)),
    (b"null", 'JSON object with "inputs"', (400,)),
    (b'{"input": {}}', 'JSON object with "inputs"', (400,)),
    (b'{"inputs": {}, "extra": 1}', "unexpected keys ['extra']", (400,)),
    (b'{"inputs": {"x": [[NaN, 1, 2]], "k": [1], "m": [[true, true]]}}', "NaN is not a JSON number", (400,)),
    (b'{"inputs": {"x": [[Infinity, 1, 2]], "k": [1], "m": [[true, true]]}}', "Infinity is not a JSON number", (400,)),
    (b'{"inputs": {"x": [[-Infinity, 1, 2]], "k": [1], "m": [[true, true]]}}', "-Infinity", (400,)),
    (b'{"inputs": {"x": [[1e999, 1, 2]], "k": [1], "m": [[true, true]]}}', "1e999 overflows", (422,)),
    (b'{"inputs": {"x": [[-1e999, 1, 2]], "k": [1], "m": [[true, true]]}}', "-1e999 overflows", (422,)),
    (b'{"inputs": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", "nested too deeply", (400,)),
    (_with(x=json.loads("[" * 200 + "1" + "]" * 200)), "nested too deeply", (422,)),
    (b'{"inputs": {"x": [[1, 2, 3]], "k": [1' + b"0" * 5000 + b'], "m": [[true, true]]}}', "malformed JSON", (400,)),
    (_with(x=[[1e39, 1, 2]]), "outside the float32 range", (422,)),
    (_with(x=[[-3.5e38, 1, 2]]), "outside the float32 range", (422,)),
    (_with(x=[[True, 1, 2]]), "got booleans", (422,)),
    (_with(x=[[True, False, True]]), "got booleans", (422,)),
    (_with(k=[True]), "got booleans", (422,)),
    (_with(k=[1.5]), "got floating-point values", (422,)),
    (_with(k=[2**31]), "outside the int32 range", (422,)),
    (_with(k=[-(2**31) - 1]), "outside the int32 range", (422,)),
    (_with(k=[2**70]), "outside the int32 range", (422,)),
    (_with(m=[[1, 0]]), "must be bool", (422,)),
    (_with(m=[[1.0, 0.0]]), "must be bool", (422,)),
    (_with(x=[["a", "b", "c"]]), "must be numeric; got str", (422,)),
    (_with(x=[[None, 1, 2]]), "must be numeric; got null", (422,)),
    (_with(x=[[{}, 1, 2]]), "must be numeric; got dict", (422,)),
    (_with(x=[[1, 2, 3], [1, 2]], k=[1, 2], m=[[True, True]] * 2), "rectangular", (422,)),
    (_with(x=[[1, 2]]), "must have shape (rows, 3)", (422,)),
    (_with(x=[1, 2, 3]), "must have shape (rows, 3)", (422,)),
    (_with(x=7), "must have shape (rows, 3)", (422,)),
    (_with(x=[]), "must have shape", (422,)),
    (_with(x=[[1, 2, 3]] * 2), "different row counts", (422,)),
    (json.dumps({"inputs": {"x": [[1, 2, 3]], "k": [1]}}).encode(), "missing ['m']", (422,)),
    (_with(y=[[1]]), "unexpected ['y']", (422,)),
    (json.dumps({"inputs": [[1, 2, 3]]}).encode(), "must be an object of columns", (422,)),
    (json.dumps({"inputs": None}).encode(), "must be an object of columns", (422,)),
    (json.dumps({"inputs": "x"}).encode(), "must be an object of columns", (422,)),
    (_with(x=[[1, 2, 3]] * 5000, k=[1] * 5000, m=[[True, True]] * 5000), "limit is 1024", (413,)),
]


@pytest.mark.parametrize("body, expect, status", BODIES, ids=[f"body{i}" for i in range(len(BODIES))])
def test_bad_bodies_are_4xx_naming_the_problem(body, expect, status):
    _bad_body(body, SPEC, expect, status)


def test_good_body_becomes_typed_arrays():
    out = SPEC.validate(parse_body(_with(), 1 << 20))
    assert {k: v.dtype.name for k, v in out.items()} == {"x": "float32", "k": "int32", "m": "bool"}
    np.testing.assert_array_equal(out["x"], [[1, 2, 3]])
    assert out["k"].tolist() == [7] and out["m"].tolist() == [[True, False]]


def test_oversized_body_is_413():
    BAD_INPUTS["http"] += 1
    with pytest.raises(RequestError, match="exceeds the limit of 10") as info:
        parse_body(b"x" * 11, 10)
    assert info.value.status == 413


UNTYPED = [
    (json.dumps({"inputs": {}}).encode(), "non-empty object"),
    (json.dumps({"inputs": {"a": 1}}).encode(), "leading row dimension"),
    (json.dumps({"inputs": {"a": [1, 2], "b": [1]}}).encode(), "different row counts"),
    (json.dumps({"inputs": {"a": [1, True]}}).encode(), "mixes booleans and numbers"),
    (json.dumps({"inputs": {"a": []}}).encode(), "at least one row"),
    (json.dumps({"inputs": {"a": ["s"]}}).encode(), "must be numeric"),
    (json.dumps({"inputs": {"a": [2**64, 1]}}).encode(), "too large for 64 bits"),
    (json.dumps({"inputs": {"a": [2**70]}}).encode(), "too large for 64 bits"),
]


@pytest.mark.parametrize("body, expect", UNTYPED)
def test_bad_untyped_bodies(body, expect):
    _bad_body(body, None, expect)


def test_numpy_inputs_from_a_handle_follow_the_same_rules():
    spec = InputSpec.parse({"x": ((2,), "float32")})
    for arr, expect in [
        (np.ones((1, 2), bool), "got booleans"),
        (np.full((1, 2), 1e300), "outside the float32"),
        (np.array([["a", "b"]]), "must be numeric"),
        (np.ones((1, 3), np.float32), "shape"),
    ]:
        BAD_INPUTS["http"] += 1
        with pytest.raises(RequestError, match=expect):
            spec.validate({"x": arr})
    # NaN is a float32 value (JSON cannot carry it; a handle can): kept, not silently changed.
    assert math.isnan(spec.validate({"x": np.array([[np.nan, 1.0]])})["x"][0, 0])
    ints = InputSpec.parse({"k": ((), "int8")})
    BAD_INPUTS["http"] += 1
    with pytest.raises(RequestError, match="outside the int8 range"):
        ints.validate({"k": np.array([300], np.int64)})


# ---------------------------------------------------------------- HTTP bodies: properties

DTYPES = ["float32", "float64", "float16", "int8", "int32", "int64", "uint8", "bool"]
names = st.text("abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=6)
specs = st.dictionaries(
    names, st.tuples(st.lists(st.integers(1, 3), max_size=2), st.sampled_from(DTYPES)), min_size=1, max_size=3
)


def _leaf(dtype: str):
    dt = np.dtype(dtype)
    if dt.kind == "b":
        return st.booleans()
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return st.integers(int(info.min), int(info.max))
    top = float(np.finfo(dt).max)
    return st.floats(-top, top, allow_nan=False, allow_infinity=False) | st.integers(-1000, 1000)


@st.composite
def good_requests(draw):
    spec = draw(specs)
    rows = draw(st.integers(1, 4))
    cols = {}
    for name, (shape, dtype) in spec.items():
        n = rows * int(np.prod(shape, dtype=int))
        flat = draw(st.lists(_leaf(dtype), min_size=n, max_size=n))
        cols[name] = np.array(flat, dtype=object).reshape((rows, *shape)).tolist()
    return InputSpec.parse({k: (tuple(s), d) for k, (s, d) in spec.items()}), cols, rows


@settings(max_examples=150, deadline=None)
@given(good_requests())
def test_property_good_bodies_are_accepted_exactly(req):
    spec, cols, rows = req
    out = spec.validate(parse_body(json.dumps({"inputs": cols}).encode(), 1 << 20))
    for name, col in spec.columns.items():
        assert out[name].dtype == np.dtype(col.dtype) and out[name].shape == (rows, *col.shape)
        if np.dtype(col.dtype).kind in "iub":
            assert out[name].tolist() == np.asarray(cols[name]).astype(col.dtype).tolist()


MUTATIONS = {
    # name: (how to break one leaf of a column, expected message, applicable dtype kinds)
    "bool": (lambda v: True, "booleans", "fiu"),
    "string": (lambda v: "1", "must be numeric", "fiub"),
    "null": (lambda v: None, "must be numeric", "fiub"),
    "object": (lambda v: {"v": v}, "must be numeric", "fiub"),
    "float_for_int": (lambda v: 0.5, "floating-point", "iu"),
    "number_for_bool": (lambda v: 1, "must be bool", "b"),
    "int_overflow": (lambda v: 2**63, "outside the", "iu"),
    "float32_overflow": (lambda v: 1e300, "outside the", "f"),
}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(good_requests(), st.sampled_from(sorted(MUTATIONS)), st.data())
def test_property_one_bad_leaf_is_a_422_naming_the_column(req, mutation, data):
    spec, cols, _ = req
    breaker, expect, kinds = MUTATIONS[mutation]
    candidates = [
        n
        for n, c in spec.columns.items()
        if np.dtype(c.dtype).kind in kinds
        and not (mutation == "float32_overflow" and c.dtype == "float64")
        and not (mutation == "int_overflow" and c.dtype == "uint64")
    ]
    if not candidates:
        return
    name = data.draw(st.sampled_from(candidates))
    arr = np.array(cols[name], dtype=object)
    flat = arr.reshape(-1)
    i = data.draw(st.integers(0, flat.size - 1))
    flat[i] = breaker(flat[i])
    cols = {**cols, name: arr.tolist()}
    body = json.dumps({"inputs": cols}).encode()
    BAD_INPUTS["http"] += 1
    with pytest.raises(RequestError) as info:
        spec.validate(parse_body(body, 1 << 20))
    assert info.value.status == 422 and expect in str(info.value) and repr(name) in str(info.value)


@settings(max_examples=150, deadline=None)
@given(good_requests(), st.sampled_from(["drop", "extra", "short_row", "extra_key", "wrap", "truncate", "nan"]))
def test_property_structural_breaks_are_4xx(req, how):
    spec, cols, _ = req
    name = next(iter(spec.columns))
    payload: object = {"inputs": dict(cols)}
    if how == "drop":
        del payload["inputs"][name]
    elif how == "extra":
        payload["inputs"]["zz_extra_column"] = [[1]]
    elif how == "short_row":
        payload["inputs"][name] = cols[name] + [[0] * 5]  # per-row dimensions here are 1..3
    elif how == "extra_key":
        payload["meta"] = 1
    elif how == "wrap":
        payload = [payload]
    body = json.dumps(payload).encode()
    if how == "truncate":
        body = body[: len(body) // 2]
    if how == "nan":
        body = body.replace(b'{"inputs": {', b'{"inputs": {"nan_col": [NaN], ', 1)
    BAD_INPUTS["http"] += 1
    with pytest.raises(RequestError) as info:
        spec.validate(parse_body(body, 1 << 20))
    assert 400 <= info.value.status < 500 and str(info.value)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(json_values, st.booleans())
def test_property_any_json_is_accepted_or_a_4xx(inputs, typed):
    """Random JSON as ``inputs``: either valid numeric columns or a RequestError, never another exception."""
    body = json.dumps({"inputs": inputs}).encode()
    try:
        out = parse_body(body, 1 << 20)
        out = SPEC.validate(out) if typed else validate_untyped(out)
    except RequestError as e:
        BAD_INPUTS["http"] += 1
        assert 400 <= e.status < 500 and str(e)
        return
    assert all(isinstance(v, np.ndarray) and v.dtype.kind in "fiub" and v.ndim >= 1 for v in out.values())


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_property_random_bytes_are_4xx(body):
    try:
        validate_untyped(parse_body(body, 1 << 20))
    except RequestError as e:
        BAD_INPUTS["http"] += 1
        assert 400 <= e.status < 500


def test_column_array_keeps_the_value_exact_for_numpy_inputs():
    arr = np.arange(6, dtype=np.int64).reshape(2, 3)
    assert column_array("x", arr, want=np.dtype("int16")).dtype == np.int16


# ---------------------------------------------------------------- configs: tables


def _bad_config(fn, expect: str) -> None:
    """``fn()`` must raise InvalidArgument (a TypeError and a ValueError) whose message has ``expect``."""
    BAD_INPUTS["config"] += 1
    with pytest.raises(InvalidArgument) as info:
        fn()
    assert expect in str(info.value), str(info.value)
    assert "\n" not in str(info.value)


CONFIGS = [
    (dict(accelerator_type="TPU-V4", accelerator_config="2x2x2"), "accelerator_config='2x2x2'"),
    (dict(accelerator_type="TPU-V4", accelerator_config=None), "accelerator_config=None"),
    (dict(accelerator_type="TPU-V4", accelerator_config=["tpu", "2x2x2"]), "accelerator_config=['tpu', '2x2x2']"),
    (
        dict(accelerator_type="TPU-V4", accelerator_config={"kind": "gpu", "topology": "2x2x2"}),
        "accelerator_config type 'gpu' is not supported; valid: tpu",
    ),
    (dict(accelerator_type="TPU-V4", accelerator_config={"type": "gpu", "topology": "2x2x2"}), "'gpu'"),
    (dict(accelerator_type="TPU-V4", accelerator_config={"kind": 1, "topology": "2x2x2"}), "['kind']=1"),
    (
        dict(accelerator_type="TPU-V4", accelerator_config={"kind": "tpu", "type": "gpu", "topology": "2x2x2"}),
        "'kind' or 'type'",
    ),
    (dict(accelerator_type="TPU-V4", accelerator_config={"kind": "tpu"}), "needs a 'topology'"),
    (dict(accelerator_type="TPU-V4", accelerator_config={"kind": "tpu", "topology": None}), "needs a 'topology'"),
    (dict(accelerator_type="TPU-V4", accelerator_config={"kind": "tpu", "topology": 8}), "['topology']=8"),
    (dict(accelerator_type="TPU-V4", accelerator_config={"kind": "tpu", "topology": "3x3x3"}), "'3x3x3'"),
    (
        dict(accelerator_type="v6e", accelerator_config={"kind": "tpu", "topology": "3x3"}),
        "'3x3' is not a v6e topology",
    ),
    (dict(accelerator_type="TPU-V9", accelerator_config=V4), "TPU-V9"),
    (dict(accelerator_type="", accelerator_config=V4), "accelerator_type=''"),
    (dict(accelerator_type=4, accelerator_config=V4), "accelerator_type=4"),
    (dict(accelerator_type="TPU-V4", accelerator_config={**V4, "chips_per_host": "4"}), "chips_per_host']='4'"),
    (dict(accelerator_type="TPU-V4", accelerator_config={**V4, "chips_per_host": 0}), "chips_per_host']=0"),
    (
        dict(
            accelerator_type="TPU-V6E",
            accelerator_config={"kind": "tpu", "topology": "2x4", "chips_per_host": 4, "chips_per_vm": 8},
        ),
        "'chips_per_host' or 'chips_per_vm'",
    ),
    (dict(accelerator_type="TPU-V4", accelerator_config={**V4, "zone": "x"}), "unknown keys"),
    (dict(accelerator_type="TPU-V4", accelerator_config=V4, input_spec="x:8"), "input_spec='x:8'"),
    (dict(accelerator_type="TPU-V4", accelerator_config=V4, input_spec={}), "at least one column"),
    (dict(accelerator_type="TPU-V4", accelerator_config=V4, input_spec={"x": "8xfloat32"}), "input_spec['x']"),
    (dict(accelerator_type="TPU-V4", accelerator_config=V4, input_spec={"x": (8, "float32", 1)}), "input_spec['x']"),
    (dict(accelerator_type="TPU-V4", accelerator_config=V4, input_spec={"x": ((0,), "float32")}), "shape=(0,)"),
    (dict(accelerator_type="TPU-V4", accelerator_config=V4, input_spec={"x": (("8",), "float32")}), "shape=('8',)"),
    (dict(accelerator_type="TPU-V4", accelerator_config=V4, input_spec={"x": ((True,), "float32")}), ".shape"),
    (dict(accelerator_type="TPU-V4", accelerator_config=V4, input_spec={"x": ("8", "float32")}), "shape='8'"),
    (
        dict(accelerator_type="TPU-V4", accelerator_config=V4, input_spec={"x": ((8,), "object")}),
        "dtype 'object' is not numeric",
    ),
    (dict(accelerator_type="TPU-V4", accelerator_config=V4, input_spec={"x": ((8,), "floaty")}), "'floaty'"),
    (dict(accelerator_type="TPU-V4", accelerator_config=V4, input_spec={"x": ((8,), "complex64")}), "'complex64'"),
    (dict(accelerator_type="TPU-V4", accelerator_config=V4, input_spec={"x": ((8,), None)}), "dtype=None"),
    (dict(accelerator_type="TPU-V4", accelerator_config=V4, input_spec={"x": {"shape": [8]}}), "'shape' and 'dtype'"),
    (dict(accelerator_type="TPU-V4", accelerator_config=V4, input_spec={"": ((8,), "float32")}), "non-empty"),
    (dict(accelerator_type="TPU-V4", accelerator_config=V4, input_spec={1: ((8,), "float32")}), "non-empty strings"),
    (dict(accelerator_type="TPU-V4", accelerator_config=V4, max_batch_size=0), "max_batch_size=0"),
    (dict(accelerator_type="TPU-V4", accelerator_config=V4, max_batch_size=4.0), "max_batch_size=4.0"),
    (dict(accelerator_type="TPU-V4", accelerator_config=V4, max_batch_size=True), "max_batch_size=True"),
    (dict(accelerator_type="TPU-V4", accelerator_config=V4, max_batch_size="8"), "max_batch_size='8'"),
    (dict(accelerator_type="TPU-V4", accelerator_config=V4, max_body_bytes=0), "max_body_bytes=0"),
    (dict(accelerator_type="TPU-V4", accelerator_config=V4, max_body_bytes=None), "max_body_bytes=None"),
    (dict(accelerator_type="TPU-V4", accelerator_config=V4, reservation_timeout_s=0), "reservation_timeout_s=0"),
    (dict(accelerator_type="TPU-V4", accelerator_config=V4, reservation_timeout_s=-1), "reservation_timeout_s=-1"),
    (dict(accelerator_type="TPU-V4", accelerator_config=V4, reservation_timeout_s="5"), "reservation_timeout_s='5'"),
    (dict(accelerator_type="TPU-V4", accelerator_config=V4, init_timeout_s=float("nan")), "init_timeout_s=nan"),
    (dict(accelerator_type="TPU-V4", accelerator_config=V4, request_timeout_s=float("inf")), "request_timeout_s=inf"),
    (dict(accelerator_type="TPU-V4", accelerator_config=V4, request_timeout_s=None), "request_timeout_s=None"),
    (dict(accelerator_type="TPU-V4", accelerator_config=V4, body_timeout_s=0), "body_timeout_s=0"),
    (dict(accelerator_type="TPU-V4", accelerator_config=V4, batch_wait_timeout_s=-0.1), "batch_wait_timeout_s=-0.1"),
    (dict(accelerator_type="TPU-V4", accelerator_config=V4, batch_wait_timeout_s=False), "batch_wait_timeout_s=False"),
]


@pytest.mark.parametrize("kwargs, expect", CONFIGS, ids=[f"cfg{i}" for i in range(len(CONFIGS))])
def test_bad_deployment_options_name_the_value(kwargs, expect):
    _bad_config(lambda: deployment(**kwargs), expect)


class _NoCall:
    def setup(self, ctx):
        pass


class _CallIsData:
    __call__ = 3


class _SetupIsData:
    setup = "not a method"

    def __call__(self, batch):
        return batch


def _fn(batch):
    return batch


@pytest.mark.parametrize(
    "model, expect",
    [
        (_NoCall, "defines __call__(self, batch); _NoCall does not"),
        (_CallIsData, "_CallIsData.__call__ is 3"),
        (_SetupIsData, "_SetupIsData.setup is 'not a method'"),
        (_fn, "a class with __call__"),
        (None, "model=None"),
        (42, "model=42"),
    ],
)
def test_model_without_call_is_rejected_at_construction(model, expect):
    _bad_config(lambda: deployment(accelerator_type="TPU-V4", accelerator_config=V4)(model), expect)


def test_model_classes_that_are_accepted():
    class Base:
        def __call__(self, batch):
            return batch

    class Child(Base):  # __call__ inherited
        pass

    for cls in (Base, Child):
        assert deployment(accelerator_type="TPU-V4", accelerator_config=V4)(cls) is not None


@pytest.mark.parametrize(
    "fn, expect",
    [
        (lambda: SliceServeConfig("TPU-V4", "2x2x2", chips_per_host=0), "chips_per_host=0"),
        (lambda: SliceServeConfig("TPU-V4", 222), "topology=222"),
        (lambda: SliceServeConfig(None, SliceRequest.parse("2x2x2", "v4", num_slices=2)), "one slice"),
        (lambda: SliceServeConfig(None, "2x2x2"), "accelerator_type"),
        (lambda: SliceServeConfig("TPU-V4", "2x2x2", input_spec=[("x", 8)]), "input_spec"),
        (lambda: InputSpec.parse({"x": ((8,), "float32")}, max_rows=0), "max_rows=0"),
        (lambda: InputSpec({}), "columns={}"),
        (lambda: InputSpec({"x": ((8,), "float32")}), "a ColumnSpec"),
        (lambda: ColumnSpec((8,), "str"), "not numeric"),
        (lambda: ColumnSpec([8, -1], "float32"), "shape=(8, -1)"),
        (lambda: ColumnSpec((1,) * 40, "float32"), "at most 32 dimensions"),
        (lambda: parse_accelerator_config(None, V4), "accelerator_type=None"),
        (lambda: start_http(port=0), "port=0"),
        (lambda: start_http(port="8000"), "port='8000'"),
        (lambda: start_http(port=8000, host=""), "host=''"),
        (lambda: build(["model"]), "args=['model']"),
        (lambda: build({"model": "nomodule", "accelerator_type": "v4", "accelerator_config": V4}), "ClassName"),
        (lambda: build({"model": 5, "accelerator_type": "v4", "accelerator_config": V4}), "args['model']=5"),
        (lambda: build({"model": "json:Nope", "accelerator_type": "v4", "accelerator_config": V4}), "json:Nope"),
        (
            lambda: build({"model": "no_such_pkg_x:M", "accelerator_type": "v4", "accelerator_config": V4}),
            "no_such_pkg_x",
        ),
        (
            lambda: build(
                {
                    "model": "tests.serve_models:Dot",
                    "accelerator_type": "v4",
                    "accelerator_config": V4,
                    "init_args": "abc",
                }
            ),
            "init_args",
        ),
        (
            lambda: build(
                {
                    "model": "tests.serve_models:Dot",
                    "accelerator_type": "v4",
                    "accelerator_config": V4,
                    "init_kwargs": [1],
                }
            ),
            "init_kwargs",
        ),
        (lambda: build({"model": "tests.serve_models:Dot", "accelerator_type": "v4"}), "missing 'accelerator_config'"),
    ],
)
def test_bad_configs_name_the_value(fn, expect):
    _bad_config(fn, expect)


# ---------------------------------------------------------------- accepted spellings, one parse


def test_ray_serve_llm_and_rayslice_spellings_give_one_request():
    want = SliceRequest.parse("2x4", "TPU-V6E", chips_per_host=4)
    for cfg in (
        {"kind": "tpu", "topology": "2x4", "chips_per_host": 4},
        {"type": "tpu", "topology": "2x4", "chips_per_host": 4},
        {"kind": "TPU", "type": "tpu", "topology": "2x4", "chips_per_vm": 4},
        {"topology": "2x4", "chips_per_vm": 4},
    ):
        assert parse_accelerator_config("TPU-V6E", cfg) == want
    assert parse_accelerator_config("v4", {"kind": "tpu", "topology": Topology.parse("2x2x2", "v4")}).num_hosts == 2


def test_ray_serve_llm_tpu_config_object_is_accepted():
    accelerators = pytest.importorskip("ray.llm._internal.serve.core.configs.accelerators")
    req = parse_accelerator_config("TPU-V4", accelerators.TPUConfig(topology="2x2x2"))
    assert req == SliceRequest.parse("2x2x2", "TPU-V4")
    BAD_INPUTS["config"] += 1
    with pytest.raises(InvalidArgument, match="needs a 'topology'"):
        parse_accelerator_config("TPU-V4", accelerators.TPUConfig())


def test_config_parses_the_request_once_and_keeps_it():
    cfg = SliceServeConfig.from_accelerator_config(
        "TPU-V4",
        {"kind": "tpu", "topology": "2x2x2"},
        input_spec={"x": {"shape": [8], "dtype": "float32"}},
        max_batch_size=8,
    )
    assert isinstance(cfg.request, SliceRequest) and cfg.topology_info is cfg.request.topology
    assert cfg.input_spec.max_rows == 8 and cfg.input_spec.columns["x"] == ColumnSpec((8,), "float32")
    # A request or a Topology given whole is used as is (never parsed again).
    assert SliceServeConfig(None, cfg.request).request is cfg.request
    topo = Topology.parse("4x4", "v6e")
    assert SliceServeConfig(None, topo).request.topology is topo
    # Ints for float options are fine and become floats.
    assert SliceServeConfig("v4", "2x2x2", request_timeout_s=5).request_timeout_s == 5.0


def test_small_batches_travel_inline_with_each_host_call():
    from rayslice.serve.replica import SHARE_BYTES, _shared

    small = {"x": np.ones((SHARE_BYTES // 32 - 1, 8), np.float32)}
    assert _shared(small) is small  # no object-store round trip below Ray's own inline limit


def _answer_case(events, timeout_s: float = 5.0):
    """Runs one step's :class:`_Answer` over two hand-made host futures; ``events`` settle them in order."""
    import asyncio

    from rayslice.serve.replica import ReplicaCore, _Answer

    core = object.__new__(ReplicaCore)  # only what _Answer uses: the config and the health flag
    core.cfg, core.broken = SliceServeConfig("v4", "2x2x2", request_timeout_s=timeout_s), None

    async def run():
        loop = asyncio.get_running_loop()
        hosts = [loop.create_future(), loop.create_future()]
        answer = _Answer(core, hosts, time.monotonic() + timeout_s)
        got = None
        for rank, value in events:
            if isinstance(value, BaseException):
                hosts[rank].set_exception(value)
            else:
                hosts[rank].set_result(value)
            await asyncio.sleep(0)
            if got is None and answer.future.done():
                got = answer.future.exception() or answer.future.result()
        if got is None:
            try:
                got = await answer.future
            except Exception as e:
                got = e
        if isinstance(got, Exception):
            answer.drop()  # as the step does: stop waiting for the other hosts
        elif not all(h.done() for h in hosts):  # a host still running: wait for its deadline to be noticed
            until = time.monotonic() + timeout_s + 5.0
            while core.broken is None and time.monotonic() < until:
                await asyncio.sleep(0.01)
        answer.drop()
        return got

    return asyncio.run(run()), core.broken


def test_a_step_answers_with_host_0_and_tells_a_lost_host_from_a_model_error():
    from rayslice.errors import GangError

    lost = GangError("gone", outcome=Outcome.PREEMPTED)
    # Host 0 answers: the request has it; a host lost afterwards turns the replica unhealthy.
    got, broken = _answer_case([(0, {"y": 1}), (1, lost)])
    assert got == {"y": 1} and broken is not None and broken.outcome is Outcome.PREEMPTED
    # Another host lost first: the request fails at once, naming it (host 0 may sit in a collective).
    got, broken = _answer_case([(1, lost)])
    assert isinstance(got, GangError) and got.outcome is Outcome.PREEMPTED and got.rank == 1
    assert str(got) == "host 1: GangError: gone" and got.__cause__ is lost
    # A model error on another host is the request's: host 0 reports it; the replica stays healthy.
    got, broken = _answer_case([(1, ValueError("bad row")), (0, ValueError("bad row"))])
    assert isinstance(got, ValueError) and broken is None
    got, broken = _answer_case([(1, None), (0, {"y": 2})])
    assert got == {"y": 2} and broken is None


def test_a_step_past_its_deadline_fails_and_a_late_host_turns_the_replica_unhealthy():
    got, broken = _answer_case([], timeout_s=0.05)
    assert isinstance(got, TimeoutError) and "request_timeout_s=0.05" in str(got)
    got, broken = _answer_case([(0, {"y": 1})], timeout_s=0.05)  # host 1 never finishes
    assert got == {"y": 1} and broken is not None and broken.outcome is Outcome.TIMEOUT


def test_outcomes_map_to_http_statuses():
    assert http_status(RunOutcome.success(1.0)) == 200
    assert http_status(RunOutcome.of(ValueError("model bug"))) == 500
    assert http_status(RunOutcome.of(TimeoutError("slow"))) == 503
    for o in (Outcome.PREEMPTED, Outcome.TIMEOUT, Outcome.CANCELLED):
        assert http_status(o) == 503
    with pytest.raises(ValueError, match="4xx"):
        RequestError("no", status=500)


def test_bad_input_counts_are_large():
    """The tables above hold at least this many bad inputs (the properties add hundreds more)."""
    assert len(BODIES) + len(UNTYPED) + len(CONFIGS) >= 95
