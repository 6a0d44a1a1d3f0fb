"""JaxTrainer on the simulated cluster: training, checkpoints, chaos, errors, multi-slice."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

import rayslice
from rayslice.errors import GangError, Outcome
from rayslice.placement import PG_NAME_PREFIX
from rayslice.sim import SliceSpec
from rayslice.train import CheckpointConfig, FailureConfig, JaxTrainer, RunConfig, ScalingConfig, latest_complete_step

from . import train_loops
from .conftest import live_groups

pytestmark = [pytest.mark.ray, pytest.mark.slow]

V4 = ScalingConfig(topology="2x2x2", accelerator_type="TPU-V4", init_timeout_s=120)
V5P = ScalingConfig(topology="2x2x2", accelerator_type="TPU-V5P", init_timeout_s=120)


def _no_actors_left(timeout_s: float = 30.0):
    """Gang processes still alive once ``timeout_s`` has passed without them all gone (``[]``: none left).

    ``ray.kill`` returns before the GCS actor table says DEAD (the warm spares are killed last), so the
    table is read until it is empty or the deadline passes.
    """
    # The GCS actor table (the state API would need the dashboard).
    from ray._private.state import actors

    deadline = time.monotonic() + timeout_s
    while True:
        left = [a for a in actors().values() if a["State"] == "ALIVE" and "_HostProcess" in a.get("ActorClassName", "")]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.1)


def _restore_in_separate_process(checkpoint_dir: str) -> dict:
    # Plain Orbax, no rayslice, in its own process.
    code = textwrap.dedent(f"""
        import json, numpy as np, orbax.checkpoint as ocp
        import jax
        step = ocp.CheckpointManager({checkpoint_dir!r}).latest_step()
        path = f"{checkpoint_dir}/{{step}}/state"
        ckptr = ocp.PyTreeCheckpointer()
        tree = ckptr.metadata(path).item_metadata.tree
        as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
        out = ckptr.restore(path, args=ocp.args.PyTreeRestore(restore_args=as_numpy))
        leaves = jax.tree_util.tree_leaves_with_path(out)
        print(json.dumps({{"step": step, "leaves": {{jax.tree_util.keystr(k): np.asarray(v).tobytes().hex()
                                                     for k, v in leaves}}}}))
    """)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_trains_checkpoints_and_restores_with_plain_orbax(ray_cluster, tmp_path):
    cfg = {"rows": 160, "every": 4}
    result = JaxTrainer(
        train_loops.regression_loop,
        train_loop_config=cfg,
        scaling_config=V4,
        run_config=RunConfig(
            name="basic", storage_path=str(tmp_path), progress=False, checkpoint_config=CheckpointConfig(num_to_keep=2)
        ),
    ).fit()
    assert result.error is None, result.error
    losses = [m["loss"] for m in result.metrics_history]
    assert len(losses) == 20 and [m["step"] for m in result.metrics_history] == list(range(1, 21))
    assert losses[-1] < 0.5 * losses[0]  # it learns
    last = result.metrics
    assert (last["world_size"], last["process_count"], last["device_count"], last["local_device_count"]) == (2, 2, 8, 4)
    assert last["world_rank"] == 0 and last["worker_id"] == 0 and last["megascale_slices"] == ""
    # Every 4 steps, 2 kept: 16 and 20.
    ckdir = f"{result.path}/checkpoints"
    assert sorted(int(d) for d in os.listdir(ckdir) if d.isdigit()) == [16, 20]
    assert result.checkpoint.step == 20 == latest_complete_step(ckdir)
    meta = result.checkpoint.metadata()
    assert meta["step"] == 20 and meta["data_states"]["data"][1]["batches"] == 20
    restored = _restore_in_separate_process(ckdir)
    assert restored["step"] == 20 and any("params" in k for k in restored["leaves"])
    g = result.goodput
    assert g.steps == 20 and g.seconds["productive"] > 0 and g.seconds["compile"] > 0 and g.seconds["lost"] == 0
    assert abs(sum(g.seconds.values()) - g.wall_s) < 1e-6
    assert len(g.attempts) == 1 and g.attempts[0]["compile"] == g.seconds["compile"]
    c = g.compiles[0]  # JAX's own compile figures, inside the compile component; a fresh cache: misses, no hits
    assert c["xla_s"] > 0 and c["cache_misses"] > 0 and c["cache_hits"] == 0
    assert c["xla_s"] + c["trace_lower_s"] >= g.seconds["compile"] - 1e-9
    assert g.as_dict()["compiles"] == [c] and g.as_dict()["compile_xla_s"] == c["xla_s"]
    assert os.listdir(f"{result.path}/compile_cache")  # JAX's persistent cache, for the next attempt
    assert live_groups(PG_NAME_PREFIX) == [] and _no_actors_left() == []


@pytest.fixture(scope="module")
def chaos_slices(sim):
    """Two v5p 2x2x2 slices of their own: the chaos test breaks one."""
    names = [sim.add_slice(SliceSpec("TPU-V5P", "2x2x2", name=f"chaos-{i}")) for i in range(2)]
    yield names
    for n in names:
        alive = [h for h in sim.slices[n].hosts if h.alive]
        if alive:
            sim.preempt_slice(n)


def test_preemption_mid_run_gives_bitwise_identical_params(ray_cluster, chaos_slices, tmp_path):
    import ray

    # Ray Data input: 320 rows, split over 2 hosts, 8 rows per host per step = 20 steps.
    cfg = {"ray_data": True, "every": 4, "sleep_s": 0.25}
    datasets = {"train": ray.data.range(320).map_batches(train_loops.regression_rows)}
    plain = JaxTrainer(
        train_loops.regression_loop,
        train_loop_config=cfg,
        scaling_config=V5P,
        datasets=datasets,
        run_config=RunConfig(name="plain", storage_path=str(tmp_path), progress=False),
    ).fit()
    assert plain.error is None, plain.error

    from rayslice.train.checkpoint import checkpoints_dir, latest_complete_step, run_dir

    fired = []
    root = checkpoints_dir(run_dir(str(tmp_path), "chaos"))

    def preempt_at_step_6(report):
        # Not before step 4's checkpoint is complete: the first save (imports, compiles) can take longer
        # than a few steps on a loaded machine, and the test is about resuming from a checkpoint.
        if report["step"] >= 6 and not fired and (latest_complete_step(root) or 0) >= 4:
            busy = [s.name for s in rayslice.list_slices() if s.name in chaos_slices and s.state == "busy"]
            fired.append(busy[0])
            ray_cluster.preempt_host(busy[0], 1)

    trainer = JaxTrainer(
        train_loops.regression_loop,
        # Attempt 1 slows down after step 6 (sleep only: the same numbers), so that the kill the driver
        # fires on seeing step 6 lands long before the run's end on a loaded machine.
        train_loop_config={**cfg, "slow_after": 6, "slow_s": 0.6},
        scaling_config=V5P,
        datasets=datasets,
        run_config=RunConfig(
            name="chaos",
            storage_path=str(tmp_path),
            progress=False,
            failure_config=FailureConfig(max_preemptions=2),
            callbacks=[preempt_at_step_6],
        ),
    )
    chaos = trainer.fit()
    assert chaos.error is None, chaos.error
    assert "ray.data" in trainer._warm.imports  # spare processes can unpickle their shards at once
    assert fired and chaos.preemptions == 1 and chaos.attempts == 2 and chaos.failures == 0
    assert chaos.metrics["restored_from"] in (4, 8, 12)  # resumed from a checkpoint, on the other slice
    steps = [h["step"] for h in chaos.metrics_history]
    recomputed = len(steps) - len(set(steps))  # steps reported by both attempts
    g = chaos.goodput  # the time after the last report is noticing the loss (detection) or lost work
    assert g.lost_steps == recomputed and g.seconds["lost"] + g.seconds["detection"] > 0
    assert sorted(set(steps)) == list(range(1, 21))
    a = _restore_in_separate_process(f"{plain.path}/checkpoints")
    b = _restore_in_separate_process(f"{chaos.path}/checkpoints")
    assert a["step"] == b["step"] == 20
    assert a["leaves"] == b["leaves"]  # bitwise identical params and optimizer state
    assert live_groups(PG_NAME_PREFIX) == [] and _no_actors_left() == []


def test_user_exception_reaches_result_without_retry(ray_cluster, tmp_path):
    result = JaxTrainer(
        train_loops.failing_loop,
        train_loop_config={},
        scaling_config=V4,
        run_config=RunConfig(
            name="fails", storage_path=str(tmp_path), progress=False, failure_config=FailureConfig(max_failures=0)
        ),
    ).fit()
    assert isinstance(result.error, ValueError)
    assert "loss is NaN at step 2 (injected)" in str(result.error)
    assert "failing_loop" in str(result.error)  # the worker's traceback
    assert (result.attempts, result.failures, result.preemptions) == (1, 1, 0)
    assert live_groups(PG_NAME_PREFIX) == [] and _no_actors_left() == []


def test_user_errors_retry_within_budget(ray_cluster, tmp_path):
    result = JaxTrainer(
        train_loops.failing_loop,
        train_loop_config={"rank": 0},
        scaling_config=V4,
        run_config=RunConfig(
            name="retries", storage_path=str(tmp_path), progress=False, failure_config=FailureConfig(max_failures=1)
        ),
    ).fit()
    assert isinstance(result.error, ValueError) and (result.attempts, result.failures) == (2, 2)


def test_crash_mid_save_keeps_the_previous_checkpoint(ray_cluster, tmp_path):
    result = JaxTrainer(
        train_loops.crash_mid_save_loop,
        train_loop_config={},
        scaling_config=V4,
        run_config=RunConfig(
            name="crash", storage_path=str(tmp_path), progress=False, failure_config=FailureConfig(max_preemptions=1)
        ),
    ).fit()
    assert result.error is None, result.error
    assert result.preemptions == 1
    assert result.metrics["restored_from"] == 1 and result.metrics["sum"] == 1.0  # step 1's values, intact


def test_two_slices_one_mesh(ray_cluster, tmp_path):
    # A reservation that cannot complete fails within the test's timeout, saying why (the slices' states).
    sc = ScalingConfig(
        topology="2x2x2", accelerator_type="TPU-V4", num_slices=2, init_timeout_s=120, reservation_timeout_s=120
    )
    result = JaxTrainer(
        train_loops.regression_loop,
        train_loop_config={"rows": 32, "every": 100},
        scaling_config=sc,
        run_config=RunConfig(name="multislice", storage_path=str(tmp_path), progress=False),
    ).fit()
    assert result.error is None, result.error
    m = result.metrics
    assert (m["world_size"], m["process_count"], m["device_count"], m["num_slices"]) == (4, 4, 16, 2)
    assert m["megascale_slices"] == "2"


def test_gang_that_cannot_form_fails_instead_of_hanging(ray_cluster, tmp_path):
    sc = ScalingConfig(topology="2x2x2", accelerator_type="TPU-V4", init_timeout_s=0.001)
    result = JaxTrainer(
        train_loops.failing_loop,
        scaling_config=sc,
        run_config=RunConfig(name="noinit", storage_path=str(tmp_path), progress=False),
    ).fit()
    assert isinstance(result.error, GangError) and result.error.outcome is Outcome.TIMEOUT
    assert live_groups(PG_NAME_PREFIX) == []


_DRIVER = textwrap.dedent("""
    import sys, json, os
    sys.path.insert(0, {root!r})
    import ray
    ray.init(address={address!r}, log_to_driver=False)
    from tests import train_loops
    from rayslice.train import JaxTrainer, RunConfig, ScalingConfig
    r = JaxTrainer(train_loops.regression_loop, train_loop_config={{"rows": 16, "every": 1}},
                   scaling_config=ScalingConfig(topology="2x2x2", accelerator_type="TPU-V4"),
                   run_config=RunConfig(name="driver", storage_path={path!r}, progress=False)).fit()
    print(json.dumps({{"error": str(r.error) if r.error else None, "jax": "jax" in sys.modules,
                      "steps": len(r.metrics_history)}}))
""")


def test_driver_never_imports_jax(ray_cluster, tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = _DRIVER.format(root=root, address=ray_cluster.address, path=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    info = json.loads(out.stdout.strip().splitlines()[-1])
    assert info == {"error": None, "jax": False, "steps": 2}
