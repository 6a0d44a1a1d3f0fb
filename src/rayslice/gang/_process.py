"""The body of one gang process: its host's environment, its context, SIGTERM as a notice.

A gang actor is :class:`_HostProcess` wrapped with ``ray.remote``
(:func:`_actor_class`); a gang's local rank 0 runs the same body in the calling
process (:mod:`rayslice.gang._local`). Inside a gang process,
:func:`host_context` says where it sits.

Example:
    >>> gang_process = _HostProcess(None, None, notices=False)  # a warm process, not yet given a host
    >>> gang_process.ping(), gang_process.context() is None
    (True, True)
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import socket
from collections.abc import Callable, Sequence
from typing import Any

_MEGASCALE_KEYS = ("MEGASCALE_COORDINATOR_ADDRESS", "MEGASCALE_NUM_SLICES", "MEGASCALE_SLICE_ID", "MEGASCALE_PORT")


# -- SIGTERM as a preemption notice (Kubernetes sends it before evicting a pod) ----------------
# A gang process records SIGTERM instead of dying at once when something listens (a training
# attempt: rayslice.train.notice); with no listener it keeps Ray's behaviour (the process exits).
_NOTICE_LISTENERS: list[Callable[[str], None]] = []
_PREVIOUS_SIGTERM: Any = None


def on_sigterm(listener: Callable[[str], None]) -> Callable[[], None]:
    """Calls ``listener("SIGTERM")`` when this gang process gets SIGTERM; returns the unsubscribe function."""
    _NOTICE_LISTENERS.append(listener)

    def remove() -> None:
        if listener in _NOTICE_LISTENERS:
            _NOTICE_LISTENERS.remove(listener)

    return remove


def _sigterm(signum: int, frame: Any) -> None:
    if _NOTICE_LISTENERS:
        for listener in list(_NOTICE_LISTENERS):
            try:
                listener("SIGTERM")
            except Exception:  # a listener never turns a notice into a crash
                pass
        return
    import signal

    previous = _PREVIOUS_SIGTERM
    if callable(previous):
        previous(signum, frame)
    elif previous != signal.SIG_IGN:
        raise SystemExit(128 + signum)


def _install_sigterm() -> None:
    global _PREVIOUS_SIGTERM
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be installed from the main thread
    try:
        previous = signal.signal(signal.SIGTERM, _sigterm)
    except (ValueError, OSError):
        return
    if previous is not _sigterm:
        _PREVIOUS_SIGTERM = previous


@dataclasses.dataclass(frozen=True)
class HostContext:
    """Where a gang process sits; :func:`host_context` returns it inside the process."""

    rank: int  # == jax.process_index()
    world_size: int  # == jax.process_count()
    slice_index: int
    slice_name: str
    worker_id: int
    num_slices: int
    hosts_per_slice: int
    node_id: str
    devices_per_host: int
    coordinator_address: str | None = None
    gang_name: str = ""
    artifacts_dir: str | None = None  # where the job keeps its outputs (a training run's path)


_CONTEXT: HostContext | None = None


def host_context() -> HostContext:
    """This gang process's :class:`HostContext` (only inside a gang process)."""
    if _CONTEXT is None:
        raise RuntimeError("host_context() is only available inside a rayslice gang process")
    return _CONTEXT


class _HostProcess:
    """The body of one gang actor (wrapped with ``ray.remote`` at start)."""

    def __init__(self, env: dict[str, str] | None, ctx: HostContext | None, notices: bool = True) -> None:
        # ``None, None``: a warm process of a :class:`~rayslice.warm.WarmPool`, given its host by :meth:`adopt` later.
        self._held: socket.socket | None = None
        self._ctx: HostContext | None = None
        if env is not None and ctx is not None:
            self.adopt(env, ctx)
        if notices:  # not for a local rank 0 (_LocalHost): the process and its signals are its owner's
            _install_sigterm()  # in the actor's main thread: SIGTERM becomes a notice (see on_sigterm)

    def adopt(self, env: dict[str, str], ctx: HostContext) -> bool:
        """Becomes one host of a gang: sets that host's environment before JAX starts a backend."""
        global _CONTEXT
        # Never inherit multi-slice settings from the node or a previous job.
        for key in _MEGASCALE_KEYS:
            os.environ.pop(key, None)
        # A gang process holds every chip of its host: as Ray does for a whole-host allocation,
        # no visible-chips mask (a warm process was started without the bundle's resources).
        os.environ.pop("TPU_VISIBLE_CHIPS", None)
        os.environ.update(env)
        _CONTEXT = ctx
        self._ctx = ctx
        return True

    def warm_up(self, imports: Sequence[str], optional: Sequence[str] = ()) -> float:
        """Imports ``imports`` (e.g. ``"jax"``), and ``optional`` where installed, without starting any JAX
        backend; returns the seconds taken."""
        import importlib
        import time

        t0 = time.perf_counter()
        for name in imports:
            importlib.import_module(name)
        for name in optional:
            try:
                importlib.import_module(name)
            except ModuleNotFoundError:  # not installed here: nothing to warm
                pass
        import gc

        gc.freeze()  # the modules live as long as the process: keep them out of full collections (GIL pauses)
        return time.perf_counter() - t0

    def bind_coordinator_port(self) -> int:
        """Binds a port on this host and holds it until JAX takes it over."""
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("", 0))
        self._held = s
        return s.getsockname()[1]

    def init_jax(
        self, coordinator: str, num_processes: int, process_id: int, timeout_s: float, cpu_collectives: bool = True
    ) -> dict[str, Any]:
        global _CONTEXT
        import time

        if self._ctx is None:
            raise RuntimeError("a warm gang process must be adopted before jax.distributed starts")
        if self._held is not None:
            # Hand the port over to JAX's coordination service, which binds it now.
            self._held.close()
            self._held = None
        t0 = time.perf_counter()
        import jax

        t1 = time.perf_counter()
        if process_id != 0:
            # A client that finds the coordination service not yet listening backs off for about a
            # second before it retries; connect only once host 0's service accepts connections.
            _wait_listening(coordinator, t1 + timeout_s)
        # JAX's own preemption service would take SIGTERM over (a C++ handler); rayslice's replaces it.
        jax.config.update("jax_enable_preemption_service", False)
        if not cpu_collectives:  # no computation spans processes: CPU collectives stay in memory (no gloo)
            jax.config.update("jax_cpu_collectives_implementation", None)
        jax.distributed.initialize(
            coordinator_address=coordinator,
            num_processes=num_processes,
            process_id=process_id,
            initialization_timeout=max(1, int(timeout_s)),
        )
        self._ctx = _CONTEXT = dataclasses.replace(self._ctx, coordinator_address=coordinator)
        return {
            "process_index": jax.process_index(),
            "process_count": jax.process_count(),
            "device_count": jax.device_count(),
            "local_device_count": jax.local_device_count(),
            "import_s": t1 - t0,
            "init_s": time.perf_counter() - t1,
        }

    def context(self) -> HostContext | None:
        return self._ctx

    def ping(self) -> bool:
        """Answers at once (a liveness check; run in the ``control`` group when the gang has one)."""
        return True

    def call(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        return fn(*args, **kwargs)

    def call_packed(self, call: bytes) -> Any:
        """Runs a call serialized once for every host (:meth:`SliceGang.run_async_packed`)."""
        fn, args, kwargs = pickle.loads(call)
        return fn(*args, **kwargs)

    def call_split(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[Any, Any]:
        # ``fn`` returns (summary, payload) and Ray stores them as two objects:
        # the caller fetches the small summary and can hand the payload on
        # (e.g. to Ray Data) without pulling it to the driver.
        summary, payload = fn(*args, **kwargs)
        return summary, payload


def _ping() -> bool:
    return True


def _wait_listening(address: str, until: float, poll_s: float = 0.005) -> bool:
    """Waits until a TCP server accepts connections at ``host:port`` (or ``until``, perf_counter); True if it does.

    Example:
        >>> import time
        >>> _wait_listening("127.0.0.1:1", time.perf_counter() + 0.05)  # nothing listens on port 1
        False
    """
    import time

    host, _, port = address.rpartition(":")
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=max(poll_s, 0.05)):
                return True
        except OSError:
            if time.perf_counter() + poll_s >= until:
                return False
            time.sleep(poll_s)


def _actor_class(options: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The Ray actor class of gang processes for these actor options, and the options left for ``.options``."""
    import ray

    options = dict(options)
    groups = options.pop("concurrency_groups", None)  # Ray takes them only at ray.remote, not .options
    cls = ray.remote(concurrency_groups=groups)(_HostProcess) if groups else ray.remote(_HostProcess)  # type: ignore[call-overload]
    return cls, options
