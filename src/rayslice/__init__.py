"""rayslice: run JAX workloads on whole accelerator slices with Ray.

Example:
    >>> import rayslice
    >>> rayslice.Topology.parse("TPU-V6E", "4x4").num_hosts
    4
"""

from rayslice import data, metrics, profiler
from rayslice.cluster import HostInfo, SliceInfo, list_slices, parse_slices
from rayslice.data import batch_predict, iter_jax_batches
from rayslice.dispatch import run_on_slice
from rayslice.errors import (
    GangError,
    NoMatchingSlice,
    Outcome,
    RaysliceError,
    ReservationError,
    ReservationTimeout,
    classify,
    describe,
)
from rayslice.gang import HostContext, SliceGang, host_context
from rayslice.placement import (
    ReservedHost,
    ReservedSlice,
    SlicePlacementGroup,
    explain,
    slice_placement_group,
)
from rayslice.planning import Plan, SliceVerdict, plan
from rayslice.profiler import init_jax_profiler
from rayslice.sim import SimulatedCluster, SliceSpec
from rayslice.topology import (
    GENERATIONS,
    Generation,
    Topology,
    generation,
    valid_topologies,
)

__version__ = "0.1.0"

__all__ = [
    "GENERATIONS",
    "GangError",
    "Generation",
    "HostContext",
    "HostInfo",
    "NoMatchingSlice",
    "Outcome",
    "Plan",
    "RaysliceError",
    "ReservationError",
    "ReservationTimeout",
    "ReservedHost",
    "ReservedSlice",
    "SimulatedCluster",
    "SliceGang",
    "SliceInfo",
    "SlicePlacementGroup",
    "SliceSpec",
    "SliceVerdict",
    "Topology",
    "batch_predict",
    "classify",
    "data",
    "describe",
    "explain",
    "generation",
    "host_context",
    "init_jax_profiler",
    "iter_jax_batches",
    "list_slices",
    "metrics",
    "parse_slices",
    "plan",
    "profiler",
    "run_on_slice",
    "slice_placement_group",
    "valid_topologies",
]
