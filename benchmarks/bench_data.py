"""Data feeding benchmark: the feeder against the true limits, measured in the same run.

CPU mode (``python benchmarks/bench_data.py [rows=N] [repeats=N] [passes=N]``; what ``make bench`` runs):
same Dataset (default 1M rows x 128 float32 = 0.5 GB, materialized in the
object store), same sharding (1-D over 4 CPU devices), batch 1024 rows, each
consumer blocking on every batch:

* limit       - ``jax.device_put`` of the *same* 64-byte aligned views of the
                object-store blocks the feeder reads (JAX aliases them on CPU:
                no copy); the true limit;
* limit_copy  - ``device_put`` of 16-byte aligned numpy slices (JAX copies those);
* limit_bulk  - one ``device_put`` of 64 batches at a time (per-call cost amortized);
* limit2      - ``limit`` with the next ``device_put`` issued one ahead;
* rayslice    - ``rayslice.data.iter_jax_batches`` (default ``pipeline="auto"``: sync on CPU);
* rayslice_thread - the same with ``pipeline="thread"`` (the prefetch thread);
* ray         - Ray 2.60's ``Dataset.iter_jax_batches``;
* naive       - ``Dataset.iter_batches`` + ``jax.device_put``;
* step_*      - a consumer running a real jitted step per batch: on resident
                data (the limit), fed by rayslice (auto / thread), fed by Ray;
* rebatch     - 8k-row blocks into 64k-row batches (rows written into staging).

Every method runs ``repeats`` rounds (default 5), interleaved; in each round
it makes ``passes`` passes (default 3) back to back and keeps the fastest, the
one least disturbed by other guests of the VM's host (steal time moves a
0.1 s pass by up to 3x on the 2-core container). Each ratio is computed per
round and reported as median, min and max.

GPU mode (``python benchmarks/bench_data.py --gpu [--dry-run]``): see
:func:`run_gpu`. Runs in its own process (XLA needs its flags before JAX starts).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from _options import parse_options  # benchmarks/ is on the path: the script's folder, or run.py's

GOAL_VS_LIMIT = 0.9
GOAL_VS_RAY = 2.0
GOAL_STEP = 0.98  # step rate fed by the feeder / with data already resident
GPU_GOAL_VS_PINNED = 0.8
GPU_GOAL_VS_RAY = 2.5
STEP_MS = 5.0  # the GPU's training-like step, on data already on the device


def _consume(batches: Iterable[Any]) -> int:
    rows = 0
    for b in batches:
        x = b["data"] if isinstance(b, dict) else b
        x.block_until_ready()
        rows += x.shape[0]
    return rows


def _ahead(it: Iterable[Any]) -> Iterable[Any]:
    """Issues one item ahead of the consumer (device_put returns before the copy ends)."""
    prev = None
    for x in it:
        if prev is not None:
            yield prev
        prev = x
    if prev is not None:
        yield prev


def _bulk(batches: list[Any], sharding: Any, group: int = 64) -> Iterable[Any]:
    import jax

    for i in range(0, len(batches), group):
        part = batches[i : i + group]
        yield from jax.device_put(part, [sharding] * len(part))


def _time(
    fn: Callable[[], Iterable[Any]], expect_rows: int, consume: Callable[[Iterable[Any]], int] = _consume
) -> float:
    t0 = time.perf_counter()
    rows = consume(fn())
    dt = time.perf_counter() - t0
    assert rows == expect_rows, (rows, expect_rows)
    return dt


def _stepper(width: int, sharding: Any, layers: int = 1) -> Callable[[Iterable[Any]], int]:
    """A consumer running a training-like jitted step (two matmuls per row block) on every batch.

    The step is per-shard (no collective: XLA's CPU collectives can stall with many
    executions in flight on 2 cores) and, like a training loop, waits for step i-1
    when it has dispatched step i.
    """
    import jax
    import jax.numpy as jnp

    w = jax.device_put(jnp.full((width, width), 0.01, jnp.float32))

    @jax.jit
    def step(x: Any) -> Any:
        if layers > 1:  # a longer step (GPU): the same layer repeated
            x = jax.lax.fori_loop(0, layers - 1, lambda _, h: jnp.tanh(h @ w), x)
        return (jnp.tanh(x @ w) @ w).sum(axis=1)

    def consume(batches: Iterable[Any]) -> int:
        prev, rows = None, 0
        for b in batches:
            x = b["data"] if isinstance(b, dict) else b
            out = step(x)
            if prev is not None:
                prev.block_until_ready()
            prev = out
            rows += x.shape[0]
        if prev is not None:
            prev.block_until_ready()
        return rows

    return consume


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def _verdict(v: dict[str, float], goal: float | None = None, digits: int = 2) -> str:
    """A spread as ``median M [min A, max B]``, with the goal's verdict when there is one."""
    text = f"median {v['median']:.{digits}f} [min {v['min']:.{digits}f}, max {v['max']:.{digits}f}]"
    return text if goal is None else f"{text}  goal >= {goal}: {'met' if v['median'] >= goal else 'NOT met'}"


def _blocks_numpy(ds: Any) -> list[Any]:
    """The Dataset's blocks as numpy views of the object store, in order (as the feeder reads them)."""
    return [b["data"] for b in ds.iter_batches(batch_size=None, batch_format="numpy")]


def run(
    rows: int = 1_000_000,
    width: int = 128,
    batch_size: int = 1024,
    repeats: int = 5,
    passes: int = 3,
    num_devices: int = 4,
    rebatch_block: int = 8192,
    rebatch_batch: int = 65536,
) -> dict[str, Any]:
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={num_devices}"
    import numpy as np
    import ray

    n = rows - rows % batch_size  # every method yields whole batches only
    nbytes = n * width * 4
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # Ray first: it forks helper processes, which must not happen after JAX starts threads.
    ray.init(num_cpus=2, object_store_memory=max(3 * nbytes, 300 * 2**20), include_dashboard=False, log_to_driver=False)
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from rayslice.data import iter_jax_batches
    from rayslice.data._staging import is_aligned

    assert jax.device_count() == num_devices
    sharding = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), PartitionSpec("data"))
    arr = np.random.default_rng(0).standard_normal((n, width), dtype=np.float32)
    rb_rows = (min(n, 4 * rebatch_batch) // rebatch_batch) * rebatch_batch
    try:
        ds = ray.data.from_numpy(arr).materialize()
        ds_small = (
            ray.data.from_numpy(arr[:rb_rows]).repartition(rb_rows // rebatch_block).materialize() if rb_rows else None
        )
        # The limit reads the same object-store memory as the feeder: views of its blocks.
        store = _blocks_numpy(ds)
        views = [
            v
            for blk in store
            for v in (blk[i : i + batch_size] for i in range(0, len(blk), batch_size))
            if len(v) == batch_size
        ][: n // batch_size]
        copies = [arr[i : i + batch_size] for i in range(0, n, batch_size)]
        # numpy's own large allocations are 16-byte aligned: JAX copies them.
        copies16 = copies if not is_aligned(arr) else [c.copy() for c in copies]
        aligned_views = sum(is_aligned(v) for v in views) / len(views)
        consume_step = _stepper(width, sharding)
        resident = [jax.device_put(v, sharding) for v in views]
        jax.block_until_ready(resident)
        feed = dict(batch_size=batch_size, sharding=sharding, ragged="drop")
        methods: dict[str, tuple[Callable[[], Iterable[Any]], Any]] = {
            "limit": (lambda: (jax.device_put(b, sharding) for b in views), _consume),
            "limit_copy": (lambda: (jax.device_put(b, sharding) for b in copies16), _consume),
            "limit_bulk": (lambda: _bulk(views, sharding), _consume),
            "limit2": (lambda: _ahead(jax.device_put(b, sharding) for b in views), _consume),
            "rayslice": (lambda: iter_jax_batches(ds, **feed), _consume),
            "rayslice_thread": (lambda: iter_jax_batches(ds, pipeline="thread", **feed), _consume),
            "ray": (lambda: ds.iter_jax_batches(batch_size=batch_size, drop_last=True), _consume),
            "naive": (
                lambda: (
                    jax.device_put(b["data"], sharding)
                    for b in ds.iter_batches(batch_size=batch_size, batch_format="numpy", drop_last=True)
                ),
                _consume,
            ),
            "step_resident": (lambda: iter(resident), consume_step),
            "step_rayslice": (lambda: iter_jax_batches(ds, **feed), consume_step),
            "step_rayslice_thread": (lambda: iter_jax_batches(ds, pipeline="thread", **feed), consume_step),
            "step_ray": (lambda: ds.iter_jax_batches(batch_size=batch_size, drop_last=True), consume_step),
        }
        expect = {k: n for k in methods}
        if ds_small is not None:
            big = [a for a in (arr[i : i + rebatch_batch] for i in range(0, rb_rows, rebatch_batch))]
            big_aligned = [jax.numpy.asarray(b) for b in big]  # warm allocation paths
            del big_aligned
            methods["rebatch_limit"] = (
                lambda: (
                    jax.device_put(
                        np.concatenate([b[i : i + rebatch_block] for i in range(0, len(b), rebatch_block)]), sharding
                    )
                    for b in big
                ),
                _consume,
            )
            methods["rebatch"] = (
                lambda: iter_jax_batches(ds_small, batch_size=rebatch_batch, sharding=sharding, ragged="drop"),
                _consume,
            )
            methods["rebatch_ray"] = (
                lambda: ds_small.iter_jax_batches(batch_size=rebatch_batch, drop_last=True),
                _consume,
            )
            expect.update(rebatch_limit=rb_rows, rebatch=rb_rows, rebatch_ray=rb_rows)
        times: dict[str, list[float]] = {k: [] for k in methods}
        for name, (fn, consume) in methods.items():  # warm-up: compile paths, page in the store
            _time(fn, expect[name], consume)
        for _ in range(repeats):  # interleaved, so noise hits every method alike
            for name, (fn, consume) in methods.items():
                times[name].append(min(_time(fn, expect[name], consume) for _ in range(passes)))
    finally:
        ray.shutdown()

    def ratio(a: str, b: str) -> dict[str, float]:  # per round: a's rate / b's rate
        return _spread([tb / ta for ta, tb in zip(times[a], times[b])])

    med = {k: statistics.median(v) for k, v in times.items()}
    result: dict[str, Any] = {
        "rows": n,
        "width": width,
        "batch_size": batch_size,
        "bytes": nbytes,
        "devices": num_devices,
        "platform": jax.devices()[0].platform,
        "repeats": repeats,
        "passes": passes,
        "aligned_views": aligned_views,
        "limit_copy_aligned": float(np.mean([is_aligned(c) for c in copies16])),
        "rows_per_s": {k: expect[k] / v for k, v in med.items()},
        "gb_per_s": {k: expect[k] * width * 4 / v / 1e9 for k, v in med.items()},
        "rebatch": {"rows": rb_rows, "block": rebatch_block, "batch": rebatch_batch},
    }
    spreads = {
        "vs_limit": ratio("rayslice", "limit"),
        "vs_limit2": ratio("rayslice", "limit2"),
        "vs_limit_copy": ratio("rayslice", "limit_copy"),
        "vs_limit_bulk": ratio("rayslice", "limit_bulk"),
        "vs_ray": ratio("rayslice", "ray"),
        "vs_naive": ratio("rayslice", "naive"),
        "thread_vs_limit": ratio("rayslice_thread", "limit"),
        "step_vs_resident": ratio("step_rayslice", "step_resident"),
        "step_thread_vs_resident": ratio("step_rayslice_thread", "step_resident"),
        "step_ray_vs_resident": ratio("step_ray", "step_resident"),
    }
    if rb_rows:
        spreads["rebatch_vs_limit"] = ratio("rebatch", "rebatch_limit")
        spreads["rebatch_vs_ray"] = ratio("rebatch", "rebatch_ray")
    result["spread"] = spreads
    result.update({k: v["median"] for k, v in spreads.items()})
    return result


def _print_cpu(r: dict[str, Any]) -> None:
    print(
        f"{r['rows']:,} rows x {r['width']} f32, batch {r['batch_size']}, {r['devices']} {r['platform']} devices, "
        f"{r['repeats']} rounds of the best of {r['passes']} passes; "
        f"object-store views 64-byte aligned: {100 * r['aligned_views']:.0f}%, "
        f"copy-limit slices: {100 * r['limit_copy_aligned']:.0f}%",
        file=sys.stderr,
    )
    for k, v in r["rows_per_s"].items():
        print(f"  {k:22s} {v / 1e6:8.2f} M rows/s  {r['gb_per_s'][k]:7.2f} GB/s", file=sys.stderr)
    for k, v in r["spread"].items():
        print(f"  {k:26s} median {v['median']:.3f}  [min {v['min']:.3f}, max {v['max']:.3f}]", file=sys.stderr)


# -- GPU mode ---------------------------------------------------------------------------------------------------


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _in_flight(jax: Any, src: Any, target: Any, reps: int, threads: int = 1) -> float:
    """GB/s of ``reps`` ``device_put``s of ``src`` to ``target``, all in flight, issued from ``threads`` threads.

    Each way of issuing is warmed up first (a pool's threads started too), outside the timed region.
    """

    def issue(k: int) -> list[Any]:
        return [jax.device_put(src, target) for _ in range(k)]

    if threads == 1:
        jax.block_until_ready(issue(1))
        t0 = time.perf_counter()
        jax.block_until_ready(issue(reps))
        return _gbps(src.nbytes * reps, time.perf_counter() - t0)
    shares = [reps // threads + (i < reps % threads) for i in range(threads)]
    with ThreadPoolExecutor(threads) as pool:
        jax.block_until_ready(list(pool.map(issue, [1] * threads)))
        t0 = time.perf_counter()
        jax.block_until_ready(list(pool.map(issue, shares)))
        return _gbps(src.nbytes * reps, time.perf_counter() - t0)


def _h2d(jax: Any, host: Any, dev_sharding: Any, pinned_sharding: Any, reps: int) -> dict[str, float]:
    """Host->device GB/s of one batch: pageable numpy, and from a JAX pinned_host array."""
    out = {"pageable": _in_flight(jax, host, dev_sharding, reps)}
    if pinned_sharding is not None:
        p = jax.device_put(host, pinned_sharding)
        out["pinned"] = _in_flight(jax, p, dev_sharding, reps)
        # The same puts issued from two threads: whether a transfer's fixed cost is host
        # work in the issuing thread that a second thread overlaps (then this is the limit).
        out["pinned_2threads"] = _in_flight(jax, p, dev_sharding, reps, threads=2)
    return out


def _cupy_pinned(nbytes: int, reps: int) -> float | None:
    """Pinned H2D GB/s with CuPy (cudaMemcpyAsync from cudaHostAlloc memory), if CuPy is there."""
    try:
        import cupy as cp
        import cupyx
    except Exception:
        return None
    import numpy as np

    src = cupyx.empty_pinned((nbytes,), dtype=np.uint8)
    src[:] = 1
    dst = cp.empty((nbytes,), dtype=cp.uint8)
    stream = cp.cuda.Stream(non_blocking=True)
    dst.set(src, stream=stream)
    stream.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.set(src, stream=stream)
    stream.synchronize()
    return _gbps(nbytes * reps, time.perf_counter() - t0)


REBATCH_ROWS = 8192  # rows per block of the GPU benchmark's many-small-blocks Dataset


def _time_steady(fn: Callable[[], Iterable[Any]], expect_rows: int) -> tuple[float, float, int]:
    """(whole pass, time to the first batch, rows after the first batch) of one pass, in seconds.

    The rate from the first batch on is the stream's steady throughput, comparable with a
    bandwidth; the time to the first batch (starting the iterator, the first block fetch)
    is reported apart: a pass of 1 GB at the wire's rate lasts ~20 ms, so a few ms of start
    would otherwise read as a lower bandwidth.
    """
    t0 = time.perf_counter()
    it = iter(fn())
    rows = 0
    t_first = None
    first_rows = 0
    for b in it:
        x = b["data"] if isinstance(b, dict) else b
        if t_first is None:
            t_first = time.perf_counter() - t0
            first_rows = x.shape[0]
        x.block_until_ready()
        rows += x.shape[0]
    total = time.perf_counter() - t0
    assert rows == expect_rows, (rows, expect_rows)
    return total, t_first or 0.0, rows - first_rows


def _timed_steps(fn: Callable[[], Iterable[Any]], expect_rows: int, consume: Callable[[Iterable[Any]], int]) -> float:
    """Seconds per step of one pass, from the first batch in hand to the last step's end."""
    it = iter(fn())
    head = next(it)
    t0 = time.perf_counter()

    def stream() -> Iterable[Any]:
        yield head
        yield from it

    rows = consume(stream())
    dt = time.perf_counter() - t0
    assert rows == expect_rows, (rows, expect_rows)
    x = head["data"] if isinstance(head, dict) else head
    return dt / (expect_rows // x.shape[0])


def _step_rounds(
    methods: dict[str, Callable[[], Iterable[Any]]], n: int, consume: Callable[[Iterable[Any]], int], repeats: int
) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {k: [] for k in methods}
    for fn in methods.values():
        _timed_steps(fn, n, consume)
    for _ in range(repeats):
        for name, fn in methods.items():
            out[name].append(_timed_steps(fn, n, consume))
    return out


def _training_step(
    width: int, sharding: Any, resident: list[Any], bs: int, dry_run: bool
) -> tuple[Callable[[Iterable[Any]], int], int]:
    """A training-like step of ~STEP_MS on data already on the device (GPU): as many layers as that takes."""
    n = len(resident) * bs
    layers = 1
    if dry_run:
        return _stepper(width, sharding), layers
    for _ in range(3):  # step time = fixed + per layer: converges in a few rounds
        probe_layers = layers * 8 if layers == 1 else layers
        probe = _stepper(width, sharding, probe_layers)
        _time(lambda: iter(resident), n, probe)  # compiles
        t = min(_time(lambda: iter(resident), n, probe) for _ in range(3)) / len(resident)
        layers = max(1, round(probe_layers * STEP_MS * 1e-3 / t))
    return _stepper(width, sharding, layers), layers


def _dry_run_sizes(rows: int, repeats: int) -> tuple[int, tuple[int, ...], int]:
    """A dry run's ``(rows, sizes_mb, repeats)``, on CPU devices (a test of an accelerator script)."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    return min(rows, 65536), (1, 2), min(repeats, 2)


def run_gpu(
    dry_run: bool = False,
    rows: int = 2_000_000,
    width: int = 128,
    repeats: int = 5,
    sizes_mb: tuple[int, ...] = (4, 8, 16, 32),
) -> dict[str, Any]:
    """GPU host: pinned and pageable H2D, rayslice vs Ray's iter_jax_batches, and a fed training step.

    Per batch size (4-32 MB of a 2M x 128 float32 materialized Dataset, one block):
    ``pinned`` (10 ``device_put``s in flight of a ``pinned_host`` array: the limit a JAX
    program sees; ``pinned_2threads``, the same 10 issued from two threads, and
    ``vs_pinned_best``, rayslice against the faster of the two in each round),
    ``cupy_pinned`` (a CUDA copy from ``cudaHostAlloc`` memory: the wire),
    ``pageable``; then, in phase 1 (Ray's store as any process has it) Ray's
    ``iter_jax_batches`` and rayslice's ``staging="pinned"``/``"pageable"``, and in phase 2
    rayslice's default (which registers the store with CUDA, once per process) and Ray
    again on the registered store. Rates count from the first batch on (the stream's
    throughput); whole-pass rates and the time to the first batch are reported too. Then
    8k-row blocks rebatched into 32 MB batches, and a ~5 ms jitted step fed by the feeder
    (and by Ray, in phase 1) against the same step on data already on the device.

    Needs JAX with a GPU backend and Ray (e.g. installed from ``shared/gpu/pack.sh``'s
    tarball); no network. ``dry_run`` runs the same code path on CPU devices with
    small sizes (for testing this script); without a GPU and without ``dry_run`` it
    returns ``{"skipped": ...}`` and measures nothing.
    """
    if dry_run:
        rows, sizes_mb, repeats = _dry_run_sizes(rows, repeats)
    elif not (os.path.exists("/dev/nvidiactl") or os.path.exists("/proc/driver/nvidia")):
        return {
            "skipped": "no GPU: no NVIDIA driver on this host (/dev/nvidiactl); --gpu --dry-run runs "
            "the same code on CPU devices"
        }
    try:
        import numpy as np
        import ray
    except Exception as e:
        return {"skipped": f"no Ray here ({type(e).__name__}: {e}); install it from the packed tarball"}
    if not ray.is_initialized():  # before JAX starts its threads: Ray forks helper processes
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ray.init(
            num_cpus=min(8, os.cpu_count() or 2),
            object_store_memory=max(3 * rows * width * 4, 300 * 2**20),
            include_dashboard=False,
            log_to_driver=False,
        )
    import jax

    try:
        devs = jax.devices("cpu" if dry_run else "gpu")
    except RuntimeError as e:
        ray.shutdown()
        return {"skipped": f"no GPU: JAX {jax.__version__} sees only {jax.devices()[0].platform} devices ({e})"}
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    dev = devs[0]
    sharding = NamedSharding(Mesh(np.array([dev]), ("data",)), PartitionSpec("data"))
    kinds = {m.kind for m in dev.addressable_memories()}
    pinned = sharding.with_memory_kind("pinned_host") if "pinned_host" in kinds else None
    result: dict[str, Any] = {
        "device": str(getattr(dev, "device_kind", dev.platform)),
        "platform": dev.platform,
        "jax": jax.__version__,
        "dry_run": dry_run,
        "rows": rows,
        "width": width,
        "repeats": repeats,
        "memory_kinds": sorted(kinds),
        "sizes": {},
    }
    row_bytes = width * 4
    arr = np.random.default_rng(0).standard_normal((rows, width), dtype=np.float32)
    from rayslice.data import iter_jax_batches

    try:
        ds = ray.data.from_numpy(arr).materialize()
        small = ray.data.from_numpy([arr[i : i + REBATCH_ROWS] for i in range(0, rows, REBATCH_ROWS)]).materialize()
        big = sizes_mb[-1] * 2**20 // row_bytes
        resident = [jax.device_put(arr[i : i + big], sharding) for i in range(0, rows - rows % big, big)]
        jax.block_until_ready(resident)
        consume_step, layers = _training_step(width, sharding, resident, big, dry_run)
        # Phase 1, Ray's object store as a user's process has it: Ray and rayslice's paths that
        # leave it alone. Phase 2: rayslice's default, which registers the store for DMA once per
        # process (from then on every view of it is pinned memory, for any reader, Ray's too).
        phases = {
            "plain": lambda bs: {
                "ray": lambda: ds.iter_jax_batches(batch_size=bs, drop_last=True),
                "rayslice_pinned": lambda: iter_jax_batches(ds, staging="pinned", **feed(bs)),
                "rayslice_pageable": lambda: iter_jax_batches(ds, staging="pageable", **feed(bs)),
            },
            "registered": lambda bs: {
                "rayslice": lambda: iter_jax_batches(ds, **feed(bs)),
                "ray_registered": lambda: ds.iter_jax_batches(batch_size=bs, drop_last=True),
            },
        }

        def feed(bs: int) -> dict[str, Any]:
            return dict(batch_size=bs, sharding=sharding, ragged="drop")

        per_size: dict[int, dict[str, list[float]]] = {mb: {} for mb in sizes_mb}
        first: dict[int, dict[str, list[float]]] = {mb: {} for mb in sizes_mb}
        for phase, make in phases.items():
            for mb in sizes_mb:
                bs = mb * 2**20 // row_bytes
                n = rows - rows % bs
                host = arr[:bs].copy()
                per, lat = per_size[mb], first[mb]
                methods = make(bs)
                for fn in methods.values():  # warm-up (and, in phase 2, the store's registration)
                    _time(fn, n)
                for _ in range(repeats):
                    if phase == "plain":
                        for k, v in _h2d(jax, host, sharding, pinned, 10).items():
                            per.setdefault(k, []).append(v)
                    for name, fn in methods.items():
                        total, t_first, steady_rows = _time_steady(fn, n)
                        per.setdefault(name, []).append(_gbps(steady_rows * row_bytes, total - t_first))
                        lat.setdefault(name, []).append(1e3 * t_first)
                        per.setdefault(name + "_whole", []).append(_gbps(n * row_bytes, total))
            if phase == "plain":  # Ray fed steps, before the store is registered
                steps_plain = _step_rounds(
                    {
                        "resident": lambda: iter(resident),
                        "ray": lambda: ds.iter_jax_batches(batch_size=big, drop_last=True),
                    },
                    rows - rows % big,
                    consume_step,
                    repeats,
                )
        for mb in sizes_mb:
            per = per_size[mb]
            if not dry_run:
                per["cupy_pinned"] = [v for v in [_cupy_pinned(mb * 2**20, 20)] if v is not None]
            entry: dict[str, Any] = {k: _spread(v) for k, v in per.items() if v}
            ref = "pinned" if "pinned" in per else "pageable"
            entry["vs_pinned"] = _spread([a / b for a, b in zip(per["rayslice"], per[ref])])
            if "pinned_2threads" in per:  # against JAX's best way of issuing pinned puts, per round
                best = [max(a, b) for a, b in zip(per["pinned"], per["pinned_2threads"])]
                entry["vs_pinned_best"] = _spread([a / b for a, b in zip(per["rayslice"], best)])
            entry["vs_ray"] = _spread([a / b for a, b in zip(per["rayslice"], per["ray"])])
            entry["first_batch_ms"] = {k: _spread(v) for k, v in first[mb].items()}
            result["sizes"][f"{mb}MB"] = entry
        from rayslice.data._storepin import store_pinning

        pin = store_pinning()  # registered during phase 2's first warm-up pass, outside the timed rounds
        result["store_pinning"] = {
            "registered_mib": sum(e - s for s, e in pin.registered) >> 20,
            "seconds": pin.seconds,
            "failure": pin.failure,
        }
        # Many small blocks into 32 MB batches: the defaults (on a GPU, rows written straight into
        # a staging buffer), and each block's piece sent as it is (DMA from the store), joined on the device.
        re_methods = {
            "rayslice": lambda: iter_jax_batches(small, batch_size=big, sharding=sharding, ragged="drop"),
            "rayslice_device_join": lambda: iter_jax_batches(
                small, batch_size=big, sharding=sharding, ragged="drop", assemble="device"
            ),
            "ray": lambda: small.iter_jax_batches(batch_size=big, drop_last=True),
        }
        rb: dict[str, list[float]] = {k: [] for k in re_methods}
        for fn in re_methods.values():
            _time(fn, rows - rows % big)
        for _ in range(repeats):
            for name, fn in re_methods.items():
                rb[name].append(_gbps((rows - rows % big) * row_bytes, _time(fn, rows - rows % big)))
        result["rebatch"] = {
            "block_rows": REBATCH_ROWS,
            "batch_rows": big,
            "note": "Ray's rate measured after the store's registration (it reads the same pinned memory)",
            **{k: _spread(v) for k, v in rb.items()},
            "vs_ray": _spread([a / b for a, b in zip(rb["rayslice"], rb["ray"])]),
            "device_join_vs_default": _spread([a / b for a, b in zip(rb["rayslice_device_join"], rb["rayslice"])]),
        }
        # A training-like step (~STEP_MS) fed by the feeder vs on data already on the device.
        steps_reg = _step_rounds(
            {
                "resident": lambda: iter(resident),
                "rayslice": lambda: iter_jax_batches(ds, batch_size=big, sharding=sharding, ragged="drop"),
            },
            rows - rows % big,
            consume_step,
            repeats,
        )
        result["step"] = {
            "batch_rows": big,
            "layers": layers,
            "step_ms": 1e3 * statistics.median(steps_reg["resident"]),
            "rayslice_vs_resident": _spread([r / f for r, f in zip(steps_reg["resident"], steps_reg["rayslice"])]),
            "ray_vs_resident": _spread([r / f for r, f in zip(steps_plain["resident"], steps_plain["ray"])]),
        }
    finally:
        ray.shutdown()
    return result


def _print_gpu(r: dict[str, Any]) -> None:
    if "skipped" in r:
        print(f"GPU benchmark skipped: {r['skipped']}", file=sys.stderr)
        return
    print(
        f"{r['device']} ({r['platform']}, JAX {r['jax']}){' DRY RUN on CPU' if r['dry_run'] else ''}; "
        f"{r['rows']:,} x {r['width']} f32; memory kinds {r['memory_kinds']}; {r['repeats']} rounds",
        file=sys.stderr,
    )
    skip = ("vs_pinned", "vs_pinned_best", "vs_ray", "first_batch_ms")
    for size, e in r["sizes"].items():
        bw = "  ".join(f"{k} {v['median']:.1f}" for k, v in e.items() if k not in skip and not k.endswith("_whole"))
        whole = "  ".join(f"{k[:-6]} {v['median']:.1f}" for k, v in e.items() if k.endswith("_whole"))
        lat = "  ".join(f"{k} {v['median']:.1f}" for k, v in e["first_batch_ms"].items())
        print(f"  {size:>5}: GB/s from the first batch on: {bw}", file=sys.stderr)
        print(f"         GB/s whole pass (with its start): {whole}", file=sys.stderr)
        print(f"         ms to the first batch: {lat}", file=sys.stderr)
        for k, goal in (
            ("vs_pinned", GPU_GOAL_VS_PINNED),
            ("vs_pinned_best", GPU_GOAL_VS_PINNED),
            ("vs_ray", GPU_GOAL_VS_RAY),
        ):
            if k not in e:
                continue
            print(f"         rayslice {k}: {_verdict(e[k], goal)}", file=sys.stderr)
    sp = r["store_pinning"]
    print(
        f"  object store registered for DMA: {sp['registered_mib']} MiB in {sp['seconds']:.2f} s (once per process)"
        + (f"; off: {sp['failure']}" if sp["failure"] else ""),
        file=sys.stderr,
    )
    rb = r["rebatch"]
    print(
        f"  rebatch {rb['block_rows']}-row blocks -> {rb['batch_rows']}-row batches: GB/s rayslice "
        f"{rb['rayslice']['median']:.1f} (joined on the device: {rb['rayslice_device_join']['median']:.1f}), "
        f"Ray {rb['ray']['median']:.1f}; vs_ray median {rb['vs_ray']['median']:.2f} "
        f"[min {rb['vs_ray']['min']:.2f}, max {rb['vs_ray']['max']:.2f}]; "
        f"device join vs default {_verdict(rb['device_join_vs_default'])}",
        file=sys.stderr,
    )
    s = r["step"]
    for k in ("rayslice_vs_resident", "ray_vs_resident"):
        goal = GOAL_STEP if k.startswith("rayslice") else None
        print(f"  step {s['step_ms']:.2f} ms ({s['layers']} layers), {k}: {_verdict(s[k], goal, 3)}", file=sys.stderr)


_USAGE = "bench_data.py [--gpu [--dry-run]] [rows=N] [repeats=N] [sizes_mb=4,8 (with --gpu)]"


def main(argv: list[str]) -> int:
    import json

    try:
        flags, kwargs = parse_options(argv, {"--gpu", "--dry-run"}, _USAGE, lambda f: run_gpu if "--gpu" in f else run)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    if "--gpu" in flags:
        result = run_gpu(dry_run="--dry-run" in flags, **kwargs)
        _print_gpu(result)
    else:
        result = run(**kwargs)
        _print_cpu(result)
    print(json.dumps(result))  # one JSON line last, for benchmarks/run.py to read
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


def _agreement_steps(steps: int, batch_size: int, agree: bool) -> float:
    # Runs on each host of a reserved slice: the feeder alone, small batches, so
    # the per-step agreement cost is not hidden behind a large transfer.
    import time

    import numpy as np

    from rayslice.data import iter_jax_batches

    source = [{"x": np.zeros((batch_size * steps, 8), np.float32)}]
    t0 = time.perf_counter()
    for b in iter_jax_batches(source, batch_size=batch_size, agree=agree):
        b["x"].block_until_ready()
    return (time.perf_counter() - t0) / steps


def agreement_cost(steps: int = 500, batch_size: int = 64, rounds: int = 3) -> dict[str, float]:
    """Per-step time with and without multi-host agreement on a 2-host simulated slice.

    Needs a connected cluster with a free v4 2x2x2 slice (benchmarks/run.py provides it).
    """
    import sys

    from ray import cloudpickle

    import rayslice

    # Ship this module's functions by value: hosts cannot import benchmarks/.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    with (
        rayslice.slice_placement_group("2x2x2", "TPU-V4", timeout_s=60, progress=False) as spg,
        rayslice.SliceGang(spg) as gang,
    ):
        gang.run(_agreement_steps, 50, batch_size, True)  # warm-up
        on, off = [], []
        for _ in range(rounds):
            off.append(max(gang.run(_agreement_steps, steps, batch_size, False)))
            on.append(max(gang.run(_agreement_steps, steps, batch_size, True)))
    on_s, off_s = statistics.median(on), statistics.median(off)
    return {
        "steps": steps,
        "hosts": spg.num_hosts,
        "with_us": 1e6 * on_s,
        "without_us": 1e6 * off_s,
        "cost_us": 1e6 * (on_s - off_s),
    }
