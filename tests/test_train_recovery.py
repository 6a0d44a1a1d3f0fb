"""Fast recovery: failure detection inside the gang (heartbeats, step deadline)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rayslice.errors import GangError, InvalidArgument, Outcome
from rayslice.train import FailureConfig
from rayslice.train.goodput import GoodputTracker
from rayslice.train.heartbeat import HeartbeatMonitor, HeartbeatPublisher, heartbeat_key, period_for


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _beat(seq: int, step: int, phase: str = "step") -> dict:
    return {"seq": seq, "step": step, "phase": phase}


# -- pure logic -----------------------------------------------------------------
@given(silence=st.floats(0, 10), timeout=st.floats(0.2, 5))
def test_a_host_is_lost_exactly_when_its_record_stops_changing_longer_than_the_timeout(silence, timeout):
    clock = _Clock()
    m = HeartbeatMonitor(2, timeout, None, clock=clock)
    m.observe({0: _beat(1, 0), 1: _beat(1, 0)})
    clock.t = silence
    m.observe({0: _beat(2, 0), 1: _beat(1, 0)})  # rank 0 keeps beating, rank 1 is silent
    v = m.check()
    if silence > timeout:
        assert v is not None and v.kind == "lost" and v.ranks == (1,) and v.silent_s == silence
    else:
        assert v is None


def test_first_record_gets_a_grace_and_finished_hosts_are_never_lost():
    clock = _Clock()
    m = HeartbeatMonitor(2, 1.0, None, clock=clock)
    clock.t = 5.0
    assert m.check() is None  # no record yet: still starting (unpickling its arguments)
    m.observe({0: _beat(1, 3), 1: _beat(1, 3, "done")})
    clock.t = 7.0
    m.finish(0)
    assert m.check() is None  # rank 0 returned, rank 1 said "done"
    clock.t = 60.0
    assert HeartbeatMonitor(2, 1.0, None, clock=clock).check() is None  # a fresh monitor starts its own grace


@given(silence=st.floats(0, 30), timeout=st.floats(0.2, 5), answers=st.booleans())
def test_a_silent_host_whose_machine_answers_is_busy_until_the_live_grace(silence, timeout, answers):
    clock, asked = _Clock(), []

    def reachable(ranks):
        asked.append(list(ranks))
        return set(ranks) if answers else set()

    m = HeartbeatMonitor(2, timeout, None, clock=clock, reachable=reachable, live_grace_s=10.0)
    m.observe({0: _beat(1, 0), 1: _beat(1, 0)})
    clock.t = silence
    m.observe({0: _beat(2, 0), 1: _beat(1, 0)})  # rank 1 is silent
    v = m.check()
    # Only an overdue host still within the grace is probed, all of them in one call.
    assert asked == ([[1]] if timeout < silence <= 10.0 else [])
    if silence <= timeout or (answers and silence <= 10.0):
        assert v is None
        assert (1 in m.spared) == (silence > timeout)
    else:
        assert v is not None and v.kind == "lost" and v.ranks == (1,) and v.silent_s == silence
        assert v.answering == ()  # never answered while silent (or never asked)
        assert "is gone" in v.message(timeout, None)
    if timeout < silence <= 10.0:
        assert m.check(probe=False).ranks == (1,)  # silence alone decides when the caller says so


def test_a_host_spared_then_silent_past_the_grace_is_lost_as_stuck_or_dead():
    clock = _Clock()
    m = HeartbeatMonitor(2, 1.0, None, clock=clock, reachable=lambda ranks: set(ranks), live_grace_s=5.0)
    m.observe({0: _beat(1, 0), 1: _beat(1, 0)})
    clock.t = 3.0
    m.observe({0: _beat(2, 0), 1: _beat(1, 0)})
    assert m.check() is None and m.spared == {1: 3.0}
    clock.t = 6.0
    m.observe({0: _beat(3, 0), 1: _beat(1, 0)})
    v = m.check()
    assert v is not None and v.ranks == (1,) and v.answering == (1,)
    assert "stuck" in v.message(1.0, None) and "is gone" not in v.message(1.0, None)
    # Spared once, then its machine stops answering within the grace: gone, not stuck (its node is lost).
    up = {1}
    m = HeartbeatMonitor(2, 1.0, None, clock=clock, reachable=lambda ranks: up & set(ranks), live_grace_s=5.0)
    clock.t = 0.0
    m.observe({0: _beat(1, 0), 1: _beat(1, 0)})
    clock.t = 2.0
    m.observe({0: _beat(2, 0), 1: _beat(1, 0)})  # rank 0 keeps beating
    assert m.check() is None and 1 in m.spared
    up.clear()
    clock.t = 3.0
    m.observe({0: _beat(3, 0), 1: _beat(1, 0)})
    v = m.check()
    assert v is not None and v.ranks == (1,) and v.answering == ()
    assert "is gone" in v.message(1.0, None)


def test_the_first_record_is_not_probed_and_the_live_grace_is_at_least_the_timeout():
    clock = _Clock()
    m = HeartbeatMonitor(1, 1.0, None, clock=clock, reachable=lambda ranks: set(ranks))
    clock.t = 11.0
    v = m.check()  # never beat: past the first-record grace, lost whatever its machine says
    assert v is not None and v.ranks == (0,) and v.answering == ()
    clock = _Clock()
    m = HeartbeatMonitor(1, 20.0, None, clock=clock, reachable=lambda ranks: set(ranks), live_grace_s=5.0)
    m.observe({0: _beat(1, 0)})
    clock.t = 21.0
    m.observe({0: _beat(1, 0)})
    v = m.check()  # the grace is at least the timeout: 20 s, not 5
    assert m.live_grace_s == 20.0 and v is not None and v.ranks == (0,)


def test_node_probe_connects_to_the_raylet_port_and_reuses_answers_for_ttl():
    import socket

    from rayslice.train.liveness import NodeProbe

    server = socket.create_server(("127.0.0.1", 0))
    up = server.getsockname()[1]
    closed = socket.create_server(("127.0.0.1", 0))
    down = closed.getsockname()[1]
    closed.close()  # nothing listens there now: refused, as a removed node's port
    try:
        clock = _Clock()
        probe = NodeProbe({"up": ("127.0.0.1", up), "down": ("127.0.0.1", down)}, clock=clock)
        assert probe("up") and not probe("down") and not probe("unknown")
        assert probe.probes == 2  # an unknown node costs no connection
        probe("up")
        assert probe.probes == 2  # within ttl_s: the answer is reused
        clock.t = 1.0
        assert probe.answering(["up", "down", "unknown"]) == {"up"} and probe.probes == 4  # one batch, in parallel
        probe.answering(["down"])
        assert probe.probes == 4  # a refusal is reused for ttl_s too
    finally:
        server.close()

    def refuse(address, timeout_s):
        raise ConnectionRefusedError(address)

    assert NodeProbe({"n": ("10.0.0.1", 1)}, connect=refuse)("n") is False


def test_step_deadline_finds_the_hung_hosts_but_not_the_first_step_or_the_final_wait():
    clock = _Clock()
    m = HeartbeatMonitor(2, 1.0, 3.0, start_step=4, clock=clock)
    for t in range(0, 10):  # both alive; the first step of the attempt (compile) takes 10 s: not timed
        clock.t = float(t)
        m.observe({0: _beat(t + 1, 4), 1: _beat(t + 1, 4)})
        assert m.check() is None
    clock.t = 10.0
    m.observe({0: _beat(20, 5), 1: _beat(20, 5)})
    for t in range(11, 14):
        clock.t = float(t)
        m.observe({0: _beat(t + 20, 6), 1: _beat(t + 20, 5)})  # rank 1 stops progressing, still beating
        assert m.check() is None
    clock.t = 13.5
    m.observe({0: _beat(40, 6), 1: _beat(40, 5)})
    v = m.check()
    assert v is not None and v.kind == "hung" and v.ranks == (1,)
    assert v.step == 5 and "step_timeout_s=3" in v.message(1.0, 3.0)
    clock.t = 20.0
    m2 = HeartbeatMonitor(1, 1.0, 3.0, clock=clock)
    m2.observe({0: _beat(1, 2, "finishing")})
    clock.t = 30.0
    m2.observe({0: _beat(2, 2, "finishing")})
    assert m2.check() is None  # waiting for the last checkpoint is not a hung step


def test_a_hung_gang_names_every_host_at_the_stuck_step_the_one_in_its_own_code_first():
    clock = _Clock()
    m = HeartbeatMonitor(3, 5.0, 2.0, clock=clock)
    m.observe({r: _beat(1, 2) for r in range(3)})
    clock.t = 0.4  # rank 1 is seen at the same step a poll later; rank 2 got one step further
    m.observe(
        {
            0: {**_beat(2, 2), "where": "_value (array.py:650)", "in_jax": True},
            1: {**_beat(2, 3), "where": "train (loop.py:12)", "in_jax": False},
            2: {**_beat(2, 3), "where": "train (loop.py:9)", "in_jax": False},
        }
    )
    clock.t = 2.1  # rank 0 is past the deadline at step 2; ranks 1 and 2 got to step 3 (1.7 s ago)
    v = m.check()
    assert v is not None and v.ranks == (0,) and v.step == 2 and v.where == ("_value (array.py:650) in JAX",)
    m = HeartbeatMonitor(2, 5.0, 2.0, clock=clock)
    clock.t = 10.0
    m.observe({0: {**_beat(1, 4), "where": "_value (array.py:650)", "in_jax": True}})
    clock.t = 10.3
    m.observe({1: {**_beat(1, 4), "where": "train (loop.py:12)", "in_jax": False}})
    clock.t = 12.1  # rank 0 past the deadline, rank 1 (same step) not yet: both are named, rank 1 first
    v = m.check()
    assert v is not None and v.kind == "hung" and v.ranks == (1, 0) and v.step == 4
    assert v.where == ("train (loop.py:12)", "_value (array.py:650) in JAX")
    text = v.message(1.0, 2.0, lambda r: f"host {r}")
    assert "host 1 at train (loop.py:12); host 0 at _value (array.py:650) in JAX" in text and "hung" in text


def test_the_publisher_says_where_the_watched_thread_is():
    import threading

    import jax.numpy as jnp

    from rayslice.train.heartbeat import _in_jax, where_is

    release = threading.Event()

    def stuck_in_user_code():
        release.wait(30)

    t = threading.Thread(target=stuck_in_user_code)
    t.start()
    try:
        seen = []
        p = HeartbeatPublisher("k", 60, lambda: (1, "step"), put=lambda k, v: seen.append(json.loads(v)), watch=t.ident)
        deadline = time.monotonic() + 10
        while (not seen or not seen[-1]["where"].startswith("wait (")) and time.monotonic() < deadline:
            p.beat()  # until the thread sits in Event.wait
            time.sleep(0.001)
    finally:
        release.set()
        t.join()
    assert seen[-1]["where"].startswith("wait (threading.py:") and seen[-1]["in_jax"] is False
    assert where_is(t.ident) == (None, False)  # gone
    assert _in_jax(jnp.__file__) and not _in_jax(threading.__file__) and not _in_jax(__file__)


def test_publisher_reports_an_unreachable_store_once_and_keeps_going(caplog):
    calls = []

    def put(key, value):
        calls.append(value)
        raise ConnectionError("GCS unreachable")

    p = HeartbeatPublisher("k", 0.001, lambda: (1, "step"), put=put).start()
    while len(calls) < 5:
        p.beat()
    p.stop()
    assert len([r for r in caplog.records if "cannot be published" in r.getMessage()]) == 1
    assert heartbeat_key("r", 1, 0) == "r/1/0" and period_for(1.0) == 0.25


def test_failure_config_validates_detection_settings():
    assert FailureConfig().heartbeat_timeout_s == 1.0 and FailureConfig().step_timeout_s is None
    with pytest.raises(InvalidArgument, match="heartbeat_timeout_s=0.05"):
        FailureConfig(heartbeat_timeout_s=0.05)
    with pytest.raises(InvalidArgument, match="step_timeout_s=-1"):
        FailureConfig(step_timeout_s=-1)


def test_compilation_cache_is_under_the_run_by_default():
    from rayslice.train import RunConfig

    assert RunConfig().compilation_cache_dir("/r/run") == "/r/run/compile_cache"
    assert RunConfig(compilation_cache=False).compilation_cache_dir("/r/run") is None
    assert RunConfig(compilation_cache="gs://b/cache").compilation_cache_dir("/r/run") == "gs://b/cache"
    with pytest.raises(InvalidArgument, match="compilation_cache=3"):
        RunConfig(compilation_cache=3)
    with pytest.raises(InvalidArgument, match="compilation_cache='ftp://x'"):
        RunConfig(compilation_cache="ftp://x")


def test_goodput_per_attempt_adds_up_to_the_run():
    g = GoodputTracker(clock=iter([0.0, 20.0]).__next__)
    for attempt in range(2):
        g.begin_attempt()
        g.add("startup", 1.0)
        g.on_reports(
            [
                {"step": 1, "step_s": 2.0 if attempt == 0 else 0.2, "stall_s": 0.0, "first": True},
                {"step": 2, "step_s": 1.0, "stall_s": 0.0, "first": False},
            ]
        )
        if attempt == 0:
            g.on_failure(None, unreported_s=1.0, detection_s=0.5)
    out = g.finish()
    assert [a["compile"] for a in out.attempts] == [2.0, 0.2]
    assert out.attempts[0]["productive"] == 0.0 and out.attempts[0]["lost"] == 1.5
    for k in ("startup", "compile", "productive", "lost", "detection"):
        assert abs(sum(a[k] for a in out.attempts) - out.seconds[k]) < 1e-9
    assert "attempt 2" in [c.header for c in out.table().columns]


def test_goodput_books_only_what_jax_measured_as_compile():
    g = GoodputTracker(clock=iter([0.0, 20.0]).__next__)
    for attempt in range(2):
        g.begin_attempt()
        xla = 2.0 if attempt == 0 else 0.1  # the restart loads its programs from the persistent cache
        g.on_reports(
            [
                {
                    "step": 1,
                    "step_s": 4.0,
                    "stall_s": 0.0,
                    "first": True,
                    "restore_s": 0.5,
                    "compile": (xla, 1.0, attempt * 3, 3 - attempt * 3),
                },
                {"step": 2, "step_s": 1.0, "stall_s": 0.0, "first": False},
                {
                    "step": 3,
                    "step_s": 1.5,
                    "stall_s": 0.0,
                    "first": False,
                    "compile": (0.25, 0.25, 0, 1),
                },  # a recompile
                {"step": 4, "step_s": 0.5, "stall_s": 0.0, "first": False, "compile": (5.0, 0.0, 0, 1)},  # clamped
            ]
        )
        if attempt == 0:
            g.on_failure(None, unreported_s=0.0)
    out = g.finish()
    first, restart = out.attempts
    assert first["compile"] == 2.0 + 1.0 + 0.5 + 0.5 and restart["compile"] == 0.1 + 1.0 + 0.5 + 0.5
    assert first["startup"] == 4.0 - 0.5 - 3.0 and first["restore"] == 0.5
    assert restart["productive"] == 1.0 + 1.0 and first["productive"] == 0.0 and first["lost"] == 2.0
    assert [c["xla_s"] for c in out.compiles] == [7.25, 5.35] and [c["cache_hits"] for c in out.compiles] == [0, 3]
    assert abs(sum(out.seconds.values()) - out.wall_s) < 1e-9
    d = out.as_dict()
    assert d["compiles"][1]["cache_misses"] == 2 and d["compile_cache_hits"] == 3
    rows = [c._cells for c in out.table().columns][0]
    assert any("of which XLA" in r for r in rows) and any("trace + lower" in r for r in rows)


def test_the_compile_clock_reads_jax_monitoring():
    import jax
    import jax.numpy as jnp

    from rayslice.train.worker import compile_clock

    clock = compile_clock()
    assert compile_clock() is clock  # listeners registered once per process
    before = clock.totals
    jax.jit(lambda x: jnp.tanh(x @ x.T) * 3.0 + 1.25)(jnp.ones((7, 5))).block_until_ready()
    after = clock.totals
    assert after[0] > before[0] and after[1] > before[1]  # XLA compile, trace + lower


def test_detection_time_is_its_own_goodput_component():
    g = GoodputTracker(clock=iter([0.0, 10.0]).__next__)
    g.on_reports(
        [
            {"step": 1, "step_s": 1.0, "stall_s": 0.0, "first": True},
            {"step": 2, "step_s": 1.0, "stall_s": 0.0, "first": False},
        ]
    )
    g.on_failure(None, unreported_s=2.0, detection_s=1.5)
    out = g.finish()
    assert out.seconds["detection"] == 1.5 and out.seconds["lost"] == 1.0 + 0.5 and out.lost_steps == 2
    assert abs(sum(out.seconds.values()) - out.wall_s) < 1e-9


# -- on the simulator ----------------------------------------------------------
@pytest.mark.ray
@pytest.mark.slow
def test_a_hung_host_is_found_by_the_step_deadline_and_the_run_restarts(ray_cluster, tmp_path):
    from rayslice.train import JaxTrainer, RunConfig, ScalingConfig, UserCallback

    from . import train_loops
    from .test_train import _no_actors_left

    class Seen(UserCallback):
        errors: list = []

        def after_exception(self, run_context, worker_exceptions):
            self.errors.extend(worker_exceptions.values())

    seen = Seen()
    result = JaxTrainer(
        train_loops.hang_loop,
        train_loop_config={"steps": 5, "hang_at": 3},
        scaling_config=ScalingConfig(topology="2x2x2", accelerator_type="TPU-V4"),
        run_config=RunConfig(
            name="hung",
            storage_path=str(tmp_path),
            progress=False,
            failure_config=FailureConfig(max_failures=1, step_timeout_s=2),
            callbacks=[seen],
        ),
    ).fit()
    assert result.error is None, result.error
    assert (result.attempts, result.failures, result.preemptions) == (2, 1, 0)
    (err,) = seen.errors
    assert isinstance(err, GangError) and err.outcome is Outcome.TIMEOUT and "hung" in str(err)
    assert "worker 1" in str(err)
    # The host stuck in its own code comes first; its peer waits for it inside a JAX collective.
    assert "on host rank 1 (slice-a worker 1) at hang_loop (train_loops.py:" in str(err), err
    assert str(err).count(" in JAX") == 1 and err.rank == 1
    assert result.metrics == {"step_done": 5, "attempt": 2}
    assert result.goodput.seconds["detection"] >= 0 and result.goodput.seconds["lost"] > 0
    assert _no_actors_left() == []


_PRODUCTION = textwrap.dedent("""
    import json, os, sys, time
    sys.path.insert(0, {root!r})
    import ray
    import rayslice
    from rayslice.sim import SimulatedCluster, SliceSpec
    from rayslice.train import FailureConfig, JaxTrainer, RunConfig, ScalingConfig, UserCallback
    from tests import train_loops

    out = {{}}
    with SimulatedCluster([SliceSpec("TPU-V4", "2x2x2", name="prod-a"), SliceSpec("TPU-V4", "2x2x2", name="prod-b")],
                          health_check="production", head_cpus=1) as sim:
        class Chaos(UserCallback):
            def after_exception(self, run_context, worker_exceptions):
                out["detected_after_s"] = time.monotonic() - out["killed_at"]
                alive = {{n["NodeID"] for n in ray.nodes() if n["Alive"]}}
                out["ray_still_lists_it_alive"] = out["node"] in alive
                out["error"] = [str(e) for e in worker_exceptions.values()]

        def kill(report):
            if report["step"] >= 3 and "node" not in out:
                busy = [s for s in rayslice.list_slices() if s.state == "busy"][0]
                out["first_slice"] = busy.name
                out["node"] = sim.slices[busy.name].hosts[1].node_id
                out["killed_at"] = time.monotonic()
                sim.preempt_host(busy.name, 1, wait=False)
            elif report["attempt"] == 2 and "second_slice" not in out:
                out["second_slice"] = [s.name for s in rayslice.list_slices() if s.state == "busy"]
                out["recovered_after_s"] = time.monotonic() - out["killed_at"]

        r = JaxTrainer(train_loops.regression_loop, train_loop_config={{"rows": 96, "every": 2, "sleep_s": 0.1}},
                       scaling_config=ScalingConfig(topology="2x2x2", accelerator_type="TPU-V4"),
                       run_config=RunConfig(name="prod", storage_path={path!r}, progress=False,
                                            failure_config=FailureConfig(max_preemptions=1),
                                            callbacks=[kill, Chaos()])).fit()
        out.update(result_error=str(r.error) if r.error else None, preemptions=r.preemptions,
                   steps=sorted({{h["step"] for h in r.metrics_history}}), detection_s=r.goodput.seconds["detection"],
                   compile_s=[a["compile"] for a in r.goodput.attempts], cache=os.listdir(r.path + "/compile_cache"),
                   groups=[g["name"] for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"])
    print(json.dumps(out))
""")


@pytest.mark.ray
def test_a_host_holding_its_gil_past_the_heartbeat_timeout_is_busy_not_lost(ray_cluster, tmp_path, caplog):
    # Host 1 holds its GIL for 2.5 s in one C call: no heartbeat for 2.5 s (timeout 1 s), its machine
    # (its Ray node's raylet) answers all along. Taken for lost, the run would restart (a preemption).
    from rayslice.train import JaxTrainer, RunConfig, ScalingConfig

    from . import train_loops
    from .test_train import _no_actors_left

    with caplog.at_level("INFO", logger="rayslice.train.controller"):
        result = JaxTrainer(
            train_loops.hang_loop,
            train_loop_config={"steps": 5, "hang_at": 3, "hold_gil_s": 2.5},
            scaling_config=ScalingConfig(topology="2x2x2", accelerator_type="TPU-V4"),
            run_config=RunConfig(
                name="busy", storage_path=str(tmp_path), progress=False, failure_config=FailureConfig(max_preemptions=0)
            ),
        ).fit()
    assert result.error is None, result.error
    assert (result.attempts, result.preemptions, result.failures) == (1, 0, 0)
    assert result.metrics["step_done"] == 5
    said = [r.getMessage() for r in caplog.records if "is silent but its machine answers" in r.getMessage()]
    assert any("worker 1" in line for line in said), said
    assert _no_actors_left() == []


@pytest.mark.ray
@pytest.mark.slow
def test_a_dead_host_is_detected_before_ray_declares_its_node_dead(tmp_path):
    # Its own cluster, with Ray's production health-check timing (in a subprocess:
    # this process may be connected to the session cluster).
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = _PRODUCTION.format(root=root, path=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["result_error"] is None and out["preemptions"] == 1
    assert out["ray_still_lists_it_alive"] is True  # found by heartbeats, not by Ray's node health checks
    # Whichever comes first ends the attempt: the heartbeat verdict (naming the host), or the error of
    # the dead process's own call (its worker died with the node). Both come before Ray's node death.
    error = out["error"][0]
    assert ("stopped sending heartbeats" in error and "worker 1" in error) or "actor died" in error, error
    assert out["second_slice"] != [out["first_slice"]]  # the next attempt avoided the slice of the dead host
    assert out["steps"] == list(range(1, 13)) and out["detection_s"] > 0
    assert out["groups"] == []
    assert len(out["compile_s"]) == 2 and out["cache"]  # the restart read JAX's persistent compilation cache
