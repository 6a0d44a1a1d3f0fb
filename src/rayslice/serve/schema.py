"""Request validation for slice deployments (pure; nothing from clients is unpickled).

Requests carry JSON: ``{"inputs": {"x": [[...], ...]}}``, one or more rows per
column. Each column is checked against the deployment's ``input_spec``
(per-row shape and dtype) before anything reaches the slice, so a bad request
is a 4xx for that client and never an error on the hosts.

What is refused, and why (each a :class:`RequestError` naming the problem):

- bodies that are not strict JSON (RFC 8259 has no ``NaN``/``Infinity``),
  nested too deeply, with numbers that overflow a double (``1e999``), or with
  keys other than ``"inputs"``: 400 / 422;
- booleans where numbers are expected (``true`` is not ``1.0``), floats for an
  integer column, integers outside the column's range, finite values that
  overflow the column's float type (``1e39`` for ``float32``): 422.

Example:
    >>> spec = InputSpec.parse({"x": ((3,), "float32")})
    >>> spec.validate({"x": [[1, 2, 3]]})["x"].shape
    (1, 3)
    >>> spec.validate(parse_body(b'{"inputs": {"x": [[1, 2, true]]}}', 1024))
    Traceback (most recent call last):
    ...
    rayslice.serve.schema.RequestError: column 'x' must be float32; got booleans (true/false are not numbers)
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import numpy as np

from rayslice._validate import check_int, fail

__all__ = ["ColumnSpec", "InputSpec", "RequestError", "column_array", "parse_body", "rows_of", "validate_untyped"]

_KINDS = {"f": "floating", "i": "integer", "u": "integer", "b": "boolean"}
_MAX_DIMS = 32  # per-row dimensions a column may declare
_JSON_TYPES = {bool: "b", int: "i", float: "f"}


class RequestError(ValueError):
    """A client error: ``status`` is the HTTP status to answer with (4xx).

    Example:
        >>> RequestError("too big", status=413).status
        413
    """

    def __init__(self, message: str, status: int = 422) -> None:
        super().__init__(message)
        if not 400 <= status < 500:
            raise ValueError(f"status={status!r} is not valid: expected a 4xx HTTP status")
        self.status = status


def _dtype_of(where: str, dtype: object) -> str:
    if isinstance(dtype, bool) or not isinstance(dtype, str | type | np.dtype):
        raise fail(where, dtype, "a numeric dtype name such as 'float32', 'int32' or 'bool'", got_type=True)
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise fail(where, dtype, "a numpy dtype name such as 'float32', 'int32' or 'bool'") from None
    if dt.kind not in _KINDS:
        raise fail(
            where, dtype, f"a numeric dtype (dtype {str(dtype)!r} is not numeric; valid kinds: float, int, uint, bool)"
        )
    return dt.name


@dataclasses.dataclass(frozen=True)
class ColumnSpec:
    """One input column: the shape of one row and the dtype. Validated on construction.

    Example:
        >>> ColumnSpec((8,), "float32")
        ColumnSpec(shape=(8,), dtype='float32')
        >>> ColumnSpec((0,), "float32")
        Traceback (most recent call last):
        ...
        rayslice.errors.InvalidArgument: shape=(0,) is not valid: expected a list of integers >= 1 (per-row shape)
    """

    shape: tuple[int, ...]  # per row
    dtype: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", _shape_of("shape", self.shape))
        object.__setattr__(self, "dtype", _dtype_of("dtype", self.dtype))


def _shape_of(where: str, shape: object) -> tuple[int, ...]:
    valid = "a list of integers >= 1 (per-row shape)"
    if isinstance(shape, bool):
        raise fail(where, shape, valid, got_type=True)
    if isinstance(shape, int | np.integer):
        shape = (shape,)
    if isinstance(shape, str | bytes) or not isinstance(shape, Sequence):
        raise fail(where, shape, valid, got_type=True)
    if len(shape) > _MAX_DIMS:
        raise fail(where, shape, f"at most {_MAX_DIMS} dimensions")
    out = []
    for d in shape:
        if isinstance(d, bool) or not isinstance(d, int | np.integer) or not 1 <= d <= 2**31:
            raise fail(where, tuple(shape), valid)
        out.append(int(d))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class InputSpec:
    """Per-column row shapes and dtypes of a deployment's inputs.

    Example:
        >>> InputSpec.parse({"x": {"shape": [8], "dtype": "float32"}}).columns["x"].shape
        (8,)
        >>> InputSpec.parse({"x": "8xfloat32"})
        Traceback (most recent call last):
        ...
        rayslice.errors.InvalidArgument: input_spec['x']='8xfloat32' is not valid: expected (shape, dtype) \
or {'shape': [...], 'dtype': ...}, got str
    """

    columns: Mapping[str, ColumnSpec]
    max_rows: int = 1024

    def __post_init__(self) -> None:
        if not isinstance(self.columns, Mapping) or not self.columns:
            raise fail("columns", self.columns, "a non-empty mapping of column name to ColumnSpec")
        for name, col in self.columns.items():
            if not isinstance(name, str) or not name:
                raise fail("columns", name, "column names as non-empty strings")
            if not isinstance(col, ColumnSpec):
                raise fail(f"columns[{name!r}]", col, "a ColumnSpec", got_type=True)
        object.__setattr__(self, "columns", MappingProxyType(dict(self.columns)))
        check_int("max_rows", self.max_rows, minimum=1)

    @classmethod
    def parse(cls, spec: Mapping[str, Any] | InputSpec, max_rows: int = 1024) -> InputSpec:
        """From ``{"x": ((8,), "float32")}`` or ``{"x": {"shape": [8], "dtype": "float32"}}``.

        Raises:
            InvalidArgument: naming the column and the bad value.
        """
        check_int("max_rows", max_rows, minimum=1)
        if isinstance(spec, InputSpec):
            return dataclasses.replace(spec, max_rows=max_rows)
        if not isinstance(spec, Mapping):
            raise fail(
                "input_spec",
                spec,
                "a mapping of column name to (shape, dtype), e.g. {'x': ((8,), 'float32')}",
                got_type=True,
            )
        if not spec:
            raise fail("input_spec", spec, "at least one column, e.g. {'x': ((8,), 'float32')}")
        cols = {}
        for name, s in spec.items():
            if not isinstance(name, str) or not name.strip():
                raise fail("input_spec", dict(spec), f"column names as non-empty strings (got {name!r})")
            where = f"input_spec[{name!r}]"
            if isinstance(s, Mapping):
                if set(s) != {"shape", "dtype"}:
                    raise fail(where, dict(s), "exactly the keys 'shape' and 'dtype'")
                shape, dtype = s["shape"], s["dtype"]
            elif isinstance(s, Sequence) and not isinstance(s, str | bytes) and len(s) == 2:
                shape, dtype = s
            else:
                raise fail(where, s, "(shape, dtype) or {'shape': [...], 'dtype': ...}", got_type=True)
            cols[name] = ColumnSpec(_shape_of(f"{where}.shape", shape), _dtype_of(f"{where}.dtype", dtype))
        return cls(cols, max_rows)

    def validate(self, inputs: Any) -> dict[str, np.ndarray]:
        """Checks one request's inputs; returns numpy arrays or raises :class:`RequestError`."""
        if not isinstance(inputs, Mapping):
            raise RequestError(
                f"'inputs' must be an object of columns {sorted(self.columns)}, got {type(inputs).__name__}"
            )
        missing = sorted(set(self.columns) - set(inputs))
        extra = sorted(str(k) for k in set(inputs) - set(self.columns))
        if missing or extra:
            raise RequestError(
                f"inputs must have exactly the columns {sorted(self.columns)}; missing {missing}, unexpected {extra}"
            )
        out, rows = {}, None
        for name, col in self.columns.items():
            arr = column_array(name, inputs[name], f"numeric ({col.dtype})", want=np.dtype(col.dtype))
            if arr.shape[1:] != col.shape or arr.ndim != len(col.shape) + 1:
                raise RequestError(
                    f"column {name!r} must have shape (rows, {', '.join(map(str, col.shape))}); got {arr.shape}"
                )
            n = arr.shape[0]
            if rows is not None and n != rows:
                raise RequestError(f"columns have different row counts: {name!r} has {n}, others {rows}")
            rows = n
            out[name] = arr
        if not rows:
            raise RequestError("a request needs at least one row")
        if rows > self.max_rows:
            raise RequestError(f"{rows} rows in one request; the limit is {self.max_rows}", status=413)
        return out


def _json_kinds(name: str, value: Any) -> set[str]:
    """The kinds of the leaves of a nested JSON list ('b', 'i', 'f'), or RequestError."""
    try:
        leaves = np.asarray(value, dtype=object)
    except ValueError as e:  # more than 64 dimensions, or ragged beyond repair
        raise RequestError(f"column {name!r} is not a rectangular numeric array: {_first_line(e)}") from None
    if leaves.ndim > _MAX_DIMS:
        raise RequestError(f"column {name!r} is nested too deeply (more than {_MAX_DIMS} levels)")
    kinds = set()
    for t in set(map(type, leaves.ravel().tolist())):
        kind = _JSON_TYPES.get(t)
        if kind is None:
            if t in (list, tuple):
                raise RequestError(f"column {name!r} is not a rectangular array (rows of different lengths)")
            what = "null" if t is type(None) else t.__name__
            raise RequestError(f"column {name!r} must be numeric; got {what} values")
        kinds.add(kind)
    return kinds


def _first_line(e: BaseException) -> str:
    return (str(e).splitlines() or [""])[0]


def column_array(name: str, value: Any, expected: str = "numeric", want: np.dtype | None = None) -> np.ndarray:
    """One request column as a numpy array of dtype ``want`` (or its own), or :class:`RequestError` (422).

    Booleans are not numbers, floats are not integers, and values outside
    ``want``'s range are refused instead of wrapping or becoming ``inf``.

    Example:
        >>> column_array("x", [[1, 2]], want=np.dtype("int8")).dtype
        dtype('int8')
        >>> column_array("x", [300], want=np.dtype("int8"))
        Traceback (most recent call last):
        ...
        rayslice.serve.schema.RequestError: column 'x' has values outside the int8 range [-128, 127]
    """
    if isinstance(value, np.ndarray):
        arr = value
        kinds = {arr.dtype.kind}
    else:
        kinds = _json_kinds(name, value) if isinstance(value, list) else set()
        try:
            arr = np.asarray(value)
        except (ValueError, OverflowError) as e:  # ragged nested lists
            raise RequestError(f"column {name!r} is not a rectangular array: {_first_line(e)}") from None
        if kinds == {"i"} and want is not None and want.kind in "iu":
            try:  # exact: JSON integers are never routed through float64
                return np.array(value, dtype=want)
            except OverflowError:
                info = np.iinfo(want)
                raise RequestError(
                    f"column {name!r} has values outside the {want.name} range [{info.min}, {info.max}]"
                ) from None
        if kinds and kinds <= {"i", "b"} and arr.dtype.kind not in "iub":  # object, or float64 from mixed sizes
            raise RequestError(f"column {name!r} has integers too large for 64 bits")
        if not kinds:
            kinds = {arr.dtype.kind}
    if arr.dtype.kind not in _KINDS:
        raise RequestError(f"column {name!r} must be {expected}; got {arr.dtype}")
    if want is None:
        if "b" in kinds and len(kinds) > 1:
            raise RequestError(f"column {name!r} mixes booleans and numbers")
        return arr
    label = want.name
    if want.kind == "b":
        if kinds != {"b"}:
            raise RequestError(f"column {name!r} must be bool (true/false); got numbers")
        return arr.astype(want, copy=False)
    if "b" in kinds:
        raise RequestError(f"column {name!r} must be {label}; got booleans (true/false are not numbers)")
    if want.kind in "iu":
        if "f" in kinds:
            raise RequestError(f"column {name!r} must be {label}; got floating-point values")
        info = np.iinfo(want)
        if arr.size and (arr.min() < info.min or arr.max() > info.max):
            raise RequestError(f"column {name!r} has values outside the {label} range [{info.min}, {info.max}]")
        return arr.astype(want, copy=False)
    with np.errstate(over="ignore", invalid="ignore"):
        out = arr.astype(want, copy=False)
    if arr.size and arr.dtype.kind == "f" and not np.isfinite(out).all():
        overflow = np.isfinite(arr) & ~np.isfinite(out)
        if overflow.any():
            bad = arr[overflow].flat[0]
            raise RequestError(
                f"column {name!r} has values outside the {label} range (e.g. {bad:g}); "
                f"the largest is {np.finfo(want).max:g}"
            )
    return out


def validate_untyped(inputs: Any) -> dict[str, np.ndarray]:
    """Inputs of a deployment without an ``input_spec``: numeric columns with equal row counts.

    Example:
        >>> validate_untyped({"x": [[1.5], [2.0]]})["x"].shape
        (2, 1)
    """
    if not isinstance(inputs, Mapping) or not inputs:
        raise RequestError("inputs must be a non-empty object of columns")
    out = {str(k): column_array(str(k), v) for k, v in inputs.items()}
    if any(a.ndim == 0 for a in out.values()):
        raise RequestError("inputs must be numeric arrays with a leading row dimension")
    counts = {k: len(a) for k, a in out.items()}
    if len(set(counts.values())) != 1:
        raise RequestError(f"columns have different row counts: {counts}")
    if not next(iter(counts.values())):
        raise RequestError("a request needs at least one row")
    return out


def _no_constant(token: str) -> Any:
    raise RequestError(f"malformed JSON: {token} is not a JSON number (JSON has no NaN or Infinity)", status=400)


def _finite_float(token: str) -> float:
    value = float(token)
    if not np.isfinite(value):
        raise RequestError(f"number {token[:40]} overflows a 64-bit float", status=422)
    return value


def parse_body(body: bytes, max_bytes: int) -> Any:
    """The ``inputs`` of a JSON request body, or :class:`RequestError` (400/413/422).

    Example:
        >>> parse_body(b'{"inputs": {"x": [1, 2]}}', 100)
        {'x': [1, 2]}
        >>> parse_body(b'{"inputs": {"x": [NaN]}}', 100)
        Traceback (most recent call last):
        ...
        rayslice.serve.schema.RequestError: malformed JSON: NaN is not a JSON number (JSON has no NaN or Infinity)
    """
    if not isinstance(body, bytes | bytearray):
        raise RequestError(f"the body must be bytes, got {type(body).__name__}", status=400)
    if len(body) > max_bytes:
        raise RequestError(f"request body of {len(body)} bytes exceeds the limit of {max_bytes}", status=413)
    if not body.strip():
        raise RequestError('the body is empty; expected a JSON object with "inputs"', status=400)
    try:
        payload = json.loads(body, parse_constant=_no_constant, parse_float=_finite_float)
    except RecursionError:
        raise RequestError("malformed JSON: nested too deeply", status=400) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"malformed JSON: {e}", status=400) from None
    except RequestError:
        raise
    except ValueError as e:  # e.g. an integer of more than 4,300 digits
        raise RequestError(f"malformed JSON: {_first_line(e)}", status=400) from None
    if not isinstance(payload, dict) or "inputs" not in payload:
        raise RequestError('the body must be a JSON object with "inputs"', status=400)
    extra = sorted(set(payload) - {"inputs"})
    if extra:
        raise RequestError(f'the body must have only "inputs"; unexpected keys {extra}', status=400)
    return payload["inputs"]


def rows_of(inputs: Mapping[str, np.ndarray]) -> int:
    """Rows of a validated request (every column has the same count)."""
    return len(next(iter(inputs.values())))
