"""What ``JaxTrainer.fit()`` returns (:class:`Result`) and what callbacks get (:class:`TrainRunContext`).

Example:
    >>> import dataclasses
    >>> "restores" in {f.name for f in dataclasses.fields(Result)}
    True
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rayslice._validate import fail
from rayslice.train.checkpoint import Checkpoint
from rayslice.train.config import RunConfig, ScalingConfig
from rayslice.train.elastic import ResizeEvent
from rayslice.train.goodput import Goodput
from rayslice.train.ramtier import RestoreChoice

__all__ = ["Result", "TrainRunContext"]


@dataclasses.dataclass(frozen=True)
class TrainRunContext:
    """What ``UserCallback`` hooks get as ``run_context`` (Ray Train's name).

    Attributes:
        run_id: Unique per ``fit()`` call.
        name: The run's name (fresh per ``fit()`` unless ``RunConfig.name`` is set).
        path: ``<storage_path>/<name>``.
        run_config: The run's :class:`RunConfig`.
        scaling_config: The run's :class:`ScalingConfig`.
        train_loop_config: What the training function gets.
    """

    run_id: str
    name: str
    path: str
    run_config: RunConfig
    scaling_config: ScalingConfig
    train_loop_config: Any

    def get_run_config(self) -> RunConfig:
        return self.run_config


@dataclasses.dataclass
class Result:
    """What ``fit()`` returns (Ray Train's attributes, plus rayslice's).

    Attributes:
        metrics: Rank 0's last reported metrics (None if nothing was reported).
        metrics_history: Rank 0's reports in order, ``[{"step": ..., **metrics}]``.
        checkpoint: The latest complete checkpoint, or None.
        path: ``<storage_path>/<name>``.
        error: The error that ended the run (your exception, a reservation
            or gang error), or None. ``fit()`` returns it rather than raising.
        goodput: Where the wall time went.
        attempts, preemptions, failures: Attempt counts.
        name: The run's name (pass it as ``RunConfig(name=...)`` to resume).
        return_value: What the training function returned on rank 0.
        best_checkpoints: ``[(Checkpoint, metrics)]`` for every complete
            checkpoint on storage, oldest first.
        restores: Where each attempt resumed from, and why: a
            :class:`~rayslice.train.ramtier.RestoreChoice` per restart (and
            per first attempt that resumed a named run), with the tier
            (``"ram"``, ``"storage"``, ``"none"``), the step, the reason and
            the seconds rank 0 spent restoring.
        ram_tier_bytes: Peak bytes the RAM tier held on one node (its own
            host's shards plus its buddy's replica, up to two steps each);
            0 when ``CheckpointConfig.ram_every_steps`` is None.
    """

    metrics: dict[str, Any] | None
    metrics_history: list[dict[str, Any]]
    checkpoint: Checkpoint | None
    path: str
    error: BaseException | None
    goodput: Goodput
    attempts: int
    preemptions: int
    failures: int
    name: str = ""
    return_value: Any = None
    best_checkpoints: list[tuple[Checkpoint, dict[str, Any]]] = dataclasses.field(default_factory=list)
    resizes: list[ResizeEvent] = dataclasses.field(default_factory=list)
    restores: list[RestoreChoice] = dataclasses.field(default_factory=list)
    ram_tier_bytes: int = 0

    @property
    def metrics_dataframe(self) -> Any:
        """``metrics_history`` as a pandas DataFrame, one row per report."""
        import pandas as pd

        return pd.DataFrame(self.metrics_history)

    @property
    def filesystem(self) -> Any:
        """A ``pyarrow.fs.FileSystem`` for :attr:`path` (as Ray's ``Result.filesystem``)."""
        import pyarrow.fs

        return pyarrow.fs.FileSystem.from_uri(self.path)[0]

    def get_best_checkpoint(self, metric: str, mode: str) -> Checkpoint | None:
        """The checkpoint whose ``metric`` is highest (``mode="max"``) or lowest (``"min"``)."""
        if mode not in ("max", "min"):
            raise fail("mode", mode, "'max' or 'min'")
        scored = [(m[metric], c) for c, m in self.best_checkpoints if isinstance(m.get(metric), int | float)]
        if not scored:
            return None
        pick = max if mode == "max" else min
        return pick(scored, key=lambda t: t[0])[1]
