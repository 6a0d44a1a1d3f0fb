"""Progress display for long waits (private).

Short waits stay silent; a wait that lasts longer than ``quiet_s`` shows one
live line (rich) saying what it waits for, how long it has waited, the
deadline, and the first reason from the plan.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any


class WaitDisplay:
    """A live status line that appears once a wait gets long.

    Args:
        what: What is being waited for.
        enabled: False makes it a no-op.
        quiet_s: Waits shorter than this show nothing.
        clock: Monotonic clock.
    """

    def __init__(self, what: str, *, enabled: bool = True, quiet_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic, publish_every_s: float = 5.0) -> None:
        self.what = what
        self.enabled = enabled
        self.quiet_s = quiet_s
        self._clock = clock
        self._start = clock()
        self._status: Any = None
        self._last_publish: float | None = None
        self._publish_every_s = publish_every_s
        self.shown = False

    def update(self, plan: Any, deadline: Any) -> bool:
        """Refreshes the line; returns True when the wait should be (re)published."""
        now = self._clock()
        if now - self._start < self.quiet_s:
            return False
        self.shown = True
        if self.enabled:
            reasons = [v for v in plan.verdicts if v.matches_shape] or list(plan.verdicts)
            why = str(reasons[0]) if reasons else "no TPU slices in the cluster"
            if len(reasons) > 1:
                why += f" (+{len(reasons) - 1} more)"
            limit = "" if deadline.timeout_s is None else f" / {deadline.timeout_s:.0f} s"
            text = f"{self.what}: waited {deadline.elapsed:.0f} s{limit} — {why}"
            if self._status is None:
                from rich.console import Console

                self._status = Console(file=sys.stderr).status(text)
                self._status.start()
            else:
                self._status.update(text)
        if self._last_publish is None or now - self._last_publish >= self._publish_every_s:
            self._last_publish = now
            return True
        return False

    def close(self) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None
