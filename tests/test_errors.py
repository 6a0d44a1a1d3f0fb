"""Tests for rayslice.errors (pure; Ray's exception classes need no cluster)."""

from __future__ import annotations

import doctest

import pytest
import ray.exceptions as rex

from rayslice import errors as errors_mod
from rayslice.errors import (
    GangError,
    NoMatchingSlice,
    Outcome,
    RaysliceError,
    ReservationError,
    ReservationTimeout,
    classify,
)


def task_error(cause: BaseException) -> rex.RayTaskError:
    """A RayTaskError as a worker builds it (pid/ip given so nothing is looked up)."""
    return rex.RayTaskError(
        function_name="f", traceback_str="tb", cause=cause, proctitle="ray::f", pid=1234, ip="10.0.0.1"
    )


def test_task_error_helper_keeps_its_cause():
    err = task_error(ValueError("x"))
    assert isinstance(err.cause, ValueError) and str(err.cause) == "x"


@pytest.mark.parametrize(
    "exc,outcome",
    [
        (rex.ActorDiedError(), Outcome.PREEMPTED),
        (rex.ActorUnavailableError("unreachable", None), Outcome.PREEMPTED),
        (rex.NodeDiedError("node n1 died"), Outcome.PREEMPTED),
        (rex.WorkerCrashedError(), Outcome.PREEMPTED),
        (rex.OutOfMemoryError("oom"), Outcome.PREEMPTED),
        (rex.LocalRayletDiedError(), Outcome.PREEMPTED),
        (task_error(ValueError("x")), Outcome.FAILED),
        (task_error(ValueError("x")).as_instanceof_cause(), Outcome.FAILED),  # what ray.get raises
        (task_error(rex.ActorDiedError()), Outcome.PREEMPTED),  # a gang process calling a dead one
        (task_error(rex.ActorDiedError()).as_instanceof_cause(), Outcome.PREEMPTED),
        (task_error(rex.NodeDiedError("gone")), Outcome.PREEMPTED),
        (rex.TaskCancelledError(), Outcome.CANCELLED),
        (KeyboardInterrupt(), Outcome.CANCELLED),
        (rex.GetTimeoutError(), Outcome.TIMEOUT),
        (TimeoutError("slow"), Outcome.TIMEOUT),
        (ReservationTimeout("no slice in time"), Outcome.TIMEOUT),
        (ValueError("boom"), Outcome.FAILED),
        (RuntimeError("boom"), Outcome.FAILED),
        (NoMatchingSlice("none"), Outcome.FAILED),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else v.value,
)
def test_classify(exc, outcome):
    assert classify(exc) is outcome


@pytest.mark.parametrize("outcome", list(Outcome))
def test_gang_error_keeps_its_outcome(outcome):
    err = GangError("host rank 1 lost", outcome, rank=1)
    assert classify(err) is outcome
    assert (err.outcome, err.rank, str(err)) == (outcome, 1, "host rank 1 lost")


def test_gang_error_rank_defaults_to_none():
    assert GangError("x", Outcome.TIMEOUT).rank is None


def test_outcome_values():
    assert [o.value for o in Outcome] == ["ok", "preempted", "failed", "cancelled", "timeout"]
    assert Outcome.FAILED == "failed"  # a str enum


def test_user_timeout_inside_a_task_is_failed():
    raised_by_get = task_error(TimeoutError("socket timed out")).as_instanceof_cause()
    assert classify(task_error(TimeoutError("socket timed out"))) is Outcome.FAILED
    assert classify(raised_by_get) is Outcome.FAILED


def test_actor_creation_failure_is_failed():
    err = rex.ActorDiedError(task_error(ValueError("bad config")))
    assert err.actor_init_failed
    assert classify(err) is Outcome.FAILED


def test_error_hierarchy():
    assert issubclass(ReservationError, RaysliceError)
    assert issubclass(NoMatchingSlice, ReservationError)
    assert issubclass(ReservationTimeout, ReservationError)
    assert issubclass(ReservationTimeout, TimeoutError)
    assert issubclass(GangError, RaysliceError)
    assert not issubclass(NoMatchingSlice, TimeoutError)


def test_reservation_timeout_caught_as_builtin_timeout():
    with pytest.raises(TimeoutError):
        raise ReservationTimeout("waited 30 s")


def test_report_is_in_the_message():
    report = "request: 1 x v4 2x2x2\n  - a: busy: host 1 has 0/4 chips free"
    err = ReservationTimeout("no v4 2x2x2 slice became free in 30 s", report)
    assert err.report == report
    assert str(err) == "no v4 2x2x2 slice became free in 30 s\n" + report
    assert "a: busy: host 1 has 0/4 chips free" in str(err)


def test_no_report_no_trailing_newline():
    err = NoMatchingSlice("no v6e 4x4 slice")
    assert err.report == ""
    assert str(err) == "no v6e 4x4 slice"


def test_module_doctests():
    result = doctest.testmod(errors_mod)
    assert result.failed == 0
    assert result.attempted > 0
