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

__all__ = ["SliceRequest", "bundle_label_selectors", "request_from_args"]


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
                raise fail(
                    "accelerator_type",
                    accelerator_type,
                    "None when topology is already a SliceRequest (its topology is fixed)",
                )
            changes: dict[str, Any] = {}
            if num_slices is not None:
                changes["num_slices"] = num_slices
            if resources_per_host is not None:
                changes["resources_per_host"] = resources_per_host
            return dataclasses.replace(topology, **changes) if changes else topology
        if isinstance(topology, Topology):
            if chips_per_host is not None and chips_per_host != topology.chips_per_host:
                raise fail(
                    "chips_per_host", chips_per_host, f"{topology.chips_per_host} (fixed by the Topology given) or None"
                )
            topo = topology
        else:
            if accelerator_type is None:
                raise fail(
                    "accelerator_type",
                    accelerator_type,
                    "a TPU generation such as 'TPU-V6E' or 'v6e' when topology is a string",
                )
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


def request_from_args(
    topology: Any,
    accelerator_type: Any = None,
    *,
    accelerator_version: Any = None,
    num_slices: Any = None,
    chips_per_host: Any = None,
    chips_per_vm: Any = None,
    resources_per_host: Any = None,
    resources_per_bundle: Any = None,
    tpu_resource_per_chip: Any = None,
) -> SliceRequest:
    """One SliceRequest from rayslice's or Ray's spelling of the same arguments.

    Ray's ``accelerator_version``, ``chips_per_vm``, ``resources_per_bundle``
    and ``tpu_resource_per_chip`` map onto rayslice's fields; giving both
    spellings of one thing with different values is an error.

    Example:
        >>> r = request_from_args("4x4", accelerator_version="v6e", resources_per_bundle={"TPU": 4, "CPU": 1})
        >>> r.bundle_resources
        {'TPU': 4.0, 'CPU': 1.0}
    """
    if accelerator_version is not None:
        if accelerator_type is not None and accelerator_type != accelerator_version:
            raise fail(
                "accelerator_version",
                accelerator_version,
                f"the same as accelerator_type={accelerator_type!r}, or pass only one of them",
            )
        accelerator_type = accelerator_version
    if chips_per_vm is not None:
        if chips_per_host is not None and chips_per_host != chips_per_vm:
            raise fail("chips_per_vm", chips_per_vm, f"the same as chips_per_host={chips_per_host!r}, or only one")
        chips_per_host = chips_per_vm
    if tpu_resource_per_chip not in (None, 1) or isinstance(tpu_resource_per_chip, bool):
        raise fail("tpu_resource_per_chip", tpu_resource_per_chip, "1 or None (one TPU resource per chip)")
    if chips_per_host is not None:
        check_int("chips_per_host", chips_per_host, minimum=1)
    if resources_per_bundle is not None:
        if resources_per_host is not None:
            raise fail(
                "resources_per_bundle",
                resources_per_bundle,
                "None when resources_per_host is given (they are the same thing)",
            )
        bundle = check_resources("resources_per_bundle", resources_per_bundle)
        chips = bundle.pop("TPU", None)
        request = SliceRequest.parse(
            topology, accelerator_type, num_slices=num_slices, chips_per_host=chips_per_host, resources_per_host=bundle
        )
        if chips is not None and chips != request.topology.chips_per_host:
            raise fail(
                "resources_per_bundle",
                resources_per_bundle,
                f"'TPU': {request.topology.chips_per_host} or no 'TPU' entry: rayslice reserves one bundle "
                f"per host holding all its chips ({request.topology})",
            )
        return request
    return SliceRequest.parse(
        topology,
        accelerator_type,
        num_slices=num_slices,
        chips_per_host=chips_per_host,
        resources_per_host=resources_per_host,
    )


def bundle_label_selectors(value: Any, request: SliceRequest) -> list[dict[str, str]]:
    """Extra per-bundle label selectors: one dict for all, one per host of a slice, or one per bundle.

    Example:
        >>> r = SliceRequest.parse("2x2x2", "v4", num_slices=2)
        >>> bundle_label_selectors({"pool": "a"}, r)
        [{'pool': 'a'}, {'pool': 'a'}, {'pool': 'a'}, {'pool': 'a'}]
    """
    if value is None:
        return [{} for _ in range(request.num_hosts)]
    if isinstance(value, Mapping):
        value = [value]
    valid = (
        f"a dict of label -> value, or a list of 1, {request.hosts_per_slice} (per host of a slice) "
        f"or {request.num_hosts} (per bundle) dicts"
    )
    if not isinstance(value, list | tuple) or not all(isinstance(d, Mapping) for d in value):
        raise fail("bundle_label_selector", value, valid, got_type=True)
    for d in value:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in d.items()):
            raise fail("bundle_label_selector", value, "labels and values as strings")
    if len(value) == 1:
        return [dict(value[0]) for _ in range(request.num_hosts)]
    if len(value) == request.hosts_per_slice:
        return [dict(d) for _ in range(request.num_slices) for d in value]
    if len(value) == request.num_hosts:
        return [dict(d) for d in value]
    raise fail("bundle_label_selector", value, valid)
