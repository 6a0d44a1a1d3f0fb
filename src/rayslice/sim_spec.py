"""Specs of simulated TPU slices: what :class:`~rayslice.sim.SimulatedCluster` brings up.

A :class:`SliceSpec` names a slice's generation, chip shape and host layout,
validated against the topology catalog when it is built, so a bad spec fails
before any process starts. The CLI spells one ``GEN:TOPOLOGY[:CHIPS_PER_HOST][@NAME]``
(``rayslice sim up --slice v4:2x2x2``); :meth:`SliceSpec.parse` reads that form.

Example:
    >>> spec = SliceSpec.parse("v6e:2x4:4@pool-a")
    >>> spec.name, spec.topology_info.num_hosts, spec.topology_info.chips_per_host
    ('pool-a', 2, 4)
    >>> [s.topology for s in _specs(["v4:2x2x2", SliceSpec("TPU-V4", "2x2x1")])]
    ['2x2x2', '2x2x1']
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from rayslice._validate import check_instance, check_int, check_optional, fail
from rayslice.errors import InvalidArgument
from rayslice.topology import Topology

_SLICE_ARG = re.compile(r"^(?P<gen>[A-Za-z0-9_-]+?):(?P<topo>[0-9xX]+)(?::(?P<cph>\d+))?(?:@(?P<name>[a-z0-9-]+))?$")


@dataclasses.dataclass(frozen=True)
class SliceSpec:
    """One simulated slice to bring up.

    Args:
        accelerator_type: Any spelling the topology catalog accepts ("TPU-V4", "v6e").
        topology: The chip shape, e.g. "2x2x2" or "4x4".
        name: Slice name (``TPU_NAME``); generated when omitted.
        chips_per_host: Overrides the catalog default (v5e/v6e "2x4" only).
        cpus_per_host: Logical CPUs each simulated host advertises to Ray.

    Example:
        >>> SliceSpec.parse("v4:2x2x2").topology_info.num_hosts
        2
    """

    accelerator_type: str
    topology: str
    name: str | None = None
    chips_per_host: int | None = None
    cpus_per_host: int = 2
    _topology: Topology = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Validate eagerly, once: a bad spec must fail before any process starts.
        check_optional(check_int, "chips_per_host", self.chips_per_host, minimum=1)
        topo = Topology.parse(self.topology, self.accelerator_type, chips_per_host=self.chips_per_host)
        object.__setattr__(self, "_topology", topo)
        if self.name is not None and (
            not isinstance(self.name, str) or not re.fullmatch(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?", self.name)
        ):
            raise InvalidArgument(f"slice name {self.name!r} is not valid; use lowercase letters, digits and '-'")
        check_int("cpus_per_host", self.cpus_per_host)
        if self.cpus_per_host < 1:
            raise InvalidArgument(f"cpus_per_host={self.cpus_per_host} must be >= 1")

    @property
    def topology_info(self) -> Topology:
        """The catalog entry for this slice (parsed once, at construction)."""
        return self._topology

    @classmethod
    def parse(cls, text: str) -> SliceSpec:
        """Parses the CLI form ``GEN:TOPOLOGY[:CHIPS_PER_HOST][@NAME]``.

        Example:
            >>> SliceSpec.parse("v6e:2x4:4@pool-a").name
            'pool-a'
        """
        if not isinstance(text, str):
            raise fail("slice", text, "a string GEN:TOPOLOGY[:CHIPS_PER_HOST][@NAME], e.g. v4:2x2x2", got_type=True)
        m = _SLICE_ARG.match(text.strip())
        if not m:
            raise ValueError(
                f"{text!r} is not a slice; expected GEN:TOPOLOGY[:CHIPS_PER_HOST][@NAME], "
                "e.g. v4:2x2x2, v6e:4x4, v6e:2x4:4@pool-a"
            )
        cph = int(m["cph"]) if m["cph"] else None
        return cls(m["gen"], m["topo"], name=m["name"], chips_per_host=cph)


def _specs(slices: object) -> list[SliceSpec]:
    """SliceSpecs, or their CLI strings ("v4:2x2x2"), validated before anything starts."""
    if isinstance(slices, SliceSpec | str) or not isinstance(slices, Sequence):
        raise fail("slices", slices, "a list of SliceSpec or 'GEN:TOPOLOGY' strings, e.g. ['v4:2x2x2']", got_type=True)
    out = []
    for item in slices:
        if isinstance(item, str):
            item = SliceSpec.parse(item)
        out.append(check_instance("slices", item, SliceSpec, "SliceSpec objects or 'GEN:TOPOLOGY' strings"))
    return out
