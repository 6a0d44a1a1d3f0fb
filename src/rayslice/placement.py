"""Reserving whole slices on Ray Core: :func:`slice_placement_group`.

How a reservation works:

1. Snapshot the cluster's slices (:mod:`rayslice.cluster`) and plan on it
   (:mod:`rayslice.planning`, pure).
2. For each chosen slice create one placement group with one bundle per host,
   bundle *i* pinned by label selector to ``{tpu-slice-name: S, tpu-worker-id: i}``.
   Bundle order is physical worker order, and a group can never straddle two
   slices. Bundle 0 also takes the slice's ``TPU-<pod type>-head`` resource, so
   other users of Ray's TPU helpers see the slice as taken.
3. If a group is not ready quickly (another job won a race for the slice),
   remove everything created and plan again. Multi-slice is all or nothing.
4. Wait with a deadline and a progress line; on timeout raise
   :class:`ReservationTimeout` explaining every slice. When no slice of that
   shape exists and no autoscaler can add one, raise :class:`NoMatchingSlice`
   at once. Every exit path removes what it created.

Example:
    >>> import rayslice
    >>> with rayslice.slice_placement_group("2x2x2", "TPU-V4", timeout_s=30) as spg:  # doctest: +SKIP
    ...     print([h.worker_id for h in spg.slices[0].hosts])
    [0, 1]
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from rayslice._deadline import Deadline
from rayslice._progress import WaitDisplay
from rayslice.cluster import LABEL_SLICE, LABEL_WORKER_ID, SliceInfo, list_slices
from rayslice.errors import NoMatchingSlice, ReservationTimeout
from rayslice.planning import Plan, plan
from rayslice.request import SliceRequest
from rayslice.topology import Topology

logger = logging.getLogger(__name__)

PG_NAME_PREFIX = "rayslice:"
_WAITING_KV_PREFIX = b"rayslice/waiting/"
_KV_NAMESPACE = b"rayslice"


@dataclasses.dataclass(frozen=True)
class ReservedHost:
    """One reserved host: bundle ``bundle_index`` of its slice's group sits on it."""

    worker_id: int
    node_id: str
    ip: str
    bundle_index: int


@dataclasses.dataclass(frozen=True)
class ReservedSlice:
    """One reserved slice and its placement group."""

    name: str
    slice_index: int
    hosts: tuple[ReservedHost, ...]
    placement_group: Any  # ray.util.placement_group.PlacementGroup


class SlicePlacementGroup:
    """Whole slices held for one job. Release with :meth:`release` or a ``with`` block.

    Attributes:
        request: What was reserved (topology, slices, per-host resources).
        topology: The topology of each slice.
        slices: The reserved slices, in slice-index order.
        wait_s: Seconds the reservation took.
    """

    def __init__(self, request: SliceRequest, slices: tuple[ReservedSlice, ...], name: str, wait_s: float) -> None:
        self.request = request
        self.topology = request.topology
        self.slices = slices
        self.name = name
        self.wait_s = wait_s
        self._released = False

    @property
    def placement_groups(self) -> list[Any]:
        """One placement group per slice, in slice order."""
        return [s.placement_group for s in self.slices]

    @property
    def num_slices(self) -> int:
        return len(self.slices)

    @property
    def num_hosts(self) -> int:
        """Hosts over all slices (one gang process each)."""
        return sum(len(s.hosts) for s in self.slices)

    def hosts(self) -> Iterator[tuple[ReservedSlice, ReservedHost]]:
        """Every (slice, host) in rank order: slice index, then worker id."""
        for s in self.slices:
            for h in s.hosts:
                yield s, h

    def scheduling_strategy(self, slice_index: int | str, worker_id: int) -> Any:
        """A Ray scheduling strategy that places a task/actor on that host's bundle.

        Args:
            slice_index: Index in :attr:`slices`, or the slice name.
            worker_id: Physical worker id within the slice.
        """
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        s = self._slice(slice_index)
        if not 0 <= worker_id < len(s.hosts):
            raise ValueError(f"worker_id {worker_id} not in slice {s.name!r}; valid: 0..{len(s.hosts) - 1}")
        return PlacementGroupSchedulingStrategy(
            placement_group=s.placement_group,
            placement_group_bundle_index=s.hosts[worker_id].bundle_index,
            placement_group_capture_child_tasks=True,
        )

    def _slice(self, key: int | str) -> ReservedSlice:
        for s in self.slices:
            if key in (s.slice_index, s.name):
                return s
        raise ValueError(f"no reserved slice {key!r}; have {[s.name for s in self.slices]}")

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        """Removes every placement group of the reservation. Idempotent."""
        if self._released:
            return
        self._released = True
        _remove_groups(self.placement_groups)

    def __enter__(self) -> SlicePlacementGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        names = ", ".join(s.name for s in self.slices)
        return f"SlicePlacementGroup({self.topology.name} {self.topology.generation}, slices=[{names}])"


def _remove_groups(groups: list[Any]) -> None:
    from ray.util.placement_group import remove_placement_group

    for pg in groups:
        try:
            remove_placement_group(pg)
        except Exception:  # already removed, or the cluster is gone
            logger.debug("removing placement group %s failed", pg.id, exc_info=True)


def _bundles(s: SliceInfo, topo: Topology, extra: Mapping[str, float]) -> tuple[list[dict], list[dict]]:
    bundles, selectors = [], []
    for worker_id in range(topo.num_hosts):
        b: dict[str, float] = {"TPU": float(topo.chips_per_host), **extra}
        if worker_id == 0:
            b[topo.head_resource] = 1.0
        bundles.append(b)
        selectors.append({LABEL_SLICE: s.name, LABEL_WORKER_ID: str(worker_id)})
    return bundles, selectors


def _create_groups(p: Plan, extra: Mapping[str, float], name: str, created: list[Any]) -> None:
    from ray.util.placement_group import placement_group

    for s in p.chosen:
        bundles, selectors = _bundles(s, p.request, extra)
        created.append(
            placement_group(
                bundles,
                strategy="STRICT_SPREAD",
                # Unique: the control plane refuses a second group of the same
                # name, and two reservations may race for one slice.
                name=f"{PG_NAME_PREFIX}{name}:{s.name}:{uuid.uuid4().hex[:6]}",
                bundle_label_selector=selectors,
            )
        )


def autoscaler_can_add_nodes(status: Mapping[str, Any] | None) -> bool:
    """Whether an autoscaler status report comes from an autoscaler with node types (pure).

    Every Ray head runs a monitor that publishes a status report; without an
    autoscaling config (a plain ``ray start`` or the simulator) it uses a
    read-only provider whose node types are just ``node_<node id>``. An
    autoscaler that can launch nodes (KubeRay's, the cluster launcher's) names
    its configured types (``headgroup``, ``tpu-v6e-4x4`` ...).
    """
    if not status:
        return False
    mapping = (status.get("autoscaler_report") or {}).get("node_type_mapping") or {}
    return any(node_type != f"node_{node_id}" for node_id, node_type in mapping.items())


def _autoscaler_configured() -> bool:
    """True when an autoscaler (e.g. KubeRay's) can add slices to this cluster."""
    from ray._private import ray_constants
    from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_initialized

    if not _internal_kv_initialized():
        return False
    raw = _internal_kv_get(ray_constants.DEBUG_AUTOSCALING_STATUS.encode())
    try:
        return autoscaler_can_add_nodes(json.loads(raw) if raw else None)
    except ValueError:
        return False


def _set_waiting(name: str, info: dict[str, Any] | None) -> None:
    from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_put

    key = _WAITING_KV_PREFIX + name.encode()
    try:
        if info is None:
            _internal_kv_del(key, namespace=_KV_NAMESPACE)
        else:
            _internal_kv_put(key, json.dumps(info).encode(), overwrite=True, namespace=_KV_NAMESPACE)
    except Exception:  # status is best effort; never fail a reservation over it
        logger.debug("could not publish waiting state", exc_info=True)


def waiting_reservations() -> list[dict[str, Any]]:
    """Reservations currently waiting for slices (published by every waiting driver)."""
    from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_list

    out = []
    for key in _internal_kv_list(_WAITING_KV_PREFIX, namespace=_KV_NAMESPACE):
        raw = _internal_kv_get(key, namespace=_KV_NAMESPACE)
        if raw:
            out.append(json.loads(raw))
    return out


def explain(topology: str, accelerator_type: str, *, num_slices: int = 1, chips_per_host: int | None = None) -> Plan:
    """The per-slice report a reservation would act on, without reserving.

    Example:
        >>> print(rayslice.explain("2x2x2", "TPU-V4"))  # doctest: +SKIP
        request: 1 x v4 2x2x2 (8 chips, 2 hosts x 4); 2 slice(s) of that type and shape, 1 usable now
          - a: busy: host 1 has 0/4 chips free
          - b: free
    """
    topo = Topology.parse(accelerator_type, topology, chips_per_host=chips_per_host)
    return plan(topo, list_slices(), num_slices=num_slices)


def slice_placement_group(
    topology: str | Topology | SliceRequest,
    accelerator_type: str | None = None,
    *,
    num_slices: int | None = None,
    chips_per_host: int | None = None,
    resources_per_host: Mapping[str, float] | None = None,
    timeout_s: float = 300.0,
    name: str | None = None,
    autoscale: bool | None = None,
    race_window_s: float = 5.0,
    progress: bool = True,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> SlicePlacementGroup:
    """Reserves ``num_slices`` whole slices of ``topology``.

    Args:
        topology: Chip shape, e.g. "4x4" or "2x2x2".
        accelerator_type: Generation in any spelling, e.g. "TPU-V6E", "v4".
        num_slices: Distinct slices to reserve, all or nothing.
        chips_per_host: For shapes with two host layouts (v5e/v6e "2x4").
        resources_per_host: Extra resources each host's bundle holds (e.g. CPU).
        timeout_s: Longest wait before :class:`ReservationTimeout`.
        name: Name shown in ``rayslice status`` (and in placement group names).
        autoscale: Whether an autoscaler may add slices; detected when None.
        race_window_s: How long a new group may stay pending before it is
            treated as a lost race and planning starts over.
        progress: Show a progress line while waiting.
        clock: Monotonic clock (injectable for tests).
        sleep: Sleep paired with ``clock``.

    Returns:
        The reservation; use it as a context manager or call ``release()``.

    Raises:
        NoMatchingSlice: No slice of that type and shape exists and nothing can add one.
        ReservationTimeout: Matching slices exist but none was free in time;
            the message explains every slice.

    Example:
        >>> spg = rayslice.slice_placement_group("2x2x2", "TPU-V4", timeout_s=60)  # doctest: +SKIP
        >>> spg.num_hosts, spg.release()  # doctest: +SKIP
        (2, None)
    """
    request = SliceRequest.parse(topology, accelerator_type, num_slices=num_slices,
                                 chips_per_host=chips_per_host, resources_per_host=resources_per_host)
    topo, num_slices, extra = request.topology, request.num_slices, dict(request.resources_per_host)
    name = name or f"job-{uuid.uuid4().hex[:8]}"
    if ":" in name or not name.strip():
        raise ValueError(f"name {name!r} is not valid: it must be non-empty and must not contain ':'")
    deadline = Deadline(timeout_s, clock=clock, sleep=sleep)
    display = WaitDisplay(f"reserving {num_slices} x {topo}", enabled=progress, clock=clock)
    if autoscale is None:
        autoscale = _autoscaler_configured()
    created: list[Any] = []
    raced: set[str] = set()
    interval = 0.05
    asked_autoscaler = False
    try:
        while True:
            p = plan(topo, list_slices(), num_slices=num_slices, exclude=raced)
            raced.clear()
            if p.ok:
                _create_groups(p, extra, name, created)
                # PlacementGroup.wait takes whole seconds, too coarse for a
                # group that is ready in milliseconds: poll it, gently.
                wait_until = clock() + min(race_window_s, deadline.remaining)
                pending = list(created)
                while pending:
                    pending = [pg for pg in pending if not pg.wait(timeout_seconds=0)]
                    if not pending or clock() >= wait_until:
                        break
                    sleep(0.005)
                if not pending:
                    return _build(request, p, created, name, deadline.elapsed)
                # Lost a race (or the snapshot was stale): give back everything
                # and plan again, skipping the slices that did not come through.
                raced = {s.name for s, pg in zip(p.chosen, created) if pg in pending}
                _remove_groups(created)
                created.clear()
            elif p.num_matching < num_slices and not autoscale:
                raise NoMatchingSlice(
                    f"no {num_slices} slice(s) of {topo} in this cluster and no autoscaler to add them",
                    p.explain(),
                )
            elif autoscale and not asked_autoscaler:
                _request_capacity(topo, num_slices)
                asked_autoscaler = True
            if deadline.expired:
                raise ReservationTimeout(
                    f"no {num_slices} free slice(s) of {topo} within {timeout_s:g} s", p.explain()
                )
            if display.update(p, deadline):
                _set_waiting(name, {"name": name, "request": f"{num_slices} x {topo}", "since_s": deadline.elapsed,
                                    "report": p.explain()})
            sleep(min(interval, deadline.remaining))
            interval = min(interval * 1.5, 1.0)
    except BaseException:
        _remove_groups(created)
        raise
    finally:
        display.close()
        if display.shown:
            _set_waiting(name, None)
        if asked_autoscaler:
            _request_capacity(topo, 0)


def _request_capacity(topo: Topology, num_slices: int) -> None:
    """Asks the autoscaler for slices the way it understands TPU demand."""
    from ray.autoscaler.sdk import request_resources

    # A TPU-<pod type>-head demand makes Ray's autoscaler (and KubeRay's) scale a
    # multi-host worker group by one whole slice per head.
    request_resources(bundles=[{topo.head_resource: 1}] * num_slices)


def _build(request: SliceRequest, p: Plan, groups: list[Any], name: str, wait_s: float) -> SlicePlacementGroup:
    reserved = []
    for index, (s, pg) in enumerate(zip(p.chosen, groups)):
        hosts = tuple(ReservedHost(h.worker_id, h.node_id, h.ip, bundle_index=h.worker_id) for h in s.hosts)
        reserved.append(ReservedSlice(s.name, index, hosts, pg))
    return SlicePlacementGroup(request, tuple(reserved), name, wait_s)
