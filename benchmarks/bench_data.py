"""Data feeding benchmark: rows/s and GB/s into device-sharded global arrays.

Same run, same data, same sharding (1-D over 4 CPU devices), batch 1024 rows:

* limit    - numpy batches already in memory + ``jax.device_put`` to the sharding;
* limit2   - the same with the next batch's ``device_put`` issued before the
             current one is waited on (what any prefetching feeder can reach);
* rayslice - ``rayslice.data.iter_jax_batches`` over the Ray Dataset;
* ray      - Ray 2.60's ``Dataset.iter_jax_batches`` over the same Dataset;
* naive    - ``Dataset.iter_batches`` + ``jax.device_put`` in a loop.

The Dataset (default 1M rows x 128 float32 = 0.5 GB) is materialized in the
object store first, so every method reads the same blocks. Each consumer
blocks on every batch, as a training step would. Runs in its own process
(XLA needs its device-count flag before JAX starts).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

GOAL_VS_LIMIT = 0.9
GOAL_VS_RAY = 1.8


def _consume(batches: Iterable[Any]) -> int:
    import jax

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


def _time(fn: Callable[[], Iterable[Any]], expect_rows: int) -> float:
    t0 = time.perf_counter()
    rows = _consume(fn())
    dt = time.perf_counter() - t0
    assert rows == expect_rows, (rows, expect_rows)
    return dt


def run(rows: int = 1_000_000, width: int = 128, batch_size: int = 1024, repeats: int = 3,
        num_devices: int = 4) -> dict[str, Any]:
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={num_devices}"
    import numpy as np
    import ray

    n = rows - rows % batch_size  # every method yields whole batches only
    nbytes = n * width * 4
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # Ray first: it forks helper processes, which must not happen after JAX starts threads.
    ray.init(num_cpus=2, object_store_memory=max(2 * nbytes, 200 * 2**20), include_dashboard=False,
             log_to_driver=False)
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from rayslice.data import iter_jax_batches

    assert jax.device_count() == num_devices
    sharding = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), PartitionSpec("data"))
    arr = np.random.default_rng(0).standard_normal((n, width), dtype=np.float32)
    try:
        ds = ray.data.from_numpy(arr).materialize()
        in_memory = [arr[i:i + batch_size] for i in range(0, n, batch_size)]
        methods: dict[str, Callable[[], Iterable[Any]]] = {
            "limit": lambda: (jax.device_put(b, sharding) for b in in_memory),
            "limit2": lambda: _ahead((jax.device_put(b, sharding) for b in in_memory)),
            "rayslice": lambda: iter_jax_batches(ds, batch_size=batch_size, sharding=sharding, ragged="drop"),
            "ray": lambda: ds.iter_jax_batches(batch_size=batch_size, drop_last=True),
            "naive": lambda: (jax.device_put(b["data"], sharding)
                              for b in ds.iter_batches(batch_size=batch_size, batch_format="numpy",
                                                       drop_last=True)),
        }
        times: dict[str, list[float]] = {k: [] for k in methods}
        for name, fn in methods.items():  # warm-up: compile paths, page in the store
            _time(fn, n)
        for _ in range(repeats):  # interleaved, so noise hits every method alike
            for name, fn in methods.items():
                times[name].append(_time(fn, n))
    finally:
        ray.shutdown()
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {"rows": n, "width": width, "batch_size": batch_size, "bytes": nbytes, "devices": num_devices,
              "platform": jax.devices()[0].platform,
              "rows_per_s": {k: n / v for k, v in med.items()},
              "gb_per_s": {k: nbytes / v / 1e9 for k, v in med.items()}}
    r = result["rows_per_s"]
    result["vs_limit"] = r["rayslice"] / r["limit"]
    result["vs_limit2"] = r["rayslice"] / r["limit2"]
    result["vs_ray"] = r["rayslice"] / r["ray"]
    result["vs_naive"] = r["rayslice"] / r["naive"]
    return result


if __name__ == "__main__":
    import json
    import sys

    # Prints one JSON line last, for benchmarks/run.py to read.
    print(json.dumps(run(**{k: int(v) for k, v in (a.split("=") for a in sys.argv[1:])})))


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
    with rayslice.slice_placement_group("2x2x2", "TPU-V4", timeout_s=60, progress=False) as spg, \
            rayslice.SliceGang(spg) as gang:
        gang.run(_agreement_steps, 50, batch_size, True)  # warm-up
        on, off = [], []
        for _ in range(rounds):
            off.append(max(gang.run(_agreement_steps, steps, batch_size, False)))
            on.append(max(gang.run(_agreement_steps, steps, batch_size, True)))
    on_s, off_s = statistics.median(on), statistics.median(off)
    return {"steps": steps, "hosts": spg.num_hosts, "with_us": 1e6 * on_s, "without_us": 1e6 * off_s,
            "cost_us": 1e6 * (on_s - off_s)}
