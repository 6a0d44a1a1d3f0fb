"""Two real JAX processes (``jax.distributed``, no Ray), as the two hosts of a slice serving "data_tensor".

Each process reads the weights of a checkpoint for itself and runs only programs over its own devices
(``ModelRunner.host_local``), so JAX's CPU client is started without a cross-process collective
implementation (no gloo), as ``SliceGang(cpu_collectives=False)`` starts the LLM server's hosts; the
tokens must equal those of a one-process runner of the same weights.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

_HOST = textwrap.dedent(
    """
    import json, sys
    import jax
    import numpy as np

    jax.config.update("jax_cpu_collectives_implementation", None)
    jax.distributed.initialize(sys.argv[1], 2, int(sys.argv[2]), initialization_timeout=60)
    from rayslice.serve.llm.model import LMConfig, init_params
    from rayslice.serve.llm.runner import Decode, ModelRunner, Prefill, Step
    from rayslice.serve.llm.weights import load_params

    lm = LMConfig(d_model=32, num_layers=2, num_heads=4, d_ff=64, max_len=64)
    params = load_params(sys.argv[3])  # each host reads for itself: no barrier across processes
    same = jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), params, init_params(lm, seed=3))

    def generate(r, slots, steps=6):
        prompts = {s: tuple(range(100 + s, 105 + 2 * s)) for s in slots}
        out = {s: [] for s in slots}
        res = r.step(Step(prefills=tuple(
            Prefill(slot=s, tokens=prompts[s], bucket=16, temperature=0.0, top_p=1.0, seed=0) for s in slots)))
        for s, t in zip(slots, res.prefill_tokens):
            out[s].append(int(t))
        active = np.zeros(r.num_slots, bool)
        active[list(slots)] = True
        n = r.num_slots
        for _ in range(steps):
            toks = r.step(Step(decode=Decode(active, np.zeros(n, np.float32), np.ones(n, np.float32),
                                             np.zeros(n, np.uint32)))).decode_tokens
            for s in slots:
                out[s].append(int(toks[s]))
        return out

    kw = dict(num_slots=8, max_context=64, vocab_limit=264)
    r = ModelRunner(lm, params, layout="data_tensor", tensor_parallel=2, **kw)
    r.skip_others = True
    mine = [s for s in range(8) if r.group_of(s) in r.local_groups]
    warm = r.warm_up((16,))
    got = generate(r, [mine[0], mine[-1]])
    ref = ModelRunner(lm, params, devices=jax.local_devices(), tensor_parallel=2, **kw)  # one process alone
    want = generate(ref, [mine[0], mine[-1]])
    print(json.dumps({
        "host_local": r.host_local, "mesh": dict(r.mesh.shape), "groups": sorted(r.local_groups),
        "decode_devices": sorted({d.process_index for d in r.program_devices()["decode"]}),
        "crossing": r.collectives_between_hosts(16), "warm": warm,
        "weights_as_saved": all(jax.tree.leaves(same)),
        "got": {str(k): v for k, v in got.items()}, "want": {str(k): v for k, v in want.items()},
    }))
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_two_processes_without_gloo_load_a_checkpoint_and_serve_their_own_slots_with_the_tokens_of_one_process(
    tmp_path,
):
    import orbax.checkpoint as ocp

    from rayslice.serve.llm.model import LMConfig, init_params

    lm = LMConfig(d_model=32, num_layers=2, num_heads=4, d_ff=64, max_len=64)
    ckptr = ocp.StandardCheckpointer()  # what JaxTrainer writes: <run>/checkpoints/<step>/state
    ckptr.save(tmp_path / "checkpoints" / "3" / "state", {"params": init_params(lm, seed=3)})
    ckptr.wait_until_finished()
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    address = f"127.0.0.1:{_free_port()}"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _HOST, address, str(i), str(tmp_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for i in range(2)
    ]
    try:
        outs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            p.kill()
    results = []
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err.decode()[-3000:]
        results.append(json.loads(out.decode().strip().splitlines()[-1]))
    for rank, res in enumerate(results):
        assert res["host_local"] and res["mesh"] == {"data": 4, "model": 2} and res["weights_as_saved"]
        assert res["groups"] == [2 * rank, 2 * rank + 1]  # each host holds two tensor-parallel groups
        assert res["decode_devices"] == [rank] and res["crossing"] == []  # no program leaves the process
        assert res["got"] == res["want"]  # greedy tokens: the same as one process
        assert all(len(v) == 7 and min(v) >= 0 for v in res["got"].values())
    assert results[0]["got"] != results[1]["got"]  # different slots, different prompts
