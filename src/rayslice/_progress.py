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
#: A waiting driver republishes every few seconds (``WaitDisplay``'s ``publish_every_s``); an entry
#: not refreshed for this long belongs to a process that died while it waited (killed, its node lost).
STALE_AFTER_S = 30.0


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
    """Publishes (or, with None, withdraws) a waiting reservation, stamped with the time it was written."""
    from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_put

    key = _WAITING_KV_PREFIX + name.encode()
    try:
        if info is None:
            _internal_kv_del(key, namespace=_KV_NAMESPACE)
        else:
            stamped = {**info, "published_at": time.time()}
            _internal_kv_put(key, json.dumps(stamped).encode(), overwrite=True, namespace=_KV_NAMESPACE)
    except Exception:  # status is best effort; never fail a reservation over it
        logger.debug("could not publish waiting state", exc_info=True)


def waiting_reservations(stale_after_s: float = STALE_AFTER_S) -> list[dict[str, Any]]:
    """Reservations currently waiting for slices (published by every waiting driver).

    An entry its driver has not refreshed for ``stale_after_s`` is left over
    from a process that died while waiting: it is dropped from the answer and
    deleted.
    """
    from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_get, _internal_kv_list

    out = []
    now = time.time()
    for key in _internal_kv_list(_WAITING_KV_PREFIX, namespace=_KV_NAMESPACE):
        raw = _internal_kv_get(key, namespace=_KV_NAMESPACE)
        if not raw:
            continue
        info = json.loads(raw)
        age = now - float(info.get("published_at", now))
        if age > stale_after_s:
            _internal_kv_del(key, namespace=_KV_NAMESPACE)
            continue
        if "since_s" in info:  # how long it has waited by now, not at its last refresh
            info["since_s"] = float(info["since_s"]) + max(0.0, age)
        out.append(info)
    return out
