"""Preemption notices: learn that a host will go, agree on a step, save there, stop.

A host learns of its coming preemption from one of these sources (each one
that is missing is reported once, at INFO, and never breaks a job):

- **SIGTERM** to the host process, what Kubernetes sends before evicting a
  pod (the gang process records it instead of dying: :func:`rayslice.gang.on_sigterm`);
- the **GCE metadata server** (``instance/preempted`` = ``TRUE``, or
  ``instance/maintenance-event`` other than ``NONE``), polled by a thread only
  when the server answers; ``RAYSLICE_GCE_METADATA_URL`` points elsewhere
  (the simulator's or a test's fake endpoint);
- **Ray node draining** (``ray._private.state.state.get_draining_nodes()``,
  the GCS's list that ``ray drain-node`` and KubeRay's autoscaler fill).

Every host of the gang must save the *same* step (an Orbax save is a
collective), so a notice is agreed through the JAX coordination service's
key-value store (:class:`NoticeAgreement`): the first host that sees a notice
publishes it; a thread on every host waits for that key, and, holding the
host's step lock, freezes the host at its last claimed step ``c`` and posts
``c``. The save step is ``N = max(c) + 1``: no host has passed it (each is
frozen at ``c <= N - 1``), and no host waits on another host's step loop
(only on the posting threads), so the agreement cannot deadlock behind a
collective. ``report()`` of step ``N`` saves on every host, waits until the
save is complete, and ends the training function; the next attempt resumes
from ``N``, with zero lost steps. A host killed before the save completes
leaves Orbax's temporary directory, never a half checkpoint: the run falls
back to the previous complete one.

Example:
    >>> kv = MemoryKV()
    >>> hosts = [NoticeAgreement(kv, "run/1", rank=r, world_size=2) for r in range(2)]
    >>> _ = [h.start() for h in hosts]
    >>> hosts[0].claim(3), hosts[1].claim(2)         # both hosts step on, no notice
    (False, False)
    >>> hosts[1].announce("SIGTERM")                  # host 1 will be preempted
    >>> [h.wait_agreed(5) for h in hosts]            # frozen at 3 and 2: save at 4
    [4, 4]
    >>> hosts[1].claim(3), hosts[1].claim(4), hosts[0].claim(4)
    (False, True, True)
    >>> hosts[0].notice["reason"], hosts[0].notice["rank"]
    ('SIGTERM', 1)
    >>> for h in hosts:
    ...     h.stop()
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

#: The GCE metadata server's base URL (overridden by ``RAYSLICE_GCE_METADATA_URL``).
GCE_METADATA_URL = "http://metadata.google.internal/computeMetadata/v1"
METADATA_ENV = "RAYSLICE_GCE_METADATA_URL"
#: How long a host waits, frozen at a step, for every host to post its step.
AGREE_TIMEOUT_S = 60.0
_POLL_S = 1.0
_REPORTED: set[str] = set()  # missing sources already reported in this process


def _once(source: str, message: str, *args: Any) -> None:
    if source not in _REPORTED:
        _REPORTED.add(source)
        logger.info(message, *args)


class MemoryKV:
    """An in-process stand-in for the JAX coordination service's key-value client (tests, doctests)."""

    def __init__(self) -> None:
        self._data: dict[str, str] = {}
        self._cond = threading.Condition()

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
        with self._cond:
            if key in self._data and not allow_overwrite:
                raise RuntimeError(f"ALREADY_EXISTS: {key}")
            self._data[key] = value
            self._cond.notify_all()

    def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str:
        with self._cond:
            if not self._cond.wait_for(lambda: key in self._data, timeout=timeout_in_ms / 1000):
                raise TimeoutError(f"DEADLINE_EXCEEDED: {key}")
            return self._data[key]

    def key_value_delete(self, key: str) -> None:
        with self._cond:
            self._data.pop(key, None)


class NoticeAgreement:
    """Agreement of every host of an attempt on the step to save at (see the module docstring).

    Args:
        client: The coordination service's key-value client (``jax._src.distributed.global_state.client``).
        prefix: Unique per attempt (``<run id>/<attempt>``).
        rank, world_size: This host's rank and the number of hosts.
        agree_timeout_s: How long a frozen host waits for the others' steps
            before giving up on the notice (a peer gone: the normal recovery path).
    """

    def __init__(
        self, client: Any, prefix: str, *, rank: int, world_size: int, agree_timeout_s: float = AGREE_TIMEOUT_S
    ) -> None:
        self._kv = client
        self._key = f"rayslice/notice/{prefix}"
        self.rank, self.world_size = rank, world_size
        self.agree_timeout_s = agree_timeout_s
        self._lock = threading.Lock()
        self._claimed = 0  # the last step whose report started (its save decision is taken)
        self._frozen = threading.Event()
        self._agreed = threading.Event()
        self._stop = threading.Event()
        self.save_step: int | None = None
        self.notice: dict[str, Any] | None = None
        self.noticed_at: float | None = None  # time.monotonic() when this host learned of the notice
        self.failed: str | None = None
        self._thread: threading.Thread | None = None

    def start(self, claimed: int = 0) -> NoticeAgreement:
        self._claimed = claimed
        self._thread = threading.Thread(target=self._watch, name="rayslice-notice", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def announce(self, reason: str, **details: Any) -> None:
        """This host learned of a preemption: tell every host (only the first notice counts)."""
        record = json.dumps({"rank": self.rank, "reason": reason, **details})
        try:
            self._kv.key_value_set(f"{self._key}/go", record)
            logger.warning(
                "preemption notice on host rank %d (%s): saving at the next step boundary", self.rank, reason
            )
        except Exception:  # another host announced first (or the service is gone: nothing to save with)
            pass

    def _watch(self) -> None:
        raw = None
        while not self._stop.is_set() and raw is None:
            try:
                raw = self._kv.blocking_key_value_get(f"{self._key}/go", 1000)
            except Exception as e:
                timed_out = "DEADLINE" in str(e).upper() or "TIMEOUT" in type(e).__name__.upper()
                if not timed_out and self._stop.wait(0.5):  # the service is going away
                    return
        if raw is None:
            return
        self.noticed_at = time.monotonic()
        try:
            self.notice = json.loads(raw)
        except ValueError:
            self.notice = {"rank": None, "reason": str(raw)}
        with self._lock:  # no report() decides a step while the host freezes
            frozen_at = self._claimed
            self._frozen.set()
        try:
            self._kv.key_value_set(f"{self._key}/at/{self.rank}", str(frozen_at))
            deadline = time.monotonic() + self.agree_timeout_s
            steps = []
            for r in range(self.world_size):
                left_ms = max(1, int(1000 * (deadline - time.monotonic())))
                steps.append(int(self._kv.blocking_key_value_get(f"{self._key}/at/{r}", left_ms)))
            self.save_step = max(steps) + 1
        except Exception as e:  # a peer never posted (gone): no emergency save, the normal path
            self.failed = f"hosts did not agree on a step to save at ({e})"
        self._agreed.set()

    def wait_agreed(self, timeout_s: float | None = None) -> int | None:
        """Blocks until the step is agreed (or agreement failed); the step or None."""
        self._agreed.wait(timeout_s)
        return self.save_step

    def claim(self, step: int) -> bool:
        """Step ``step`` is being reported: True when it is the agreed save step (same on every host).

        Called once per step by ``report()``, in increasing order. Once a notice
        is frozen on this host, this waits for the agreement (milliseconds:
        posting threads, not step loops).
        """
        with self._lock:
            if step > self._claimed:
                self._claimed = step
            frozen = self._frozen.is_set()
        if not frozen:
            return False
        if not self._agreed.wait(self.agree_timeout_s + 5):
            return False
        return self.save_step == step


class NoticeSources:
    """This host's watchers of real notice sources; each calls ``announce(reason, **details)`` once.

    Args:
        announce: Called with the reason (``"SIGTERM"``, ``"gce-preempted"``,
            ``"gce-maintenance"``, ``"ray-drain"``) at the first notice.
        metadata_url: The GCE metadata base URL (default: ``$RAYSLICE_GCE_METADATA_URL`` or GCE's).
        node_id: This host's Ray node id, to find it among draining nodes (None: not checked).
        poll_s: Seconds between polls.
        draining: Returns ``{node id hex: deadline ms}`` (default: Ray's GCS).
        sigterm: Subscribe to SIGTERM (default: :func:`rayslice.gang.on_sigterm`).

    Example:
        >>> seen = []
        >>> src = NoticeSources(lambda reason, **d: seen.append(reason), metadata_url="http://127.0.0.1:9",
        ...                     node_id="ab", poll_s=0.01, draining=lambda: {"ab": 0}, sigterm=None).start()
        >>> src.wait(5)
        True
        >>> src.stop(); seen
        ['ray-drain']
    """

    def __init__(
        self,
        announce: Callable[..., None],
        *,
        metadata_url: str | None = None,
        node_id: str | None = None,
        poll_s: float = _POLL_S,
        draining: Callable[[], dict[str, int]] | None = None,
        sigterm: Callable[[Callable[[str], None]], Callable[[], None]] | None | bool = True,
    ) -> None:
        self._announce = announce
        self.metadata_url = (metadata_url or os.environ.get(METADATA_ENV) or GCE_METADATA_URL).rstrip("/")
        self.node_id = node_id
        self.poll_s = poll_s
        self._draining = draining or _ray_draining_nodes
        self._sigterm = sigterm
        self._stop = threading.Event()
        self._fired = threading.Event()
        self._unsubscribe: Callable[[], None] | None = None
        self._threads: list[threading.Thread] = []

    def _fire(self, reason: str, **details: Any) -> None:
        if not self._fired.is_set():
            self._fired.set()
            self._announce(reason, **details)

    def start(self) -> NoticeSources:
        sub = self._sigterm
        if sub is True:
            from rayslice.gang import on_sigterm

            sub = on_sigterm
        if callable(sub):
            self._unsubscribe = sub(lambda reason: self._fire(reason))
        for target, name in ((self._poll_metadata, "gce-metadata"), (self._poll_drain, "ray-drain")):
            t = threading.Thread(target=target, name=f"rayslice-notice-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def wait(self, timeout_s: float) -> bool:
        """True once a notice fired (tests)."""
        return self._fired.wait(timeout_s)

    def stop(self) -> None:
        self._stop.set()
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None

    # -- GCE metadata -----------------------------------------------------------
    def _get(self, path: str, timeout: float) -> str:
        req = urllib.request.Request(f"{self.metadata_url}/{path}", headers={"Metadata-Flavor": "Google"})
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.read().decode().strip()

    def _poll_metadata(self) -> None:
        try:
            self._get("instance/preempted", 1.0)
        except Exception as e:  # not on GCE (the usual case off TPU VMs): say so once, stop polling
            _once(
                "gce",
                "GCE metadata server %s not reachable (%s): preemption notices come from SIGTERM and "
                "Ray node draining only",
                self.metadata_url,
                type(e).__name__,
            )
            return
        while not self._stop.is_set() and not self._fired.is_set():
            try:
                if self._get("instance/preempted", 2.0).upper() == "TRUE":
                    self._fire("gce-preempted")
                    return
                event = self._get("instance/maintenance-event", 2.0)
                if event and event.upper() != "NONE":
                    self._fire("gce-maintenance", event=event)
                    return
            except Exception as e:  # a transient failure: keep polling, reported once
                _once("gce-poll", "GCE metadata poll failed (%s); retrying", e)
            self._stop.wait(self.poll_s)

    # -- Ray node draining -------------------------------------------------------
    def _poll_drain(self) -> None:
        if not self.node_id:
            return
        while not self._stop.is_set() and not self._fired.is_set():
            try:
                nodes = self._draining()
            except Exception as e:
                _once(
                    "drain",
                    "Ray node draining not readable (%s): preemption notices come from SIGTERM "
                    "and the GCE metadata server only",
                    e,
                )
                return
            if self.node_id in nodes:
                self._fire("ray-drain", deadline_ms=int(nodes[self.node_id] or 0))
                return
            self._stop.wait(self.poll_s)


def _ray_draining_nodes() -> dict[str, int]:
    from ray._private.state import state

    return dict(state.get_draining_nodes())


__all__ = ["GCE_METADATA_URL", "METADATA_ENV", "MemoryKV", "NoticeAgreement", "NoticeSources"]
