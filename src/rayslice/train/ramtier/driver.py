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

    def prestart(self, node_ids: Sequence[str]) -> int:
        """Creates the stores of nodes a later attempt may run on (a restart's spare hosts); returns how many.

        A store's process then starts off the critical path: the attempt that runs there finds it up.
        """
        before = len(self.stores)
        for node_id in node_ids:
            self._create(node_id)
        return len(self.stores) - before

    def _create(self, node_id: str) -> str:
        """The name of the store of ``node_id``, created (not waited for) if missing."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from rayslice.gang import NAMESPACE

        name = store_name(self.run_id, node_id)
        if name not in self.stores:
            self.stores[name] = (
                ray.remote(RamStore)
                .options(
                    name=name,
                    namespace=NAMESPACE,
                    num_cpus=0,
                    max_concurrency=4,  # pings and inventories never queue behind a large put
                    max_restarts=0,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
                )
                .remote()
            )
            self.nodes[name] = node_id
            self.labels.setdefault(name, f"node {node_id[:8]}")
        return name

    def start_attempt(self, attempt: int, hosts: Sequence[Any]) -> list[dict[str, Any]]:
        """Creates the stores missing on the attempt's nodes; returns each rank's ``info["ram"]``.

        ``hosts`` are the gang's host contexts (rank order: ``node_id``,
        ``slice_index``, ``worker_id``, ``slice_name``, ``num_slices``, ``hosts_per_slice``).
        """
        import ray

        names = []
        for h in hosts:
            name = self._create(h.node_id)
            names.append(name)
            self.labels[name] = f"{h.slice_name} worker {h.worker_id}"
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
            self._retire_before(attempt)

    def _retire_before(self, attempt: int) -> None:
        """Kills the stores only earlier attempts used: a step of ``attempt`` is complete, theirs are obsolete.

        Their nodes may be gone unnoticed (the rest of a broken slice): a store kept would only make the next
        restore choice wait for its answer. Stores pre-started on spare hosts were never used and stay.
        """
        import ray

        current = {n for pair in self.placement.get(attempt, {}).values() for n in pair}
        earlier = {n for a, by_rank in self.placement.items() if a < attempt for pair in by_rank.values() for n in pair}
        for name in earlier - current:
            actor = self.stores.pop(name, None)
            if actor is None:
                continue
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                pass

    def meta(self, choice: RestoreChoice, timeout_s: float = 10.0) -> dict[str, Any] | None:
        """The metadata saved with a RAM ``choice`` (from the first store of its lowest rank that answers)."""
        import ray

        if choice.tier != "ram" or not choice.sources or choice.step is None:
            return None
        rank = min(choice.sources)
        for name in choice.sources[rank]:
            actor = self.stores.get(name)
            if actor is None:
                continue
            try:
                got = ray.get(actor.meta.remote(rank, choice.from_attempt, choice.step), timeout=timeout_s)
            except Exception:
                continue
            if got is not None:
                return dict(got)
        return None

    def answering(self, node_ids: Collection[str], timeout_s: float = 0.5) -> set[str]:
        """Those of ``node_ids`` whose store answers a ping within ``timeout_s`` (their host is up).

        A store is a process of its own on its host: when a gang process died,
        its store still answering tells a process that died alone (e.g. aborted
        with its collective) from a host that went down.
        """
        import ray

        asked = {n: self.stores[s].ping.remote() for s, n in self.nodes.items() if n in node_ids and s in self.stores}
        ready, _ = ray.wait(list(asked.values()), num_returns=len(asked), timeout=timeout_s) if asked else ([], [])
        up = set()
        for node, ref in asked.items():
            if ref in ready:
                try:
                    ray.get(ref)
                except Exception:
                    continue
                up.add(node)
        return up

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
