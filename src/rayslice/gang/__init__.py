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

The package's parts: :class:`SliceGang` here; the body of each gang process,
its :class:`HostContext` and SIGTERM notices in ``_process``; a local rank 0
in ``_local``; a call serialized once for every host in ``_packing``; results
gathered in rank order under one deadline in ``_gather``.

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
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from rayslice._deadline import Deadline
from rayslice._validate import check_bool, fail
from rayslice.gang._gather import _ordered_get
from rayslice.gang._local import _LocalHost
from rayslice.gang._packing import _pack
from rayslice.gang._process import HostContext, _actor_class, _ping, host_context, on_sigterm
from rayslice.placement import SlicePlacementGroup
from rayslice.topology import MEGASCALE_PORT

__all__ = [
    "CONTROL_GROUP",
    "NAMESPACE",
    "HostContext",
    "SliceGang",
    "WarmSource",
    "gang_actor_name",
    "gang_environment",
    "host_context",
    "on_sigterm",
]

#: Ray namespace of named gang processes (``<gang>/<gang id>/<rank>``).
NAMESPACE = "rayslice"
#: Name of the optional concurrency group for control calls (liveness pings): a gang started with
#: ``actor_options={"concurrency_groups": {CONTROL_GROUP: 1}}`` answers them while its work runs.
CONTROL_GROUP = "control"


def gang_actor_name(gang: str, gang_id: str, rank: int) -> str:
    """The Ray actor name of one gang process (namespace :data:`NAMESPACE`).

    Example:
        >>> gang_actor_name("my-run", "ab12cd34", 1)
        'my-run/ab12cd34/1'
    """
    return f"{gang}/{gang_id}/{rank}"


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


def _kill(actor: Any) -> None:
    if isinstance(actor, _LocalHost):
        actor.close()
        return
    import ray

    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # already dead, or the cluster is gone
        pass


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
