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
import logging
import math
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from rayslice._deadline import Deadline
from rayslice._groups import (
    PG_NAME_PREFIX,
    create_groups,
    remove_groups,
    request_capacity,
)
from rayslice._progress import WaitDisplay, publish_waiting, waiting_reservations
from rayslice._validate import (
    check_bool,
    check_choice,
    check_float,
    check_optional,
    check_str,
    fail,
)
from rayslice.cluster import (
    LABEL_SLICE,
    LABEL_WORKER_ID,
    autoscaler_configured,
    list_slices,
)
from rayslice.errors import NoMatchingSlice, ReservationTimeout
from rayslice.planning import Plan, plan
from rayslice.request import SliceRequest, bundle_label_selectors, request_from_args
from rayslice.topology import Topology

logger = logging.getLogger(__name__)


__all__ = [
    "PG_NAME_PREFIX",
    "ReservedHost",
    "ReservedSlice",
    "SlicePlacementGroup",
    "explain",
    "slice_placement_group",
    "waiting_reservations",
]


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
    """Whole slices held for one job. Release with :meth:`release` / :meth:`shutdown` or a ``with`` block.

    Get one from :func:`slice_placement_group`. Constructing it directly with
    Ray's arguments (``SlicePlacementGroup(topology="4x4",
    accelerator_version="v6e")``, as with ``ray.util.tpu.SlicePlacementGroup``)
    reserves the same way and takes the same keywords.

    Unlike Ray's handle, each slice has its own placement group (so no group
    ever straddles two slices) and every group is ready when you get the
    handle; ``slice_placement_group`` is the single group of a one-slice
    reservation, ``slice_placement_groups`` the list for any number.

    Attributes:
        request: What was reserved (topology, slices, per-host resources).
        topology: The :class:`~rayslice.topology.Topology` of each slice.
        slices: The reserved slices, in slice-index order.
        name: The reservation's name (shown by ``rayslice status``).
        wait_s: Seconds the reservation took.
    """

    request: SliceRequest
    slices: tuple[ReservedSlice, ...]
    name: str
    wait_s: float
    _pg_per_slice: bool
    _released: bool

    def __init__(
        self, topology: str | Topology | SliceRequest, accelerator_version: str | None = None, **kwargs: Any
    ) -> None:
        held = slice_placement_group(topology, accelerator_version, **kwargs)
        self.__dict__.update(held.__dict__)

    @classmethod
    def _held(
        cls,
        request: SliceRequest,
        slices: tuple[ReservedSlice, ...],
        name: str,
        wait_s: float,
        pg_per_slice: bool = False,
    ) -> SlicePlacementGroup:
        self = cls.__new__(cls)
        self.request, self.slices, self.name, self.wait_s = request, slices, name, wait_s
        self._pg_per_slice = pg_per_slice
        self._released = False
        return self

    @property
    def topology(self) -> Topology:
        return self.request.topology

    @property
    def placement_groups(self) -> list[Any]:
        """One placement group per slice, in slice order."""
        return [s.placement_group for s in self.slices]

    @property
    def slice_placement_groups(self) -> list[Any]:
        """One placement group per slice, in slice order (Ray's name).

        Raises:
            ValueError: for a one-slice reservation made without
                ``pg_per_slice=True``, as Ray's handle does (use
                :attr:`slice_placement_group`, or :attr:`placement_groups`
                which always works).
        """
        if not self._pg_per_slice and self.num_slices == 1:
            raise ValueError("pg_per_slice=False, use `slice_placement_group` instead.")
        return self.placement_groups

    @property
    def slice_placement_group(self) -> Any:
        """The placement group of a one-slice reservation (Ray's name).

        Raises:
            ValueError: for several slices (each has its own group: use
                :attr:`slice_placement_groups`), or when the reservation was
                made with ``pg_per_slice=True``, as Ray's handle does.
        """
        if self._pg_per_slice:
            raise ValueError("pg_per_slice=True, use `slice_placement_groups` instead.")
        if self.num_slices > 1:
            raise ValueError(
                f"this reservation holds {self.num_slices} slices, one placement group each "
                "(a group never straddles slices): use `slice_placement_groups`"
            )
        return self.slices[0].placement_group

    @property
    def placement_group(self) -> Any:
        """Alias of :attr:`slice_placement_group` (Ray's name)."""
        return self.slice_placement_group

    @property
    def accelerator_version(self) -> str:
        """The generation as Ray names it, e.g. "v6e" or "v5litepod"."""
        return self.topology.pod_type.rsplit("-", 1)[0]

    @property
    def num_slices(self) -> int:
        return len(self.slices)

    @property
    def num_hosts(self) -> int:
        """Hosts over all slices (one gang process each)."""
        return sum(len(s.hosts) for s in self.slices)

    @property
    def num_bundles(self) -> int:
        """Bundles over all slices: one per host."""
        return self.num_hosts

    @property
    def chips_per_host(self) -> int:
        return self.topology.chips_per_host

    @property
    def devices_per_host(self) -> int:
        """``TPU`` resources one host's bundle holds (Ray's meaning: one per chip)."""
        return self.topology.chips_per_host

    @property
    def bundle_resources(self) -> dict[str, float]:
        """The resources each bundle holds (bundle 0 of each slice also holds its head resource)."""
        return self.request.bundle_resources

    @property
    def bundle_label_selector(self) -> list[dict[str, str]]:
        """The label selector of every bundle, slice by slice, in bundle order."""
        return [{LABEL_SLICE: s.name, LABEL_WORKER_ID: str(h.worker_id)} for s in self.slices for h in s.hosts]

    @property
    def head_placement_groups(self) -> list[Any]:
        """Always empty: rayslice claims a slice with its worker group alone (no head groups)."""
        return []

    def release_head_pgs(self, slice_index: int | None = None) -> None:
        """Nothing to do: there are no head placement groups (kept for Ray parity)."""

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
        remove_groups(self.placement_groups)

    def shutdown(self) -> None:
        """Ray's name for :meth:`release`."""
        self.release()

    def __enter__(self) -> SlicePlacementGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        names = ", ".join(s.name for s in self.slices)
        return f"SlicePlacementGroup({self.topology.name} {self.topology.generation}, slices=[{names}])"


def explain(
    topology: str | Topology | SliceRequest,
    accelerator_type: str | None = None,
    *,
    num_slices: int | None = None,
    chips_per_host: int | None = None,
    resources_per_host: Mapping[str, float] | None = None,
    accelerator_version: str | None = None,
) -> Plan:
    """The per-slice report a reservation would act on, without reserving.

    Takes the same request arguments as :func:`slice_placement_group`.

    Example:
        >>> print(rayslice.explain("2x2x2", "TPU-V4"))  # doctest: +SKIP
        request: 1 x v4 2x2x2 (8 chips, 2 hosts x 4); 2 slice(s) of that type and shape, 1 usable now
          - a: busy: host 1 has 0/4 chips free
          - b: free
    """
    request = request_from_args(
        topology,
        accelerator_type,
        accelerator_version=accelerator_version,
        num_slices=num_slices,
        chips_per_host=chips_per_host,
        resources_per_host=resources_per_host,
    )
    return plan(request, list_slices())


_STRATEGIES = ("STRICT_SPREAD", "SPREAD", "PACK", "STRICT_PACK")
_MIN_RACE_WINDOW_S = 0.5


def slice_placement_group(
    topology: str | Topology | SliceRequest,
    accelerator_type: str | None = None,
    resources_per_bundle: Mapping[str, float] | None = None,
    num_slices: int | None = None,
    chips_per_vm: int | None = None,
    pg_per_slice: bool = False,
    tpu_resource_per_chip: int | None = None,
    *,
    accelerator_version: str | None = None,
    chips_per_host: int | None = None,
    resources_per_host: Mapping[str, float] | None = None,
    timeout_s: float | None = 300.0,
    head_reservation_timeout_s: float | None = None,
    name: str | None = None,
    strategy: str = "STRICT_SPREAD",
    lifetime: str | None = None,
    bundle_label_selector: Sequence[Mapping[str, str]] | Mapping[str, str] | None = None,
    autoscale: bool | None = None,
    race_window_s: float = 5.0,
    progress: bool = True,
    avoid_slices: Iterable[str] = (),
    prefer_slices: Iterable[str] = (),
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> SlicePlacementGroup:
    """Reserves ``num_slices`` whole slices of ``topology``.

    The positional order is Ray's (``ray.util.tpu.slice_placement_group``):
    ``topology``, then the generation, then Ray's optional arguments; Ray's
    keywords (``accelerator_version``, ``chips_per_vm``,
    ``resources_per_bundle``, ``head_reservation_timeout_s``, ``strategy``,
    ``lifetime``, ``bundle_label_selector``, ``pg_per_slice``) are accepted
    beside rayslice's own. ``topology`` may also be a parsed
    :class:`~rayslice.topology.Topology` or a whole
    :class:`~rayslice.request.SliceRequest`.

    Args:
        topology: Chip shape, e.g. "4x4" or "2x2x2" (or a Topology/SliceRequest).
        accelerator_type: Generation in any spelling, e.g. "TPU-V6E", "v4"
            (Ray's ``accelerator_version``).
        resources_per_bundle: Ray's name for what each host's bundle holds;
            a ``TPU`` entry must equal the chips per host (one bundle per host).
        num_slices: Distinct slices to reserve, all or nothing (default 1).
        chips_per_vm: Ray's name for ``chips_per_host``.
        pg_per_slice: Only changes which of Ray's properties answer (each
            slice always has its own group here).
        tpu_resource_per_chip: Must be 1 (or None).
        accelerator_version: Ray's name for ``accelerator_type``.
        chips_per_host: For shapes with two host layouts (v5e/v6e "2x4").
        resources_per_host: Extra resources each host's bundle holds (e.g. CPU).
        timeout_s: Longest wait for free slices before
            :class:`ReservationTimeout` (0: take them only if free now; None:
            no limit). A group just created always gets ``race_window_s`` to
            become ready.
        head_reservation_timeout_s: Ray's name for ``timeout_s``.
        name: Name shown in ``rayslice status`` (and in placement group names).
        strategy: Placement strategy of each slice's group. Bundles are pinned
            to hosts by label, so any spread strategy behaves the same; the
            PACK strategies only fit single-host slices.
        lifetime: None (the groups die with this driver) or "detached".
        bundle_label_selector: Extra labels each bundle's host must carry, on
            top of the slice/worker labels (which take precedence).
        autoscale: Whether an autoscaler may add slices; detected when None.
        race_window_s: How long a new group may stay pending before it is
            treated as a lost race and planning starts over (>= 0.5 s:
            removing a group while Ray is still placing it can strand chips).
        progress: Show a progress line while waiting.
        avoid_slices: Slice names to pass over while other slices fit (e.g. one
            whose host just stopped answering, before Ray declares it dead);
            taken only when nothing else is free.
        prefer_slices: Slice names to take first when they are free and fit
            (e.g. the slice whose host 0 runs the caller: a serve replica
            placed there becomes that host itself); otherwise the usual order.
        clock: Monotonic clock (injectable for tests).
        sleep: Sleep paired with ``clock``.

    Returns:
        The reservation, every group ready; use it as a context manager or
        call ``release()`` / ``shutdown()``.

    Raises:
        InvalidArgument: A bad argument (before anything is created).
        NoMatchingSlice: No slice of that type and shape exists (or none can
            ever hold ``resources_per_host``) and nothing can add one.
        ReservationTimeout: Matching slices exist but none was free in time;
            the message explains every slice.

    Example:
        >>> spg = rayslice.slice_placement_group("2x2x2", "TPU-V4", timeout_s=60)  # doctest: +SKIP
        >>> spg.num_hosts, spg.release()  # doctest: +SKIP
        (2, None)
    """
    request = request_from_args(
        topology,
        accelerator_type,
        accelerator_version=accelerator_version,
        num_slices=num_slices,
        chips_per_host=chips_per_host,
        chips_per_vm=chips_per_vm,
        resources_per_host=resources_per_host,
        resources_per_bundle=resources_per_bundle,
        tpu_resource_per_chip=tpu_resource_per_chip,
    )
    if head_reservation_timeout_s is not None:
        timeout_s = head_reservation_timeout_s
    timeout_s = check_optional(check_float, "timeout_s", timeout_s, minimum=0, allow_inf=True)
    if timeout_s is not None and math.isinf(timeout_s):
        timeout_s = None
    race_window_s = check_float("race_window_s", race_window_s, minimum=_MIN_RACE_WINDOW_S)
    check_bool("pg_per_slice", pg_per_slice)
    check_bool("progress", progress)
    strategy = check_choice("strategy", strategy, _STRATEGIES)
    if strategy.endswith("PACK") and request.hosts_per_slice > 1:
        raise fail(
            "strategy",
            strategy,
            f"a SPREAD strategy: a {request.topology} slice spans "
            f"{request.hosts_per_slice} hosts (Ray nodes), which PACK cannot place",
        )
    lifetime = check_choice("lifetime", lifetime, (None, "detached"))
    selectors = bundle_label_selectors(bundle_label_selector, request)
    if name is None or name == "":
        name = f"job-{uuid.uuid4().hex[:8]}"
    if not isinstance(name, str) or ":" in name or not name.strip():
        raise fail("name", name, "a non-empty string (it must not contain ':')")
    topo, num = request.topology, request.num_slices
    deadline = Deadline(timeout_s, clock=clock, sleep=sleep)
    display = WaitDisplay(f"reserving {request}", enabled=progress, clock=clock)
    if autoscale is None:
        autoscale = autoscaler_configured()
    group_options = {"strategy": strategy, "lifetime": lifetime}
    created: list[Any] = []
    raced: set[str] = set()
    avoid = {check_str("avoid_slices", n) for n in ([avoid_slices] if isinstance(avoid_slices, str) else avoid_slices)}
    prefer = {
        check_str("prefer_slices", n) for n in ([prefer_slices] if isinstance(prefer_slices, str) else prefer_slices)
    }
    interval = 0.05
    asked_autoscaler = False
    try:
        while True:
            snapshot = list_slices()
            p = plan(request, snapshot, exclude=raced | avoid, prefer=prefer)
            if not p.ok and avoid:
                p = plan(request, snapshot, exclude=raced, prefer=prefer)
            raced.clear()
            if p.ok:
                create_groups(p, selectors, name, group_options, created)
                # PlacementGroup.wait takes whole seconds, too coarse for a
                # group that is ready in milliseconds: poll it, gently. A new
                # group always gets the race window, whatever is left of the
                # deadline (which bounds the wait for free slices).
                wait_until = clock() + race_window_s
                pending = list(created)
                while pending:
                    pending = [pg for pg in pending if not pg.wait(timeout_seconds=0)]
                    if not pending or clock() >= wait_until:
                        break
                    sleep(0.005)
                if not pending:
                    return _build(request, p, created, name, deadline.elapsed, pg_per_slice)
                # Lost a race (or the snapshot was stale): give back everything
                # and plan again, skipping the slices that did not come through.
                raced = {s.name for s, pg in zip(p.chosen, created) if pg in pending}
                remove_groups(created)
                created.clear()
            elif p.num_matching < num and not autoscale:
                raise NoMatchingSlice(
                    f"no {num} slice(s) of {topo} in this cluster"
                    + (" able to hold the per-host resources" if request.resources_per_host else "")
                    + " and no autoscaler to add them",
                    p.explain(),
                )
            elif autoscale and not asked_autoscaler:
                request_capacity(topo, num)
                asked_autoscaler = True
            if deadline.expired:
                raise ReservationTimeout(f"no {num} free slice(s) of {topo} within {timeout_s:g} s", p.explain())
            if display.update(p, deadline):
                publish_waiting(
                    name, {"name": name, "request": str(request), "since_s": deadline.elapsed, "report": p.explain()}
                )
            sleep(min(interval, deadline.remaining))
            interval = min(interval * 1.5, 1.0)
    except BaseException:
        remove_groups(created)
        raise
    finally:
        display.close()
        if display.shown:
            publish_waiting(name, None)
        if asked_autoscaler:
            request_capacity(topo, 0)


def _build(
    request: SliceRequest, p: Plan, groups: list[Any], name: str, wait_s: float, pg_per_slice: bool
) -> SlicePlacementGroup:
    reserved = []
    for index, (s, pg) in enumerate(zip(p.chosen, groups)):
        hosts = tuple(ReservedHost(h.worker_id, h.node_id, h.ip, bundle_index=h.worker_id) for h in s.hosts)
        reserved.append(ReservedSlice(s.name, index, hosts, pg))
    return SlicePlacementGroup._held(request, tuple(reserved), name, wait_s, pg_per_slice)
