"""Warm gang processes: started ahead of need on spare hosts, adopted by the next gang.

A restart after a lost host pays a Ray worker process start and ``import
jax`` before ``jax.distributed`` can even begin. A :class:`WarmPool` pays
both in advance, off the critical path, on the hosts a restart would reserve
next (:func:`spare_hosts`); ``SliceGang(spg, warm=pool)`` (see
:mod:`rayslice.gang`) adopts those processes instead of starting fresh ones.

Example:
    >>> pool = WarmPool()
    >>> pool.imports, len(pool)
    (('jax',), 0)
    >>> WarmPool(imports="jax")
    Traceback (most recent call last):
    ...
    rayslice.errors.InvalidArgument: imports='jax' is not valid; expected a list of module names, e.g. ['jax']
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rayslice.errors import InvalidArgument
from rayslice.gang import _actor_class, _kill
from rayslice.request import SliceRequest

#: What a :class:`WarmPool` process imports by default: JAX (never a backend: that waits for ``jax.distributed``).
WARM_IMPORTS: tuple[str, ...] = ("jax",)


class WarmPool:
    """Gang processes started ahead of need on given hosts, which the next ``SliceGang`` adopts.

    Starting a gang process costs a Ray worker process start and ``import
    jax`` (about a second each on a small machine) before
    ``jax.distributed`` can even begin; a restart after a lost host pays it
    again. A warm pool pays it in advance, off the critical path: it starts
    one process per given host (Ray node) that imports ``imports`` and then
    waits, with no JAX backend started and no chips held (the new attempt's
    placement group reserves the host; the process sees every chip of it, as
    a whole-host allocation does). ``SliceGang(spg, warm=pool)`` takes the
    pool's process on each reserved host, sets that host's environment
    (``adopt`` of :mod:`rayslice.gang`'s host process) and forms the mesh; hosts without one get a
    fresh process. An adopted process belongs to its gang (killed with it);
    :meth:`shutdown` kills the rest. The pool's actor options must be the
    gang's (same runtime environment, concurrency), else it is not used.

    Args:
        imports: Modules every warm process imports at once (e.g. ``"jax"``,
            ``"orbax.checkpoint"``); importing must not start a JAX backend.
        actor_options: The Ray actor options of the gangs that will adopt them.
        optional_imports: Modules imported too where they are installed
            (e.g. ``"flax.linen"``, ``"optax"``); one that is not installed
            is skipped, the process stays usable.

    Example:
        >>> pool = WarmPool(imports=("jax",), actor_options={"max_concurrency": 2})
        >>> len(pool), pool.node_ids, pool.ready([])
        (0, [], True)
        >>> pool.warm(["<node id of a spare host>"])  # doctest: +SKIP
        1
        >>> with SliceGang(spg, warm=pool) as gang:  # doctest: +SKIP
        ...     gang.timings["adopted"]
        2
        >>> pool.shutdown()
    """

    def __init__(
        self,
        imports: Sequence[str] = WARM_IMPORTS,
        actor_options: dict[str, Any] | None = None,
        optional_imports: Sequence[str] = (),
    ) -> None:
        for name, value in (("imports", imports), ("optional_imports", optional_imports)):
            if isinstance(value, str) or not all(isinstance(m, str) and m for m in value):
                raise InvalidArgument(f"{name}={value!r} is not valid; expected a list of module names, e.g. ['jax']")
        self.imports = tuple(imports)
        self.optional_imports = tuple(optional_imports)
        self.actor_options = dict(actor_options or {})
        self._procs: dict[str, tuple[Any, Any]] = {}  # node id -> (actor, ref of its warm_up call)

    def __len__(self) -> int:
        return len(self._procs)

    @property
    def node_ids(self) -> list[str]:
        """Hosts (Ray node ids) that have a warm process now."""
        return sorted(self._procs)

    def warm(self, node_ids: Sequence[str]) -> int:
        """Starts a warm process on each of ``node_ids`` that has none; returns at once with how many it started."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        started = 0
        for node_id in node_ids:
            if node_id in self._procs:
                continue
            cls, options = _actor_class(self.actor_options)
            actor = cls.options(
                num_cpus=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
                max_restarts=0,
                max_task_retries=0,
                **options,
            ).remote(None, None)
            self._procs[node_id] = (actor, actor.warm_up.remote(self.imports, self.optional_imports))
            started += 1
        return started

    def ready(self, node_ids: Sequence[str]) -> bool:
        """True when each of ``node_ids`` has a warm process that has finished its imports (or failed them)."""
        import ray

        want = set(node_ids)
        if not want:
            return True
        if not want <= set(self._procs):
            return False
        refs = [self._procs[n][1] for n in want]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        return len(done) == len(refs)

    def take(self, node_id: str) -> Any | None:
        """The warm process on ``node_id`` (now the caller's), or None when there is none or it died."""
        import ray

        entry = self._procs.pop(node_id, None)
        if entry is None:
            return None
        actor, ref = entry
        ready, _ = ray.wait([ref], timeout=0)
        if ready:
            try:
                ray.get(ref)
            except Exception:  # its host went away, or an import failed: start fresh instead
                _kill(actor)
                return None
        return actor  # still importing: adopting it is never slower than a fresh start

    def discard(self, node_ids: Sequence[str]) -> None:
        """Kills the warm processes of these hosts (e.g. of a slice that lost a host)."""
        for node_id in node_ids:
            entry = self._procs.pop(node_id, None)
            if entry is not None:
                _kill(entry[0])

    def shutdown(self) -> None:
        """Kills every process not adopted. Idempotent."""
        self.discard(list(self._procs))

    def __enter__(self) -> WarmPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def spare_hosts(request: SliceRequest, exclude: Sequence[str] = (), max_slices: int | None = None) -> list[str]:
    """Node ids of the hosts of free slices of ``request``'s shape, outside ``exclude`` (slice names).

    What a restart would reserve next: the processes of a :class:`WarmPool`
    go there. At most ``max_slices`` slices (default: ``request.num_slices``),
    in the order the inventory lists them.
    """
    from rayslice.cluster import list_slices

    limit = request.num_slices if max_slices is None else max_slices
    out: list[str] = []
    taken = 0
    for s in list_slices():
        if taken >= limit:
            break
        if s.name in exclude or s.state != "free":
            continue
        try:
            if s.topology_info() != request.topology:
                continue
        except Exception:  # a slice the catalog does not know
            continue
        out += [h.node_id for h in s.hosts]
        taken += 1
    return out
