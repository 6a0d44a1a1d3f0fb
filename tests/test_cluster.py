"""Tests for rayslice.cluster.parse_slices (pure; no Ray cluster).

Node records are built by :func:`node`, shaped like ``ray.nodes()`` output.
"""

from __future__ import annotations

import doctest
import random

import pytest

from rayslice import cluster as cluster_mod
from rayslice.cluster import HostInfo, parse_slices

# Labels Ray 2.60 puts on the hosts of each shape (accelerator type, topology, pod type).
V4_2X2X2 = ("TPU-V4", "2x2x2", "v4-16")  # 2 hosts x 4 chips
V4_2X2X1 = ("TPU-V4", "2x2x1", "v4-8")  # 1 host x 4 chips
V6E_2X4 = ("TPU-V6E", "2x4", "v6e-8")  # 1 x 8 chips or 2 x 4 chips
V6E_4X4 = ("TPU-V6E", "4x4", "v6e-16")  # 4 hosts x 4 chips


def node(
    slice_name: str | None,
    worker_id: int | None,
    shape: tuple[str, str, str] = V4_2X2X2,
    *,
    chips: float = 4.0,
    alive: bool = True,
    node_id: str | None = None,
    ip: str | None = None,
) -> dict:
    """One ``ray.nodes()`` record; ``slice_name=None`` makes a non-TPU (head) node."""
    accel, topo, pod = shape
    node_id = node_id or f"{slice_name}-n{worker_id}"
    labels: dict[str, str] = {"ray.io/node-id": node_id}
    resources: dict[str, float] = {"CPU": 2.0, "memory": 1e9}
    if slice_name is not None:
        labels["ray.io/tpu-slice-name"] = slice_name
        labels["ray.io/accelerator-type"] = accel
        labels["ray.io/tpu-topology"] = topo
        labels["ray.io/tpu-pod-type"] = pod
        if worker_id is not None:
            labels["ray.io/tpu-worker-id"] = str(worker_id)
        resources["TPU"] = chips
        resources[f"accelerator_type:{accel}"] = 1.0
    return {
        "NodeID": node_id,
        "Alive": alive,
        "NodeManagerAddress": ip or f"10.0.{worker_id or 0}.1",
        "Resources": resources,
        "Labels": labels,
    }


def free_of(nodes: list[dict]) -> dict[str, dict[str, float]]:
    """``available`` with every alive node's chips free."""
    return {n["NodeID"]: dict(n["Resources"]) for n in nodes if n["Alive"]}


def one(slices, name):
    (s,) = [s for s in slices if s.name == name]
    return s


def test_groups_by_slice_name_and_orders_hosts_by_worker_id():
    nodes = [
        node("b", 1),
        node("a", 1),
        node("b", 0),
        node("a", 0),
    ]
    random.Random(7).shuffle(nodes)
    slices = parse_slices(nodes, free_of(nodes))
    assert [s.name for s in slices] == ["a", "b"]
    for s in slices:
        assert [h.worker_id for h in s.hosts] == [0, 1]
        assert [h.node_id for h in s.hosts] == [f"{s.name}-n0", f"{s.name}-n1"]
        assert [h.ip for h in s.hosts] == ["10.0.0.1", "10.0.1.1"]
        assert (s.accelerator_type, s.topology, s.pod_type) == V4_2X2X2
        assert (s.chips_per_host, s.hosts_expected, s.missing_workers) == (4, 2, ())
        assert s.problem is None
        assert s.state == "free" and s.is_complete and s.is_free
        assert (s.chips_total, s.chips_free, s.hosts_alive) == (8.0, 8.0, 2)


def test_hosts_ordered_numerically_not_as_strings():
    nodes = [node("big", w, V6E_4X4) for w in (3, 10, 2, 0, 1)]
    (s,) = parse_slices(nodes, free_of(nodes))
    assert [h.worker_id for h in s.hosts] == [0, 1, 2, 3, 10]


def test_host_records_carry_node_fields():
    n = node("s", 0, V4_2X2X1, node_id="abc", ip="192.168.1.9")
    (s,) = parse_slices([n], {"abc": {"TPU": 3.0}})
    assert s.hosts == (
        HostInfo(worker_id=0, node_id="abc", ip="192.168.1.9", alive=True, chips_total=4.0, chips_free=3.0),
    )


def test_nodes_without_tpu_labels_are_ignored():
    head = node(None, None, node_id="head")
    no_worker_id = node("orphan", None)  # a slice label but no worker id
    empty_labels = {
        "NodeID": "x",
        "Alive": True,
        "NodeManagerAddress": "1.2.3.4",
        "Resources": {"CPU": 1.0},
        "Labels": {},
    }
    no_labels_key = {"NodeID": "y", "Alive": True, "NodeManagerAddress": "1.2.3.5", "Resources": {"CPU": 1.0}}
    hosts = [node("s", 0, V4_2X2X1)]
    nodes = [head, no_worker_id, empty_labels, no_labels_key, *hosts]
    slices = parse_slices(nodes, free_of(nodes))
    assert [s.name for s in slices] == ["s"]
    assert [h.node_id for h in slices[0].hosts] == ["s-n0"]


def test_no_tpu_nodes_gives_no_slices():
    assert parse_slices([node(None, None, node_id="head")], {}) == []
    assert parse_slices([], {}) == []


def test_slice_with_dead_host_is_incomplete():
    nodes = [node("s", 0), node("s", 1, alive=False)]
    (s,) = parse_slices(nodes, free_of(nodes))
    assert s.state == "incomplete"
    assert not s.is_complete and not s.is_free
    assert s.hosts_alive == 1 and s.hosts_expected == 2
    assert [h.state for h in s.hosts] == ["free", "dead"]
    assert s.hosts[1].chips_free == 0.0
    # Only alive hosts count toward the slice's chips.
    assert (s.chips_total, s.chips_free) == (4.0, 4.0)


def test_dead_host_reports_no_free_chips_even_if_listed_available():
    nodes = [node("s", 0, V4_2X2X1, alive=False)]
    (s,) = parse_slices(nodes, {"s-n0": {"TPU": 4.0}})
    assert s.hosts[0].chips_free == 0.0
    assert s.state == "incomplete"


def test_missing_worker_is_reported_and_slice_incomplete():
    nodes = [node("s", w, V6E_4X4) for w in (0, 1, 3)]
    (s,) = parse_slices(nodes, free_of(nodes))
    assert s.hosts_expected == 4
    assert s.missing_workers == (2,)
    assert [h.worker_id for h in s.hosts] == [0, 1, 3]
    assert s.state == "incomplete"
    assert not s.is_complete


def test_replaced_host_uses_the_alive_record():
    old = node("s", 1, alive=False, node_id="old-1", ip="10.9.9.9")
    new = node("s", 1, node_id="new-1", ip="10.0.1.2")
    for order in ([node("s", 0), old, new], [new, node("s", 0), old]):
        (s,) = parse_slices(order, free_of(order))
        assert [h.node_id for h in s.hosts] == ["s-n0", "new-1"]
        assert s.hosts[1].ip == "10.0.1.2" and s.hosts[1].alive
        assert s.missing_workers == ()
        assert s.state == "free" and s.is_complete


def test_labels_taken_from_alive_node_over_dead_one():
    # A dead node predating a pool change carries stale labels.
    stale = node("s", 0, V4_2X2X2, alive=False, node_id="stale")
    live = node("s", 0, V4_2X2X1, node_id="live")
    (s,) = parse_slices([stale, live], free_of([live]))
    assert (s.topology, s.pod_type, s.hosts_expected) == ("2x2x1", "v4-8", 1)
    assert s.state == "free"


def test_chips_free_from_available_and_busy_host():
    nodes = [node("s", 0), node("s", 1)]
    available = {"s-n0": {"TPU": 4.0, "CPU": 2.0}, "s-n1": {"TPU": 1.0, "CPU": 2.0}}
    (s,) = parse_slices(nodes, available)
    assert [h.chips_free for h in s.hosts] == [4.0, 1.0]
    assert [h.state for h in s.hosts] == ["free", "busy"]
    assert s.state == "busy"
    assert s.is_complete and not s.is_free
    assert (s.chips_total, s.chips_free) == (8.0, 5.0)


def test_fully_busy_host_whose_tpu_key_is_absent_from_available_is_busy():
    nodes = [node("s", 0, V4_2X2X1)]
    (s,) = parse_slices(nodes, {"s-n0": {"CPU": 2.0}})  # node reported, no TPU left
    assert s.hosts[0].chips_free == 0.0
    assert s.state == "busy"


def test_node_absent_from_available_counts_as_free():
    nodes = [node("s", 0), node("s", 1)]
    (s,) = parse_slices(nodes, {"s-n0": {"TPU": 4.0}})  # s-n1 just provisioned
    assert [h.chips_free for h in s.hosts] == [4.0, 4.0]
    assert s.state == "free"


def test_v6e_2x4_from_two_4_chip_hosts_is_two_hosts():
    nodes = [node("s", 0, V6E_2X4, chips=4.0), node("s", 1, V6E_2X4, chips=4.0)]
    (s,) = parse_slices(nodes, free_of(nodes))
    assert (s.chips_per_host, s.hosts_expected) == (4, 2)
    assert s.state == "free"
    assert s.topology_info().num_hosts == 2
    assert s.topology_info().chips_per_host == 4


def test_v6e_2x4_from_one_8_chip_host_is_one_host():
    nodes = [node("s", 0, V6E_2X4, chips=8.0)]
    (s,) = parse_slices(nodes, free_of(nodes))
    assert (s.chips_per_host, s.hosts_expected) == (8, 1)
    assert s.state == "free"
    assert s.topology_info().num_hosts == 1


def test_v6e_2x4_one_of_two_4_chip_hosts_missing():
    nodes = [node("s", 0, V6E_2X4, chips=4.0)]
    (s,) = parse_slices(nodes, free_of(nodes))
    assert (s.hosts_expected, s.missing_workers, s.state) == (2, (1,), "incomplete")


def test_unknown_topology_label_is_state_unknown_with_problem():
    nodes = [node("s", 0, ("TPU-V4", "3x3x3", "v4-54"))]
    (s,) = parse_slices(nodes, free_of(nodes))
    assert s.state == "unknown"
    assert s.problem is not None
    assert s.problem.startswith("'3x3x3' is not a v4 topology; valid: 2x2x1, 2x2x2")
    assert not s.is_complete and not s.is_free
    # Without a catalog entry, the hosts present are all that is expected.
    assert (s.hosts_expected, s.missing_workers) == (1, ())


def test_unknown_accelerator_label_is_state_unknown():
    nodes = [node("s", 0, ("TPU-V99", "2x2", "v99-4"))]
    (s,) = parse_slices(nodes, free_of(nodes))
    assert s.state == "unknown"
    assert "'TPU-V99' is not a known TPU generation" in s.problem


def test_impossible_chips_per_host_is_state_unknown():
    # A v6e 4x4 cannot be built from 8-chip hosts.
    nodes = [node("s", w, V6E_4X4, chips=8.0) for w in range(2)]
    (s,) = parse_slices(nodes, free_of(nodes))
    assert s.state == "unknown"
    assert s.problem == "chips_per_host=8 is not possible for v6e 4x4; valid: 4"


def test_slices_sorted_by_name():
    names = ["zeta", "alpha", "m-2", "m-10", "beta"]
    nodes = [node(n, 0, V4_2X2X1) for n in names]
    slices = parse_slices(nodes, free_of(nodes))
    assert [s.name for s in slices] == sorted(names) == ["alpha", "beta", "m-10", "m-2", "zeta"]


def test_mixed_cluster_states():
    nodes = [
        node(None, None, node_id="head"),
        node("busy", 0),
        node("busy", 1),
        node("dead", 0),
        node("dead", 1, alive=False),
        node("free", 1),
        node("free", 0),
        node("gap", 0, V6E_4X4),
        node("gap", 3, V6E_4X4),
        node("odd", 0, ("TPU-V4", "1x1", "v4-2")),
    ]
    available = free_of(nodes)
    available["busy-n0"] = {"TPU": 0.0}
    states = {s.name: s.state for s in parse_slices(nodes, available)}
    assert states == {"busy": "busy", "dead": "incomplete", "free": "free", "gap": "incomplete", "odd": "unknown"}


def test_module_doctests():
    result = doctest.testmod(cluster_mod)
    assert result.failed == 0
    assert result.attempted > 0


@pytest.mark.parametrize(
    "chips,free,state",
    [
        (4.0, 4.0, "free"),
        (4.0, 3.5, "busy"),
        (4.0, 0.0, "busy"),
        (0.0, 0.0, "busy"),
    ],
)
def test_host_state(chips, free, state):
    h = HostInfo(0, "n", "ip", True, chips, free)
    assert h.state == state
    assert HostInfo(0, "n", "ip", False, chips, free).state == "dead"
