"""The host's side of the RAM tier: copies a step's shards to host memory and sends them to two stores.

Example:
    >>> import numpy as np
    >>> leaves, nbytes = host_copy({"n": np.arange(3, dtype=np.int64), "lr": 0.5})
    >>> sorted(leaves), nbytes
    (["['lr']", "['n']"], 24)
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["RamWriter", "host_copy"]

# The package's logger, as before the package was split into modules.
logger = logging.getLogger("rayslice.train.ramtier")


def _index_key(index: Sequence[Any], shape: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """A shard's global index as ``((start, stop), ...)`` (hashable, the same for equal slices)."""
    out = []
    for sl, dim in zip(index, shape):
        start, stop, _ = sl.indices(dim) if isinstance(sl, slice) else (int(sl), int(sl) + 1, 1)
        out.append((start, stop))
    return tuple(out)


def host_copy(arrays: Any) -> tuple[dict[str, dict[str, Any]], int]:
    """This host's part of a pytree, copied to host memory: ``({leaf path: leaf record}, bytes)``.

    A ``jax.Array`` leaf keeps each distinct addressable shard (a replicated
    leaf: one copy), keyed by its global index; other leaves (numpy arrays,
    numbers) are kept whole. Every array is a copy, so the caller may donate
    or overwrite its buffers as soon as this returns.
    """
    import jax
    import numpy as np

    leaves: dict[str, dict[str, Any]] = {}
    nbytes = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(arrays)[0]:
        key = jax.tree_util.keystr(path)
        if isinstance(leaf, jax.Array):
            shards: dict[tuple[tuple[int, int], ...], Any] = {}
            for shard in leaf.addressable_shards:
                k = _index_key(shard.index, leaf.shape)
                if k not in shards:
                    shards[k] = np.array(shard.data, copy=True)
                    nbytes += shards[k].nbytes
            leaves[key] = {"kind": "array", "shape": tuple(leaf.shape), "dtype": str(leaf.dtype), "shards": shards}
        else:
            value = np.array(leaf, copy=True) if isinstance(leaf, np.ndarray) else leaf
            nbytes += int(getattr(value, "nbytes", 0))
            leaves[key] = {"kind": "value", "value": value}
    return leaves, nbytes


class RamWriter:
    """One per host process: copies a step's shards to host memory and sends them to two stores.

    Args:
        rank: This host's world rank.
        attempt: The attempt number.
        world_size: Hosts in the attempt.
        primary: Name of this node's store.
        replica: Name of the buddy's store (None: no replica, one host).
    """

    def __init__(self, rank: int, attempt: int, world_size: int, primary: str, replica: str | None) -> None:
        self.rank, self.attempt, self.world_size = rank, attempt, world_size
        self.primary, self.replica = primary, replica
        self.acked: int | None = None  # newest step acknowledged by both stores
        self.bytes_held = 0  # this node's store, at its last acknowledgement
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._handles: dict[str, Any] = {}
        self._warned = False

    def save(self, step: int, arrays: Any, meta: Mapping[str, Any]) -> float:
        """Copies this host's shards now (synchronously); sends them in the background. Returns the seconds blocked."""
        t0 = time.perf_counter()
        self.wait()  # at most one step in flight per host: the stores keep two
        leaves, nbytes = host_copy(arrays)
        payload = {
            "step": step,
            "attempt": self.attempt,
            "rank": self.rank,
            "world_size": self.world_size,
            "meta": dict(meta),
            "leaves": leaves,
            "nbytes": nbytes,
        }
        self._thread = threading.Thread(target=self._send, args=(step, payload), name="rayslice-ram", daemon=True)
        self._thread.start()
        return time.perf_counter() - t0

    def wait(self, timeout: float | None = None) -> None:
        """Waits for the step in flight to reach both stores (or fail)."""
        if self._thread is not None:
            self._thread.join(timeout)
            if not self._thread.is_alive():
                self._thread = None

    def _handle(self, name: str) -> Any:
        if name not in self._handles:
            import ray

            from rayslice.gang import NAMESPACE

            self._handles[name] = ray.get_actor(name, namespace=NAMESPACE)
        return self._handles[name]

    def _put_primary(self, step: int, ref: Any) -> int:
        import ray

        return int(ray.get(self._handle(self.primary).put.remote(self.rank, self.attempt, step, ref)))

    def _put_replica(self, step: int, ref: Any) -> None:
        import ray

        if self.replica is not None:
            ray.get(self._handle(self.replica).put.remote(self.rank, self.attempt, step, ref))

    def _send(self, step: int, payload: dict[str, Any]) -> None:
        import ray

        try:
            ref = ray.put(payload)
            del payload
            held = self._put_primary(step, ref)  # the node's own store first, then the buddy's
            self._put_replica(step, ref)
            self.bytes_held = max(self.bytes_held, held)
            self.acked = step
        except Exception as e:  # a store is gone: this step is not in RAM (storage still is); say so once
            self.error = e
            if not self._warned:
                self._warned = True
                logger.warning("RAM checkpoint of step %d not kept (%s); storage checkpoints go on", step, e)
