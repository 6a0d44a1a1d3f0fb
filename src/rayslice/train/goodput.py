"""Goodput: where a run's wall time went.

Components: reservation wait, start-up (processes + JAX init), compile (the
first step of each attempt, restore included), productive steps, checkpoint
stall (time a step was blocked by a save), detection (from a host's last sign
of life to the driver noticing its loss, or from a step deadline to the end of
a hung step), lost work (steps recomputed after a failure, plus the unfinished
step), and
other (driver overhead, final checkpoint wait, teardown). They add up to the
wall time; ``goodput`` is productive / wall.

Example:
    >>> g = GoodputTracker(clock=iter([0.0, 10.0]).__next__)
    >>> g.add("productive", 6.0); g.add("reservation", 1.0)
    >>> round(g.finish().fraction, 2)
    0.6
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable
from typing import Any


@dataclasses.dataclass(frozen=True)
class AttemptEnd:
    """How one attempt ended.

    Attributes:
        attempt: The attempt number (1-based).
        outcome: The attempt's :class:`~rayslice.errors.Outcome` value (``"ok"``, ``"preempted"``, ...).
        reason: ``"notice"`` (a preemption notice: emergency save, clean stop),
            ``"lost"`` (a host vanished), ``"error"``, or ``""`` on success.
        step: For a notice, the step of the emergency save.
        emergency_save_s: For a notice, the seconds the save took (until complete on storage).
        notice: For a notice, its source (``"SIGTERM"``, ``"gce-preempted"``, ``"gce-maintenance"``, ``"ray-drain"``).

    Example:
        >>> AttemptEnd(1, "preempted", "notice", step=8, emergency_save_s=0.4, notice="SIGTERM").reason
        'notice'
    """

    attempt: int
    outcome: str
    reason: str = ""
    step: int | None = None
    emergency_save_s: float | None = None
    notice: str | None = None


COMPONENTS = ("reservation", "startup", "compile", "productive", "checkpoint_stall", "detection", "lost", "other")


@dataclasses.dataclass(frozen=True)
class Goodput:
    """Seconds per component; ``fraction`` = productive / wall.

    Attributes:
        wall_s: The run's wall time.
        seconds: Seconds per component (they add up to ``wall_s``).
        steps: The last step reached.
        lost_steps: Steps computed twice (after a failure).
        attempts: Seconds per component of each attempt, in order (what
            happened between attempts, e.g. teardown, is in the run's "other").
    """

    wall_s: float
    seconds: dict[str, float]
    steps: int
    lost_steps: int
    attempts: tuple[dict[str, float], ...] = ()
    endings: tuple[AttemptEnd, ...] = ()

    @property
    def fraction(self) -> float:
        return self.seconds["productive"] / self.wall_s if self.wall_s > 0 else 0.0

    def table(self) -> Any:
        """A rich table of the components."""
        from rich.table import Table

        t = Table(
            title=f"goodput {100 * self.fraction:.1f}% of {self.wall_s:.1f} s "
            f"({self.steps} steps, {self.lost_steps} recomputed)",
            title_justify="left",
        )
        t.add_column("component")
        t.add_column("seconds", justify="right")
        t.add_column("share", justify="right")
        per_attempt = len(self.attempts) > 1
        if per_attempt:
            for i in range(len(self.attempts)):
                t.add_column(f"attempt {i + 1}", justify="right")
        for k in COMPONENTS:
            v = self.seconds[k]
            row = [k.replace("_", " "), f"{v:.2f}", f"{100 * v / self.wall_s:.1f}%" if self.wall_s else "-"]
            if per_attempt:
                row += ["-" if k == "other" else f"{a.get(k, 0.0):.2f}" for a in self.attempts]
            t.add_row(*row)
        return t

    def as_dict(self) -> dict[str, Any]:
        return {
            "wall_s": self.wall_s,
            "fraction": self.fraction,
            "steps": self.steps,
            "lost_steps": self.lost_steps,
            **{f"{k}_s": v for k, v in self.seconds.items()},
            "attempts": [dict(a) for a in self.attempts],
            "endings": [dataclasses.asdict(e) for e in self.endings],
        }


class GoodputTracker:
    """Accumulates components during ``fit()``; pure bookkeeping, clock injected."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._start = clock()
        self.seconds = {k: 0.0 for k in COMPONENTS}
        self.steps = 0
        self.lost_steps = 0
        # Steps of the current attempt not yet covered by a checkpoint: (step, seconds).
        self._uncommitted: list[tuple[int, float]] = []
        self.attempts: list[dict[str, float]] = []
        self.endings: list[AttemptEnd] = []

    def begin_attempt(self) -> None:
        """Starts booking a new attempt (components booked before the first go to the run only)."""
        self.attempts.append({k: 0.0 for k in COMPONENTS if k != "other"})

    def end_attempt(self, end: AttemptEnd) -> None:
        """Records how the current attempt ended."""
        self.endings.append(end)

    def add(self, component: str, seconds: float) -> None:
        if component not in self.seconds:
            raise KeyError(f"unknown goodput component {component!r}; valid: {', '.join(COMPONENTS)}")
        self.seconds[component] += max(0.0, seconds)
        if self.attempts and component in self.attempts[-1]:
            self.attempts[-1][component] += max(0.0, seconds)

    def timed(self, component: str) -> _Timer:
        return _Timer(self, component)

    def on_reports(self, reports: Iterable[dict[str, Any]]) -> None:
        """Books rank 0's step reports (see ``rayslice.train.worker.report``)."""
        for r in reports:
            self.add("checkpoint_stall", r["stall_s"])
            work = max(0.0, r["step_s"] - r["stall_s"])
            if r["first"]:
                self.add("compile", work)
            else:
                self.add("productive", work)
            self.steps = max(self.steps, r["step"])
            self._uncommitted.append((r["step"], 0.0 if r["first"] else work))

    def on_failure(self, restore_step: int | None, unreported_s: float, detection_s: float = 0.0) -> None:
        """Moves steps after ``restore_step`` (they will be recomputed) to lost work.

        ``unreported_s`` is the time since the last report; the part of it
        spent noticing the failure (``detection_s``) is booked as detection.
        """
        base = restore_step or 0
        lost = [(s, w) for s, w in self._uncommitted if s > base]
        moved = sum(w for _, w in lost)
        self.seconds["productive"] -= moved
        if self.attempts:
            self.attempts[-1]["productive"] -= moved
        detection = min(max(0.0, detection_s), max(0.0, unreported_s))
        self.add("detection", detection)
        self.add("lost", moved + unreported_s - detection)
        self.lost_steps += len(lost)
        self._uncommitted = []

    def snapshot(self) -> Goodput:
        """The components so far ("other" holds the rest of the elapsed time)."""
        wall = self._clock() - self._start
        seconds = dict(self.seconds)
        seconds["other"] = max(0.0, wall - sum(v for k, v in seconds.items() if k != "other"))
        return Goodput(
            wall_s=wall,
            seconds=seconds,
            steps=self.steps,
            lost_steps=self.lost_steps,
            attempts=tuple(dict(a) for a in self.attempts),
            endings=tuple(self.endings),
        )

    def finish(self) -> Goodput:
        wall = self._clock() - self._start
        known = sum(v for k, v in self.seconds.items() if k != "other")
        self.seconds["other"] = max(0.0, wall - known)
        return Goodput(
            wall_s=wall,
            seconds=dict(self.seconds),
            steps=self.steps,
            lost_steps=self.lost_steps,
            attempts=tuple(dict(a) for a in self.attempts),
            endings=tuple(self.endings),
        )


class _Timer:
    def __init__(self, tracker: GoodputTracker, component: str) -> None:
        self.tracker, self.component = tracker, component

    def __enter__(self) -> _Timer:
        self.t0 = self.tracker._clock()
        return self

    def __exit__(self, *exc: object) -> None:
        self.tracker.add(self.component, self.tracker._clock() - self.t0)
