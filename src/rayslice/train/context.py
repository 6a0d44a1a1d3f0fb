"""Where a training worker sits: :class:`TrainContext`, shared by the worker API and checkpoints.

A small module of its own so that :mod:`rayslice.train.checkpoint` (which
needs this host's rank to pick its data iterator state) and
:mod:`rayslice.train.worker` (which sets it when an attempt starts) both
import it, and neither imports the other's callers.

Outside a training worker :func:`current_context` returns ``None``; tools
that run in gang processes (the profiler) use it to find the run's storage.

Example:
    >>> ctx = TrainContext(world_rank=1, world_size=2, slice_index=0, num_slices=1, worker_id=1,
    ...                    hosts_per_slice=2, local_device_count=4, experiment_name="run-a",
    ...                    run_path="/tmp/run-a", attempt=1)
    >>> ctx.get_world_rank(), ctx.get_world_size(), ctx.get_node_rank(), ctx.get_local_world_size()
    (1, 2, 1, 1)
    >>> current_context() is None  # not inside a training worker
    True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

__all__ = ["TrainContext", "current_context"]


@dataclasses.dataclass(frozen=True)
class TrainContext:
    """Where this worker sits, with Ray Train's getters.

    One worker runs per host, so ``world_rank`` equals ``jax.process_index()``
    and the node rank; the local rank is always 0.

    Attributes:
        world_rank: This host's rank over all slices (slice index, then worker id).
        world_size: Hosts over all slices.
        slice_index: Which reserved slice this host belongs to.
        num_slices: Slices in the run.
        worker_id: Physical worker id within the slice (``TPU_WORKER_ID``).
        hosts_per_slice: Hosts in one slice.
        local_device_count: Accelerator chips (JAX devices) on this host.
        experiment_name: The run's name (a directory under ``storage_path``).
        run_path: ``<storage_path>/<name>``.
        attempt: 1 for the first attempt, +1 per restart.
        slice_name: The slice's name (``ray.io/tpu-slice-name``).
        local_rank: Always 0 (one process per host).
        run_id: Unique per ``fit()`` call (resumed runs keep the name, not the id).
        max_slices: ``ScalingConfig.num_slices``: the slices of the full-size
            run (an elastic run may train on fewer, ``num_slices``).
        elastic_epoch: 0 at first, +1 each time an elastic run resizes (a
            new world size and a new split of the data).
        grad_accum_steps: Gradient-accumulation micro-steps per step that
            keep the global batch constant on this size (``max_slices /
            num_slices``; 1 when the run is not elastic or opts out with
            ``keep_global_batch=False``). Each micro-step takes one batch of
            the usual per-host size.
        mesh_shape: The mesh the function should build on this size,
            ``{axis: size}`` in order (``ScalingConfig.mesh`` with its first
            axis scaled; default one ``"data"`` axis over every device).
        data_resplit_step: The checkpoint step at which this epoch's dataset
            shards were split again (None: the original split): saved data
            positions of that step or before belong to the old split, and
            ``Checkpoint.data_state`` returns None for them (start of the
            new shard, which holds exactly the rows not yet consumed).

    Example:
        >>> ctx = TrainContext(0, 2, 0, 1, 0, 2, 4, "r", "/tmp/r", 2, max_slices=2, elastic_epoch=1,
        ...                    grad_accum_steps=2)
        >>> ctx.mesh_shape, ctx.world_device_count
        ({'data': 8}, 8)
    """

    world_rank: int
    world_size: int
    slice_index: int
    num_slices: int
    worker_id: int
    hosts_per_slice: int
    local_device_count: int
    experiment_name: str
    run_path: str
    attempt: int
    slice_name: str = ""
    local_rank: int = 0
    run_id: str = ""
    max_slices: int = 0
    elastic_epoch: int = 0
    grad_accum_steps: int = 1
    mesh_shape: Mapping[str, int] = dataclasses.field(default_factory=dict)
    data_resplit_step: int | None = None

    def __post_init__(self) -> None:
        if not self.max_slices:
            object.__setattr__(self, "max_slices", self.num_slices)
        if not self.mesh_shape:
            object.__setattr__(self, "mesh_shape", {"data": self.world_size * self.local_device_count})

    @property
    def world_device_count(self) -> int:
        """JAX devices over every host of this size (``jax.device_count()``)."""
        return self.world_size * self.local_device_count

    @property
    def elastic(self) -> bool:
        """True while an elastic run trains on fewer slices than its full size."""
        return self.num_slices < self.max_slices

    # Ray Train's getters (ray.train.get_context()), for code written against it.
    def get_world_rank(self) -> int:
        """This host's rank (= ``jax.process_index()``)."""
        return self.world_rank

    def get_world_size(self) -> int:
        """Hosts (workers) over all slices."""
        return self.world_size

    def get_local_rank(self) -> int:
        """Rank among workers on this node: always 0 (one worker per host)."""
        return self.local_rank

    def get_local_world_size(self) -> int:
        """Workers on this node: always 1."""
        return 1

    def get_node_rank(self) -> int:
        """This node's rank: the world rank (one worker per node)."""
        return self.world_rank

    def get_experiment_name(self) -> str:
        """The run's name."""
        return self.experiment_name

    def get_trial_name(self) -> str:
        """The run's name (one trial per run; Ray Train v2 deprecates this getter)."""
        return self.experiment_name

    def get_trial_id(self) -> str:
        """The id of this ``fit()`` call."""
        return self.run_id

    def get_trial_dir(self) -> str:
        """The run's directory on storage (``<storage_path>/<name>``)."""
        return self.run_path


_CURRENT: TrainContext | None = None


def current_context() -> TrainContext | None:
    """This process's :class:`TrainContext` while a training attempt runs in it, else ``None``.

    The public accessor for code that runs in gang processes but is not the
    training function itself (e.g. :mod:`rayslice.profiler`).
    """
    return _CURRENT


def _set_current(ctx: TrainContext | None) -> None:
    global _CURRENT
    _CURRENT = ctx
