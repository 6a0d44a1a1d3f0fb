"""Reservation benchmark: rayslice vs Ray 2.60's ray.util.tpu, same cluster, same run.

Measures the reserve -> ready -> release cycle of

* ``rayslice.slice_placement_group`` and
* ``ray.util.tpu.slice_placement_group`` with the arguments that make it
  correct for a multi-host shape (``strategy="STRICT_SPREAD"``: one bundle per
  host of the slice its head reservation found), waiting for its group to be
  ready, then ``shutdown()``;

interleaved (rayslice, Ray, rayslice, ...) so both see the same cluster state,
and planning time over 10,000 synthetic slices.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

from rayslice.cluster import HostInfo, SliceInfo, parse_slices
from rayslice.planning import plan
from rayslice.topology import Topology

GOAL_CYCLE_RATIO = 0.5
GOAL_PLAN_MS = 50.0


def rayslice_cycle(topology: str, accelerator: str) -> float:
    import rayslice

    t0 = time.perf_counter()
    spg = rayslice.slice_placement_group(topology, accelerator, timeout_s=60, progress=False)
    spg.release()
    return time.perf_counter() - t0


def ray_cycle(topology: str, accelerator: str) -> float:
    import ray
    from ray.util import tpu

    t0 = time.perf_counter()
    spg = tpu.slice_placement_group(topology, accelerator.lower().replace("tpu-", ""), strategy="STRICT_SPREAD")
    ray.get(spg.placement_group.ready(), timeout=60)
    spg.shutdown()
    return time.perf_counter() - t0


def _synthetic_slices(n: int, seed: int = 0) -> list[SliceInfo]:
    rng = random.Random(seed)
    shapes = [("TPU-V4", "2x2x2", "v4-16", 2), ("TPU-V6E", "4x4", "v6e-16", 4), ("TPU-V5P", "2x2x4", "v5p-32", 4)]
    out = []
    for i in range(n):
        accel, topo, pod, hosts = shapes[i % len(shapes)]
        hs = tuple(
            HostInfo(w, f"n{i}-{w}", "10.0.0.1", True, 4.0, 4.0 if rng.random() > 0.3 else 0.0) for w in range(hosts)
        )
        out.append(SliceInfo(f"s{i:05d}", accel, topo, pod, 4, hosts, hs))
    return out


def _synthetic_nodes(slices: list[SliceInfo]) -> tuple[list[dict[str, Any]], dict[str, dict[str, float]]]:
    nodes, avail = [], {}
    for s in slices:
        for h in s.hosts:
            nodes.append(
                {
                    "NodeID": h.node_id,
                    "Alive": True,
                    "NodeManagerAddress": h.ip,
                    "Resources": {"TPU": 4.0},
                    "Labels": {
                        "ray.io/tpu-slice-name": s.name,
                        "ray.io/tpu-worker-id": str(h.worker_id),
                        "ray.io/accelerator-type": s.accelerator_type,
                        "ray.io/tpu-topology": s.topology,
                        "ray.io/tpu-pod-type": s.pod_type,
                    },
                }
            )
            avail[h.node_id] = {"TPU": h.chips_free}
    return nodes, avail


def bench_planning(n: int = 10_000, repeats: int = 15) -> dict[str, float]:
    slices = _synthetic_slices(n)
    nodes, avail = _synthetic_nodes(slices)
    want = Topology.parse("v6e", "4x4")
    plan_s, full_s = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        p = plan(want, slices, num_slices=4)
        plan_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        p2 = plan(want, parse_slices(nodes, avail), num_slices=4)
        full_s.append(time.perf_counter() - t0)
    assert p.ok and [s.name for s in p.chosen] == [s.name for s in p2.chosen]
    return {
        "slices": n,
        "plan_ms": 1000 * statistics.median(plan_s),
        "parse_and_plan_ms": 1000 * statistics.median(full_s),
    }


def bench_cycle(topology: str = "2x2x2", accelerator: str = "TPU-V4", rounds: int = 15) -> dict[str, float]:
    # Warm both paths once (worker processes, code paths) before timing.
    rayslice_cycle(topology, accelerator)
    ray_cycle(topology, accelerator)
    ours, theirs = [], []
    for _ in range(rounds):
        ours.append(rayslice_cycle(topology, accelerator))
        theirs.append(ray_cycle(topology, accelerator))
    med_ours, med_theirs = statistics.median(ours), statistics.median(theirs)
    return {
        "rounds": rounds,
        "rayslice_ms": 1000 * med_ours,
        "ray_ms": 1000 * med_theirs,
        "ratio": med_ours / med_theirs,
        "rayslice_p90_ms": 1000 * sorted(ours)[int(0.9 * (rounds - 1))],
        "ray_p90_ms": 1000 * sorted(theirs)[int(0.9 * (rounds - 1))],
    }
