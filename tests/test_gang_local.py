"""A gang's local rank 0 (pure, no cluster): calls run in this process, in order, answered as an actor would."""

from __future__ import annotations

import os
import threading
import time

import pytest

from rayslice import gang as gang_mod
from rayslice._deadline import Deadline
from rayslice.errors import GangError, Outcome, classify
from rayslice.gang import HostContext, _process
from rayslice.gang._gather import _ordered_get
from rayslice.gang._local import _LocalHost, _LocalRef


@pytest.fixture
def local(monkeypatch):
    """A local rank 0 whose environment and context changes are undone after the test."""
    monkeypatch.setattr(os, "environ", dict(os.environ))
    monkeypatch.setattr(_process, "_CONTEXT", None)
    ctx = HostContext(
        rank=0,
        world_size=2,
        slice_index=0,
        slice_name="s",
        worker_id=0,
        num_slices=1,
        hosts_per_slice=2,
        node_id="n0",
        devices_per_host=4,
    )
    host = _LocalHost({"TPU_WORKER_ID": "0", "TPU_NAME": "s"}, ctx)
    try:
        yield host
    finally:
        host.close()


def test_it_becomes_host_0_of_the_slice_in_this_process(local):
    assert os.environ["TPU_WORKER_ID"] == "0" and os.environ["TPU_NAME"] == "s"
    assert gang_mod.host_context().rank == 0
    assert _ordered_get([local.context.remote()], Deadline(5), "context")[0].slice_name == "s"


def test_calls_run_in_order_on_one_thread_and_a_ping_never_waits_behind_them(local):
    gate = threading.Event()
    seen: list[tuple[int, str]] = []

    def step(i: int) -> int:
        if i == 0:
            gate.wait(5)
        seen.append((i, threading.current_thread().name))
        return i * 10

    refs = [local.call.remote(step, (i,), {}) for i in range(3)]
    ping = local.ping.options(concurrency_group="control").remote()
    assert ping.future().result(timeout=0.5) is True  # while the first call still blocks
    assert not refs[0].future().done()
    gate.set()
    assert _ordered_get(refs, Deadline(5), "step") == [0, 10, 20]
    assert [i for i, _ in seen] == [0, 1, 2] and len({t for _, t in seen}) == 1
    assert seen[0][1].startswith("rayslice-rank0") and seen[0][1] != threading.current_thread().name


def test_a_user_error_is_raised_as_ray_raises_it_from_an_actor(local):
    def bad() -> None:
        raise TimeoutError("the model's own timeout")

    ref = local.call.remote(bad, (), {})
    with pytest.raises(TimeoutError) as info:
        _ordered_get([ref], Deadline(5), "bad")
    import ray.exceptions

    # As from an actor: a RayTaskError that is also the user's type, so it counts as the model's
    # failure, not as the gang running out of time.
    assert isinstance(info.value, ray.exceptions.RayTaskError)
    assert classify(info.value) is Outcome.FAILED and "the model's own timeout" in str(info.value)


def test_a_deadline_fails_the_wait_and_drops_what_is_queued(local):
    gate = threading.Event()
    slow = local.call.remote(gate.wait, (5,), {})
    queued = local.call.remote(time.sleep, (0,), {})
    t0 = time.monotonic()
    with pytest.raises(GangError) as info:
        _ordered_get([slow, queued], Deadline(0.2), "slow")
    assert info.value.outcome is Outcome.TIMEOUT and "2 host(s) did not finish within 0.2 s" in str(info.value)
    assert time.monotonic() - t0 < 2
    assert queued.future().cancelled()
    gate.set()


def test_what_a_local_rank_cannot_do_is_refused_by_name(local):
    with pytest.raises(NotImplementedError, match="call_split with num_returns=2"):
        local.call_split.options(num_returns=2)
    with pytest.raises(AttributeError):
        local.no_such_method  # noqa: B018
    assert isinstance(local.ping.remote(), _LocalRef)


def test_close_cancels_the_calls_not_started(local):
    gate = threading.Event()
    running = local.call.remote(gate.wait, (5,), {})
    waiting = local.call.remote(time.sleep, (0,), {})
    local.close()
    assert waiting.future().cancelled()
    gate.set()
    assert running.future().result(timeout=5) is True


def test_local_rank0_must_be_a_bool():
    from rayslice.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="local_rank0='yes' is not valid"):
        gang_mod.SliceGang(object(), local_rank0="yes")  # type: ignore[arg-type]
