"""Host-to-device copy mechanisms on a GPU host, each against the pinned wire rate (issue 16, item 2).

The feeder's batches start in pageable memory (Ray's object store, or a
staging buffer). What reaches the pinned rate from there is a question of
mechanism, so this script measures every candidate in one run, on the same
batch sizes, in interleaved rounds (median [min, max] GB/s):

* ``pageable``       - ``jax.device_put`` of a pageable numpy array;
* ``pinned``         - ``jax.device_put`` of a ``pinned_host`` jax.Array (the wire: the limit);
* ``to_pinned``      - ``jax.device_put`` of pageable numpy into ``pinned_host`` (the host copy alone);
* ``staged``         - ``to_pinned`` then ``pinned`` (what the feeder's ``staging="pinned"`` does);
* ``cupy_pinned``    - CuPy's copy from ``cudaHostAlloc`` memory (the wire, measured outside JAX);
* ``put_cupy_pinned``- ``jax.device_put`` of a numpy view of ``cudaHostAlloc`` memory (does XLA DMA from it?);
* ``put_registered`` - ``jax.device_put`` of pageable memory pinned in place (``cudaHostRegister``);
* ``memcpy_N``       - N threads copying pageable rows into ``cudaHostAlloc`` memory (the host side of a
  staged pipeline: whether it can keep up with the wire);
* ``cupy_dlpack``    - CuPy's pinned copy, then the device array handed to JAX by DLPack (no copy).

Without a GPU it says so and measures nothing; ``--dry-run`` runs the JAX rows
on CPU devices (small sizes) to test this script. CuPy rows are skipped when
CuPy is not installed.

Usage: ``python benchmarks/bench_h2d.py [--dry-run] [rounds=N] [sizes_mb=4,16] [threads=N]``; the
last line is JSON. A bad option is refused with one line and exit status 2, before anything starts.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from _options import run_script  # benchmarks/ is on the path: the script's folder


def _spread(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def _rate(nbytes: int, fn: Callable[[], Any], reps: int) -> float:
    """GB/s of ``reps`` calls of ``fn`` (each moves ``nbytes``), after one warm-up call."""
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return nbytes * reps / (time.perf_counter() - t0) / 1e9


def _cupy() -> Any:
    try:
        import cupy

        cupy.cuda.runtime.getDeviceCount()
        return cupy
    except Exception:
        return None


def _mechanisms(jax: Any, np: Any, dev: Any, nbytes: int, threads: int, dry_run: bool) -> dict[str, Callable[[], Any]]:
    from jax.sharding import SingleDeviceSharding

    on_dev = SingleDeviceSharding(dev)
    kinds = {m.kind for m in dev.addressable_memories()}
    host = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    out: dict[str, Callable[[], Any]] = {
        "pageable": lambda: jax.device_put(host, on_dev).block_until_ready(),
    }
    if "pinned_host" in kinds:
        pinned_s = SingleDeviceSharding(dev, memory_kind="pinned_host")
        p = jax.device_put(host, pinned_s)
        p.block_until_ready()
        out["pinned"] = lambda: jax.device_put(p, on_dev).block_until_ready()
        out["to_pinned"] = lambda: jax.device_put(host, pinned_s).block_until_ready()
        out["staged"] = lambda: jax.device_put(jax.device_put(host, pinned_s), on_dev).block_until_ready()
    cp = None if dry_run else _cupy()
    if cp is None:
        return out
    import cupyx

    pinned_np = cupyx.empty_pinned((nbytes,), dtype=np.uint8)
    pinned_np[:] = host
    d = cp.empty((nbytes,), dtype=cp.uint8)
    stream = cp.cuda.Stream(non_blocking=True)

    def cupy_copy() -> Any:
        d.set(pinned_np, stream=stream)
        stream.synchronize()

    out["cupy_pinned"] = cupy_copy
    out["put_cupy_pinned"] = lambda: jax.device_put(pinned_np, on_dev).block_until_ready()
    # Pageable memory pinned in place: page-aligned, registered with CUDA for as long as it lives.
    raw = np.empty(nbytes + 4096, dtype=np.uint8)
    off = (-raw.ctypes.data) % 4096
    reg = raw[off : off + nbytes]
    reg[:] = host
    try:
        cp.cuda.runtime.hostRegister(reg.ctypes.data, nbytes, 0)
        out["put_registered"] = lambda: jax.device_put(reg, on_dev).block_until_ready()
    except Exception as e:
        print(f"cudaHostRegister failed: {e}", file=sys.stderr)
    pool = ThreadPoolExecutor(threads)
    chunks = [(i * nbytes // threads, (i + 1) * nbytes // threads) for i in range(threads)]

    def memcpy() -> None:
        list(pool.map(lambda c: np.copyto(pinned_np[c[0] : c[1]], host[c[0] : c[1]]), chunks))

    out[f"memcpy_{threads}"] = memcpy

    def one_thread() -> None:
        np.copyto(pinned_np, host)

    out["memcpy_1"] = one_thread

    def dlpack() -> Any:
        cupy_copy()
        return jax.dlpack.from_dlpack(d).block_until_ready()

    out["cupy_dlpack"] = dlpack
    return out


def run(dry_run: bool = False, rounds: int = 5, sizes_mb: tuple[int, ...] = (4, 16, 64), threads: int = 8) -> dict:
    if dry_run:
        os.environ["JAX_PLATFORMS"] = "cpu"
        sizes_mb, rounds = (1, 2), min(rounds, 2)
    elif not (os.path.exists("/dev/nvidiactl") or os.path.exists("/proc/driver/nvidia")):
        return {"skipped": "no GPU: no NVIDIA driver on this host; --dry-run runs the JAX rows on CPU devices"}
    import jax
    import numpy as np

    try:
        dev = jax.devices("cpu" if dry_run else "gpu")[0]
    except RuntimeError as e:
        return {"skipped": f"no GPU: JAX {jax.__version__} sees only {jax.devices()[0].platform} devices ({e})"}
    result: dict[str, Any] = {
        "device": str(getattr(dev, "device_kind", dev.platform)),
        "jax": jax.__version__,
        "dry_run": dry_run,
        "rounds": rounds,
        "sizes": {},
    }
    for mb in sizes_mb:
        nbytes = mb << 20
        fns = _mechanisms(jax, np, dev, nbytes, threads, dry_run)
        reps = max(3, min(50, (1 << 30) // nbytes))
        per: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(rounds):
            for k, fn in fns.items():
                per[k].append(_rate(nbytes, fn, reps))
        entry = {k: _spread(v) for k, v in per.items()}
        wire = "pinned" if "pinned" in per else "pageable"
        entry["vs_wire"] = {k: statistics.median(v) / statistics.median(per[wire]) for k, v in per.items()}
        result["sizes"][f"{mb}MB"] = entry
    return result


_USAGE = "bench_h2d.py [--dry-run] [rounds=N] [sizes_mb=4,16,64] [threads=N]"


def _print(r: dict[str, Any]) -> None:
    if "skipped" in r:
        print(f"skipped: {r['skipped']}", file=sys.stderr)
        return
    dry = " DRY RUN on CPU" if r["dry_run"] else ""
    print(f"{r['device']} (JAX {r['jax']}){dry}; {r['rounds']} rounds", file=sys.stderr)
    for size, e in r["sizes"].items():
        for k, v in e.items():
            if k != "vs_wire":
                print(
                    f"  {size:>5} {k:16s} {v['median']:7.1f} GB/s [{v['min']:.1f}, {v['max']:.1f}]  "
                    f"{e['vs_wire'][k]:.2f} of the wire",
                    file=sys.stderr,
                )


def main(argv: list[str]) -> int:
    return run_script(argv, _USAGE, run, _print)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
