"""Host gangs on the simulated cluster: environment, one global JAX mesh, psum, failures."""

from __future__ import annotations

import os

import numpy as np
import pytest

import rayslice
from rayslice import GangError, Outcome, SliceGang, slice_placement_group
from rayslice.placement import PG_NAME_PREFIX

from .conftest import SLICE_A, SLICE_B, busy_host, live_groups

pytestmark = pytest.mark.ray


def _identity() -> dict:
    import jax

    ctx = rayslice.host_context()
    keys = (
        "TPU_WORKER_ID",
        "TPU_WORKER_HOSTNAMES",
        "TPU_NAME",
        "MEGASCALE_COORDINATOR_ADDRESS",
        "MEGASCALE_NUM_SLICES",
        "MEGASCALE_SLICE_ID",
        "MEGASCALE_PORT",
    )
    return {
        "env": {k: os.environ.get(k) for k in keys},
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "device_count": jax.device_count(),
        "local_device_count": jax.local_device_count(),
        "ctx": ctx,
    }


def _global_sum() -> float:
    # Each process contributes (rank + 1) on each local device; the sum crosses every host.
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = jax.make_mesh((jax.device_count(),), ("d",))
    local = np.full((jax.local_device_count(),), jax.process_index() + 1, np.float32)
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, PartitionSpec("d")), local)
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, PartitionSpec()))(x)
    return float(total.addressable_data(0))


def _echo_rank(batch: dict, k: int) -> tuple[int, float]:
    import jax
    import ray

    # An object ref inside the arguments reaches the host as a ref Ray still tracks.
    x = ray.get(batch["ref"][0]) if "ref" in batch else batch["x"]
    return jax.process_index(), float(np.sum(x)) * k


def test_psum_over_a_reserved_slice_and_ranks_follow_worker_ids(ray_cluster):
    with busy_host(SLICE_A, 0):
        with (
            slice_placement_group("2x2x2", "TPU-V4", timeout_s=30, progress=False) as spg,
            SliceGang(spg, init_timeout_s=90) as gang,
        ):
            assert spg.slices[0].name == SLICE_B
            out = gang.run(_identity, timeout_s=60)
            sums = gang.run(_global_sum, timeout_s=60)
            import ray

            one = ray.get(gang.run_async_on([1], _identity), timeout=60)  # that host alone
            # One serialization for every host; a call holding an object ref goes Ray's own way.
            packed = ray.get(gang.run_async_packed(_echo_rank, {"x": np.arange(3.0)}, k=2), timeout=60)
            ref = ray.put(np.arange(4))
            via_ray = ray.get(gang.run_async_packed(_echo_rank, {"ref": [ref]}, k=1), timeout=60)
            with pytest.raises(IndexError, match=r"ranks=\[2\] is not valid: expected ranks in 0..1"):
                gang.run_async_on([2], _identity)
    assert [o["process_index"] for o in one] == [1]
    assert [p[0] for p in packed] == [0, 1] and all(p[1] == 6.0 for p in packed)
    assert [v[0] for v in via_ray] == [0, 1] and all(v[1] == 6.0 for v in via_ray)
    assert [o["process_index"] for o in out] == [0, 1]
    assert [o["env"]["TPU_WORKER_ID"] for o in out] == ["0", "1"]
    assert all(o["process_count"] == 2 and o["device_count"] == 8 and o["local_device_count"] == 4 for o in out)
    assert [o["ctx"].worker_id for o in out] == [0, 1] and {o["ctx"].slice_name for o in out} == {SLICE_B}
    # Single slice: no multi-slice settings, whatever the node had.
    assert all(o["env"]["MEGASCALE_NUM_SLICES"] is None for o in out)
    assert sums == [12.0, 12.0]  # 4 devices x 1 + 4 devices x 2
    assert live_groups(PG_NAME_PREFIX) == []


def test_two_slices_form_one_mesh_with_consistent_megascale_env(ray_cluster):
    out = rayslice.run_on_slice(_identity, topology="2x2x2", accelerator_type="TPU-V4", num_slices=2, timeout_s=30)
    assert [o["process_index"] for o in out] == [0, 1, 2, 3]
    assert all(o["process_count"] == 4 and o["device_count"] == 16 for o in out)
    assert [(o["ctx"].slice_index, o["ctx"].worker_id) for o in out] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    coordinators = {o["env"]["MEGASCALE_COORDINATOR_ADDRESS"] for o in out}
    assert len(coordinators) == 1 and None not in coordinators
    assert [o["env"]["MEGASCALE_SLICE_ID"] for o in out] == ["0", "0", "1", "1"]
    assert {o["env"]["MEGASCALE_NUM_SLICES"] for o in out} == {"2"}
    assert {o["env"]["MEGASCALE_PORT"] for o in out} == {"8081"}
    # Hostnames list the hosts of each process's own slice.
    assert out[0]["env"]["TPU_WORKER_HOSTNAMES"] == out[1]["env"]["TPU_WORKER_HOSTNAMES"]
    assert out[0]["env"]["TPU_NAME"] != out[2]["env"]["TPU_NAME"]
    assert live_groups(PG_NAME_PREFIX) == []


def _fail_on_rank_1() -> int:
    ctx = rayslice.host_context()
    if ctx.rank == 1:
        raise ValueError(f"bad batch on rank {ctx.rank}")
    return ctx.rank


def test_user_exception_surfaces_with_its_message_and_nothing_leaks(ray_cluster):
    with pytest.raises(ValueError, match="bad batch on rank 1"):
        rayslice.run_on_slice(_fail_on_rank_1, topology="2x2x2", accelerator_type="TPU-V4", timeout_s=30)
    assert live_groups(PG_NAME_PREFIX) == []


def _die() -> None:
    if rayslice.host_context().rank == 1:
        os._exit(1)  # the process vanishes, as on a lost host


def test_lost_process_is_classified_preempted(ray_cluster):
    with (
        slice_placement_group("2x2x2", "TPU-V4", timeout_s=30, progress=False) as spg,
        SliceGang(spg, init_jax=False) as gang,
    ):
        with pytest.raises(GangError) as info:
            gang.run(_die, timeout_s=60)
    assert info.value.outcome is Outcome.PREEMPTED and info.value.rank == 1
    assert live_groups(PG_NAME_PREFIX) == []


# -- warm pool: processes started ahead, adopted by the next gang ------------------------------
def test_warm_pool_validates_and_starts_empty():
    from rayslice.errors import InvalidArgument
    from rayslice.warm import WarmPool

    with pytest.raises(InvalidArgument, match="imports='jax'"):
        WarmPool(imports="jax")
    with pytest.raises(InvalidArgument, match="optional_imports='optax'"):
        WarmPool(optional_imports="optax")
    pool = WarmPool()
    assert len(pool) == 0 and pool.node_ids == [] and pool.take("no-such-node") is None
    pool.shutdown()  # nothing to kill: idempotent


def test_warm_up_skips_optional_modules_that_are_not_installed_and_fails_on_required_ones():
    import gc
    import sys

    from rayslice.gang._process import _HostProcess

    proc = object.__new__(_HostProcess)  # the actor's body, without the actor (no SIGTERM handler installed here)
    proc._held, proc._ctx = None, None
    gc.unfreeze()
    try:
        assert proc.warm_up(["json"], ["no_such_module_rayslice", "csv"]) >= 0 and "csv" in sys.modules
        assert gc.get_freeze_count() > 0  # the imported modules are out of full collections' reach
        with pytest.raises(ModuleNotFoundError):
            proc.warm_up(["no_such_module_rayslice"])
    finally:
        gc.unfreeze()


def test_a_gang_adopts_warm_processes_on_its_hosts_and_they_form_the_mesh(ray_cluster):
    from rayslice.request import SliceRequest
    from rayslice.warm import WarmPool, spare_hosts

    from .test_train import _no_actors_left

    options = {"max_concurrency": 2}
    with busy_host(SLICE_A, 0), WarmPool(("jax",), options) as pool:
        request = SliceRequest.parse("2x2x2", "TPU-V4")
        from rayslice._deadline import Deadline

        wait = Deadline(30)  # an earlier test's released group may still count as used for a moment
        while len(spares := spare_hosts(request)) != 2:  # slice-a is busy: slice-b's hosts
            wait.sleep_or_raise(0.2, f"slice-b's 2 hosts to be free (spare hosts: {spares})")
        assert pool.warm(spares) == 2 and pool.warm(spares) == 0
        with (
            slice_placement_group(request, timeout_s=30, progress=False) as spg,
            SliceGang(spg, init_timeout_s=90, actor_options=options, warm=pool) as gang,
        ):
            assert spg.slices[0].name == SLICE_B and len(pool) == 0
            assert gang.timings["adopted"] == 2 and gang.timings["total_s"] >= gang.timings["init_s"]
            out = gang.run(_identity, timeout_s=60)
            sums = gang.run(_global_sum, timeout_s=60)
        # A pool with other actor options is not used: fresh processes.
        pool.warm(spares)
        with (
            slice_placement_group(request, timeout_s=30, progress=False) as spg,
            SliceGang(spg, init_timeout_s=90, warm=pool, init_jax=False) as gang,
        ):
            assert gang.timings["adopted"] == 0 and len(pool) == 2
    assert [o["env"]["TPU_WORKER_ID"] for o in out] == ["0", "1"] and [o["process_index"] for o in out] == [0, 1]
    assert [o["ctx"].worker_id for o in out] == [0, 1] and sums == [12.0, 12.0]
    assert live_groups(PG_NAME_PREFIX) == []
    assert _no_actors_left() == []  # waits up to 30 s for the warm processes to go
