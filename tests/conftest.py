"""Shared fixtures: one simulated TPU cluster for the whole test session.

Starting Ray costs seconds of CPU on a 2-core machine, so every test that
needs Ray shares one ``SimulatedCluster`` of two v4 ``2x2x2`` slices
(``slice-a`` and ``slice-b``, 2 hosts x 4 chips each). Tests that break hosts
add their own slices first and never touch those two.
"""

from __future__ import annotations

import contextlib
import os

# Tests that use JAX in this process see 4 CPU devices, like one simulated host.
# Set before anything imports JAX; Ray worker processes get their own settings.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
# Ray's log deduplicator holds repeats of a driver notice back and prints them later, inside whichever
# test (or doctest, comparing stdout exactly) runs then: in one long test process, print them when they come.
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
from collections.abc import Iterator

import pytest
from hypothesis import settings

from rayslice.sim import SimulatedCluster, SliceSpec

# No per-example deadline: an example of pure logic that a full garbage collection or steal time on a
# loaded 2-core machine holds up past 200 ms is not a failure (Hypothesis would call it flaky).
settings.register_profile("rayslice", deadline=None)
settings.load_profile("rayslice")

SLICE_A, SLICE_B = "slice-a", "slice-b"


@pytest.fixture(scope="session")
def sim() -> Iterator[SimulatedCluster]:
    cluster = SimulatedCluster(
        [SliceSpec("TPU-V4", "2x2x2", name=SLICE_A), SliceSpec("TPU-V4", "2x2x2", name=SLICE_B)],
        head_cpus=2,
    )
    cluster.start()
    _pack_ray_data_tasks()
    try:
        yield cluster
    finally:
        cluster.shutdown()


def _pack_ray_data_tasks() -> None:
    """Ray Data's tasks fill a node before using the next one, instead of Ray Data's SPREAD.

    Every simulated node runs on the same two cores, so spreading a dataset's tasks over ten nodes
    only starts a pool of worker processes on each (measured: the first ``materialize`` of
    ``range(320).map_batches(f)`` on the test cluster took 34 s with 28 worker processes started,
    4.8 s with 11). Ray marks this setting deprecated, hence the warning filter.
    """
    import warnings

    import ray.data

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ray.data.DataContext.get_current().scheduling_strategy = "DEFAULT"


@pytest.fixture
def ray_cluster(sim: SimulatedCluster) -> Iterator[SimulatedCluster]:
    """The session cluster, checked to hold no rayslice placement group after each test."""
    yield sim
    assert live_groups() == [], "a test left placement groups behind"


def live_groups(prefix: str = "") -> list[str]:
    """Names of placement groups that are not removed."""
    import ray

    return sorted(
        g["name"]
        for g in ray.util.placement_group_table().values()
        if g["state"] != "REMOVED" and g["name"].startswith(prefix)
    )


def wait_free(*slice_names: str, timeout_s: float = 30.0) -> None:
    """Waits until Ray's resource view shows these slices free (a removed group's chips show up a moment later)."""
    import rayslice
    from rayslice._deadline import Deadline

    deadline = Deadline(timeout_s)
    while True:
        states = {s.name: s.state for s in rayslice.list_slices() if s.name in slice_names}
        if all(states.get(n) == "free" for n in slice_names):
            return
        deadline.sleep_or_raise(0.05, f"slices not free: {states}")


@contextlib.contextmanager
def busy_host(slice_name: str, worker_id: int, chips: float = 4) -> Iterator[None]:
    """Holds chips of one host with a placement group, as another job would."""
    import ray

    pg = ray.util.placement_group(
        [{"TPU": chips}],
        name=f"blocker:{slice_name}:{worker_id}",
        bundle_label_selector=[{"ray.io/tpu-slice-name": slice_name, "ray.io/tpu-worker-id": str(worker_id)}],
    )
    try:
        ray.get(pg.ready(), timeout=30)
        yield
    finally:
        ray.util.remove_placement_group(pg)


_EXIT_STATUS: list[int] = []


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _EXIT_STATUS.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Ends the test process with pytest's own status once everything is reported.

    The session cluster is shut down by then, but Ray's and XLA's native threads can still race
    the interpreter's finalization: a CI run whose 1,511 tests all passed ended in a segfault after
    the summary, failing ``make test``. Nothing is left to run at that point, so exit directly.
    """
    import sys

    if _EXIT_STATUS:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT_STATUS[-1])
