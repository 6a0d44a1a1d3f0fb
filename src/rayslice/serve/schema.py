"""Request validation for slice deployments (pure; nothing from clients is unpickled).

Requests carry JSON: ``{"inputs": {"x": [[...], ...]}}``, one or more rows per
column. Each column is checked against the deployment's ``input_spec``
(per-row shape and dtype) before anything reaches the slice, so a bad request
is a 4xx for that client and never an error on the hosts.

Example:
    >>> spec = InputSpec.parse({"x": ((3,), "float32")})
    >>> spec.validate({"x": [[1, 2, 3]]})["x"].shape
    (1, 3)
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

import numpy as np

_KINDS = {"f": "floating", "i": "integer", "u": "integer", "b": "boolean"}


class RequestError(ValueError):
    """A client error: ``status`` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 422) -> None:
        super().__init__(message)
        self.status = status


@dataclasses.dataclass(frozen=True)
class ColumnSpec:
    shape: tuple[int, ...]  # per row
    dtype: str

    def __post_init__(self) -> None:
        try:
            kind = np.dtype(self.dtype).kind
        except TypeError:
            raise ValueError(f"dtype {self.dtype!r} is not a numpy dtype") from None
        if kind not in _KINDS:
            raise ValueError(f"dtype {self.dtype!r} is not numeric; valid kinds: float, int, uint, bool")
        if any(not isinstance(d, int) or d < 1 for d in self.shape):
            raise ValueError(f"shape {self.shape} must be positive integers")


@dataclasses.dataclass(frozen=True)
class InputSpec:
    """Per-column row shapes and dtypes of a deployment's inputs."""

    columns: Mapping[str, ColumnSpec]
    max_rows: int = 1024

    @classmethod
    def parse(cls, spec: Mapping[str, Any], max_rows: int = 1024) -> InputSpec:
        """From ``{"x": ((8,), "float32")}`` or ``{"x": {"shape": [8], "dtype": "float32"}}``."""
        if not spec:
            raise ValueError("input_spec must name at least one column")
        cols = {}
        for name, s in spec.items():
            shape, dtype = (s["shape"], s["dtype"]) if isinstance(s, Mapping) else s
            cols[name] = ColumnSpec(tuple(int(d) for d in shape), str(dtype))
        return cls(cols, max_rows)

    def validate(self, inputs: Any) -> dict[str, np.ndarray]:
        """Checks one request's inputs; returns numpy arrays or raises :class:`RequestError`."""
        if not isinstance(inputs, Mapping):
            raise RequestError(f"'inputs' must be an object of columns {sorted(self.columns)}, "
                               f"got {type(inputs).__name__}")
        missing = sorted(set(self.columns) - set(inputs))
        extra = sorted(set(inputs) - set(self.columns))
        if missing or extra:
            raise RequestError(f"inputs must have exactly the columns {sorted(self.columns)}; "
                               f"missing {missing}, unexpected {extra}")
        out, rows = {}, None
        for name, col in self.columns.items():
            arr = column_array(name, inputs[name], f"numeric ({col.dtype})")
            want = np.dtype(col.dtype)
            if want.kind in "iub" and arr.dtype.kind == "f":
                raise RequestError(f"column {name!r} must be {col.dtype}; got floating-point values")
            if arr.shape[1:] != col.shape or arr.ndim != len(col.shape) + 1:
                raise RequestError(f"column {name!r} must have shape (rows, {', '.join(map(str, col.shape))}); "
                                   f"got {arr.shape}")
            n = arr.shape[0]
            if rows is not None and n != rows:
                raise RequestError(f"columns have different row counts: {name!r} has {n}, others {rows}")
            rows = n
            out[name] = arr.astype(want, copy=False)
        if not rows:
            raise RequestError("a request needs at least one row")
        if rows > self.max_rows:
            raise RequestError(f"{rows} rows in one request; the limit is {self.max_rows}", status=413)
        return out


def column_array(name: str, value: Any, expected: str = "numeric") -> np.ndarray:
    """One request column as a numeric numpy array, or :class:`RequestError` (422)."""
    if isinstance(value, np.ndarray):
        arr = value
    else:
        try:
            arr = np.asarray(value)
        except ValueError as e:  # ragged nested lists
            raise RequestError(f"column {name!r} is not a rectangular array: {e}") from None
    if arr.dtype.kind not in _KINDS:
        raise RequestError(f"column {name!r} must be {expected}; got {arr.dtype}")
    return arr


def validate_untyped(inputs: Any) -> dict[str, np.ndarray]:
    """Inputs of a deployment without an ``input_spec``: numeric columns with equal row counts."""
    if not isinstance(inputs, Mapping) or not inputs:
        raise RequestError("inputs must be a non-empty object of columns")
    out = {k: column_array(k, v) for k, v in inputs.items()}
    if any(a.ndim == 0 for a in out.values()):
        raise RequestError("inputs must be numeric arrays with a leading row dimension")
    if len({len(a) for a in out.values()}) != 1:
        raise RequestError("columns have different row counts")
    return out


def parse_body(body: bytes, max_bytes: int) -> Any:
    """The ``inputs`` of a JSON request body, or :class:`RequestError` (400/413)."""
    if len(body) > max_bytes:
        raise RequestError(f"request body of {len(body)} bytes exceeds the limit of {max_bytes}", status=413)
    try:
        payload = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"malformed JSON: {e}", status=400) from None
    if not isinstance(payload, dict) or "inputs" not in payload:
        raise RequestError('the body must be a JSON object with "inputs"', status=400)
    return payload["inputs"]


def rows_of(inputs: Mapping[str, np.ndarray]) -> int:
    return len(next(iter(inputs.values())))
