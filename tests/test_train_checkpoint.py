"""Checkpoints without JAX or Ray: the layout, committed steps only, directory checkpoints as in Ray."""

from __future__ import annotations

import os

import pytest

from rayslice.errors import InvalidArgument
from rayslice.train.checkpoint import (
    Checkpoint,
    checkpoint_steps,
    checkpoints_dir,
    commit_pending,
    discard_pending,
    latest_complete_step,
    pending_dir,
    prune_directories,
    run_dir,
    split_data_iterators,
    step_dir,
    step_of,
    write_pending,
)


def test_only_committed_step_directories_count(tmp_path):
    for name in ("4", "8", "12.orbax-checkpoint-tmp-1764500000", "notes"):
        (tmp_path / name).mkdir()
    (tmp_path / "16").write_text("a file, not a step")
    assert checkpoint_steps(str(tmp_path)) == [4, 8]
    assert latest_complete_step(str(tmp_path)) == 8
    assert checkpoint_steps(str(tmp_path / "missing")) == [] and latest_complete_step(str(tmp_path / "missing")) is None


def test_data_state_for_a_rank_the_checkpoint_does_not_have(tmp_path):
    meta = tmp_path / "8" / "meta"
    meta.mkdir(parents=True)
    meta.joinpath("metadata").write_text('{"step": 8, "data_states": {"data": [{"batches": 8}, {"batches": 8}]}}')
    ckpt = Checkpoint(str(tmp_path / "8"), 8)
    assert ckpt.data_state("data", rank=1) == {"batches": 8}
    assert ckpt.data_state("other", rank=0) is None
    with pytest.raises(ValueError, match="holds data states for 2 host"):
        ckpt.data_state("data", rank=2)


def test_data_iterators_are_split_from_arrays():
    class It:
        def state(self):
            return {"batches": 3}

    arrays, states = split_data_iterators({"params": [1.0], "data": It()})
    assert arrays == {"params": [1.0]} and states == {"data": {"batches": 3}}


def test_one_module_owns_the_layout():
    root = checkpoints_dir(run_dir("file:///data/results/", "run-a"))
    assert root == "/data/results/run-a/checkpoints"
    assert step_dir(root, 12) == "/data/results/run-a/checkpoints/12" and step_of(step_dir(root, 12)) == 12
    assert step_of(pending_dir(root, 12, 1)) is None  # a step being written is not a step
    assert run_dir("gs://bucket/x", "r") == "gs://bucket/x/r"
    with pytest.raises(InvalidArgument, match="step=-1"):
        step_dir(root, -1)


def _user_dir(tmp_path, name, files):
    d = tmp_path / name
    d.mkdir()
    for rel, text in files.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_text(text)
    return str(d)


def test_directory_checkpoints_are_merged_committed_and_read_back_like_rays(tmp_path):
    root = str(tmp_path / "checkpoints")
    # Two hosts add their files to step 3 of attempt 1; nothing is complete before the driver commits.
    write_pending(root, 3, 1, _user_dir(tmp_path, "host0", {"model.json": "{}", "opt/state.txt": "0"}))
    write_pending(root, 3, 1, _user_dir(tmp_path, "host1", {"shard-1.txt": "1"}))
    assert checkpoint_steps(root) == []
    ckpt = commit_pending(root, 3, 1, {"step": 3, "metrics": {"loss": [0.5, 0.25]}})
    assert checkpoint_steps(root) == [3] and ckpt.step == 3 and ckpt.kind == "directory"
    with ckpt.as_directory() as d:  # local: in place, no copy
        assert d == ckpt.path and sorted(os.listdir(d)) == [".rayslice", "model.json", "opt", "shard-1.txt"]
    copy = ckpt.to_directory(str(tmp_path / "copy"))
    with open(os.path.join(copy, "opt", "state.txt")) as f:
        assert f.read() == "0"
    assert os.path.isdir(ckpt.to_directory())  # a fresh temporary directory
    assert ckpt.metadata()["metrics"] == {"loss": [0.5, 0.25]}
    ckpt.set_metadata({"epoch": 1})
    ckpt.update_metadata({"lr": 0.1})
    assert ckpt.get_metadata() == {"epoch": 1, "lr": 0.1}
    assert Checkpoint.from_directory(str(tmp_path / "host1")).get_metadata() == {}
    with pytest.raises(ValueError, match="directory checkpoint .* as_directory"):
        ckpt.restore()


def test_uncommitted_directory_checkpoints_are_discarded(tmp_path):
    root = str(tmp_path / "checkpoints")
    write_pending(root, 5, 2, _user_dir(tmp_path, "src", {"a.txt": "a"}))
    discard_pending(root)
    assert os.listdir(root) == [] and checkpoint_steps(root) == []


def test_directory_retention_keeps_the_best_and_the_newest(tmp_path):
    root = str(tmp_path / "checkpoints")
    src = _user_dir(tmp_path, "src", {"a.txt": "a"})
    for step, loss in [(1, 0.9), (2, 0.1), (3, 0.5), (4, 0.7)]:
        write_pending(root, step, 1, src)
        commit_pending(root, step, 1, {"step": step, "metrics": {"loss": loss}})
    assert prune_directories(root, 2, "loss", "min") == [1]  # best two (2, 3) plus the newest (4)
    assert checkpoint_steps(root) == [2, 3, 4]
    assert prune_directories(root, 1) == [2, 3] and checkpoint_steps(root) == [4]
    assert prune_directories(root, None) == []


def test_a_checkpoint_path_is_checked():
    assert Checkpoint("/r/checkpoints/7").step == 7 and Checkpoint("/r/checkpoints/7").directory == "/r/checkpoints"
    with pytest.raises(InvalidArgument, match="path="):
        Checkpoint(3)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="path="):
        Checkpoint.from_directory("")


def test_data_state_outside_a_worker_needs_a_rank(tmp_path):
    meta = tmp_path / "8" / "meta"
    meta.mkdir(parents=True)
    meta.joinpath("metadata").write_text('{"step": 8, "data_states": {"data": [{"batches": 8}]}}')
    with pytest.raises(InvalidArgument, match="rank=None .* outside a training worker"):
        Checkpoint(str(tmp_path / "8")).data_state("data")
