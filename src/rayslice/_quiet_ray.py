"""Quiet Ray: keeps Ray's own chatter out of a simulated cluster's driver console.

:class:`~rayslice.sim.SimulatedCluster` (unless ``verbose=True``) installs a
:class:`_QuietRay` on the driver: INFO logs of Ray Core, Ray Data, Serve and
Train go to WARNING on the console (everything still reaches the session's log
files), and the notices Ray pushes about nodes the simulator killed on purpose
are dropped, the others cut to one short line.

Example:
    >>> q = _QuietRay(None)
    >>> q.summarize("Some notice from Ray" + chr(10) + "with a long traceback")
    'Some notice from Ray'
    >>> q.expect_death("ab12")
    >>> q.summarize("The node with node id: ab12 and address: 1.2.3.4 has been marked dead") is None
    True
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import re
import tempfile
from collections.abc import Sequence
from typing import Any

# The simulator's logger: what this module logs belongs to the simulated cluster.
logger = logging.getLogger("rayslice.sim")

# Loggers whose INFO output (progress, "connected", "deployed") is quieted on the
# console unless verbose; Ray Data keeps writing everything to its session log file.
_QUIET_LOGGERS = ("ray", "ray.data", "ray.serve", "ray.train", "ray.tune")
_WORKER_NODE = re.compile(r"Node ID: ([0-9a-f]{8})")
_WORKER_PID = re.compile(r"Worker PID: (\d+)")


class _WarningsOnly(logging.Filter):
    """Lets warnings and errors through, nothing below."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING


class _QuietRay:
    """Keeps Ray's own chatter out of this driver's console; :meth:`restore` undoes it.

    - INFO logs of Ray Core, Serve, Train go to WARNING (``ray.init`` gets
      ``logging_level=WARNING``; the others are set here);
    - Ray Data keeps logging everything to its session file ``ray-data.log`` but
      only warnings to the console (its own ``RAY_DATA_LOGGING_CONFIG`` hook),
      so no progress or "execution plan" lines;
    - error notices Ray pushes to every driver about nodes this simulator killed
      on purpose ("node marked dead", "a worker died" there and on the other
      hosts of that slice, the raylet's "terminated unexpectedly" dump) are
      dropped: the simulator logs one line instead; other notices are cut to
      one short line.

    The raylet dump cannot be told apart by content: the dying node's agents
    publish it without a node id, with the tail of ``raylet.out`` in the
    session's log folder, which on a simulated cluster (every node shares the
    head's session) is the *head's* raylet log, not the dead one's (Ray's
    ``process_watcher.report_raylet_error_logs``). So once the simulator has
    killed a node, these dumps are dropped; an unexpected death of another
    node still shows, as its "node ... marked dead" notice, which names it.
    """

    def __init__(self, temp_dir: str | None) -> None:
        self._temp_dir = temp_dir or tempfile.gettempdir()
        self._levels: dict[str, int] = {}
        self._env_before: str | None = None
        self._env_set = False
        self._patched: Any = None
        self._original: Any = None
        self._dead_nodes: set[str] = set()
        self._mates: set[str] = set()
        self._serve_filter = _WarningsOnly()

    def expect_death(self, node_id: str, slice_mates: Sequence[str] = ()) -> None:
        """This node is being killed on purpose: its death notices are not news.

        Neither are the deaths of the gang processes on its ``slice_mates``
        (the other hosts of its slice): a multi-host JAX program ends on every
        host when one host goes, and rayslice reports that as a preemption.
        """
        self._dead_nodes.add(node_id)
        self._mates.update(slice_mates)

    def install(self) -> _QuietRay:
        for name in _QUIET_LOGGERS[2:]:
            log = logging.getLogger(name)
            self._levels[name] = log.level
            log.setLevel(logging.WARNING)
        # `import ray.serve` resets its logger's level and handlers, but keeps its filters.
        logging.getLogger("ray.serve").addFilter(self._serve_filter)
        self._quiet_ray_data()
        import ray._private.worker as ray_worker

        original = ray_worker.print_to_stdstream

        def filtered(data: dict[str, Any], ignore_prefix: bool) -> None:
            if data.get("pid") == "raylet":
                lines = [short for line in data.get("lines", []) if (short := self.summarize(line))]
                if not lines:
                    return
                data = {**data, "lines": lines}
            original(data, ignore_prefix)

        ray_worker.print_to_stdstream = filtered
        self._patched, self._original = filtered, original
        return self

    def summarize(self, message: str) -> str | None:
        """None for a notice about a node killed on purpose, else one short line.

        A notice is about such a node when it names the node's id, or when it
        is a raylet's termination dump after the simulator killed a node (the
        dump names no node; see the class docstring).

        >>> dump = "Raylet is terminated. Termination is unexpected. Last 20 lines:" + chr(10) + "    [...] ..."
        >>> fresh = _QuietRay(None)
        >>> fresh.summarize(dump)
        'a raylet terminated unexpectedly (details: verbose=True, or raylet*.out in the session logs)'
        >>> q = _QuietRay(None)
        >>> q.expect_death("ab12")
        >>> q.summarize(dump) is None
        True
        >>> q.summarize("The node with node id: ab12 and address: 1.2.3.4 has been marked dead") is None
        True
        >>> q.summarize("The node with node id: cd34 and address: 1.2.3.4 has been marked dead")
        'The node with node id: cd34 and address: 1.2.3.4 has been marked dead'
        >>> died = "A worker died or was killed ... Node ID: 0123456789abcdef Worker PID: 77 Worker exit ..."
        >>> q.summarize(died).startswith("a worker died unexpectedly (node 01234567, pid 77); details: verbose=True")
        True
        """
        if any(node in message for node in self._dead_nodes):
            return None  # "node ... marked dead", "a worker died" on a node killed on purpose
        if "ServeController.graceful_shutdown failed" in message:
            return None  # serve.shutdown() kills its controller while a retried shutdown call is queued: harmless
        if message.startswith("A worker died") and any(node in message for node in self._mates):
            return None  # a gang process on the rest of a slice that lost a host
        if message.startswith("Raylet is terminated"):
            if self._dead_nodes:
                return None  # no node named, and its log tail is the head's: see the class docstring
            return "a raylet terminated unexpectedly (details: verbose=True, or raylet*.out in the session logs)"
        if message.startswith("A worker died"):
            node, pid = _WORKER_NODE.search(message), _WORKER_PID.search(message)
            where = ", ".join(x for x in (node and f"node {node.group(1)}", pid and f"pid {pid.group(1)}") if x)
            return (
                f"a worker died unexpectedly{f' ({where})' if where else ''}; "
                "details: verbose=True, or the worker's log in the session logs"
            )
        first = message.strip().splitlines()[0] if message.strip() else ""
        return first[:300] or None

    def _quiet_ray_data(self) -> None:
        """Ray Data: everything to its log file, only warnings to the console."""
        var = "RAY_DATA_LOGGING_CONFIG"
        if os.environ.get(var):
            return  # the user configured Ray Data's logging: theirs wins
        try:
            import yaml
            from ray.data._internal import logging as data_logging

            config: dict[str, Any] = copy.deepcopy(data_logging.DEFAULT_CONFIG)
            config["handlers"]["console"]["level"] = "WARNING"
            path = os.path.join(self._temp_dir, "rayslice-ray-data-logging.yaml")
            with open(path, "w") as f:
                yaml.safe_dump(config, f)
            self._env_before, self._env_set = os.environ.get(var), True
            os.environ[var] = path
            data_logging.configure_logging()
        except Exception as e:  # a Ray Data without this hook: stay correct, just louder
            logger.debug("could not quiet Ray Data's console logs: %s", e)

    def restore(self) -> None:
        for name, level in self._levels.items():
            logging.getLogger(name).setLevel(level)
        self._levels.clear()
        logging.getLogger("ray.serve").removeFilter(self._serve_filter)
        if self._env_set:
            if self._env_before is None:
                os.environ.pop("RAY_DATA_LOGGING_CONFIG", None)
            else:
                os.environ["RAY_DATA_LOGGING_CONFIG"] = self._env_before
            self._env_set = False
            with contextlib.suppress(Exception):
                from ray.data._internal import logging as data_logging

                data_logging.configure_logging()
        if self._patched is not None:
            import ray._private.worker as ray_worker

            if ray_worker.print_to_stdstream is self._patched:
                ray_worker.print_to_stdstream = self._original
            self._patched = None
