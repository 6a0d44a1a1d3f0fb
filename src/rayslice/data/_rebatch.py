"""Host-side batches of exactly ``batch_size`` rows from any source (private).

Sources: a ``ray.data.Dataset``, a ``ray.data.DataIterator`` (e.g. one shard
of ``streaming_split``), or any iterable of ``dict[str, np.ndarray]`` or
``pyarrow.Table`` batches of any size. Every batch but the last has exactly
``batch_size`` rows; the last may be partial. ``skip_rows`` drops that many
rows from the start (resuming from an iterator state); with a local shuffle
the rows are skipped after shuffling, so a seeded stream resumes exactly.

Example:
    >>> import numpy as np
    >>> [len(b["x"]) for b in host_batches([{"x": np.arange(5)}, {"x": np.arange(6)}], 4)]
    [4, 4, 3]
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

Batch = dict[str, np.ndarray]


def _is_ray_source(source: Any) -> bool:
    # Duck-typed so that importing rayslice.data never imports Ray Data.
    mod = type(source).__module__
    return mod.startswith("ray.data") and hasattr(source, "iter_batches")


def _arrow_to_numpy(table: Any) -> Batch:
    import pyarrow as pa

    out: Batch = {}
    for name, col in zip(table.column_names, table.columns):
        arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
        if pa.types.is_fixed_size_list(arr.type):
            # Tensors stored as fixed-size lists: (rows, width[, ...]).
            width = arr.type.list_size
            flat = arr.flatten().to_numpy(zero_copy_only=False)
            out[name] = flat.reshape(len(arr), width, *flat.shape[1:])
        elif hasattr(arr, "to_numpy_ndarray"):  # Ray's tensor extension type
            out[name] = arr.to_numpy_ndarray()
        else:
            out[name] = arr.to_numpy(zero_copy_only=False)
    return out


def to_numpy_batch(batch: Any, columns: Sequence[str] | None) -> Batch:
    """One source batch as a dict of numpy arrays, with equal row counts."""
    if isinstance(batch, Mapping):
        out = {k: np.asarray(v) for k, v in batch.items()}
    elif type(batch).__module__.startswith("pyarrow"):
        out = _arrow_to_numpy(batch)
    else:
        raise TypeError(
            f"batches must be dict[str, np.ndarray] or pyarrow.Table, got {type(batch).__name__}"
        )
    if columns is not None:
        missing = [c for c in columns if c not in out]
        if missing:
            from rayslice._validate import fail

            raise fail("columns", list(columns), f"columns of the data {sorted(out)}; missing: {missing}")
        out = {c: out[c] for c in columns}
    if not out:
        raise ValueError("a batch has no columns")
    lengths = {k: len(v) for k, v in out.items()}
    if len(set(lengths.values())) != 1:
        raise ValueError(f"columns of one batch have different row counts: {lengths}")
    return out


def _rows(batch: Batch) -> int:
    return len(next(iter(batch.values())))


def _concat(parts: list[Batch]) -> Batch:
    if len(parts) == 1:
        return parts[0]
    first = set(parts[0])
    for p in parts[1:]:
        if set(p) != first:
            raise ValueError(f"source batches have different columns: {sorted(first)} and {sorted(p)}; "
                             "every batch must have the same columns (select them with columns=[...])")
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def _shuffled(batches: Iterable[Batch], buffer_size: int, seed: int | None, out_rows: int) -> Iterator[Batch]:
    """Rows in a local random order: once ``buffer_size + out_rows`` rows are
    buffered, ``out_rows`` random ones leave; the rest drain shuffled at the end."""
    rng = np.random.default_rng(seed)
    buf: Batch | None = None
    for b in batches:
        buf = b if buf is None else _concat([buf, b])
        while _rows(buf) >= buffer_size + out_rows:
            take = np.zeros(_rows(buf), dtype=bool)
            take[rng.choice(_rows(buf), out_rows, replace=False)] = True
            yield {k: v[take] for k, v in buf.items()}
            buf = {k: v[~take] for k, v in buf.items()}
    if buf is not None and _rows(buf):
        order = rng.permutation(_rows(buf))
        yield {k: v[order] for k, v in buf.items()}


def _rebatch(batches: Iterable[Batch], batch_size: int, skip_rows: int) -> Iterator[Batch]:
    buf: list[Batch] = []
    have = 0
    for b in batches:
        n = _rows(b)
        if skip_rows:
            if n <= skip_rows:
                skip_rows -= n
                continue
            b = {k: v[skip_rows:] for k, v in b.items()}
            n -= skip_rows
            skip_rows = 0
        if n == 0:
            continue
        buf.append(b)
        have += n
        while have >= batch_size:
            merged = _concat(buf)
            yield {k: v[:batch_size] for k, v in merged.items()}
            rest = {k: v[batch_size:] for k, v in merged.items()}
            have -= batch_size
            buf = [rest] if have else []
    if have:
        yield _concat(buf)


def check_source(source: Any) -> None:
    """Refuses what is not a source of batches, before any thread starts."""
    if _is_ray_source(source):
        return
    if isinstance(source, Mapping) or type(source).__module__.startswith("pyarrow"):
        raise TypeError("source must be an iterable of batches, a ray.data.Dataset or a DataIterator; "
                        "got a single batch (wrap it in a list)")
    if isinstance(source, np.ndarray | str | bytes) or not hasattr(source, "__iter__"):
        raise TypeError(f"source must be a ray.data.Dataset, a DataIterator or an iterable of dict[str, np.ndarray] "
                        f"/ pyarrow.Table batches; got {type(source).__name__} (e.g. pass [{{'x': array}}])")


def host_batches(
    source: Any,
    batch_size: int,
    *,
    columns: Sequence[str] | None = None,
    skip_rows: int = 0,
    fetch_batches: int = 16,
    ray_prefetch_batches: int = 2,
    shuffle_buffer: int | None = None,
    shuffle_seed: int | None = None,
) -> Iterator[Batch]:
    """Exact-size host batches from ``source`` (see module docstring).

    From Ray Data, rows are fetched ``fetch_batches`` batches at a time and cut
    here into zero-copy numpy views: Ray's per-batch cost is paid once per
    fetch instead of once per step, which matters at thousands of steps/s.
    """
    if _is_ray_source(source):
        ds = source
        if columns is not None and hasattr(ds, "select_columns"):
            ds = ds.select_columns(list(columns))
        # Ray Data formats batches on a thread pool and, by default, yields them
        # in completion order; resuming from a row count needs the same order
        # every time, so ask a Dataset for its source order (a small reorder
        # buffer). A streaming_split shard's order is decided by its split
        # coordinator, out of reach here: resuming one is not exact.
        if hasattr(ds, "context"):
            ds.context.execution_options.preserve_order = True
        fetch = batch_size * max(1, fetch_batches)
        raw = iter(ds.iter_batches(batch_size=fetch, batch_format="numpy", drop_last=False,
                                   prefetch_batches=ray_prefetch_batches, local_shuffle_buffer_size=shuffle_buffer,
                                   local_shuffle_seed=shuffle_seed))
        # Resuming: skip whole fetches without converting them, then rows.
        whole, rest = divmod(skip_rows, fetch)
        for _ in range(whole):
            if next(raw, None) is None:
                return
        yield from _rebatch((to_numpy_batch(b, columns) for b in raw), batch_size, rest)
        return
    batches: Iterable[Batch] = (to_numpy_batch(b, columns) for b in source)
    if shuffle_buffer is not None:
        batches = _shuffled(batches, shuffle_buffer, shuffle_seed, batch_size)
    yield from _rebatch(batches, batch_size, skip_rows)
