"""slice_placement_group() on the simulated cluster: whole slices, never straddling, bounded, no leaks."""

from __future__ import annotations

import os
import time

import pytest

import rayslice
from rayslice import placement
from rayslice.errors import NoMatchingSlice, ReservationTimeout

from .conftest import SLICE_A, SLICE_B, busy_host, live_groups, wait_free

pytestmark = pytest.mark.ray


def _bundle_nodes(pg) -> list[str]:
    import ray

    table = ray.util.placement_group_table(pg)
    return [table["bundles_to_node_id"][i] for i in range(len(table["bundles"]))]


def _worker_node_ids(slice_name: str) -> list[str]:
    s = {x.name: x for x in rayslice.list_slices()}[slice_name]
    return [h.node_id for h in s.hosts]


def test_reserves_a_whole_slice_in_worker_order(ray_cluster):
    with rayslice.slice_placement_group("2x2x2", "TPU-V4", timeout_s=30, progress=False) as spg:
        assert spg.num_slices == 1 and spg.num_hosts == 2
        s = spg.slices[0]
        assert s.name in (SLICE_A, SLICE_B)
        assert [h.worker_id for h in s.hosts] == [0, 1] == [h.bundle_index for h in s.hosts]
        # Bundle i sits on worker i of that one slice.
        assert _bundle_nodes(s.placement_group) == _worker_node_ids(s.name) == [h.node_id for h in s.hosts]
        (group,) = live_groups(placement.PG_NAME_PREFIX)
        assert group.startswith(f"{placement.PG_NAME_PREFIX}{spg.name}:{s.name}:")
        # The slice now shows as busy to everyone, including Ray's own helpers.
        assert {x.name: x.state for x in rayslice.list_slices()}[s.name] == "busy"
        strategy = spg.scheduling_strategy(0, 1)
        assert strategy.placement_group_bundle_index == 1
    assert spg.released and live_groups(placement.PG_NAME_PREFIX) == []


def test_busy_host_sends_the_reservation_to_the_other_slice(ray_cluster):
    with busy_host(SLICE_A, 1):
        with rayslice.slice_placement_group("2x2x2", "TPU-V4", timeout_s=30, progress=False) as spg:
            s = spg.slices[0]
            assert s.name == SLICE_B
            assert set(_bundle_nodes(s.placement_group)) == set(_worker_node_ids(SLICE_B))
            assert not set(_bundle_nodes(s.placement_group)) & set(_worker_node_ids(SLICE_A))


def test_both_busy_times_out_naming_both_slices(ray_cluster):
    timeout_s = 3.0
    with busy_host(SLICE_A, 1), busy_host(SLICE_B, 0, chips=2):
        t0 = time.monotonic()
        with pytest.raises(ReservationTimeout) as info:
            rayslice.slice_placement_group("2x2x2", "TPU-V4", timeout_s=timeout_s, progress=False)
        took = time.monotonic() - t0
    assert timeout_s <= took <= timeout_s + 5
    msg = str(info.value)
    assert f"{SLICE_A}: busy: host 1 has 0/4 chips free" in msg
    assert f"{SLICE_B}: busy: host 0 has 2/4 chips free" in msg
    assert live_groups(placement.PG_NAME_PREFIX) == []


def test_missing_shape_fails_fast(ray_cluster):
    for topo, accel in (("4x4", "TPU-V6E"), ("2x2x4", "TPU-V4")):
        t0 = time.monotonic()
        with pytest.raises(NoMatchingSlice) as info:
            rayslice.slice_placement_group(topo, accel, timeout_s=60, progress=False)
        assert time.monotonic() - t0 < 5
        assert f"{SLICE_A}: other shape: TPU-V4 2x2x2" in str(info.value)
    assert live_groups(placement.PG_NAME_PREFIX) == []


def test_too_many_slices_fails_fast(ray_cluster):
    with pytest.raises(NoMatchingSlice, match="no 3 slice"):
        rayslice.slice_placement_group("2x2x2", "TPU-V4", num_slices=3, timeout_s=60, progress=False)


def test_two_slices_all_or_nothing(ray_cluster):
    with rayslice.slice_placement_group("2x2x2", "TPU-V4", num_slices=2, timeout_s=30, progress=False) as spg:
        assert sorted(s.name for s in spg.slices) == [SLICE_A, SLICE_B]
        assert [s.slice_index for s in spg.slices] == [0, 1]
        assert spg.num_hosts == 4
    # With one slice busy, a two-slice request holds nothing while it waits.
    with busy_host(SLICE_B, 1):
        with pytest.raises(ReservationTimeout):
            rayslice.slice_placement_group("2x2x2", "TPU-V4", num_slices=2, timeout_s=1.5, progress=False)
        assert live_groups(placement.PG_NAME_PREFIX) == []


def test_interrupt_while_waiting_leaves_nothing(ray_cluster):
    calls = []

    def interrupting_sleep(s: float) -> None:
        calls.append(s)
        raise KeyboardInterrupt

    with busy_host(SLICE_A, 0), busy_host(SLICE_B, 0):
        with pytest.raises(KeyboardInterrupt):
            rayslice.slice_placement_group(
                "2x2x2", "TPU-V4", timeout_s=30, progress=False, sleep=interrupting_sleep, name="interrupted"
            )
    assert calls and live_groups(placement.PG_NAME_PREFIX) == []
    # (Only this test's entry: another process may be waiting, or have died waiting, meanwhile.)
    assert [w for w in placement.waiting_reservations() if w["name"] == "interrupted"] == []


def test_the_wait_of_a_driver_that_died_waiting_is_dropped(ray_cluster):
    import subprocess
    import sys

    from ray.experimental.internal_kv import _internal_kv_get

    from rayslice import _progress
    from rayslice._deadline import Deadline

    info = {"name": "alive", "request": "1 x v4 2x2x2", "since_s": 4.0}
    _progress.publish_waiting("alive", info)
    # Another driver publishes its wait and dies without withdrawing it (as when killed mid-wait).
    code = (
        "import os, ray; from rayslice import _progress; ray.init(address=os.environ['ADDR'], log_to_driver=False); "
        "_progress.publish_waiting('died', {'name': 'died', 'request': '1 x v4 2x2x2', 'since_s': 1.0}); "
        "os._exit(0)"
    )
    subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, "ADDR": ray_cluster.address}, check=True, timeout=120
    )
    key = _progress._WAITING_KV_PREFIX + b"died"
    try:
        gone = Deadline(60)  # until the GCS notices the driver is gone
        while any(w["name"] == "died" for w in placement.waiting_reservations()):
            gone.sleep_or_raise(0.2, "the dead driver's wait is still listed")
        assert _internal_kv_get(key, namespace=_progress._KV_NAMESPACE) is None  # and deleted
        assert [w for w in placement.waiting_reservations() if w["name"] == "alive"] == [info]  # live: kept as is
    finally:
        _progress.publish_waiting("alive", None)
    assert [w for w in placement.waiting_reservations() if w["name"] == "alive"] == []


def test_lost_race_is_replanned(ray_cluster, monkeypatch):
    # A stale snapshot claims slice-a is free while another job holds a host:
    # the group for slice-a stays pending, is removed, and slice-b is taken.
    real = placement.list_slices
    with busy_host(SLICE_A, 1):
        stale = [s for s in real()]
        stale = [s if s.name != SLICE_A else _all_free(s) for s in stale]
        snapshots = iter([stale])
        monkeypatch.setattr(placement, "list_slices", lambda: next(snapshots, None) or real())
        with rayslice.slice_placement_group("2x2x2", "TPU-V4", timeout_s=30, race_window_s=0.5, progress=False) as spg:
            assert spg.slices[0].name == SLICE_B
        assert live_groups(placement.PG_NAME_PREFIX) == []


def _all_free(s):
    import dataclasses

    hosts = tuple(dataclasses.replace(h, chips_free=h.chips_total) for h in s.hosts)
    return dataclasses.replace(s, hosts=hosts)


def test_exception_inside_the_block_releases(ray_cluster):
    with pytest.raises(RuntimeError, match="user code"):
        with rayslice.slice_placement_group("2x2x2", "TPU-V4", timeout_s=30, progress=False):
            raise RuntimeError("user code")
    assert live_groups(placement.PG_NAME_PREFIX) == []


def test_explain_reports_every_slice(ray_cluster):
    wait_free(SLICE_A, SLICE_B)  # explain() is a snapshot: the previous test's release shows up a moment later
    with busy_host(SLICE_A, 1):
        plan = rayslice.explain("2x2x2", "TPU-V4")
    assert plan.ok and [s.name for s in plan.chosen] == [SLICE_B]
    assert plan.verdict(SLICE_A).reason == "busy: host 1 has 0/4 chips free"
    assert plan.verdict(SLICE_B).reason == "free"


def test_bad_request_names_the_value(ray_cluster):
    with pytest.raises(ValueError, match="'4x5' is not a v6e topology; valid: 1x1, 2x2"):
        rayslice.slice_placement_group("4x5", "TPU-V6E")
    with pytest.raises(ValueError, match="num_slices=0"):
        rayslice.slice_placement_group("2x2x2", "TPU-V4", num_slices=0)
    with pytest.raises(ValueError, match="must not contain ':'"):
        rayslice.slice_placement_group("2x2x2", "TPU-V4", name="a:b")
