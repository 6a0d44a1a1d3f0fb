"""Elastic multi-slice training benchmark (issue 15), on a simulated cluster of its own.

Three single-host slices of TPU v4 2x2x1 (4 chips, one host each): three 2x2x2
slices (six hosts) do not fit next to a driver and a JAX process per host on a
2-core machine. There is never a spare slice: the point is not to need one.

Figures:

(a) slice lost -> next completed step on the survivors, on the driver clock:
    from the moment the driver kills the slice (``preempt_slice(wait=False)``)
    to the driver's hearing of the first step completed by every survivor
    (detection, teardown, reservation, start-up, restore, compile included).
(b) the global batch kept constant by accumulation (``num_slices=3,
    min_slices=1``: 3 -> 1 -> 3 slices, ``grad_accum_steps`` 1 -> 3 -> 1), one
    shrink and one grow vs the fault-free run, same data (every micro-step gets
    the batch of the host of the full-size run it stands for) and seeds. Two
    sets of parameters train side by side in the same runs: ``mesh``, the usual
    code (the mean gradient of a batch sharded over the mesh, micro-step
    gradients averaged), and ``exact``, float32 with deterministic reductions
    (each full-size host's gradient computed on one device, gathered, summed
    in host order). Reported: the max abs difference of the final parameters
    and of the loss curve, and whether they are bitwise equal.
(c) goodput of a 3-slice run losing one slice for a third of the run (the
    slice comes back ``outage_s`` later, a third of the fault-free run's wall
    time), as productive chip-seconds over the chip-seconds the cluster
    actually had (12 chips, 8 during the outage); the same schedule under plain
    restart (``min_slices=num_slices``: waiting for the replacement); and the
    fault-free run's own fraction (the same elastic run without the fault),
    the ceiling: start-up and compile are never productive, so the fraction
    of a short run is bounded by its start-up, whatever the recovery. The
    goal is judged on the faulty runs' own fraction (median of ``rounds``),
    not relative to that ceiling. Runs of ``STEPS`` steps of 0.2 s: long
    enough that the first start-up (~6 s) is not most of what is lost.

``python benchmarks/bench_elastic.py [rounds=N]`` prints one JSON line;
``make bench`` runs it in a subprocess and adds :func:`rows` to its table.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import threading
import time
from typing import Any

from _options import parse_options  # benchmarks/ is on the path: the script's folder, or run.py's

GOAL_SHRINK_S = 3.0
GOAL_GOODPUT = 0.9
SHAPE = ("TPU-V4", "2x2x1")
CHIPS_PER_SLICE = 4
SLICES = 3
# Steps of the goodput runs (0.2 s each): a resize costs a few seconds whatever the run's length, but so
# does the first start-up (~6 s): at 270 steps the fault-free run itself reached only 0.89-0.91 of the
# chip-s available; 600 steps (~2 min a run) make it a run, still short.
STEPS = 600
# The goodput runs' checkpoint cadence, as in production (and bench_train's): the RAM tier every step,
# storage every 50. Figure (b) checkpoints to storage every step.
PRODUCTION_CHECKPOINTS = {"ram_every_steps": 1, "storage_every_steps": 50}


def _ship_by_value() -> None:
    # Hosts cannot import benchmarks/: send this module's functions by value.
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])


# -- the training functions ---------------------------------------------------------------
def step_loop(config: dict) -> None:
    """Data parallel steps of ``step_s`` each (a jitted step, then the rest of the time asleep); a checkpoint each."""
    import time as _t

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from rayslice.train import get_checkpoint, get_context, report

    ctx = get_context()
    mesh = jax.make_mesh(tuple(ctx.mesh_shape.values()), tuple(ctx.mesh_shape))
    repl, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    width = 64
    init = jax.jit(lambda: jnp.eye(width, dtype=jnp.float32) * 0.5, out_shardings=repl)
    state: dict[str, Any] = {"w": init(), "step": 0}
    ckpt = get_checkpoint()
    if ckpt is not None:
        state = ckpt.restore(state)
    start = int(state["step"])

    @jax.jit
    def train_step(w, x):
        loss, g = jax.value_and_grad(lambda w: jnp.mean((jnp.tanh(x @ w) - 0.5) ** 2))(w)
        return w - 0.1 * g, loss

    x = jax.make_array_from_process_local_data(rows, np.full((jax.local_device_count() * 8, width), 0.1, np.float32))
    for i in range(start, config["steps"]):
        t = _t.perf_counter()
        w, loss = train_step(state["w"], x)
        state = {"w": w, "step": i + 1}
        loss = float(loss)
        _t.sleep(max(0.0, config["step_s"] - (_t.perf_counter() - t)))
        report({"loss": loss, "slices": ctx.num_slices, "attempt": ctx.attempt, "step": i + 1}, checkpoint=state)


def accum_loop(config: dict) -> None:
    """A small MLP trained twice side by side (``mesh`` and ``exact`` parameters); see the module notes, (b)."""
    import os as _os
    import time as _t

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from rayslice.train import get_checkpoint, get_context, report

    ctx = get_context()
    mesh = jax.make_mesh(tuple(ctx.mesh_shape.values()), tuple(ctx.mesh_shape))
    repl, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    accum, rank = ctx.grad_accum_steps, ctx.world_rank
    full_hosts = ctx.max_slices * ctx.hosts_per_slice  # hosts of the full-size run: one micro-step stands for one
    batch, width, hidden, lr, seed = config["batch"], config["width"], 32, 0.05, config["seed"]
    rng = np.random.default_rng(seed)
    init = {
        "w1": (rng.standard_normal((width, hidden)) / np.sqrt(width)).astype(np.float32),
        "w2": (rng.standard_normal((hidden, 1)) / np.sqrt(hidden)).astype(np.float32),
    }
    true = np.random.default_rng(seed + 1).standard_normal((width, 1)).astype(np.float32)

    def data(step: int, host: int) -> tuple[np.ndarray, np.ndarray]:
        r = np.random.default_rng([seed, step, host])
        x = r.standard_normal((batch, width), dtype=np.float32)
        return x, np.sin(x @ true).astype(np.float32)

    def glob(a: np.ndarray) -> Any:  # the same host value everywhere -> a replicated global array
        return jax.make_array_from_callback(a.shape, repl, lambda idx: a[idx])

    def host(a: Any) -> np.ndarray:
        return np.asarray(a.addressable_data(0))

    def loss_fn(p, x, y):
        return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)

    state: dict[str, Any] = {
        "mesh": {k: glob(v) for k, v in init.items()},
        "exact": {k: glob(v) for k, v in init.items()},
        "step": 0,
    }
    ckpt = get_checkpoint()
    if ckpt is not None:
        state = ckpt.restore(state)
    start = int(state["step"])
    exact = {k: host(v) for k, v in state["exact"].items()}
    mesh_grad = jax.jit(jax.value_and_grad(loss_fn), out_shardings=repl)
    average = jax.jit(lambda gs: jax.tree.map(lambda *g: sum(g) / len(g), *gs), out_shardings=repl)
    update = jax.jit(lambda p, g: jax.tree.map(lambda a, b: a - lr * b, p, g), out_shardings=repl)
    device = jax.local_devices()[0]
    local_grad = jax.jit(jax.grad(loss_fn))
    for step in range(start, config["steps"]):
        t = _t.perf_counter()
        grads, losses, mine = [], [], []
        for m in range(accum):  # micro-step m of host `rank` stands for host rank * accum + m of the full run
            x, y = data(step, rank * accum + m)
            xs = jax.make_array_from_process_local_data(rows, x)
            ys = jax.make_array_from_process_local_data(rows, y)
            loss, g = mesh_grad(state["mesh"], xs, ys)
            grads.append(g)
            losses.append(float(loss))
            pe = jax.device_put(exact, device)
            ge = local_grad(pe, jax.device_put(x, device), jax.device_put(y, device))
            mine.append({k: np.asarray(v) for k, v in ge.items()})
        new_mesh = update(state["mesh"], average(grads) if accum > 1 else grads[0])
        for k in exact:  # gather every full-size host's gradient, sum them in host order: no reduction tree
            local = np.stack([g[k] for g in mine])
            every = np.asarray(multihost_utils.process_allgather(local)).reshape((full_hosts, *local.shape[1:]))
            total = every[0].copy()
            for v in range(1, full_hosts):
                total = total + every[v]
            exact[k] = (exact[k] - np.float32(lr) * (total / np.float32(full_hosts))).astype(np.float32)
        state = {"mesh": new_mesh, "exact": {k: glob(v) for k, v in exact.items()}, "step": step + 1}
        _t.sleep(max(0.0, config["step_s"] - (_t.perf_counter() - t)))
        report(
            {
                "loss": sum(losses) / len(losses),
                "slices": ctx.num_slices,
                "accum": accum,
                "attempt": ctx.attempt,
                "step": step + 1,
            },
            checkpoint=state,
        )
    if rank == 0:
        final = {f"mesh_{k}": host(v) for k, v in state["mesh"].items()}
        final.update({f"exact_{k}": v for k, v in exact.items()})
        np.savez(_os.path.join(config["out"], f"{config['tag']}.npz"), **final)


# -- the driver's side ------------------------------------------------------------------
class _Schedule:
    """The chaos of one run: kill a busy slice once step ``kill_at`` is reported, bring one back later.

    The slice comes back ``outage_s`` after the kill (a thread: a plain-restart run reports nothing while it
    waits), or, with ``outage_s=None``, when the shrunk run has reported ``back_after`` steps.
    """

    def __init__(self, sim: Any, pool: list[str], kill_at: int, outage_s: float | None, back_after: int = 2) -> None:
        self.sim, self.pool, self.kill_at, self.outage_s, self.back_after = sim, pool, kill_at, outage_s, back_after
        self.killed_at: float | None = None  # time.time() of the kill (driver clock)
        self.next_step_at: float | None = None  # the first completed step after it
        self.added_at: float | None = None  # the new slice is up
        self.victim: str | None = None
        self._small = 0
        self._kill_wanted = threading.Event()

    def after_report(self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Any) -> None:
        m = metrics[0]
        step = int(m["step"])
        if self.killed_at is None and m["slices"] == SLICES and step >= self.kill_at:
            import rayslice

            busy = sorted(s.name for s in rayslice.list_slices() if s.state == "busy" and s.name in self.pool)
            self.victim = busy[-1]
            if self.outage_s is None:
                self._kill()
            else:  # fit() runs in a thread (see _goodput_run): the main thread kills and adds (Ray needs signals)
                self._kill_wanted.set()
        elif self.killed_at is not None and m["attempt"] > 1:
            if self.next_step_at is None:
                self.next_step_at = time.time()
            self._small += m["slices"] < SLICES
            if self.outage_s is None and self.added_at is None and self._small >= self.back_after:
                self._add()

    def _kill(self) -> None:
        assert self.victim is not None
        self.killed_at = time.time()
        self.sim.preempt_slice(self.victim, wait=False)  # no spare slice anywhere: go on with the survivors

    def poll(self) -> None:
        """In the main thread: the kill a report asked for, and the slice's return ``outage_s`` after it."""
        if self._kill_wanted.is_set() and self.killed_at is None:
            self._kill()
        back = None if self.outage_s is None or self.killed_at is None else self.killed_at + self.outage_s
        if back is not None and self.added_at is None and time.time() >= back:  # the schedule's own clock
            self._add()

    def _add(self) -> None:
        name = self.sim.add_slice(f"v4:2x2x1@elastic-{time.time_ns() % 10**9}")
        self.pool.append(name)
        self.added_at = time.time()


def _all_free(pool: list[str]) -> None:
    """Waits until the cluster shows every slice of the pool alive and free (the last run's are given back)."""
    import rayslice
    from rayslice._deadline import Deadline

    deadline = Deadline(60)
    while sum(s.state == "free" and s.name in pool for s in rayslice.list_slices()) < SLICES:
        deadline.sleep_or_raise(0.2, f"the {SLICES} slices of the benchmark never came back free")


def _fit(
    loop: Any,
    config: dict,
    storage: str,
    *,
    min_slices: int,
    keep: bool,
    callbacks: list[Any],
    checkpoints: dict[str, int] | None = None,
) -> Any:
    """One run on the benchmark's slices; ``checkpoints``: the cadence (default: storage every step)."""
    from rayslice.train import CheckpointConfig, FailureConfig, JaxTrainer, RunConfig, ScalingConfig

    r = JaxTrainer(
        loop,
        train_loop_config=config,
        scaling_config=ScalingConfig(
            topology=SHAPE[1],
            accelerator_type=SHAPE[0],
            num_slices=SLICES,
            min_slices=min_slices,
            keep_global_batch=keep,
            regrow_every_s=0,
            reservation_timeout_s=300,
        ),
        run_config=RunConfig(
            name=f"elastic-bench-{time.time_ns()}",
            storage_path=storage,
            progress=False,
            callbacks=callbacks,
            checkpoint_config=CheckpointConfig(**(checkpoints or {}), num_to_keep=2),
            failure_config=FailureConfig(max_preemptions=3),
        ),
    ).fit()
    assert r.error is None, r.error
    return r


def _productive_chip_s(r: Any) -> float:
    """Productive seconds of each attempt (recomputed steps excluded) x the chips it trained on."""
    slices = {int(h["attempt"]): int(h["slices"]) for h in r.metrics_history}
    return sum(a["productive"] * slices.get(i + 1, 0) * CHIPS_PER_SLICE for i, a in enumerate(r.goodput.attempts))


def _goodput_run(
    sim: Any, pool: list[str], storage: str, steps: int, step_s: float, *, elastic: bool | None, outage_s: float = 0.0
) -> dict[str, Any]:
    """One run of :func:`step_loop`: fault-free (``elastic=None``), elastic, or plain restart, with the schedule."""
    config = {"steps": steps, "step_s": step_s}
    sched = None if elastic is None else _Schedule(sim, pool, steps // 3, outage_s)
    _all_free(pool)
    t0 = time.time()
    box: dict[str, Any] = {}

    def fit() -> None:
        try:
            box["result"] = _fit(
                step_loop,
                config,
                storage,
                min_slices=SLICES if elastic is False else 1,  # the fault-free run: the elastic run, no fault
                keep=False,
                callbacks=[sched] if sched else [],
                checkpoints=PRODUCTION_CHECKPOINTS,
            )
        except BaseException as e:  # re-raised in the main thread
            box["error"] = e

    runner = threading.Thread(target=fit, daemon=True)
    runner.start()
    while runner.is_alive():
        if sched is not None:
            sched.poll()
        runner.join(0.02)
    if "error" in box:
        raise box["error"]
    r = box["result"]
    t1 = time.time()
    wall = t1 - t0
    available = SLICES * CHIPS_PER_SLICE * wall
    out: dict[str, Any] = {"wall_s": wall, "resizes": [str(e) for e in r.resizes], "attempts": r.attempts}
    if sched is not None:
        assert sched.killed_at is not None and sched.added_at is not None, "the schedule never ran"
        out["outage_s"] = sched.added_at - sched.killed_at
        out["next_step_s"] = sched.next_step_at - sched.killed_at if sched.next_step_at else None
        available -= CHIPS_PER_SLICE * out["outage_s"]
    out["productive_chip_s"] = _productive_chip_s(r)
    out["available_chip_s"] = available
    out["fraction"] = out["productive_chip_s"] / available
    return out


def shrink_and_goodput(
    sim: Any, pool: list[str], storage: str, rounds: int = 3, steps: int = STEPS, step_s: float = 0.2
) -> dict[str, Any]:
    """Figures (a) and (c): a fault-free run, ``rounds`` elastic runs, one plain-restart run, same schedule."""
    clean = _goodput_run(sim, pool, storage, steps, step_s, elastic=None)
    outage = clean["wall_s"] / 3
    elastic = [_goodput_run(sim, pool, storage, steps, step_s, elastic=True, outage_s=outage) for _ in range(rounds)]
    plain = _goodput_run(sim, pool, storage, steps, step_s, elastic=False, outage_s=outage)
    return {"steps": steps, "step_s": step_s, "clean": clean, "elastic": elastic, "plain": plain}


def accumulation(sim: Any, pool: list[str], storage: str, steps: int = 40) -> dict[str, Any]:
    """Figure (b): fault-free vs one shrink (3 -> 1 slices, 3 micro-steps) and one grow, same data and seeds."""
    import numpy as np

    out_dir = tempfile.mkdtemp(dir=storage)
    config = {"steps": steps, "step_s": 0.25, "batch": 16, "width": 16, "seed": 7, "out": out_dir}
    curves, runs = {}, {}
    for tag in ("clean", "resized"):
        sched = _Schedule(sim, pool, steps // 5, None) if tag == "resized" else None
        _all_free(pool)
        r = _fit(
            accum_loop, {**config, "tag": tag}, storage, min_slices=1, keep=True, callbacks=[sched] if sched else []
        )
        curves[tag] = {int(h["step"]): float(h["loss"]) for h in r.metrics_history}  # the last run of each step
        runs[tag] = r
    assert sorted(curves["clean"]) == sorted(curves["resized"]) == list(range(1, steps + 1))
    resizes = runs["resized"].resizes
    assert [(e.slices_before, e.slices_after) for e in resizes] == [(3, 1), (1, 3)], [str(e) for e in resizes]
    accums = sorted({int(h["accum"]) for h in runs["resized"].metrics_history})
    a, b = np.load(f"{out_dir}/clean.npz"), np.load(f"{out_dir}/resized.npz")
    out: dict[str, Any] = {"steps": steps, "resizes": [str(e) for e in resizes], "accum_steps": accums}
    for kind in ("mesh", "exact"):
        keys = [k for k in a.files if k.startswith(kind + "_")]
        out[kind] = {
            "max_abs_diff": float(max(np.max(np.abs(a[k] - b[k])) for k in keys)),
            "bitwise_equal": all(a[k].tobytes() == b[k].tobytes() for k in keys),
        }
    out["loss_curve_max_abs_diff"] = max(abs(curves["clean"][s] - curves["resized"][s]) for s in curves["clean"])
    return out


def run(rounds: int = 3, steps: int = STEPS, step_s: float = 0.2) -> dict[str, Any]:
    """Every figure on a simulated cluster of three v4 2x2x1 slices (started and shut down here)."""
    from rayslice.sim import SimulatedCluster, SliceSpec

    _ship_by_value()
    t0 = time.time()
    specs = [SliceSpec(*SHAPE, name=f"elastic-{i}") for i in range(SLICES)]
    with SimulatedCluster(specs, head_cpus=2) as sim:
        pool = [s.name for s in specs]
        with tempfile.TemporaryDirectory(prefix="rs-bench-elastic-") as storage:
            out = {"slices": f"{SLICES} x v4 {SHAPE[1]} (one host each)"}
            out["accumulation"] = accumulation(sim, pool, storage)
            out["goodput"] = shrink_and_goodput(sim, pool, storage, rounds=rounds, steps=steps, step_s=step_s)
    out["total_s"] = time.time() - t0
    return out


def rows(out: dict[str, Any]) -> list[tuple[str, ...]]:
    """The benchmark table rows of :func:`run`: (figure, rayslice, peer, ratio, goal, met)."""
    met = "[green]yes[/green]", "[red]NO[/red]"
    g, acc = out["goodput"], out["accumulation"]
    el = g["elastic"]
    shrink = [e["next_step_s"] for e in el]
    med = statistics.median(shrink)
    fr = [e["fraction"] for e in el]
    frac = statistics.median(fr)
    clean, plain = g["clean"]["fraction"], g["plain"]["fraction"]
    exact, mesh = acc["exact"], acc["mesh"]
    return [
        (
            f"elastic: slice lost -> next step on the 2 survivors, no spare ({out['slices']}; median of {len(el)}, "
            f"{min(shrink):.2f}-{max(shrink):.2f})",
            f"{med:.2f} s",
            "-",
            "-",
            f"<= {GOAL_SHRINK_S:g} s",
            met[not med <= GOAL_SHRINK_S],
        ),
        (
            f"elastic: 3 -> 1 -> 3 slices, global batch kept by accumulation {acc['accum_steps']}: final params "
            "vs fault-free, max abs diff",
            f"exact (f32, fixed-order sums): {exact['max_abs_diff']:.3g}"
            f" ({'bitwise equal' if exact['bitwise_equal'] else 'NOT bitwise equal'})",
            f"mesh mean + averaged micro-steps: {mesh['max_abs_diff']:.3g}; "
            f"loss curve {acc['loss_curve_max_abs_diff']:.3g}",
            "-",
            "exact: bitwise; mesh: <= 1e-5",
            met[not (exact["bitwise_equal"] and mesh["max_abs_diff"] <= 1e-5)],
        ),
        (
            f"elastic goodput, 1 of 3 slices lost for {statistics.median(e['outage_s'] for e in el):.0f} s of "
            f"{g['clean']['wall_s']:.0f} s: productive / available chip-s (median of {len(el)})",
            f"{frac:.2f} ({min(fr):.2f}-{max(fr):.2f}; the fault-free run's {clean:.2f}: {frac / clean:.2f} of it)",
            f"plain restart (waits for the slice): {plain:.2f}",
            f"{frac / plain:.2f}x plain",
            f">= {GOAL_GOODPUT:g} of the chip-s available",
            met[frac < GOAL_GOODPUT],
        ),
    ]


_USAGE = "bench_elastic.py [rounds=N] [steps=N] [step_s=SECONDS]"


def main(argv: list[str]) -> int:
    """Runs :func:`run` with ``key=value`` options (rounds, steps, step_s); one JSON line; 2 on a bad option."""
    import json

    try:
        _, kwargs = parse_options(argv, set(), _USAGE, lambda _: run)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    print(json.dumps(run(**kwargs)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
