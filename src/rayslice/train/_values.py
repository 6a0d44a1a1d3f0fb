"""What a step's ``report`` carries, as values: metrics as plain Python, checkpoint trees Orbax can save.

``report`` is on every step's path, so metric values are converted without
waiting on the devices where they can be: :func:`_is_ready` says whether a
value (or every leaf of a nested one) is computed, :func:`_plain` turns it into
plain Python with its structure kept (arrays become lists, scalars Python
numbers), and :func:`_wait_until_ready` waits for the rest. A checkpoint
pytree goes through :func:`_checkpointable`, which makes host-local arrays
global on a multi-host run and names any leaf Orbax cannot save.

Example:
    >>> import numpy as np
    >>> _plain({"loss": np.float32(0.5), "sizes": (np.arange(3), 4)})
    {'loss': 0.5, 'sizes': ([0, 1, 2], 4)}
    >>> _is_ready({"a": [1, 2.0, None]})
    True
    >>> _json_safe({"when": object})["when"]
    "<class 'object'>"
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from rayslice._validate import fail

#: Metric values that are plain Python already (checked by exact type first: report() is on the step's path).
_PLAIN_TYPES = frozenset({bool, int, float, str, type(None)})


def _plain(v: Any) -> Any:
    """A metric value as plain Python, structure kept: arrays become lists, scalars Python numbers."""
    if type(v) in _PLAIN_TYPES or isinstance(v, bool | int | float | str):  # subclasses too (e.g. IntEnum)
        return v
    if type(v) in _jax_array_types():  # the usual metric: a computed jax scalar
        return _read_jax(v)
    if isinstance(v, Mapping):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return type(v)(_plain(x) for x in v)
    tolist = getattr(v, "tolist", None)  # numpy / jax arrays and scalars (0-d: a Python number)
    if callable(tolist) and hasattr(v, "dtype"):
        try:
            return tolist()
        except Exception:
            return v
    return v  # anything else travels as itself (pickled by Ray)


def _read_jax(v: Any) -> Any:
    """A computed ``jax.Array`` as plain Python (itself if it cannot be read)."""
    try:
        return np.asarray(v).tolist()  # its host buffer as numpy first: a third of Array.tolist()'s cost
    except Exception:
        return v


_JAX_ARRAY_TYPES: frozenset[type] = frozenset()


def _jax_array_types() -> frozenset[type]:
    """The concrete types of ``jax.Array`` values (empty while JAX is not imported: nothing can be one)."""
    global _JAX_ARRAY_TYPES
    if not _JAX_ARRAY_TYPES:
        import sys

        if "jax" in sys.modules:
            from jax._src.array import ArrayImpl

            _JAX_ARRAY_TYPES = frozenset({ArrayImpl})
    return _JAX_ARRAY_TYPES


def _json_safe(v: Any) -> Any:
    return json.loads(json.dumps(v, default=str))


def _wait_until_ready(v: Any) -> None:
    if isinstance(v, Mapping):
        for x in v.values():
            _wait_until_ready(x)
    elif isinstance(v, list | tuple):
        for x in v:
            _wait_until_ready(x)
    elif callable(getattr(v, "block_until_ready", None)):
        v.block_until_ready()


def _is_ready(v: Any) -> bool:
    if type(v) in _PLAIN_TYPES:
        return True
    if isinstance(v, Mapping):
        return all(_is_ready(x) for x in v.values())
    if isinstance(v, list | tuple):
        return all(_is_ready(x) for x in v)
    is_ready = getattr(v, "is_ready", None)
    return is_ready() if callable(is_ready) else True


def _checkpointable(tree: Any) -> Any:
    """The pytree with every leaf Orbax can save on a multi-host run, or an error naming the bad leaf.

    Host-local ``jax.Array`` leaves (committed to this host's devices, e.g. a
    ``jnp`` scalar computed outside ``jit``) cannot be saved by Orbax when more
    than one process runs; they are taken as replicated (every host holds the
    same value, as SPMD code does) and made global over all devices. NumPy
    arrays and Python numbers are saved as they are.
    """
    import jax

    multi = jax.process_count() > 1
    mesh = None

    def fix(path: Any, leaf: Any) -> Any:
        nonlocal mesh
        where = f"report(checkpoint=...) leaf {jax.tree_util.keystr(path) or '<root>'}"
        if isinstance(leaf, jax.Array):
            if multi and leaf.is_fully_addressable:
                if mesh is None:
                    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("hosts",))
                replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
                return jax.make_array_from_process_local_data(replicated, np.asarray(leaf))
            return leaf
        if isinstance(leaf, np.ndarray):
            if leaf.dtype == object or leaf.dtype.kind in "USV":
                raise fail(
                    where,
                    leaf,
                    "an array of numbers (not strings or objects): put them in metrics, "
                    "or save files with Checkpoint.from_directory(dir)",
                )
            return leaf
        if isinstance(leaf, bool | int | float | complex | np.generic):
            return leaf
        raise fail(
            where,
            leaf,
            "a jax.Array, numpy array or Python number: put other values in metrics, "
            "or save files with Checkpoint.from_directory(dir)",
            got_type=True,
        )

    return jax.tree_util.tree_map_with_path(fix, tree)
