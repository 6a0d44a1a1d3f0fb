"""Distributed JAX training on whole slices, in Ray Train's vocabulary.

Example:
    >>> from rayslice.train import JaxTrainer, ScalingConfig, RunConfig
    >>> ScalingConfig(topology="2x2x2", accelerator_type="TPU-V4").num_workers
    2
"""

from rayslice.train.checkpoint import Checkpoint, latest_complete_step
from rayslice.train.config import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from rayslice.train.controller import JaxTrainer, Result
from rayslice.train.goodput import Goodput
from rayslice.train.worker import TrainContext, get_checkpoint, get_context, get_dataset_shard, report

__all__ = [
    "Checkpoint",
    "CheckpointConfig",
    "FailureConfig",
    "Goodput",
    "JaxTrainer",
    "Result",
    "RunConfig",
    "ScalingConfig",
    "TrainContext",
    "get_checkpoint",
    "get_context",
    "get_dataset_shard",
    "latest_complete_step",
    "report",
]
