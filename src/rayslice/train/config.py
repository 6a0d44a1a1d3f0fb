"""Configuration for :class:`~rayslice.train.JaxTrainer` (Ray Train's vocabulary).

Every config is a frozen dataclass validated on construction: a bad value
raises ``ValueError`` naming it and saying what is valid.

Example:
    >>> ScalingConfig(topology="2x2x2", accelerator_type="TPU-V4").topology_info.num_hosts
    2
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rayslice.topology import Topology


@dataclasses.dataclass(frozen=True)
class ScalingConfig:
    """Where to train: one worker per host of ``num_slices`` whole slices.

    Args:
        topology: Slice shape, e.g. "2x2x2".
        accelerator_type: Generation, e.g. "TPU-V4".
        use_tpu: Must be True: rayslice trains on slices (kept for Ray Train parity).
        num_slices: Slices, all reserved together (multi-slice: one global mesh).
        chips_per_host: Host layout for v5e/v6e "2x4".
        resources_per_host: Extra resources per host bundle (e.g. ``{"CPU": 1}``).
        reservation_timeout_s: Longest wait for free slices, per attempt.
        init_timeout_s: Deadline for all processes to start and form the JAX mesh.
    """

    topology: str
    accelerator_type: str
    use_tpu: bool = True
    num_slices: int = 1
    chips_per_host: int | None = None
    resources_per_host: Mapping[str, float] | None = None
    reservation_timeout_s: float = 600.0
    init_timeout_s: float = 180.0

    def __post_init__(self) -> None:
        if not self.use_tpu:
            raise ValueError("use_tpu=False is not supported: rayslice trains on whole slices (use_tpu=True)")
        if self.num_slices < 1:
            raise ValueError(f"num_slices={self.num_slices} must be >= 1")
        for name in ("reservation_timeout_s", "init_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0")
        self.topology_info  # noqa: B018 - validates topology, type and chips_per_host

    @property
    def topology_info(self) -> Topology:
        return Topology.parse(self.accelerator_type, self.topology, chips_per_host=self.chips_per_host)

    @property
    def num_workers(self) -> int:
        """One worker per host of every slice."""
        return self.topology_info.num_hosts * self.num_slices


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Checkpoint retention.

    Args:
        num_to_keep: Newest complete checkpoints kept on storage (None: all).
        async_save: Save in the background: the next step does not wait for storage.
    """

    num_to_keep: int | None = None
    async_save: bool = True

    def __post_init__(self) -> None:
        if self.num_to_keep is not None and self.num_to_keep < 1:
            raise ValueError(f"num_to_keep={self.num_to_keep} must be >= 1 or None")


@dataclasses.dataclass(frozen=True)
class FailureConfig:
    """Separate budgets for lost hosts and for errors in user code.

    Args:
        max_preemptions: Restarts allowed after a host/slice is lost (-1: unlimited).
        max_failures: Restarts allowed after an error in user code (0: none).
    """

    max_preemptions: int = 10
    max_failures: int = 0

    def __post_init__(self) -> None:
        for name in ("max_preemptions", "max_failures"):
            if getattr(self, name) < -1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0, or -1 for unlimited")


_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Where a run keeps its checkpoints, and how it handles failures.

    Args:
        name: Run name (a directory under ``storage_path``).
        storage_path: Storage every host can reach (on real slices a shared or
            cloud path; on the simulator a local directory).
        checkpoint_config: Checkpoint retention.
        failure_config: Restart budgets.
        progress: Show a live progress line in the driver.
        callbacks: Called in the driver with each report from rank 0
            (``{"step", "metrics", "attempt"}``), e.g. to log or inject faults.
    """

    name: str = "rayslice-run"
    storage_path: str = "~/rayslice_results"
    checkpoint_config: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    failure_config: FailureConfig = dataclasses.field(default_factory=FailureConfig)
    progress: bool = True
    callbacks: Sequence[Callable[[dict[str, Any]], None]] = ()

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(f"run name {self.name!r} is not valid; use letters, digits, '_', '-', '.'")
        if "://" in self.storage_path and not self.storage_path.startswith(("gs://", "s3://", "file://")):
            raise ValueError(f"storage_path {self.storage_path!r}: supported schemes are gs://, s3://, file://")

    @property
    def run_path(self) -> str:
        """``storage_path/name``, with ``~`` expanded for local paths."""
        base = self.storage_path
        if base.startswith("file://"):
            base = base[len("file://"):]
        if "://" not in base:
            base = os.path.abspath(os.path.expanduser(base))
        return f"{base.rstrip('/')}/{self.name}"

    @property
    def checkpoint_path(self) -> str:
        return f"{self.run_path}/checkpoints"
