"""One training attempt, watched from the driver (private): reports, returns, heartbeats, verdicts.

While an attempt runs, :meth:`AttemptWatch.run` loops over four things until
every host has returned or the attempt has failed:

* **reports**: one ``drain_reports`` call in flight per host (a host that does
  not answer never blocks the others'); a step every host has reported is
  complete: its checkpoint is committed and the callbacks see it;
* **returns**: each host's ``run_worker`` call ends with the loop's return
  value, a stop after a preemption notice's save, or an error;
* **heartbeats**: a :class:`~rayslice.train.heartbeat.HeartbeatMonitor` says
  when a host is lost (silent) or hung (no step); an error that may be the echo
  of a lost peer (a broken collective) waits for the heartbeats' word;
* **housekeeping**: warm processes on spare hosts, an elastic run's grow.

Each way an attempt ends is a :class:`~rayslice.errors.RunOutcome`. What the
attempt learned about its hosts goes to the run's
:class:`~rayslice.train._hosts.HostLedger`; its detection delay (how long a
lost host had been silent when the loss was declared) to
:attr:`AttemptWatch.detection_s`.

Example:
    >>> status_line({"step": 7, "metrics": {"loss": 0.123456, "lr": 1e-3, "n": 3}}, attempt=2, restarts=1)
    'step 7 | loss 0.1235, lr 0.001, n 3 | attempt 2, restarts 1'
    >>> status_line({"step": 9, "metrics": {"loss": 0.5}}, attempt=3, restarts=2, slices=(1, 2))
    'step 9 | loss 0.5 | 1/2 slices, attempt 3, restarts 2'
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

from rayslice.errors import GangError, Outcome, RunOutcome, describe
from rayslice.gang import SliceGang
from rayslice.placement import SlicePlacementGroup
from rayslice.train._elastic_run import ElasticRun, request_grow
from rayslice.train._hosts import HostLedger
from rayslice.train.checkpoint import Checkpoint, commit_pending, prune_directories, step_dir
from rayslice.train.config import CheckpointConfig, FailureConfig
from rayslice.train.elastic import GROW_REASON
from rayslice.train.goodput import GoodputTracker
from rayslice.train.heartbeat import HeartbeatMonitor, Verdict, period_for, read_beats
from rayslice.train.ramtier import RamTier
from rayslice.train.result import TrainRunContext
from rayslice.train.worker import drain_reports

# The trainer's messages, under the one name users (and their log filters) know it by.
logger = logging.getLogger("rayslice.train.controller")

_POLL_S = 0.2
_QUICK_POLL_S = 0.05  # the driver's poll while a host's heartbeat is overdue
_SHOW_EVERY_S = 0.5  # the goodput gauges and the status line, at most this often
_WARM_REFRESH_S = 5.0  # how often a running attempt looks for new spare hosts to warm


class CallbackFailed(Exception):
    """A user callback raised: the run stops with its error (no failure of the attempt's hosts)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(describe(error))
        self.error = error


def status_line(report: dict[str, Any], attempt: int, restarts: int, slices: tuple[int, int] | None = None) -> str:
    """The progress line of a reported step: its first four metrics, and the run's size when elastic.

    Args:
        report: Rank 0's report of the step (``step``, ``metrics``).
        attempt: The attempt's number.
        restarts: Restarts so far.
        slices: ``(slices now, slices asked)`` for an elastic run.
    """
    shown = ", ".join(
        f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in list(report["metrics"].items())[:4]
    )
    size = f"{slices[0]}/{slices[1]} slices, " if slices is not None else ""
    return f"step {report['step']} | {shown} | {size}attempt {attempt}, restarts {restarts}"


@dataclasses.dataclass(frozen=True)
class RunParts:
    """What lives for a whole ``fit()`` and every attempt's watch works with (built once by the trainer).

    Attributes:
        run: The run's identity and configs (what callbacks receive).
        root: The run's checkpoint directory.
        failure: The run's failure settings.
        checkpoint: The run's checkpoint settings.
        callbacks: The user's callbacks.
        exporter: The goodput gauges (``export(seconds, fraction)``).
        num_slices: Slices asked for (an elastic run's full size).
        ledger: What the run knows about its hosts.
        ram: The RAM checkpoint tier, if on.
        elastic: The elastic run, if elastic.
        status: The rich status line (None without progress output).
        say: Prints one line to the user.
        restore_seconds: ``(attempt, seconds)``: a restore's time, as rank 0 reported it.
        warm_spares: ``(spg)``: warm processes on the hosts a next attempt would take.
        grow_ready: ``(spg, target)``: whether to stop now to grow to ``target`` slices.
    """

    run: TrainRunContext
    root: str
    failure: FailureConfig
    checkpoint: CheckpointConfig
    callbacks: tuple[Any, ...]
    exporter: Any
    num_slices: int
    ledger: HostLedger
    ram: RamTier | None
    elastic: ElasticRun | None
    status: Any
    say: Callable[[str], None]
    restore_seconds: Callable[[int, float], None]
    warm_spares: Callable[[SlicePlacementGroup], None]
    grow_ready: Callable[[SlicePlacementGroup, int], bool]


class AttemptWatch:
    """Watches one attempt's hosts until they all return or the attempt fails (see the module's docstring).

    Args:
        parts: The run's parts.
        gang: The attempt's started gang.
        refs: Each rank's ``run_worker`` call, in rank order.
        monitor: The attempt's heartbeat monitor.
        keys: Each rank's heartbeat key.
        attempt: The attempt's number.
        restarts: Restarts before it.
        t0: When the attempt began (``time.monotonic()``).
        tracker: The run's goodput.
        history: Rank 0's reports so far (appended to).

    Attributes:
        detection_s: How long a lost host had been silent when its loss was declared (0 otherwise).
        return_value: Rank 0's return value, once it returned.
        notice: What the hosts saved when they stopped on a preemption notice (None otherwise).
    """

    def __init__(
        self,
        parts: RunParts,
        gang: SliceGang,
        refs: list[Any],
        monitor: HeartbeatMonitor,
        keys: list[str],
        *,
        attempt: int,
        restarts: int,
        t0: float,
        tracker: GoodputTracker,
        history: list[dict[str, Any]],
    ) -> None:
        self.p, self.gang, self.monitor, self.keys = parts, gang, monitor, keys
        self.attempt, self.restarts, self.t0 = attempt, restarts, t0
        self.tracker, self.history = tracker, history
        self.world = len(gang.actors)
        self.period = period_for(parts.failure.heartbeat_timeout_s)
        self.pending = dict(enumerate(refs))
        self.last = time.monotonic()  # rank 0's last report (or the start): what a failure loses since
        self.steps: dict[int, dict[int, dict[str, Any]]] = {}  # step -> rank -> report, until every rank has it
        # One drain call in flight per rank: a host that does not answer (dead,
        # and not yet declared dead by Ray) never blocks the others' reports.
        self.draining: dict[int, Any] = {}
        self.died: list[int] = []  # ranks whose drain call found their process dead
        self.noticed: dict[int, dict[str, Any]] = {}  # hosts that stopped after a notice's emergency save
        self.shown_next = 0.0
        self.detection_s = 0.0
        self.return_value: Any = None
        self.notice: dict[str, Any] | None = None
        hosts: dict[str, list[str]] = {}
        for hc in gang.contexts:
            hosts.setdefault(hc.slice_name, []).append(hc.node_id)
        parts.ledger.attempt_on(hosts)

    # -- the loop ------------------------------------------------------------
    def run(self) -> RunOutcome:
        """Watches until every host returned (success, or a stop on a notice) or the attempt failed.

        Raises:
            CallbackFailed: A user callback raised (the run stops).
        """
        import ray

        poll = _POLL_S
        warm_next = time.monotonic()
        told_busy: set[int] = set()  # the hosts spared for a busy process, said once
        el, monitor = self.p.elastic, self.monitor
        while True:
            try:
                self._drain(timeout=min(0.1, poll))
            except CallbackFailed:
                raise
            except Exception as e:  # a host gone: it was lost
                self.detection_s = self._silent(self.died)
                return self._outcome_of(e)
            ready, _ = ray.wait(list(self.pending.values()), num_returns=len(self.pending), timeout=poll)
            for rank, ref in list(self.pending.items()):
                if ref not in ready:
                    continue
                del self.pending[rank]
                monitor.finish(rank)
                try:
                    out = ray.get(ref)
                except Exception as e:
                    return self._failed(e, rank)
                if out.get("notice"):
                    self.noticed[rank] = out["notice"]
                elif rank == 0:
                    self.return_value = out.get("return_value")
            if not self.pending:
                try:  # every host returned: collect the last reports
                    self._drain(timeout=30)  # calls in flight from before (they may have missed the last ones)
                    self._drain(timeout=30)  # fresh calls, made after every host returned
                except CallbackFailed:
                    raise
                except Exception as e:
                    return self._outcome_of(e)
                if self.noticed:
                    return self._stopped_on_notice()
                return RunOutcome.success(time.monotonic() - self.t0)
            try:
                monitor.observe(read_beats(self.keys))
            except Exception as e:  # the GCS is unreachable: Ray's own errors will tell
                logger.debug("heartbeats unreadable: %s", e)
            verdict = monitor.check()
            if verdict is not None:
                return self._detected(verdict)
            for rank in monitor.spared.keys() - told_busy:
                told_busy.add(rank)
                logger.info(
                    "attempt %d: %s is silent but its machine answers: a busy process (its GIL held), "
                    "not a lost host; it is given up to %g s",
                    self.attempt,
                    self._where(rank),
                    monitor.live_grace_s,
                )
            # A host's beat is overdue: look again soon, so that a loss is declared close to
            # heartbeat_timeout_s after its last beat rather than up to a poll period later.
            poll = _QUICK_POLL_S if self._quietest() > 1.5 * self.period else _POLL_S
            if time.monotonic() >= warm_next and self.history and self.history[-1].get("attempt") == self.attempt:
                # Once this attempt has compiled (its first report), so that imports on the spare hosts do not
                # compete with it; again every few seconds: spare slices come and go (a node pool replaces one).
                warm_next = time.monotonic() + _WARM_REFRESH_S
                self.p.warm_spares(self.gang.spg)
            if el is not None and (target := el.grow_target()) is not None and self.p.grow_ready(self.gang.spg, target):
                el.grow_asked = True  # free slices, and processes warm on every host of the bigger size: grow
                try:
                    asked = ray.get(self.gang.actors[0].call.remote(request_grow, (target,), {}), timeout=10)
                except Exception:  # rank 0 is gone: the loss is found by the usual path
                    asked = True
                el.grow_off = not asked
                self.p.say(
                    f"elastic: slices free for {target}: saving at the next step to grow"
                    if asked
                    else "elastic: slices are free, but notices are off (FailureConfig.preemption_notices): "
                    "the run grows at its next restart"
                )

    # -- reports -------------------------------------------------------------
    def _drain(self, timeout: float, skip: frozenset[int] = frozenset()) -> None:
        """Books the reports the hosts hold (those in ``skip`` are not asked); raises a host's death."""
        import ray

        for rank, a in enumerate(self.gang.actors):
            if rank not in self.draining and rank not in skip:
                self.draining[rank] = a.call.remote(drain_reports, (), {})
        waiting = [ref for rank, ref in self.draining.items() if rank not in skip]
        ready, _ = ray.wait(waiting, num_returns=len(waiting), timeout=timeout)
        got: dict[int, list[dict[str, Any]]] = {}
        error: BaseException | None = None
        for rank, ref in sorted(self.draining.items()):
            if ref in ready:
                del self.draining[rank]
                try:
                    got[rank] = ray.get(ref)
                except Exception as e:  # the host died (Ray noticed it): raised once the others are booked
                    error = error or e
                    if isinstance(e, ray.exceptions.RayActorError):  # its process gone, maybe its host
                        self._suspect(rank)
                        self.died.append(rank)
        ram = self.p.ram
        for rank, reports in got.items():
            for r in reports:
                self.steps.setdefault(r["step"], {})[rank] = r
                if ram is not None:
                    ram.observe(self.attempt, rank, r)
                if rank == 0 and r.get("restore_s"):
                    self.p.restore_seconds(self.attempt, r["restore_s"])
        rank0 = got.get(0)
        if rank0:
            self._booked(rank0)
        for step in sorted(s for s in self.steps if len(self.steps[s]) == self.world):
            self._complete(step, self.steps.pop(step))
        if error is not None:
            raise error

    def _booked(self, rank0: list[dict[str, Any]]) -> None:
        """Rank 0's new reports: goodput, history, and (a few times a second) the gauges and status line."""
        self.last = time.monotonic()
        el = self.p.elastic
        if el is not None:
            el.on_step()
        self.tracker.on_reports(rank0)
        self.history.extend(rank0)
        if self.last < self.shown_next:
            return
        self.shown_next = self.last + _SHOW_EVERY_S
        snap = self.tracker.snapshot()
        self.p.exporter.export(snap.seconds, snap.fraction)
        if self.p.status:
            slices = (self.world // self.gang.contexts[0].hosts_per_slice, self.p.num_slices) if el else None
            self.p.status.update(status_line(rank0[-1], self.attempt, self.restarts, slices))

    def _complete(self, step: int, by_rank: dict[int, dict[str, Any]]) -> None:
        """Every rank reported ``step``: its checkpoint is committed, the callbacks see it."""
        p = self.p
        kinds = {r["checkpoint"] for r in by_rank.values()} - {None}
        rank0 = by_rank[0]
        ckpt = None
        if "directory" in kinds:
            ckpt = commit_pending(
                p.root,
                step,
                self.attempt,
                {"step": step, "metrics": rank0["metrics"], "world_size": self.world, "attempt": self.attempt},
            )
            cc = p.checkpoint
            prune_directories(p.root, cc.num_to_keep, cc.checkpoint_score_attribute, cc.checkpoint_score_order)
        elif "arrays" in kinds:
            ckpt = Checkpoint(step_dir(p.root, step), step)  # may still be being written (async save)
        per_rank = [by_rank[r]["metrics"] for r in range(self.world)]
        for cb in p.callbacks:
            try:
                if callable(getattr(cb, "after_report", None)):
                    cb.after_report(p.run, per_rank, ckpt)
                elif callable(cb) and not hasattr(cb, "after_exception"):
                    cb({"step": step, "metrics": rank0["metrics"], "attempt": self.attempt})
            except Exception as e:
                raise CallbackFailed(e) from e

    def _salvage(self, skip: frozenset[int]) -> None:
        try:  # hosts may still hold reports of steps done before the failure
            self._drain(timeout=2.0, skip=skip)
        except CallbackFailed:
            raise
        except Exception:
            pass

    # -- hosts -----------------------------------------------------------------
    def _where(self, rank: int) -> str:
        hc = self.gang.contexts[rank]
        return f"host rank {rank} ({hc.slice_name} worker {hc.worker_id})"

    def _suspect(self, rank: int, silent: bool = False) -> None:
        # Reserve elsewhere if possible; an elastic run checks before it counts (HostLedger.confirm).
        hc = self.gang.contexts[rank]
        self.p.ledger.suspect(hc.slice_name, hc.node_id, silent)

    def _quietest(self) -> float:
        """How long the quietest host still running has been silent (driver clock)."""
        m = self.monitor
        return max((m.silent_s(r) for r in range(self.world) if r not in m.finished), default=0.0)

    def _silent(self, ranks: Sequence[int] = ()) -> float:
        """The detection delay of a loss Ray reported.

        How long the hosts whose processes died (``ranks``, when known) had been silent, i.e. since
        their last sign of life; else how long the quietest host had been, counted only beyond a
        normal gap between beats. Read first, so that hosts still alive count as fresh even if the
        driver was busy (e.g. in a callback) and stale records are not taken for silence.
        """
        try:
            self.monitor.observe(read_beats(self.keys))
        except Exception:
            pass
        if ranks:
            return max(self.monitor.silent_s(r) for r in ranks)
        quiet = self._quietest()
        return quiet if quiet > 2 * self.period else 0.0

    # -- how the attempt ended -----------------------------------------------------
    def _outcome_of(self, e: BaseException) -> RunOutcome:
        now = time.monotonic()
        return RunOutcome.of(e, elapsed_s=now - self.t0, lost_s=now - self.last)

    def _failed(self, e: BaseException, rank: int | None) -> RunOutcome:
        """A host's call raised: its error, or (when the heartbeats say so) the echo of a lost host."""
        fc, gang, ledger = self.p.failure, self.gang, self.p.ledger
        outcome = RunOutcome.of(e).outcome
        # A process Ray reported dead: its silence is the detection delay (another error: none).
        self.detection_s = self._silent([rank] if outcome is Outcome.PREEMPTED and rank is not None else [])
        if outcome is not Outcome.PREEMPTED:
            # The error may be the echo of a lost host (a collective broke
            # because its peer died): a preemption, not a bug. The
            # heartbeats tell within heartbeat_timeout_s; a ping confirms.
            timeout = fc.heartbeat_timeout_s
            until = time.monotonic() + timeout + 2 * self.period  # the beat period of that timeout
            while time.monotonic() < until:
                try:
                    self.monitor.observe(read_beats(self.keys))
                except Exception:
                    break
                verdict = self.monitor.check(probe=False)  # a peer's error is evidence enough: silence decides
                if verdict is not None and verdict.kind == "lost":
                    out = self._detected(verdict)
                    if out.error is not None:
                        out.error.__cause__ = e
                    return out
                time.sleep(_QUICK_POLL_S)
            lost_ranks = gang.lost_hosts(timeout_s=1.0)
            ledger.lose(gang.contexts[r].node_id for r in lost_ranks)
            if lost_ranks:
                outcome = Outcome.PREEMPTED
                self.detection_s = self._silent(lost_ranks)
                # Ray may list the node as alive for a while yet: reserve elsewhere if possible.
                ledger.avoid |= {gang.contexts[r].slice_name for r in lost_ranks}
        elif rank is not None and 0 <= rank < len(gang.contexts):  # Ray saw the process die, maybe its host
            # Reserve elsewhere if possible. Its node is not taken for lost: a process also dies alone (a
            # collective aborted by a peer's loss), and its node's RAM store may hold the replicas needed.
            self._suspect(rank)
        self._salvage(frozenset())
        now = time.monotonic()
        return RunOutcome(
            outcome, e, now - self.t0, now - self.last, rank if rank is not None else getattr(e, "rank", None)
        )

    def _detected(self, verdict: Verdict) -> RunOutcome:
        """The heartbeats' verdict: hosts lost (silent) or hung (no step)."""
        fc, gang, ledger = self.p.failure, self.gang, self.p.ledger
        message = verdict.message(fc.heartbeat_timeout_s, fc.step_timeout_s, self._where)
        if verdict.kind == "lost":
            outcome = Outcome.PREEMPTED
            self.detection_s = verdict.silent_s
            if self.p.elastic is not None and self.p.ram is not None:
                # A silent process, maybe a lost host: the hosts' RAM stores tell before the count.
                ledger.avoid = set()
                for r in verdict.ranks:
                    self._suspect(r, silent=True)
            else:
                # Their RAM stores went with them, unless their machine answered (a stuck process: keep them).
                ledger.lose(gang.contexts[r].node_id for r in verdict.ranks if r not in verdict.answering)
                # Ray may list the node as alive for a while yet: reserve elsewhere if possible.
                ledger.avoid = {gang.contexts[r].slice_name for r in verdict.ranks}
        else:
            outcome = Outcome.TIMEOUT
            self.detection_s = max(0.0, verdict.silent_s - cast(float, fc.step_timeout_s))
        error = GangError(message, outcome, rank=verdict.ranks[0])
        self._salvage(frozenset(verdict.ranks) if verdict.kind == "lost" else frozenset())
        now = time.monotonic()
        return RunOutcome(outcome, error, now - self.t0, now - self.last, verdict.ranks[0])

    def _stopped_on_notice(self) -> RunOutcome:
        """Every host saved the agreed step of a preemption notice and stopped: a preemption, nothing lost."""
        noticed, contexts = self.noticed, self.gang.contexts
        first = noticed[min(noticed)]
        step = first["step"]
        save_s = max(n["save_s"] for n in noticed.values())
        # The save's wait after the step's report (its stall is in the report) is checkpoint time too.
        self.tracker.add("checkpoint_stall", max(n["save_s"] - n["save_stall_s"] for n in noticed.values()))
        self.notice = {**first, "save_s": save_s}
        rank = first.get("rank")
        rank = rank if isinstance(rank, int) and 0 <= rank < len(contexts) else min(noticed)
        hc = contexts[rank]
        if first.get("reason") != GROW_REASON:
            self.p.ledger.avoid = {hc.slice_name}  # the noticed host is about to go: reserve elsewhere if possible
        error = GangError(
            f"preemption notice ({first.get('reason')}) on host rank {rank} ({hc.slice_name} worker "
            f"{hc.worker_id}): every host saved step {step} ({save_s:.2f} s) and stopped",
            Outcome.PREEMPTED,
            rank=rank,
        )
        return RunOutcome(Outcome.PREEMPTED, error, time.monotonic() - self.t0, 0.0, rank)


__all__ = ["AttemptWatch", "CallbackFailed", "RunParts", "status_line"]
