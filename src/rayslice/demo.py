"""``rayslice demo``: the whole system, step by step, on an embedded simulated cluster.

Each step is a real use of the public API on a real multi-node Ray cluster
running on this machine:

1. bring up two simulated v4 ``2x2x2`` slices (2 hosts x 4 chips each);
2. show the slices as the inventory sees them;
3. start one JAX process on every host, which reports the devices it sees;
4. make one host of slice A busy, reserve a whole slice (it lands on B),
   and run a cross-host ``psum`` on it;
5. show why a reservation of a missing shape fails fast;
6. prepare a dataset with Ray Data;
7. train a Flax model on a 2-host slice with ``JaxTrainer``, preempting one of
   its hosts mid-run: the run resumes from its checkpoint on the other slice;
   twice, with the recovery path rayslice had before (Ray's node death,
   cold processes, no compilation cache, storage checkpoints only) and with
   today's (heartbeats, warm spare processes, the cache, a RAM tier), and the
   summary prints both goodputs;
8. the node pool replaces the lost slice; batch inference over every row with
   ``batch_predict`` (``iter_jax_batches`` on every host of a slice);
9. serve the trained model with Ray Serve on a whole slice and query it over HTTP;
10. summary, shut down, no Ray process left.

The output reads as a story when piped or logged (``rayslice demo > log``):
Ray's own INFO logs, Ray Data progress and the raylet crash dump of the
simulated preemption stay out of it (one line says what happened);
``verbose=True`` (``rayslice demo --verbose``) shows everything.
"""

from __future__ import annotations

import functools
import re
import tempfile
import time
from typing import Any

from rich.console import Console
from rich.panel import Panel

from rayslice._tables import slices_table

SLICES = (("v4", "2x2x2", "slice-a"), ("v4", "2x2x2", "slice-b"))
# The training run: one pass over TRAIN_ROWS rows, BATCH_SIZE rows per host per step on the 2 hosts of a slice
# (TRAIN_ROWS // (2 * BATCH_SIZE) = 224 steps), one host preempted at PREEMPT_AT of the way.
TRAIN_ROWS = 458_752
TEST_ROWS = 1024
BATCH_SIZE = 1024
PREEMPT_AT = 0.42
STORAGE_EVERY = 8  # the "before" run: storage checkpoints, its only tier
RAM_EVERY = 8  # the "after" run: the RAM tier every RAM_EVERY steps, storage every AFTER_STORAGE_EVERY
AFTER_STORAGE_EVERY = 32


def _host_report() -> dict:
    # Runs inside a gang process on a simulated host.
    import os

    import jax

    from rayslice.gang import host_context

    ctx = host_context()
    return {
        "slice": ctx.slice_name,
        "worker": ctx.worker_id,
        "rank": jax.process_index(),
        "local": jax.local_device_count(),
        "global": jax.device_count(),
        "platform": jax.devices()[0].platform,
        "TPU_WORKER_ID": os.environ["TPU_WORKER_ID"],
    }


def _psum() -> float:
    # Sums 1 over every device of every host of the slice: crosses hosts.
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = jax.make_mesh((jax.device_count(),), ("d",))
    sharding = NamedSharding(mesh, PartitionSpec("d"))
    local = np.ones((jax.local_device_count(),), np.float32) * (jax.process_index() + 1)
    x = jax.make_array_from_process_local_data(sharding, local)
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, PartitionSpec()))(x)
    return float(total.addressable_data(0))


def _show_metrics(console: Console) -> str:
    """Reads rayslice's series back from Ray's real Prometheus endpoints (one per node)."""
    import ray
    import requests

    from rayslice._deadline import Deadline

    deadline = Deadline(20)
    while True:
        series, where = [], ""
        for n in ray.nodes():
            port = n.get("MetricsExportPort")
            if not (n["Alive"] and port):
                continue
            try:
                text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
            except requests.RequestException:
                continue
            mine = [line for line in text.splitlines() if line.startswith("ray_rayslice_")]
            if mine:
                series += mine
                where = where or f"http://127.0.0.1:{port}/metrics"
        if any(s.startswith("ray_rayslice_goodput_fraction") for s in series) or deadline.expired:
            break
        deadline.sleep_or_raise(1.0, "waiting for metrics")
    names = sorted({s.split("{", 1)[0] for s in series})
    console.print(
        f"{len(series)} rayslice series on the nodes' Prometheus endpoints (e.g. {where}): {', '.join(names)}"
    )
    for s in series:
        if s.startswith(("ray_rayslice_goodput_fraction", "ray_rayslice_step_time_seconds")):
            name, rest = s.split("{", 1)
            labels = re.findall(r'(\w+)="([^"]*)"', rest.rsplit("}", 1)[0])
            shown = ",".join(f'{k}="{v}"' for k, v in labels if k in ("run", "slice", "worker_id", "component"))
            console.print(f"  {name}{{{shown}}} {float(s.rsplit(' ', 1)[1]):.4g}")
    return (
        f"{len(series)} series (ray_rayslice_*) on each node's Prometheus endpoint, e.g. {where}; "
        "Grafana: observability/grafana-dashboard.json"
    )


def _leftover_processes() -> list[str]:
    """Child processes still running after shutdown (killed, and named, if any)."""
    import psutil

    left = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            left.append(f"{p.name()}({p.pid})")
            p.kill()
        except psutil.NoSuchProcess:
            continue
    return left


def _serve(console: Console, checkpoint_path: str, preds: Any) -> str:
    import requests
    from ray import serve

    from rayslice import _demo_model
    from rayslice import serve as slice_serve

    _step(console, 10, "Serve the trained model on a whole slice (Ray Serve) and query it over HTTP")
    port = slice_serve.start_http()
    try:
        dep = slice_serve.deployment(
            accelerator_type="TPU-V4",
            accelerator_config={"type": "tpu", "topology": "2x2x2"},
            input_spec={"x": ((_demo_model.FEATURES,), "float32")},
        )(_demo_model.Regressor)
        t0 = time.monotonic()
        with console.status("deploying: reserve a slice, start 2 host processes, restore the checkpoint"):
            serve.run(dep.bind(checkpoint_path), name="regressor", route_prefix="/regressor")
        console.print(f"deployed in {time.monotonic() - t0:.1f} s at http://127.0.0.1:{port}/regressor")
        rows = preds.head(4)
        x = [list(map(float, v)) for v in rows["x"]] if "x" in rows else None
        if x is None:  # batch_predict kept id and y only: rebuild the features for those ids
            import numpy as np

            x = _demo_model.make_features({"id": np.asarray(rows["id"])})["x"].tolist()
        t0 = time.monotonic()
        r = requests.post(f"http://127.0.0.1:{port}/regressor", json={"inputs": {"x": x}}, timeout=30)
        ms = 1000 * (time.monotonic() - t0)
        r.raise_for_status()
        got = r.json()["outputs"]["y"]
        console.print(
            f"POST /regressor {len(x)} rows -> {[round(v, 3) for v in got]} in {ms:.0f} ms "
            f"(labels {[round(float(v), 3) for v in rows['y']]})"
        )
        bad = requests.post(f"http://127.0.0.1:{port}/regressor", data=b"{oops", timeout=30)
        console.print(f"malformed JSON -> HTTP {bad.status_code}: {bad.json()['error']}")
        return f"HTTP on a 2-host slice, {len(x)} rows answered in {ms:.0f} ms, bad input -> {bad.status_code}"
    finally:
        serve.shutdown()


def _llm(console: Console) -> str:
    """Train a byte-level LM on the standard library's source, serve it on a 2-host slice, stream from it."""
    from ray import serve

    from rayslice import serve as slice_serve
    from rayslice.serve.llm import EngineConfig, LLMConfig, LMConfig, build_app, train_tiny_lm

    _step(console, 11, "An LLM on a whole slice: train on the stdlib's source, serve an OpenAI API, stream")
    lm = LMConfig(d_model=64, num_layers=2, num_heads=8, d_ff=256, max_len=256)
    t0 = time.monotonic()
    with console.status("training a byte-level transformer with JaxTrainer on a 2-host slice"):
        result = train_tiny_lm(lm=lm, steps=60, batch_size=32, seq_len=128, lr=3e-3)
    losses = [m["loss"] for m in result.metrics_history]
    console.print(
        f"trained {len(losses)} steps in {time.monotonic() - t0:.1f} s: loss {losses[0]:.2f} -> {losses[-1]:.2f}"
    )
    port = slice_serve.start_http()
    try:
        cfg = LLMConfig(
            model_name="stdlib-lm",
            lm=lm,
            checkpoint=result.checkpoint.path,
            engine=EngineConfig(
                num_slots=8,
                max_context=256,
                prefill_buckets=(32, 128, 256),
                max_tokens_limit=128,
                default_max_tokens=32,
            ),
        )
        t0 = time.monotonic()
        with console.status("deploying: reserve a slice, start 2 host processes, compile every shape"):
            serve.run(build_app(cfg), name="llm", route_prefix="/")
        console.print(
            f"OpenAI-compatible API at http://127.0.0.1:{port}/v1 in {time.monotonic() - t0:.1f} s "
            "(model sharded over both hosts' 8 devices)"
        )
        try:
            import openai
        except ImportError:  # the demo's own install has it; a bare wheel may not
            return "skipped streaming: the openai package is not installed (pip install openai)"
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        prompt = "def __init__(self"
        pieces, t0, first = [], time.monotonic(), None
        for chunk in client.completions.create(
            model="stdlib-lm", prompt=prompt, max_tokens=48, temperature=0.8, top_p=0.95, seed=0, stream=True
        ):
            first = first if first is not None else time.monotonic() - t0
            pieces.append(chunk.choices[0].text)
        text = "".join(pieces)
        console.print(
            f"streamed {len(pieces)} chunks (first after {1000 * (first or 0):.0f} ms): {(prompt + text)!r}",
            highlight=False,
            markup=False,
        )
        return (
            f"byte-level LM, loss {losses[0]:.2f} -> {losses[-1]:.2f}; streamed {len(pieces)} chunks "
            f"over the OpenAI API, first token {1000 * (first or 0):.0f} ms"
        )
    finally:
        serve.shutdown()


def _train(console: Console, sim: Any, train_ds: Any, storage: str, *, fast: bool) -> Any:
    """The demo's training run, preempted once: with rayslice's fast recovery, or the path it had before."""
    import rayslice
    from rayslice import _demo_model
    from rayslice.train import CheckpointConfig, FailureConfig, JaxTrainer, RunConfig, ScalingConfig

    preempted: list[str] = []
    at = int(PREEMPT_AT * TRAIN_ROWS // (2 * BATCH_SIZE))

    def preempt_once(report: dict) -> None:
        if report["step"] >= at and not preempted:
            busy = [s.name for s in rayslice.list_slices() if s.state == "busy"]
            preempted.append(busy[0])
            console.print(f"[yellow]>>> host 1 of {busy[0]} preempted (simulated) at step {report['step']}[/yellow]")
            sim.preempt_host(busy[0], 1, wait=False)

    if fast:  # the defaults, plus the RAM tier: the loop hands its state over every step, the config decides
        checkpoints = CheckpointConfig(
            num_to_keep=2, ram_every_steps=RAM_EVERY, storage_every_steps=AFTER_STORAGE_EVERY
        )
        failures = FailureConfig(max_preemptions=3)
    else:  # detection by Ray's node death only, no notices, cold processes; storage every STORAGE_EVERY steps
        checkpoints = CheckpointConfig(num_to_keep=2)
        failures = FailureConfig(
            max_preemptions=3, heartbeat_timeout_s=600, preemption_notices=False, warm_spares=False
        )
    result = JaxTrainer(
        _demo_model.train_loop,
        train_loop_config={"lr": 1e-3, "batch_size": BATCH_SIZE, "every": 1 if fast else STORAGE_EVERY},
        scaling_config=ScalingConfig(topology="2x2x2", accelerator_type="TPU-V4"),
        run_config=RunConfig(
            name="demo" if fast else "demo-before",
            storage_path=storage,
            callbacks=[preempt_once],
            checkpoint_config=checkpoints,
            failure_config=failures,
            compilation_cache=fast,
        ),
        datasets={"train": train_ds},
        console=console,
    ).fit()
    if result.error is not None:
        raise RuntimeError(f"training failed: {result.error}")
    return result


def _restart_xla(before: Any, after: Any) -> str:
    """The restart's XLA compile (JAX's own timing) before -> after, with the persistent cache's hits."""
    if len(before.compiles) < 2 or len(after.compiles) < 2:
        return "no restart measured"
    b, a = before.compiles[1], after.compiles[1]
    return (
        f"restart's XLA compile {b['xla_s']:.2f} -> {a['xla_s']:.2f} s ({a['cache_hits']:.0f} cache hits; "
        f"first attempt {after.compiles[0]['xla_s']:.2f} s), trace + lower {a['trace_lower_s']:.2f} s"
    )


def _step(console: Console, n: int, text: str) -> None:
    console.rule(f"[bold]{n}. {text}")


def run_demo(console: Console, *, verbose: bool = False) -> None:
    """Runs the demo end to end; raises on any failure.

    Args:
        console: Where the story goes (see :func:`rayslice._tables.make_console`).
        verbose: Also show everything Ray prints (INFO logs, Ray Data progress,
            worker logs, raylet crash dumps); by default they stay in Ray's log files.
    """
    import ray

    import rayslice
    from rayslice.sim import SimulatedCluster, SliceSpec

    t_start = time.monotonic()
    specs = [SliceSpec(gen, shape, name=name) for gen, shape, name in SLICES]
    _step(console, 1, "Start a simulated TPU cluster (real multi-node Ray on this machine)")
    sim = SimulatedCluster(specs, verbose=verbose)
    with console.status(f"starting head + {sum(s.topology_info.num_hosts for s in specs)} simulated hosts"):
        sim.start()
    try:
        console.print(f"{sim.num_hosts} hosts up in {sim.startup_s:.1f} s at {sim.address}")

        _step(console, 2, "Slices as rayslice.list_slices() sees them")
        console.print(slices_table(rayslice.list_slices()))

        _step(console, 3, "One JAX process per host, every host of both slices")
        with console.status("reserving both slices and starting 4 JAX processes"):
            reports = rayslice.run_on_slice(
                _host_report, topology="2x2x2", accelerator_type="TPU-V4", num_slices=2, timeout_s=60
            )
        for r in reports:
            console.print(
                f"  {r['slice']} worker {r['worker']} (TPU_WORKER_ID={r['TPU_WORKER_ID']}): "
                f"rank {r['rank']}, {r['local']} local {r['platform']} devices, {r['global']} global"
            )

        _step(console, 4, "Reserve a whole slice while a host of slice-a is busy, then psum across its hosts")
        blocker = ray.util.placement_group(
            [{"TPU": 4}], bundle_label_selector=[{"ray.io/tpu-slice-name": "slice-a", "ray.io/tpu-worker-id": "1"}]
        )
        ray.get(blocker.ready(), timeout=30)
        try:
            console.print(rayslice.explain("2x2x2", "TPU-V4").explain())
            t0 = time.monotonic()
            with rayslice.slice_placement_group("2x2x2", "TPU-V4", timeout_s=60, name="demo") as spg:
                got = spg.slices[0]
                console.print(
                    f"reserved [bold]{got.name}[/bold] in {1000 * (time.monotonic() - t0):.0f} ms; "
                    f"bundles -> worker ids {[h.worker_id for h in got.hosts]}"
                )
                with rayslice.SliceGang(spg, init_timeout_s=60) as gang:
                    sums = gang.run(_psum, timeout_s=60)
                hosts, devs = spg.topology.num_hosts, spg.topology.devices_per_host
                expected = float(sum((rank + 1) * devs for rank in range(hosts)))
                console.print(f"psum over {hosts} hosts x {devs} devices = {sums} (expected {expected})")
                if any(s != expected for s in sums):
                    raise RuntimeError(f"psum gave {sums}, expected {expected}")
        finally:
            ray.util.remove_placement_group(blocker)

        _step(console, 5, "A shape the cluster does not have fails fast, with the reason")
        t0 = time.monotonic()
        try:
            rayslice.slice_placement_group("4x4", "TPU-V6E", timeout_s=60)
        except rayslice.NoMatchingSlice as e:
            console.print(f"NoMatchingSlice after {time.monotonic() - t0:.2f} s:\n{e}")

        summary = _train_and_infer(console, sim)
    finally:
        _step(console, 12, "Shut down")
        with console.status("stopping the simulated cluster"):
            sim.shutdown()
        left = _leftover_processes()
    state = "no processes left" if not left else f"{len(left)} leftover process(es) killed: {left}"
    lines = [f"demo finished in {time.monotonic() - t_start:.1f} s; cluster stopped, {state}"]
    lines += [f"{k}: {v}" for k, v in summary.items()] if "summary" in locals() else []
    console.print(Panel("\n".join(lines), title="summary", style="green"))


def _train_and_infer(console: Console, sim: Any) -> dict[str, str]:
    import ray

    import rayslice
    from rayslice import _demo_model
    from rayslice.sim import SliceSpec

    _step(console, 6, "Prepare data with Ray Data")
    rows = TRAIN_ROWS + TEST_ROWS
    ds = ray.data.range(rows).map_batches(_demo_model.make_features)
    train_ds, test_ds = ds.train_test_split(test_size=TEST_ROWS, seed=0)
    console.print(
        f"{rows} rows -> train {train_ds.count()}, test {test_ds.count()} (columns: {', '.join(ds.schema().names)})"
    )

    _step(console, 7, "Train on a 2-host slice; one host is preempted mid-run (before/after fast recovery)")
    storage = tempfile.mkdtemp(prefix="rayslice-demo-")
    console.print(
        "[bold]before[/bold]: the recovery path rayslice had before: a loss found when Ray declares the node "
        "dead, cold processes, compile from scratch, restore from the last storage checkpoint "
        f"(every {STORAGE_EVERY} steps)"
    )
    before = _train(console, sim, train_ds, storage, fast=False)
    with console.status("the node pool replaces the lost slice"):
        sim.add_slice(SliceSpec("TPU-V4", "2x2x2"))
    console.print(
        "[bold]after[/bold]: heartbeats inside the gang, warm spare processes, the compilation cache, "
        f"and a RAM checkpoint every {RAM_EVERY} steps (storage every {AFTER_STORAGE_EVERY})"
    )
    result = _train(console, sim, train_ds, storage, fast=True)
    if result.checkpoint is None or not result.metrics:
        raise RuntimeError("training finished without a checkpoint or metrics")
    checkpoint = result.checkpoint.path
    first, last = result.metrics_history[0]["loss"], result.metrics["loss"]
    console.print(
        f"trained {result.goodput.steps} steps: loss {first:.3f} -> {last:.3f}; "
        f"{result.preemptions} preemption(s), {result.attempts} attempts; checkpoint {checkpoint}"
    )

    metrics_line = _show_metrics(console)

    _step(console, 8, "The node pool replaces the lost slice")
    with console.status("adding a replacement slice"):
        new = sim.add_slice(SliceSpec("TPU-V4", "2x2x2"))
    console.print(slices_table(rayslice.list_slices()))
    console.print(f"replacement slice: {new}")

    _step(console, 9, "Batch inference over every test row with batch_predict (iter_jax_batches on each host)")
    t0 = time.monotonic()
    out = rayslice.batch_predict(
        test_ds,
        _demo_model.predict,
        setup=functools.partial(_demo_model.load_params, checkpoint),
        topology="2x2x2",
        accelerator_type="TPU-V4",
        batch_size=64,
        input_columns=["x"],
        keep_columns=["id", "y"],
    )
    preds = out.to_pandas()
    mse = float(((preds["prediction"] - preds["y"]) ** 2).mean())
    console.print(
        f"{len(preds)} predictions (of {test_ds.count()} rows, none padded) "
        f"in {time.monotonic() - t0:.1f} s; "
        f"test MSE {mse:.4f} (variance of y: {float(preds['y'].var()):.4f})"
    )
    served = _serve(console, checkpoint, preds)
    llm = _llm(console)
    g, b = result.goodput, before.goodput
    return {
        "training": f"{g.steps} steps, loss {first:.3f} -> {last:.3f}, {result.preemptions} preemption recovered",
        "goodput": f"before {100 * b.fraction:.1f}% -> after {100 * g.fraction:.1f}% productive "
        f"({b.wall_s:.1f} s -> {g.wall_s:.1f} s wall, {b.lost_steps} -> {g.lost_steps} steps recomputed)",
        "recovery costs": f"detection {b.seconds['detection']:.1f} -> {g.seconds['detection']:.1f} s, "
        f"start-up {b.seconds['startup']:.1f} -> {g.seconds['startup']:.1f} s, "
        f"compile {b.seconds['compile']:.1f} -> {g.seconds['compile']:.1f} s, "
        f"lost work {b.seconds['lost']:.1f} -> {g.seconds['lost']:.1f} s",
        "compile cache": _restart_xla(b, g),
        "batch inference": f"{len(preds)} rows, test MSE {mse:.4f}",
        "serving": served,
        "LLM serving": llm,
        "metrics": metrics_line,
        "checkpoint": checkpoint,
    }
