"""A gang's packed calls (pure, no cluster): what may be serialized once for every host, and what may not."""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import ray
from hypothesis import given, settings
from hypothesis import strategies as st

from rayslice.gang._packing import _pack


@dataclasses.dataclass
class _Holder:
    value: object


def _loaded(call: bytes | None):
    assert call is not None
    fn, args, kwargs = pickle.loads(call)
    return fn(*args, **kwargs)


def test_a_call_of_plain_values_is_packed_once_and_loads_as_it_was():
    batch = {"x": np.arange(6, dtype=np.float32).reshape(2, 3)}
    out = _loaded(_pack(np.sum, (batch["x"],), {"axis": 1}))
    assert out.tolist() == [3.0, 12.0]
    twice = _pack(np.sum, (batch["x"],), {"axis": 1})
    assert twice == _pack(np.sum, (batch["x"],), {"axis": 1})  # one serialization, the same bytes for every host


def test_object_refs_anywhere_in_a_call_are_left_to_rays_own_serializer():
    ref = ray.ObjectRef.nil()
    for args in (
        (ref,),
        ({"batch": [ref]},),
        ((1, (2, ref)),),
        (_Holder(ref),),
        ({"nested": {"set": frozenset({1}), "deep": [[{"r": ref}]]}},),
    ):
        assert _pack(print, args, {}) is None, args
    assert _pack(print, (), {"k": ref}) is None

    def closure() -> object:  # a function that captured a ref
        return ref

    assert _pack(closure, (), {}) is None


def test_a_serving_step_takes_the_standard_pickler_and_loads_the_same():
    from rayslice.serve import host

    batch = {"x": np.ones((2, 8), np.float32), "ids": np.arange(2)}
    call = _pack(host.infer, (batch, 2), {"tag": ("a", 1.5, None, b"b", True)})
    assert call == pickle.dumps((host.infer, (batch, 2), {"tag": ("a", 1.5, None, b"b", True)}), protocol=5)
    fn, args, kwargs = pickle.loads(call)
    assert fn is host.infer and kwargs == {"tag": ("a", 1.5, None, b"b", True)}
    assert args[1] == 2 and all(np.array_equal(args[0][k], batch[k]) for k in batch)


def test_functions_sent_by_value_keep_going_through_cloudpickle():
    from ray import cloudpickle

    from rayslice.gang import _packing

    def local(x):
        return x + 1

    assert not _packing._by_reference(local) and not _packing._by_reference(lambda: 1)
    assert _loaded(_pack(local, (1,), {})) == 2
    # A module registered by value is pickled by value for hosts that cannot import it:
    # the standard pickler would name it, so the call must not take the fast path.
    cloudpickle.register_pickle_by_value(dataclasses)
    try:
        assert not _packing._by_reference(dataclasses.fields)
        assert _pack(dataclasses.fields, (1,), {}) != pickle.dumps((dataclasses.fields, (1,), {}), protocol=5)
    finally:
        cloudpickle.unregister_pickle_by_value(dataclasses)
        _packing._BY_REFERENCE.clear()


def test_an_object_array_or_unknown_object_is_never_taken_for_plain_data():
    ref = ray.ObjectRef.nil()
    holder = np.empty(1, dtype=object)
    holder[0] = ref
    assert _pack(print, (holder,), {}) is None  # found by cloudpickle's walk, not by the fast path
    assert _pack(print, ({"k": [1, 2, {"deep": holder}]},), {}) is None
    held = {"r": ref}
    assert _pack(held.get, ("r",), {}) is None  # a builtin bound to an object carries that object
    many = tuple(range(1000))  # beyond the fast path's item limit: still packed, by cloudpickle
    assert _loaded(_pack(len, (many,), {})) == 1000


@given(
    st.recursive(
        st.none()
        | st.booleans()
        | st.integers()
        | st.floats(allow_nan=False)
        | st.text(max_size=5)
        | st.binary(max_size=5),
        lambda kids: (
            st.lists(kids, max_size=4) | st.tuples(kids, kids) | st.dictionaries(st.text(max_size=3), kids, max_size=3)
        ),
        max_leaves=20,
    )
)
@settings(max_examples=60, deadline=None)
def test_plain_data_packs_to_what_cloudpickle_would_load(value):
    from ray import cloudpickle

    call = _pack(repr, (value,), {})
    assert _loaded(call) == repr(value)
    assert pickle.loads(call)[1] == cloudpickle.loads(cloudpickle.dumps((value,)))
