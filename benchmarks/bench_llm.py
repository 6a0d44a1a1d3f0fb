"""LLM serving: the slice deployment (2 hosts, tensor-parallel) vs the same model in a plain Serve deployment.

Measured through the real HTTP endpoint with the official ``openai`` client,
the same model (random weights, same seed) and engine on both sides:

- time to first token (TTFT: p50, with p10-p90 as the spread) and tokens/s per stream, one stream at a time;
- aggregate tokens/s with 16 concurrent streams vs 1 stream (continuous batching);
- XLA compilations after warm-up (must be 0: fixed shapes).

The slice deployment uses the default ``"auto"`` layout (``"data_tensor"``: the
hosts split the batch slots, tensor parallel inside each host, no collective
between hosts) with 2-device tensor-parallel groups (``TENSOR_PARALLEL``); the
baseline serves the same weights in one process holding as many devices as one
host of the slice (4 for v4 ``2x2x2``, pinned whatever node Serve picks),
tensor parallel over all of them. Each side also reports where a first token's
time goes (``phases_ms``).

Standalone: ``.venv/bin/python benchmarks/bench_llm.py [--requests N] [--layout L] [--tensor-parallel K]`` (starts its
own simulated cluster). From ``benchmarks/run.py``: ``bench_llm.run(requests=...)``
on a running cluster with a free v4 2x2x2 slice; it returns a dict of figures.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import json
import statistics
import time
from typing import Any

from rayslice.serve.llm import EngineConfig, LLMConfig, LMConfig, build_app

MODEL = "bench-lm"
PROMPT = "def fibonacci(n):\n    "


# Tensor-parallel groups of 2 devices: on the simulator every all-reduce, even between the devices of one host,
# is a gloo exchange over TCP whose cost grows with the group (about 0.6 ms for 2 devices, 2.3 ms for 4).
TENSOR_PARALLEL = 2


def config(
    accelerator_type: str = "TPU-V4",
    topology: str = "2x2x2",
    layout: str = "auto",
    tensor_parallel: int | None = TENSOR_PARALLEL,
) -> LLMConfig:
    return LLMConfig(
        layout=layout,
        tensor_parallel=tensor_parallel,
        model_name=MODEL,
        lm=LMConfig(),
        seed=1,
        accelerator_type=accelerator_type,
        topology=topology,
        engine=EngineConfig(
            num_slots=16,
            max_context=256,
            prefill_buckets=(32, 64, 128, 256),
            max_tokens_limit=128,
            default_max_tokens=16,
        ),
    )


def _stream(client: Any, max_tokens: int) -> tuple[float, float, int]:
    """(ttft_s, total_s, completion tokens) of one streamed completion."""
    t0 = time.perf_counter()
    first, tokens = None, 0
    for chunk in client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if first is None and chunk.choices and chunk.choices[0].text:
            first = time.perf_counter()
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    return (first or end) - t0, end - t0, tokens


def _stats(base: str) -> dict[str, Any]:
    import requests

    return requests.get(f"{base}/rayslice/stats", timeout=30).json()


def measure(base: str, requests: int, max_tokens: int) -> dict[str, float]:
    import openai

    client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)
    for _ in range(3):
        _stream(client, 8)  # warm the HTTP path
    compiles = _stats(base)["compiles"]
    runs = [_stream(client, max_tokens) for _ in range(requests)]
    ttft = [r[0] for r in runs]
    per_stream = [r[2] / max(r[1] - r[0], 1e-9) for r in runs]
    single = sum(r[2] for r in runs) / sum(r[1] for r in runs)
    with cf.ThreadPoolExecutor(16) as pool:
        t0 = time.perf_counter()
        many = list(pool.map(lambda _: _stream(client, max_tokens), range(16)))
        wall = time.perf_counter() - t0
    aggregate = sum(r[2] for r in many) / wall
    stats = _stats(base)
    ttft_ms = sorted(1000 * t for t in ttft)
    ttft_p50 = statistics.median(ttft_ms)
    prefill_step, prefill_device = stats["prefill_step_ms_p50"], stats["prefill_device_ms_p50"]
    return {
        "step_ms_p50": stats["step_ms_p50"],
        "device_step_ms_p50": stats["device_step_ms_p50"],
        "layout": stats.get("layout"),
        "mesh": stats.get("mesh"),
        "devices": stats.get("devices"),
        # Where a first token's time goes (p50s of sequential requests on an idle engine): the prefill on the
        # devices, the replica's call to the devices around it (hosts: a Ray actor call each step; one process: a
        # thread), and the rest of the TTFT (HTTP, SSE, request parsing, scheduling).
        "phases_ms": {
            "prefill_device": prefill_device,
            "call_around_prefill": None if prefill_step is None else round(prefill_step - prefill_device, 3),
            "http_sse_scheduling": None if prefill_step is None else round(ttft_p50 - prefill_step, 3),
        },
        "ttft_p50_ms": ttft_p50,
        "ttft_p10_ms": ttft_ms[len(ttft_ms) // 10],
        "ttft_p90_ms": ttft_ms[(9 * len(ttft_ms)) // 10],
        "ttft_n": len(ttft_ms),
        "tokens_per_s_stream": statistics.median(per_stream),
        "tokens_per_s_1": single,
        "tokens_per_s_16": aggregate,
        "batching_ratio": aggregate / single,
        "compiles_after_warm_up": _stats(base)["compiles"] - compiles,
    }


def run(
    port: int | None = None,
    requests: int = 30,
    max_tokens: int = 64,
    accelerator_type: str = "TPU-V4",
    topology: str = "2x2x2",
    layout: str = "auto",
    tensor_parallel: int | None = TENSOR_PARALLEL,
) -> dict[str, Any]:
    """Both deployments on the running cluster; returns the figures and the ratios."""
    from ray import serve

    from rayslice import serve as slice_serve

    port = slice_serve.start_http(port)
    cfg = config(accelerator_type, topology, layout, tensor_parallel)
    out: dict[str, Any] = {}
    try:
        serve.run(build_app(cfg), name="llm-slice", route_prefix="/llm-slice")
        out["slice"] = measure(f"http://127.0.0.1:{port}/llm-slice/v1", requests, max_tokens)
        serve.delete("llm-slice")
        # The baseline: one process holding as many devices as one host of the slice (its replica pinned to that
        # device count, wherever Serve places it), tensor parallel over all of them (in-process collectives).
        per_host = cfg.topology_info.devices_per_host
        local = dataclasses.replace(cfg, tensor_parallel=None)
        env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={per_host}"}
        options = {"num_cpus": 0, "runtime_env": {"env_vars": env}}
        serve.run(build_app(local, local=True, ray_actor_options=options), name="llm-local", route_prefix="/llm-local")
        out["local"] = measure(f"http://127.0.0.1:{port}/llm-local/v1", requests, max_tokens)
        serve.delete("llm-local")
        if out["local"]["devices"] != per_host:
            raise RuntimeError(f"the baseline ran on {out['local']['devices']} devices, not {per_host}")
    finally:
        serve.shutdown()
    s, loc = out["slice"], out["local"]
    out["ttft_added_ms"] = s["ttft_p50_ms"] - loc["ttft_p50_ms"]
    out["ttft_ratio"] = s["ttft_p50_ms"] / loc["ttft_p50_ms"]
    out["tokens_per_s_ratio"] = s["tokens_per_s_stream"] / loc["tokens_per_s_stream"]
    out["goals"] = {
        "ttft_added_ms<=5": out["ttft_added_ms"] <= 5.0,
        "batching_ratio>=4": s["batching_ratio"] >= 4,
        "no_recompiles": s["compiles_after_warm_up"] == 0 and loc["compiles_after_warm_up"] == 0,
    }
    return out


def main(argv: list[str] | None = None) -> None:
    from rayslice.sim import SimulatedCluster, SliceSpec

    ap = argparse.ArgumentParser(prog="bench_llm.py", description=__doc__)
    ap.add_argument("--requests", type=int, default=30, help="sequential streams per deployment")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--layout", default="auto", help="auto, tensor or data_tensor")
    ap.add_argument(
        "--tensor-parallel", type=int, default=TENSOR_PARALLEL, help="devices per tensor-parallel group (0: largest)"
    )
    args = ap.parse_args(argv)
    # Every bad word one line (argparse's usage and error, rc 2) before a cluster starts.
    if args.requests < 1:
        ap.error(f"--requests {args.requests}: expected a positive number of streams")
    try:
        cfg = config(layout=args.layout, tensor_parallel=args.tensor_parallel or None)
    except ValueError as e:  # InvalidArgument: the layout, or a tensor_parallel the slice cannot take
        ap.error(str(e))
    if not 1 <= args.max_tokens <= cfg.engine.max_tokens_limit:
        ap.error(f"--max-tokens {args.max_tokens}: expected 1 to {cfg.engine.max_tokens_limit} (the engine's limit)")
    with SimulatedCluster([SliceSpec("TPU-V4", "2x2x2", name="bench-llm")]):
        figures = run(
            requests=args.requests,
            max_tokens=args.max_tokens,
            layout=args.layout,
            tensor_parallel=args.tensor_parallel or None,
        )
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
