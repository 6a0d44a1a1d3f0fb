"""Exceptions and failure outcomes shared by every rayslice layer.

Failures are values: code that catches a Ray error calls :func:`classify` once
and branches on the :class:`Outcome`, instead of string-matching messages at
each call site.

Example:
    >>> classify(ValueError("boom"))
    <Outcome.FAILED: 'failed'>
"""

from __future__ import annotations

import dataclasses
import enum


class RaysliceError(Exception):
    """Base class of rayslice's own errors."""


class InvalidArgument(RaysliceError, TypeError, ValueError):
    """A public config or entry point was given a bad value.

    It is both a ``TypeError`` and a ``ValueError``, so code that caught
    either keeps working; the message names the parameter, shows the bad
    value and says what is valid.
    """


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


@dataclasses.dataclass(frozen=True)
class RunOutcome:
    """How one unit of distributed work ended, as a value: outcome, error, timing.

    Returned by the training controller's attempts and the serve replica's
    calls alike, instead of bare tuples or exceptions to string-match.

    Attributes:
        outcome: How it ended.
        error: The exception behind a non-OK outcome (None when OK).
        elapsed_s: Seconds the work ran.
        lost_s: Seconds of work done since the last durable point (the last
            report or checkpoint) that the failure threw away.
        rank: The host rank that failed first, when known.

    Example:
        >>> r = RunOutcome.of(ValueError("bad batch"), elapsed_s=1.5)
        >>> r.outcome, r.ok, r.message
        (<Outcome.FAILED: 'failed'>, False, 'ValueError: bad batch')
        >>> RunOutcome.success(2.0).ok
        True
    """

    outcome: Outcome
    error: BaseException | None = None
    elapsed_s: float = 0.0
    lost_s: float = 0.0
    rank: int | None = None

    @classmethod
    def of(
        cls, exc: BaseException, *, elapsed_s: float = 0.0, lost_s: float = 0.0, outcome: Outcome | None = None
    ) -> RunOutcome:
        """The outcome of a failure: :func:`classify` decides unless ``outcome`` is given."""
        return cls(outcome or classify(exc), exc, elapsed_s, lost_s, getattr(exc, "rank", None))

    @classmethod
    def success(cls, elapsed_s: float = 0.0) -> RunOutcome:
        return cls(Outcome.OK, None, elapsed_s)

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.OK

    @property
    def message(self) -> str:
        """One line: the user's own exception when Ray wrapped one ("" when OK)."""
        return describe(self.error)


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
