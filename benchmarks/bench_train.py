"""Trainer benchmark: rayslice JaxTrainer vs Ray 2.60's ray.train.v2.jax.JaxTrainer.

Same simulated cluster, same run, same tiny loop (a jitted step, a report per
step). Ray's trainer is run with ``ScalingConfig(use_tpu=True,
topology="2x2x2", accelerator_type="TPU-V4", num_workers=2,
resources_per_worker={"TPU": 4})``: on the simulator every host's environment
carries ``JAX_PLATFORMS=cpu``, which Ray's JAX backend honours, so with
``use_tpu=True`` it calls ``jax.distributed.initialize`` on CPU (gloo).
``RAY_TRAIN_V2_ENABLED=1`` selects Ray Train v2.

Measured: fit() -> first completed step (the loop records wall-clock time of
its first step; same machine, same clock), total fit time, the per-step
overhead of the trainer (report() each step vs the bare loop, in the same
gang), and recovery (host lost -> next step completed).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from typing import Any


def _ship_by_value() -> None:
    # Hosts cannot import benchmarks/ or tests/: send these functions by value.
    from ray import cloudpickle

    sys.path.insert(0, __file__.rsplit("/", 2)[0])
    from tests import train_loops

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    cloudpickle.register_pickle_by_value(train_loops)


GOAL_RATIO = 0.5
GOAL_OVERHEAD = 0.03
GOAL_RECOVERY_S = 10.0


def tiny_loop(config: dict) -> None:
    import time as _t

    import jax
    import jax.numpy as jnp

    x = jnp.ones((64, 64))
    f = jax.jit(lambda a: (a @ a).sum())
    for i in range(config["steps"]):
        v = float(f(x + i))
        metrics = {"v": v, "t": _t.time(), "step": i}
        if i == 0:  # the same record for both trainers: when the first step completed
            with open(f"{config['marks']}/first-{jax.process_index()}", "w") as fh:
                fh.write(str(metrics["t"]))
        if config["ray"]:
            import ray.train

            ray.train.report(metrics)
        else:
            from rayslice.train import report

            report(metrics)


def _first_step(marks: str) -> float:
    import os

    return min(float(open(os.path.join(marks, f)).read()) for f in os.listdir(marks))


def _ours(steps: int, storage: str) -> tuple[float, float]:
    from rayslice.train import JaxTrainer, RunConfig, ScalingConfig

    marks = tempfile.mkdtemp(dir=storage)
    t0 = time.time()
    r = JaxTrainer(
        tiny_loop,
        train_loop_config={"steps": steps, "ray": False, "marks": marks},
        scaling_config=ScalingConfig(topology="2x2x2", accelerator_type="TPU-V4"),
        run_config=RunConfig(name=f"bench-{time.time_ns()}", storage_path=storage, progress=False),
    ).fit()
    total = time.time() - t0
    assert r.error is None, r.error
    return _first_step(marks) - t0, total


def _ray(steps: int, storage: str) -> tuple[float, float]:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.v2.jax import JaxTrainer

    marks = tempfile.mkdtemp(dir=storage)
    t0 = time.time()
    trainer = JaxTrainer(
        tiny_loop,
        train_loop_config={"steps": steps, "ray": True, "marks": marks},
        scaling_config=ScalingConfig(
            use_tpu=True, num_workers=2, topology="2x2x2", accelerator_type="TPU-V4", resources_per_worker={"TPU": 4}
        ),
        run_config=RunConfig(name=f"raybench-{time.time_ns()}", storage_path=storage),
    )
    r = trainer.fit()
    total = time.time() - t0
    assert r.error is None, r.error
    return _first_step(marks) - t0, total


def compare(rounds: int = 3, steps: int = 5) -> dict[str, Any]:
    _ship_by_value()
    with tempfile.TemporaryDirectory(prefix="rs-bench-") as storage:
        _ours(steps, storage)  # warm-up both (worker processes, imports)
        _ray(steps, storage)
        ours, theirs = [], []
        for _ in range(rounds):
            ours.append(_ours(steps, storage))
            theirs.append(_ray(steps, storage))
    f_ours, t_ours = statistics.median(o[0] for o in ours), statistics.median(o[1] for o in ours)
    f_ray, t_ray = statistics.median(o[0] for o in theirs), statistics.median(o[1] for o in theirs)
    return {
        "rounds": rounds,
        "first_step_s": {"rayslice": f_ours, "ray": f_ray},
        "fit_s": {"rayslice": t_ours, "ray": t_ray},
        "first_ratio": f_ours / f_ray,
        "fit_ratio": t_ours / t_ray,
    }


def overhead(steps: int = 300) -> dict[str, float]:
    from rayslice.train import JaxTrainer, RunConfig, ScalingConfig

    _ship_by_value()
    from tests import train_loops  # the same loop the tests use

    with tempfile.TemporaryDirectory(prefix="rs-bench-") as storage:
        r = JaxTrainer(
            train_loops.overhead_loop,
            train_loop_config={"steps": steps},
            scaling_config=ScalingConfig(topology="2x2x2", accelerator_type="TPU-V4"),
            run_config=RunConfig(name=f"overhead-{time.time_ns()}", storage_path=storage, progress=False),
        ).fit()
    assert r.error is None, r.error
    m = r.metrics
    return {
        "steps": steps,
        "bare_ms": 1000 * m["bare_s"] / steps,
        "reported_ms": 1000 * m["reported_s"] / steps,
        "overhead": m["overhead"],
        "report_us": m["report_us"],
    }


def _one_preemption_run(name: str, accelerator_type: str, *, every: int, chaos: Any) -> Any:
    """A 160-row regression run on a 2x2x2 slice whose ``chaos`` callback preempts once; checks it recovered."""
    from tests import train_loops

    from rayslice.train import FailureConfig, JaxTrainer, RunConfig, ScalingConfig

    with tempfile.TemporaryDirectory(prefix="rs-bench-") as storage:
        r = JaxTrainer(
            train_loops.regression_loop,
            train_loop_config={"rows": 160, "every": every, "sleep_s": 0.1},
            scaling_config=ScalingConfig(topology="2x2x2", accelerator_type=accelerator_type),
            run_config=RunConfig(
                name=f"{name}-{time.time_ns()}",
                storage_path=storage,
                progress=False,
                failure_config=FailureConfig(max_preemptions=1),
                callbacks=[chaos],
            ),
        ).fit()
    assert r.error is None and r.preemptions == 1, r.error
    return r


def recovery(sim: Any) -> dict[str, float]:
    """Preempts a host mid-run; measures host lost -> next step completed (driver clock)."""
    import rayslice

    _ship_by_value()

    marks: dict[str, float] = {}

    def chaos(report: dict) -> None:
        if report["step"] >= 4 and "lost" not in marks:
            busy = [s.name for s in rayslice.list_slices() if s.state == "busy"][0]
            marks["lost"] = time.time()
            sim.preempt_host(busy, 1, wait=False)  # kill only; the trainer must notice by itself
        elif report["attempt"] == 2 and "next" not in marks:
            marks["next"] = time.time()

    r = _one_preemption_run("recovery", "TPU-V4", every=2, chaos=chaos)
    return {"recovery_s": marks["next"] - marks["lost"], "lost_s": r.goodput.seconds["lost"]}


GOAL_NOTICE_LOST_STEPS = 0


def notice(sim: Any, grace_s: float = 20.0) -> dict[str, Any]:
    """A preemption notice with ``grace_s`` (>= one step + one save) mid-run: lost steps, measured (goal 0)."""
    import rayslice

    _ship_by_value()

    from rayslice.sim import SliceSpec

    # Slices of its own (a shape nothing else uses): the notice ends one host of one of them.
    own = [sim.add_slice(SliceSpec("TPU-V5P", "2x2x2", name=f"bench-notice-{i}")) for i in range(2)]
    fired: list[str] = []

    def chaos(report: dict) -> None:
        if report["step"] >= 4 and not fired:
            busy = [s.name for s in rayslice.list_slices() if s.state == "busy" and s.name in own][0]
            fired.append(busy)
            sim.notify_preemption(busy, 1, grace_s=grace_s)  # SIGTERM now, the host dies after grace_s

    r = _one_preemption_run("notice", "TPU-V5P", every=100, chaos=chaos)
    end = r.goodput.endings[0]
    steps = [h["step"] for h in r.metrics_history]
    return {
        "lost_steps": r.goodput.lost_steps,
        "recomputed": len(steps) - len(set(steps)),
        "reason": end.reason,
        "save_step": end.step,
        "emergency_save_s": end.emergency_save_s,
        "grace_s": grace_s,
    }


def notice_row(n: dict[str, Any]) -> tuple[str, ...]:
    """The benchmark table row of :func:`notice`: (figure, rayslice, peer, ratio, goal, met)."""
    ok = n["lost_steps"] <= GOAL_NOTICE_LOST_STEPS and n["recomputed"] == 0 and n["reason"] == "notice"
    return (
        f"preemption with a notice ({n['grace_s']:g} s grace) -> lost steps",
        f"{n['lost_steps']} (saved step {n['save_step']} in {n['emergency_save_s'] or 0:.2f} s)",
        "-",
        "-",
        f"{GOAL_NOTICE_LOST_STEPS}",
        "[green]yes[/green]" if ok else "[red]NO[/red]",
    )
