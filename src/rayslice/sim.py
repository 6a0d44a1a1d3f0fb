"""A simulated TPU cluster: a real multi-node Ray cluster on one machine.

Each simulated TPU host is a real Ray node (its own raylet) started with the
environment a GKE TPU host has (``TPU_NAME``, ``TPU_WORKER_ID``,
``TPU_ACCELERATOR_TYPE``, ``TPU_TOPOLOGY``, ``TPU_WORKER_HOSTNAMES``) and the
``TPU`` resource of its chip count. Ray 2.60's own TPU detection then derives
the ``accelerator_type:TPU-...`` and ``TPU-<pod type>-head`` resources and the
``ray.io/tpu-*`` labels exactly as on a real slice; nothing here writes them by
hand, so whatever passes on the simulator sees the same cluster shape as a real
one. JAX processes on a host see ``devices_per_host`` CPU devices through
``--xla_force_host_platform_device_count``.

Output: by default (``verbose=False``) Ray's own chatter stays out of the
driver's output and in the session's log files: INFO logs of Ray Core, Ray
Data (progress) and Serve are raised to WARNING on the console, worker logs
are not forwarded, and the raylet crash dumps and "node marked dead" notices
that a simulated preemption causes are replaced by one line
(``host 1 of slice-a preempted (simulated)``, logged on ``rayslice.sim``).
``verbose=True`` shows everything Ray prints.

Example:
    >>> from rayslice.sim import SimulatedCluster, SliceSpec
    >>> with SimulatedCluster([SliceSpec("TPU-V4", "2x2x2")]) as sim:  # doctest: +SKIP
    ...     sim.preempt_host(sim.slice_names[0], 1)
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from rayslice._deadline import Deadline
from rayslice._quiet_ray import _QuietRay
from rayslice._validate import check_choice, check_float, check_int, fail
from rayslice.errors import InvalidArgument
from rayslice.sim_spec import SliceSpec, _specs
from rayslice.topology import Topology

#: Ray settings that make a killed node be declared dead within ~2 s instead of
#: the production ~15 s, so preemption tests and recovery benchmarks are quick.
#: Real clusters keep Ray's defaults; rayslice code never relies on the value.
_SIM_SYSTEM_CONFIG: dict[str, Any] = {
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 500,
    "health_check_timeout_ms": 500,
    "health_check_failure_threshold": 3,
    # Metrics reach the Prometheus endpoint within ~1 s instead of ~10 s.
    "metrics_report_interval_ms": 1000,
}

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class SimHost:
    """One running simulated host (a Ray node)."""

    slice_name: str
    worker_id: int
    node: Any  # ray._private.node.Node
    alive: bool = True

    @property
    def node_id(self) -> str:
        return self.node.node_id


@dataclasses.dataclass
class SimSlice:
    """One running simulated slice."""

    name: str
    topology: Topology
    hosts: list[SimHost]


def host_environment(slice_name: str, topo: Topology, worker_id: int) -> dict[str, str]:
    """The environment a GKE TPU host of this slice carries (plus the CPU stand-in).

    Example:
        >>> env = host_environment("s", Topology.parse("v4", "2x2x2"), 1)
        >>> env["TPU_WORKER_ID"], env["TPU_ACCELERATOR_TYPE"]
        ('1', 'v4-16')
    """
    hostnames = ",".join(f"{slice_name}-w-{i}" for i in range(topo.num_hosts))
    return {
        "TPU_NAME": slice_name,
        "TPU_WORKER_ID": str(worker_id),
        "TPU_ACCELERATOR_TYPE": topo.api_accelerator_type,
        "TPU_TOPOLOGY": topo.name,
        "TPU_WORKER_HOSTNAMES": hostnames,
        # The CPU stand-in for the host's chips: one XLA CPU device per TPU device.
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={topo.devices_per_host}",
    }


@contextlib.contextmanager
def _patched_environ(env: dict[str, str]) -> Iterator[None]:
    # Ray resolves a node's resources and labels in the process that starts the
    # node, from os.environ; patch it only for that call.
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class SimulatedCluster:
    """A real multi-node Ray cluster whose worker nodes are simulated TPU hosts.

    The head node holds no TPU. Use as a context manager: the cluster is shut
    down on exit, on error and on Ctrl-C.

    Args:
        slices: The slices to start.
        head_cpus: Logical CPUs of the head node (drivers, Serve, Ray Data).
        object_store_mb: Object store size of every node, in MiB.
        connect: Connect this process's ``ray`` to the cluster on start.
        include_dashboard: Start Ray's dashboard (the state API and web UI; each
            node's Prometheus endpoint works without it).
        dashboard_port: Explicit dashboard port (0 lets the OS choose).
        metrics_export_port: Explicit Prometheus port of the head node.
        temp_dir: Root for Ray's session files; a private temp dir by default.
        log_to_driver: Forward worker logs to this process (default: ``verbose``).
        verbose: Show everything Ray prints (INFO logs, Ray Data progress,
            raylet crash dumps). Default: quiet, see the module docstring.
        health_check: "fast" (default): a killed host's node is declared dead
            in about 1.5 s; "production": Ray's default node health-check
            timing (about 15-30 s), as on a real cluster, so that failure
            detection that does not rely on it can be tested.
        clock: Monotonic clock, injectable for tests.

    Example:
        >>> with SimulatedCluster([SliceSpec("v4", "2x2x2", name="a")]) as sim:  # doctest: +SKIP
        ...     print(sim.address, sim.startup_s)
    """

    def __init__(
        self,
        slices: Sequence[SliceSpec] = (),
        *,
        head_cpus: int = 2,
        object_store_mb: int = 100,
        connect: bool = True,
        include_dashboard: bool = False,
        dashboard_port: int = 0,
        metrics_export_port: int | None = None,
        temp_dir: str | None = None,
        log_to_driver: bool | None = None,
        verbose: bool = False,
        health_check: str = "fast",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        check_int("object_store_mb", object_store_mb)
        if object_store_mb < 80:
            raise InvalidArgument(f"object_store_mb={object_store_mb} is below Ray's minimum of 80")
        check_int("head_cpus", head_cpus, minimum=1)
        self._specs = _specs(slices)
        self._head_cpus = head_cpus
        self._store_bytes = object_store_mb * 1024 * 1024
        self._connect = connect
        self._include_dashboard = include_dashboard
        self._dashboard_port = dashboard_port
        self._metrics_export_port = metrics_export_port
        self._own_temp = temp_dir is None
        self._temp_dir = temp_dir
        self._verbose = bool(verbose)
        self._health_check = check_choice("health_check", health_check, ("fast", "production"))
        self._log_to_driver = self._verbose if log_to_driver is None else log_to_driver
        self._quiet: _QuietRay | None = None
        self._clock = clock
        self._cluster: Any = None
        self._slices: dict[str, SimSlice] = {}
        self._counter = 0
        self.startup_s: float | None = None

    # -- lifecycle -----------------------------------------------------
    def start(self) -> SimulatedCluster:
        """Starts the head and every slice; returns self."""
        import ray
        from ray.cluster_utils import Cluster

        if self._cluster is not None:
            raise RuntimeError("SimulatedCluster already started")
        names = [s.name for s in self._specs if s.name]
        if len(names) != len(set(names)):
            raise ValueError(f"duplicate slice names in {names}")
        t0 = self._clock()
        if self._temp_dir is None:
            # Short path: Ray's unix sockets live under it (107-char limit).
            self._temp_dir = tempfile.mkdtemp(prefix="rs-", dir="/tmp")
        # Ray writes the current-cluster address file under $RAY_TMPDIR/ray.
        os.makedirs(os.path.join(self._temp_dir, "ray"), exist_ok=True)
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        head_args: dict[str, Any] = dict(
            num_cpus=self._head_cpus,
            object_store_memory=self._store_bytes,
            temp_dir=self._temp_dir,
            include_dashboard=self._include_dashboard,
            dashboard_host="127.0.0.1",
            dashboard_port=self._dashboard_port if self._include_dashboard else None,
            _system_config=(
                _SIM_SYSTEM_CONFIG
                if self._health_check == "fast"
                else {k: v for k, v in _SIM_SYSTEM_CONFIG.items() if not k.startswith("health_check")}
            ),
        )
        if self._metrics_export_port is not None:
            head_args["metrics_export_port"] = self._metrics_export_port
        try:
            with _patched_environ({"RAY_TMPDIR": self._temp_dir}):
                self._cluster = Cluster(initialize_head=True, head_node_args=head_args)
            for spec in self._specs:
                self._start_slice(spec)
            if self._connect:
                if not self._verbose:
                    self._quiet = _QuietRay(self._temp_dir).install()
                ray.init(
                    address=self.address,
                    log_to_driver=self._log_to_driver,
                    logging_level=logging.INFO if self._verbose else logging.WARNING,
                )
        except BaseException:
            self.shutdown()
            raise
        self.startup_s = self._clock() - t0
        return self

    def shutdown(self) -> None:
        """Stops every node and removes the session files. Idempotent."""
        import ray

        if ray.is_initialized():
            ray.shutdown()
        if self._quiet is not None:
            self._quiet.restore()
            self._quiet = None
        if self._cluster is not None:
            with contextlib.suppress(Exception):
                self._cluster.shutdown()
            self._cluster = None
        if self._own_temp and self._temp_dir:
            shutil.rmtree(self._temp_dir, ignore_errors=True)
            self._temp_dir = None
        self._slices.clear()

    def __enter__(self) -> SimulatedCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- state ----------------------------------------------------------
    @property
    def address(self) -> str:
        """The GCS address to pass to ``ray.init(address=...)``."""
        if self._cluster is None:
            raise RuntimeError("SimulatedCluster is not running")
        return self._cluster.address

    @property
    def dashboard_url(self) -> str | None:
        """The dashboard URL, when the dashboard was started."""
        return self._cluster.webui_url if self._cluster is not None else None

    @property
    def slices(self) -> dict[str, SimSlice]:
        """The running slices by name (hosts that were preempted have alive=False)."""
        return dict(self._slices)

    @property
    def slice_names(self) -> list[str]:
        return list(self._slices)

    @property
    def num_hosts(self) -> int:
        """Alive simulated hosts."""
        return sum(h.alive for s in self._slices.values() for h in s.hosts)

    # -- changes (a node pool's life) --------------------------------------
    def add_slice(self, spec: SliceSpec | str) -> str:
        """Brings up a new slice (a SliceSpec or "GEN:TOPOLOGY[@NAME]"), as a node pool recreating one.

        Returns:
            The new slice's name.
        """
        (spec,) = _specs([spec])
        if spec.name is not None and spec.name in self._slices:
            raise fail("spec", spec.name, "a slice name not already in the cluster")
        if self._cluster is None:
            raise RuntimeError("SimulatedCluster is not running")
        return self._start_slice(spec).name

    def preempt_host(self, slice_name: str, worker_id: int, *, wait: bool = True, timeout_s: float = 30.0) -> None:
        """Kills one host's node abruptly, as a preempted VM dies.

        With ``wait`` (default), returns once Ray's control plane has declared
        the node dead (within ``timeout_s``); without, right after the kill.
        """
        host = self._host(slice_name, worker_id)
        self._kill([host], wait, timeout_s)

    def preempt_slice(self, slice_name: str, *, wait: bool = True, timeout_s: float = 30.0) -> None:
        """Kills every host of a slice abruptly (a whole-slice preemption)."""
        s = self._slice(slice_name)
        self._kill([h for h in s.hosts if h.alive], wait, timeout_s)

    def notify_preemption(self, slice_name: str, worker_id: int, grace_s: float) -> list[int]:
        """Delivers a preemption notice to one host, then kills it after ``grace_s``; returns at once.

        The notice travels the way Kubernetes delivers one before evicting a
        pod: SIGTERM to the host's Ray worker processes (a rayslice gang
        process records it as a notice; others exit as Ray's workers do). A
        timer thread kills the host abruptly (:meth:`preempt_host`, without
        waiting) ``grace_s`` seconds later, unless the cluster is shut down
        first or the host is already gone.

        Args:
            slice_name: A running slice.
            worker_id: A live host of it.
            grace_s: Seconds between the notice and the kill (>= 0).

        Returns:
            The process ids that got SIGTERM.
        """
        import signal
        import threading

        grace = check_float("grace_s", grace_s, minimum=0, maximum=3600)
        host = self._host(slice_name, check_int("worker_id", worker_id, minimum=0))
        pids = _worker_pids(host.node)
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGTERM)
        logger.info(
            "host %d of %s: preemption notice (SIGTERM to %d processes), killed in %.1f s (simulated)",
            worker_id,
            slice_name,
            len(pids),
            grace,
        )

        def kill() -> None:
            if self._cluster is not None and host.alive:
                with contextlib.suppress(Exception):
                    self._kill([host], False, 0.0)

        timer = threading.Timer(grace, kill)
        timer.daemon = True
        timer.name = f"rayslice-sim-preempt-{slice_name}-{worker_id}"
        timer.start()
        return pids

    # -- internals --------------------------------------------------------
    def _slice(self, name: str) -> SimSlice:
        if name not in self._slices:
            raise ValueError(f"no slice {name!r}; slices: {', '.join(self._slices) or 'none'}")
        return self._slices[name]

    def _host(self, slice_name: str, worker_id: int) -> SimHost:
        s = self._slice(slice_name)
        if not 0 <= worker_id < len(s.hosts):
            raise ValueError(f"worker_id {worker_id} is not in slice {slice_name!r}; valid: 0..{len(s.hosts) - 1}")
        host = s.hosts[worker_id]
        if not host.alive:
            raise ValueError(f"host {worker_id} of slice {slice_name!r} is already down")
        return host

    def _new_name(self, topo: Topology) -> str:
        while True:
            name = f"{topo.pod_type}-{self._counter}"
            self._counter += 1
            if name not in self._slices:
                return name

    def _start_slice(self, spec: SliceSpec) -> SimSlice:
        topo = spec.topology_info
        name = spec.name or self._new_name(topo)
        if name in self._slices:
            raise ValueError(f"slice {name!r} already exists")
        sim_slice = SimSlice(name=name, topology=topo, hosts=[])
        self._slices[name] = sim_slice
        for worker_id in range(topo.num_hosts):
            env = host_environment(name, topo, worker_id)
            with _patched_environ(env):
                node = self._cluster.add_node(
                    num_cpus=spec.cpus_per_host,
                    resources={"TPU": topo.chips_per_host},
                    object_store_memory=self._store_bytes,
                    temp_dir=self._temp_dir,
                    env_vars=env,
                )
            sim_slice.hosts.append(SimHost(name, worker_id, node))
        return sim_slice

    def _kill(self, hosts: list[SimHost], wait: bool, timeout_s: float) -> None:
        import ray

        for host in hosts:
            if self._quiet is not None:
                mates = [h.node_id for h in self._slices[host.slice_name].hosts if h is not host]
                self._quiet.expect_death(host.node_id, slice_mates=mates)
            # A preempted VM takes every process on it down at once: the node's own processes, and the
            # worker processes under its raylet (which would otherwise linger until they notice).
            workers = _descendants(_raylet_pid(host.node))
            self._cluster.remove_node(host.node, allow_graceful=False)
            _kill_pids(workers)
            host.alive = False
            logger.info("host %d of %s preempted (simulated)", host.worker_id, host.slice_name)
        if not wait:
            return
        dead = {h.node_id for h in hosts}
        deadline = Deadline(timeout_s, clock=self._clock)
        while True:
            alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]} if ray.is_initialized() else set()
            if not dead & alive:
                return
            deadline.sleep_or_raise(0.1, f"nodes {sorted(dead & alive)} still alive after kill")


def _raylet_pid(node: Any) -> int | None:
    try:
        from ray._private import ray_constants

        return int(node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid)
    except (AttributeError, KeyError, IndexError, TypeError, ImportError):
        return None


def _descendants(pid: int | None) -> list[int]:
    """Every process under ``pid`` (recursively); [] when there is none or it is gone."""
    import psutil

    if pid is None:
        return []
    with contextlib.suppress(psutil.Error):
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    return []


def _kill_pids(pids: Sequence[int]) -> None:
    import signal

    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def _worker_pids(node: Any) -> list[int]:
    """Ray worker processes running work on one simulated host (children of its raylet, not its agents)."""
    import psutil

    pid = _raylet_pid(node)
    if pid is None:
        return []
    out = []
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process(pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                # Workers are titled "ray::<actor or task>"; the node's agents ("ray::DashboardAgent",
                # "ray::RuntimeEnvAgent") share the raylet's fate and idle workers run nothing.
                name = (child.cmdline() or [""])[0].split(".", 1)[0]
                if name.startswith("ray::") and name != "ray::IDLE" and not name.endswith("Agent"):
                    out.append(child.pid)
    return out
