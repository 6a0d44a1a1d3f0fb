"""The RAM stores: one Ray actor per node, holding its hosts' payloads and their buddies' replicas.

Example:
    >>> store_name("ab12", "f00d" * 14)
    'rayslice-ram/ab12/f00df00df00df00d'
    >>> s = RamStore()
    >>> for step in (2, 4, 6, 8, 10):
    ...     _ = s.put(0, 1, step, {"world_size": 1, "leaves": {}, "nbytes": 8})
    >>> [e[2] for e in s.inventory()["entries"]]  # nothing pinned yet: the four newest (MAX_KEPT)
    [4, 6, 8, 10]
    >>> _ = s.pin(1, 8)  # every rank completed step 8: older steps go
    >>> [e[2] for e in s.inventory()["entries"]]
    [8, 10]
"""

from __future__ import annotations

import threading
from typing import Any

from rayslice.train.ramtier.choice import MAX_KEPT, retained

__all__ = ["STORE_PREFIX", "RamStore", "store_name"]

#: Prefix of the stores' Ray actor names (namespace ``rayslice.gang.NAMESPACE``).
STORE_PREFIX = "rayslice-ram"


def store_name(run_id: str, node_id: str) -> str:
    """The Ray actor name of the RAM store of one node for one ``fit()``.

    Example:
        >>> store_name("ab12", "f00d" * 14)
        'rayslice-ram/ab12/f00df00df00df00d'
    """
    return f"{STORE_PREFIX}/{run_id}/{node_id[:16]}"


class RamStore:
    """Holds RAM checkpoint payloads of the hosts of one node and their buddies (run as a Ray actor).

    Payloads are copied into this process's heap (not kept as views of the
    object store), so they live as long as the store, whatever happens to the
    host that sent them.

    Example:
        >>> s = RamStore()
        >>> s.put(0, 1, 2, {"world_size": 1, "leaves": {}, "nbytes": 10})
        10
        >>> s.inventory()["entries"]
        [(0, 1, 2, 1)]
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[int, dict[tuple[int, int], dict[str, Any]]] = {}
        self._pin: tuple[int, int] | None = None
        self._peak = 0

    def ping(self) -> bool:
        return True

    def put(self, owner: int, attempt: int, step: int, payload: dict[str, Any]) -> int:
        """Keeps ``payload`` (a copy) for ``owner``; returns the bytes this store holds now."""
        payload = _deep_copy(payload)
        with self._lock:
            entries = self._data.setdefault(owner, {})
            entries[(attempt, step)] = payload
            self._prune(owner)
            held = self._bytes()
            self._peak = max(self._peak, held)
            return held

    def pin(self, attempt: int, step: int) -> int:
        """Every rank completed ``step`` of ``attempt``: older entries go. Returns the bytes held."""
        with self._lock:
            if self._pin is None or (step, attempt) > (self._pin[1], self._pin[0]):
                self._pin = (attempt, step)
            for owner in list(self._data):
                self._prune(owner)
            return self._bytes()

    def get(self, owner: int, attempt: int, step: int) -> dict[str, Any] | None:
        with self._lock:
            return self._data.get(owner, {}).get((attempt, step))

    def meta(self, owner: int, attempt: int, step: int) -> dict[str, Any] | None:
        """The metadata saved with a step (metrics, every host's data states), without its arrays."""
        with self._lock:
            payload = self._data.get(owner, {}).get((attempt, step))
            return None if payload is None else dict(payload.get("meta", {}))

    def inventory(self) -> dict[str, Any]:
        """``{"entries": [(owner, attempt, step, world size)], "bytes": held, "peak_bytes": peak}``."""
        with self._lock:
            entries = [
                (owner, a, s, int(p.get("world_size", 0)))
                for owner, by_key in sorted(self._data.items())
                for (a, s), p in sorted(by_key.items())
            ]
            return {"entries": entries, "bytes": self._bytes(), "peak_bytes": self._peak}

    def _prune(self, owner: int) -> None:
        entries = self._data.get(owner, {})
        # The pin (the step the driver saw complete everywhere) reaches each store at its own time and lags the
        # hosts: every step from it on may be the next one pinned, so a store keeps up to MAX_KEPT of them
        # (which also covers a buddy's late replica: no floor from the other owners is needed).
        keep = retained(entries, self._pin, keep=MAX_KEPT)
        for key in [k for k in entries if k not in keep]:
            del entries[key]
        if not entries:
            self._data.pop(owner, None)

    def _bytes(self) -> int:
        return sum(int(p.get("nbytes", 0)) for by_key in self._data.values() for p in by_key.values())


def _deep_copy(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _deep_copy(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return type(v)(_deep_copy(x) for x in v)
    copy = getattr(v, "copy", None)
    if callable(copy) and hasattr(v, "dtype"):  # a numpy array (maybe a read-only view of the object store)
        return copy()
    return v
