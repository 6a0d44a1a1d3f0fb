"""Whether a silent host's machine still answers: a probe that needs no Python on that machine.

A host's heartbeat (:mod:`rayslice.train.heartbeat`) comes from a Python
thread, so it needs the host process's GIL. A live process can hold the GIL
off for over a second (a long C call such as JAX lowering, a garbage
collection, an oversubscribed machine); a lost host's machine, by contrast,
is gone. :class:`NodeProbe` tells the two apart without the process: it opens
a TCP connection to the Ray node's raylet port (opened by the machine's kernel
on the raylet's listening socket, whatever any Python process there is doing)
and closes it at once.
A preempted VM or a removed node refuses it (or lets it time out).

The driver probes a host only once its heartbeat is overdue; a host whose
machine answers is given :data:`LIVE_HOST_GRACE_S` before it is taken for
lost (see :class:`~rayslice.train.heartbeat.HeartbeatMonitor`).

Example:
    >>> import socket
    >>> server = socket.create_server(("127.0.0.1", 0))
    >>> port = server.getsockname()[1]
    >>> probe = NodeProbe({"up": ("127.0.0.1", port)})
    >>> probe("up"), probe("not-a-node")
    (True, False)
    >>> server.close()
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

#: A silent host whose machine still answers gets this long (since its last
#: heartbeat) before it is taken for lost. A process that holds its GIL
#: longer than that is as good as hung.
LIVE_HOST_GRACE_S = 10.0


def _connect(address: tuple[str, int], timeout_s: float) -> None:
    socket.create_connection(address, timeout=timeout_s).close()


def raylet_addresses(node_ids: Iterable[str] | None = None) -> dict[str, tuple[str, int]] | None:
    """Node id -> (ip, raylet port) of the nodes Ray lists as alive (of ``node_ids`` if given); None if unreadable."""
    try:
        import ray

        nodes = ray.nodes()
    except Exception:
        return None
    wanted = None if node_ids is None else set(node_ids)
    return {
        n["NodeID"]: (n["NodeManagerAddress"], int(n["NodeManagerPort"]))
        for n in nodes
        if n.get("Alive") and n.get("NodeManagerPort") and (wanted is None or n["NodeID"] in wanted)
    }


class NodeProbe:
    """Tells whether Ray nodes' machines answer, by a TCP connect to each node's raylet port.

    A node that is not in ``addresses`` (unknown, or not alive when they were
    read) does not answer. A connection that opens proves the machine is up
    and the raylet's listening socket open (the kernel completes the
    handshake), not that the raylet is healthy: enough to tell a busy process
    from a machine that is gone.

    Args:
        addresses: Node id -> ``(ip, port)``; default: read from
            ``ray.nodes()`` (alive nodes, raylet ports) on first use (a failed
            read counts as no node answering).
        timeout_s: The connect deadline: a VM gone without a reset lets a
            connection time out instead of refusing it. Several nodes are
            probed in parallel, so a call waits at most about this long.
        ttl_s: How long an answer is reused (the driver polls often while a
            beat is overdue).
        connect: Opens and closes one connection, raising ``OSError`` when
            it fails (tests inject it).
        clock: A monotonic clock.
    """

    def __init__(
        self,
        addresses: Mapping[str, tuple[str, int]] | None = None,
        *,
        timeout_s: float = 0.25,
        ttl_s: float = 0.25,
        connect: Callable[[tuple[str, int], float], Any] = _connect,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._addresses = dict(addresses) if addresses is not None else None
        self.timeout_s = timeout_s
        self.ttl_s = ttl_s
        self._connect = connect
        self._clock = clock
        self._answers: dict[str, tuple[float, bool]] = {}
        self.probes = 0  # connections attempted

    def __call__(self, node_id: str) -> bool:
        """Whether ``node_id``'s machine answered (now, or within ``ttl_s``)."""
        return node_id in self.answering([node_id])

    def answering(self, node_ids: Iterable[str]) -> set[str]:
        """Those of ``node_ids`` whose machine answered (now, or within ``ttl_s``); probed in parallel."""
        now = self._clock()
        wanted = set(node_ids)
        fresh = {n: seen[1] for n in wanted if (seen := self._answers.get(n)) and now - seen[0] < self.ttl_s}
        if self._addresses is None:  # read once; unreadable: no node answers
            self._addresses = raylet_addresses() or {}
        stale = sorted(wanted - fresh.keys())
        todo = [n for n in stale if n in self._addresses]
        new = dict.fromkeys(stale, False)  # an unknown node does not answer
        if todo:
            self.probes += len(todo)
            with ThreadPoolExecutor(max_workers=len(todo)) as pool:
                new.update(zip(todo, pool.map(self._answers_one, todo), strict=True))
        stamp = self._clock()
        self._answers.update({n: (stamp, ok) for n, ok in new.items()})
        return {n for n, ok in {**fresh, **new}.items() if ok}

    def _answers_one(self, node_id: str) -> bool:
        try:
            self._connect(cast(dict, self._addresses)[node_id], self.timeout_s)
            return True
        except OSError:
            return False


__all__ = ["LIVE_HOST_GRACE_S", "NodeProbe", "raylet_addresses"]
