"""Exceptions and failure outcomes shared by every rayslice layer.

Failures are values: code that catches a Ray error calls :func:`classify` once
and branches on the :class:`Outcome`, instead of string-matching messages at
each call site.

Example:
    >>> classify(ValueError("boom"))
    <Outcome.FAILED: 'failed'>
"""

from __future__ import annotations

import enum


class RaysliceError(Exception):
    """Base class of rayslice's own errors."""


class ReservationError(RaysliceError):
    """A slice could not be reserved."""

    def __init__(self, message: str, report: str = "") -> None:
        super().__init__(message + (f"\n{report}" if report else ""))
        self.report = report


class NoMatchingSlice(ReservationError):
    """The cluster has no slice of that type and shape and nothing can add one."""


class ReservationTimeout(ReservationError, TimeoutError):
    """Matching slices exist but none became free before the deadline."""


class GangError(RaysliceError):
    """A host process of a gang failed; ``outcome`` says how."""

    def __init__(self, message: str, outcome: Outcome, *, rank: int | None = None) -> None:
        super().__init__(message)
        self.outcome = outcome
        self.rank = rank


class Outcome(str, enum.Enum):
    """How a unit of distributed work ended."""

    OK = "ok"
    PREEMPTED = "preempted"  # a host (node, VM) was lost: retry elsewhere
    FAILED = "failed"  # an error in user code or config: retrying will not help
    CANCELLED = "cancelled"  # the caller stopped it
    TIMEOUT = "timeout"  # a deadline ran out


def classify(exc: BaseException) -> Outcome:
    """Maps an exception raised by Ray (or by user code through Ray) to an outcome.

    A dead actor or node means the host went away (preemption, node failure,
    OOM-kill of the process): the work can be retried on other hosts. A task
    error wraps an exception from user code: retrying gives the same result.
    """
    import ray.exceptions as rex

    if isinstance(exc, GangError):
        return exc.outcome
    host_lost = (
        rex.ActorDiedError,
        rex.ActorUnavailableError,
        rex.NodeDiedError,
        rex.WorkerCrashedError,
        rex.OutOfMemoryError,
        rex.ObjectLostError,
        rex.LocalRayletDiedError,
    )
    if isinstance(exc, rex.RayTaskError):
        # Checked first: what ray.get raises also subclasses the user's own
        # exception type, which may be a TimeoutError. The cause can itself
        # be a lost actor (a gang process calling another); look through it.
        cause = exc.cause if isinstance(getattr(exc, "cause", None), BaseException) else None
        if cause is not None and isinstance(cause, host_lost) and not _init_failed(cause):
            return Outcome.PREEMPTED
        return Outcome.FAILED
    if isinstance(exc, KeyboardInterrupt | rex.TaskCancelledError):
        return Outcome.CANCELLED
    if isinstance(exc, rex.GetTimeoutError | TimeoutError):
        return Outcome.TIMEOUT
    if isinstance(exc, host_lost):
        # An actor whose constructor raised is a user/config error, not a lost host.
        return Outcome.FAILED if _init_failed(exc) else Outcome.PREEMPTED
    return Outcome.FAILED


def _init_failed(exc: BaseException) -> bool:
    return bool(getattr(exc, "actor_init_failed", False))


def describe(exc: BaseException | None) -> str:
    """One line for a failure: the user's own exception when Ray wrapped one.

    Example:
        >>> describe(ValueError("bad batch"))
        'ValueError: bad batch'
    """
    if exc is None:
        return ""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException) and cause is not exc:
        exc = cause
    lines = str(exc).strip().splitlines()
    text = lines[0] if lines else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
