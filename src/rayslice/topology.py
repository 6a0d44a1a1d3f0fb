"""The one catalog of TPU facts in rayslice: generations, slice shapes, hosts.

Everything else in the package asks this module how many chips, hosts and JAX
devices a slice has, and which Ray/GKE strings name it; nothing else keeps its
own copy of these facts.

Host-size default: v4, v5p and v7x VMs always hold 4 chips. For v5e and v6e,
a shape of at most 8 chips is one VM by default (1x1 -> 1 chip, 2x2 -> 4 chips,
and 2x4 -> ONE 8-chip VM), the same default Ray 2.60 uses
(``ray._private.accelerators.tpu.get_chips_per_host``). Pass
``chips_per_host=4`` to describe a 2x4 slice as two 4-chip VMs (GKE's
``ct6e-standard-4t`` / ``ct5lp-hightpu-4t`` node pools). Larger v5e/v6e
shapes are always 4-chip VMs.

>>> t = Topology.parse("TPU-V6E", "4x4")
>>> str(t)
'v6e 4x4 (16 chips, 4 hosts x 4)'
>>> t.pod_type, t.head_resource, t.gke_machine_type
('v6e-16', 'TPU-v6e-16-head', 'ct6e-standard-4t')
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from rayslice.errors import InvalidArgument

__all__ = [
    "GENERATIONS",
    "MEGASCALE_PORT",
    "Generation",
    "Topology",
    "chips_per_host_options",
    "generation",
    "is_shape",
    "valid_topologies",
]

GENERATIONS: tuple[str, ...] = ("v4", "v5e", "v5p", "v6e", "v7x")

#: The port libtpu's Megascale (multi-slice DCN) traffic uses: GKE/KubeRay open it
#: as ``mxla`` on TPU worker pods; rayslice's gang sets it as ``MEGASCALE_PORT``.
MEGASCALE_PORT = 8081


@dataclass(frozen=True)
class Generation:
    """Facts about one TPU generation. Get one with :func:`generation`.

    ``gke_machine_types`` maps chips per host to the GKE machine type. It is a
    read-only mapping, so code that reads the shared catalog cannot change it.

    >>> g = generation("ironwood")
    >>> g.name, g.accelerator_type, g.api_prefix, g.devices_per_chip
    ('v7x', 'TPU-V7X', 'tpu7x', 2)
    """

    name: str
    accelerator_type: str
    ray_prefix: str
    api_prefix: str
    gke_accelerator: str
    cores_per_chip: int
    devices_per_chip: int
    topologies: tuple[str, ...]
    gke_machine_types: Mapping[int, str] = field(hash=False)

    @property
    def ndim(self) -> int:
        """How many axes this generation's shapes have (2 or 3)."""
        return self.topologies[0].count("x") + 1


def _shape_str(shape: tuple[int, ...]) -> str:
    return "x".join(str(d) for d in shape)


def _dims(topology: str) -> tuple[int, ...]:
    return tuple(int(d) for d in topology.split("x"))


def _smallest_first(shapes: set[str]) -> tuple[str, ...]:
    # By chip count, then shape: listings and error messages read small to large.
    return tuple(sorted(shapes, key=lambda s: (math.prod(_dims(s)), _dims(s))))


def _cube_shapes(max_dims: tuple[int, int, int]) -> tuple[str, ...]:
    # Google's rule for 3D slices (https://cloud.google.com/tpu/docs/types-topologies):
    # AxBxC with A <= B <= C, and either a sub-cube shape below or every axis a
    # multiple of 4 (whole 4x4x4 cubes). max_dims bounds each axis.
    shapes = {"2x2x1", "2x2x2", "2x2x4", "2x4x4"}
    for a in range(4, max_dims[0] + 1, 4):
        for b in range(a, max_dims[1] + 1, 4):
            for c in range(b, max_dims[2] + 1, 4):
                shapes.add(f"{a}x{b}x{c}")
    return _smallest_first(shapes)


# Google's 2D slice tables; v5e and v6e take the same eight shapes.
# https://cloud.google.com/tpu/docs/v5e and https://cloud.google.com/tpu/docs/v6e
# Ray 2.60's VALID_TPU_TOPOLOGY also lists "2x8" for v5litepod and v6e; no
# Google page lists it, so it is not valid here.
_SHAPES_2D = _smallest_first({"1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16"})

# The catalog. Sources, per column:
#   cores_per_chip, pod sizes: https://cloud.google.com/tpu/docs/v4 (2 TCs,
#     4096-chip pod = 16x16x16), /v5e (1 TC), /v5p (2 TCs; largest slice
#     16x16x24), /v6e (1 TC), /tpu7x (2 TCs, 4-chip VMs, 9216-chip pod).
#   devices_per_chip: v4/v5p run "megacore" (both TensorCores form one JAX
#     device), https://cloud.google.com/tpu/docs/system-architecture-tpu-vm;
#     TPU7x drops megacore: "the Ironwood programming model lets you access two
#     TPU devices" per chip (https://cloud.google.com/tpu/docs/tpu7x). Ray still
#     counts one "TPU" resource per chip unless RAY_TPU_RESOURCE_PER_CHIP is set.
#   gke_accelerator, gke_machine_types:
#     https://cloud.google.com/kubernetes-engine/docs/concepts/plan-tpus
#     (on v6e, 2x4 is one host on ct6e-standard-8t and two on ct6e-standard-4t).
#     GKE also has tpu7x-standard-1t for a 1x1x1 TPU7x; Ray 2.60 has no 1x1x1 for
#     v7x, and v7x hosts are always 4 chips here, so it is left out.
#   ray_prefix: Ray 2.60 normalize_tpu_accelerator_type(); api_prefix: what GKE
#     puts in TPU_ACCELERATOR_TYPE (TPU7x uses "tpu7x-<cores>", which Ray
#     rewrites to "v7x-<cores>").
#   v4 shapes: the rule above, up to the 16x16x16 pod. Ray 2.60's table
#     also has unsorted shapes (8x4x4) and stops at 12 on the first two axes, so
#     Ray's SlicePlacementGroup rejects 4x16x16, 8x16x16 (v4-4096, listed by
#     Google), 12x16x16 and 16x16x16.
#   v5p shapes: the same rule up to the documented 16x16x24 maximum. GKE (per
#     the xpk tool) also takes longer shapes such as 4x4x28, up to the
#     8960-chip pod; those are not listed here.
#   v7x shapes: Ray 2.60's list, not yet checked against the tpu7x page's shape
#     table; GKE (per xpk) also takes other whole-cube shapes up to the pod.
_CATALOG: dict[str, Generation] = {
    g.name: g
    for g in (
        Generation(
            "v4",
            "TPU-V4",
            "v4",
            "v4",
            "tpu-v4-podslice",
            2,
            1,
            _cube_shapes((16, 16, 16)),
            MappingProxyType({4: "ct4p-hightpu-4t"}),
        ),
        Generation(
            "v5e",
            "TPU-V5LITEPOD",
            "v5litepod",
            "v5litepod",
            "tpu-v5-lite-podslice",
            1,
            1,
            _SHAPES_2D,
            MappingProxyType({1: "ct5lp-hightpu-1t", 4: "ct5lp-hightpu-4t", 8: "ct5lp-hightpu-8t"}),
        ),
        Generation(
            "v5p",
            "TPU-V5P",
            "v5p",
            "v5p",
            "tpu-v5p-slice",
            2,
            1,
            _cube_shapes((16, 16, 24)),
            MappingProxyType({4: "ct5p-hightpu-4t"}),
        ),
        Generation(
            "v6e",
            "TPU-V6E",
            "v6e",
            "v6e",
            "tpu-v6e-slice",
            1,
            1,
            _SHAPES_2D,
            MappingProxyType({1: "ct6e-standard-1t", 4: "ct6e-standard-4t", 8: "ct6e-standard-8t"}),
        ),
        Generation(
            "v7x",
            "TPU-V7X",
            "v7x",
            "tpu7x",
            "tpu7x",
            2,
            2,
            _smallest_first(
                {"2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8", "8x8x16", "8x16x16"}
            ),
            MappingProxyType({4: "tpu7x-standard-4t"}),
        ),
    )
}

# Shapes Ray 2.60's VALID_TPU_TOPOLOGY accepts that Google's tables do not list,
# with the reason they are refused here.
_RAY_ONLY_SHAPES: dict[tuple[str, str], str] = {
    (g, "2x8"): f"Ray's table lists {g} 2x8, but Google's {g} shapes do not: a 16-chip slice is 4x4"
    for g in ("v5e", "v6e")
}
# Generations Ray knows that rayslice does not run on, and why.
_LEGACY = {
    "v2": "v2 is a legacy Cloud TPU generation (TPU VMs only, no GKE node pools)",
    "v3": "v3 is a legacy Cloud TPU generation (TPU VMs only, no GKE node pools)",
}

# Every spelling that names a generation, lowercased. Built from the catalog so
# a new column value is accepted automatically; the extras are product names
# and legacy labels ("tpu-v5-lite-device" is GKE's old single-host v5e label).
_ALIASES: dict[str, str] = {}
for _g in _CATALOG.values():
    for _alias in (
        _g.name,
        _g.accelerator_type,
        _g.ray_prefix,
        _g.api_prefix,
        _g.gke_accelerator,
        f"tpu-{_g.name}",
        f"tpu-{_g.ray_prefix}",
    ):
        _ALIASES[_alias.lower()] = _g.name
_ALIASES.update(
    {
        "v5lite": "v5e",
        "v5lite-pod": "v5e",
        "tpu-v5-lite-device": "v5e",
        "trillium": "v6e",
        "ironwood": "v7x",
        "tpu-7x": "v7x",
    }
)

# Block of chips one host holds, by (shape rank, chips per host).
_HOST_BLOCKS: dict[tuple[int, int], tuple[int, ...]] = {
    (2, 1): (1, 1),
    (2, 4): (2, 2),
    (2, 8): (2, 4),
    (3, 4): (2, 2, 1),
}


def generation(name: str) -> Generation:
    """Return the catalog entry for a TPU generation, however it is spelled.

    Accepts, case-insensitively, the canonical name ("v6e"), Ray's accelerator
    type ("TPU-V6E"), GKE's accelerator label ("tpu-v6e-slice"), a pod type
    ("v6e-16", "tpu7x-16"), "tpu-v6e", and names such as "v5litepod",
    "v5lite", "tpu-v5-lite-device", "tpu7x" and "ironwood".

    Raises:
        ValueError: if ``name`` is not a known spelling; the message lists the
            valid generations.

    >>> generation("tpu-v5-lite-podslice").name
    'v5e'
    >>> generation("v4-16").cores_per_chip
    2
    """
    key = name.strip().lower() if isinstance(name, str) else ""
    # A pod type ("v6e-16", "tpu7x-16") names its generation plus a size.
    key = re.sub(r"-\d+$", "", key)
    legacy = _LEGACY.get(key.removeprefix("tpu-"))
    if legacy:
        raise InvalidArgument(f"{name!r}: {legacy}; rayslice supports {', '.join(GENERATIONS)}")
    if key not in _ALIASES:
        raise InvalidArgument(
            f"{name!r} is not a known TPU generation; valid: {', '.join(GENERATIONS)}"
            " (also spelled like 'TPU-V6E', 'tpu-v6e-slice' or 'v6e-16')"
        )
    return _CATALOG[_ALIASES[key]]


def valid_topologies(generation: str) -> list[str]:
    """Return every valid topology of a generation, smallest first.

    >>> valid_topologies("v6e")
    ['1x1', '2x2', '2x4', '4x4', '4x8', '8x8', '8x16', '16x16']
    """
    return list(_gen(generation).topologies)


def is_shape(value: object) -> bool:
    """Whether ``value`` is spelled like a chip shape ("4x4", "2x2x2"), valid or not.

    >>> is_shape("4X4"), is_shape("v6e")
    (True, False)
    """
    return _parse_shape(value) is not None


def _is_generation(name: object) -> bool:
    return isinstance(name, str) and re.sub(r"-\d+$", "", name.strip().lower()) in _ALIASES


# The public parameter named "generation" shadows the function inside
# valid_topologies() and chips_per_host_options(); they call it by this name.
_gen = generation


def _bad_topology(value: object, gen: Generation, why: str = "") -> InvalidArgument:
    return InvalidArgument(f"{value!r} is not a {gen.name} topology{why}; valid: {', '.join(gen.topologies)}")


def _check_shape(gen: Generation, value: object, shape: tuple[int, ...] | None) -> str:
    """Return the shape's name, or raise the helpful error about ``value``."""
    if shape is None or not shape or any(d < 1 for d in shape):
        raise _bad_topology(value, gen)
    if len(shape) != gen.ndim:
        kind = "3D shapes (AxBxC)" if gen.ndim == 3 else "2D shapes (AxB)"
        same = [t for t in gen.topologies if math.prod(_dims(t)) == math.prod(shape)]
        hint = f"; the {math.prod(shape)}-chip shape is {' or '.join(same)}" if same else ""
        raise _bad_topology(value, gen, f": {gen.name} takes {kind}{hint}")
    name = _shape_str(shape)
    if name not in gen.topologies:
        why = _RAY_ONLY_SHAPES.get((gen.name, name), "")
        raise _bad_topology(value, gen, f" ({why})" if why else "")
    return name


def _parse_shape(topology: object) -> tuple[int, ...] | None:
    if isinstance(topology, str):
        text = re.sub(r"\s+", "", topology).lower()
        if re.fullmatch(r"\d{1,6}(x\d{1,6})+", text):  # no real axis has 7 digits
            return _dims(text)
        return None
    if isinstance(topology, tuple | list) and all(isinstance(d, int) and not isinstance(d, bool) for d in topology):
        return tuple(topology)
    return None


def chips_per_host_options(generation: str, topology: str) -> tuple[int, ...]:
    """Return the chips-per-host values a slice shape can have, ascending.

    A multi-host slice is made of 4-chip VMs; 1- and 8-chip VMs exist only as a
    whole single-host slice (v5e/v6e 1x1 and 2x4). The largest option is the
    default :meth:`Topology.parse` picks.

    Raises:
        ValueError: if the generation or topology is not valid.

    >>> chips_per_host_options("v6e", "2x4")
    (4, 8)
    >>> chips_per_host_options("v4", "2x2x1")
    (4,)
    """
    gen = _gen(generation)
    shape = _dims(_check_shape(gen, topology, _parse_shape(topology)))
    chips = math.prod(shape)
    options = []
    for per_host in sorted(gen.gke_machine_types):
        block = _HOST_BLOCKS.get((len(shape), per_host))
        fits = block is not None and all(s % b == 0 for s, b in zip(shape, block))
        if fits and (per_host == chips or (per_host == 4 and chips > 4)):
            options.append(per_host)
    return tuple(options)


@dataclass(frozen=True)
class Topology:
    """One TPU slice: a generation, a chip shape, and how many chips per host.

    Construction validates everything and canonicalizes ``generation`` (any
    spelling :func:`generation` accepts) and ``shape`` (a tuple). Use
    :meth:`parse` to start from strings and get the default ``chips_per_host``.

    >>> t = Topology("v4", (2, 2, 2), 4)
    >>> t.num_hosts, t.pod_type, t.host_grid
    (2, 'v4-16', (1, 1, 2))
    """

    generation: str
    shape: tuple[int, ...]
    chips_per_host: int

    def __post_init__(self) -> None:
        gen = generation(self.generation)
        shape = _parse_shape(self.shape)
        _check_shape(gen, self.shape, shape)
        # Frozen: the canonical spellings are stored via object.__setattr__.
        object.__setattr__(self, "generation", gen.name)
        object.__setattr__(self, "shape", shape)
        options = chips_per_host_options(gen.name, self.name)
        per_host = self.chips_per_host
        if type(per_host) is not int or per_host not in options:  # no bool/float
            raise InvalidArgument(
                f"chips_per_host={self.chips_per_host!r} is not possible for "
                f"{gen.name} {self.name}; valid: {', '.join(map(str, options))}"
            )

    @classmethod
    def parse(cls, topology: str, accelerator_type: str, *, chips_per_host: int | None = None) -> Topology:
        """Build a Topology from a topology string and a generation spelling.

        The order is Ray's (``topology``, then ``accelerator_type``), and both
        are keyword-friendly. The older order (generation first) keeps
        working: a shape ("4x4") and a generation ("v6e") can never be
        mistaken for each other, so the two are told apart by what they are,
        not by position; two shapes or two generations is an error.

        ``topology`` may use any case and spaces ("4 X 4"). When
        ``chips_per_host`` is None it defaults to 4, except that v5e/v6e shapes
        of at most 8 chips are one host: 1x1 -> 1, 2x2 -> 4, 2x4 -> ONE 8-chip
        host. Pass ``chips_per_host=4`` for a 2x4 made of two 4-chip hosts.

        Raises:
            ValueError: naming the bad value and listing the valid choices.

        >>> Topology.parse("2x4", "v6e").num_hosts
        1
        >>> Topology.parse(topology="2X4", accelerator_type="v6e", chips_per_host=4).num_hosts
        2
        >>> Topology.parse("TPU-V4", "2x2x2") == Topology.parse("2x2x2", "TPU-V4")
        True
        """
        old_order = _parse_shape(accelerator_type) is not None and _parse_shape(topology) is None
        if old_order or (_is_generation(topology) and not _is_generation(accelerator_type)):
            topology, accelerator_type = accelerator_type, topology  # the older (generation, shape) order
        if isinstance(accelerator_type, str) and _parse_shape(accelerator_type) is not None:
            raise InvalidArgument(
                f"accelerator_type={accelerator_type!r} is a shape, not a TPU generation; "
                f"valid: {', '.join(GENERATIONS)}"
            )
        gen = generation(accelerator_type)
        shape = _parse_shape(topology)
        name = _check_shape(gen, topology, shape)
        if chips_per_host is None:
            chips_per_host = max(chips_per_host_options(gen.name, name))
        return cls(gen.name, _dims(name), chips_per_host)

    @property
    def _gen(self) -> Generation:
        return _CATALOG[self.generation]

    @property
    def accelerator_type(self) -> str:
        """Ray's accelerator type resource and label, e.g. "TPU-V6E"."""
        return self._gen.accelerator_type

    @property
    def name(self) -> str:
        """The topology string, e.g. "4x4"."""
        return _shape_str(self.shape)

    @property
    def num_chips(self) -> int:
        return math.prod(self.shape)

    @property
    def num_hosts(self) -> int:
        """TPU VMs in the slice, which is also the number of Ray nodes."""
        return self.num_chips // self.chips_per_host

    @property
    def devices_per_host(self) -> int:
        """JAX devices one host process sees (``jax.local_device_count()``)."""
        return self.chips_per_host * self._gen.devices_per_chip

    @property
    def num_devices(self) -> int:
        """JAX devices in the whole slice (``jax.device_count()``)."""
        return self.num_chips * self._gen.devices_per_chip

    @property
    def _size(self) -> int:  # pod types count TensorCores: v4-16 is 8 chips
        return self.num_chips * self._gen.cores_per_chip

    @property
    def pod_type(self) -> str:
        """Ray's ray.io/tpu-pod-type label, e.g. "v6e-16" or "v7x-16".

        Built exactly as Ray 2.60's ``infer_tpu_pod_type_from_topology``.
        """
        return f"{self._gen.ray_prefix}-{self._size}"

    @property
    def api_accelerator_type(self) -> str:
        """What GKE sets in the TPU_ACCELERATOR_TYPE env var, e.g. "tpu7x-16"."""
        return f"{self._gen.api_prefix}-{self._size}"

    @property
    def head_resource(self) -> str:
        """The resource Ray 2.60 puts on worker 0 only, e.g. "TPU-v6e-16-head"."""
        return f"TPU-{self.pod_type}-head"

    @property
    def gke_accelerator(self) -> str:
        """GKE node selector cloud.google.com/gke-tpu-accelerator."""
        return self._gen.gke_accelerator

    @property
    def gke_machine_type(self) -> str:
        return self._gen.gke_machine_types[self.chips_per_host]

    @property
    def host_chip_shape(self) -> tuple[int, ...]:
        """The block of chips one host holds, e.g. (2, 2) or (2, 2, 1)."""
        return _HOST_BLOCKS[(len(self.shape), self.chips_per_host)]

    @property
    def host_grid(self) -> tuple[int, ...]:
        """Hosts along each axis, e.g. (1, 1, 2) for v4 2x2x2."""
        return tuple(s // b for s, b in zip(self.shape, self.host_chip_shape))

    @property
    def is_multi_host(self) -> bool:
        return self.num_hosts > 1

    def __str__(self) -> str:
        hosts = f"{self.num_hosts} host" + ("" if self.num_hosts == 1 else "s")
        return f"{self.generation} {self.name} ({self.num_chips} chips, {hosts} x {self.chips_per_host})"
