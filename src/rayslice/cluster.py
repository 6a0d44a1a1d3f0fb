"""What slices a live Ray cluster holds, and which of them are free.

The parsing from Ray's node records is a pure function (:func:`parse_slices`)
so that every rule here is tested without Ray; :func:`list_slices` is the thin
adapter that feeds it the connected cluster's records.

A slice is identified by the ``ray.io/tpu-slice-name`` label Ray puts on every
TPU host. Its expected host count comes from the topology catalog, with chips
per host read from the nodes themselves (``TPU`` resource), never guessed: a
v6e ``2x4`` built from two 4-chip VMs is a 2-host slice, from one 8-chip VM a
1-host slice.

Example:
    >>> nodes = [{"NodeID": "n0", "NodeManagerAddress": "10.0.0.1", "Alive": True,
    ...           "Resources": {"TPU": 4.0}, "Labels": {
    ...     "ray.io/tpu-slice-name": "s", "ray.io/tpu-worker-id": "0",
    ...     "ray.io/accelerator-type": "TPU-V4", "ray.io/tpu-topology": "2x2x1",
    ...     "ray.io/tpu-pod-type": "v4-8"}}]
    >>> [s.state for s in parse_slices(nodes, {"n0": {"TPU": 4.0}})]
    ['free']
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

from rayslice.topology import Topology

LABEL_SLICE = "ray.io/tpu-slice-name"
LABEL_WORKER_ID = "ray.io/tpu-worker-id"
LABEL_ACCELERATOR = "ray.io/accelerator-type"
LABEL_TOPOLOGY = "ray.io/tpu-topology"
LABEL_POD_TYPE = "ray.io/tpu-pod-type"


@dataclasses.dataclass(frozen=True)
class HostInfo:
    """One host (Ray node) of a slice."""

    worker_id: int
    node_id: str
    ip: str
    alive: bool
    chips_total: float
    chips_free: float
    # Other resources of the node (CPU, memory, custom): totals and what is free now.
    resources_total: Mapping[str, float] = dataclasses.field(default_factory=dict, compare=False)
    resources_free: Mapping[str, float] = dataclasses.field(default_factory=dict, compare=False)

    @property
    def is_free(self) -> bool:
        """Alive with all its chips available."""
        return self.alive and self.chips_total > 0 and self.chips_free >= self.chips_total

    @property
    def state(self) -> str:
        if not self.alive:
            return "dead"
        return "free" if self.is_free else "busy"


@dataclasses.dataclass(frozen=True)
class SliceInfo:
    """One slice seen in the cluster.

    ``hosts`` holds the most relevant record per worker id (an alive node
    before a dead one), ordered by worker id; ``missing_workers`` lists worker
    ids the topology expects that no node claims.
    """

    name: str
    accelerator_type: str
    topology: str
    pod_type: str
    chips_per_host: int
    hosts_expected: int
    hosts: tuple[HostInfo, ...]
    missing_workers: tuple[int, ...] = ()
    problem: str | None = None  # set when the labels do not describe a known slice

    @property
    def hosts_alive(self) -> int:
        return sum(h.alive for h in self.hosts)

    @property
    def is_complete(self) -> bool:
        """Every expected host is present and alive; only then is it usable."""
        return (
            self.problem is None
            and not self.missing_workers
            and self.hosts_alive == self.hosts_expected == len(self.hosts)
        )

    @property
    def is_free(self) -> bool:
        """Complete and no chip of any host is held by other work."""
        return self.is_complete and all(h.is_free for h in self.hosts)

    @property
    def chips_total(self) -> float:
        return sum(h.chips_total for h in self.hosts if h.alive)

    @property
    def chips_free(self) -> float:
        return sum(h.chips_free for h in self.hosts if h.alive)

    @property
    def state(self) -> str:
        """One of ``free``, ``busy``, ``incomplete``, ``unknown``."""
        if self.problem is not None:
            return "unknown"
        if not self.is_complete:
            return "incomplete"
        return "free" if self.is_free else "busy"

    def topology_info(self) -> Topology:
        """The catalog entry, with chips per host as the nodes report it."""
        return Topology.parse(self.topology, self.accelerator_type, chips_per_host=self.chips_per_host)


def _host_record(node: Mapping[str, Any], available: Mapping[str, Mapping[str, float]]) -> HostInfo:
    labels = node.get("Labels") or {}
    resources = node.get("Resources") or {}
    node_id = node["NodeID"]
    total = float(resources.get("TPU", 0.0))
    alive = bool(node.get("Alive"))
    others = {k: float(v) for k, v in resources.items() if k != "TPU" and not k.startswith("node:")}
    if not alive:
        free = 0.0
        others_free = {k: 0.0 for k in others}
    elif node_id not in available:
        # A node that has not reported its load yet was just provisioned:
        # treat its chips as free, as Ray's own slice helpers do.
        free = total
        others_free = dict(others)
    else:
        # Ray drops a resource from a node's available map when none is left.
        free = float(available[node_id].get("TPU", 0.0))
        others_free = {k: float(available[node_id].get(k, 0.0)) for k in others}
    return HostInfo(
        worker_id=int(labels[LABEL_WORKER_ID]),
        node_id=node_id,
        ip=node.get("NodeManagerAddress", ""),
        alive=alive,
        chips_total=total,
        chips_free=free,
        resources_total=others,
        resources_free=others_free,
    )


@functools.lru_cache(maxsize=1024)
def _expected_hosts(accel: str, topo_name: str, chips: int) -> tuple[int | None, str | None]:
    # Cached: a cluster has few distinct shapes but may have thousands of slices.
    try:
        return Topology.parse(topo_name, accel, chips_per_host=chips or None).num_hosts, None
    except ValueError as e:
        return None, str(e)


def _build_slice(name: str, records: list[tuple[Mapping[str, Any], HostInfo]]) -> SliceInfo:
    # Prefer the labels of alive nodes: a dead node may predate a pool change.
    records.sort(key=lambda r: (not r[1].alive, r[1].worker_id))
    labels = records[0][0].get("Labels") or {}
    accel = labels.get(LABEL_ACCELERATOR, "")
    topo_name = labels.get(LABEL_TOPOLOGY, "")
    pod_type = labels.get(LABEL_POD_TYPE, "")
    by_worker: dict[int, HostInfo] = {}
    for _, host in records:
        by_worker.setdefault(host.worker_id, host)  # alive ones come first
    hosts = tuple(by_worker[w] for w in sorted(by_worker))
    chips = max((int(h.chips_total) for h in hosts if h.chips_total), default=0)
    expected, problem = _expected_hosts(accel, topo_name, chips)
    if expected is None:
        expected = len(hosts)
    missing = tuple(w for w in range(expected) if w not in by_worker)
    return SliceInfo(
        name=name,
        accelerator_type=accel,
        topology=topo_name,
        pod_type=pod_type,
        chips_per_host=chips,
        hosts_expected=expected,
        hosts=hosts,
        missing_workers=missing,
        problem=problem,
    )


def parse_slices(
    nodes: Sequence[Mapping[str, Any]],
    available: Mapping[str, Mapping[str, float]],
) -> list[SliceInfo]:
    """Groups Ray node records into slices (pure; no Ray needed).

    Args:
        nodes: Records as ``ray.nodes()`` returns them (NodeID, Alive,
            NodeManagerAddress, Resources, Labels).
        available: Available resources per node id, for chips free.

    Returns:
        Slices sorted by name. Nodes without TPU slice labels are ignored.
    """
    grouped: dict[str, list[tuple[Mapping[str, Any], HostInfo]]] = {}
    for node in nodes:
        labels = node.get("Labels") or {}
        name = labels.get(LABEL_SLICE)
        if not name or LABEL_WORKER_ID not in labels:
            continue
        grouped.setdefault(name, []).append((node, _host_record(node, available)))
    return [_build_slice(name, recs) for name, recs in sorted(grouped.items())]


def apply_group_reservations(
    nodes: Sequence[Mapping[str, Any]],
    available: Mapping[str, Mapping[str, float]],
    groups: Mapping[str, Mapping[str, Any]],
) -> dict[str, dict[str, float]]:
    """Lowers each node's free TPU by what created placement groups hold there (pure).

    Ray's per-node availability reaches the control plane a little after a
    placement group is created; the group table is current at once. Taking
    the lower of the two keeps a just-reserved slice from looking free.

    Args:
        nodes: ``ray.nodes()`` records.
        available: Per-node available resources (possibly stale).
        groups: ``ray.util.placement_group_table()``.
    """
    held: dict[str, float] = {}
    for g in groups.values():
        if g.get("state") != "CREATED":
            continue
        bundles = g.get("bundles") or {}
        for index, node_id in (g.get("bundles_to_node_id") or {}).items():
            held[node_id] = held.get(node_id, 0.0) + float((bundles.get(index) or {}).get("TPU", 0.0))
    out = {k: dict(v) for k, v in available.items()}
    for node in nodes:
        node_id = node["NodeID"]
        if node_id not in held:
            continue
        total = float((node.get("Resources") or {}).get("TPU", 0.0))
        # Same reading as parse_slices: absent node = fresh (all free), absent key = none free.
        current = out[node_id].get("TPU", 0.0) if node_id in out else total
        out.setdefault(node_id, {})["TPU"] = max(0.0, min(current, total - held[node_id]))
    return out


def cluster_snapshot() -> tuple[list[dict[str, Any]], dict[str, dict[str, float]]]:
    """Node records and available resources of the connected Ray cluster."""
    import ray
    from ray._private.state import available_resources_per_node

    nodes = ray.nodes()
    # available_resources_per_node is what Ray's own TPU helpers use; there is
    # no public per-node availability API in Ray 2.60.
    available = available_resources_per_node()
    return nodes, apply_group_reservations(nodes, available, ray.util.placement_group_table())


def list_slices() -> list[SliceInfo]:
    """The slices of the connected Ray cluster.

    Example:
        >>> import rayslice
        >>> for s in rayslice.list_slices():  # doctest: +SKIP
        ...     print(s.name, s.state, s.hosts_alive, "/", s.hosts_expected)
    """
    nodes, available = cluster_snapshot()
    return parse_slices(nodes, available)


def autoscaler_can_add_nodes(status: Mapping[str, Any] | None) -> bool:
    """Whether an autoscaler status report comes from an autoscaler with node types (pure).

    Every Ray head runs a monitor that publishes a status report; without an
    autoscaling config (a plain ``ray start`` or the simulator) it uses a
    read-only provider whose node types are just ``node_<node id>``. An
    autoscaler that can launch nodes (KubeRay's, the cluster launcher's) names
    its configured types (``headgroup``, ``tpu-v6e-4x4`` ...).
    """
    if not status:
        return False
    mapping = (status.get("autoscaler_report") or {}).get("node_type_mapping") or {}
    return any(node_type != f"node_{node_id}" for node_id, node_type in mapping.items())


def autoscaler_configured() -> bool:
    """True when an autoscaler (e.g. KubeRay's) can add slices to this cluster."""
    from ray._private import ray_constants
    from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_initialized

    if not _internal_kv_initialized():
        return False
    raw = _internal_kv_get(ray_constants.DEBUG_AUTOSCALING_STATUS.encode())
    try:
        return autoscaler_can_add_nodes(json.loads(raw) if raw else None)
    except ValueError:
        return False
