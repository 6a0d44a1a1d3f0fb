"""Run every benchmark and print ratios against the peer and the limit measured in this run.

Usage: ``make bench`` (or ``.venv/bin/python benchmarks/run.py [--rounds N] [--rows N]``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from rich.console import Console
from rich.table import Table

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_data  # noqa: E402
import bench_elastic  # noqa: E402
import bench_llm  # noqa: E402
import bench_reservation  # noqa: E402
import bench_serve  # noqa: E402
import bench_train  # noqa: E402
from rayslice.sim import SimulatedCluster, SliceSpec  # noqa: E402


def _met(ok: bool) -> str:
    return "[green]yes[/green]" if ok else "[red]NO[/red]"


def _own_process(console: Console, label: str, script: str, *args: str) -> dict | None:
    """Runs ``benchmarks/<script> <args>`` in its own process; its last stdout line as JSON (None on failure)."""
    with console.status(label):
        out = subprocess.run(
            [sys.executable, os.path.join(HERE, script), *args], capture_output=True, text=True, timeout=1800
        )
    if out.returncode:
        console.print(out.stderr[-3000:])
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=15, help="reservation cycles per peer")
    ap.add_argument("--rows", type=int, default=1_000_000, help="rows of the data benchmark")
    ap.add_argument("--train-rounds", type=int, default=3, help="fit() runs per trainer")
    ap.add_argument("--recovery-rounds", type=int, default=3, help="host kills timed with production health checks")
    ap.add_argument("--chaos-rounds", type=int, default=3, help="rayslice fault-free/chaos pairs (median ratio)")
    ap.add_argument("--elastic-rounds", type=int, default=3, help="elastic runs losing a slice (medians)")
    args = ap.parse_args()
    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")  # Ray's JaxTrainer lives in Train v2
    console = Console(width=max(Console().width, 150))
    t = Table(title="rayslice benchmarks (same machine, same run)", title_justify="left")
    for col in ("benchmark", "rayslice", "peer / limit", "ratio", "goal", "met"):
        t.add_column(col)

    with console.status("planning over 10,000 synthetic slices"):
        planning = bench_reservation.bench_planning()
    slices = [
        SliceSpec("TPU-V4", "2x2x2", name="bench-a"),
        SliceSpec("TPU-V4", "2x2x2", name="bench-b"),
        SliceSpec(*bench_train.OVERHEAD_SHAPE, name="bench-c"),  # the per-step overhead's one-host slice
    ]
    with console.status("starting the simulated cluster"):
        sim = SimulatedCluster(slices).start()
    try:
        console.print(f"simulated cluster: {sim.num_hosts} hosts up in {sim.startup_s:.1f} s")
        with console.status(f"reservation cycles x {args.rounds} per peer"):
            cycle = bench_reservation.bench_cycle(rounds=args.rounds)
        with console.status("multi-host agreement cost"):
            agree = bench_data.agreement_cost()
        with console.status(f"trainers, {args.train_rounds} fit() each"):
            train = bench_train.compare(rounds=args.train_rounds)
        overs = []
        for target_ms, goal, phase_steps, pairs in bench_train.OVERHEAD_CASES:
            with console.status(f"trainer per-step overhead, {target_ms:g} ms step"):
                overs.append((bench_train.overhead(target_ms, phase_steps, pairs), goal))
        with console.status("LLM serving: slice deployment vs one process"):
            llm = bench_llm.run(requests=30)
        with console.status("recovery after a lost host"):
            rec = bench_train.recovery(sim)  # last: it breaks a slice
            notice_row = bench_train.notice_row(bench_train.notice(sim))  # on slices of its own
    finally:
        sim.shutdown()
    data = _own_process(
        console, f"data feeding, {args.rows:,} rows (own process)", "bench_data.py", f"rows={args.rows}"
    )
    # Serving latency is a few ms on top of ~20 ms of Serve's own CPU per request on this
    # 2-core machine: it gets a cluster of its own, as a deployment would, not the leftovers
    # (idle trainer processes, the overhead rows' third slice) of the rows above. Both deployments
    # (slice and plain) and the floor are still measured on that one cluster, interleaved.
    srv = _own_process(console, "serving latency and throughput (own cluster)", "bench_serve.py", "run")
    prod = _own_process(
        console,
        "recovery with Ray's production health checks, compile cache, chaos goodput (own cluster)",
        "bench_train.py",
        "production",
        f"rounds={args.recovery_rounds}",
        f"chaos_rounds={args.chaos_rounds}",
    )
    elastic = _own_process(
        console,
        "elastic training: shrink onto survivors, accumulation, goodput (own cluster)",
        "bench_elastic.py",
        f"rounds={args.elastic_rounds}",
    )
    cost = _own_process(console, "report() on the step's thread (own process, no Ray)", "bench_train.py", "report_cost")
    if data is None or srv is None or prod is None or elastic is None or cost is None:
        return 1

    t.add_row(
        f"reserve->ready->release, v4 2x2x2 (median of {cycle['rounds']})",
        f"{cycle['rayslice_ms']:.1f} ms",
        f"{cycle['ray_ms']:.1f} ms (ray.util.tpu)",
        f"{cycle['ratio']:.3f}x",
        f"<= {bench_reservation.GOAL_CYCLE_RATIO}x",
        _met(cycle["ratio"] <= bench_reservation.GOAL_CYCLE_RATIO),
    )
    t.add_row(
        f"plan over {planning['slices']:,} slices",
        f"{planning['plan_ms']:.1f} ms",
        f"(parse {planning['slices']:,} slices' nodes + plan: {planning['parse_and_plan_ms']:.0f} ms)",
        "-",
        f"< {bench_reservation.GOAL_PLAN_MS:g} ms",
        _met(planning["plan_ms"] < bench_reservation.GOAL_PLAN_MS),
    )
    r, g = data["rows_per_s"], data["gb_per_s"]
    label = (
        f"{data['rows']:,} x {data['width']} f32, batch {data['batch_size']}, {data['devices']} {data['platform']} devs"
    )
    t.add_row(
        f"iter_jax_batches vs limit ({label})",
        f"{r['rayslice'] / 1e6:.2f} M rows/s, {g['rayslice']:.2f} GB/s",
        f"{r['limit'] / 1e6:.2f} M rows/s, {g['limit']:.2f} GB/s (device_put)",
        f"{data['vs_limit']:.2f}x",
        f">= {bench_data.GOAL_VS_LIMIT}x",
        _met(data["vs_limit"] >= bench_data.GOAL_VS_LIMIT),
    )
    t.add_row(
        "iter_jax_batches vs pipelined limit",
        "",
        f"{r['limit2'] / 1e6:.2f} M rows/s, {g['limit2']:.2f} GB/s",
        f"{data['vs_limit2']:.2f}x",
        "(info)",
        "-",
    )
    t.add_row(
        "iter_jax_batches vs Ray Dataset.iter_jax_batches",
        "",
        f"{r['ray'] / 1e6:.2f} M rows/s, {g['ray']:.2f} GB/s",
        f"{data['vs_ray']:.2f}x",
        f">= {bench_data.GOAL_VS_RAY}x",
        _met(data["vs_ray"] >= bench_data.GOAL_VS_RAY),
    )
    sp = data["spread"]
    t.add_row(
        f"  spread over {data['repeats']} rounds: vs limit / vs Ray",
        "",
        f"min-max {sp['vs_limit']['min']:.2f}-{sp['vs_limit']['max']:.2f} / "
        f"{sp['vs_ray']['min']:.2f}-{sp['vs_ray']['max']:.2f}",
        "",
        "(info)",
        "-",
    )
    t.add_row(
        "iter_jax_batches vs copying device_put / one device_put per 64 batches",
        "",
        f"{r['limit_copy'] / 1e6:.2f} / {r['limit_bulk'] / 1e6:.2f} M rows/s",
        f"{data['vs_limit_copy']:.2f}x / {data['vs_limit_bulk']:.2f}x",
        "(info)",
        "-",
    )
    t.add_row(
        "jitted step fed by iter_jax_batches vs data already on device",
        "",
        f"thread: {data['step_thread_vs_resident']:.3f}x, Ray: {data['step_ray_vs_resident']:.3f}x",
        f"{data['step_vs_resident']:.3f}x",
        f">= {bench_data.GOAL_STEP}x",
        _met(data["step_vs_resident"] >= bench_data.GOAL_STEP),
    )
    t.add_row(
        "iter_jax_batches vs naive iter_batches+device_put",
        "",
        f"{r['naive'] / 1e6:.2f} M rows/s, {g['naive']:.2f} GB/s",
        f"{data['vs_naive']:.2f}x",
        "(info)",
        "-",
    )
    t.add_row(
        f"multi-host agreement, {agree['hosts']} hosts, per step",
        f"{agree['with_us']:.0f} us/step",
        f"{agree['without_us']:.0f} us/step without",
        f"+{agree['cost_us']:.0f} us",
        "(documented)",
        "-",
    )
    fs, ft = train["first_step_s"], train["fit_s"]
    t.add_row(
        f"fit() -> first completed step (median of {train['rounds']})",
        f"{fs['rayslice']:.2f} s",
        f"{fs['ray']:.2f} s (ray.train.v2.jax.JaxTrainer)",
        f"{train['first_ratio']:.2f}x",
        f"<= {bench_train.GOAL_RATIO}x",
        _met(train["first_ratio"] <= bench_train.GOAL_RATIO),
    )
    t.add_row(
        "fit() total, 5-step loop",
        f"{ft['rayslice']:.2f} s",
        f"{ft['ray']:.2f} s",
        f"{train['fit_ratio']:.2f}x",
        f"<= {bench_train.GOAL_RATIO}x",
        _met(train["fit_ratio"] <= bench_train.GOAL_RATIO),
    )
    for over, goal in overs:
        t.add_row(*bench_train.overhead_row(over, goal))
    t.add_row(*bench_train.report_cost_row(cost))
    sl, pl = srv["slice"], srv["plain"]
    t.add_row(
        "serve p50 / p99 latency, 1-row HTTP requests",
        f"{sl['p50_ms']:.1f} / {sl['p99_ms']:.1f} ms",
        f"{pl['p50_ms']:.1f} / {pl['p99_ms']:.1f} ms (plain Serve, one host)",
        f"+{srv['added_p50_ms']:.2f} ms p50",
        f"<= +{bench_serve.GOAL_ADDED_P50_MS:g} ms",
        _met(srv["added_p50_ms"] <= bench_serve.GOAL_ADDED_P50_MS),
    )
    fw = srv["forward"]
    t.add_row(
        "serve floor: a plain replica forwarding each batch to one model actor (one Ray call)",
        f"slice - forward {srv['beyond_forward_p50_ms']:+.2f} ms p50 "
        f"({srv['beyond_forward_p50_spread_ms'][0]:+.1f}..{srv['beyond_forward_p50_spread_ms'][1]:+.1f})",
        f"{fw['p50_ms']:.1f} ms: forward - plain {srv['forward_added_p50_ms']:+.2f} ms "
        f"({srv['forward_added_p50_spread_ms'][0]:+.1f}..{srv['forward_added_p50_spread_ms'][1]:+.1f})",
        "-",
        "(info)",
        "-",
    )
    t.add_row(
        "serve throughput, 8 concurrent clients",
        f"{sl['rps']:.0f} req/s",
        f"{pl['rps']:.0f} req/s",
        f"{sl['rps'] / pl['rps']:.2f}x",
        "(info)",
        "-",
    )
    ls, ll = llm["slice"], llm["local"]
    t.add_row(
        "LLM time to first token p50 (streaming, OpenAI API)",
        f"{ls['ttft_p50_ms']:.1f} ms (p10-p90 {ls['ttft_p10_ms']:.1f}-{ls['ttft_p90_ms']:.1f}, n={ls['ttft_n']}; "
        f"2-host slice, {ls['layout']} {ls['mesh']})",
        f"{ll['ttft_p50_ms']:.1f} ms (p10-p90 {ll['ttft_p10_ms']:.1f}-{ll['ttft_p90_ms']:.1f}; "
        "plain Serve, one process)",
        f"+{llm['ttft_added_ms']:.1f} ms ({llm['ttft_ratio']:.2f}x); tokens/s {llm['tokens_per_s_ratio']:.2f}x",
        "<= +5 ms",
        _met(llm["goals"]["ttft_added_ms<=5"]),
    )
    t.add_row(
        "LLM continuous batching: 16 streams vs 1 (aggregate tokens/s)",
        f"{ls['batching_ratio']:.1f}x",
        "",
        "-",
        ">= 4x; 0 compiles after warm-up",
        _met(llm["goals"]["batching_ratio>=4"] and llm["goals"]["no_recompiles"]),
    )
    t.add_row(
        "recovery: host lost -> next step completed",
        f"{rec['recovery_s']:.1f} s",
        "",
        "-",
        f"<= {bench_train.GOAL_RECOVERY_S:g} s",
        _met(rec["recovery_s"] <= bench_train.GOAL_RECOVERY_S),
    )
    t.add_row(*notice_row)
    for row in bench_train.production_rows(prod):
        t.add_row(*row)
    for row in bench_elastic.rows(elastic):
        t.add_row(*row)
    console.print(t)
    console.print(
        f"p90 reservation cycle: rayslice {cycle['rayslice_p90_ms']:.1f} ms, ray.util.tpu {cycle['ray_p90_ms']:.1f} ms"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
