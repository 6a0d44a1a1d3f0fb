"""The CLI with bad input: one line, non-zero exit, nothing spawned or signalled, nothing hangs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import psutil
import pytest

from .test_cli import run


def _one_line_error(out: subprocess.CompletedProcess, *fragments: str) -> None:
    assert out.returncode == 1, (out.stdout, out.stderr)
    assert "Traceback" not in out.stderr and "Traceback" not in out.stdout
    first = out.stderr.strip().splitlines()[-1] if out.stderr.strip() else ""
    assert "error:" in out.stderr, out.stderr
    for fragment in fragments:
        assert fragment in out.stderr, (fragment, out.stderr, first)


def test_detach_with_a_bad_timeout_spawns_nothing(tmp_path):
    before = {p.pid for p in psutil.process_iter()}
    out = run("sim", "up", "--slice", "v4:2x2x1", "--detach", "--timeout-s", "-5", env={"RAYSLICE_HOME": str(tmp_path)})
    _one_line_error(out, "--timeout-s=-5")
    assert not (tmp_path / "sim.log").exists() and not (tmp_path / "sim.json").exists()
    spawned = [
        p
        for p in psutil.process_iter(["pid", "cmdline"])
        if p.pid not in before and "rayslice.cli" in " ".join(p.info["cmdline"] or [])
    ]
    assert spawned == []


@pytest.mark.parametrize(
    "args, fragment",
    [
        (("sim", "up", "--slice", "v4:2x2x1", "--head-cpus", "0", "--detach"), "--head-cpus=0"),
        (("sim", "up", "--slice", "v4:4x4"), "'4x4' is not a v4 topology"),
        (("sim", "down", "--timeout-s", "0"), "--timeout-s=0"),
        (("topology", "4x4"), "which generation"),
        (("explain", "2x2x2", "v9"), "'v9' is not a known TPU generation"),
        (("explain", "2x2x2", "v4", "--num-slices", "0"), "num_slices=0"),
    ],
)
def test_bad_arguments_are_one_line_errors(tmp_path, args, fragment):
    _one_line_error(run(*args, env={"RAYSLICE_HOME": str(tmp_path)}), fragment)


@pytest.mark.parametrize("content", ['{"pid": "abc"}', "{}", "not json", '{"pid": 1, "address": "x"}', "[1, 2]"])
def test_a_broken_state_file_is_ignored_not_a_traceback(tmp_path, content):
    (tmp_path / "sim.json").write_text(content)
    out = run("sim", "down", env={"RAYSLICE_HOME": str(tmp_path)})
    _one_line_error(out, "no simulated cluster is running")
    out = run("status", env={"RAYSLICE_HOME": str(tmp_path), "RAY_ADDRESS": ""})
    _one_line_error(out, "no cluster to connect to")


def test_sim_down_never_signals_a_process_it_did_not_start(tmp_path):
    # A live process that is not the simulator (pid reuse after a crash): it must survive.
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        started = psutil.Process(victim.pid).create_time()
        for state in (
            {"pid": victim.pid, "address": "127.0.0.1:1", "started": started},  # not our command
            {"pid": victim.pid, "address": "127.0.0.1:1", "started": started - 100},
        ):  # reused pid
            (tmp_path / "sim.json").write_text(json.dumps(state))
            out = run("sim", "down", env={"RAYSLICE_HOME": str(tmp_path)})
            _one_line_error(out, "no simulated cluster is running")
            assert victim.poll() is None, "sim down signalled a process it did not start"
            assert not (tmp_path / "sim.json").exists()
    finally:
        victim.kill()
        victim.wait()


def test_rayslice_home_under_a_regular_file(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    out = run("sim", "down", env={"RAYSLICE_HOME": str(blocker / "home")})
    _one_line_error(out, "not a directory")


def test_status_of_an_address_nobody_listens_on_returns_at_once(tmp_path):
    start = time.monotonic()
    out = run("status", "--address", "127.0.0.1:1", env={"RAYSLICE_HOME": str(tmp_path)}, timeout=60)
    _one_line_error(out, "cannot connect to Ray at 127.0.0.1:1")
    assert time.monotonic() - start < 45


def test_topology_and_explain_take_either_order():
    a, b = run("topology", "4x4", "v6e"), run("topology", "v6e", "4x4")
    assert a.returncode == b.returncode == 0 and a.stdout == b.stdout
    assert "v6e-16" in a.stdout


def test_topology_cli_runs_without_a_home(tmp_path):
    env = {**os.environ, "RAYSLICE_HOME": str(tmp_path / "never" / "created")}
    out = subprocess.run(
        [sys.executable, "-m", "rayslice.cli", "topology", "2x2x2", "v4"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert out.returncode == 0 and not (tmp_path / "never").exists()
