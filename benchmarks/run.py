"""Run every benchmark on one simulated cluster and print ratios measured in this run.

Usage: ``make bench`` (or ``.venv/bin/python benchmarks/run.py [--rounds N]``).
"""

from __future__ import annotations

import argparse
import os
import sys

from rich.console import Console
from rich.table import Table

sys.path.insert(0, os.path.dirname(__file__))

import bench_reservation  # noqa: E402

from rayslice.sim import SimulatedCluster, SliceSpec  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    console = Console()

    planning = bench_reservation.bench_planning()
    slices = [SliceSpec("TPU-V4", "2x2x2", name="bench-a"), SliceSpec("TPU-V4", "2x2x2", name="bench-b")]
    with console.status("starting the simulated cluster"), SimulatedCluster(slices) as sim:
        console.print(f"{sim.num_hosts} hosts up in {sim.startup_s:.1f} s")
        with console.status(f"reservation cycles x {args.rounds}"):
            cycle = bench_reservation.bench_cycle(rounds=args.rounds)

    t = Table(title="rayslice benchmarks (same machine, same run)", title_justify="left")
    for col in ("benchmark", "rayslice", "peer / limit", "ratio", "goal", "met"):
        t.add_column(col)
    ok_cycle = cycle["ratio"] <= bench_reservation.GOAL_CYCLE_RATIO
    t.add_row("reserve->ready->release, v4 2x2x2 (median of %d)" % cycle["rounds"],
              f"{cycle['rayslice_ms']:.1f} ms", f"{cycle['ray_ms']:.1f} ms (ray.util.tpu)",
              f"{cycle['ratio']:.2f}x", f"<= {bench_reservation.GOAL_CYCLE_RATIO}x", "yes" if ok_cycle else "NO")
    ok_plan = planning["plan_ms"] < bench_reservation.GOAL_PLAN_MS
    t.add_row(f"plan over {planning['slices']:,} slices", f"{planning['plan_ms']:.1f} ms",
              f"parse+plan {planning['parse_and_plan_ms']:.1f} ms", "-",
              f"< {bench_reservation.GOAL_PLAN_MS:g} ms", "yes" if ok_plan else "NO")
    console.print(t)
    console.print(f"p90: rayslice {cycle['rayslice_p90_ms']:.1f} ms, ray.util.tpu {cycle['ray_p90_ms']:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
