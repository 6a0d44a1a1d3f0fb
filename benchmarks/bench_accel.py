"""The feeder on an accelerator host where Ray cannot run, against that host's own host-to-device limits.

Issue 16 asks for a feeder that reaches the wire "on accelerators". The GPU row
(``bench_data.py --gpu``) needs Ray's object store; this script measures the
part of the feeder that runs after it (rebatching, staging, the transfer, the
prefetch thread) on any JAX accelerator, with no Ray and no network: e.g. a
TPU VM that opens no sockets. Its source is what Ray's store hands the feeder,
64-byte aligned numpy blocks in host memory: one block (each batch a view of
it) or 8k-row blocks (each batch written into a staging buffer).

Per batch size (default 4-32 MB of 2M x 128 float32), in interleaved rounds,
GB/s from the first batch on:

* limits, 10 transfers in flight: ``pageable`` (``device_put`` of a numpy batch),
  ``pinned`` (of a ``pinned_host`` ``jax.Array``), each also issued from two
  threads (``*_2threads``); ``to_pinned`` (numpy into ``pinned_host``, 2 in
  flight: the host copy that ``staging="pinned"`` adds). The true limit of a
  round is its fastest way to the device (``best``);
* the feeder: ``rayslice`` (defaults), ``rayslice_sync`` (``pipeline="sync"``),
  ``rayslice_blocks`` (defaults, from 8k-row blocks: a batch spanning blocks
  is joined on the device), ``rayslice_blocks_host`` (the same, joined in a
  staging buffer on the host: ``assemble="host"``), ``rayslice_uneven``
  (defaults, from 10,000-row blocks, which cut every batch at another place:
  no join layout recurs, and most chunks of a grid would cross a block's end,
  so a batch is cut on the device out of the whole blocks that hold it, where
  that sends at most twice its bytes, else joined on the host),
  ``rayslice_large`` (defaults, from 100,000-row blocks, larger than a batch:
  a batch across a block's end is joined on a grid of equal chunks) and
  ``rayslice_large_host`` (the same, ``assemble="host"``). ``staging="pinned"``
  is left out: ``to_pinned`` and ``pinned`` are its two halves (on a TPU v5e
  host the feeder ran at 0.21-0.25 GB/s that way). ``rayslice_host_kept`` and
  ``rayslice_host_donated``: 8k-row blocks joined on the host, each batch
  through a jitted ``x * 2`` that keeps it or donates it (``donate_argnums``:
  the batch is deleted, often while its copy still reads the staging buffer).
  The first (warm-up) pass
  of each, which compiles the device joins, is reported apart (``warm_up_pass_ms``);
* ratios per round: ``vs_best``, ``vs_pinned``, ``vs_pageable`` (rayslice's
  defaults), ``blocks_vs_best``, ``blocks_host_vs_best``, ``uneven_vs_best``,
  ``large_vs_best``, ``large_host_vs_best``, ``best_feeder_vs_best`` (the
  feeder's fastest setting) and ``donated_vs_kept``.

Then a ~5 ms jitted step on data already on the device (``resident``) and fed:
by the feeder (its defaults, ``pipeline="sync"``, and from 8k-row blocks joined
on the device and on the host), and
by two plain loops without the feeder, the true limit of feeding the step on
this host (a transfer during a step can slow the step itself): ``plain_thread``
(a thread ``device_put``-ing into a 2-deep queue) and ``one_ahead`` (the
consumer's own thread putting the next batch before each step). Reported per
round as each rate over the resident rate, and the feeder's default over the
faster plain loop (``rayslice_vs_plain``). Ray's ``iter_jax_batches`` is not
measured here (it needs Ray): ``bench_data.py --gpu`` compares the two.

Without an accelerator it says so and measures nothing; ``--dry-run`` runs the
same code on CPU devices with small sizes (to test this script).

Usage: ``python benchmarks/bench_accel.py [--dry-run] [rows=N] [repeats=N] [sizes_mb=4,8,16,32]``; the
last line is JSON. A bad option is refused with one line and exit status 2, before anything starts.
"""

from __future__ import annotations

import os
import platform
import queue
import statistics
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any

from _options import run_script  # benchmarks/ is on the path: the script's folder
from bench_data import (
    GOAL_STEP,
    GPU_GOAL_VS_PINNED,
    REBATCH_ROWS,
    _ahead,
    _dry_run_sizes,
    _gbps,
    _h2d,
    _in_flight,
    _spread,
    _step_rounds,
    _time,
    _time_steady,
    _training_step,
    _verdict,
)

LIMITS = ("pageable", "pageable_2threads", "pinned", "pinned_2threads")


def _limits(jax: Any, host: Any, sharding: Any, pinned: Any, reps: int = 10) -> dict[str, float]:
    """bench_data's host->device limits, plus pageable puts from two threads and numpy into ``pinned_host``."""
    out = _h2d(jax, host, sharding, pinned, reps)
    out["pageable_2threads"] = _in_flight(jax, host, sharding, reps, threads=2)
    if pinned is not None:
        out["to_pinned"] = _in_flight(jax, host, pinned, 2)  # slow on some hosts (0.2-0.5 GB/s on a TPU v5e)
    return out


def _accelerators(jax: Any, dry_run: bool) -> list[Any]:
    if dry_run:
        return jax.devices("cpu")
    return [d for d in jax.devices() if d.platform != "cpu"]


def run(
    dry_run: bool = False,
    rows: int = 2_000_000,
    width: int = 128,
    repeats: int = 5,
    sizes_mb: tuple[int, ...] = (4, 8, 16, 32),
) -> dict[str, Any]:
    """Limits, the feeder's settings and a fed step on this host's first accelerator (see the module docstring)."""
    if dry_run:
        rows, sizes_mb, repeats = _dry_run_sizes(rows, repeats)
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from rayslice.data import iter_jax_batches
    from rayslice.data._staging import aligned_empty

    devs = _accelerators(jax, dry_run)
    if not devs:
        return {"skipped": f"no accelerator: JAX {jax.__version__} sees only {jax.devices()[0].platform} devices"}
    dev = devs[0]
    sharding = NamedSharding(Mesh(np.array([dev]), ("data",)), PartitionSpec("data"))
    kinds = sorted({m.kind for m in dev.addressable_memories()})
    pinned = sharding.with_memory_kind("pinned_host") if "pinned_host" in kinds else None
    src = aligned_empty((rows, width), np.dtype("float32"))  # as Ray's store lays a block out: 64-byte aligned
    src[:] = np.random.default_rng(0).standard_normal((rows, width), dtype=np.float32)
    one = [{"data": src}]
    blocks = [{"data": src[i : i + REBATCH_ROWS]} for i in range(0, rows, REBATCH_ROWS)]
    # Blocks whose size is unrelated to the batch's: every batch cuts them at another place, so a
    # stream meets more join layouts than it compiles (the rest are cut out of whole blocks on the device).
    uneven = [{"data": src[i : i + UNEVEN_ROWS]} for i in range(0, rows, UNEVEN_ROWS)]
    # Blocks larger than any batch here, of a size unrelated to it (as Ray Data's blocks of up to
    # 128 MB often are): a batch across a block's end is joined on a grid of equal chunks.
    large = [{"data": src[i : i + LARGE_ROWS]} for i in range(0, rows, LARGE_ROWS)]
    row_bytes = width * 4
    result: dict[str, Any] = {
        "device": str(getattr(dev, "device_kind", dev.platform)),
        "platform": dev.platform,
        "platform_version": str(getattr(dev.client, "platform_version", "")),
        "jax": jax.__version__,
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version()},
        "dry_run": dry_run,
        "rows": rows,
        "width": width,
        "repeats": repeats,
        "memory_kinds": kinds,
        "sizes": {},
    }

    def feeder(source: list[Any], bs: int, **kw: Any) -> Callable[[], Iterable[Any]]:
        return lambda: iter_jax_batches(source, batch_size=bs, sharding=sharding, ragged="drop", **kw)

    with iter_jax_batches(one, batch_size=8, sharding=sharding) as probe:  # what the defaults chose here
        result["defaults"] = {
            "pipeline": probe._feeder.pipeline,
            "staging_pinned": probe._feeder.pinned is not None,
            "assemble": probe._feeder.assemble,
        }
    for mb in sizes_mb:
        bs = mb * 2**20 // row_bytes
        n = rows - rows % bs
        methods = {
            "rayslice": feeder(one, bs),
            "rayslice_sync": feeder(one, bs, pipeline="sync"),
            "rayslice_blocks": feeder(blocks, bs),
            "rayslice_blocks_host": feeder(blocks, bs, assemble="host"),
            "rayslice_uneven": feeder(uneven, bs),
            "rayslice_large": feeder(large, bs),
            "rayslice_large_host": feeder(large, bs, assemble="host"),
        }
        feeding = list(methods)
        # A step that donates its batch (``donate_argnums``) deletes it, often while its copy still
        # reads the staging buffer; against the same step keeping it (both read the step's output).
        methods["rayslice_host_kept"] = _through(feeder(blocks, bs, assemble="host"), jax.jit(lambda x: x * 2))
        methods["rayslice_host_donated"] = _through(
            feeder(blocks, bs, assemble="host"), jax.jit(lambda x: x * 2, donate_argnums=0)
        )
        # Warm-up: pages in, and compiles the device joins of the block sources (reported).
        warm_up = {name: 1e3 * _time(fn, n) for name, fn in methods.items()}
        per: dict[str, list[float]] = {}
        first: dict[str, list[float]] = {}
        for _ in range(repeats):
            for k, v in _limits(jax, src[:bs], sharding, pinned).items():
                per.setdefault(k, []).append(v)
            for name, fn in methods.items():
                total, t_first, steady = _time_steady(fn, n)
                per.setdefault(name, []).append(_gbps(steady * row_bytes, total - t_first))
                first.setdefault(name, []).append(1e3 * t_first)
        best = [max(per[k][i] for k in LIMITS if k in per) for i in range(repeats)]
        feeders = [max(per[k][i] for k in feeding) for i in range(repeats)]
        entry: dict[str, Any] = {k: _spread(v) for k, v in per.items()}
        for ratio, method in VS_BEST.items():
            entry[ratio] = _spread([a / b for a, b in zip(per[method], best)])
        entry["best_feeder_vs_best"] = _spread([a / b for a, b in zip(feeders, best)])
        entry["donated_vs_kept"] = _spread(
            [a / b for a, b in zip(per["rayslice_host_donated"], per["rayslice_host_kept"])]
        )
        for ref in ("pinned", "pageable"):
            if ref in per:
                entry[f"vs_{ref}"] = _spread([a / b for a, b in zip(per["rayslice"], per[ref])])
        entry["first_batch_ms"] = {k: _spread(v) for k, v in first.items()}
        entry["warm_up_pass_ms"] = warm_up
        result["sizes"][f"{mb}MB"] = entry
    big = sizes_mb[-1] * 2**20 // row_bytes
    n = rows - rows % big
    views = [src[i : i + big] for i in range(0, n, big)]
    resident = [jax.device_put(v, sharding) for v in views]
    jax.block_until_ready(resident)
    consume_step, layers = _training_step(width, sharding, resident, big, dry_run)
    steps = _step_rounds(
        {
            "resident": lambda: iter(resident),
            "rayslice": feeder(one, big),
            "rayslice_sync": feeder(one, big, pipeline="sync"),
            "rayslice_blocks": feeder(blocks, big),
            "rayslice_blocks_host": feeder(blocks, big, assemble="host"),
            "plain_thread": lambda: _plain_thread(jax, views, sharding),
            "one_ahead": lambda: _ahead(jax.device_put(v, sharding) for v in views),  # the next put before a step
        },
        n,
        consume_step,
        repeats,
    )
    plain = [min(a, b) for a, b in zip(steps["plain_thread"], steps["one_ahead"])]  # seconds per step: the faster
    result["step"] = {
        "batch_rows": big,
        "layers": layers,
        "step_ms": 1e3 * statistics.median(steps["resident"]),
        **{f"{k}_vs_resident": _spread([r / f for r, f in zip(steps["resident"], steps[k])]) for k in STEP_METHODS},
        "rayslice_vs_plain": _spread([p / f for p, f in zip(plain, steps["rayslice"])]),
    }
    return result


STEP_METHODS = ("rayslice", "rayslice_sync", "rayslice_blocks", "rayslice_blocks_host", "plain_thread", "one_ahead")
#: Ratios to the round's true limit, each of one feeder method.
VS_BEST = {
    "vs_best": "rayslice",
    "blocks_vs_best": "rayslice_blocks",
    "blocks_host_vs_best": "rayslice_blocks_host",
    "uneven_vs_best": "rayslice_uneven",
    "large_vs_best": "rayslice_large",
    "large_host_vs_best": "rayslice_large_host",
}
UNEVEN_ROWS = 10_000  # rows per block of the uneven source (not a divisor of any batch size here)
LARGE_ROWS = 100_000  # rows per block of the large source (51 MB: larger than any batch here, not a multiple)


def _through(fn: Callable[[], Iterable[Any]], step: Any) -> Callable[[], Iterable[Any]]:
    """``fn``'s stream with each batch's ``data`` replaced by ``step(data)``."""
    return lambda: ({**b, "data": step(b["data"])} for b in fn())


def _plain_thread(jax: Any, views: list[Any], sharding: Any, depth: int = 2) -> Iterable[Any]:
    """Batches put by a plain thread into a ``depth``-deep queue (no feeder): a reference pipeline."""
    q: queue.Queue[Any] = queue.Queue(maxsize=depth)

    def put_all() -> None:
        for v in views:
            q.put(jax.device_put(v, sharding))
        q.put(None)

    thread = threading.Thread(target=put_all, name="bench-plain-thread", daemon=True)
    thread.start()
    while (x := q.get()) is not None:
        yield x
    thread.join()


def _print(r: dict[str, Any]) -> None:
    if "skipped" in r:
        print(f"accelerator benchmark skipped: {r['skipped']}", file=sys.stderr)
        return
    print(
        f"{r['device']} ({r['platform']} {r['platform_version']}, JAX {r['jax']}, {r['host']['cpus']} CPUs)"
        f"{' DRY RUN on CPU' if r['dry_run'] else ''}; {r['rows']:,} x {r['width']} f32; "
        f"memory kinds {r['memory_kinds']}; defaults here {r['defaults']}; {r['repeats']} rounds",
        file=sys.stderr,
    )
    ratios = (*VS_BEST, "best_feeder_vs_best", "donated_vs_kept", "vs_pinned", "vs_pageable")
    for size, e in r["sizes"].items():
        bw = "  ".join(f"{k} {v['median']:.1f}" for k, v in e.items() if k not in ratios and not k.endswith("_ms"))
        print(f"  {size:>5}: GB/s from the first batch on: {bw}", file=sys.stderr)
        print(
            "         ms to the first batch: "
            + "  ".join(f"{k} {v['median']:.1f}" for k, v in e["first_batch_ms"].items()),
            file=sys.stderr,
        )
        print(
            "         ms of the warm-up pass: " + "  ".join(f"{k} {v:.0f}" for k, v in e["warm_up_pass_ms"].items()),
            file=sys.stderr,
        )
        for k in ratios:
            if k in e:
                goal = GPU_GOAL_VS_PINNED if k in ("vs_best", "blocks_vs_best") else None
                print(f"         rayslice {k}: {_verdict(e[k], goal)}", file=sys.stderr)
    s = r["step"]
    print(f"  step {s['step_ms']:.2f} ms on resident data ({s['layers']} layers); fed, of that rate:", file=sys.stderr)
    for k in [f"{m}_vs_resident" for m in STEP_METHODS] + ["rayslice_vs_plain"]:
        goal = GOAL_STEP if k in ("rayslice_vs_resident", "rayslice_vs_plain") else None
        print(f"    {k:28s} {_verdict(s[k], goal, 3)}", file=sys.stderr)


_USAGE = "bench_accel.py [--dry-run] [rows=N] [repeats=N] [sizes_mb=4,8,16,32]"


def main(argv: list[str]) -> int:
    return run_script(argv, _USAGE, run, _print)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
