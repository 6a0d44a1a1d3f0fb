"""Failure detection inside the gang: heartbeats and a step-progress deadline.

Ray declares a node dead only after its health checks fail (about 15-30 s
with Ray's production settings), and a host whose collective is stuck never
dies at all. So each host process of a training attempt runs a
:class:`HeartbeatPublisher`: a daemon thread that writes a small record
(a sequence number, the last completed step, a phase) to Ray's internal
key-value store (held by the GCS) every ``period_s``. The driver reads the
records with :func:`read_beats` and feeds them to a :class:`HeartbeatMonitor`,
pure bookkeeping on the driver's own monotonic clock (no clock is ever
compared across machines: only *when the driver saw a record change*), which
says:

- **lost**: a host's record stopped changing for ``heartbeat_timeout_s``
  (its process, or its VM, is gone; Ray may still list the node as alive).
  Given a ``reachable`` check (the driver's is a
  :class:`~rayslice.train.liveness.NodeProbe` of the host's machine), a silent
  host whose machine still answers is given up to ``live_grace_s`` instead:
  its process is alive but busy (holding its GIL), not lost;
- **hung**: every host is alive but no step completed on some host for
  ``step_timeout_s`` (a stuck collective, a wedged device). The first step of
  an attempt (compile, restore) and the final checkpoint wait are not timed.

Example:
    >>> now = [0.0]
    >>> m = HeartbeatMonitor(world_size=2, heartbeat_timeout_s=1.0, step_timeout_s=None, clock=lambda: now[0])
    >>> m.observe({0: {"seq": 1, "step": 1, "phase": "step"}, 1: {"seq": 1, "step": 1, "phase": "step"}})
    >>> now[0] = 2.0
    >>> m.observe({0: {"seq": 2, "step": 2, "phase": "step"}, 1: {"seq": 1, "step": 1, "phase": "step"}})
    >>> v = m.check()                     # rank 1's record has not changed for 2 s
    >>> v.kind, v.ranks, v.silent_s
    ('lost', (1,), 2.0)
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rayslice.train.liveness import LIVE_HOST_GRACE_S

logger = logging.getLogger(__name__)

#: Ray internal-KV namespace of heartbeat records.
NAMESPACE = "rayslice-heartbeat"
#: A host gets this long (driver clock) for its first record after its attempt starts.
FIRST_BEAT_GRACE_S = 10.0


def heartbeat_key(run_id: str, attempt: int, rank: int) -> str:
    """The internal-KV key of one host's heartbeat record.

    Example:
        >>> heartbeat_key("ab12", 2, 1)
        'ab12/2/1'
    """
    return f"{run_id}/{attempt}/{rank}"


def period_for(heartbeat_timeout_s: float) -> float:
    """How often a host publishes: a quarter of the timeout, at most 0.25 s.

    Example:
        >>> period_for(1.0), period_for(0.4)
        (0.25, 0.1)
    """
    return min(0.25, heartbeat_timeout_s / 4)


class HeartbeatPublisher:
    """A daemon thread publishing this host's liveness and progress (runs in a gang process).

    Args:
        key: Its :func:`heartbeat_key`.
        period_s: Seconds between records.
        progress: Returns ``(last completed step, phase)``; read at every beat.
        put: Writes ``(key, bytes)``; default: Ray's internal KV (namespace :data:`NAMESPACE`).
        watch: The ident of the thread running the training function: each
            record then says where that thread is (:func:`where_is`), so a
            hung gang's error names the host stuck in user code apart from the
            ones waiting for it inside a JAX collective.

    A store that cannot be reached is reported once (a warning) and retried;
    it never stops the training function.

    Example:
        >>> seen = []
        >>> p = HeartbeatPublisher("k", 0.01, lambda: (3, "step"), put=lambda k, v: seen.append(v)).start()
        >>> p.stop()
        >>> json.loads(seen[0])["step"]
        3
    """

    def __init__(
        self,
        key: str,
        period_s: float,
        progress: Callable[[], tuple[int, str]],
        put: Callable[[str, bytes], None] | None = None,
        watch: int | None = None,
    ) -> None:
        self.key = key
        self._watch = watch
        self.period_s = period_s
        self._progress = progress
        self._put = put or _kv_put
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._seq = 0
        self._warned = False

    def start(self) -> HeartbeatPublisher:
        self.beat()  # the first record before the training function starts
        self._thread = threading.Thread(target=self._run, name="rayslice-heartbeat", daemon=True)
        self._thread.start()
        return self

    def beat(self) -> None:
        """Publishes one record now."""
        self._seq += 1
        step, phase = self._progress()
        record: dict[str, Any] = {"seq": self._seq, "step": step, "phase": phase}
        if self._watch is not None:
            record["where"], record["in_jax"] = where_is(self._watch)
        try:
            self._put(self.key, json.dumps(record).encode())
        except Exception as e:  # the store is unreachable: say so once, keep training
            if not self._warned:
                self._warned = True
                logger.warning(
                    "heartbeat %s cannot be published (%s); the driver will treat this host as lost "
                    "if it stays unreachable",
                    self.key,
                    e,
                )

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.beat()

    def stop(self) -> None:
        """Stops the thread (idempotent); the last record stays for the driver to read."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None


def where_is(thread_id: int) -> tuple[str | None, bool]:
    """Where a thread is now: ``("function (file:line)", inside JAX?)`` of its innermost Python frame.

    "Inside JAX" means that frame belongs to the ``jax`` or ``jaxlib`` package:
    the thread waits in a JAX call (a collective, a transfer, a device sync),
    not in its own code. ``(None, False)`` if the thread is gone.

    Example:
        >>> here, in_jax = where_is(threading.get_ident())
        >>> here.startswith("where_is ("), in_jax
        (True, False)
    """
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return None, False
    code = frame.f_code
    return f"{code.co_name} ({os.path.basename(code.co_filename)}:{frame.f_lineno})", _in_jax(code.co_filename)


def _in_jax(filename: str) -> bool:
    for name in ("jax", "jaxlib"):
        module = sys.modules.get(name)
        where = getattr(module, "__file__", None)
        if where and filename.startswith(os.path.dirname(where) + os.sep):
            return True
    return False


def _kv_put(key: str, value: bytes) -> None:
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(key, value, overwrite=True, namespace=NAMESPACE)


def read_beats(keys: Sequence[str]) -> dict[int, dict[str, Any]]:
    """Reads the records of ``keys`` (rank order) from Ray's internal KV; missing ones are left out."""
    from ray.experimental import internal_kv

    out = {}
    for rank, key in enumerate(keys):
        raw = internal_kv._internal_kv_get(key, namespace=NAMESPACE)
        if raw:
            out[rank] = json.loads(raw)
    return out


def delete_beats(keys: Sequence[str]) -> None:
    """Removes heartbeat records (the driver does, when an attempt ends)."""
    from ray.experimental import internal_kv

    for key in keys:
        try:
            internal_kv._internal_kv_del(key, namespace=NAMESPACE)
        except Exception:  # the cluster is gone: nothing to clean
            return


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What the monitor found wrong.

    Attributes:
        kind: ``"lost"`` (heartbeats stopped) or ``"hung"`` (no step progress).
        ranks: The hosts concerned, in rank order.
        silent_s: For "lost", how long the first of them has been silent; for
            "hung", how long no step has completed.
        step: For "hung", the step the stuck hosts last completed.
        answering: For "lost", those of ``ranks`` whose machine answered
            while they were silent (then silent past the monitor's
            ``live_grace_s``: stuck, or dead on a live machine).
        where: For "hung", per host of ``ranks``, where its training thread
            was at its last record (``"function (file:line)"``, ``" in JAX"``
            appended when it waits inside a JAX call), or None if not known.
            Hosts in their own code come first: they are the likely cause,
            the others wait for them in a collective.
    """

    kind: str
    ranks: tuple[int, ...]
    silent_s: float
    step: int | None = None
    where: tuple[str | None, ...] = ()
    answering: tuple[int, ...] = ()

    def message(
        self,
        heartbeat_timeout_s: float,
        step_timeout_s: float | None,
        where: Callable[[int], str] = lambda r: f"rank {r}",
    ) -> str:
        hosts = ", ".join(where(r) for r in self.ranks)
        if self.kind == "lost":
            why = (
                f"its machine answered past the timeout but the process stayed silent for over {self.silent_s:.0f} s: "
                "it is stuck (its Python threads cannot run) or dead"
                if self.answering and set(self.answering) == set(self.ranks)
                else "the host process or its machine is gone"
            )
            return (
                f"{hosts} stopped sending heartbeats {self.silent_s:.1f} s ago (heartbeat_timeout_s="
                f"{heartbeat_timeout_s:g}): {why}"
            )
        if len(self.where) == len(self.ranks):  # where each one is, the likely cause first
            spots = zip(self.ranks, self.where, strict=True)
            hosts = "; ".join(f"{where(r)} at {w}" if w else where(r) for r, w in spots)
        alive = "the host is alive" if len(self.ranks) == 1 else "the hosts are alive"
        return (
            f"no step completed for {self.silent_s:.1f} s after step {self.step} (step_timeout_s={step_timeout_s:g}) "
            f"on {hosts}: {alive} but hung (a stuck collective?)"
        )


class HeartbeatMonitor:
    """Driver-side bookkeeping of heartbeat records (pure: clock injected).

    Args:
        world_size: Hosts in the attempt.
        heartbeat_timeout_s: Silence after which a host is lost.
        step_timeout_s: Time without a completed step after which the gang is
            hung (None: not checked).
        start_step: The step the attempt resumes from (its first step is not timed).
        clock: The driver's monotonic clock.
        reachable: ``ranks -> those whose machine still answers``, asked (once
            per check, for all of them) only of hosts that have beaten at least
            once, are silent beyond ``heartbeat_timeout_s`` and still within
            ``live_grace_s``; None: silence alone decides.
        live_grace_s: How long a silent host whose machine answers may stay
            silent before it is lost anyway (at least ``heartbeat_timeout_s``).

    Example:
        >>> now = [0.0]
        >>> m = HeartbeatMonitor(2, 1.0, None, clock=lambda: now[0], reachable=lambda ranks: {1} & set(ranks))
        >>> m.observe({0: {"seq": 1}, 1: {"seq": 1}})
        >>> now[0] = 1.5
        >>> m.check().ranks, m.spared            # rank 0's machine is gone; rank 1's answers: busy
        ((0,), {1: 1.5})
        >>> now[0] = 11.0
        >>> m.check().ranks                      # past live_grace_s (10 s), busy or not
        (0, 1)
    """

    def __init__(
        self,
        world_size: int,
        heartbeat_timeout_s: float,
        step_timeout_s: float | None,
        start_step: int = 0,
        clock: Callable[[], float] = time.monotonic,
        reachable: Callable[[Sequence[int]], set[int]] | None = None,
        live_grace_s: float = LIVE_HOST_GRACE_S,
    ) -> None:
        self._clock = clock
        self.world_size = world_size
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._reachable = reachable
        self.live_grace_s = max(live_grace_s, heartbeat_timeout_s)
        self.spared: dict[int, float] = {}  # rank -> its longest silence let pass because its machine answered
        self.step_timeout_s = step_timeout_s
        self.start_step = start_step
        now = clock()
        self._started = now
        self._seq: dict[int, int] = {}
        self._seen: dict[int, float] = {}  # rank -> driver time its record last changed
        self._step: dict[int, int] = {}
        self._phase: dict[int, str] = {}
        self._where: dict[int, tuple[str, bool]] = {}
        self._progress_at: dict[int, float] = {}  # rank -> driver time its step last advanced
        self.finished: set[int] = set()
        self.last_seen: dict[int, float] = {}

    def observe(self, beats: Mapping[int, Mapping[str, Any]]) -> None:
        """Takes the records just read (rank -> record)."""
        now = self._clock()
        for rank, b in beats.items():
            if self._seq.get(rank) != b["seq"]:
                self._seq[rank] = b["seq"]
                self._seen[rank] = now
            step = int(b.get("step", 0))
            if step != self._step.get(rank):
                self._step[rank] = step
                self._progress_at[rank] = now
            self._phase[rank] = str(b.get("phase", "step"))
            if b.get("where"):
                self._where[rank] = (str(b["where"]), bool(b.get("in_jax")))

    def finish(self, rank: int) -> None:
        """This host's training function returned: it stops beating on purpose."""
        self.finished.add(rank)

    def check(self, probe: bool = True) -> Verdict | None:
        """A :class:`Verdict` if a host is lost or the gang is hung, else None.

        ``probe=False``: silence alone decides (the caller already has other
        evidence of a loss, e.g. a peer's collective failed).
        """
        now = self._clock()
        overdue = []  # (rank, silence, may be spared)
        for rank in range(self.world_size):
            if rank in self.finished or self._phase.get(rank) == "done":
                continue
            seen = self._seen.get(rank)
            limit = self.heartbeat_timeout_s if seen is not None else max(FIRST_BEAT_GRACE_S, self.heartbeat_timeout_s)
            since = now - (self._started if seen is None else seen)
            if since > limit:
                overdue.append((rank, since, seen is not None and since <= self.live_grace_s))
        spareable = [r for r, _, ok in overdue if ok]
        answers = self._reachable(spareable) if probe and spareable and self._reachable is not None else set()
        for rank, since, _ in overdue:
            if rank in answers:  # alive but busy (its GIL held off its heartbeat thread): not lost yet
                self.spared[rank] = max(since, self.spared.get(rank, 0.0))
        lost = [(r, since) for r, since, _ in overdue if r not in answers]
        if lost:
            # Answered while silent, then silent past the grace (not probed again): stuck, or dead on a live
            # machine. One that answered before but not now (its machine went since) is simply gone.
            answering = tuple(r for r, since in lost if r in self.spared and since > self.live_grace_s)
            return Verdict("lost", tuple(r for r, _ in lost), max(s for _, s in lost), answering=answering)
        if self.step_timeout_s is None:
            return None
        timed = {}
        for rank in range(self.world_size):
            step = self._step.get(rank)
            # Not timed: finished hosts, the first step of the attempt, the final checkpoint wait.
            if rank in self.finished or step is None or step <= self.start_step or self._phase.get(rank) != "step":
                continue
            timed[rank] = (now - self._progress_at[rank], step)
        over = [step for since, step in timed.values() if since > self.step_timeout_s]
        if not over:
            return None
        # Every host still at the stuck step is stuck with it (the others may have been seen
        # reaching it a poll later); the ones in their own code first, then those waiting in JAX.
        at = min(over)
        waiting = {r for r, (_, in_jax) in self._where.items() if in_jax}
        stuck = sorted((r for r, (_, step) in timed.items() if step == at), key=lambda r: r in waiting)
        return Verdict("hung", tuple(stuck), max(timed[r][0] for r in stuck), at, tuple(map(self._spot, stuck)))

    def _spot(self, rank: int) -> str | None:
        if rank not in self._where:
            return None
        where, in_jax = self._where[rank]
        return f"{where} in JAX" if in_jax else where

    def silent_s(self, rank: int) -> float:
        """Seconds since ``rank``'s record last changed (since the start if never)."""
        return self._clock() - self._seen.get(rank, self._started)


__all__ = ["HeartbeatMonitor", "HeartbeatPublisher", "Verdict", "delete_beats", "heartbeat_key", "read_beats"]
