"""JaxTrainer used the way Ray Train's documentation and tests use ray.train.v2.jax (on the simulator).

Ray's names and call forms: ``ScalingConfig(num_workers=..., use_tpu=True,
topology=..., accelerator_type=...)``, ``RunConfig(storage_path=...)`` with
no name, ``report(metrics, checkpoint=Checkpoint.from_directory(tmp))`` from
rank 0 only, ``get_checkpoint().as_directory()``, ``get_context()``
getters, a ``UserCallback`` with ``after_report``; plus a reservation the
caller already holds (``tpu_slice=``).
"""

from __future__ import annotations

import json
import os

import pytest

import rayslice
from rayslice.errors import InvalidArgument
from rayslice.placement import PG_NAME_PREFIX
from rayslice.train import (
    Checkpoint,
    CheckpointConfig,
    JaxTrainer,
    RunConfig,
    ScalingConfig,
    TrainRunContext,
    UserCallback,
)

from . import train_loops
from .conftest import live_groups

pytestmark = [pytest.mark.ray, pytest.mark.slow]


class Recorder(UserCallback):
    def __init__(self):
        self.reports = []

    def after_report(self, run_context, metrics, checkpoint):
        epoch = None
        if checkpoint is not None:
            with checkpoint.as_directory() as d, open(os.path.join(d, "state.json")) as f:
                epoch = json.load(f)["epoch"]
        self.reports.append((run_context, metrics, checkpoint, epoch))


def test_a_ray_train_loop_runs_with_fresh_runs_and_explicit_resume(ray_cluster, tmp_path):
    recorder = Recorder()
    trainer = JaxTrainer(
        train_loops.ray_style_loop,
        train_loop_config={"epochs": 3},
        scaling_config=ScalingConfig(num_workers=2, use_tpu=True, topology="2x2x2", accelerator_type="TPU-V4"),
        run_config=RunConfig(storage_path=str(tmp_path), callbacks=[recorder], progress=False),
    )
    first = trainer.fit()
    assert first.error is None, first.error
    assert first.name.startswith("rayslice_run-") and first.path == str(tmp_path / first.name)
    m = first.metrics
    assert m["losses"] == [1.0 / 3, 0.5] and m["epoch"] == 3  # a list metric stays a list
    assert m["ranks"] == [0, 2, 0, 1, 0] and m["names"] == [first.name, first.name]
    assert first.return_value == {"final_epoch": 3}
    assert list(first.metrics_dataframe["epoch"]) == [1, 2, 3]
    # after_report: every worker's metrics, rank order, and the checkpoint persisted in run storage.
    assert [r[3] for r in recorder.reports] == [1, 2, 3]
    context, per_worker, checkpoint, _ = recorder.reports[-1]
    assert isinstance(context, TrainRunContext) and context.name == first.name
    assert [w["ranks"][0] for w in per_worker] == [0, 1] and isinstance(checkpoint, Checkpoint)
    assert checkpoint.path.startswith(first.path)  # copied out of the worker's temporary directory
    assert first.checkpoint.step == 3 and len(first.best_checkpoints) == 3
    with first.checkpoint.as_directory() as d, open(os.path.join(d, "state.json")) as f:
        assert json.load(f) == {"epoch": 3}

    second = trainer.fit()  # same trainer, same storage, no name: a new run, not a silent resume
    assert second.error is None and second.name != first.name
    assert second.metrics["resumed_from"] == 0

    resumed = JaxTrainer(  # resuming is explicit: the earlier run's name
        train_loops.ray_style_loop,
        train_loop_config={"epochs": 1},
        scaling_config=ScalingConfig(num_workers=2, use_tpu=True, topology="2x2x2", accelerator_type="TPU-V4"),
        run_config=RunConfig(name=first.name, storage_path=str(tmp_path), progress=False),
    ).fit()
    assert resumed.error is None and resumed.metrics["resumed_from"] == 3 and resumed.metrics["epoch"] == 4
    assert resumed.path == first.path


def test_trains_on_a_held_slice_with_host_local_checkpoint_leaves(ray_cluster, tmp_path):
    spg = rayslice.slice_placement_group("2x2x2", "TPU-V4", timeout_s=60, progress=False)
    try:
        with pytest.raises(InvalidArgument, match="tpu_slice=.* expected a reservation of 2 x v4 2x2x2"):
            JaxTrainer(
                train_loops.host_local_leaves_loop,
                tpu_slice=spg,
                scaling_config=ScalingConfig(topology="2x2x2", accelerator_type="TPU-V4", num_slices=2),
            )
        result = JaxTrainer(
            train_loops.host_local_leaves_loop,
            tpu_slice=spg,  # no scaling_config: the held slice says it all
            run_config=RunConfig(
                storage_path=str(tmp_path),
                progress=False,
                checkpoint_config=CheckpointConfig(async_save=False),
                worker_runtime_env={"env_vars": {"RAYSLICE_TEST_ENV": "from-runtime-env"}},
            ),
        ).fit()
        assert result.error is None, result.error
        m = result.metrics
        assert (m["w"], m["n"], m["lr"], m["count"]) == ([0.0, 1.0, 2.0, 3.0], [0, 1, 2], 0.5, 7)
        assert "leaf ['params']['tag']" in m["error"] and "Checkpoint.from_directory" in m["error"]
        assert m["env"] == "from-runtime-env"
        assert result.metrics_history[0]["processes"] == 2  # multi-host: the case Orbax refuses host-local arrays
        # The trainer neither reserved nor released: the caller's slice is still held.
        assert not spg.released and live_groups(PG_NAME_PREFIX)
    finally:
        spg.release()
