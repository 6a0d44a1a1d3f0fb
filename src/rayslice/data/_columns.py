"""Host-side column work for the feeder (private): collate, cast, check, pad, compare layouts.

Everything here runs on numpy batches on the prefetch thread, before any
transfer, so a bad column fails with its name and the fix instead of JAX's
dtype message, and nothing lossy happens silently (NaN cast to int32, an
int64 id past int32's range, a pad value that does not fit its column).

Example:
    >>> import numpy as np
    >>> cast({"x": np.array([1.5, np.nan])}, np.dtype("int32"), ())
    Traceback (most recent call last):
    ...
    ValueError: column 'x': 1 value(s) of float64 are NaN or infinite and have no int32 value (e.g. nan)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from rayslice.data._rebatch import Batch, Dropped, to_numpy_batch
from rayslice.data.options import on_device

ARRAY_KEY = "__rayslice_array__"  # a collate_fn that returns one array: unwrapped again at yield
Schema = dict[str, list]  # column -> [dtype name, trailing shape]


def rows_of(batch: Batch | Dropped) -> int:
    return batch.rows if isinstance(batch, Dropped) else len(next(iter(batch.values())))


def nbytes_of(batch: Batch | Dropped) -> int:
    """Bytes held by a host batch's columns (none for a dropped one)."""
    return 0 if isinstance(batch, Dropped) else sum(v.nbytes for v in batch.values())


def _collate_format(fn: Callable[..., Any]) -> str:
    # Ray's collate classes by name, so that Ray Data is imported only by those who use it.
    names = {c.__name__ for c in type(fn).__mro__}
    return "pyarrow" if "ArrowBatchCollateFn" in names else "pandas" if "PandasBatchCollateFn" in names else "numpy"


def collate(fn: Callable[..., Any], batch: Batch) -> Batch:
    """``fn`` over one host batch in the format it declares; the result as a numpy batch of the same rows."""
    fmt = _collate_format(fn)
    if fmt == "pyarrow":
        import pyarrow as pa

        arg: Any = pa.table({k: (pa.array(list(v)) if v.ndim > 1 else pa.array(v)) for k, v in batch.items()})
    elif fmt == "pandas":
        import pandas as pd

        arg = pd.DataFrame({k: (list(v) if v.ndim > 1 else v) for k, v in batch.items()})
    else:
        arg = dict(batch)
    out = fn(arg)
    if isinstance(out, np.ndarray):
        out = {ARRAY_KEY: out}
    elif not isinstance(out, Mapping):
        raise TypeError(f"collate_fn returned {type(out).__name__}; expected a np.ndarray or dict[str, np.ndarray]")
    result = to_numpy_batch(out, None)
    if rows_of(result) != rows_of(batch):
        raise ValueError(
            f"collate_fn returned {rows_of(result)} row(s) for a batch of {rows_of(batch)}; "
            "it must keep the rows (the feeder counts them to resume)"
        )
    return result


def _checked_astype(name: str, v: np.ndarray, dtype: np.dtype) -> np.ndarray:
    if v.dtype == dtype:
        return v
    if not on_device(v.dtype):
        raise TypeError(
            f"column {name!r} holds {v.dtype} values, which cannot be cast to {dtype}; "
            f"leave it out of dtypes (or keep it on the host with host_columns=[{name!r}])"
        )
    if dtype.kind in "iu" and v.dtype.kind == "f" and v.size:
        bad = ~np.isfinite(v)
        if bad.any():
            raise ValueError(
                f"column {name!r}: {int(bad.sum())} value(s) of {v.dtype} are NaN or infinite and "
                f"have no {dtype} value (e.g. {v[bad].flat[0]})"
            )
    if dtype.kind in "iu" and v.dtype.kind in "iuf" and v.size:
        info = np.iinfo(dtype)
        lo, hi = v.min(), v.max()
        if lo < info.min or hi > info.max:
            raise ValueError(
                f"column {name!r}: values from {lo} to {hi} do not fit {dtype} "
                f"[{info.min}, {info.max}]; cast to a wider dtype or keep it in host_columns"
            )
    with np.errstate(over="ignore", invalid="ignore"):  # checked just below
        out = v.astype(dtype, copy=False)
    if dtype.kind == "f" and v.dtype.kind == "f" and v.size and np.isinf(out).any() and np.isfinite(v).all():
        raise ValueError(
            f"column {name!r}: values of {v.dtype} overflow {dtype} (largest magnitude "
            f"{np.abs(v).max()}); cast to a wider dtype"
        )
    return out


def cast_target(dtypes: Any, column: str, host_columns: Sequence[str]) -> np.dtype | None:
    """The dtype :func:`cast` gives ``column``, or None to leave it as it is."""
    if isinstance(dtypes, Mapping):
        return dtypes.get(column)
    return None if dtypes is None or column in host_columns else dtypes


def cast(batch: Batch, dtypes: Any, host_columns: Sequence[str]) -> Batch:
    """Casts device columns: one dtype for all of them (as Ray does), or ``{column: dtype}``."""
    if dtypes is None:
        return batch
    if isinstance(dtypes, Mapping):
        unknown = set(dtypes) - set(batch)
        if unknown:
            from rayslice._validate import fail

            raise fail(
                "dtypes", dict(dtypes), f"dtypes for columns of the data {sorted(batch)}; unknown: {sorted(unknown)}"
            )
    out = {}
    for k, v in batch.items():
        want = cast_target(dtypes, k, host_columns)
        out[k] = v if want is None else _checked_astype(k, v, want)
    return out


def schema_of(batch: Batch) -> Schema:
    return {k: [v.dtype.name if on_device(v.dtype) else v.dtype.str, list(v.shape[1:])] for k, v in batch.items()}


def check_device_columns(batch: Batch, host_columns: Sequence[str]) -> None:
    """Refuses columns devices cannot hold, naming them and the fix."""
    for k, v in batch.items():
        if k not in host_columns and not on_device(v.dtype):
            what = "strings" if v.dtype.kind in "SU" else f"{v.dtype} values"
            shown = ARRAY_KEY if k == ARRAY_KEY else repr(k)
            raise TypeError(
                f"column {shown} holds {what}, which cannot go to devices; pass host_columns=[{k!r}] "
                f"to keep it next to each batch as numpy, or columns=[...] to leave it out"
            )


def check_same_layout(template: Batch, batch: Batch) -> None:
    """Every host batch must have the first batch's columns, dtypes and trailing shapes."""
    if set(batch) != set(template):
        raise ValueError(
            f"a batch has columns {sorted(batch)} but the first had {sorted(template)}; "
            "every batch must have the same columns (select them with columns=[...])"
        )
    for k, v in batch.items():
        t = template[k]
        if v.dtype != t.dtype or v.shape[1:] != t.shape[1:]:
            raise ValueError(
                f"column {k!r} changed from {t.dtype}{list(t.shape[1:])} to "
                f"{v.dtype}{list(v.shape[1:])} between batches; cast it with dtypes={{{k!r}: ...}}"
            )


def pad_fill(pad_value: Any, column: str, dtype: np.dtype, host: bool) -> Any:
    """The fill for one column, checked to fit its dtype exactly (host columns: as given)."""
    if isinstance(pad_value, Mapping):
        if column not in pad_value:
            if host:
                return 0
            raise ValueError(f"paddings/pad_value has no value for column {column!r}; it names {sorted(pad_value)}")
        pad_value = pad_value[column]
    if host:
        return pad_value
    try:
        filled = np.array(pad_value).astype(dtype)
        fits = bool(filled == pad_value) or (bool(np.isnan(filled)) and pad_value != pad_value)
    except (TypeError, ValueError, OverflowError):
        fits = False
    if not fits:
        raise ValueError(
            f"pad value {pad_value!r} does not fit column {column!r} of dtype {dtype}; "
            f"pass pad_value={{{column!r}: ...}} (Ray: paddings) with a value of that dtype"
        )
    return pad_value


def pad(batch: Batch | None, batch_size: int, fills: Mapping[str, Any], template: Batch) -> tuple[Batch, np.ndarray]:
    """``batch`` (or no rows) padded to ``batch_size``, and the mask of real rows."""
    n = 0 if batch is None else rows_of(batch)
    out = {}
    for k, t in template.items():
        full = np.full((batch_size, *t.shape[1:]), fills[k], dtype=t.dtype)
        if n:
            full[:n] = batch[k]  # type: ignore[index]
        out[k] = full
    mask = np.zeros(batch_size, dtype=bool)
    mask[:n] = True
    return out, mask


def template_from(schema: Schema) -> Batch:
    """Zero-row arrays with another host's layout (for a host whose shard is empty)."""
    import jax.numpy as jnp  # knows bfloat16 and friends by name

    return {k: np.zeros((0, *shape), dtype=jnp.dtype(dtype)) for k, (dtype, shape) in schema.items()}


def compare_hosts(metas: Sequence[Mapping[str, Any]]) -> None:
    """Raises a ValueError naming the first setting or column on which hosts differ."""
    for p, m in enumerate(metas):
        if "error" in m:
            raise RuntimeError(f"host {p} failed before the first step: {m['error']}")
    for key in ("batch_size", "ragged", "mask_key", "agree_window", "host_columns"):
        values = [m.get(key) for m in metas]
        if len({repr(v) for v in values}) > 1:
            per = ", ".join(f"host {p}: {v!r}" for p, v in enumerate(values))
            raise ValueError(f"hosts disagree on {key} ({per}); every host must pass the same {key}")
    known = [(p, m["schema"]) for p, m in enumerate(metas) if m.get("schema") is not None]
    if not known:
        return
    p0, s0 = known[0]
    for p, s in known[1:]:
        if set(s) != set(s0):
            raise ValueError(
                f"hosts have different columns: host {p0}: {sorted(s0)}, host {p}: {sorted(s)} "
                f"(missing on host {p}: {sorted(set(s0) - set(s))}, extra: {sorted(set(s) - set(s0))}); "
                "select the same columns on every host with columns=[...]"
            )
        for col in sorted(s0):
            if s[col] != s0[col]:
                raise ValueError(
                    f"column {col!r} is {s0[col][0]}{s0[col][1]} on host {p0} but {s[col][0]}{s[col][1]} "
                    f"on host {p}; cast it the same way on every host with dtypes={{{col!r}: ...}}"
                )
