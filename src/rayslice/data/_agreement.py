"""Multi-host agreement on batch sizes (private).

Every few steps each host posts how many rows it has for each of the next
``window`` steps and reads what the others posted, through the key-value store of ``jax.distributed``'s
coordination service. This is not a device collective, so it can run on the
feeder's background thread without ever interleaving with the training step's
collectives (which must be issued in the same order on every host).

Cost: one small RPC to set plus one blocking get per other host, per window of
steps; it runs ahead of the step on the prefetch thread, overlapping compute.
"""

from __future__ import annotations

import itertools
import json
import threading
from typing import Any

_SEQ = itertools.count()
_SEQ_LOCK = threading.Lock()


def next_stream_id() -> int:
    """A per-process id for a new iterator; the same on every host when all
    hosts create their iterators in the same order (as SPMD programs do)."""
    with _SEQ_LOCK:
        return next(_SEQ)


class RowAgreement:
    """Exchanges per-step row counts among all JAX processes.

    Args:
        stream_id: Identifies the iterator (see :func:`next_stream_id`).
        timeout_s: How long to wait for the slowest host at one step.
    """

    def __init__(self, stream_id: int, timeout_s: float) -> None:
        import jax
        from jax._src import distributed

        self.process = jax.process_index()
        self.count = jax.process_count()
        self.client = distributed.global_state.client if self.count > 1 else None
        if self.count > 1 and self.client is None:
            raise RuntimeError("multi-process JAX without jax.distributed: cannot agree on batch sizes")
        self.prefix = f"rayslice/feed/{stream_id}"
        self.timeout_ms = max(1, int(timeout_s * 1000))
        self._last_step: int | None = None

    def handshake(self, meta: dict[str, Any]) -> list[dict[str, Any]]:
        """Posts this host's settings and column layout once, before its first
        count, and returns every host's (in process order): hosts compare them
        before the first step, and a host whose shard is empty learns the
        layout for its padding batches."""
        if self.client is None:
            return [meta]
        self.client.key_value_set(f"{self.prefix}/meta/{self.process}", json.dumps(meta))
        return [
            meta if p == self.process else json.loads(self._get(f"{self.prefix}/meta/{p}", p, "its settings"))
            for p in range(self.count)
        ]

    def abort(self, step: int | None, message: str) -> None:
        """Tells the other hosts this one failed, where they wait for it next
        (its settings when ``step`` is None, else its counts for ``step``), so
        they raise at once instead of waiting out the timeout."""
        if self.client is not None:
            key = f"{self.prefix}/meta/{self.process}" if step is None else f"{self.prefix}/{step}/{self.process}"
            try:
                self.client.key_value_set(key, json.dumps({"error": message}))
            except Exception:  # already posted: the others will time out and name this host
                pass

    def _get(self, key: str, p: int, what: str) -> str:
        try:
            return self.client.blocking_key_value_get(key, self.timeout_ms)  # type: ignore[union-attr]
        except Exception as e:  # the runtime raises its own XlaRuntimeError
            raise TimeoutError(
                f"host {p} did not report {what} within {self.timeout_ms / 1000:g} s (agreement_timeout_s): {e}"
            ) from e

    def exchange(self, step: int, mine: list[int], window: int) -> list[list[int]]:
        """Agrees on row counts for steps ``step .. step+window-1``.

        ``mine`` holds this host's row counts for those steps (shorter when its
        shard ends). Returns, per step, every host's count in process order (0
        for a host that has run out).
        """
        if self.client is None:
            return [[c] for c in mine] + [[0]] * (window - len(mine))
        self.client.key_value_set(f"{self.prefix}/{step}/{self.process}", json.dumps(mine))
        lists = []
        for p in range(self.count):
            if p == self.process:
                lists.append(mine)
                continue
            got = json.loads(self._get(f"{self.prefix}/{step}/{p}", p, f"its batches for step {step}"))
            if isinstance(got, dict):
                raise RuntimeError(f"host {p} stopped feeding at step {step}: {got.get('error')}")
            lists.append(got)
        if self._last_step is not None:
            # Every host has posted this window, so all have read the previous one.
            try:
                self.client.key_value_delete(f"{self.prefix}/{self._last_step}/{self.process}")
            except Exception:
                pass
        self._last_step = step
        return [[lst[j] if j < len(lst) else 0 for lst in lists] for j in range(window)]
