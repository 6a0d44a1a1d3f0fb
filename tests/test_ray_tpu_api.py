"""A ray.util.tpu user's script, with only the import changed, on the simulated cluster.

Each test uses rayslice the way Ray's documentation and tests use
``ray.util.tpu``: Ray's argument names, call forms and return types.
"""

from __future__ import annotations

import time

import pytest

from rayslice import SlicePlacementGroup, run_on_slice, slice_placement_group
from rayslice.errors import InvalidArgument, NoMatchingSlice

from .conftest import SLICE_A, SLICE_B, live_groups, wait_free

pytestmark = pytest.mark.ray


def _wait_for(condition, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


class _Where:
    def node(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()


def _hostname_task():
    import ray

    @ray.remote
    def where(tag=None):
        import os

        return (ray.get_runtime_context().get_node_id(), os.environ.get("TPU_WORKER_ID"), tag)

    return where


def test_handle_constructed_like_rays_reserves_and_exposes_rays_properties(ray_cluster):
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    handle = SlicePlacementGroup(topology="2x2x2", accelerator_version="v4")
    try:
        pg = handle.slice_placement_group
        assert pg is handle.placement_group
        ray.get(pg.ready(), timeout=10)
        assert (handle.num_hosts, handle.num_bundles, handle.num_slices) == (2, 2, 1)
        assert (handle.chips_per_host, handle.devices_per_host) == (4, 4)
        assert handle.accelerator_version == "v4" and handle.topology.name == "2x2x2"
        assert handle.bundle_resources == {"TPU": 4.0}
        assert handle.head_placement_groups == []
        handle.release_head_pgs()  # a no-op, as Ray's after ready()
        with pytest.raises(ValueError, match="pg_per_slice=False"):
            handle.slice_placement_groups  # noqa: B018 - Ray's handle refuses this too
        # Actors hold their chips while they live, so two of them need both hosts' bundles
        # (short tasks could run one after the other on the same bundle).
        where = ray.remote(_Where)
        actors = [
            where.options(
                num_cpus=0,
                resources={"TPU": 4},
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg),
            ).remote()
            for _ in range(handle.num_hosts)
        ]
        nodes = ray.get([a.node.remote() for a in actors], timeout=60)
        for a in actors:
            ray.kill(a)
        assert len(set(nodes)) == 2  # one per host of the slice
    finally:
        handle.shutdown()
    handle.shutdown()  # idempotent
    assert live_groups("rayslice:") == []


def test_pg_per_slice_two_slices_and_rays_bundle_resources(ray_cluster):
    spg = slice_placement_group(
        topology="2x2x2",
        accelerator_version="v4",
        num_slices=2,
        pg_per_slice=True,
        resources_per_bundle={"TPU": 4, "CPU": 0},
    )
    try:
        assert len(spg.slice_placement_groups) == 2 and spg.num_bundles == 4
        assert sorted(s.name for s in spg.slices) == [SLICE_A, SLICE_B]
        with pytest.raises(ValueError, match="pg_per_slice=True"):
            spg.slice_placement_group  # noqa: B018
        assert len(spg.bundle_label_selector) == 4
    finally:
        spg.shutdown()


def test_run_on_slice_with_a_remote_function_returns_object_refs_and_releases(ray_cluster):
    import ray

    where = _hostname_task()
    refs = run_on_slice(where, topology="2x2x2", accelerator_version="v4", tag="x")
    assert all(isinstance(r, ray.ObjectRef) for r in refs) and len(refs) == 2
    results = ray.get(refs, timeout=60)
    assert [w for _, w, _ in results] == ["0", "1"] and {t for _, _, t in results} == {"x"}
    # The slice it reserved for itself is released once the tasks are done.
    assert _wait_for(lambda: live_groups("rayslice:") == [])


def test_run_on_slice_on_a_held_slice_leaves_it_held(ray_cluster):
    import ray

    where = _hostname_task()
    handle = slice_placement_group(topology="2x2x2", accelerator_version="v4", num_slices=2, pg_per_slice=True)
    try:
        first = ray.get(run_on_slice(where, tpu_slice=handle), timeout=60)
        second = ray.get(run_on_slice(where, tpu_slice=handle, slice_index=1), timeout=60)
        assert len(first) == 4 and len(second) == 2
        assert {n for n, _, _ in second} == {h.node_id for h in handle.slices[1].hosts}
        assert len(live_groups("rayslice:")) == 2  # still held: the caller releases it
        # A plain function on the held slice: a gang with jax.distributed, results back.
        counts = run_on_slice(_device_count, tpu_slice=handle, slice_index=0)
        assert counts == [8, 8]
    finally:
        handle.shutdown()
    with pytest.raises(InvalidArgument, match="still held"):
        run_on_slice(where, tpu_slice=handle)


def _device_count():
    import jax

    return jax.device_count()


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        (dict(), "topology=None"),
        (dict(topology="2x2x2", accelerator_version="v4", slice_index=0), "slice_index=0"),
        (dict(topology="2x2x2", accelerator_version="v4", chips_per_vm=3), "chips_per_host=3"),
        (dict(topology="2x2x2", accelerator_version="v4", timeout_s=-1), "timeout_s=-1"),
    ],
)
def test_run_on_slice_bad_arguments_fail_before_reserving(ray_cluster, kwargs, named):
    with pytest.raises(InvalidArgument, match=named):
        run_on_slice(_hostname_task(), **kwargs)
    assert live_groups("rayslice:") == []


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        (dict(race_window_s=0), "race_window_s=0"),
        (dict(race_window_s=-1), "race_window_s=-1"),
        (dict(timeout_s="5"), "timeout_s='5'"),
        (dict(num_slices="2"), "num_slices='2'"),
        (dict(num_slices=1.5), "num_slices=1.5"),
        (dict(resources_per_host={"CPU": -1}), "resources_per_host['CPU']=-1"),
        (dict(resources_per_bundle={"TPU": 1}), "'TPU': 4"),
        (dict(strategy="STRICT_PACK"), "strategy='STRICT_PACK'"),
        (dict(strategy="DIAGONAL"), "strategy='DIAGONAL'"),
        (dict(lifetime="forever"), "lifetime='forever'"),
        (dict(name="a:b"), "name='a:b'"),
        (dict(bundle_label_selector=[{"a": "1"}] * 3), "bundle_label_selector"),
        (dict(tpu_resource_per_chip=2), "tpu_resource_per_chip=2"),
    ],
)
def test_bad_reservation_arguments_name_the_value_and_create_nothing(ray_cluster, kwargs, named):
    with pytest.raises(InvalidArgument, match=named.replace("[", r"\[").replace("(", r"\(")):
        slice_placement_group("2x2x2", "v4", timeout_s=kwargs.pop("timeout_s", 5), progress=False, **kwargs)
    assert live_groups("rayslice:") == []


def test_resources_no_host_can_hold_fail_fast_with_the_reason(ray_cluster):
    start = time.monotonic()
    with pytest.raises(NoMatchingSlice) as e:
        slice_placement_group("2x2x2", "v4", resources_per_host={"CPU": 100}, timeout_s=60, progress=False)
    assert time.monotonic() - start < 30  # not the whole timeout
    assert "too small: host 0 has 2 CPU in total, request wants 100 per host" in str(e.value)
    with pytest.raises(NoMatchingSlice, match="no 'no-such-thing' resource"):
        slice_placement_group("2x2x2", "v4", resources_per_host={"no-such-thing": 1}, timeout_s=60, progress=False)
    assert live_groups("rayslice:") == []


def test_timeout_zero_takes_a_free_slice_and_extra_resources_are_held(ray_cluster):
    wait_free(SLICE_A, SLICE_B)  # timeout_s=0 takes only a slice free now: not one Ray still shows busy
    with slice_placement_group("2x2x2", "v4", timeout_s=0, resources_per_host={"CPU": 1}, progress=False) as spg:
        assert spg.bundle_resources == {"TPU": 4.0, "CPU": 1.0}
        assert spg.request.resources_per_host == {"CPU": 1.0}
    assert live_groups("rayslice:") == []
