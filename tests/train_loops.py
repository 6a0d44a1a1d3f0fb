"""Training loops run by the trainer tests (inside gang processes; JAX imported here only)."""

from __future__ import annotations

import contextlib
import gc
import os
import time
from collections.abc import Iterator
from typing import Any

W_TRUE = (1.0, -2.0, 3.0, 0.5)


def regression_loop(config: dict) -> None:
    """A small Flax MLP on deterministic per-host data; checkpoints every ``every`` steps."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from rayslice.data import iter_jax_batches
    from rayslice.train import get_checkpoint, get_context, report, save_requested

    ctx = get_context()
    mesh = jax.make_mesh((jax.device_count(),), ("data",))

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(1)(nn.relu(nn.Dense(32)(x)))

    model, tx = MLP(), optax.adam(config.get("lr", 0.05))
    repl = NamedSharding(mesh, P())
    params = jax.jit(model.init, out_shardings=repl)(jax.random.key(config.get("seed", 0)), jnp.zeros((1, 4)))
    state = {"params": params, "opt": jax.jit(tx.init, out_shardings=repl)(params)}
    data_state = None
    ckpt = get_checkpoint()
    if ckpt is not None:
        state = ckpt.restore(state)
        data_state = ckpt.data_state("data")
    if config.get("ray_data"):
        from rayslice.train import get_dataset_shard

        source = get_dataset_shard("train")  # this host's deterministic split of a Ray Dataset
    else:
        rng = np.random.default_rng(ctx.world_rank)
        x = rng.standard_normal((config["rows"], 4)).astype(np.float32)
        source = [{"x": x, "y": (x @ np.array(W_TRUE, np.float32)).astype(np.float32)}]
    it = iter_jax_batches(
        source,
        batch_size=8,
        state=data_state,
        ragged="drop",
        columns=["x", "y"],
        sharding=NamedSharding(mesh, P("data")),
    )

    @jax.jit
    def step(state, batch):
        def loss_fn(p):
            return jnp.mean((model.apply(p, batch["x"])[:, 0] - batch["y"]) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss

    for batch in it:
        state, loss = step(state, batch)
        n = it.state()["batches"]
        slow = ctx.attempt == 1 and n > config.get("slow_after", n)  # a long step: a kill lands inside it
        time.sleep(config["slow_s"] if slow else config.get("sleep_s", 0.0))
        extra = {
            "restored_from": ckpt.step if ckpt else 0,
            "world_rank": ctx.world_rank,
            "world_size": ctx.world_size,
            "process_count": jax.process_count(),
            "device_count": jax.device_count(),
            "local_device_count": ctx.local_device_count,
            "num_slices": ctx.num_slices,
            "slice_index": ctx.slice_index,
            "worker_id": ctx.worker_id,
            "megascale_slices": os.environ.get("MEGASCALE_NUM_SLICES", ""),
        }
        # save_requested(): a preemption notice was agreed for this step (the emergency save).
        save = n % config["every"] == 0 or save_requested()
        report({"loss": loss, **extra}, checkpoint={**state, "data": it} if save else None)


def regression_rows(batch: dict) -> dict:
    """Ray Data map_batches: features and target per row id (deterministic)."""
    import numpy as np

    ids = batch["id"]
    x = np.stack([np.sin(ids * (k + 1) * 0.1) for k in range(4)], axis=1).astype(np.float32)
    return {"x": x, "y": (x @ np.array(W_TRUE, np.float32)).astype(np.float32)}


def failing_loop(config: dict) -> None:
    from rayslice.train import get_context, report

    report({"loss": 1.0})
    if get_context().world_rank == config.get("rank", 1):
        raise ValueError("loss is NaN at step 2 (injected)")
    time.sleep(30)  # the healthy host would wait in a collective; the trainer must not


def crash_mid_save_loop(config: dict) -> None:
    """Attempt 1: a complete checkpoint at step 1, then both hosts die while step 2's save runs."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from rayslice.train import get_checkpoint, report

    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    big = jax.device_put(jnp.ones((jax.device_count() * 1024, 4096), jnp.float32), NamedSharding(mesh, P("data")))
    ckpt = get_checkpoint()
    if ckpt is not None:
        restored = ckpt.restore({"w": big})
        report({"restored_from": ckpt.step, "sum": float(restored["w"].sum()) / big.size})
        return
    report({"loss": 1.0}, checkpoint={"w": big})
    from rayslice.train.worker import _session

    _session().writer.wait()  # step 1 is complete on storage
    report({"loss": 0.5}, checkpoint={"w": big * 2})  # asynchronous: still writing...
    os._exit(1)  # ...when the host dies (the process vanishes, as on preemption)


def overhead_loop(config: dict) -> None:
    """Times the same jitted step with and without report() (the trainer's per-step cost).

    ``target_ms`` sizes the step: a chain of small matmuls (one compute
    thread per host, as a device computing while its host waits) whose length
    is calibrated on the hosts, all at once, until the bare step takes about
    that long (``size`` fixes it instead). With ``pipelined``, the loop does not
    wait for each step: the step carries its state to the next, as a training
    step does, and the host runs ahead of the device (report() bounds how far);
    the phase waits for its last step. ``warmup_s`` of reported steps run before
    the timed pairs, so the run's one-time work (the first drains, the warm
    spare processes that the trainer starts on a free slice after the first
    report) is not taken for a per-step cost.

    The machine's speed drifts by tens of percent over seconds, so the cost is
    measured in many short pairs of phases (``phase_steps`` bare steps and as
    many reported ones, in alternating order, every host starting each pair
    at once); the overhead is the median of the per-pair ratios. Every third
    pair is bare against bare: the median of those is the method's own noise
    floor, measured in the same run.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils

    from rayslice.train import report

    def step_of(size: int):
        # ``size`` small dependent matmuls: one thread computes, as a device would while its host waits
        # (a large matmul would spread over every core and make both hosts fight for them).
        w = jnp.full((128, 128), 0.01, jnp.float32)
        x = jnp.ones((32, 128), jnp.float32)
        f = jax.jit(lambda a: jax.lax.fori_loop(0, size, lambda _, a: jnp.tanh(a @ w), a).mean())
        f(x).block_until_ready()
        return f, x

    def chained_of(size: int):
        # The same step carrying its state to the next one (a training step's shape), for the pipelined loop.
        w = jnp.full((128, 128), 0.01, jnp.float32)

        def g(a):
            a = jax.lax.fori_loop(0, size, lambda _, a: jnp.tanh(a @ w), a)
            return a, a.mean()

        g = jax.jit(g)
        g(jnp.ones((32, 128), jnp.float32))[1].block_until_ready()
        return g

    def bare_ms(f, x, n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            f(x).block_until_ready()
        return 1000 * (time.perf_counter() - t0) / n

    def together(tag: str) -> None:  # every host starts the next phase at once (they share the machine's cores)
        multihost_utils.sync_global_devices(tag)

    size = config.get("size")
    if size is None:  # calibrate, every host at once: the step time grows with the number of matmuls
        size = 100
        for k in range(3):
            f, x = step_of(size)
            together(f"calibrate-{k}")
            ms = sorted(bare_ms(f, x, max(3, int(100 / max(bare_ms(f, x, 3), 0.05)))) for _ in range(5))[2]
            size = max(1, round(size * config.get("target_ms", 3.5) / ms))
        size = int(multihost_utils.broadcast_one_to_all(np.int32(size)))  # the same step on every host
    f, x = step_of(size)
    pipelined = bool(config.get("pipelined"))
    g = chained_of(size) if pipelined else None
    warm_until = time.perf_counter() + config.get("warmup_s", 0.0)
    i = 0
    while time.perf_counter() < warm_until:
        report({"v": f(x), "i": i})
        i += 1

    n = config.get("phase_steps", 10)
    inside: list[float] = []

    def timed(with_report: bool) -> tuple[float, float]:
        c0, t0 = time.process_time(), time.perf_counter()
        a = x
        for i in range(n):
            if g is None:  # wait for every step
                v = f(x)
                v.block_until_ready()
            else:  # pipelined: no wait per step (report() bounds how far the host runs ahead)
                a, v = g(a)
            if with_report:
                t1 = time.perf_counter()
                report({"v": v, "i": i})
                inside.append(time.perf_counter() - t1)
        if g is not None:
            v.block_until_ready()  # the phase ends when its last step does
        return time.perf_counter() - t0, time.process_time() - c0

    ratios: list[float] = []  # reported / bare, per pair
    nulls: list[float] = []  # bare / bare, per pair
    bare_s: list[float] = []
    cpu: dict[bool, list[float]] = {False: [], True: []}
    gc0 = gc.get_stats()
    for k in range(config.get("pairs", 150)):
        null = k % 3 == 2
        together(f"pair-{k}")
        order = (False, not null) if k % 2 == 0 else (not null, False)
        (t_a, c_a), (t_b, c_b) = timed(order[0]), timed(order[1])
        times = dict(zip(order, (t_a, t_b))) if not null else {}
        if null:
            nulls.append(t_b / t_a if k % 2 == 0 else t_a / t_b)
            continue
        ratios.append(times[True] / times[False])
        bare_s.append(times[False])
        for kind, c in zip(order, (c_a, c_b)):
            cpu[kind].append(c)
    collections = sum(g["collections"] for g in gc.get_stats()) - sum(g["collections"] for g in gc0)

    def med(v: list[float]) -> float:
        return sorted(v)[len(v) // 2]

    def q(v: list[float], p: float) -> float:
        return sorted(v)[int(p * (len(v) - 1))]

    report(
        {
            "size": size,
            "phase_steps": n,
            "pairs": len(ratios),
            "bare_ms": 1000 * med(bare_s) / n,
            "overhead": med(ratios) - 1,
            "overhead_p25": q(ratios, 0.25) - 1,
            "overhead_p75": q(ratios, 0.75) - 1,
            "null": med(nulls) - 1,
            "null_p25": q(nulls, 0.25) - 1,
            "null_p75": q(nulls, 0.75) - 1,
            "report_us": 1e6 * med(inside),
            "report_mean_us": 1e6 * sum(inside) / len(inside),
            "cpu_added_us": 1e6 * (sum(cpu[True]) - sum(cpu[False])) / (n * len(ratios)),
            "gc_collections": collections,
        }
    )


def busy_loop(config: dict) -> None:
    """Steps until a stop file appears (or a step limit): a job to observe while it runs."""
    import jax
    import jax.numpy as jnp

    from rayslice.train import report

    if config.get("profiler_server"):
        import rayslice

        rayslice.init_jax_profiler()
    x = jnp.ones((128, 128))
    f = jax.jit(lambda a: (a @ a).mean())
    for i in range(config.get("max_steps", 2000)):
        v = f(x + i)
        time.sleep(config.get("sleep_s", 0.05))
        report({"v": v})
        if os.path.exists(config["stop_file"]):
            break


def ray_style_loop(config: dict) -> dict:
    """Written the way Ray Train's guides write a loop: files in a temporary directory, Ray's getters."""
    import json
    import tempfile

    from rayslice.train import Checkpoint, get_checkpoint, get_context, report

    ctx = get_context()
    start = 0
    checkpoint = get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as d, open(os.path.join(d, "state.json")) as f:
            start = json.load(f)["epoch"]
    for epoch in range(start, start + config["epochs"]):
        metrics = {
            "epoch": epoch + 1,
            "losses": [1.0 / (epoch + 1), 0.5],
            "resumed_from": start,
            "ranks": [
                ctx.get_world_rank(),
                ctx.get_world_size(),
                ctx.get_local_rank(),
                ctx.get_local_world_size(),
                ctx.get_node_rank(),
            ],
            "names": [ctx.get_experiment_name(), ctx.get_trial_name()],
        }
        with tempfile.TemporaryDirectory() as tmp:
            if ctx.get_world_rank() == 0:  # Ray's pattern: rank 0 writes, the others report None
                with open(os.path.join(tmp, "state.json"), "w") as f:
                    json.dump({"epoch": epoch + 1}, f)
                report(metrics, checkpoint=Checkpoint.from_directory(tmp))
            else:
                report(metrics, checkpoint=None)
    return {"final_epoch": start + config["epochs"]}


def host_local_leaves_loop(config: dict) -> None:
    """Saves leaves Orbax refuses on multi-host runs as they are (made global), restores them, and a bad leaf."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from rayslice.errors import InvalidArgument
    from rayslice.train import Checkpoint, get_context, report
    from rayslice.train.checkpoint import checkpoints_dir, step_dir

    ctx = get_context()
    tree = {"w": jnp.arange(4.0), "n": np.arange(3, dtype=np.int64), "lr": 0.5, "count": 7}
    report({"phase": "save", "processes": jax.process_count()}, checkpoint=tree)  # synchronous (async_save=False)
    target = {"w": jnp.zeros(4), "n": np.zeros(3, np.int64), "lr": 0.0, "count": 0}
    back = Checkpoint(step_dir(checkpoints_dir(ctx.run_path), 1)).restore(target)
    try:
        report({}, checkpoint={"params": {"tag": "not an array"}})
        error = ""
    except InvalidArgument as e:
        error = str(e)
    report(
        {
            "w": back["w"],
            "n": back["n"],
            "lr": back["lr"],
            "count": back["count"],
            "error": error,
            "env": os.environ.get("RAYSLICE_TEST_ENV", ""),
        }
    )


def hang_loop(config: dict) -> None:
    """Every step is a barrier over all hosts; on attempt 1 one host hangs at ``hang_at`` (alive, no progress).

    With ``hold_gil_s``, that host instead holds its GIL that long (its heartbeat thread cannot run), then goes on.
    """
    from jax.experimental import multihost_utils

    from rayslice.train import get_context, report

    ctx = get_context()
    for step in range(1, config["steps"] + 1):
        if ctx.attempt == 1 and step == config["hang_at"] and ctx.world_rank == config.get("rank", 1):
            if config.get("hold_gil_s"):  # a busy host: one C call holds the GIL, no Python thread runs
                import ctypes

                ctypes.PyDLL(None).usleep(int(config["hold_gil_s"] * 1e6))  # PyDLL: called with the GIL held
            else:
                time.sleep(600)  # a wedged host: its process stays alive, its peers wait in the collective
        multihost_utils.sync_global_devices(f"step-{step}")
        report({"step_done": step, "attempt": ctx.attempt})


def _block_replica_exchange(marker: str) -> None:
    """This host's next RAM save reaches its own node's store, then hangs sending the replica (a test hook)."""
    from rayslice.train.worker import _session

    writer = _session().ram

    def stuck(step: int, ref: object) -> None:
        with open(marker, "w") as f:
            f.write(str(step))
        time.sleep(120)  # the node is killed meanwhile

    writer._put_replica = stuck


def _hold(marker: str, timeout_s: float = 120.0) -> bool:
    """Waits (at most ``timeout_s``) until the file ``marker`` exists; returns whether it does."""
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    return os.path.exists(marker)


def ram_loop(config: dict) -> None:
    """A small optax loop with a replicated and a row-sharded parameter; reports a digest of the final state.

    Checkpoints when ``save_requested()`` (the RAM and storage cadences of the
    run's ``CheckpointConfig``). With ``block_replica_at``, host ``block_rank``
    of attempt 1 hangs in the replica exchange of that RAM step (see
    :func:`_block_replica_exchange`). With ``hold_attempt`` and ``hold_at``,
    every host of that attempt waits after reporting that step until the file
    ``hold_marker`` exists (see :func:`_hold`).
    """
    import hashlib

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from rayslice.data import iter_jax_batches
    from rayslice.train import get_checkpoint, get_context, report, save_requested

    ctx = get_context()
    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("data",))
    repl, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    tx = optax.adam(0.05)
    params = {
        "w": jax.device_put(jnp.zeros(4, jnp.float32), repl),
        "table": jax.device_put(jnp.arange(n * 8, dtype=jnp.float32).reshape(n * 2, 4) / 10, rows),
    }
    placed = lambda tree: jax.tree.map(lambda a: rows if a.ndim == 2 else repl, tree)
    opt = jax.jit(tx.init, out_shardings=placed(jax.eval_shape(tx.init, params)))(params)
    state = {"params": params, "opt": opt}
    shardings = placed(state)
    ckpt = get_checkpoint()
    data_state = None
    if ckpt is not None:
        state = ckpt.restore(state)
        data_state = ckpt.data_state("data")
    rng = np.random.default_rng(ctx.world_rank)
    x = rng.standard_normal((config["steps"] * 8, 4)).astype(np.float32)
    source = [{"x": x, "y": (x @ np.array(W_TRUE, np.float32)).astype(np.float32)}]
    it = iter_jax_batches(source, batch_size=8, state=data_state, ragged="drop", columns=["x", "y"], sharding=rows)

    def step(state, batch):
        def loss_fn(p):
            pred = batch["x"] @ p["w"] + jnp.mean(p["table"] ** 2)
            return jnp.mean((pred - batch["y"]) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss

    jstep = jax.jit(step, out_shardings=(shardings, repl))
    for batch in it:
        state, loss = jstep(state, batch)
        done = it.state()["batches"]
        time.sleep(config.get("sleep_s", 0.0))
        blocked = ctx.attempt == 1 and ctx.world_rank == config.get("block_rank", 1)
        if blocked and done == config.get("block_replica_at"):
            _block_replica_exchange(config["marker"])
        extra = {"restored_from": ckpt.step if ckpt else 0, "tier": ckpt.tier if ckpt else ""}
        report({"loss": loss, **extra}, checkpoint={**state, "data": it} if save_requested() else None)
        if ctx.attempt == config.get("hold_attempt") and done == config.get("hold_at"):
            _hold(config["hold_marker"])
    final = multihost_utils.process_allgather(state, tiled=True)
    digest = hashlib.sha256(b"".join(np.asarray(leaf).tobytes() for leaf in jax.tree.leaves(final))).hexdigest()
    report({"digest": digest, "leaves": len(jax.tree.leaves(final))})


@contextlib.contextmanager
def one_host_session(run_path: Any) -> Iterator[Any]:
    """A worker session of a one-host attempt, outside Ray (report() and drain_reports() work on it).

    For tests and benchmarks of the worker's side alone. The heap freeze the first report does
    (``worker._freeze_heap``) is undone on the way out: this is the caller's process, not a host process.
    """
    import dataclasses
    import pathlib

    from rayslice.train import context, worker

    run_path = pathlib.Path(run_path)
    fields = {f.name for f in dataclasses.fields(context.TrainContext)}
    kw = {
        "world_rank": 0, "world_size": 1, "slice_index": 0, "num_slices": 1, "worker_id": 0, "hosts_per_slice": 1,
        "local_device_count": 1, "experiment_name": "x", "run_path": str(run_path), "attempt": 1, "slice_name": "s",
        "local_rank": 0, "run_id": "r",
    }  # fmt: skip
    ctx = context.TrainContext(**{k: v for k, v in kw.items() if k in fields})
    info = {"checkpoint_dir": str(run_path / "ckpt"), "restore_step": None, "num_to_keep": None, "async_save": True}
    session = worker._Session(ctx, info, {})
    worker._SESSION = session
    gc.unfreeze()
    try:
        yield session
    finally:
        gc.unfreeze()
        worker.wait_for_checkpoints()
        session.sampler.stop()
        worker._SESSION = None
