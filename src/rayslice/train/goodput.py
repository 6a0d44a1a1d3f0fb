"""Goodput: where a run's wall time went.

Components: reservation wait (an attempt after the first: the
re-reservation), start-up (processes + JAX init, and the part of each
attempt's first step that is neither compile nor restore: the loop's set-up,
its first batch and first execution), compile (what JAX itself measures in
rank 0's process: Python tracing, lowering and the XLA compile or its load
from the persistent cache, in any step; workers that send no such figures
book their whole first step, restore excluded), restore (time inside
``restore()`` on rank 0, from the RAM tier or from storage), productive
steps, checkpoint stall
(time a step was blocked by a save), detection (from a host's last sign of
life to the driver noticing its loss, or from a step deadline to the end of a
hung step), lost work (steps recomputed after a failure, plus the unfinished
step), and other (driver overhead, final checkpoint wait, teardown). They add
up to the wall time; ``goodput`` is productive / wall. :attr:`Goodput.recovery`
sums what the restarts cost, by cause. :attr:`Goodput.compiles` splits each
attempt's compile into XLA (compile or cache load) and trace + lower, with
the persistent cache's hits and misses.

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

from rayslice.train.elastic import ResizeEvent


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


COMPONENTS = (
    "reservation",
    "startup",
    "compile",
    "restore",
    "productive",
    "checkpoint_stall",
    "detection",
    "lost",
    "other",
)
#: What a restart costs, by cause (:attr:`Goodput.recovery`).
RECOVERY = ("detection", "re_reservation", "startup", "compile", "restore", "lost")
#: JAX's compile figures per attempt (:attr:`Goodput.compiles`).
COMPILE_KEYS = ("xla_s", "trace_lower_s", "cache_hits", "cache_misses")


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
            The reservation of attempt 2 and later is the re-reservation.
        endings: How each attempt ended.
        restore_tiers: Where each attempt resumed from: ``"ram"``,
            ``"storage"`` or ``"none"`` (a fresh start).
        resizes: Each resize of an elastic run, in order
            (:class:`~rayslice.train.elastic.ResizeEvent`: time, slices
            before/after, reason, seconds lost).
        compiles: Per attempt, JAX's compile figures (keys :data:`COMPILE_KEYS`):
            ``xla_s`` (XLA compile or persistent-cache load), ``trace_lower_s``
            (tracing + lowering), ``cache_hits`` and ``cache_misses``. Inside
            the "compile" component, not beside it.
    """

    wall_s: float
    seconds: dict[str, float]
    steps: int
    lost_steps: int
    attempts: tuple[dict[str, float], ...] = ()
    endings: tuple[AttemptEnd, ...] = ()
    restore_tiers: tuple[str, ...] = ()
    resizes: tuple[ResizeEvent, ...] = ()
    compiles: tuple[dict[str, float], ...] = ()

    @property
    def fraction(self) -> float:
        return self.seconds["productive"] / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def recovery(self) -> dict[str, float]:
        """Seconds the restarts cost, by cause (keys :data:`RECOVERY`).

        Detection and lost work of every failure; the re-reservation,
        start-up, compile and restore of every attempt after the first.

        Example:
            >>> g = Goodput(10.0, {k: 0.0 for k in COMPONENTS}, 4, 1,
            ...             attempts=({"reservation": 1.0, "lost": 0.5}, {"reservation": 0.3, "restore": 0.1}))
            >>> g.recovery["re_reservation"], g.recovery["restore"], g.recovery["lost"]
            (0.3, 0.1, 0.5)
        """
        later = self.attempts[1:]
        return {
            "detection": sum(a.get("detection", 0.0) for a in self.attempts),
            "re_reservation": sum(a.get("reservation", 0.0) for a in later),
            "startup": sum(a.get("startup", 0.0) for a in later),
            "compile": sum(a.get("compile", 0.0) for a in later),
            "restore": sum(a.get("restore", 0.0) for a in later),
            "lost": sum(a.get("lost", 0.0) for a in self.attempts),
        }

    def recovery_line(self) -> str:
        """The recovery costs in one line ("" without a restart).

        Example:
            >>> g = Goodput(10.0, {k: 0.0 for k in COMPONENTS}, 4, 1,
            ...             attempts=({"reservation": 1.0, "lost": 0.5}, {"reservation": 0.3, "restore": 0.1}),
            ...             restore_tiers=("none", "ram"))
            >>> g.recovery_line()  # doctest: +ELLIPSIS
            'recovery (1 restart): detection 0.00 s, re-reservation 0.30 s, ... restore 0.10 s (ram), lost work 0.50 s'
            >>> g = dataclasses.replace(g, resizes=(ResizeEvent(12.5, 40, 3, 2, "lost", 2.25, 1),))
            >>> g.recovery_line().split("; resizes: ")[-1]
            '3 -> 2 slices at 12.5 s (lost; step 40, 2.25 s lost)'
        """
        restarts = len(self.attempts) - 1
        if restarts < 1:
            return ""
        r = self.recovery
        tiers = [t for t in self.restore_tiers[1:] if t]
        names = {"re_reservation": "re-reservation", "lost": "lost work"}
        parts = [
            f"{names.get(k, k)} {r[k]:.2f} s" + (f" ({', '.join(tiers)})" if k == "restore" and tiers else "")
            for k in RECOVERY
        ]
        line = f"recovery ({restarts} restart{'s' if restarts > 1 else ''}): " + ", ".join(parts)
        return line + (f"; resizes: {', '.join(str(e) for e in self.resizes)}" if self.resizes else "")

    def table(self) -> Any:
        """A rich table of the components."""
        from rich.table import Table

        t = Table(
            title=f"goodput {100 * self.fraction:.1f}% of {self.wall_s:.1f} s "
            f"({self.steps} steps, {self.lost_steps} recomputed)",
            title_justify="left",
            caption=self.recovery_line() or None,
            caption_justify="left",
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
            label = k.replace("_", " ")
            if per_attempt and k == "reservation":
                label = "reservation (2+: re-reservation)"
            row = [label, f"{v:.2f}", f"{100 * v / self.wall_s:.1f}%" if self.wall_s else "-"]
            if per_attempt:
                for i, a in enumerate(self.attempts):
                    cell = "-" if k == "other" else f"{a.get(k, 0.0):.2f}"
                    tier = self.restore_tiers[i] if i < len(self.restore_tiers) else ""
                    if k == "restore" and tier in ("ram", "storage"):
                        cell += f" {tier}"
                    row.append(cell)
            t.add_row(*row)
            if k == "compile" and any(c["cache_hits"] + c["cache_misses"] or c["xla_s"] for c in self.compiles):
                parts = (("  of which XLA (cache hits/misses)", "xla_s"), ("  of which trace + lower", "trace_lower_s"))
                for label, key in parts:
                    total = sum(c[key] for c in self.compiles)
                    row = [label, f"{total:.2f}", f"{100 * total / self.wall_s:.1f}%" if self.wall_s else "-"]
                    if per_attempt:
                        for i in range(len(self.attempts)):
                            c = self.compiles[i] if i < len(self.compiles) else dict.fromkeys(COMPILE_KEYS, 0)
                            hits = f" ({c['cache_hits']:.0f}/{c['cache_misses']:.0f})" if key == "xla_s" else ""
                            row.append(f"{c[key]:.2f}{hits}")
                    elif key == "xla_s":
                        c = self.compile_totals
                        row[0] = f"  of which XLA ({c['cache_hits']:.0f} cache hits / {c['cache_misses']:.0f} misses)"
                    t.add_row(*row, style="dim")
        return t

    @property
    def compile_totals(self) -> dict[str, float]:
        """:attr:`compiles` summed over the attempts.

        Example:
            >>> g = Goodput(1.0, {k: 0.0 for k in COMPONENTS}, 1, 0,
            ...             compiles=({"xla_s": 2.0, "trace_lower_s": 1.0, "cache_hits": 0, "cache_misses": 4},
            ...                       {"xla_s": 0.25, "trace_lower_s": 1.0, "cache_hits": 4, "cache_misses": 0}))
            >>> g.compile_totals["xla_s"], g.compile_totals["cache_hits"]
            (2.25, 4)
        """
        return {k: sum(c.get(k, 0) for c in self.compiles) for k in COMPILE_KEYS}

    def as_dict(self) -> dict[str, Any]:
        return {
            "wall_s": self.wall_s,
            "fraction": self.fraction,
            "steps": self.steps,
            "lost_steps": self.lost_steps,
            **{f"{k}_s": v for k, v in self.seconds.items()},
            "attempts": [dict(a) for a in self.attempts],
            "endings": [dataclasses.asdict(e) for e in self.endings],
            "restore_tiers": list(self.restore_tiers),
            "recovery": self.recovery,
            "resizes": [dataclasses.asdict(e) for e in self.resizes],
            "compiles": [dict(c) for c in self.compiles],
            **{f"compile_{k}": v for k, v in self.compile_totals.items()},
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
        self.restore_tiers: list[str] = []
        self.resizes: list[ResizeEvent] = []  # an elastic run's resizes (the controller keeps them current)
        self.compiles: list[dict[str, float]] = []  # per attempt; one run-wide entry if no attempt was begun

    def begin_attempt(self) -> None:
        """Starts booking a new attempt (components booked before the first go to the run only)."""
        self.attempts.append({k: 0.0 for k in COMPONENTS if k != "other"})
        self.restore_tiers.append("")
        self.compiles.append(dict.fromkeys(COMPILE_KEYS, 0))

    def note_restore(self, tier: str) -> None:
        """Where the current attempt resumes from (``"ram"``, ``"storage"`` or ``"none"``)."""
        if self.restore_tiers:
            self.restore_tiers[-1] = tier

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
            restore = min(max(0.0, float(r.get("restore_s") or 0.0)), max(0.0, r["step_s"] - r["stall_s"]))
            self.add("restore", restore)
            work = max(0.0, r["step_s"] - r["stall_s"] - restore)
            measured = r.get("compile")  # JAX's (xla_s, trace_lower_s, hits, misses) during this step
            if measured is None:  # not measured: the whole first step is compile
                compiled = work if r["first"] else 0.0
            else:
                xla, trace_lower, hits, misses = measured
                compiled = min(work, max(0.0, xla) + max(0.0, trace_lower))
                if not self.compiles:
                    self.compiles.append(dict.fromkeys(COMPILE_KEYS, 0))
                c = self.compiles[-1]
                c["xla_s"] += xla
                c["trace_lower_s"] += trace_lower
                c["cache_hits"] += hits
                c["cache_misses"] += misses
            self.add("compile", compiled)
            self.add("startup" if r["first"] else "productive", work - compiled)
            self.steps = max(self.steps, r["step"])
            self._uncommitted.append((r["step"], 0.0 if r["first"] else work - compiled))

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
            restore_tiers=tuple(self.restore_tiers),
            resizes=tuple(self.resizes),
            compiles=tuple(dict(c) for c in self.compiles),
        )

    def finish(self) -> Goodput:
        """The final components: :meth:`snapshot`, with "other" kept in the tracker too."""
        done = self.snapshot()
        self.seconds["other"] = done.seconds["other"]
        return done


class _Timer:
    def __init__(self, tracker: GoodputTracker, component: str) -> None:
        self.tracker, self.component = tracker, component

    def __enter__(self) -> _Timer:
        self.t0 = self.tracker._clock()
        return self

    def __exit__(self, *exc: object) -> None:
        self.tracker.add(self.component, self.tracker._clock() - self.t0)
