"""Checkpoint discovery without JAX: only committed steps count."""

from __future__ import annotations

import pytest

from rayslice.train.checkpoint import Checkpoint, checkpoint_steps, latest_complete_step, split_data_iterators


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
