"""SliceRequest, Ray's argument vocabulary for it, and the shared argument checks (pure, Hypothesis)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rayslice import _validate as v
from rayslice.errors import InvalidArgument
from rayslice.request import SliceRequest, bundle_label_selectors, request_from_args
from rayslice.topology import GENERATIONS, Topology, valid_topologies

# -- SliceRequest ----------------------------------------------------------------------------------------------

VALID = [(t, g) for g in GENERATIONS for t in valid_topologies(g)[:6]]


@given(st.sampled_from(VALID), st.integers(1, 64), st.booleans())
def test_request_from_strings_equals_request_from_topology(pair, num_slices, swap):
    topology, gen = pair
    args = (gen, topology) if swap else (topology, gen)
    r = SliceRequest.parse(*args, num_slices=num_slices)
    assert r == SliceRequest(Topology.parse(topology, gen), num_slices)
    assert r.num_hosts == r.topology.num_hosts * num_slices
    assert SliceRequest.parse(r) is r  # built once, passed down whole
    assert SliceRequest.parse(r.topology, num_slices=num_slices) == r


def test_request_is_frozen_and_its_resources_read_only():
    r = SliceRequest.parse("2x2x2", "v4", resources_per_host={"CPU": 1})
    with pytest.raises(AttributeError):
        r.num_slices = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        r.resources_per_host["CPU"] = 5  # type: ignore[index]
    assert r.bundle_resources == {"TPU": 4.0, "CPU": 1.0}
    assert str(r) == "1 x v4 2x2x2 (8 chips, 2 hosts x 4)"


BAD_REQUESTS = [
    (dict(num_slices=0), "num_slices=0"),
    (dict(num_slices=-1), "num_slices=-1"),
    (dict(num_slices="2"), "num_slices='2'"),
    (dict(num_slices=1.5), "num_slices=1.5"),
    (dict(num_slices=True), "num_slices=True"),
    (dict(num_slices=10**9), "num_slices=1000000000"),
    (dict(resources_per_host={"TPU": 4}), "TPU"),
    (dict(resources_per_host={"CPU": -1}), "resources_per_host['CPU']=-1"),
    (dict(resources_per_host={"CPU": float("nan")}), "resources_per_host['CPU']=nan"),
    (dict(resources_per_host={"CPU": "1"}), "resources_per_host['CPU']='1'"),
    (dict(resources_per_host=["CPU"]), "resources_per_host=['CPU']"),
    (dict(resources_per_host={1: 1}), "resources_per_host={1: 1}"),
    (dict(chips_per_host=3), "chips_per_host=3"),
    (dict(chips_per_host="4"), "chips_per_host='4'"),
]


@pytest.mark.parametrize(("kwargs", "named"), BAD_REQUESTS)
def test_bad_request_names_the_value(kwargs, named):
    with pytest.raises(InvalidArgument) as e:
        SliceRequest.parse("2x2x2", "v4", **kwargs)
    assert named in str(e.value)
    assert isinstance(e.value, TypeError) and isinstance(e.value, ValueError)  # either except clause works


@pytest.mark.parametrize(
    ("topology", "accel", "named"),
    [
        ("2x2x2", None, "accelerator_type=None"),
        ("2x2x2", "v9", "'v9'"),
        ("4x4", "2x2", "'2x2'"),
        ("v4", "v6e", "'v"),
        (None, "v4", "None"),
        (42, "v4", "42"),
        ("9" * 5000 + "x4", "v6e", "not a v6e topology"),
    ],
)
def test_bad_topology_strings_are_clear(topology, accel, named):
    with pytest.raises(ValueError) as e:
        SliceRequest.parse(topology, accel)
    assert named in str(e.value)


@given(st.text(max_size=30), st.text(max_size=12))
@settings(max_examples=300)
def test_any_string_pair_parses_or_raises_a_value_error_naming_it(topology, accel):
    try:
        r = SliceRequest.parse(topology, accel)
    except ValueError as e:
        assert repr(topology)[:20] in str(e) or repr(accel)[:12] in str(e) or "accelerator_type" in str(e)
    else:
        assert r.topology.num_chips >= 1


# -- Ray's vocabulary -------------------------------------------------------------------------------------------


def test_ray_names_map_onto_the_request():
    r = request_from_args(
        "2x4",
        accelerator_version="v6e",
        num_slices=2,
        chips_per_vm=4,
        resources_per_bundle={"TPU": 4, "CPU": 1},
        tpu_resource_per_chip=1,
    )
    assert (r.topology.chips_per_host, r.hosts_per_slice, r.num_slices) == (4, 2, 2)
    assert dict(r.resources_per_host) == {"CPU": 1.0}


@pytest.mark.parametrize(
    ("args", "named"),
    [
        ({"accelerator_version": "v5e"}, "accelerator_version='v5e'"),
        ({"chips_per_host": 4, "chips_per_vm": 8}, "chips_per_vm=8"),
        ({"resources_per_bundle": {"TPU": 1}}, "'TPU': 4"),
        ({"resources_per_host": {"CPU": 1}, "resources_per_bundle": {"CPU": 1}}, "resources_per_bundle"),
        ({"tpu_resource_per_chip": 2}, "tpu_resource_per_chip=2"),
    ],
)
def test_conflicting_or_unsupported_ray_arguments_are_errors(args, named):
    with pytest.raises(InvalidArgument, match=named.replace("(", r"\(")):
        request_from_args("4x4", "v6e", **args)


def test_bundle_label_selectors_per_host_or_per_bundle():
    r = SliceRequest.parse("2x2x2", "v4", num_slices=2)
    assert bundle_label_selectors(None, r) == [{}] * 4
    assert bundle_label_selectors([{"a": "0"}, {"a": "1"}], r) == [{"a": "0"}, {"a": "1"}] * 2
    assert len(bundle_label_selectors([{"b": str(i)} for i in range(4)], r)) == 4
    with pytest.raises(InvalidArgument, match="bundle_label_selector"):
        bundle_label_selectors([{"a": "0"}] * 3, r)
    with pytest.raises(InvalidArgument, match="strings"):
        bundle_label_selectors({"a": 1}, r)


# -- the shared checks -----------------------------------------------------------------------------------------

NOT_INTS = st.one_of(st.floats(), st.text(max_size=5), st.booleans(), st.none(), st.lists(st.integers(), max_size=2))


@given(NOT_INTS)
def test_check_int_refuses_every_non_integer_naming_it(value):
    with pytest.raises(InvalidArgument) as e:
        v.check_int("batch_size", value, minimum=1)
    assert str(e.value).startswith("batch_size=") and "expected an integer >= 1" in str(e.value)


@given(st.integers(-(10**6), 10**6))
def test_check_int_range(value):
    if 1 <= value <= 100:
        assert v.check_int("n", value, minimum=1, maximum=100) == value
    else:
        with pytest.raises(InvalidArgument, match=f"n={value} is not valid"):
            v.check_int("n", value, minimum=1, maximum=100)


@given(st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-5, 5)))
def test_check_float_positive_and_finite(value):
    ok = not (isinstance(value, float) and (math.isnan(value) or math.isinf(value))) and value > 0
    if ok:
        assert v.check_float("timeout_s", value, minimum=0, exclusive_min=True) == float(value)
    else:
        with pytest.raises(InvalidArgument, match="timeout_s="):
            v.check_float("timeout_s", value, minimum=0, exclusive_min=True)


def test_check_float_refuses_strings_and_bools():
    for bad in ("5", True, None, [1.0]):
        with pytest.raises(InvalidArgument, match="expected a number"):
            v.check_float("timeout_s", bad)


def test_str_list_refuses_a_lone_string():
    with pytest.raises(InvalidArgument, match=r"columns='id'.*\['id'\]"):
        v.check_str_list("columns", "id")
    assert v.check_str_list("columns", ["id", "x"]) == ("id", "x")
    for bad in ([1], ["a", "a"], [""], {"a": 1}, b"ab", 3):
        with pytest.raises(InvalidArgument, match="columns="):
            v.check_str_list("columns", bad)


def test_long_values_are_shortened_in_messages():
    with pytest.raises(InvalidArgument) as e:
        v.check_int("n", "x" * 1000)
    assert len(str(e.value)) < 200
