"""One slice request, built once at every entry point and passed down whole.

A :class:`SliceRequest` is what every layer that reserves slices takes: the
parsed :class:`~rayslice.topology.Topology`, how many slices, and what else
each host's bundle holds. Configs (``ScalingConfig``, ``SliceServeConfig``),
the CLI and :func:`~rayslice.slice_placement_group` build it once from the
user's strings (in either spelling Ray users know: ``topology`` +
``accelerator_type``, or Ray's ``accelerator_version``) and never parse again.

Example:
    >>> r = SliceRequest.parse("2x2x2", "TPU-V4", num_slices=2)
    >>> r.num_hosts, r.hosts_per_slice, str(r)
    (4, 2, '2 x v4 2x2x2 (8 chips, 2 hosts x 4)')
    >>> SliceRequest.parse(r) is r
    True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from rayslice._validate import check_int, check_resources, fail
from rayslice.topology import Topology

__all__ = ["SliceRequest"]


@dataclasses.dataclass(frozen=True)
class SliceRequest:
    """Whole slices of one topology, and the extra resources each host's bundle holds.

    Args:
        topology: The parsed slice shape (see :meth:`Topology.parse`).
        num_slices: Distinct slices, reserved all or nothing.
        resources_per_host: Extra Ray resources each host's bundle holds (e.g.
            ``{"CPU": 1}``); never ``TPU``, which comes from the topology.

    Example:
        >>> SliceRequest(Topology.parse("4x4", "v6e"), resources_per_host={"CPU": 2}).bundle_resources
        {'TPU': 4.0, 'CPU': 2.0}
    """

    topology: Topology
    num_slices: int = 1
    resources_per_host: Mapping[str, float] = dataclasses.field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        if not isinstance(self.topology, Topology):
            raise fail("topology", self.topology, "a Topology (use SliceRequest.parse for strings)", got_type=True)
        check_int("num_slices", self.num_slices, minimum=1, maximum=4096)
        extra = check_resources("resources_per_host", self.resources_per_host, forbidden=("TPU",))
        object.__setattr__(self, "resources_per_host", MappingProxyType(extra))

    @classmethod
    def parse(
        cls,
        topology: str | Topology | SliceRequest,
        accelerator_type: str | None = None,
        *,
        num_slices: int | None = None,
        chips_per_host: int | None = None,
        resources_per_host: Mapping[str, float] | None = None,
    ) -> SliceRequest:
        """Builds a request from strings, a :class:`Topology`, or another request.

        A :class:`SliceRequest` passed with no other argument is returned as
        is; a :class:`Topology` needs no ``accelerator_type``. Strings are
        parsed once with :meth:`Topology.parse` (either argument order works;
        see there).

        Raises:
            InvalidArgument: naming the bad value and what is valid.

        Example:
            >>> SliceRequest.parse("v6e", "2x4", chips_per_host=4).hosts_per_slice
            2
        """
        if isinstance(topology, SliceRequest):
            if accelerator_type is not None or chips_per_host is not None:
                raise fail("accelerator_type", accelerator_type,
                           "None when topology is already a SliceRequest (its topology is fixed)")
            changes: dict[str, Any] = {}
            if num_slices is not None:
                changes["num_slices"] = num_slices
            if resources_per_host is not None:
                changes["resources_per_host"] = resources_per_host
            return dataclasses.replace(topology, **changes) if changes else topology
        if isinstance(topology, Topology):
            if chips_per_host is not None and chips_per_host != topology.chips_per_host:
                raise fail("chips_per_host", chips_per_host,
                           f"{topology.chips_per_host} (fixed by the Topology given) or None")
            topo = topology
        else:
            if accelerator_type is None:
                raise fail("accelerator_type", accelerator_type,
                           "a TPU generation such as 'TPU-V6E' or 'v6e' when topology is a string")
            topo = Topology.parse(topology, accelerator_type, chips_per_host=chips_per_host)
        return cls(topo, 1 if num_slices is None else num_slices, resources_per_host or {})

    @property
    def hosts_per_slice(self) -> int:
        """Hosts (Ray nodes, gang processes) in one slice."""
        return self.topology.num_hosts

    @property
    def num_hosts(self) -> int:
        """Hosts over all slices: one bundle, one gang process each."""
        return self.topology.num_hosts * self.num_slices

    @property
    def bundle_resources(self) -> dict[str, float]:
        """What each host's bundle holds: its chips, plus ``resources_per_host``."""
        return {"TPU": float(self.topology.chips_per_host), **self.resources_per_host}

    def __str__(self) -> str:
        return f"{self.num_slices} x {self.topology}"
