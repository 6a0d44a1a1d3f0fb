"""Host batch -> global ``jax.Array`` transfers for the feeder (private): DMA from the store, staging, per device.

One :class:`Transfers` per feeder decides, once, how a host batch reaches the
devices of its sharding, column by column:

* **straight from Ray's object store** (CUDA devices, ``staging="auto"``): a
  column that is a zero-copy view of the store goes to ``device_put`` as it
  is. The store's shared memory is registered with CUDA once per process
  (:class:`~rayslice.data._storepin.StorePinning`), so that is a DMA at the
  wire's rate with no host copy;
* **through ``pinned_host`` memory** (``"pinned"`` only): ``device_put`` into
  JAX's pinned host memory, then to the devices;
* **as it is** (every other column under ``"auto"``, and ``"pageable"``): a
  ``device_put`` of host memory (on CPU devices an alias of an aligned batch);
* **in pieces** (a :class:`~rayslice.data._pieces.Pieces` column, a batch
  spanning source blocks under ``assemble="device"``): each device's rows
  of each piece transferred as they are and joined on that device; in a
  stream whose layouts do not recur, on a grid of equal chunks, or cut on
  the device out of the whole source blocks that hold its rows, or joined
  on the host first (see :mod:`~rayslice.data._pieces`).

Measured on an H200 host (docs/performance.md, *GPU host*), for 8-32 MB
batches: the feeder with pageable ``device_put`` 14-18 GB/s, through
``pinned_host`` 14-16 GB/s, from the registered store 49-54 GB/s, against a
CUDA copy from pinned memory of 52-55 GB/s. On a TPU v5e host (*TPU host*)
JAX copies numpy into ``pinned_host`` memory at 0.2-0.5 GB/s, so staging
through it held the feeder to 0.21-0.25 GB/s against a pageable
``device_put`` of 11-12 GB/s: ``"auto"`` never stages. On a host with several local devices,
each device's rows are transferred from a thread pool (``transfer_threads``).
Staging buffers the feeder assembled a batch in are lent again once nothing
references them, a transfer still reading one included
(:class:`~rayslice.data._staging.StagingRing`).

Example:
    >>> import jax, numpy as np
    >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec
    >>> s = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("data",)), PartitionSpec("data"))
    >>> t = Transfers(s, staging="pinned")
    >>> t.pinned is not None, np.asarray(t.put({"x": np.arange(4.0)}, 4)["x"]).tolist()
    (True, [0.0, 1.0, 2.0, 3.0])
    >>> t.close()
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from rayslice._validate import fail
from rayslice.data._pieces import (
    GRID_MIN_BYTES,
    Layouts,
    Pieces,
    device_spans,
    grid_chunks,
    grid_cuts,
    join_on_device,
    write_rows,
)
from rayslice.data._staging import StagingRing, aligned_empty
from rayslice.data._storepin import StorePinning, store_pinning

Batch = Mapping[str, np.ndarray]
#: One device's arrays to transfer, and where its rows start in them (whole blocks; None: joined as they are).
_Job = tuple[list[np.ndarray], int | None]


def _is_cuda(device: Any) -> bool:
    try:
        return device.platform == "gpu" and "cuda" in str(device.client.platform_version).lower()
    except Exception:
        return False


class Transfers:
    """How one feeder's host batches become global arrays (see the module docstring).

    Args:
        sharding: The batch's ``NamedSharding`` (batch dimension split).
        staging: ``"auto"``, ``"pinned"`` or ``"pageable"`` (as :class:`~rayslice.data.FeederOptions`).
        threads: Threads issuing per-device transfers (None: one per local
            accelerator when there are several, at most 8; 0 on CPU devices).
        process_count: ``jax.process_count()``.
        ring_depth: Staging buffers kept per batch shape.
        reuse_staging: Keep a ring of staging buffers for host joins, lent
            again once the transfer that read them is done (nothing references
            them any more), and handed to the process's next stream at the
            end: where a transfer always copies (accelerators).
        store: Ray's object store registration to use (None: the process's
            own, on CUDA devices under ``staging="auto"``; given, for tests).
        grid_bytes: Smallest chunk of a grid join, in bytes of one column on
            one device (:data:`~rayslice.data._pieces.GRID_MIN_BYTES`).
    """

    def __init__(
        self,
        sharding: Any,
        *,
        staging: str = "auto",
        threads: int | None = None,
        process_count: int = 1,
        ring_depth: int = 4,
        reuse_staging: bool = False,
        store: StorePinning | None = None,
        grid_bytes: int = GRID_MIN_BYTES,
    ) -> None:
        self.sharding = sharding
        self.local = sorted(sharding.addressable_devices, key=lambda d: d.id)
        self.platform = self.local[0].platform
        self.process_count = process_count
        self.pinned = self._pinned_sharding(staging, self.local[0])
        self.ring: StagingRing | None = StagingRing(ring_depth) if reuse_staging else None
        self._alloc = self.ring.alloc if self.ring is not None else aligned_empty  # host joins' buffers
        self.store = store
        if store is None and staging == "auto" and _is_cuda(self.local[0]):
            self.store = store_pinning()
        self._cuda_ordinal = getattr(self.local[0], "local_hardware_id", None) if self.store is not None else None
        if threads is None:
            threads = min(8, len(self.local)) if self.platform != "cpu" and len(self.local) > 1 else 0
        self.threads = threads if process_count == 1 and len(self.local) > 1 else 0
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="rayslice-h2d") if self.threads else None
        self._index_maps: dict[tuple, list] = {}
        self._spans: dict[int, Any] = {}
        self.layouts = Layouts()
        self.block_layouts = Layouts()  # which whole blocks' shapes (and rows cut) a stream compiles cuts for
        self.grid_bytes = grid_bytes
        self.device_joins = 0  # columns joined on the devices (for tests and benchmarks)
        self.grid_joins = 0  # of which on a grid of equal chunks
        self.block_joins = 0  # of which from whole blocks

    def _pinned_sharding(self, staging: str, device: Any) -> Any:
        """The batch sharding in ``pinned_host`` memory, or None to transfer from pageable memory."""
        if staging == "pageable":
            return None
        try:
            kinds = {m.kind for m in device.addressable_memories()}
        except Exception:  # a backend without memory kinds
            kinds = set()
        if "pinned_host" not in kinds:
            if staging == "pinned":
                raise fail(
                    "staging",
                    staging,
                    f"'auto' or 'pageable': {self.platform} devices have no pinned_host "
                    f"memory (they have {sorted(kinds) or 'none listed'})",
                )
            return None
        if staging == "auto":  # measured: never faster than pageable, and ~50x slower on a TPU v5e host
            return None
        return self.sharding.with_memory_kind("pinned_host")

    # -- transfers ------------------------------------------------------
    def _put_one(self, v: np.ndarray, device: Any, pinned: bool) -> Any:
        import jax
        from jax.sharding import SingleDeviceSharding

        if pinned:
            v = jax.device_put(v, SingleDeviceSharding(device, memory_kind="pinned_host"))
        return jax.device_put(v, SingleDeviceSharding(device))

    def _put_per_device(self, dev: Batch, direct: set[str]) -> dict[str, Any]:
        """Every device's rows of every column, transferred from the pool in parallel."""
        import jax

        pool = self._pool
        assert pool is not None
        jobs = {}
        for k, v in dev.items():  # every job submitted before any is waited on
            key = v.shape
            if key not in self._index_maps:
                self._index_maps[key] = list(self.sharding.addressable_devices_indices_map(v.shape).items())
            pinned = self.pinned is not None and k not in direct
            jobs[k] = [pool.submit(self._put_one, v[idx], d, pinned) for d, idx in self._index_maps[key]]
        return {
            k: jax.make_array_from_single_device_arrays(dev[k].shape, self.sharding, [f.result() for f in fs])
            for k, fs in jobs.items()
        }

    def _put_columns(self, dev: Batch, rows: int, pinned: Any) -> dict[str, Any]:
        import jax

        if self.process_count == 1:
            if pinned is not None:  # into pinned host memory, then one DMA per device
                return jax.device_put(jax.device_put(dict(dev), pinned), self.sharding)
            return jax.device_put(dict(dev), self.sharding)
        shape0 = (rows * self.process_count,)
        target = pinned if pinned is not None else self.sharding
        out = {k: jax.make_array_from_process_local_data(target, v, shape0 + v.shape[1:]) for k, v in dev.items()}
        return jax.device_put(out, self.sharding) if pinned is not None else out

    def _layout(self, col: Pieces, rows: int) -> tuple[list[tuple[Any, int, int]] | None, bool]:
        """Each local device's rows of a batch whose columns are in pieces cut like ``col`` (None where
        a device's shard is not a row range), and whether the batch's layout is compiled (:class:`Layouts`)."""
        if self.store is not None:  # pieces of Ray's store: registered for DMA on first sight, as views are
            self._in_store(col.parts[0])
        if rows not in self._spans:  # the batch dimension alone is split
            self._spans[rows] = device_spans(self.sharding, (rows * self.process_count,))
        spans = self._spans[rows]
        if spans is None:
            return None, False
        # Every Pieces column of a batch is cut at the same rows: one layout per batch.
        key = tuple((d.id, lengths) for d, a, b in spans if len(lengths := tuple(len(p) for p in col.rows(a, b))) > 1)
        return spans, not key or self.layouts.admit(key)

    def _grid(self, col: Pieces, spans: list[tuple[Any, int, int]]) -> list[list[np.ndarray]] | None:
        """Each device's rows of ``col`` as equal chunks to join on the device (see :func:`grid_cuts`), a
        chunk across a block's end joined in a staging buffer; None where a device's rows are too few
        bytes for a grid, or more than a quarter of its chunks would cross an end (measured on a TPU
        v5e host: there the grid gained nothing over the host join)."""
        row_bytes = col.nbytes // max(1, len(col))
        cut = []
        for _, a, b in spans:  # a device whose rows lie in one block takes them as they are
            whole = col.rows(a, b)
            cut.append(
                [whole] if len(whole) == 1 else grid_chunks(col, a, b, grid_cuts(b - a, row_bytes, self.grid_bytes))
            )
        if any(len(c) == 1 and len(c[0]) > 1 or 4 * sum(len(pieces) > 1 for pieces in c) > len(c) for c in cut):
            return None
        alloc = self._alloc
        return [
            [
                write_rows(alloc((sum(map(len, pieces)), *col.shape[1:]), col.dtype), pieces)  # across an end
                if len(pieces) > 1
                else pieces[0]
                for pieces in chunks
            ]
            for chunks in cut
        ]

    def _whole_blocks(self, col: Pieces, spans: list[tuple[Any, int, int]]) -> list[_Job] | None:
        """Each device's rows of ``col`` as the whole source blocks that hold them and where they start
        there (:meth:`Pieces.blocks`); None where a block is under ``grid_bytes`` or a device would
        receive more than twice its rows (measured on a TPU v5e host: whole 5 MB blocks into
        8-32 MB batches 0.57-0.90 of a contiguous ``device_put``, joined on the host 0.49-0.58;
        into 4 MB batches, 2.2 times the bytes, 0.34 against 0.39)."""
        jobs: list[_Job] = []
        for _, a, b in spans:
            whole = col.rows(a, b)
            if len(whole) == 1:  # a device whose rows lie in one block takes them as they are
                jobs.append((whole, None))
                continue
            found = col.blocks(a, b)
            if found is None:
                return None
            blocks, at = found
            sent = sum(map(len, blocks))
            # The cut must lie inside the blocks: the device would clamp it, silently, to other rows.
            if sent > 2 * (b - a) or at + b - a > sent or min(x.nbytes for x in blocks) < self.grid_bytes:
                return None
            jobs.append((blocks, at))
        return jobs

    def _from_blocks(self, pieces: dict[str, Pieces], spans: list[tuple[Any, int, int]]) -> dict[str, list[_Job]]:
        """:meth:`_whole_blocks` of the columns that allow it, where the batch's block shapes recur."""
        cols = {k: jobs for k, col in pieces.items() if (jobs := self._whole_blocks(col, spans)) is not None}
        if not cols:
            return {}
        # One compilation per device, block shapes and rows cut: a batch's key is the set of its devices' own.
        jobs = next(iter(cols.values()))
        key = tuple(
            sorted({(tuple(map(len, arrays)), b - a) for (arrays, at), (_, a, b) in zip(jobs, spans) if at is not None})
        )
        return cols if self.block_layouts.admit(key) else {}

    def _join_on_devices(
        self, cols: dict[str, list[_Job]], shapes: dict[str, tuple[int, ...]], spans: list
    ) -> dict[str, Any]:
        """Global arrays of ``cols`` (per local device, the arrays to transfer and join there, in
        ``spans``' order, and where its rows start in whole blocks) of global shape ``shapes[k]``;
        every job is issued before any is waited on."""
        import jax

        jobs: dict[str, list[Any]] = {}
        for k, per_device in cols.items():
            if self._pool is not None:
                jobs[k] = [
                    self._pool.submit(join_on_device, arrays, d, at, b - a)
                    for (arrays, at), (d, a, b) in zip(per_device, spans)
                ]
            else:
                jobs[k] = [join_on_device(arrays, d, at, b - a) for (arrays, at), (d, a, b) in zip(per_device, spans)]
        out = {}
        for k, fs in jobs.items():
            arrays = [f.result() for f in fs] if self._pool is not None else fs
            out[k] = jax.make_array_from_single_device_arrays(shapes[k], self.sharding, arrays)
        self.device_joins += len(cols)
        return out

    def put(self, dev: Batch, rows: int) -> dict[str, Any]:
        """Global arrays of this host's ``rows``-row batch ``dev`` (device columns only).

        A staging buffer the batch was assembled in is lent again once the
        transfer that reads it is done. :class:`Pieces` columns are joined on
        the devices: in their pieces where the batch's layout recurs, else on a
        grid of equal chunks once most batches' layouts have not recurred,
        else from whole source blocks where their shapes recur, else on the
        host.
        """
        pieces: dict[str, Pieces] = {k: v for k, v in dev.items() if isinstance(v, Pieces)}  # type: ignore[misc]
        if not pieces:
            return self._put_plain(dev, rows)
        spans, compiled = self._layout(next(iter(pieces.values())), rows)
        cols: dict[str, list[_Job]] = {}
        if spans is not None and compiled:
            cols = {k: [(col.rows(a, b), None) for _, a, b in spans] for k, col in pieces.items()}
        elif spans is not None:
            if self.layouts.mostly_refused:
                for k, col in pieces.items():
                    if (grid := self._grid(col, spans)) is not None:
                        cols[k] = [(arrays, None) for arrays in grid]
                self.grid_joins += len(cols)
            if left := {k: col for k, col in pieces.items() if k not in cols}:
                whole = self._from_blocks(left, spans)
                cols.update(whole)
                self.block_joins += len(whole)
        shapes = {k: (rows * self.process_count, *pieces[k].shape[1:]) for k in cols}
        joined = self._join_on_devices(cols, shapes, spans or []) if cols else {}
        rest = {k: v.join(self._alloc) if isinstance(v, Pieces) else v for k, v in dev.items() if k not in joined}
        out = self._put_plain(rest, rows) if rest else {}
        return {k: joined[k] if k in joined else out[k] for k in dev}

    def _put_plain(self, dev: Batch, rows: int) -> dict[str, Any]:
        """:meth:`put` of numpy columns."""
        direct = {k for k, v in dev.items() if self._in_store(v)}
        if self._pool is not None:
            out = self._put_per_device(dev, direct)
        else:
            out = self._put_columns({k: dev[k] for k in direct}, rows, None) if direct else {}
            if len(direct) < len(dev):
                out.update(self._put_columns({k: v for k, v in dev.items() if k not in direct}, rows, self.pinned))
            out = {k: out[k] for k in dev}  # the batch's column order, whatever path each took
        return out

    def _in_store(self, v: np.ndarray) -> bool:
        """Whether ``v`` goes to the devices as it is, by DMA from the registered store."""
        import jax

        if self.store is None or jax.dtypes.canonicalize_dtype(v.dtype) != v.dtype:  # JAX would cast it first
            return False
        return self.store.covers(v, self._cuda_ordinal)

    def put_many(self, devs: list[Batch]) -> list[dict[str, Any]]:
        """Consecutive small batches in one ``device_put`` call (one process, no pool, no staging)."""
        import jax

        return jax.device_put([dict(d) for d in devs], self.sharding)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
