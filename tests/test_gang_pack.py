"""A gang's packed calls (pure, no cluster): what may be serialized once for every host, and what may not."""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import ray

from rayslice.gang import _pack


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
