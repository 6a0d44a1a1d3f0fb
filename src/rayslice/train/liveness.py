"""Whether a silent host's machine still answers: a probe that needs no Python on that machine.

A host's heartbeat (:mod:`rayslice.train.heartbeat`) comes from a Python
thread, so it needs the host process's GIL. A live process can hold the GIL
off for over a second (a long C call such as JAX lowering, a garbage
collection, an oversubscribed machine); a lost host's machine, by contrast,
is gone. :class:`NodeProbe` tells the two apart without the process: it opens
a TCP connection to the Ray node's raylet port (answered by the raylet, a C++
process, whatever any Python process there is doing) and closes it at once.
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
from collections.abc import Callable, Mapping
from typing import Any

#: A silent host whose machine still answers gets this long (since its last
#: heartbeat) before it is taken for lost. A process that holds its GIL
#: longer than that is as good as hung.
LIVE_HOST_GRACE_S = 10.0


def _connect(address: tuple[str, int], timeout_s: float) -> None:
    socket.create_connection(address, timeout=timeout_s).close()


def _raylet_addresses() -> dict[str, tuple[str, int]]:
    """Node id -> (ip, raylet port) of the nodes Ray lists as alive."""
    import ray

    return {
        n["NodeID"]: (n["NodeManagerAddress"], int(n["NodeManagerPort"]))
        for n in ray.nodes()
        if n.get("Alive") and n.get("NodeManagerPort")
    }


class NodeProbe:
    """Tells whether Ray nodes' machines answer, by a TCP connect to each node's raylet port.

    Args:
        addresses: Node id -> ``(ip, port)``; default: read from
            ``ray.nodes()`` (alive nodes, raylet ports) on first use.
        timeout_s: The connect deadline: a VM gone without a reset lets a
            connection time out instead of refusing it.
        ttl_s: How long an answer is reused (the driver polls often while a
            beat is overdue).
        connect: Opens and closes one connection, raising ``OSError`` when
            it fails (tests inject it).
        clock: A monotonic clock.

    A node that is not in ``addresses`` (unknown, or not alive when they were
    read) does not answer.
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
        self.probes = 0  # connections attempted (for tests and logs)

    def __call__(self, node_id: str) -> bool:
        """Whether ``node_id``'s machine answered (now, or within ``ttl_s``)."""
        now = self._clock()
        seen = self._answers.get(node_id)
        if seen is not None and now - seen[0] < self.ttl_s:
            return seen[1]
        if self._addresses is None:
            try:
                self._addresses = _raylet_addresses()
            except Exception:  # Ray is unreachable from here: no answer from anywhere
                return False
        address = self._addresses.get(node_id)
        answered = False
        if address is not None:
            self.probes += 1
            try:
                self._connect(address, self.timeout_s)
                answered = True
            except OSError:
                answered = False
        self._answers[node_id] = (self._clock(), answered)
        return answered


__all__ = ["LIVE_HOST_GRACE_S", "NodeProbe"]
