"""Preemption notices: an agreed emergency save at a step boundary, a clean stop, zero lost steps."""

from __future__ import annotations

import http.server
import logging
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rayslice import gang
from rayslice._deadline import Deadline
from rayslice.errors import InvalidArgument
from rayslice.gang import _process
from rayslice.train import AttemptEnd, FailureConfig
from rayslice.train.goodput import GoodputTracker
from rayslice.train.notice import MemoryKV, NoticeAgreement, NoticeSources


# -- pure logic -----------------------------------------------------------------
@settings(max_examples=30, deadline=None)
@given(frozen=st.lists(st.integers(0, 50), min_size=1, max_size=5), data=st.data())
def test_every_host_agrees_on_one_save_step_that_none_has_passed(frozen, data):
    kv = MemoryKV()
    world = len(frozen)
    hosts = [NoticeAgreement(kv, "r/1", rank=r, world_size=world, agree_timeout_s=5).start() for r in range(world)]
    for h, step in zip(hosts, frozen):
        if step:
            assert h.claim(step) is False  # no notice yet: every step goes on
    hosts[data.draw(st.integers(0, world - 1))].announce("SIGTERM")
    agreed = {h.wait_agreed(5) for h in hosts}
    assert agreed == {max(frozen) + 1}
    # Each host steps on from where it froze: exactly the agreed step saves, on every host.
    for h, step in zip(hosts, frozen):
        saves = [s for s in range(step + 1, max(frozen) + 3) if h.claim(s)]
        assert saves == [max(frozen) + 1]
        h.stop()


def test_agreement_holds_while_hosts_keep_stepping_concurrently():
    kv = MemoryKV()
    hosts = [NoticeAgreement(kv, "r/2", rank=r, world_size=3, agree_timeout_s=5).start() for r in range(3)]
    saved: dict[int, list[int]] = {r: [] for r in range(3)}
    stepped = [0, 0, 0]

    def loop(rank: int) -> None:
        for step in range(1, 400):
            stepped[rank] = step
            if hosts[rank].claim(step):
                saved[rank].append(step)
                return
            time.sleep(0.0005 * (rank + 1))  # hosts at different speeds

    threads = [threading.Thread(target=loop, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    all_stepping = Deadline(10)  # the notice comes while every host is stepping
    while min(stepped) < 5:
        all_stepping.sleep_or_raise(0.001, f"not every host has stepped 5 times: {stepped}")
    hosts[2].announce("gce-preempted")
    hosts[0].announce("SIGTERM")  # a second notice changes nothing
    for t in threads:
        t.join(10)
    steps = {tuple(v) for v in saved.values()}
    assert len(steps) == 1 and len(next(iter(steps))) == 1  # the same single step on every host
    assert hosts[1].notice == {"rank": 2, "reason": "gce-preempted"}


def test_a_peer_that_never_posts_degrades_to_no_save():
    kv = MemoryKV()
    alone = NoticeAgreement(kv, "r/3", rank=0, world_size=2, agree_timeout_s=0.2).start()
    alone.announce("SIGTERM")  # rank 1 is gone: it will never post its step
    assert alone.wait_agreed(5) is None and "did not agree" in alone.failed
    assert alone.claim(1) is False  # the normal path: no half-agreed save


class _Metadata(http.server.BaseHTTPRequestHandler):
    answers = {"instance/preempted": "FALSE", "instance/maintenance-event": "NONE"}
    headers_seen: list = []

    def do_GET(self):
        self.headers_seen.append(self.headers.get("Metadata-Flavor"))
        body = self.answers.get(self.path.split("/computeMetadata/v1/", 1)[-1], "")
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args):
        pass


def test_gce_metadata_maintenance_event_is_a_notice(monkeypatch):
    # The first GET decides "reachable" within 1 s; a loaded machine's local server gets more.
    get = NoticeSources._get
    monkeypatch.setattr(NoticeSources, "_get", lambda self, path, timeout: get(self, path, max(timeout, 10.0)))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Metadata)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/computeMetadata/v1"
    seen = []
    try:
        src = NoticeSources(
            lambda reason, **d: seen.append((reason, d)), metadata_url=url, poll_s=0.02, sigterm=None
        ).start()
        assert not src.wait(0.2)  # polled, nothing pending
        _Metadata.answers = {**_Metadata.answers, "instance/maintenance-event": "TERMINATE_ON_HOST_MAINTENANCE"}
        assert src.wait(5)
        src.stop()
    finally:
        server.shutdown()
    assert seen == [("gce-maintenance", {"event": "TERMINATE_ON_HOST_MAINTENANCE"})]
    assert set(_Metadata.headers_seen) == {"Google"}


def test_missing_sources_are_reported_once_and_never_fire(caplog, monkeypatch):
    from rayslice.train import notice

    monkeypatch.setattr(notice, "_REPORTED", set())
    seen = []

    def broken():
        raise ConnectionError("no GCS")

    with caplog.at_level(logging.INFO, logger="rayslice.train.notice"):
        for _ in range(2):
            src = NoticeSources(
                lambda reason, **d: seen.append(reason),
                metadata_url="http://127.0.0.1:9",
                node_id="ab",
                poll_s=0.01,
                draining=broken,
                sigterm=None,
            ).start()
            assert not src.wait(0.5)
            src.stop()
    messages = [r.getMessage() for r in caplog.records]
    assert len([m for m in messages if m.startswith("GCE metadata server")]) == 1
    assert len([m for m in messages if "Ray node draining not readable" in m]) == 1
    assert seen == []


def test_sigterm_is_a_notice_only_while_someone_listens():
    seen = []
    remove = gang.on_sigterm(seen.append)
    try:
        _process._sigterm(15, None)
    finally:
        remove()
    assert seen == ["SIGTERM"]
    with pytest.raises(SystemExit):  # nobody listens: the process ends, as Ray's workers do
        _process._sigterm(15, None)


def test_notice_settings_are_validated_and_the_ending_is_recorded():
    assert FailureConfig().preemption_notices is True and FailureConfig(notice_poll_s=2).notice_poll_s == 2.0
    with pytest.raises(InvalidArgument, match="notice_poll_s=0"):
        FailureConfig(notice_poll_s=0)
    with pytest.raises(InvalidArgument, match="preemption_notices"):
        FailureConfig(preemption_notices="yes")
    g = GoodputTracker(clock=iter([0.0, 5.0]).__next__)
    g.begin_attempt()
    g.end_attempt(AttemptEnd(1, "preempted", "notice", step=4, emergency_save_s=0.3, notice="SIGTERM"))
    out = g.finish()
    assert out.endings[0].reason == "notice" and out.as_dict()["endings"][0]["step"] == 4


# -- on the simulator ----------------------------------------------------------
@pytest.fixture(scope="module")
def notice_slices(sim):
    """Three v5p 2x2x2 slices of their own: notices and kills land only there."""
    from rayslice.sim import SliceSpec

    names = [sim.add_slice(SliceSpec("TPU-V5P", "2x2x2", name=f"notice-{i}")) for i in range(3)]
    yield names
    for n in names:
        if any(h.alive for h in sim.slices[n].hosts):
            sim.preempt_slice(n)


@pytest.fixture(scope="module")
def plain_run(notice_slices, tmp_path_factory):
    from rayslice.train import JaxTrainer, RunConfig, ScalingConfig

    from . import train_loops

    storage = tmp_path_factory.mktemp("notice-plain")
    r = JaxTrainer(
        train_loops.regression_loop,
        train_loop_config=_CFG,
        scaling_config=ScalingConfig(topology="2x2x2", accelerator_type="TPU-V5P"),
        run_config=RunConfig(name="plain", storage_path=str(storage), progress=False),
    ).fit()
    assert r.error is None, r.error
    return r


_CFG = {"rows": 96, "every": 4, "sleep_s": 0.2}  # 12 steps per run


def _run(sim, slices, tmp_path, name, grace_s, committed=None, **extra):
    import rayslice
    from rayslice.train import JaxTrainer, RunConfig, ScalingConfig
    from rayslice.train.checkpoint import checkpoints_dir, latest_complete_step, run_dir

    from . import train_loops

    fired = []
    root = checkpoints_dir(run_dir(str(tmp_path), name))

    def notify_at_step_5(report):
        # With ``committed``: not before that step's checkpoint is complete (a first save, with its imports
        # and compiles, can take longer than a step on the loaded 2-core machine).
        ready = committed is None or (latest_complete_step(root) or 0) >= committed
        if report["step"] >= 5 and not fired and ready:
            busy = [s.name for s in rayslice.list_slices() if s.name in slices and s.state == "busy"]
            fired.append((busy[0], report["step"]))
            sim.notify_preemption(busy[0], 1, grace_s=grace_s)

    r = JaxTrainer(
        train_loops.regression_loop,
        train_loop_config={**_CFG, **extra},
        scaling_config=ScalingConfig(topology="2x2x2", accelerator_type="TPU-V5P"),
        run_config=RunConfig(
            name=name,
            storage_path=str(tmp_path),
            progress=False,
            failure_config=FailureConfig(max_preemptions=1),
            callbacks=[notify_at_step_5],
        ),
    ).fit()
    if fired and sim.slices[fired[0][0]].hosts[1].alive:
        # The grace ends with the run: a noticed host left alive would be killed by the notice's timer
        # later, in the middle of whichever run (of a later test) took its slice meanwhile.
        sim.preempt_host(fired[0][0], 1)
    return r, fired


@pytest.mark.ray
@pytest.mark.slow
def test_a_notice_saves_at_the_next_step_and_the_restart_loses_no_step(ray_cluster, notice_slices, plain_run, tmp_path):
    from .test_train import _no_actors_left, _restore_in_separate_process

    # Attempt 1 slows down after step 5 (sleep only): the notice the driver sends on seeing step 5 lands
    # long before the run's end on a loaded machine.
    r, fired = _run(ray_cluster, notice_slices, tmp_path, "noticed", grace_s=30, slow_after=5, slow_s=1.0)
    assert r.error is None, r.error
    assert fired and (r.attempts, r.preemptions, r.failures) == (2, 1, 0)
    end = r.goodput.endings[0]
    assert (end.outcome, end.reason, end.notice) == ("preempted", "notice", "SIGTERM")
    assert end.step > fired[0][1] and end.emergency_save_s > 0  # the next step boundary, not a past one
    assert r.metrics["restored_from"] == end.step  # the next attempt resumed from the emergency save
    steps = [h["step"] for h in r.metrics_history]
    assert steps == list(range(1, 13))  # every step once: 0 lost steps
    assert r.goodput.lost_steps == 0 and r.goodput.endings[1].outcome == "ok"
    a = _restore_in_separate_process(f"{plain_run.path}/checkpoints")
    b = _restore_in_separate_process(f"{r.path}/checkpoints")
    assert a["step"] == b["step"] == 12 and a["leaves"] == b["leaves"]  # bitwise identical
    assert _no_actors_left() == []


@pytest.mark.ray
@pytest.mark.slow
def test_a_notice_followed_by_a_kill_before_the_save_falls_back_to_the_last_checkpoint(
    ray_cluster, notice_slices, plain_run, tmp_path
):
    from .test_train import _no_actors_left, _restore_in_separate_process

    # Step 6 of attempt 1 takes 3 s: the host is killed (0.2 s after its notice) before that boundary's save.
    r, fired = _run(
        ray_cluster, notice_slices, tmp_path, "too-late", grace_s=0.2, committed=4, slow_after=5, slow_s=3.0
    )
    assert r.error is None, r.error
    assert fired and (r.attempts, r.preemptions) == (2, 1)
    end = r.goodput.endings[0]
    assert (end.outcome, end.reason) == ("preempted", "lost")  # the normal path, not a notice
    assert r.metrics["restored_from"] == 4  # the previous complete checkpoint (steps 5+ are recomputed)
    assert sorted(set(h["step"] for h in r.metrics_history)) == list(range(1, 13))
    a = _restore_in_separate_process(f"{plain_run.path}/checkpoints")
    b = _restore_in_separate_process(f"{r.path}/checkpoints")
    assert a["step"] == b["step"] == 12 and a["leaves"] == b["leaves"]
    assert _no_actors_left() == []
