"""Offline batch inference on a reserved slice: :func:`batch_predict`.

It reserves a slice for the pass, or runs on one you already hold
(``tpu_slice=``). The dataset is split into one stream per host (``streaming_split``); every
host feeds its stream through :func:`~rayslice.data.iter_jax_batches` with
``ragged="pad"`` (hosts agree on every step, so uneven shards never hang), runs
the same jitted function over the global batch (SPMD), and keeps only its own,
real rows: padded rows never reach the output. Each host's predictions, next
to the input columns you keep, return as an Arrow table in Ray's object store,
owned by the driver, and become one ``ray.data.Dataset`` without passing
through the driver's memory.

Example:
    >>> import ray, numpy as np
    >>> from rayslice.data import batch_predict
    >>> ds = ray.data.from_items([{"id": i, "x": float(i)} for i in range(100)])  # doctest: +SKIP
    >>> out = batch_predict(ds, lambda b: b["x"] * 2, topology="2x2x2", accelerator_type="TPU-V4",
    ...                     batch_size=16, keep_columns=["id"])  # doctest: +SKIP
    >>> with rayslice.slice_placement_group("2x2x2", "TPU-V4") as spg:  # doctest: +SKIP
    ...     out = batch_predict(ds, lambda b: b["x"] * 2, tpu_slice=spg, batch_size=16)  # held: not released
    >>> sorted(out.take_all(), key=lambda r: r["id"])[3]  # doctest: +SKIP
    {'id': 3, 'prediction': 6.0}
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from rayslice._validate import (
    check_callable,
    check_float,
    check_instance,
    check_optional,
    check_str,
    check_str_list,
    fail,
)
from rayslice.data.options import FeederOptions, Ragged
from rayslice.request import SliceRequest
from rayslice.topology import Topology


def local_rows(arr: Any, ranges: Sequence[tuple[int, int]]) -> np.ndarray:
    """This process's rows ``ranges`` (global first-dim index ranges) of a global array.

    Works whatever the array's sharding: each range is cut from any
    addressable shard that covers it (a replicated output covers all).
    """
    shards = []
    for s in arr.addressable_shards:
        idx = s.index[0] if s.index else slice(None)
        start = idx.start or 0
        stop = idx.stop if idx.stop is not None else arr.shape[0]
        shards.append((start, stop, s))
    pieces = []
    for lo, hi in ranges:
        for start, stop, s in shards:
            if start <= lo and hi <= stop:
                pieces.append(np.asarray(s.data)[lo - start : hi - start])
                break
        else:
            raise ValueError(f"rows {lo}:{hi} are not addressable on this host for sharding {arr.sharding}")
    return np.concatenate(pieces) if len(pieces) > 1 else pieces[0]


def _own_ranges(mask: Any) -> list[tuple[int, int]]:
    # The rows this host contributed: the addressable shards of the input batch.
    spans = {(s.index[0].start or 0, s.index[0].stop) for s in mask.addressable_shards}
    return sorted(spans)


def _bind_state(predict_fn: Callable, state: Any) -> Callable:
    """``batch -> predict_fn(state, batch)``, jitted with the state's arrays as arguments.

    Arrays must be arguments, not closure constants: jit would embed closed-over
    weights in the program, and refuses arrays that span other hosts. Other
    leaves (a Flax module, settings) are closed over as static values.
    """
    import jax

    leaves, treedef = jax.tree_util.tree_flatten(state)
    is_array = [isinstance(leaf, jax.Array | np.ndarray) for leaf in leaves]
    arrays = [leaf for leaf, a in zip(leaves, is_array) if a]
    static = [leaf for leaf, a in zip(leaves, is_array) if not a]

    def call(arrs: list, batch: Any) -> Any:
        arr_it, static_it = iter(arrs), iter(static)
        rebuilt = treedef.unflatten([next(arr_it) if a else next(static_it) for a in is_array])  # type: ignore[attr-defined]
        return predict_fn(rebuilt, batch)

    jitted = jax.jit(call)
    return lambda batch: jitted(arrays, batch)


def _to_arrow(columns: dict[str, np.ndarray]) -> Any:
    import pyarrow as pa
    from ray.data.extensions import ArrowTensorArray

    arrays = {k: (ArrowTensorArray.from_numpy(v) if v.ndim > 1 else pa.array(v)) for k, v in columns.items()}
    return pa.table(arrays)


def _host_predict(
    shard: Any,
    predict_fn: Callable,
    setup: Callable | None,
    options: FeederOptions,
    input_columns: Sequence[str] | None,
    keep: Sequence[str] | None,
    output_column: str,
) -> Any:
    import jax

    from rayslice.data.feeder import iter_jax_batches

    state = setup() if setup is not None else None
    step = jax.jit(predict_fn) if setup is None else _bind_state(predict_fn, state)
    parts: dict[str, list[np.ndarray]] = {}
    mask_key = options.mask_key
    with iter_jax_batches(shard, options=options) as it:
        for batch in it:
            mask = batch.pop(mask_key)
            names = input_columns or [k for k in batch if not isinstance(batch[k], np.ndarray)]
            inputs = {k: batch[k] for k in names}
            out = step(inputs)
            outs = out if isinstance(out, dict) else {output_column: out}
            ranges = _own_ranges(mask)
            real = local_rows(mask, ranges)
            kept = {
                k: (batch[k] if isinstance(batch[k], np.ndarray) else local_rows(batch[k], ranges))
                for k in (keep if keep is not None else batch)
            }
            for k, v in {**kept, **{k: local_rows(v, ranges) for k, v in outs.items()}}.items():
                parts.setdefault(k, []).append(v[real])
    if not parts:
        return 0, None
    table = _to_arrow({k: np.concatenate(v) for k, v in parts.items()})
    return table.num_rows, table


def _feeder_options(
    batch_size: int, dtypes: Any, input_columns: tuple[str, ...] | None, keep: tuple[str, ...] | None
) -> FeederOptions:
    # Kept columns ride along on the host (exact ids, any dtype); only inputs go to devices.
    columns = None if input_columns is None or keep is None else tuple(dict.fromkeys([*input_columns, *keep]))
    return FeederOptions(
        batch_size=batch_size,
        ragged=Ragged.PAD,
        dtypes=dtypes,
        columns=columns,
        host_columns=tuple(k for k in (keep or ()) if k not in (input_columns or ())),
        mask_key="__rayslice_mask",
    )


def batch_predict(
    dataset: Any,
    predict_fn: Callable[..., Any],
    *,
    batch_size: int,
    topology: str | Topology | SliceRequest | None = None,
    accelerator_type: str | None = None,
    tpu_slice: Any = None,
    setup: Callable[[], Any] | None = None,
    input_columns: Sequence[str] | None = None,
    keep_columns: Sequence[str] | None = None,
    output_column: str = "prediction",
    dtypes: Any = None,
    num_slices: int | None = None,
    chips_per_host: int | None = None,
    timeout_s: float = 600.0,
    reservation_timeout_s: float = 300.0,
) -> Any:
    """Runs a jitted function over every row of ``dataset`` on all hosts of a slice.

    Either reserves the slice (``topology`` + ``accelerator_type``, or a
    :class:`~rayslice.request.SliceRequest` / ``Topology``) for the pass and
    releases it after, or runs on one the caller already holds
    (``tpu_slice=``, Ray's keyword), which it neither reserves nor releases.

    Args:
        dataset: A ``ray.data.Dataset``.
        predict_fn: ``predict_fn(batch)`` (or ``predict_fn(state, batch)`` with
            ``setup``) over a dict of global ``jax.Array``s; returns an array
            (first dim = batch) or a dict of them.
        batch_size: Rows per host per step.
        topology: Slice shape, e.g. "2x2x2", or a ``Topology`` / ``SliceRequest``.
        accelerator_type: Generation, e.g. "TPU-V4" (with a string topology).
        tpu_slice: A held :class:`~rayslice.placement.SlicePlacementGroup` to
            run on instead of reserving one.
        setup: Runs once per host after ``jax.distributed`` is up (e.g. load
            and shard weights); its result is passed to ``predict_fn``.
        input_columns: Columns passed to ``predict_fn`` (default: all).
        keep_columns: Input columns copied next to each prediction (default:
            all); e.g. ``["id"]`` to align predictions with input rows.
        output_column: Column name for a non-dict output.
        dtypes: Host-side casts (see :func:`iter_jax_batches`).
        num_slices: Slices to spread the work over (default 1).
        chips_per_host: Host layout for v5e/v6e "2x4".
        timeout_s: Deadline for the whole pass once the slice is held.
        reservation_timeout_s: Deadline to reserve the slice.

    Returns:
        A ``ray.data.Dataset`` with one row per input row (never a padded one).

    Raises:
        InvalidArgument: A bad argument, before anything is reserved.
    """
    import inspect

    from rayslice.placement import SlicePlacementGroup, slice_placement_group

    if not hasattr(dataset, "streaming_split"):
        raise fail("dataset", dataset, "a ray.data.Dataset", got_type=True)
    check_callable("predict_fn", predict_fn)
    check_optional(check_callable, "setup", setup)
    inputs = check_optional(check_str_list, "input_columns", input_columns)
    keep = check_optional(check_str_list, "keep_columns", keep_columns)
    check_str("output_column", output_column)
    check_float("timeout_s", timeout_s, minimum=0, exclusive_min=True)
    check_float("reservation_timeout_s", reservation_timeout_s, minimum=0, exclusive_min=True)
    options = _feeder_options(batch_size, dtypes, inputs, keep)
    try:
        arity = len(inspect.signature(predict_fn).parameters)
    except (TypeError, ValueError):
        arity = 1
    if setup is None and arity == 2:
        raise fail(
            "setup", setup, "a function whose result is passed as predict_fn's state: predict_fn takes (state, batch)"
        )
    if tpu_slice is not None:
        check_instance("tpu_slice", tpu_slice, SlicePlacementGroup, "a SlicePlacementGroup you hold")
        for name, value in (
            ("topology", topology),
            ("accelerator_type", accelerator_type),
            ("num_slices", num_slices),
            ("chips_per_host", chips_per_host),
        ):
            if value is not None:
                raise fail(name, value, "left out when tpu_slice= is given (the held slice fixes it)")
        if tpu_slice.released:
            raise fail("tpu_slice", tpu_slice, "a reservation that is still held (this one was released)")
        return _predict_on(tpu_slice, dataset, predict_fn, setup, options, inputs, keep, output_column, timeout_s)
    if topology is None:
        raise fail(
            "topology",
            topology,
            "a slice shape such as '2x2x2' (with accelerator_type), a Topology or a SliceRequest; or pass tpu_slice=",
        )
    request = SliceRequest.parse(topology, accelerator_type, num_slices=num_slices, chips_per_host=chips_per_host)
    with slice_placement_group(request, timeout_s=reservation_timeout_s) as spg:
        return _predict_on(spg, dataset, predict_fn, setup, options, inputs, keep, output_column, timeout_s)


def _predict_on(
    spg: Any,
    dataset: Any,
    predict_fn: Callable,
    setup: Callable | None,
    options: FeederOptions,
    inputs: tuple[str, ...] | None,
    keep: tuple[str, ...] | None,
    output_column: str,
    timeout_s: float,
) -> Any:
    import ray

    from rayslice.gang import SliceGang

    with SliceGang(spg) as gang:
        shards = dataset.streaming_split(spg.num_hosts, equal=False)
        args = [(shard, predict_fn, setup, options, inputs, keep, output_column) for shard in shards]
        rows, tables = gang.run_each(_host_predict, args, timeout_s=timeout_s)
    kept = [t for n, t in zip(rows, tables) if n]
    if not kept:
        return ray.data.from_items([])
    return ray.data.from_arrow_refs(kept)
