"""The machinery behind one :class:`~rayslice.data.JaxBatchIterator`: source, staging, transfers, pipeline.

:class:`Feeder` runs the steps of one stream (see :mod:`rayslice.data.feeder`
for what a step does): it reads and prepares this host's batches, agrees on
each step's rows with the other hosts, transfers the batch to the devices
(a few at once in one process under the synchronous pipeline on CPU
devices) and hands it over, from the consumer's ``next()`` or from a
prefetch thread. :func:`_assembly` picks where a batch spanning
source blocks is joined; a prefetch thread still running when the
interpreter exits is stopped before JAX is torn down.

Example:
    >>> import numpy as np
    >>> from rayslice.data.options import build_options
    >>> f = Feeder([{"x": np.arange(8)}], build_options(batch_size=4), state=None)
    >>> next(f)["x"].shape, f.state()["rows"]
    ((4,), 4)
    >>> f.close()
"""

from __future__ import annotations

import atexit
import collections
import queue
import threading
import weakref
from collections.abc import Generator, Iterator, Mapping
from typing import Any

import numpy as np

from rayslice._validate import fail
from rayslice.data import _columns as cols
from rayslice.data._agreement import RowAgreement, next_stream_id
from rayslice.data._pieces import Pieces
from rayslice.data._rebatch import Batch, Dropped, check_source, host_batches
from rayslice.data._sharding import batch_sharding, default_sharding
from rayslice.data._staging import StagingRing
from rayslice.data._steps import NEVER_PARTIAL, Step, decide
from rayslice.data._transfer import Transfers
from rayslice.data.options import FeederOptions, Ragged, check_state

_END = object()


#: On CPU devices the synchronous pipeline transfers up to this many consecutive
#: batches with one ``device_put`` call (its fixed cost, about a third of a 512 KB
#: batch's, is paid once per group) ...
GROUP_MAX_BATCHES = 8
#: ... while the group holds at most this many bytes (a batch this large pays the
#: per-call cost alone: a few percent of its transfer).
GROUP_MAX_BYTES = 4 << 20


def _reuses_staging(platform: str) -> bool:
    """Whether a device copy of a host buffer never aliases it: then host joins stage in a ring whose
    buffers go to the process's next streams (an aliased buffer lives as long as its batch)."""
    return platform != "cpu"


def _assembly(choice: str, platform: str, pinned: bool) -> str:
    """Where a batch spanning source blocks is joined: ``"device"`` or ``"host"`` (``FeederOptions.assemble``).

    ``"auto"`` joins on the device on TPUs, where it was measured (one host copy
    fewer: 0.84-1.01 of the fastest ``device_put`` on a TPU v5e host, against
    0.36-0.39 joined on the host), and on the host elsewhere: on CPU devices an
    aligned staging buffer is aliased, not copied; on GPUs the device join is
    not measured yet (``bench_data.py --gpu`` compares both); and a batch
    staged through pinned memory is staged whole.

    Example:
        >>> _assembly("auto", "tpu", False), _assembly("auto", "cpu", False), _assembly("auto", "tpu", True)
        ('device', 'host', 'host')
    """
    if choice != "auto":
        return choice
    return "device" if platform == "tpu" and not pinned else "host"


class Feeder:
    """The machinery behind one :class:`~rayslice.data.JaxBatchIterator`: source, staging, transfers, pipeline.

    The steps come from one generator (:meth:`_generate`). Under
    ``pipeline="sync"`` the consumer's ``next()`` runs it; under ``"thread"``
    a background thread runs it into a queue of ``prefetch`` batches. The
    thread holds only this object, never the iterator the caller holds, so
    dropping the iterator (``break`` out of a loop) stops the thread.
    """

    def __init__(self, source: Any, options: FeederOptions, state: Mapping[str, Any] | None) -> None:
        import jax

        check_source(source)
        st = check_state(state)
        o = self.options = options
        if st["rows"] and o.local_shuffle_buffer_size is not None and o.local_shuffle_seed is None:
            raise fail(
                "state",
                state,
                "None for a stream shuffled without local_shuffle_seed "
                "(pass a seed to resume a shuffled stream exactly)",
            )
        self.host_columns = frozenset(o.host_columns)
        self.process_count = jax.process_count()
        self.sharding, self.shards = batch_sharding(o.sharding or default_sharding(), o.batch_size, self.process_count)
        local = sorted(self.sharding.addressable_devices, key=lambda d: d.id)
        self.platform = local[0].platform
        self.pipeline = o.pipeline if o.pipeline != "auto" else ("sync" if self.platform == "cpu" else "thread")
        depth = o.prefetch + o.agree_window + 2
        self._transfers = Transfers(
            self.sharding,
            staging=o.staging,
            threads=o.transfer_threads,
            process_count=self.process_count,
            ring_depth=depth,
            reuse_staging=_reuses_staging(self.platform),
        )
        self.pinned = self._transfers.pinned
        self.transfer_threads = self._transfers.threads
        # Staging buffers are lent again once nothing references them: on CPU devices, which alias
        # an aligned host buffer, not while the consumer holds its batch; on accelerators, not while
        # a transfer reads it. There the ring is the transfers' (it joins on the host too), and a
        # finished stream leaves its buffers to the process's next streams.
        self._ring = self._transfers.ring or StagingRing(depth, spares=None)
        self._batches, self._rows, self._finished = st["batches"], st["rows"], st["finished"]
        agree = self.process_count > 1 if o.agree is None else o.agree
        self._agreement = RowAgreement(next_stream_id(), o.agreement_timeout_s) if agree else None
        self._process = jax.process_index() if self._agreement else 0
        self._template: Batch | None = None
        self._fills: dict[str, Any] = {}
        self._full_mask: Any = None
        self._source_done = False
        self._alloc = self._ring.alloc
        self.assemble = _assembly(o.assemble, self.platform, self.pinned is not None)
        self._source = host_batches(
            source,
            o.batch_size,
            columns=o.columns,
            skip_rows=self._rows,
            shuffle_buffer=o.local_shuffle_buffer_size,
            shuffle_seed=o.local_shuffle_seed,
            alloc=self._alloc,
            lazy=self.assemble == "device",
            # Under "drop" a partial batch ends the stream and under "raise" it raises RaggedBatchError, on
            # every host: its rows are counted, never joined, cast or collated (nor checked).
            drop_partial=o.ragged in NEVER_PARTIAL,
        )
        # CPU devices alias host memory (a batch on device costs no device memory), so the
        # consumer's next() transfers a few batches at once; elsewhere one at a time.
        single = (
            self.process_count == 1 and self.transfer_threads == 0 and self.pinned is None and self.assemble == "host"
        )
        self._group = GROUP_MAX_BATCHES if single and self.platform == "cpu" and self.pipeline == "sync" else 1
        self._deferred: Exception | None = None  # a source error raised once the batches before it are out
        self._gen = self._generate()
        self._queue: queue.Queue = queue.Queue(maxsize=o.prefetch)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, name="rayslice-feeder", daemon=True)
        if not self._finished and self.pipeline == "thread":
            _stopped_at_exit(self)
            self._thread.start()

    # -- transfers ------------------------------------------------------
    def _to_global(self, batch: Batch, rows: int) -> dict[str, Any]:
        dev, host = self._split_host(batch)
        out = self._transfers.put(dev, rows)  # its staging buffers are lent again once nothing references them
        return {**out, **host}

    def _to_global_group(self, group: list[tuple[Batch, int]]) -> list[dict[str, Any]]:
        """:meth:`_to_global` of consecutive batches, their device columns in one ``device_put`` call."""
        if len(group) == 1:
            return [self._to_global(*group[0])]
        dev, host = zip(*(self._split_host(b) for b, _ in group), strict=True)
        outs = self._transfers.put_many(list(dev))
        return [{**out, **h} for out, h in zip(outs, host, strict=True)]

    def _split_host(self, batch: Batch) -> tuple[Batch, Batch]:
        """``(device columns, host columns)`` of a host batch."""
        dev = {k: v for k, v in batch.items() if k not in self.host_columns}
        return dev, {k: v for k, v in batch.items() if k in self.host_columns}

    def _learn(self, template: Batch) -> None:
        """Takes the layout of the first batch (this host's, or another's) and checks it once."""
        o = self.options
        cols.check_device_columns(template, o.host_columns)
        if o.ragged is Ragged.PAD and o.mask_key is not None:
            if cols.ARRAY_KEY in template:
                raise TypeError(
                    "collate_fn returned one array, but ragged='pad' adds a mask to every batch; "
                    "return a dict from collate_fn, or pass mask_key=None"
                )
            if o.mask_key in template:
                raise ValueError(f"column {o.mask_key!r} clashes with the pad mask; pass mask_key=")
        if o.ragged is Ragged.PAD:
            self._fills = {
                k: cols.pad_fill(o.pad_value, k, v.dtype, k in self.host_columns) for k, v in template.items()
            }
        # Empty arrays of the layout (no view: it would pin a staging buffer).
        self._template = {k: np.empty((0, *v.shape[1:]), v.dtype) for k, v in template.items()}

    def _host_join(self, local: Batch) -> Batch:
        """Joins on the host the :class:`Pieces` columns that host work reads (collate, a cast, host columns)."""
        o = self.options

        def on_host(k: str, v: Pieces) -> bool:
            if o.collate_fn is not None or k in self.host_columns:
                return True
            want = cols.cast_target(o.dtypes, k, o.host_columns)
            return want is not None and want != v.dtype

        return {k: v.join(self._alloc) if isinstance(v, Pieces) and on_host(k, v) else v for k, v in local.items()}

    def _prepare(self, local: Batch) -> Batch:
        o = self.options
        if self.assemble == "device":
            local = self._host_join(local)
        if o.collate_fn is not None:
            local = cols.collate(o.collate_fn, local)
        local = cols.cast(local, o.dtypes, o.host_columns)
        if self._template is None:
            self._learn(local)
        else:
            cols.check_same_layout(self._template, local)
        return local

    def _read_ahead(self, pending: collections.deque, want: int) -> None:
        """Fills ``pending`` with up to ``want`` prepared host batches (the last may be a ``Dropped``)."""
        if self._deferred is not None and not pending:  # the batches read before the error are out
            e, self._deferred = self._deferred, None
            raise e
        while len(pending) < want and not self._source_done:
            local = next(self._source, None)
            if local is None:
                self._source_done = True
                return
            pending.append(local if isinstance(local, Dropped) else self._prepare(local))

    def _read_or_abort(self, pending: collections.deque, want: int, step: int | None) -> None:
        try:
            self._read_ahead(pending, want)
        except Exception as e:  # the other hosts wait for this one: tell them, then raise here
            if self._agreement:
                self._agreement.abort(step, f"{type(e).__name__}: {e}")
            elif pending:  # alone: the batches read before the error first, then the error
                self._deferred, self._source_done = e, True
                return
            raise

    def _handshake(self) -> None:
        o = self.options
        schema = cols.schema_of(self._template) if self._template is not None else None
        meta = {
            "batch_size": o.batch_size,
            "ragged": o.ragged.value,
            "mask_key": o.mask_key,
            "agree_window": o.agree_window,
            "host_columns": sorted(o.host_columns),
            "schema": schema,
        }
        metas = self._agreement.handshake(meta)  # type: ignore[union-attr]
        cols.compare_hosts(metas)
        if self._template is None:  # this host's shard is empty: learn the layout from a host with rows
            donor = next((m["schema"] for m in metas if m["schema"] is not None), None)
            if donor is not None:
                self._learn(cols.template_from(donor))

    def _step_out(self, action: Step, local: Batch | None, n: int) -> dict[str, Any]:
        o = self.options
        if action is Step.KEEP:
            return self._to_global(local, n)  # type: ignore[arg-type]
        if action is Step.FULL:
            out = self._to_global(local, o.batch_size)  # type: ignore[arg-type]
            if o.ragged is Ragged.PAD and o.mask_key is not None:
                out[o.mask_key] = self._full(o.batch_size)
            return out
        # pad: every host pads (a host with no rows sends an all-padding batch)
        if self._template is None:
            raise ValueError(
                "this host's shard is empty and hosts do not agree (agree=False / "
                "synchronize_batches=False), so it has no column layout to pad with; leave agree on"
            )
        padded, mask = cols.pad(local, o.batch_size, self._fills, self._template)
        out = self._to_global(padded, o.batch_size)
        if o.mask_key is not None:
            # Every batch has the same structure under "pad", so a jitted step never recompiles for the last one.
            out[o.mask_key] = self._to_global({"m": mask}, o.batch_size)["m"]
        return out

    def _generate(self) -> Generator[tuple[Any, int | None], None, None]:
        """Every step's (batch on device, this host's rows), then (_END, None); errors raise.

        The source is closed however the steps end (its end, an error, ``close()``): paused
        at a batch, it holds that batch's blocks (Ray object-store memory, for a Dataset).
        """
        try:
            yield from self._steps()
        finally:
            self._source.close()

    def _steps(self) -> Generator[tuple[Any, int | None], None, None]:
        o = self.options
        step = self._batches
        pending: collections.deque = collections.deque()
        agreed: dict[int, list[int]] = {}
        window = o.agree_window if self._agreement else 1
        group: list[tuple[Batch, int]] = []  # steps read and decided, not yet transferred (CPU, sync)
        size = 0  # their bytes
        self._read_or_abort(pending, window, None)
        if self._agreement:
            self._handshake()
        elif self._group > 1 and pending:  # read as many ahead as one group takes
            each = cols.nbytes_of(pending[0])
            window = self._group = max(1, min(self._group, GROUP_MAX_BYTES // max(1, each)))
        while not self._stop.is_set():
            if step not in agreed:
                # One exchange covers a window of steps: each host reads
                # that many batches ahead and posts all their sizes at once.
                self._read_or_abort(pending, window, step)
                mine = [cols.rows_of(b) for b in list(pending)[:window]]
                if self._agreement:
                    per_step = self._agreement.exchange(step, mine, window)
                else:
                    per_step = [[c] for c in mine] or [[0]]
                agreed.update({step + j: c for j, c in enumerate(per_step)})
            counts = agreed.pop(step)
            try:
                action = decide(
                    counts,
                    o.batch_size,
                    o.ragged,
                    self.shards,
                    hosts=len(counts) if self._agreement else self.process_count,
                )
            except Exception:  # the batches before this step are out first
                yield from self._flush(group)
                raise
            n = counts[self._process]
            local = pending.popleft() if n else None
            if self._group > 1 and action in (Step.KEEP, Step.FULL):
                group.append((local, n))  # type: ignore[arg-type]
                step += 1
                size += cols.nbytes_of(local)  # type: ignore[arg-type]
                local = None  # the group holds it until transferred
                if step in agreed and len(group) < self._group and size < GROUP_MAX_BYTES:
                    continue  # the next step is decided already: transfer it with this one
                yield from self._flush(group)
                group, size = [], 0
                continue
            yield from self._flush(group)  # a step of its own (the end, a padded one): the ones before first
            group, size = [], 0
            if action is Step.END:
                # What was read ahead and dropped (ragged="drop": this host's full batches, up to agree_window,
                # where another host's is partial) is let go before the stream ends, so its staging buffers go
                # to the next streams even while this iterator lives (this host's own partial batch was never
                # joined: a Dropped); so is the source, paused at its last batch, before the end is handed
                # over (nothing resumes this generator after _END: a later close comes after the caller
                # has seen the end, the prefetch thread's as it stops, or _generate's when it is freed).
                local = None
                pending.clear()
                self._source.close()
                yield _END, None
                return
            out = self._step_out(action, local, n)
            local = None  # its staging buffers are free once copied: not held while the consumer steps
            yield self._unwrap(out), n
            del out
            step += 1

    def _flush(self, group: list[tuple[Batch, int]]) -> Iterator[tuple[Any, int]]:
        if not group:
            return
        o = self.options
        mask = o.mask_key if o.ragged is Ragged.PAD else None  # every batch of a group is full then
        for out, (_, rows) in zip(self._to_global_group(group), group, strict=True):
            if mask is not None:
                out[mask] = self._full(o.batch_size)
            yield self._unwrap(out), rows

    def _full(self, rows: int) -> Any:
        """The mask of a full batch under ``Ragged.PAD``: one transfer, shared by every full batch."""
        if self._full_mask is None:
            self._full_mask = self._to_global({"m": np.ones(rows, dtype=bool)}, rows)["m"]
        return self._full_mask

    @staticmethod
    def _unwrap(out: dict[str, Any]) -> Any:
        return out[cols.ARRAY_KEY] if cols.ARRAY_KEY in out and len(out) == 1 else out

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self) -> None:  # the prefetch thread (pipeline="thread")
        try:
            for item in self._gen:
                if not self._put(item) or item[0] is _END:
                    return
        except BaseException as e:  # handed to the consumer, raised in order
            self._put((e, None))
        finally:
            # This thread alone runs the steps: closed here as it stops (the stream's end, an error, or
            # a caller that stopped early), the source closes now, not when a collection frees the feeder.
            self._gen.close()

    # -- consumer -----------------------------------------------------
    def __next__(self) -> Any:
        if self._finished:
            raise StopIteration
        if self.pipeline == "thread":
            item, n = self._queue.get()
        else:
            try:
                item, n = next(self._gen)
            except StopIteration:  # closed
                item, n = _END, None
            except BaseException as e:
                item, n = e, None
        if item is _END:
            self._end()
            raise StopIteration
        if isinstance(item, BaseException):
            self._end()
            raise item
        self._batches += 1
        self._rows += n
        return item

    def state(self) -> dict[str, Any]:
        """Where this host is: pass back as ``state=`` to continue with the next batch."""
        return {"version": 1, "batches": self._batches, "rows": self._rows, "finished": self._finished}

    def _end(self) -> None:
        """The stream is over (its end or an error): nothing more is staged."""
        self._finished = True
        self._stop.set()
        self._ring.release()  # to the next streams, each lent once nothing references it

    def close(self, wait: bool = True) -> None:
        """Stops the prefetch thread; the iterator then ends (idempotent)."""
        self._finished = True
        self._stop.set()
        if wait and self._thread.is_alive():
            self._thread.join(timeout=10)
        if not self._thread.is_alive():
            try:
                self._gen.close()
            except ValueError:  # running in another thread right now: it stops at its next step
                pass
            else:
                self._end()
        self._transfers.close()


_THREADED: weakref.WeakSet[Feeder] = weakref.WeakSet()  # feeders whose prefetch thread may still run
_AT_EXIT = threading.Lock()


def _stopped_at_exit(feeder: Feeder) -> None:
    """Has the interpreter's exit stop ``feeder``'s prefetch thread before anything is torn down.

    A daemon thread still inside a JAX call when the interpreter finalizes
    aborted the process (exit status 134) in 1 of 4, and under load 5 of 8,
    exits after a loop over a threaded feeder raised. The handler
    is registered with the first such feeder, after JAX is up, so it runs
    before JAX's own exit handlers (they run last registered, first).
    """
    with _AT_EXIT:
        if not _THREADED:
            atexit.unregister(_stop_threads)
            atexit.register(_stop_threads)
        _THREADED.add(feeder)


def _stop_threads() -> None:
    for feeder in list(_THREADED):
        feeder.close(wait=True)
