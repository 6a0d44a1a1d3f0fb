"""LLM serving on a 2-host slice with real Ray Serve, real HTTP and the official openai client."""

from __future__ import annotations

import concurrent.futures as cf
import time

import pytest

from rayslice import serve as slice_serve
from rayslice.serve.llm import EngineConfig, LLMConfig, LMConfig, SamplingParams, build_app
from rayslice.sim import SliceSpec

pytestmark = [pytest.mark.ray, pytest.mark.slow]

LM = LMConfig(d_model=64, num_layers=2, num_heads=8, d_ff=128, max_len=128)
ENG = EngineConfig(num_slots=8, max_context=128, prefill_buckets=(32, 128), max_tokens_limit=64, default_max_tokens=16)
CFG = LLMConfig(
    model_name="tiny",
    lm=LM,
    engine=ENG,
    seed=7,
    accelerator_type="TPU-V5P",
    topology="2x2x2",
    reservation_timeout_s=60,
    init_timeout_s=180,
    step_timeout_s=20,
)
PROMPTS = ["def main(", "import", "class Foo(object):\n    def __init__(self", "x = [1, 2, 3]\nfor i in x:\n"]


@pytest.fixture(scope="module")
def llm(sim):
    """One LLM app on a v5p 2x2x2 slice of its own (the session's slice-a/slice-b are never touched)."""
    from ray import serve

    names = [sim.add_slice(SliceSpec("TPU-V5P", "2x2x2", name="llm-0"))]
    port = slice_serve.start_http()
    serve.run(build_app(CFG), name="llm", route_prefix="/llm")
    try:
        yield {"port": port, "sim": sim, "slices": names, "base": f"http://127.0.0.1:{port}/llm/v1"}
    finally:
        serve.shutdown()
        for n in names:
            if any(h.alive for h in sim.slices[n].hosts):
                sim.preempt_slice(n)


@pytest.fixture(scope="module")
def reference():
    """The same model unsharded, in this process, on one device."""
    import asyncio

    import jax

    from rayslice.serve.llm import local_engine

    eng = local_engine(LM, ENG, seed=CFG.seed, devices=jax.devices()[:1])

    def complete(prompt: str, max_tokens: int) -> list[int]:
        return asyncio.run(eng.complete(list(prompt.encode()), SamplingParams(max_tokens=max_tokens, temperature=0.0)))[
            1
        ]

    return complete


def _client(llm):
    import openai

    return openai.OpenAI(base_url=llm["base"], api_key="unused", max_retries=0, timeout=60)


def _stats(llm):
    import requests

    return requests.get(f"{llm['base']}/rayslice/stats", timeout=30).json()


def test_sharded_over_two_hosts_gives_the_unsharded_greedy_tokens_streaming_or_not(llm, reference):
    client = _client(llm)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    stats = _stats(llm)
    assert stats["hosts"] == 2 and stats["devices"] == 8 and stats["mesh"] == {"data": 2, "model": 4}
    # "auto" = data_tensor: 4-way tensor parallel inside each host, the hosts split the slots, and the
    # compiled programs (checked on the hosts at start-up) have no collective between the two hosts.
    assert stats["layout"] == "data_tensor" and stats["cross_host_collectives"] == 0
    for prompt in PROMPTS:
        r = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=24, temperature=0, extra_body={"return_token_ids": True}
        )
        assert r.choices[0].model_extra["token_ids"] == reference(prompt, 24), prompt
        assert r.usage.prompt_tokens == len(prompt.encode()) and r.usage.completion_tokens == 24
        chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stream=True))
        assert len(chunks) > 2  # tokens arrive as they are produced, not as one body
        assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts = list(chat)
    assert parts[0].choices[0].delta.role == "assistant" and parts[-1].usage.completion_tokens <= 10


def test_concurrent_requests_of_different_lengths_match_their_sequential_answers(llm, reference):
    client = _client(llm)
    jobs = [(PROMPTS[i % 4] + " " * i, 8 + 5 * i) for i in range(10)]  # more requests than the 8 slots
    want = [reference(p, n) for p, n in jobs]
    compiles = _stats(llm)["compiles"]

    def one(job):
        prompt, n = job
        if n % 2:
            return "".join(
                c.choices[0].text
                for c in client.completions.create(
                    model="tiny", prompt=prompt, max_tokens=n, temperature=0, stream=True
                )
            )
        r = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=n, temperature=0, extra_body={"return_token_ids": True}
        )
        return r.choices[0].model_extra["token_ids"]

    with cf.ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(one, jobs))
    from rayslice.serve.llm import ByteTokenizer

    tok = ByteTokenizer()
    for g, w, (_, n) in zip(got, want, jobs):
        if n % 2:
            assert g == tok.decode(w)
        else:
            assert g == w
    assert _stats(llm)["compiles"] == compiles  # fixed shapes: nothing recompiled on either host


def test_the_tensor_layout_across_both_hosts_gives_the_same_greedy_tokens(llm, reference):
    """layout="tensor": 8-way tensor parallel over both hosts (all-reduces between them), same answers."""
    import dataclasses

    from ray import serve

    sim = llm["sim"]
    name = sim.add_slice(SliceSpec("TPU-V5P", "2x2x2", name="llm-t"))
    llm["slices"].append(name)
    serve.run(build_app(dataclasses.replace(CFG, layout="tensor")), name="llm-t", route_prefix="/llm-t")
    try:
        client = _client({"base": llm["base"].replace("/llm/", "/llm-t/")})
        stats = _stats({"base": llm["base"].replace("/llm/", "/llm-t/")})
        assert stats["mesh"] == {"data": 1, "model": 8} and stats["layout"] == "tensor"
        assert stats["cross_host_collectives"] >= 2 * LM.num_layers  # one per layer, in decode and in prefill
        for prompt in PROMPTS[:2]:
            r = client.completions.create(
                model="tiny", prompt=prompt, max_tokens=16, temperature=0, extra_body={"return_token_ids": True}
            )
            assert r.choices[0].model_extra["token_ids"] == reference(prompt, 16), prompt
    finally:
        serve.delete("llm-t")
        sim.preempt_slice(name)


def test_a_client_that_disconnects_mid_stream_frees_its_slot(llm):
    client = _client(llm)
    before = _stats(llm)["cancelled"]
    stream = client.completions.create(model="tiny", prompt="def ", max_tokens=64, temperature=0, stream=True)
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()  # the HTTP connection goes away
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        s = _stats(llm)
        if s["cancelled"] > before and s["slots_busy"] == 0:
            break
        time.sleep(0.05)
    assert s["cancelled"] > before and s["slots_busy"] == 0


@pytest.mark.parametrize(
    "body, status, code",
    [
        (b"{not json", 400, None),
        (b'{"model": "tiny", "prompt": "x", "max_tokens": 0}', 400, "invalid_value"),
        (b'{"model": "tiny", "prompt": "x", "max_tokens": 65}', 400, "invalid_value"),
        (b'{"model": "tiny", "prompt": "x", "max_tokens": "3"}', 400, "invalid_type"),
        (b'{"model": "tiny", "prompt": ["x", 1]}', 400, "invalid_type"),
        (b'{"model": "other", "prompt": "x"}', 404, "model_not_found"),
        (b'{"model": "tiny", "prompt": "' + b"y" * 200 + b'"}', 400, "context_length_exceeded"),
        (b'{"model": "tiny", "messages": "hi"}', 400, "invalid_type"),
    ],
)
def test_bad_requests_get_4xx_with_an_openai_error_body(llm, body, status, code):
    import requests

    route = "/chat/completions" if b"messages" in body else "/completions"
    r = requests.post(llm["base"] + route, data=body, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["code"] == code


def test_the_openai_client_sees_typed_errors(llm):
    import openai

    client = _client(llm)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "z" * 150}])


def test_a_lost_host_gives_503_and_the_replica_is_replaced(llm):
    import openai

    sim = llm["sim"]
    llm["slices"].append(sim.add_slice(SliceSpec("TPU-V5P", "2x2x2", name="llm-1")))  # the node pool's spare
    client = _client(llm)
    victim = _stats(llm)["slice"]
    # The host to lose: one the replica's own process does not run on (the replica needs no CPU,
    # so Serve may place it on a host of its slice; losing that host drops the HTTP connection instead).
    replica_node = _stats(llm)["replica_node_id"]
    worker = next(h.worker_id for h in sim.slices[victim].hosts if h.node_id != replica_node)
    # Streams in flight on the slots of both hosts when one host dies: the replica must fail them
    # (an SSE error event, 503), not hang or end them silently. Requests that arrive later either
    # get 503 from the broken replica or wait for its replacement (Serve's health check may win the race).
    streams = [
        client.completions.create(model="tiny", prompt=f"def f{i}(", max_tokens=64, temperature=0, stream=True)
        for i in range(4)
    ]
    for st in streams:
        next(iter(st))  # every stream has produced a token: all are on the old replica
    sim.preempt_host(victim, worker, wait=False)
    failed = []
    for st in streams:
        try:
            for _ in st:
                pass
        except openai.APIError as e:
            failed.append(e)
    assert failed, "no stream in flight on the slice failed when its host died"
    assert all("host" in str(e.message) or "slice" in str(e.message) for e in failed), [e.message for e in failed]
    codes = []
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline:
        try:
            r = client.completions.create(model="tiny", prompt="def ", max_tokens=4, temperature=0)
            codes.append(200)
            if _stats(llm)["slice"] != victim:
                break
        except openai.APIStatusError as e:
            codes.append(e.status_code)
            assert e.status_code == 503 and e.body["type"] == "server_error", e.body
        except (openai.APIConnectionError, openai.APITimeoutError):
            codes.append(0)
        time.sleep(0.2)
    assert codes[-1] == 200, codes
    assert r.usage.completion_tokens == 4 and _stats(llm)["slice"] not in (victim, None)
