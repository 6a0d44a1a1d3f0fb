"""The rayslice command, run as a user runs it (a subprocess)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

import rayslice
from rayslice.errors import ReservationTimeout

from .conftest import SLICE_A, SLICE_B, busy_host

RAYSLICE = [sys.executable, "-m", "rayslice.cli"]


def run(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*RAYSLICE, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "COLUMNS": "200", **(env or {})},
    )


def test_topology_facts():
    out = run("topology", "v6e", "4x4")
    assert out.returncode == 0, out.stderr
    for fact in ("TPU-V6E", "v6e-16", "TPU-v6e-16-head", "tpu-v6e-slice", "ct6e-standard-4t"):
        assert fact in out.stdout
    lines = {
        line.split("│")[1].strip(): line.split("│")[2].strip()
        for line in out.stdout.splitlines()
        if line.count("│") >= 3
    }
    assert lines["chips"] == "16" and lines["hosts (TPU VMs = Ray nodes)"] == "4" and lines["chips per host"] == "4"


def test_topology_lists_shapes():
    out = run("topology", "TPU-V5LITEPOD")
    assert out.returncode == 0, out.stderr
    for shape in ("1x1", "2x2", "2x4", "4x4", "16x16"):
        assert f" {shape} " in out.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (("topology", "v6e", "4x5"), "error: '4x5' is not a v6e topology; valid: 1x1, 2x2, 2x4, 4x4"),
        (("topology", "v9z"), "error: "),
        (("sim", "up", "--slice", "v4-2x2x2"), "is not a slice; expected GEN:TOPOLOGY"),
    ],
)
def test_bad_input_is_one_line_not_a_traceback(args, message):
    out = run(*args)
    assert out.returncode == 1
    assert message in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


@pytest.mark.ray
def test_status_shows_slices_and_reservations(ray_cluster):
    with (
        busy_host(SLICE_A, 1),
        rayslice.slice_placement_group("2x2x2", "TPU-V4", name="held-job", timeout_s=30, progress=False),
    ):
        # Both slices are now taken: a second reservation waits, and status shows it.
        errors: list[BaseException] = []
        # The waiter waits until the test has seen it (each `rayslice status` is a new process that imports
        # Ray: seconds on a loaded machine), then its clock jumps past its deadline and it times out.
        seen = threading.Event()

        def clock() -> float:
            return time.monotonic() + (1e6 if seen.is_set() else 0.0)

        def waiter() -> None:
            try:
                rayslice.slice_placement_group(
                    "2x2x2", "TPU-V4", name="waiting-job", timeout_s=120, progress=False, clock=clock
                )
            except ReservationTimeout as e:
                errors.append(e)

        thread = threading.Thread(target=waiter)
        thread.start()
        try:
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:
                out = run("status", "--address", ray_cluster.address)
                assert out.returncode == 0, out.stderr
                if "waiting-job" in out.stdout:
                    break
        finally:
            seen.set()
            thread.join(timeout=30)
    assert "waiting-job" in out.stdout and "waiting" in out.stdout
    assert "held-job" in out.stdout and "created" in out.stdout
    assert SLICE_A in out.stdout and SLICE_B in out.stdout and "busy" in out.stdout
    assert len(errors) == 1


def test_status_without_a_cluster_is_a_clear_error(tmp_path):
    out = run("status", env={"RAYSLICE_HOME": str(tmp_path), "RAY_ADDRESS": ""})
    assert out.returncode == 1
    assert "error: no cluster to connect to" in out.stderr


@pytest.mark.slow
def test_sim_up_detach_status_down(tmp_path):
    env = {"RAYSLICE_HOME": str(tmp_path)}
    up = run("sim", "up", "--slice", "v4:2x2x1@solo", "--detach", env=env, timeout=240)
    assert up.returncode == 0, up.stderr + (tmp_path / "sim.log").read_text()
    assert "1 hosts up in" in up.stdout and "address:" in up.stdout
    try:
        again = run("sim", "up", "--slice", "v4:2x2x1", "--detach", env=env)
        assert again.returncode == 1 and "already running" in again.stderr
        status = run("status", env=env)
        assert status.returncode == 0, status.stderr
        assert "solo" in status.stdout and "free" in status.stdout
    finally:
        down = run("sim", "down", env=env, timeout=120)
    assert down.returncode == 0, down.stderr
    assert not (tmp_path / "sim.json").exists()
    assert run("sim", "down", env=env).returncode == 1
