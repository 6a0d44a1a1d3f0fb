"""LLM serving: the slice deployment (2 hosts, tensor-parallel) vs the same model in a plain Serve deployment.

Measured through the real HTTP endpoint with the official ``openai`` client,
the same model (random weights, same seed) and engine on both sides:

- time to first token (TTFT, p50) and tokens/s per stream, one stream at a time;
- aggregate tokens/s with 16 concurrent streams vs 1 stream (continuous batching);
- XLA compilations after warm-up (must be 0: fixed shapes).

Standalone: ``.venv/bin/python benchmarks/bench_llm.py [--requests N]`` (starts its
own simulated cluster). From ``benchmarks/run.py``: ``bench_llm.run(requests=...)``
on a running cluster with a free v4 2x2x2 slice; it returns a dict of figures.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import statistics
import time
from typing import Any

from rayslice.serve.llm import EngineConfig, LLMConfig, LMConfig, build_app

MODEL = "bench-lm"
PROMPT = "def fibonacci(n):\n    "


def config(accelerator_type: str = "TPU-V4", topology: str = "2x2x2") -> LLMConfig:
    return LLMConfig(
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
    return {
        "step_ms_p50": stats["step_ms_p50"],
        "device_step_ms_p50": stats["device_step_ms_p50"],
        "ttft_p50_ms": 1000 * statistics.median(ttft),
        "tokens_per_s_stream": statistics.median(per_stream),
        "tokens_per_s_1": single,
        "tokens_per_s_16": aggregate,
        "batching_ratio": aggregate / single,
        "compiles_after_warm_up": _stats(base)["compiles"] - compiles,
    }


def run(
    port: int | None = None,
    requests: int = 20,
    max_tokens: int = 64,
    accelerator_type: str = "TPU-V4",
    topology: str = "2x2x2",
) -> dict[str, Any]:
    """Both deployments on the running cluster; returns the figures and the ratios."""
    from ray import serve

    from rayslice import serve as slice_serve

    port = slice_serve.start_http(port)
    cfg = config(accelerator_type, topology)
    out: dict[str, Any] = {}
    try:
        serve.run(build_app(cfg), name="llm-slice", route_prefix="/llm-slice")
        out["slice"] = measure(f"http://127.0.0.1:{port}/llm-slice/v1", requests, max_tokens)
        serve.delete("llm-slice")
        serve.run(build_app(cfg, local=True), name="llm-local", route_prefix="/llm-local")
        out["local"] = measure(f"http://127.0.0.1:{port}/llm-local/v1", requests, max_tokens)
        serve.delete("llm-local")
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


def main() -> None:
    from rayslice.sim import SimulatedCluster, SliceSpec

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=20, help="sequential streams per deployment")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    with SimulatedCluster([SliceSpec("TPU-V4", "2x2x2", name="bench-llm")]):
        figures = run(requests=args.requests, max_tokens=args.max_tokens)
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
