"""Train a byte-level LM on the standard library's source, serve it on a 2-host slice, stream with openai.

Runs on the simulated cluster (no TPU, nothing downloaded):

    .venv/bin/python examples/llm_serve_openai.py [--steps 40]

1. ``train_tiny_lm`` trains the transformer with ``rayslice.train.JaxTrainer``
   on one v4 2x2x2 slice (2 hosts x 4 devices, data parallel) and writes an
   Orbax checkpoint.
2. ``build_app`` serves that checkpoint with Ray Serve: the replica reserves the
   other whole slice and shards the model over its 8 devices on 2 hosts
   (the default ``layout="auto"``: heads and MLP tensor-parallel over each
   host's 4 devices, the KV cache split on heads and, over the 2 hosts, on
   batch slots, so no step waits on a collective between hosts;
   ``layout="tensor"`` is 8-way tensor parallel across both).
3. The official ``openai`` client streams a completion token by token.

On a real cluster: ``ray.init(address=...)`` instead of the simulator, shared
storage (``storage_path="gs://..."``) and your slice's topology.
"""

from __future__ import annotations

import argparse
import time

import openai
from ray import serve

from rayslice import serve as slice_serve
from rayslice.serve.llm import EngineConfig, LLMConfig, LMConfig, build_app, train_tiny_lm
from rayslice.sim import SimulatedCluster, SliceSpec

LM = LMConfig(d_model=64, num_layers=2, num_heads=8, d_ff=256, max_len=256)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=120)
    args = ap.parse_args()
    with SimulatedCluster([SliceSpec("TPU-V4", "2x2x2"), SliceSpec("TPU-V4", "2x2x2")]):
        t0 = time.perf_counter()
        result = train_tiny_lm(lm=LM, steps=args.steps, batch_size=32, seq_len=128, lr=3e-3)
        losses = [m["loss"] for m in result.metrics_history]
        print(f"trained {len(losses)} steps in {time.perf_counter() - t0:.1f} s: loss {losses[0]:.2f} -> "
              f"{losses[-1]:.2f}; checkpoint {result.checkpoint.path}")

        port = slice_serve.start_http()
        cfg = LLMConfig(model_name="stdlib-lm", lm=LM, checkpoint=result.checkpoint.path,
                        engine=EngineConfig(num_slots=8, max_context=256, prefill_buckets=(32, 128, 256),
                                            max_tokens_limit=128, default_max_tokens=32))
        serve.run(build_app(cfg), name="llm", route_prefix="/")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        print("models:", [m.id for m in client.models.list().data])
        prompt = "def __init__(self"
        print(f"--- streaming a completion of {prompt!r}:")
        print(prompt, end="", flush=True)
        for chunk in client.completions.create(model="stdlib-lm", prompt=prompt, max_tokens=96, temperature=0.7,
                                               top_p=0.9, seed=0, stream=True):
            print(chunk.choices[0].text, end="", flush=True)
        print("\n---")
        chat = client.chat.completions.create(model="stdlib-lm", messages=[{"role": "user", "content": "import"}],
                                              max_tokens=24, temperature=0)
        print("chat:", repr(chat.choices[0].message.content), chat.usage)
        serve.shutdown()


if __name__ == "__main__":
    main()
