"""JAX-native data feeding: :func:`iter_jax_batches` from Ray Data to sharded global arrays.

Each host reads its own rows (``batch_size`` per host per step), casts them on
the host, and assembles one global ``jax.Array`` of ``batch_size x
process_count`` rows sharded along the batch dimension. A batch inside one
Ray block is a zero-copy view of the object store; one spanning blocks is
written piece by piece into a staging buffer, or on TPUs sent piece by
piece and joined on the device (``assemble``). On accelerators the batch
reaches the devices asynchronously (in parallel per device): on CUDA devices
a view of Ray's object store by DMA as it is (the store is registered with
CUDA once per process), anything else by ``device_put`` from host memory
(staging through JAX's ``pinned_host`` memory only when asked: it was never
faster, and on a TPU host 50x slower); a background thread keeps the next
``prefetch`` batches on device while the current step runs; on CPU devices, where an
aligned host batch is aliased rather than copied, the work runs in the
consumer's ``next()`` (``pipeline="auto"``), a few small batches per
``device_put`` call (its fixed cost paid once per group). Options are one
:class:`~rayslice.data.FeederOptions`, checked when the iterator is built;
Ray's ``Dataset.iter_jax_batches`` arguments are accepted too (see :func:`~rayslice.data.options.build_options`).

The last batch is an explicit :class:`~rayslice.data.Ragged` choice:
``"raise"`` (default; an error naming the rows left, raised before any
partial batch is yielded), ``"drop"``, ``"pad"`` (to ``batch_size`` with
``pad_value``, plus a boolean ``mask`` marking real rows, sharded like the
batch; every batch carries it, so a jitted step never recompiles for the last
one) or ``"keep"`` (Ray's default: a smaller last batch).

Hosts agree on every step (``agree=True``, the default when there is more than
one process): if one host's shard runs out first, the policy applies on every
host at the same step, so no host waits forever in a collective. Before the
first step they compare settings and column layouts, so hosts that differ in
``batch_size``, columns or dtypes fail at once with the difference named. The
cost is one key-value exchange per ``agree_window`` steps (default 8) on the
prefetch thread, overlapped with compute (measured by ``make bench``).

Example:
    >>> import numpy as np
    >>> from rayslice.data import iter_jax_batches
    >>> rows = [{"x": np.arange(10, dtype=np.float32)}]
    >>> it = iter_jax_batches(rows, batch_size=4, ragged="pad")
    >>> [int(b["mask"].sum()) for b in it]
    [4, 4, 2]
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from rayslice._validate import fail
from rayslice.data._pipeline import Feeder
from rayslice.data.options import FeederOptions, Ragged, build_options


class JaxBatchIterator(Iterator[Any]):
    """The iterator :func:`iter_jax_batches` returns.

    ``state()`` is a small JSON-able dict; passing it back as ``state=``
    continues with exactly the next batch. Use as a context manager, or call
    ``close()``, to stop the prefetch thread early; dropping the iterator
    stops it too.

    Args:
        source: See :func:`iter_jax_batches`.
        options: The options, whole; or leave it out and pass
            :func:`iter_jax_batches`'s keywords.
        state: A previous iterator's ``state()`` to resume after.
    """

    def __init__(
        self,
        source: Any,
        options: FeederOptions | None = None,
        *,
        state: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if options is None:
            options = build_options(**kwargs)
        elif kwargs:
            raise fail(sorted(kwargs)[0], kwargs[sorted(kwargs)[0]], "left out when options= is given (set it there)")
        elif not isinstance(options, FeederOptions):
            raise fail("options", options, "a FeederOptions", got_type=True)
        self.options = options
        self._feeder = Feeder(source, options, state)

    def __iter__(self) -> JaxBatchIterator:
        return self

    def __next__(self) -> Any:
        return self._feeder.__next__()

    def state(self) -> dict[str, Any]:
        """Where this host is: pass back as ``state=`` to continue with the next batch."""
        return self._feeder.state()

    def close(self) -> None:
        """Stops the prefetch thread (idempotent); ``next()`` then raises StopIteration."""
        self._feeder.close()

    @property
    def sharding(self) -> Any:
        """The ``NamedSharding`` of the batch arrays."""
        return self._feeder.sharding

    @property
    def _queue(self) -> queue.Queue:  # for tests: batches already on device
        return self._feeder._queue

    @property
    def _thread(self) -> threading.Thread:
        return self._feeder._thread

    def __enter__(self) -> JaxBatchIterator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        feeder = getattr(self, "_feeder", None)  # absent when __init__ raised
        if feeder is not None:
            feeder.close(wait=False)


def iter_jax_batches(
    source: Any,
    batch_size: int | None = None,
    *,
    options: FeederOptions | None = None,
    state: Mapping[str, Any] | None = None,
    sharding: Any = None,
    ragged: Ragged | str | None = None,
    pad_value: Any = None,
    prefetch: int | None = None,
    pipeline: str | None = None,
    staging: str | None = None,
    assemble: str | None = None,
    transfer_threads: int | None = None,
    dtypes: Any = None,
    columns: Sequence[str] | None = None,
    host_columns: Sequence[str] | None = None,
    mask_key: str | None = None,
    agree: bool | None = None,
    agreement_timeout_s: float | None = None,
    agree_window: int | None = None,
    drop_last: bool | None = None,
    paddings: Any = None,
    prefetch_batches: int | None = None,
    collate_fn: Callable[[Any], Any] | None = None,
    synchronize_batches: bool | None = None,
    local_shuffle_buffer_size: int | None = None,
    local_shuffle_seed: int | None = None,
) -> JaxBatchIterator:
    """Global, device-sharded ``jax.Array`` batches from Ray Data (or any batch iterable).

    Every keyword left as None takes its :class:`FeederOptions` default; the
    keywords are checked once, into one ``FeederOptions`` (or pass
    ``options=`` whole). Ray's ``Dataset.iter_jax_batches`` names work as they
    do there; see :func:`~rayslice.data.options.build_options` for how they map.

    Args:
        source: A ``ray.data.Dataset``, a ``ray.data.DataIterator`` (e.g.
            ``ray.train.get_dataset_shard`` or one ``streaming_split`` shard),
            or an iterable of ``dict[str, np.ndarray]`` / ``pyarrow.Table``
            batches. For a ``Dataset`` this turns on ``preserve_order`` in its
            DataContext: a resumed iterator must see rows in the same order.
        batch_size: Rows per host per step (default 256, as Ray's).
        options: All options at once (then no other option keyword).
        state: A previous iterator's ``state()`` to resume after.
        sharding: ``NamedSharding`` splitting the batch dimension; default: the
            ``jax.set_mesh`` mesh, else 1-D Auto axes (mixes with ``Mesh(devices, ("data",))``).
        ragged: ``"raise"`` (default), ``"drop"``, ``"pad"`` or ``"keep"``.
        pad_value: Fill under ``"pad"`` (a scalar or ``{column: scalar}``).
        prefetch: Batches kept on device ahead of the consumer (default 2)
            when the pipeline runs on a thread.
        pipeline: ``"auto"`` (default: ``"sync"`` on CPU devices, else
            ``"thread"``), ``"thread"`` or ``"sync"`` (no thread; Ray's
            ``prefetch_batches=0``).
        staging: ``"auto"`` (default: on CUDA devices, views of Ray's object
            store by DMA from the registered store; otherwise as
            ``"pageable"``), ``"pinned"`` or ``"pageable"``.
        assemble: Where a batch spanning several source blocks is joined:
            ``"auto"`` (default: on the device on TPUs, on the host elsewhere),
            ``"device"`` or ``"host"``.
        transfer_threads: Threads issuing per-device transfers in parallel
            (default: one per local accelerator when there are several).
        dtypes: One dtype for every device column (as Ray), or ``{column: dtype}``.
        columns: Columns to keep (a list).
        host_columns: Columns kept as numpy on this host, never sent to devices.
        mask_key: Name of the real-row mask under ``"pad"`` (default "mask").
        agree: Agree on batch counts across hosts (default: when multi-process).
        agreement_timeout_s: Longest wait for the slowest host (default 600).
        agree_window: Steps covered by one agreement exchange (default 8).
        drop_last: Ray's name: ``True`` is ``ragged="drop"``.
        paddings: Ray's name: pad the last batch with this (no mask, as in Ray).
        prefetch_batches: Ray's name for ``prefetch``.
        collate_fn: Ray's collate function (or any ``dict -> dict | ndarray``);
            a single array output yields ``jax.Array`` batches.
        synchronize_batches: Ray's name for ``agree``.
        local_shuffle_buffer_size: Rows in a local shuffle buffer.
        local_shuffle_seed: Seed for the local shuffle.

    Returns:
        A :class:`JaxBatchIterator` of ``dict[str, jax.Array]`` (host columns as numpy).

    Raises:
        InvalidArgument: A bad option, before anything is read.
        ValueError: A sharding mismatch (before the first batch), hosts that
            differ in settings or columns, or :class:`RaggedBatchError`.

    Example:
        >>> import numpy as np
        >>> batches = [{"x": np.ones((8, 3), np.float64)}]
        >>> b = next(iter_jax_batches(batches, batch_size=8, dtypes=np.float32))
        >>> b["x"].shape, str(b["x"].dtype)
        ((8, 3), 'float32')
    """
    given = dict(
        batch_size=batch_size,
        sharding=sharding,
        ragged=ragged,
        pad_value=pad_value,
        prefetch=prefetch,
        pipeline=pipeline,
        staging=staging,
        assemble=assemble,
        transfer_threads=transfer_threads,
        dtypes=dtypes,
        columns=columns,
        host_columns=host_columns,
        mask_key=mask_key,
        agree=agree,
        agreement_timeout_s=agreement_timeout_s,
        agree_window=agree_window,
        drop_last=drop_last,
        paddings=paddings,
        prefetch_batches=prefetch_batches,
        collate_fn=collate_fn,
        synchronize_batches=synchronize_batches,
        local_shuffle_buffer_size=local_shuffle_buffer_size,
        local_shuffle_seed=local_shuffle_seed,
    )
    if options is not None:
        extra = {k: v for k, v in given.items() if v is not None}
        return JaxBatchIterator(source, options, state=state, **extra)
    return JaxBatchIterator(source, build_options(**given), state=state)
