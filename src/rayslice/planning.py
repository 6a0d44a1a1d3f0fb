"""Choosing whole slices for a request: a pure function over a cluster snapshot.

:func:`plan` never talks to Ray. It takes the slices :func:`rayslice.cluster.parse_slices`
produced and says which whole, free slices satisfy a request and, for every
other slice of the cluster, why it cannot be used. The reservation layer
(:mod:`rayslice.placement`) acts on the plan; :func:`rayslice.explain` prints it.

Example:
    >>> from rayslice.cluster import SliceInfo, HostInfo
    >>> from rayslice.topology import Topology
    >>> h = lambda w, free: HostInfo(w, f"n{w}", "10.0.0.1", True, 4.0, free)
    >>> a = SliceInfo("a", "TPU-V4", "2x2x2", "v4-16", 4, 2, (h(0, 4.0), h(1, 0.0)))
    >>> b = SliceInfo("b", "TPU-V4", "2x2x2", "v4-16", 4, 2, (h(0, 4.0), h(1, 4.0)))
    >>> p = plan(SliceRequest.parse("2x2x2", "v4"), [a, b])
    >>> [s.name for s in p.chosen], p.verdict("a").reason
    (['b'], 'busy: host 1 has 0/4 chips free')
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from rayslice.cluster import HostInfo, SliceInfo
from rayslice.request import SliceRequest
from rayslice.topology import Topology


@dataclasses.dataclass(frozen=True)
class SliceVerdict:
    """Whether one slice of the cluster can serve the request, and why not."""

    slice_name: str
    usable: bool
    reason: str
    matches_shape: bool

    def __str__(self) -> str:
        return f"{self.slice_name}: {self.reason}"


@dataclasses.dataclass(frozen=True)
class Plan:
    """The outcome of planning: the slices to take, and a verdict on every slice."""

    request: SliceRequest
    chosen: tuple[SliceInfo, ...]
    verdicts: tuple[SliceVerdict, ...]

    @property
    def topology(self) -> Topology:
        return self.request.topology

    @property
    def num_slices(self) -> int:
        return self.request.num_slices

    @property
    def ok(self) -> bool:
        """True when enough whole free slices were found."""
        return len(self.chosen) == self.num_slices

    @property
    def num_matching(self) -> int:
        """Slices of the requested type and shape, whatever their state."""
        return sum(v.matches_shape for v in self.verdicts)

    def verdict(self, slice_name: str) -> SliceVerdict:
        for v in self.verdicts:
            if v.slice_name == slice_name:
                return v
        raise KeyError(slice_name)

    def first_reason(self) -> str:
        """The most relevant reason the request waits, for a one-line display.

        Example:
            >>> Plan(SliceRequest(Topology.parse("2x2x2", "v4")), (), ()).first_reason()
            'no TPU slices in the cluster'
        """
        reasons = [v for v in self.verdicts if v.matches_shape] or list(self.verdicts)
        if not reasons:
            return "no TPU slices in the cluster"
        why = str(reasons[0])
        return why + (f" (+{len(reasons) - 1} more)" if len(reasons) > 1 else "")

    def explain(self) -> str:
        """A human report: the request, then one line per slice of the cluster."""
        want = str(self.request)
        extra = self.request.resources_per_host
        if extra:
            want += " with " + ", ".join(f"{k}={v:g}" for k, v in sorted(extra.items())) + " per host"
        head = f"request: {want}; {self.num_matching} slice(s) of that type and shape, {len(self.chosen)} usable now"
        if not self.verdicts:
            return head + "\n  (the cluster has no TPU slices)"
        lines = [head] + [f"  - {v}" for v in sorted(self.verdicts, key=lambda v: (not v.matches_shape, v.slice_name))]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.explain()


def _resource_problem(hosts: tuple[HostInfo, ...], extra: dict[str, float]) -> tuple[bool, str] | None:
    """(can ever fit, reason) when the hosts lack the extra per-host resources; None when they fit now."""
    for h in hosts:
        for key, amount in extra.items():
            total = h.resources_total.get(key, 0.0)
            if total < amount:
                have = f"{total:g} {key} in total" if key in h.resources_total else f"no {key!r} resource"
                return False, f"too small: host {h.worker_id} has {have}, request wants {amount:g} per host"
    busy = [
        f"host {h.worker_id} has {h.resources_free.get(k, 0.0):g}/{h.resources_total.get(k, 0.0):g} {k} free"
        for h in hosts
        for k, amount in extra.items()
        if h.resources_free.get(k, 0.0) < amount
    ]
    return (True, "busy: " + ", ".join(busy)) if busy else None


def _reason(s: SliceInfo, request: SliceRequest) -> tuple[bool, bool, str]:
    """(matches_shape, usable, reason) for one slice; string compares only, for speed."""
    want = request.topology
    if s.problem is not None:
        return False, False, f"not a known slice ({s.problem})"
    if s.pod_type != want.pod_type or s.topology != want.name:
        return False, False, f"other shape: {s.accelerator_type} {s.topology} ({s.pod_type})"
    if s.hosts_expected != want.num_hosts:
        return (
            False,
            False,
            (
                f"other host layout: {s.hosts_expected} host(s) of {s.chips_per_host} chips, "
                f"request wants {want.num_hosts} of {want.chips_per_host}"
            ),
        )
    problems = []
    if s.missing_workers:
        problems.append("missing host(s) " + ", ".join(map(str, s.missing_workers)))
    dead = [h.worker_id for h in s.hosts if not h.alive]
    if dead:
        problems.append("dead host(s) " + ", ".join(map(str, dead)))
    extra = [h.worker_id for h in s.hosts if h.worker_id >= s.hosts_expected]
    if extra:
        problems.append("unexpected worker id(s) " + ", ".join(map(str, extra)))
    if problems:
        return True, False, "incomplete: " + "; ".join(problems)
    if request.resources_per_host:
        lacking = _resource_problem(s.hosts, dict(request.resources_per_host))
        if lacking is not None and not lacking[0]:
            return False, False, lacking[1]  # can never fit: not a match for this request
    busy = [h for h in s.hosts if not h.is_free]
    if busy:
        detail = ", ".join(f"host {h.worker_id} has {h.chips_free:g}/{h.chips_total:g} chips free" for h in busy)
        return True, False, f"busy: {detail}"
    if request.resources_per_host and lacking is not None:
        return True, False, lacking[1]
    return True, True, "free"


def plan(
    request: SliceRequest | Topology,
    slices: Sequence[SliceInfo],
    *,
    num_slices: int | None = None,
    exclude: Iterable[str] = (),
    prefer: Iterable[str] = (),
) -> Plan:
    """Picks ``num_slices`` whole free slices matching ``request``.

    Slices are taken in name order so that plans are deterministic. A slice
    is usable only when it has the requested pod type, topology and host
    layout, every host is alive, and no chip of any host is held.

    Args:
        request: What is wanted: a :class:`SliceRequest` (or a bare
            :class:`Topology`, meaning one slice with no extra resources).
        slices: The cluster's slices (:func:`rayslice.cluster.parse_slices`).
        num_slices: Overrides the request's number of slices.
        exclude: Slice names not to choose (e.g. just lost to a race).
        prefer: Slice names to choose first when they are free (e.g. the
            slice whose host 0 runs the caller); then name order as usual.

    Returns:
        A :class:`Plan`; ``plan.ok`` is False when not enough slices are free,
        and then ``plan.chosen`` is empty (all or nothing).
    """
    request = SliceRequest.parse(request, num_slices=num_slices)
    num_slices = request.num_slices
    excluded = set(exclude)
    preferred = set(prefer)
    verdicts = []
    free: list[SliceInfo] = []
    for s in slices:
        matches, usable, reason = _reason(s, request)
        if usable and s.name in excluded:
            usable, reason = False, "skipped: lost a race for it a moment ago"
        verdicts.append(SliceVerdict(s.name, usable, reason, matches))
        if usable:
            free.append(s)
    free.sort(key=lambda s: (s.name not in preferred, s.name))
    chosen = tuple(free[:num_slices]) if len(free) >= num_slices else ()
    return Plan(request=request, chosen=chosen, verdicts=tuple(verdicts))
