"""Progress display for long waits (private).

Short waits stay silent; a wait that lasts longer than ``quiet_s`` shows one
live line (rich) saying what it waits for, how long it has waited, the
deadline, and the first reason from the plan.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

_WAITING_KV_PREFIX = b"rayslice/waiting/"
_KV_NAMESPACE = b"rayslice"


class WaitDisplay:
    """A live status line that appears once a wait gets long.

    Args:
        what: What is being waited for.
        enabled: False makes it a no-op.
        quiet_s: Waits shorter than this show nothing.
        clock: Monotonic clock.
    """

    def __init__(
        self,
        what: str,
        *,
        enabled: bool = True,
        quiet_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        publish_every_s: float = 5.0,
    ) -> None:
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
            why = plan.first_reason()
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


def publish_waiting(name: str, info: dict[str, Any] | None) -> None:
    """Publishes (or, with None, withdraws) a waiting reservation, with the job and actor that wait."""
    import ray
    from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_put

    key = _WAITING_KV_PREFIX + name.encode()
    try:
        if info is None:
            _internal_kv_del(key, namespace=_KV_NAMESPACE)
        else:
            ctx = ray.get_runtime_context()
            owner = {"job": ctx.get_job_id(), "actor": ctx.get_actor_id()}
            _internal_kv_put(
                key, json.dumps({**info, "owner": owner}).encode(), overwrite=True, namespace=_KV_NAMESPACE
            )
    except Exception:  # status is best effort; never fail a reservation over it
        logger.debug("could not publish waiting state", exc_info=True)


def _owner_dead(owner: Any, jobs: dict[str, bool]) -> bool:
    """True only when Ray's GCS says the waiting actor, or else the waiting job, is dead."""
    from ray._private import state

    try:
        if owner.get("actor"):
            return state.actors(actor_id=owner["actor"]).get("State") == "DEAD"
        return jobs.get(owner.get("job") or "", False)
    except Exception:  # unknown is alive: never hide a wait over a failed lookup
        logger.debug("could not look up the owner of a waiting reservation", exc_info=True)
        return False


def waiting_reservations() -> list[dict[str, Any]]:
    """Reservations currently waiting for slices (published by every waiting driver).

    An entry whose process died while it waited (killed, its node lost: it
    never withdrew it) is dropped from the answer and deleted, once Ray's GCS
    reports its actor, or its job when it was not an actor, dead.
    """
    from ray._private import state
    from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_get, _internal_kv_list

    out = []
    jobs: dict[str, bool] | None = None
    for key in _internal_kv_list(_WAITING_KV_PREFIX, namespace=_KV_NAMESPACE):
        raw = _internal_kv_get(key, namespace=_KV_NAMESPACE)
        if not raw:
            continue
        info = json.loads(raw)
        owner = info.pop("owner", None)
        if isinstance(owner, dict):
            if jobs is None:
                try:
                    jobs = {j["JobID"]: bool(j["IsDead"]) for j in state.jobs()}
                except Exception:
                    jobs = {}
            if _owner_dead(owner, jobs):
                _internal_kv_del(key, namespace=_KV_NAMESPACE)
                continue
        out.append(info)
    return out
