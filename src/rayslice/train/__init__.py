"""Distributed JAX training on whole slices, in Ray Train's vocabulary.

Ray Train's names work as they do in ``ray.train`` / ``ray.train.v2.jax``:
``JaxTrainer``, ``ScalingConfig(num_workers=..., use_tpu=True, topology=...,
accelerator_type=...)``, ``RunConfig``, ``CheckpointConfig``,
``FailureConfig``, ``Checkpoint.from_directory``, ``report``,
``get_context``, ``get_checkpoint``, ``get_dataset_shard``, ``UserCallback``.

Example:
    >>> from rayslice.train import JaxTrainer, ScalingConfig, RunConfig
    >>> ScalingConfig(topology="2x2x2", accelerator_type="TPU-V4").num_workers
    2
"""

from rayslice.train.checkpoint import Checkpoint, latest_complete_step
from rayslice.train.config import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig, UserCallback
from rayslice.train.context import TrainContext, current_context
from rayslice.train.controller import JaxTrainer, Result, TrainRunContext
from rayslice.train.elastic import ResizeEvent
from rayslice.train.goodput import AttemptEnd, Goodput
from rayslice.train.ramtier import RamCheckpoint, RestoreChoice
from rayslice.train.worker import (
    PreemptionStop,
    get_checkpoint,
    get_context,
    get_dataset_shard,
    report,
    save_requested,
)

__all__ = [
    "AttemptEnd",
    "Checkpoint",
    "CheckpointConfig",
    "FailureConfig",
    "Goodput",
    "JaxTrainer",
    "Result",
    "RunConfig",
    "ScalingConfig",
    "TrainContext",
    "TrainRunContext",
    "UserCallback",
    "current_context",
    "get_checkpoint",
    "get_context",
    "get_dataset_shard",
    "PreemptionStop",
    "ResizeEvent",
    "RamCheckpoint",
    "RestoreChoice",
    "latest_complete_step",
    "report",
    "save_requested",
]
