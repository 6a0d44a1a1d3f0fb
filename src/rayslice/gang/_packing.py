"""A call serialized once for every host of a gang (``SliceGang.run_async_packed``).

Example:
    >>> import pickle
    >>> fn, args, kwargs = pickle.loads(_pack(max, (3, 5), {}))
    >>> fn(*args, **kwargs)
    5
"""

from __future__ import annotations

import io
import pickle
import types
import weakref
from collections.abc import Callable
from typing import Any


def _pack(fn: Callable[..., Any], args: tuple, kwargs: dict) -> bytes | None:
    """``(fn, args, kwargs)`` as bytes every host can load, or None when the call holds a Ray handle.

    Object refs and actor handles are counted references that only Ray's own
    serializer may carry (pickled outside it, Ray would lose track of them).
    A serving step's call (a module's function on numbers, strings and numpy
    arrays) takes the standard pickler, about 7x faster than cloudpickle on
    a one-row batch; anything else goes through cloudpickle, refusing handles.

    Example:
        >>> call = _pack(divmod, (7, 2), {})
        >>> fn, args, kwargs = pickle.loads(call)
        >>> fn(*args, **kwargs)
        (3, 1)
    """
    if _plain_data((args, kwargs)) and _by_reference(fn):
        return pickle.dumps((fn, args, kwargs), protocol=5)  # no handle can hide in plain data
    global _PICKLER
    if _PICKLER is None:
        import ray
        from ray import cloudpickle
        from ray.actor import ActorHandle

        class NoHandles(cloudpickle.Pickler):
            def reducer_override(self, obj: Any) -> Any:
                if isinstance(obj, ray.ObjectRef | ActorHandle):
                    raise _HoldsHandle
                return super().reducer_override(obj)

        _PICKLER = NoHandles
    buf = io.BytesIO()
    try:
        _PICKLER(buf, protocol=5).dump((fn, args, kwargs))
    except _HoldsHandle:
        return None
    return buf.getvalue()


#: Leaf types of :func:`_plain_data` (numpy arrays and scalars are checked apart).
_PLAIN_LEAVES = frozenset({type(None), bool, int, float, complex, str, bytes})


def _plain_data(obj: Any, limit: int = 256) -> bool:
    """Whether ``obj`` is only numbers, strings, numpy data and dicts, lists, tuples of them (at most ``limit`` items).

    Nothing else can hide an object ref or an actor handle, so such data is
    safe for the standard pickler.

    Example:
        >>> import numpy as np
        >>> _plain_data(({"x": np.ones((1, 8), np.float32)}, 1)), _plain_data((object(),))
        (True, False)
        >>> _plain_data(np.array([None], dtype=object))  # an object array can hold anything
        False
    """
    import numpy as np

    stack = [obj]
    while stack:
        limit -= 1
        if limit < 0:
            return False
        x = stack.pop()
        t = type(x)
        if t in _PLAIN_LEAVES:
            continue
        if t is np.ndarray or isinstance(x, np.generic):
            if x.dtype.hasobject:
                return False
        elif t is tuple or t is list:
            stack.extend(x)
        elif t is dict:
            stack.extend(x)
            stack.extend(x.values())
        else:
            return False
    return True


def _by_reference(fn: Any) -> bool:
    """Whether cloudpickle pickles ``fn`` by reference, as the standard pickler does (decided once per function).

    True for a module's function or a builtin that every host imports; False
    for lambdas, closures, ``__main__``'s functions and those of a module
    registered with ``cloudpickle.register_pickle_by_value`` (sent by value).

    Example:
        >>> _by_reference(divmod), _by_reference(lambda: 1), _by_reference({}.get)
        (True, False, False)
    """
    if not isinstance(fn, types.FunctionType | types.BuiltinFunctionType):
        return False  # a bound method or a callable object: pickled with its state
    if not isinstance(getattr(fn, "__self__", None), types.ModuleType | None):
        return False  # a builtin bound to an object ({...}.get): pickled with that object
    try:
        return _BY_REFERENCE[fn]
    except (KeyError, TypeError):
        pass
    from ray import cloudpickle

    try:
        same = pickle.dumps(fn, protocol=5) == cloudpickle.dumps(fn, protocol=5)
    except Exception:  # not importable by name (a lambda, a local function)
        same = False
    try:
        _BY_REFERENCE[fn] = same
    except TypeError:  # a builtin cannot be weakly referenced: decided again next time (a few us)
        pass
    return same


_BY_REFERENCE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_PICKLER: Any = None


class _HoldsHandle(Exception):
    """A call to pack holds an object ref or actor handle."""
