"""Host gangs: one fresh Ray actor per reserved host, with ``jax.distributed`` up.

A gang starts one actor per host of a :class:`~rayslice.placement.SlicePlacementGroup`,
pinned to that host's bundle and holding its chips. Each actor sets the
environment a TPU workload expects (``TPU_WORKER_ID``, ``TPU_WORKER_HOSTNAMES``
and, for multi-slice, ``MEGASCALE_*``) fresh, replacing whatever the node had,
*before* JAX is imported. Host 0 binds the coordinator port itself and reports
it, then hands it to JAX's coordination service in the same process (a
close-and-rebind window of microseconds, on host 0 only, instead of the
classic guess-a-free-port race across machines); then every process runs
``jax.distributed.initialize`` under one deadline, on every backend (CPU uses
gloo), forming one global mesh whose process index follows (slice, worker id).

``jax.distributed`` cannot be initialised twice in one process, so every
attempt (a restart after preemption, a new serve replica) starts a new gang.
JAX is imported only inside gang processes, never by the driver. The one
exception is a gang whose rank 0 is the calling process itself
(``local_rank0=True``: a serve replica standing on host 0 of its slice); that
process then is a gang process, once in its life.

Example:
    >>> import rayslice
    >>> def count():
    ...     import jax
    ...     return jax.device_count()
    >>> rayslice.run_on_slice(count, topology="2x2x2", accelerator_type="TPU-V4")  # doctest: +SKIP
    [8, 8]
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import io
import os
import pickle
import socket
import types
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from rayslice._deadline import Deadline
from rayslice._validate import check_bool, fail
from rayslice.errors import GangError, Outcome, classify
from rayslice.placement import SlicePlacementGroup
from rayslice.topology import MEGASCALE_PORT

#: Ray namespace of named gang processes (``<gang>/<gang id>/<rank>``).
NAMESPACE = "rayslice"
#: Name of the optional concurrency group for control calls (liveness pings): a gang started with
#: ``actor_options={"concurrency_groups": {CONTROL_GROUP: 1}}`` answers them while its work runs.
CONTROL_GROUP = "control"
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


def gang_actor_name(gang: str, gang_id: str, rank: int) -> str:
    """The Ray actor name of one gang process (namespace :data:`NAMESPACE`).

    Example:
        >>> gang_actor_name("my-run", "ab12cd34", 1)
        'my-run/ab12cd34/1'
    """
    return f"{gang}/{gang_id}/{rank}"


_CONTEXT: HostContext | None = None


def host_context() -> HostContext:
    """This gang process's :class:`HostContext` (only inside a gang process)."""
    if _CONTEXT is None:
        raise RuntimeError("host_context() is only available inside a rayslice gang process")
    return _CONTEXT


def gang_environment(spg: SlicePlacementGroup, slice_index: int, worker_id: int) -> dict[str, str]:
    """The TPU environment a gang process sets for one host of a reservation (pure).

    Example:
        >>> # {'TPU_WORKER_ID': '1', 'TPU_WORKER_HOSTNAMES': '10.0.0.1,10.0.0.2', ...}
    """
    s = spg.slices[slice_index]
    env = {
        "TPU_WORKER_ID": str(worker_id),
        "TPU_WORKER_HOSTNAMES": ",".join(h.ip for h in s.hosts),
        "TPU_NAME": s.name,
    }
    if spg.num_slices > 1:
        env.update(
            MEGASCALE_COORDINATOR_ADDRESS=spg.slices[0].hosts[0].ip,
            MEGASCALE_NUM_SLICES=str(spg.num_slices),
            MEGASCALE_SLICE_ID=str(slice_index),
            MEGASCALE_PORT=str(MEGASCALE_PORT),
        )
    return env


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


class _LocalRef:
    """A call running on a gang's local rank 0; stands in for the ``ObjectRef`` a gang actor returns.

    Gang code waits on it through :meth:`future`, as on an ``ObjectRef``'s.
    """

    def __init__(self, future: concurrent.futures.Future) -> None:
        self._future = future

    def future(self) -> concurrent.futures.Future:
        return self._future


class _LocalMethod:
    def __init__(self, host: _LocalHost, name: str) -> None:
        self._host, self._name = host, name

    def options(self, **options: Any) -> _LocalMethod:
        if options.get("num_returns", 1) != 1:
            raise NotImplementedError(f"{self._name} with num_returns={options['num_returns']} on a local rank 0")
        return self  # a concurrency group: the local rank answers pings at once anyway

    def remote(self, *args: Any) -> _LocalRef:
        return _LocalRef(self._host.submit(self._name, args))


class _LocalHost:
    """Rank 0 of a gang in the calling process (``SliceGang(local_rank0=True)``), with a gang actor's methods.

    Calls run one at a time on one thread of this process, in order, as on an
    actor; a ping answers at once. An exception from the user's function is
    raised as Ray raises one from an actor (a ``RayTaskError`` that is also an
    instance of the cause), so outcomes are classified the same way.
    """

    def __init__(self, env: dict[str, str], ctx: HostContext) -> None:
        self.body = _HostProcess(env, ctx, notices=False)
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rayslice-rank0")

    def __getattr__(self, name: str) -> _LocalMethod:
        if name.startswith("_") or not callable(getattr(_HostProcess, name, None)):
            raise AttributeError(name)
        return _LocalMethod(self, name)

    def submit(self, name: str, args: tuple) -> concurrent.futures.Future:
        if name == "ping":
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result(True)
            return done
        return self.pool.submit(_run_local, getattr(self.body, name), name, args)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def _run_local(method: Callable[..., Any], name: str, args: tuple) -> Any:
    try:
        return method(*args)
    except Exception as e:
        import traceback

        from ray.exceptions import RayTaskError

        fn = args[0] if name in ("call", "call_split") else None
        where = getattr(fn, "__name__", name)
        raise RayTaskError(where, traceback.format_exc(), e, pid=os.getpid()).as_instanceof_cause() from None


def _pack(fn: Callable[..., Any], args: tuple, kwargs: dict) -> bytes | None:
    """``(fn, args, kwargs)`` as bytes every host can load, or None when the call holds a Ray handle.

    Object refs and actor handles are counted references that only Ray's own
    serializer may carry (pickled outside it, Ray would lose track of them).
    A serving step's call (a module's function on numbers, strings and numpy
    arrays) takes the standard pickler, about 7x faster than cloudpickle on
    a one-row batch; anything else goes through cloudpickle, refusing handles.

    Example:
        >>> call = _pack(divmod, (7, 2), {})
        >>> fn, args, kwargs = pickle.loads(call)
        >>> fn(*args, **kwargs)
        (3, 1)
    """
    if _plain_data((args, kwargs)) and _by_reference(fn):
        return pickle.dumps((fn, args, kwargs), protocol=5)  # no handle can hide in plain data
    global _PICKLER
    if _PICKLER is None:
        import ray
        from ray import cloudpickle
        from ray.actor import ActorHandle

        class NoHandles(cloudpickle.Pickler):
            def reducer_override(self, obj: Any) -> Any:
                if isinstance(obj, ray.ObjectRef | ActorHandle):
                    raise _HoldsHandle
                return super().reducer_override(obj)

        _PICKLER = NoHandles
    buf = io.BytesIO()
    try:
        _PICKLER(buf, protocol=5).dump((fn, args, kwargs))
    except _HoldsHandle:
        return None
    return buf.getvalue()


#: Leaf types of :func:`_plain_data` (numpy arrays and scalars are checked apart).
_PLAIN_LEAVES = frozenset({type(None), bool, int, float, complex, str, bytes})


def _plain_data(obj: Any, limit: int = 256) -> bool:
    """Whether ``obj`` is only numbers, strings, numpy data and dicts, lists, tuples of them (at most ``limit`` items).

    Nothing else can hide an object ref or an actor handle, so such data is
    safe for the standard pickler.

    Example:
        >>> import numpy as np
        >>> _plain_data(({"x": np.ones((1, 8), np.float32)}, 1)), _plain_data((object(),))
        (True, False)
        >>> _plain_data(np.array([None], dtype=object))  # an object array can hold anything
        False
    """
    import numpy as np

    stack = [obj]
    while stack:
        limit -= 1
        if limit < 0:
            return False
        x = stack.pop()
        t = type(x)
        if t in _PLAIN_LEAVES:
            continue
        if t is np.ndarray or isinstance(x, np.generic):
            if x.dtype.hasobject:
                return False
        elif t is tuple or t is list:
            stack.extend(x)
        elif t is dict:
            stack.extend(x)
            stack.extend(x.values())
        else:
            return False
    return True


def _by_reference(fn: Any) -> bool:
    """Whether cloudpickle pickles ``fn`` by reference, as the standard pickler does (decided once per function).

    True for a module's function or a builtin that every host imports; False
    for lambdas, closures, ``__main__``'s functions and those of a module
    registered with ``cloudpickle.register_pickle_by_value`` (sent by value).

    Example:
        >>> _by_reference(divmod), _by_reference(lambda: 1), _by_reference({}.get)
        (True, False, False)
    """
    if not isinstance(fn, types.FunctionType | types.BuiltinFunctionType):
        return False  # a bound method or a callable object: pickled with its state
    if not isinstance(getattr(fn, "__self__", None), types.ModuleType | None):
        return False  # a builtin bound to an object ({...}.get): pickled with that object
    try:
        return _BY_REFERENCE[fn]
    except (KeyError, TypeError):
        pass
    from ray import cloudpickle

    try:
        same = pickle.dumps(fn, protocol=5) == cloudpickle.dumps(fn, protocol=5)
    except Exception:  # not importable by name (a lambda, a local function)
        same = False
    try:
        _BY_REFERENCE[fn] = same
    except TypeError:  # a builtin cannot be weakly referenced: decided again next time (a few us)
        pass
    return same


_BY_REFERENCE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_PICKLER: Any = None


class _HoldsHandle(Exception):
    """A call to pack holds an object ref or actor handle."""


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


def _kill(actor: Any) -> None:
    if isinstance(actor, _LocalHost):
        actor.close()
        return
    import ray

    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # already dead, or the cluster is gone
        pass


def _ordered_get(refs: Sequence[Any], deadline: Deadline, what: str) -> list[Any]:
    """ray.get over refs in rank order, raising at the first failure (no waiting on the rest)."""
    import ray

    if any(isinstance(ref, _LocalRef) for ref in refs):
        return _ordered_result([ref.future() for ref in refs], deadline, what)
    index = {ref: i for i, ref in enumerate(refs)}
    results: list[Any] = [None] * len(refs)
    pending = list(refs)
    while pending:
        timeout = None if deadline.timeout_s is None else deadline.remaining
        ready, pending = ray.wait(pending, num_returns=1, timeout=timeout)
        if not ready:
            raise GangError(
                f"{what}: {len(pending)} host(s) did not finish within {deadline.timeout_s:g} s", Outcome.TIMEOUT
            )
        for ref in ready:
            results[index[ref]] = _result(functools.partial(ray.get, ref), index[ref], what)
    return results


def _result(get: Callable[[], Any], rank: int, what: str) -> Any:
    try:
        return get()
    except Exception as exc:
        outcome = classify(exc)
        if outcome is Outcome.FAILED:
            raise  # the user's own exception, as Ray re-raises it
        raise GangError(f"{what}: host rank {rank} lost ({outcome.value}): {exc}", outcome, rank=rank) from exc


def _ordered_result(futures: Sequence[concurrent.futures.Future], deadline: Deadline, what: str) -> list[Any]:
    """:func:`_ordered_get` over futures (a gang with a local rank 0: its refs and the actors' ``ref.future()``)."""
    index = {f: i for i, f in enumerate(futures)}
    results: list[Any] = [None] * len(futures)
    pending = set(futures)
    try:
        while pending:
            timeout = None if deadline.timeout_s is None else deadline.remaining
            done, pending = concurrent.futures.wait(pending, timeout=timeout, return_when="FIRST_COMPLETED")
            if not done:
                raise GangError(
                    f"{what}: {len(pending)} host(s) did not finish within {deadline.timeout_s:g} s", Outcome.TIMEOUT
                )
            for f in sorted(done, key=index.__getitem__):
                results[index[f]] = _result(f.result, index[f], what)
    finally:
        for f in pending:
            f.cancel()
    return results


_LOCAL_RANK0_STARTED = False  # this process already was rank 0 of a gang (jax.distributed starts once)


def _check_local_rank0(spg: SlicePlacementGroup, init_jax: bool) -> None:
    """Raises unless this process may be rank 0 of a gang on ``spg`` (checked before anything starts)."""
    global _LOCAL_RANK0_STARTED
    import ray

    host0 = spg.slices[0].hosts[0]
    here = ray.get_runtime_context().get_node_id()
    if here != host0.node_id:
        raise fail(
            "local_rank0",
            True,
            f"a process on host 0 of slice {spg.slices[0].name} (node {host0.node_id[:12]}); "
            f"this process runs on node {here[:12]}",
        )
    if init_jax and _LOCAL_RANK0_STARTED:
        raise fail("local_rank0", True, "a process that was not rank 0 before: jax.distributed starts once per process")
    _LOCAL_RANK0_STARTED = _LOCAL_RANK0_STARTED or init_jax


class WarmSource(Protocol):
    """What :class:`SliceGang` needs of a warm pool (:class:`rayslice.warm.WarmPool` is one).

    A gang adopts the pool's process on a reserved host instead of starting a
    fresh one, and only when the pool's actor options are the gang's own.
    """

    actor_options: dict[str, Any]

    def take(self, node_id: str) -> Any | None:
        """The pool's process on ``node_id`` (now the caller's), or None."""
        ...


class SliceGang:
    """One process per reserved host, with ``jax.distributed`` initialised.

    Args:
        spg: The reservation to run on (not released by the gang).
        init_jax: Initialise ``jax.distributed`` on start.
        cpu_collectives: On the CPU backend (the simulator), join the processes' CPU devices with JAX's
            cross-process collectives (gloo over TCP). ``False`` for work whose every computation stays inside
            one process (e.g. the LLM server's ``"data_tensor"`` layout): collectives between a process's own
            devices then run in memory instead of through gloo, and a computation spanning processes is refused
            by JAX. No effect on accelerators.
        init_timeout_s: Deadline for all processes to start and form the mesh.
        env: Extra environment for every process.
        actor_options: Extra Ray actor options (e.g. ``max_concurrency=2`` so
            a process can answer while it runs a long call).
        name: Names the processes (``<name>/<gang id>/<rank>``, namespace
            ``rayslice``) so tools such as ``rayslice profile`` can find them.
        artifacts_dir: Where the job keeps its outputs (profiles go under
            it); seen by the processes as ``host_context().artifacts_dir``.
        warm: A :class:`~rayslice.warm.WarmPool` whose processes on the reserved hosts this
            gang adopts instead of starting fresh ones (used only when its
            actor options are the gang's).
        local_rank0: Make the calling process itself rank 0 (host 0 of the
            first slice) instead of starting an actor there: rank 0's calls
            then run in this process, on one thread, with no Ray call on the
            way (a serve replica placed on host 0 answers requests this way).
            The caller must run on that host's node, and a process can be
            rank 0 of one such gang in its life (``jax.distributed`` starts
            once per process). The reservation keeps holding host 0's chips.

    After :meth:`start`, :attr:`timings` says where the start-up time went:
    ``processes_s`` (every process up and holding its host's environment),
    ``import_s`` and ``init_s`` (the slowest host's ``import jax`` and
    ``jax.distributed.initialize``), ``total_s``, and ``adopted`` (processes
    taken from the warm pool).

    Example:
        >>> with slice_placement_group("2x2x2", "v4") as spg, SliceGang(spg) as gang:  # doctest: +SKIP
        ...     gang.run(lambda: __import__("jax").process_index())
        [0, 1]
    """

    def __init__(
        self,
        spg: SlicePlacementGroup,
        *,
        init_jax: bool = True,
        cpu_collectives: bool = True,
        init_timeout_s: float = 120.0,
        env: dict[str, str] | None = None,
        actor_options: dict[str, Any] | None = None,
        name: str | None = None,
        artifacts_dir: str | None = None,
        warm: WarmSource | None = None,
        local_rank0: bool = False,
    ) -> None:
        check_bool("local_rank0", local_rank0)
        self.local_rank0 = local_rank0
        self.spg = spg
        self.warm = warm
        self.timings: dict[str, float] = {}
        self.artifacts_dir = artifacts_dir
        self.name = name
        self.actor_options = dict(actor_options or {})
        self.init_jax = init_jax
        self.cpu_collectives = cpu_collectives
        self.init_timeout_s = init_timeout_s
        self.env = dict(env or {})
        self.actors: list[Any] = []
        self.contexts: list[HostContext] = []
        self.jax_info: list[dict[str, Any]] = []

    def start(self) -> SliceGang:
        import time
        import uuid

        t0 = time.perf_counter()
        if self.local_rank0:
            _check_local_rank0(self.spg, self.init_jax)
        topo = self.spg.topology
        actor_cls, options = _actor_class(self.actor_options)
        warm = self.warm if self.warm is not None and self.warm.actor_options == self.actor_options else None
        world = self.spg.num_hosts
        gang_id = uuid.uuid4().hex[:8]
        up: list[Any] = []  # per rank: a call that returns once the process is up with its environment
        adopted = 0
        try:
            for rank, (s, h) in enumerate(self.spg.hosts()):
                ctx = HostContext(
                    rank=rank,
                    world_size=world,
                    slice_index=s.slice_index,
                    slice_name=s.name,
                    worker_id=h.worker_id,
                    num_slices=self.spg.num_slices,
                    hosts_per_slice=len(s.hosts),
                    node_id=h.node_id,
                    devices_per_host=topo.devices_per_host,
                    gang_name=self.name or "",
                    artifacts_dir=self.artifacts_dir,
                )
                env = {**gang_environment(self.spg, s.slice_index, h.worker_id), **self.env}
                if rank == 0 and self.local_rank0:
                    local = _LocalHost(env, ctx)
                    self.actors.append(local)
                    self.contexts.append(ctx)
                    up.append(local.ping.remote())
                    continue
                actor = warm.take(h.node_id) if warm is not None else None
                if actor is not None:
                    self.actors.append(actor)
                    self.contexts.append(ctx)
                    up.append(actor.adopt.remote(env, ctx))
                    adopted += 1
                    continue
                actor = actor_cls.options(
                    num_cpus=0,
                    resources={"TPU": float(topo.chips_per_host)},
                    scheduling_strategy=self.spg.scheduling_strategy(s.slice_index, h.worker_id),
                    max_restarts=0,
                    max_task_retries=0,
                    **(
                        {"name": gang_actor_name(self.name, gang_id, rank), "namespace": NAMESPACE} if self.name else {}
                    ),
                    **options,
                ).remote(env, ctx)
                self.actors.append(actor)
                self.contexts.append(ctx)
                up.append(actor.ping.remote())
            deadline = Deadline(self.init_timeout_s)
            _ordered_get(up, deadline, "starting gang processes")
            self.timings = {"processes_s": time.perf_counter() - t0, "adopted": float(adopted)}
            if self.init_jax:
                self._init_jax(deadline)
                self.timings["import_s"] = max(i.pop("import_s", 0.0) for i in self.jax_info)
                self.timings["init_s"] = max(i.pop("init_s", 0.0) for i in self.jax_info)
            self.timings["total_s"] = time.perf_counter() - t0
        except BaseException:
            self.shutdown()
            raise
        return self

    def _init_jax(self, deadline: Deadline) -> None:
        port = _ordered_get([self.actors[0].bind_coordinator_port.remote()], deadline, "coordinator port")[0]
        ip = self.spg.slices[0].hosts[0].ip
        coordinator = f"{ip}:{port}"
        refs = [
            a.init_jax.remote(coordinator, len(self.actors), rank, deadline.remaining, self.cpu_collectives)
            for rank, a in enumerate(self.actors)
        ]
        self.jax_info = _ordered_get(refs, deadline, "jax.distributed.initialize")
        self.contexts = [dataclasses.replace(c, coordinator_address=coordinator) for c in self.contexts]

    def run_async(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Starts ``fn(*args, **kwargs)`` on every host; returns the refs in rank order."""
        return [a.call.remote(fn, args, kwargs) for a in self.actors]

    def run_async_packed(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """:meth:`run_async` with the call serialized once, the same bytes sent to every host.

        For small, latency-bound calls (a serving step): Ray serializes each
        host's arguments again, and for small numpy arguments that is most of
        a call's submission time. A call holding an object ref or an actor
        handle goes through :meth:`run_async` (only Ray may serialize those).
        """
        return self._send(range(len(self.actors)), fn, args, kwargs)

    def run_async_on(self, ranks: Sequence[int], fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Starts ``fn(*args, **kwargs)`` on the hosts of ``ranks`` only; returns their refs in that order.

        For work that needs no collective between hosts (each host computes
        on its own devices), so that idle hosts are not woken. The call is
        serialized once for all of them, as in :meth:`run_async_packed`.
        """
        bad = [r for r in ranks if not 0 <= r < len(self.actors)]
        if bad:
            raise IndexError(f"ranks={list(ranks)!r} is not valid: expected ranks in 0..{len(self.actors) - 1}")
        return self._send(ranks, fn, args, kwargs)

    def _send(self, ranks: Iterable[int], fn: Callable[..., Any], args: tuple, kwargs: dict) -> list[Any]:
        ranks = list(ranks)
        remote = [r for r in ranks if not isinstance(self.actors[r], _LocalHost)]
        call = _pack(fn, args, kwargs) if remote else None
        refs: dict[int, Any] = {}
        for r in remote:  # first, so the other hosts get their share while the local rank starts on its own
            a = self.actors[r]
            refs[r] = a.call.remote(fn, args, kwargs) if call is None else a.call_packed.remote(call)
        for r in ranks:
            if r not in refs:  # the local rank 0 takes the objects themselves (nothing to serialize)
                refs[r] = self.actors[r].call.remote(fn, args, kwargs)
        return [refs[r] for r in ranks]

    def run_each(
        self, fn: Callable[..., tuple[Any, Any]], args_per_rank: Sequence[tuple], *, timeout_s: float | None = None
    ) -> tuple[list[Any], list[Any]]:
        """Runs ``fn(*args_per_rank[rank])`` on each host; ``fn`` returns ``(summary, payload)``.

        Returns the summaries (fetched) and refs to the payloads, in rank
        order. Payloads stay in the object store, owned by the driver, so they
        outlive the gang. Raises like :meth:`run` on failure.
        """
        if len(args_per_rank) != len(self.actors):
            raise ValueError(f"{len(args_per_rank)} argument tuples for {len(self.actors)} hosts")
        pairs = [
            a.call_split.options(num_returns=2).remote(fn, tuple(args), {})
            for a, args in zip(self.actors, args_per_rank)
        ]
        summaries = _ordered_get([s for s, _ in pairs], Deadline(timeout_s), getattr(fn, "__name__", "fn"))
        return summaries, [payload for _, payload in pairs]

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None, **kwargs: Any) -> list[Any]:
        """Runs ``fn`` once per host (SPMD) and returns the results in rank order.

        Raises:
            The user's exception (from the first host that raised it), or
            :class:`GangError` with outcome PREEMPTED/TIMEOUT when a host was
            lost or the deadline ran out.
        """
        return _ordered_get(self.run_async(fn, *args, **kwargs), Deadline(timeout_s), getattr(fn, "__name__", "fn"))

    def ping_async(self) -> list[Any]:
        """Starts a liveness ping on every host; returns the refs in rank order (each resolves to True).

        A gang started with a :data:`CONTROL_GROUP` concurrency group answers
        pings there, so they never queue behind a long call.
        """
        if CONTROL_GROUP in (self.actor_options.get("concurrency_groups") or {}):
            return [a.ping.options(concurrency_group=CONTROL_GROUP).remote() for a in self.actors]
        return [a.call.remote(_ping, (), {}) for a in self.actors]

    def lost_hosts(self, timeout_s: float = 5.0) -> list[int]:
        """Ranks whose process does not answer a ping within ``timeout_s`` (dead or unreachable).

        An error seen in one process (a collective failing) is often only the
        echo of another host dying; this tells the two apart.
        """
        import ray

        refs = self.ping_async()
        if self.local_rank0:
            futures = [ref.future() for ref in refs]
            concurrent.futures.wait(futures, timeout=timeout_s)
            return [r for r, f in enumerate(futures) if not f.done() or f.cancelled() or f.exception() is not None]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        lost = []
        for rank, ref in enumerate(refs):
            if ref not in ready:
                lost.append(rank)
                continue
            try:
                ray.get(ref)
            except Exception:
                lost.append(rank)
        return lost

    def shutdown(self) -> None:
        """Kills every gang process. Idempotent."""
        for a in self.actors:
            _kill(a)
        self.actors = []

    def __enter__(self) -> SliceGang:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
