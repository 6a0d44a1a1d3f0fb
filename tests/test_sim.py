"""The simulated cluster on real Ray: fidelity to GKE TPU nodes, faults, clean shutdown."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import psutil
import pytest

import rayslice
from rayslice.sim import SliceSpec

from .conftest import SLICE_A, SLICE_B, wait_free

pytestmark = pytest.mark.ray


def _tpu_nodes(slice_name: str) -> list[dict]:
    import ray

    nodes = [n for n in ray.nodes() if n["Alive"] and n["Labels"].get("ray.io/tpu-slice-name") == slice_name]
    return sorted(nodes, key=lambda n: int(n["Labels"]["ray.io/tpu-worker-id"]))


def test_head_holds_no_tpu(ray_cluster):
    import ray

    heads = [n for n in ray.nodes() if n["Alive"] and "node:__internal_head__" in n["Resources"]]
    assert len(heads) == 1
    assert "TPU" not in heads[0]["Resources"]
    assert not any(k.startswith("ray.io/tpu") for k in heads[0]["Labels"])


@pytest.mark.parametrize("slice_name", [SLICE_A, SLICE_B])
def test_resources_and_labels_match_a_gke_tpu_host(ray_cluster, slice_name):
    nodes = _tpu_nodes(slice_name)
    assert [n["Labels"]["ray.io/tpu-worker-id"] for n in nodes] == ["0", "1"]
    for worker_id, n in enumerate(nodes):
        assert n["Resources"]["TPU"] == 4
        assert n["Resources"]["accelerator_type:TPU-V4"] == 1
        # Only worker 0 of a slice carries the pod-type head resource.
        assert ("TPU-v4-16-head" in n["Resources"]) == (worker_id == 0)
        labels = n["Labels"]
        assert labels["ray.io/accelerator-type"] == "TPU-V4"
        assert labels["ray.io/tpu-slice-name"] == slice_name
        assert labels["ray.io/tpu-topology"] == "2x2x2"
        assert labels["ray.io/tpu-pod-type"] == "v4-16"


def test_ray_tpu_helpers_count_the_simulated_slices(ray_cluster):
    from ray.util import tpu

    # Ray 2.60's own TPU helpers see our nodes as real slices.
    wait_free(SLICE_A, SLICE_B)  # a group an earlier test removed shows up free a moment later
    assert tpu.get_num_tpu_slices("2x2x2", "TPU-V4") == 2
    assert tpu.get_num_ready_tpu_slices("2x2x2", "TPU-V4") == 2
    assert tpu.get_num_tpu_slices("4x4", "TPU-V6E") == 0


def _env_and_devices() -> dict:
    import jax

    keys = ("TPU_NAME", "TPU_WORKER_ID", "TPU_ACCELERATOR_TYPE", "TPU_TOPOLOGY", "TPU_WORKER_HOSTNAMES")
    return {
        "env": {k: os.environ.get(k) for k in keys},
        "devices": jax.device_count(),
        "platform": jax.devices()[0].platform,
    }


def test_host_environment_and_jax_devices(ray_cluster):
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0)(_env_and_devices)
    nodes = _tpu_nodes(SLICE_B)
    refs = [
        task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote()
        for n in nodes
    ]
    out = ray.get(refs, timeout=120)
    for worker_id, r in enumerate(out):
        assert r["env"] == {
            "TPU_NAME": SLICE_B,
            "TPU_WORKER_ID": str(worker_id),
            "TPU_ACCELERATOR_TYPE": "v4-16",
            "TPU_TOPOLOGY": "2x2x2",
            "TPU_WORKER_HOSTNAMES": f"{SLICE_B}-w-0,{SLICE_B}-w-1",
        }
        # One CPU device per chip stands in for the host's TPU devices.
        assert (r["devices"], r["platform"]) == (4, "cpu")


def test_list_slices_sees_the_cluster(ray_cluster):
    wait_free(SLICE_A, SLICE_B)  # a group an earlier test removed shows up free a moment later
    by_name = {s.name: s for s in rayslice.list_slices()}
    for name in (SLICE_A, SLICE_B):
        s = by_name[name]
        assert (s.accelerator_type, s.topology, s.pod_type) == ("TPU-V4", "2x2x2", "v4-16")
        assert (s.hosts_alive, s.hosts_expected, s.state) == (2, 2, "free")
        assert [h.worker_id for h in s.hosts] == [0, 1]
        assert all(h.ip and h.chips_total == 4 == h.chips_free for h in s.hosts)


def _pid() -> int:
    return os.getpid()


def test_preempt_and_add_slice_are_reflected(ray_cluster, monkeypatch):
    sim = ray_cluster
    # A slice of its own (v6e 2x4 as two 4-chip hosts), so the shared ones stay intact.
    name = sim.add_slice(SliceSpec("v6e", "2x4", chips_per_host=4, name="victim"))
    s = {x.name: x for x in rayslice.list_slices()}[name]
    assert (s.state, s.hosts_alive, s.hosts_expected, s.chips_per_host) == ("free", 2, 2, 4)

    # A process running on the host dies with it, as on a preempted VM (not when it notices its raylet is gone).
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from rayslice._deadline import Deadline

    node = sim.slices[name].hosts[1].node_id
    pid = ray.get(
        ray.remote(num_cpus=0)(_pid)
        .options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
        .remote()
    )
    worker = psutil.Process(pid)
    import rayslice.sim as sim_module

    killed: list[int] = []
    kill = sim_module._kill_pids
    monkeypatch.setattr(sim_module, "_kill_pids", lambda pids: (killed.extend(pids), kill(pids)))
    sim.preempt_host(name, 1, wait=False)
    assert pid in killed  # SIGKILLed with the node, not left to notice that its raylet is gone
    gone = Deadline(10)  # how fast the kernel tears it down depends on the machine's load
    while True:
        try:
            if not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:  # reaped between the two reads
            break
        gone.sleep_or_raise(0.01, "the host's worker process outlived its host")
    ray_sees = Deadline(30)
    while (s := {x.name: x for x in rayslice.list_slices()}[name]).state != "incomplete":
        ray_sees.sleep_or_raise(0.1, "Ray never declared the preempted host dead")
    assert s.state == "incomplete" and not s.is_complete
    assert [(h.worker_id, h.alive) for h in s.hosts] == [(0, True), (1, False)]
    # Incomplete slices are never usable.
    plan = rayslice.explain("2x4", "v6e", chips_per_host=4)
    assert not plan.ok and "dead host(s) 1" in plan.verdict(name).reason

    sim.preempt_slice(name)
    s = {x.name: x for x in rayslice.list_slices()}[name]
    assert s.hosts_alive == 0 and s.state == "incomplete"

    # The node pool brings up a replacement slice.
    new = sim.add_slice(SliceSpec("v6e", "2x4", chips_per_host=4))
    assert new != name
    s = {x.name: x for x in rayslice.list_slices()}[new]
    assert (s.state, s.hosts_alive) == ("free", 2)
    sim.preempt_slice(new)  # leave no v6e capacity for later tests


def test_preempt_rejects_unknown_hosts(ray_cluster):
    with pytest.raises(ValueError, match="no slice 'nope'; slices: .*slice-a"):
        ray_cluster.preempt_host("nope", 0)
    with pytest.raises(ValueError, match=r"worker_id 7 is not in slice 'slice-a'; valid: 0\.\.1"):
        ray_cluster.preempt_host(SLICE_A, 7)


_LIFECYCLE = textwrap.dedent("""
    import json, psutil, sys
    from rayslice.sim import SimulatedCluster, SliceSpec
    with SimulatedCluster([SliceSpec("v4", "2x2x1")], object_store_mb=80) as sim:
        assert sim.num_hosts == 1
        pids = [p.pid for p in psutil.Process().children(recursive=True)]
        temp = sim._temp_dir
    print(json.dumps({"pids": pids, "temp": temp}))
""")


@pytest.mark.slow
def test_no_ray_process_left_after_shutdown():
    # Its own cluster, in its own process, so the check sees only that cluster's processes.
    out = subprocess.run(
        [sys.executable, "-c", _LIFECYCLE],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    info = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(info["pids"]) >= 3  # gcs, raylets, workers ...
    alive = [p for p in info["pids"] if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert alive == [], f"processes left behind: {alive}"
    assert not os.path.exists(info["temp"])
