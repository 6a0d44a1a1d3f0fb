"""The driver's side of the RAM tier: creates the stores, books acknowledgements, asks for the restore choice.

Example:
    >>> tier = RamTier("ab12", every=2)  # no store yet: storage decides
    >>> tier.choose(world_size=2, storage_step=30, lost_nodes=()).reason
    'storage step 30'
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from rayslice.train.ramtier.choice import RestoreChoice, buddy_ranks, choose_restore
from rayslice.train.ramtier.store import RamStore, store_name

__all__ = ["PING_DEADLINE_S", "RamTier"]

#: Seconds the driver waits for a store that is not known lost to answer.
PING_DEADLINE_S = 1.0


class RamTier:
    """The driver's view of the RAM tier during one ``fit()``: stores, acknowledgements, the restore choice.

    Args:
        run_id: The ``fit()`` call's id (names the stores).
        every: ``CheckpointConfig.ram_every_steps``.
    """

    def __init__(self, run_id: str, every: int) -> None:
        self.run_id = run_id
        self.every = every
        self.stores: dict[str, Any] = {}  # name -> actor handle
        self.labels: dict[str, str] = {}  # name -> "slice-a worker 1"
        self.nodes: dict[str, str] = {}  # name -> node id
        self.placement: dict[int, dict[int, tuple[str, str]]] = {}  # attempt -> rank -> (primary, replica)
        self._acked: dict[int, dict[int, int]] = {}  # attempt -> rank -> newest step acknowledged by both stores
        self.complete: tuple[int, int] | None = None  # (attempt, step) every rank acknowledged
        self.peak_bytes = 0

    def start_attempt(self, attempt: int, hosts: Sequence[Any]) -> list[dict[str, Any]]:
        """Creates the stores missing on the attempt's nodes; returns each rank's ``info["ram"]``.

        ``hosts`` are the gang's host contexts (rank order: ``node_id``,
        ``slice_index``, ``worker_id``, ``slice_name``, ``num_slices``, ``hosts_per_slice``).
        """
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from rayslice.gang import NAMESPACE

        actor_cls = ray.remote(RamStore)
        names = []
        for h in hosts:
            name = store_name(self.run_id, h.node_id)
            names.append(name)
            self.labels[name] = f"{h.slice_name} worker {h.worker_id}"
            if name in self.stores:
                continue
            self.stores[name] = actor_cls.options(
                name=name,
                namespace=NAMESPACE,
                num_cpus=0,
                max_concurrency=4,  # pings and inventories never queue behind a large put
                max_restarts=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(h.node_id, soft=False),
            ).remote()
            self.nodes[name] = h.node_id
        ray.get([self.stores[n].ping.remote() for n in set(names)], timeout=60)
        first = hosts[0] if hosts else None
        buddies = buddy_ranks(
            [h.slice_index for h in hosts],
            [h.worker_id for h in hosts],
            first.num_slices if first else 1,
            first.hosts_per_slice if first else 1,
        )
        self.placement[attempt] = {r: (names[r], names[b]) for r, b in enumerate(buddies)}
        self._acked[attempt] = {}
        return [
            {"every": self.every, "primary": names[r], "replica": names[b] if b != r else None}
            for r, b in enumerate(buddies)
        ]

    def observe(self, attempt: int, rank: int, record: Mapping[str, Any]) -> None:
        """Books a host's step record (its ``ram_acked`` step, its store's bytes); pins newly complete steps."""
        self.peak_bytes = max(self.peak_bytes, int(record.get("ram_bytes") or 0))
        acked = record.get("ram_acked")
        if acked is None:
            return
        by_rank = self._acked.setdefault(attempt, {})
        by_rank[rank] = max(by_rank.get(rank, 0), int(acked))
        world = len(self.placement.get(attempt, {}))
        if len(by_rank) < world:
            return
        step = min(by_rank.values())
        if self.complete is None or (step, attempt) > (self.complete[1], self.complete[0]):
            self.complete = (attempt, step)
            # Every store, those of earlier attempts too: their entries are obsolete now.
            for store in self.stores.values():
                try:
                    store.pin.remote(attempt, step)  # fire and forget: pruning only
                except Exception:
                    pass

    def choose(
        self,
        world_size: int,
        storage_step: int | None,
        lost_nodes: Collection[str],
        deadline_s: float = PING_DEADLINE_S,
    ) -> RestoreChoice:
        """Asks every store still reachable what it holds, then :func:`choose_restore`."""
        import ray

        unreachable = {n: "its host was lost" for n, node in self.nodes.items() if node in lost_nodes}
        asked = {n: a.inventory.remote() for n, a in self.stores.items() if n not in unreachable}
        ready, _ = ray.wait(list(asked.values()), num_returns=len(asked), timeout=deadline_s) if asked else ([], [])
        holdings: dict[str, list[tuple[int, int, int, int]]] = {}
        for name, ref in asked.items():
            if ref not in ready:
                unreachable[name] = f"no answer within {deadline_s:g} s"
                continue
            try:
                inv = ray.get(ref)
            except Exception as e:
                unreachable[name] = f"unreachable ({type(e).__name__})"
                continue
            holdings[name] = [tuple(e) for e in inv["entries"]]
            self.peak_bytes = max(self.peak_bytes, int(inv.get("peak_bytes", 0)))
        for name in unreachable:  # never asked again
            self.stores.pop(name, None)
        return choose_restore(
            world_size=world_size,
            holdings=holdings,
            unreachable=unreachable,
            storage_step=storage_step,
            placement=self.placement,
            labels=self.labels,
            newest_ram=self.complete,
        )

    def close(self, deadline_s: float = 2.0) -> None:
        """Reads the stores' peak bytes, then kills every store. Idempotent."""
        import ray

        try:
            refs = [a.inventory.remote() for a in self.stores.values()]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=deadline_s)
            for ref in ready:
                try:
                    self.peak_bytes = max(self.peak_bytes, int(ray.get(ref).get("peak_bytes", 0)))
                except Exception:
                    pass
        except Exception:
            pass
        for a in self.stores.values():
            try:
                ray.kill(a, no_restart=True)
            except Exception:
                pass
        self.stores = {}
