"""LLM serving without Ray: tokenizer, stop strings, scheduler, model + KV cache, engine, OpenAI API over ASGI."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rayslice.errors import InvalidArgument
from rayslice.serve.llm import api
from rayslice.serve.llm.deployment import LLMConfig
from rayslice.serve.llm.engine import Delta, EngineConfig, Finished, SamplingParams, Scheduler, local_engine
from rayslice.serve.llm.model import LMConfig, forward, init_params, mesh_shape, resolve_layout
from rayslice.serve.llm.runner import ModelRunner, StepResult, collectives_spanning, compile_count, merge_results
from rayslice.serve.llm.tokenizer import EOS_ID, IM_END_ID, ByteTokenizer, IncrementalDecoder, StopMatcher

LM = LMConfig(d_model=32, num_layers=2, num_heads=4, d_ff=64, max_len=64)
ENG = EngineConfig(num_slots=4, max_context=64, prefill_buckets=(16, 64), max_tokens_limit=48, default_max_tokens=8)
TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def engines():
    import jax
    from jax.sharding import Mesh

    params = init_params(LM, seed=3)
    # "dt": the data_tensor layout as on a 2-host slice, here with 2 devices standing for each host.
    two_by_two = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    return {
        "one": local_engine(LM, ENG, params, devices=jax.devices()[:1]),
        "tp": local_engine(LM, ENG, params, devices=jax.devices()[:4], layout="tensor"),
        "dt": local_engine(LM, ENG, params, mesh=two_by_two),
    }


def run(coro):
    return asyncio.run(coro)


# -- tokenizer and stop strings -------------------------------------------------------------------


@given(st.text())
def test_bytes_roundtrip(text):
    assert TOK.decode(TOK.encode(text)) == text
    d = IncrementalDecoder()
    assert "".join(d.feed(i) for i in TOK.encode(text)) + d.flush() == text


def test_chat_template_cannot_be_forged_from_a_message():
    ids = TOK.apply_chat_template([{"role": "user", "content": "<|im_end|>"}])
    assert ids.count(IM_END_ID) == 1 and ids[:1] == [TOK.im_start_id]
    assert TOK.decode(ids) == "user\n<|im_end|>\nassistant\n"


@given(
    st.text(alphabet="ab\n", max_size=40),
    st.lists(st.text(alphabet="ab\n", min_size=1, max_size=3), max_size=3),
    st.lists(st.integers(1, 5), min_size=1, max_size=40),
)
def test_stop_matcher_never_leaks_a_stop_and_loses_nothing(text, stops, cuts):
    m = StopMatcher(stops)
    out, i, stopped = [], 0, False
    for c in cuts * 10:
        if i >= len(text) or stopped:
            break
        piece, stopped = m.feed(text[i : i + c])
        out.append(piece)
        i += c
    if not stopped:
        out.append(m.feed(text[i:])[0])
        stopped = m.stopped
        out.append(m.flush())
    got = "".join(out)
    assert text.startswith(got)
    assert not any(s in got for s in stops)
    if stopped:
        assert any(text.startswith(got + s) for s in stops)
    else:
        assert got == text and not any(s in text for s in stops)


@given(st.text(alphabet="xyz.", max_size=30), st.integers(1, 4))
def test_a_single_stop_truncates_at_its_first_occurrence(text, chunk):
    m = StopMatcher(["."])
    out = []
    for k in range(0, len(text), chunk):
        out.append(m.feed(text[k : k + chunk])[0])
    out.append(m.flush())
    assert "".join(out) == text.split(".")[0]


# -- the scheduler with a fake model (pure) --------------------------------------------------------


class FakeRunner:
    """Per-slot state like the real runner; the next token depends only on the sequence so far."""

    def __init__(self, n):
        self.hist = [[] for _ in range(n)]

    @staticmethod
    def next_token(seq):
        return (sum(seq) * 31 + len(seq)) % 200 + 40  # printable bytes, never a stop token

    def step(self, step):
        firsts = []
        for p in step.prefills:
            self.hist[p.slot] = list(p.tokens)
            firsts.append(self.next_token(self.hist[p.slot]))
            self.hist[p.slot].append(firsts[-1])
        toks = None
        if step.decode is not None:
            toks = np.zeros(len(self.hist), np.int32)
            for s, on in enumerate(step.decode.active):
                if on:
                    toks[s] = self.next_token(self.hist[s])
                    self.hist[s].append(int(toks[s]))
        return StepResult(tuple(firsts), toks)


def reference(prompt, max_tokens):
    seq, out = list(prompt), []
    for _ in range(max_tokens):
        out.append(FakeRunner.next_token(seq))
        seq.append(out[-1])
    return out


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.lists(st.integers(0, 255), min_size=1, max_size=20), st.integers(1, 20), st.integers(0, 6), st.booleans()
        ),
        min_size=1,
        max_size=12,
    ),
    st.sampled_from([(1, 1), (2, 1), (2, 2), (3, 1), (3, 3), (4, 1), (4, 2), (4, 4)]),
    st.integers(1, 3),
)
def test_scheduler_interleaving_gives_sequential_answers(reqs, slots_groups, per_step):
    slots, groups = slots_groups
    cfg = EngineConfig(
        num_slots=slots,
        max_context=64,
        prefill_buckets=(16, 32),
        max_tokens_limit=32,
        max_prefills_per_step=per_step,
        default_max_tokens=1,
    )
    sched, fake = Scheduler(cfg, groups=groups), FakeRunner(slots)
    per = slots // groups
    pending = list(enumerate(reqs))
    live, it = {}, 0
    while pending or sched.has_work:
        # Requests arrive between steps (the third field says after how many steps).
        for i, (prompt, mt, arrive, cancel) in list(pending):
            if arrive <= it:
                live[i] = sched.add(prompt, SamplingParams(max_tokens=mt, temperature=0.0))
                pending.remove((i, (prompt, mt, arrive, cancel)))
        for i, r in live.items():
            if reqs[i][3] and len(r.generated) >= 2:
                sched.cancel(r)
        step = sched.plan()
        if step is not None:
            assert sched.busy_slots <= slots and len(step.prefills) <= per_step
            # New requests spread over the slot groups: no group gets a second one while another has room.
            by_group = [sum(p.slot // per == g for p in step.prefills) for g in range(groups)]
            room = [sum(r is None for r in sched.slots[g * per : (g + 1) * per]) for g in range(groups)]
            assert all(by_group[g] <= by_group[h] + 1 or room[h] == 0 for g in range(groups) for h in range(groups))
            sched.apply(fake.step(step))
        it += 1
        assert it < 2000
    for i, r in live.items():
        prompt, mt, _, cancel = reqs[i]
        assert r.finished is not None
        want = reference(prompt, mt)
        if r.finished.reason == "cancelled":
            assert cancel and r.generated == want[: len(r.generated)]
        else:
            assert r.finished.reason == "length" and r.generated == want
            assert r.finished.completion_tokens == mt and r.finished.prompt_tokens == len(prompt)
            text = "".join(e.text for e in r.outbox if isinstance(e, Delta))
            assert text == TOK.decode(want)
    assert sched.busy_slots == 0


def test_scheduler_refuses_what_cannot_fit():
    sched = Scheduler(ENG)
    with pytest.raises(ValueError, match="at most 63 prompt tokens"):
        sched.add([1] * 64, SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="exceeds the limit of 48"):
        sched.add([1], SamplingParams(max_tokens=49))
    with pytest.raises(ValueError, match="maximum context length is 64"):
        sched.add([1] * 40, SamplingParams(max_tokens=30))
    with pytest.raises(ValueError, match="max_tokens=0"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="prefill_buckets"):
        EngineConfig(max_context=64, prefill_buckets=(32, 128))


# -- the model, KV cache, sharding ----------------------------------------------------------------


def test_mesh_puts_heads_on_the_model_axis():
    assert mesh_shape(8, LMConfig()) == (1, 8)
    assert mesh_shape(4, LM) == (1, 4)
    assert mesh_shape(8, LM) == (2, 4)
    assert mesh_shape(8, LMConfig(), layout="data_tensor", devices_per_host=4) == (2, 4)
    assert mesh_shape(8, LMConfig(), layout="tensor", devices_per_host=4) == (1, 8)
    assert mesh_shape(16, LMConfig(), layout="data_tensor", devices_per_host=4) == (4, 4)
    assert resolve_layout("auto", 2) == "data_tensor" and resolve_layout("tensor", 4) == "tensor"
    with pytest.raises(InvalidArgument, match="layout='rows' is not valid: expected one of 'auto', 'tensor'"):
        LLMConfig(layout="rows")
    with pytest.raises(InvalidArgument, match="devices_per_host=3"):
        mesh_shape(8, LM, layout="data_tensor", devices_per_host=3)


def test_slots_must_split_evenly_over_the_data_axis():
    import jax
    from jax.sharding import Mesh

    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    with pytest.raises(InvalidArgument, match="num_slots=3 is not valid: expected a multiple of the mesh's data axis"):
        ModelRunner(LM, init_params(LM), num_slots=3, max_context=16, vocab_limit=TOK.vocab_size, mesh=mesh)
    with pytest.raises(InvalidArgument, match="groups=2"):
        Scheduler(EngineConfig(num_slots=3, max_context=64, prefill_buckets=(16,)), groups=2)
    a = StepResult((4, -1), np.array([3, 3, -1, -1]), 0.1)
    b = StepResult((-1, 9), np.array([-1, -1, 5, 6]), 0.3)
    m = merge_results([a, b])
    assert m.prefill_tokens == (4, 9) and m.decode_tokens.tolist() == [3, 3, 5, 6] and m.device_s == 0.3


def test_llm_config_refuses_a_mesh_the_slice_cannot_build_before_anything_starts():
    # v4 2x2x2: 8 devices, 4 per host; the default LM (8 heads, d_ff 256) splits over any of them.
    with pytest.raises(
        InvalidArgument, match=r"tensor_parallel=3 is not valid: expected a divisor of 4 .*'data_tensor'"
    ):
        LLMConfig(tensor_parallel=3)
    assert LLMConfig(tensor_parallel=8, layout="tensor").tensor_parallel == 8  # across both hosts: allowed
    with pytest.raises(
        InvalidArgument, match=r"engine.num_slots=4 is not valid: expected a multiple of 8, the slot groups"
    ):
        LLMConfig(tensor_parallel=1, engine=EngineConfig(num_slots=4))
    with pytest.raises(InvalidArgument, match="tensor_parallel=4 is not valid: expected a divisor of 2"):
        LLMConfig(lm=LMConfig(d_model=48, num_heads=6, d_ff=96), tensor_parallel=4)


@given(
    tp=st.none() | st.integers(1, 9),
    slots=st.integers(1, 33),
    layout=st.sampled_from(["auto", "tensor", "data_tensor"]),
)
def test_llm_config_accepts_exactly_what_every_host_can_build(tp, slots, layout):
    span = 8 if layout == "tensor" else 4  # the devices a model group may span (auto: inside one host)
    model = span if tp is None else tp
    ok = span % model == 0 and slots % (8 // model) == 0
    try:
        LLMConfig(layout=layout, tensor_parallel=tp, engine=EngineConfig(num_slots=slots))
    except InvalidArgument:
        assert not ok
    else:
        assert ok


def test_a_host_runs_only_the_programs_of_the_slots_it_holds():
    """With no collective between hosts, a host skips prefills and decodes of other hosts' slots (-1 there)."""
    import jax
    from jax.sharding import Mesh

    from rayslice.serve.llm.runner import Decode, Prefill, Step

    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    r = ModelRunner(LM, init_params(LM, seed=3), num_slots=4, max_context=64, vocab_limit=TOK.vocab_size, mesh=mesh)
    assert r.local_groups == {0, 1} and not r.skip_others  # one process holds both groups
    r.skip_others, r.local_groups = True, frozenset({0})  # as host 0 of two would see it
    p = [Prefill(slot=s, tokens=(104, 105), bucket=16, temperature=0.0, top_p=1.0, seed=0) for s in (0, 3)]
    active = np.array([False, False, True, False])
    d = Decode(active, np.zeros(4, np.float32), np.ones(4, np.float32), np.zeros(4, np.uint32))
    res = r.step(Step(prefills=tuple(p), decode=d))
    assert res.prefill_tokens[0] >= 0 and res.prefill_tokens[1] == -1
    assert res.decode_tokens.tolist() == [-1, -1, -1, -1]  # slot 2 is group 1's: not run here


def test_data_tensor_layout_keeps_every_collective_inside_a_host(engines):
    """The decode and prefill programs: the tensor layout all-reduces across "hosts", data_tensor never does."""
    dt, tp = engines["dt"].executor.runner, engines["tp"].executor.runner
    assert dict(dt.mesh.shape) == {"data": 2, "model": 2} and dict(tp.mesh.shape) == {"data": 1, "model": 4}
    for r, expect_crossing in ((dt, False), (tp, True)):
        host = {d: i // 2 for i, d in enumerate(r.mesh.devices.flat)}  # devices 0-1 stand for host 0, 2-3 for host 1
        devices = r.program_devices()
        assert len(devices["prefill"]) == r.mesh.shape["model"]  # a prefill runs on its slot group's devices only
        for name, hlo in r.compiled_hlo(16).items():
            ids = list(range(len(devices[name])))
            assert len(collectives_spanning(hlo, ids)) >= LM.num_layers, name  # one all-reduce per layer
            crossing = collectives_spanning(hlo, [host[d] for d in devices[name]])
            assert bool(crossing) == expect_crossing, name
    assert dt.collectives_between_hosts(16) == []  # one process: nothing can cross


def test_cached_greedy_decoding_matches_the_full_forward_pass(engines):
    prompt = TOK.encode("def add(a, b):\n    return")
    text, ids, fin = run(engines["one"].complete(prompt, SamplingParams(max_tokens=20, temperature=0.0)))
    seq = np.array([prompt + ids], np.int32)
    logits = np.asarray(forward(LM, init_params(LM, seed=3), seq))[0]
    want = logits[len(prompt) - 1 : -1, : TOK.vocab_size].argmax(-1)
    assert ids == want[: len(ids)].tolist()
    assert fin.completion_tokens == len(ids) and fin.prompt_tokens == len(prompt)


def test_both_layouts_give_the_unsharded_greedy_tokens(engines):
    for prompt in ("import os", "x" * 40, "class A:\n  pass\n"):
        p = SamplingParams(max_tokens=24, temperature=0.0)
        a = run(engines["one"].complete(TOK.encode(prompt), p))
        assert run(engines["tp"].complete(TOK.encode(prompt), p))[1] == a[1]
        assert run(engines["dt"].complete(TOK.encode(prompt), p))[1] == a[1]


@pytest.mark.parametrize("layout", ["tp", "dt"])
def test_concurrent_requests_match_their_sequential_answers_and_nothing_recompiles(engines, layout):
    eng = engines[layout]
    prompts = [TOK.encode("a" * n) for n in (1, 5, 17, 30, 50, 3)]
    limits = [30, 5, 12, 8, 13, 20]
    seq = [run(eng.complete(p, SamplingParams(max_tokens=m, temperature=0.0))) for p, m in zip(prompts, limits)]
    before = compile_count()

    async def together():
        return await asyncio.gather(
            *[eng.complete(p, SamplingParams(max_tokens=m, temperature=0.0)) for p, m in zip(prompts, limits)]
        )

    par = run(together())
    assert [r[1] for r in par] == [r[1] for r in seq]
    assert [r[2].completion_tokens for r in par] == limits  # 6 requests through 4 slots
    sampled = [
        run(eng.complete(prompts[2], SamplingParams(max_tokens=10, temperature=0.9, top_p=0.8, seed=s)))
        for s in (1, 1, 2)
    ]
    assert sampled[0][1] == sampled[1][1]  # a seed makes sampling reproducible
    nucleus = run(eng.complete(prompts[2], SamplingParams(max_tokens=10, temperature=1.5, top_p=1e-6, seed=4)))
    assert nucleus[1] == seq[2][1][:10]  # a tiny top_p keeps only the most likely token: greedy
    assert compile_count() == before  # fixed shapes: no request compiled anything


def test_stop_strings_and_stop_tokens(engines):
    eng = engines["one"]
    prompt = TOK.encode("hello")
    text, ids, _ = run(eng.complete(prompt, SamplingParams(max_tokens=30, temperature=0.0)))
    full = TOK.decode(ids)
    stop = full[5:7]
    t2, _, fin = run(eng.complete(prompt, SamplingParams(max_tokens=30, temperature=0.0, stop=(stop,))))
    assert fin.reason == "stop" and t2 == full[: full.find(stop)] and stop not in t2
    assert EOS_ID in TOK.stop_ids and IM_END_ID in TOK.stop_ids


def test_a_cancelled_request_frees_its_slot(engines):
    eng = engines["one"]

    async def scenario():
        req = eng.submit(TOK.encode("long"), SamplingParams(max_tokens=40, temperature=0.0))
        agen = eng.events(req)
        async for ev in agen:
            assert isinstance(ev, Delta)
            break
        await agen.aclose()  # the client went away
        for _ in range(2000):  # the slot is freed once the step in flight (if any) is applied
            if eng.scheduler.busy_slots == 0:
                break
            await asyncio.sleep(0.001)
        assert req.finished.reason == "cancelled" and len(req.generated) < 40
        return eng.scheduler.busy_slots, eng.stats()["cancelled"]

    busy, cancelled = run(scenario())
    assert busy == 0 and cancelled >= 1


# -- the OpenAI API ---------------------------------------------------------------------------------

LIMITS = api.Limits(64, 48, 8, 63)


@pytest.mark.parametrize(
    "body, status, param, text",
    [
        ({"model": "nope", "prompt": "x"}, 404, "model", "does not exist"),
        ({"prompt": "x"}, 400, "model", "must provide a model"),
        ({"model": "m", "prompt": "x", "max_tokens": 0}, 400, "max_tokens", ">= 1"),
        ({"model": "m", "prompt": "x", "max_tokens": -3}, 400, "max_tokens", ">= 1"),
        ({"model": "m", "prompt": "x", "max_tokens": 49}, 400, "max_tokens", "at most 48"),
        ({"model": "m", "prompt": "x", "max_tokens": "5"}, 400, "max_tokens", "not of type 'integer'"),
        ({"model": "m", "prompt": "x", "max_tokens": 2.5}, 400, "max_tokens", "not of type 'integer'"),
        ({"model": "m", "prompt": "x" * 64}, 400, "prompt", "maximum context length"),
        ({"model": "m", "prompt": "x" * 40, "max_tokens": 30}, 400, "max_tokens", "requested 70 tokens"),
        ({"model": "m", "prompt": 5}, 400, "prompt", "must be a string"),
        ({"model": "m", "prompt": ""}, 400, "prompt", "empty"),
        ({"model": "m", "prompt": [1, 999]}, 400, "prompt", "out of range"),
        ({"model": "m", "prompt": "x", "temperature": "hot"}, 400, "temperature", "not of type 'number'"),
        ({"model": "m", "prompt": "x", "temperature": 3}, 400, "temperature", "<= 2"),
        ({"model": "m", "prompt": "x", "top_p": 0}, 400, "top_p", "> 0"),
        ({"model": "m", "prompt": "x", "stop": 3}, 400, "stop", "list of strings"),
        ({"model": "m", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "at most 4"),
        ({"model": "m", "prompt": "x", "stream": "yes"}, 400, "stream", "boolean"),
        ({"model": "m", "prompt": "x", "n": 2}, 400, "n", "only n=1"),
        ({"model": "m", "prompt": "x", "bogus": 1}, 400, "bogus", "Unrecognized request argument"),
    ],
)
def test_bad_completion_requests(body, status, param, text):
    with pytest.raises(api.APIError) as e:
        api.parse_completion(body, "m", LIMITS)
    assert e.value.status == status and e.value.param == param and text in e.value.message
    err = e.value.body()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "body, text",
    [
        ({"model": "m"}, "'messages' must be a non-empty list"),
        ({"model": "m", "messages": []}, "'messages' must be a non-empty list"),
        ({"model": "m", "messages": ["hi"]}, "must be an object"),
        ({"model": "m", "messages": [{"role": "tool", "content": "x"}]}, "role='tool' is not supported"),
        ({"model": "m", "messages": [{"role": "user", "content": 3}]}, "must be a string or a list of text parts"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, ">= 1"),
    ],
)
def test_bad_chat_requests(body, text):
    with pytest.raises(api.APIError) as e:
        api.parse_chat(body, "m", LIMITS)
    assert e.value.status == 400 and text in e.value.message


def test_chat_parsing_and_defaults():
    spec = api.parse_chat(
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            ],
        },
        "m",
        LIMITS,
    )
    assert TOK.decode(spec.prompt, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    assert spec.params.max_tokens == min(48, 64 - len(spec.prompt)) and spec.params.temperature == 1.0
    with pytest.raises(api.APIError, match="parse the JSON"):
        api.parse_json(b"{nope")


@settings(max_examples=80, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.dictionaries(
        st.sampled_from(sorted(api.COMPLETION_KEYS) + ["x"]),
        st.one_of(
            st.none(),
            st.booleans(),
            st.integers(-5, 100),
            st.floats(allow_nan=True),
            st.text(max_size=5),
            st.lists(st.integers(-2, 300), max_size=3),
        ),
        max_size=6,
    )
)
def test_any_completion_body_is_valid_or_an_openai_error(body):
    body = {"model": "m", **body}
    try:
        spec = api.parse_completion(body, "m", LIMITS)
    except api.APIError as e:
        assert 400 <= e.status < 500 and e.body()["error"]["message"]
    else:
        assert 1 <= spec.params.max_tokens <= 48 and len(spec.prompt) + spec.params.max_tokens <= 64


def test_openai_client_over_asgi(engines):
    """The real openai client against the HTTP routes (an ASGI app, no Ray)."""
    import httpx2 as httpx
    import openai
    from starlette.applications import Starlette
    from starlette.routing import Route

    from rayslice.serve.llm.server import OpenAIServer

    eng = engines["one"]
    server = OpenAIServer(eng, "tiny")
    asgi = Starlette(routes=[Route("/{path:path}", server.handle, methods=["GET", "POST", "PUT"])])

    async def scenario():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi), base_url="http://t")
        client = openai.AsyncOpenAI(base_url="http://t/v1", api_key="x", http_client=http, max_retries=0)
        models = await client.models.list()
        assert [m.id for m in models.data] == ["tiny"]
        r = await client.completions.create(
            model="tiny", prompt="def f(", max_tokens=12, temperature=0, extra_body={"return_token_ids": True}
        )
        ref = await eng.complete(TOK.encode("def f("), SamplingParams(max_tokens=12, temperature=0.0))
        assert r.choices[0].text == ref[0] and r.choices[0].model_extra["token_ids"] == ref[1]
        assert r.usage.prompt_tokens == 6 and r.usage.completion_tokens == 12 and r.choices[0].finish_reason == "length"
        stream = await client.completions.create(
            model="tiny",
            prompt="def f(",
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
        assert "".join(c.choices[0].text for c in chunks if c.choices) == ref[0]
        assert chunks[-1].usage.completion_tokens == 12
        chat = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0
        )
        assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens <= 5
        cs = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0, stream=True
        )
        parts = [c.choices[0].delta.content or "" async for c in cs]
        assert "".join(parts) == chat.choices[0].message.content
        with pytest.raises(openai.NotFoundError) as e:
            await client.completions.create(model="other", prompt="x")
        assert e.value.body["code"] == "model_not_found"
        with pytest.raises(openai.BadRequestError) as e:
            await client.completions.create(model="tiny", prompt="x", max_tokens=0)
        assert e.value.body["param"] == "max_tokens"
        raw = await http.post("/v1/completions", content=b"{not json")
        assert raw.status_code == 400 and raw.json()["error"]["type"] == "invalid_request_error"
        raw = await http.get("/v1/completions")
        assert raw.status_code == 405
        stats = (await http.get("/v1/rayslice/stats")).json()
        assert stats["slots_busy"] == 0 and stats["slots_total"] == 4
        await http.aclose()

    run(scenario())
    json.dumps(eng.stats())
    assert isinstance(Finished("stop", 1, 1, None), Finished)


def test_slice_executor_sends_a_step_to_the_hosts_with_work_only_and_a_failure_breaks_it():
    """Hosts skip others' slots: a step goes to the hosts holding its slots; a host that fails or hangs breaks it."""
    from rayslice.serve.llm.deployment import SliceExecutor
    from rayslice.serve.llm.engine import EngineError
    from rayslice.serve.llm.runner import Decode, Prefill, Step

    async def scenario():
        sent: list[list[int]] = []
        host1 = {"fails": False}

        async def reply(rank):
            if rank == 1:  # host 1 hangs, or fails
                if host1["fails"]:
                    raise RuntimeError("host 1 died")
                await asyncio.sleep(30)
            return StepResult((7,), np.array([3, -1, -1, -1]), 0.0)

        class Gang:
            def run_async_on(self, ranks, fn, step):
                sent.append(list(ranks))
                return [reply(r) for r in ranks]

        ex = object.__new__(SliceExecutor)
        ex.cfg, ex.slice_name, ex.gang = LLMConfig(step_timeout_s=0.5), "s", Gang()
        ex._skip, ex._groups_of_rank, ex._per_group = True, [{0, 1}, {2, 3}], 1
        p = Prefill(slot=0, tokens=(1,), bucket=16, temperature=0.0, top_p=1.0, seed=0)
        d = Decode(np.array([1, 0, 1, 0], bool), np.zeros(4, np.float32), np.ones(4, np.float32), np.zeros(4))
        assert ex.ranks_with_work(Step(prefills=(p,))) == [0] and ex.ranks_with_work(Step(decode=d)) == [0, 1]
        res = await ex.run(Step(prefills=(p,)))  # host 1 holds nothing of it: not called
        assert res.prefill_tokens == (7,) and sent == [[0]]
        with pytest.raises(EngineError, match="did not finish a step within 0.5 s"):
            await ex.run(Step(decode=d))  # host 1 does not answer
        assert sent[-1] == [0, 1]
        host1["fails"] = True
        with pytest.raises(EngineError, match="host rank 1 failed: .*host 1 died"):
            await ex.run(Step(decode=d))
        ex._skip = False  # hosts that run collectives together: every step goes to every host
        with pytest.raises(EngineError, match="host rank 1 failed"):
            await ex.run(Step(prefills=(p,)))
        assert sent[-1] == [0, 1]

    run(scenario())
