"""Deadlines for every wait in rayslice (private).

Every loop that waits on a condition takes a ``Deadline`` so that it can never
wait forever, and takes its clock and sleep by injection so that tests can run
the logic without real time passing.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class DeadlineExceeded(TimeoutError):
    """A wait ran past its deadline."""


class Deadline:
    """A point in time after which a wait gives up.

    Args:
        timeout_s: Seconds from now; ``None`` means no limit (use sparingly).
        clock: Monotonic clock.
        sleep: Sleep function, paired with ``clock``.

    Example:
        >>> d = Deadline(5.0)
        >>> d.expired, 0 < d.remaining <= 5.0
        (False, True)
    """

    def __init__(
        self,
        timeout_s: float | None,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if timeout_s is not None and not timeout_s >= 0:  # also rejects NaN
            raise ValueError(f"timeout_s={timeout_s} must be a number >= 0, or None")
        self._clock = clock
        self._sleep = sleep
        self.start = clock()
        self.timeout_s = timeout_s
        self.end = None if timeout_s is None else self.start + timeout_s

    @property
    def elapsed(self) -> float:
        return self._clock() - self.start

    @property
    def remaining(self) -> float:
        """Seconds left (``inf`` without a limit), never negative."""
        if self.end is None:
            return float("inf")
        return max(0.0, self.end - self._clock())

    @property
    def expired(self) -> bool:
        return self.end is not None and self._clock() >= self.end

    def sleep_or_raise(self, interval: float, message: str) -> None:
        """Sleeps ``interval`` (capped at what is left), or raises when expired."""
        if self.expired:
            raise DeadlineExceeded(f"{message} (after {self.elapsed:.1f} s)")
        self._sleep(min(interval, self.remaining))
