"""Serving on slices with real Ray Serve and real HTTP requests on the simulated cluster."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import rayslice
from rayslice import serve as slice_serve
from rayslice.sim import SliceSpec

from . import serve_models
from .serve_models import SPEC, Dot, expected

pytestmark = [pytest.mark.ray, pytest.mark.slow]

V6E = {"type": "tpu", "topology": "2x4", "chips_per_host": 4}  # two 4-chip hosts per slice


@pytest.fixture(scope="module")
def serving(sim):
    """Serve on the session cluster, HTTP on an explicit port; two v6e 2x4 slices of its own."""
    from ray import serve

    names = [sim.add_slice(SliceSpec("v6e", "2x4", chips_per_host=4, name=f"serve-{i}")) for i in range(2)]
    port = slice_serve.start_http()
    try:
        yield {"port": port, "slices": names, "sim": sim}
    finally:
        serve.shutdown()
        for n in names:
            if any(h.alive for h in sim.slices[n].hosts):
                sim.preempt_slice(n)


def _url(serving, route: str) -> str:
    return f"http://127.0.0.1:{serving['port']}{route}"


def _post(serving, route, body=None, data=None, timeout=30):
    import requests

    return requests.post(_url(serving, route), json=body, data=data, timeout=timeout)


def _replica_slices(app: str, deployment: str) -> set[str]:
    return {s.name for s in rayslice.list_slices() if s.name.startswith("serve-") and s.state == "busy"}


def _dot(**opts):
    return slice_serve.deployment(accelerator_type="TPU-V6E", accelerator_config=V6E, input_spec=SPEC, **opts)(Dot)


def test_http_answer_is_computed_across_both_hosts(serving):
    import ray
    from ray import serve

    handle = serve.run(_dot().bind(2.0), name="dot", route_prefix="/dot")
    # Serve started the replica on host 0 of a free slice: the replica is that host itself, and the
    # only gang actor is host 1's (no Ray call between a request and host 0's answer).
    assert handle.host0_here.remote().result() is True
    named = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    assert [n.rsplit("/", 1)[-1] for n in named if n.startswith("Dot/")] == ["1"]
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    r = _post(serving, "/dot", {"inputs": {"x": x.tolist()}})
    assert r.status_code == 200, r.text
    out = r.json()["outputs"]
    np.testing.assert_allclose(out["y"], expected(x, 2.0), rtol=1e-5)
    assert out["hosts"] == [2, 2, 2]  # the global array spans both hosts of the slice
    # A DeploymentHandle call: numpy in, numpy out, batched the same way.
    got = handle.remote({"x": x[:1]}).result()
    np.testing.assert_allclose(got["y"], expected(x[:1], 2.0), rtol=1e-5)
    # Concurrent requests are batched into SPMD steps and each gets its own rows back.
    import concurrent.futures as cf

    xs = [np.full((1, 8), i, np.float32) for i in range(12)]
    with cf.ThreadPoolExecutor(12) as pool:
        outs = list(pool.map(lambda v: _post(serving, "/dot", {"inputs": {"x": v.tolist()}}).json(), xs))
    assert [o["outputs"]["y"][0] for o in outs] == [pytest.approx(float(expected(v, 2.0)[0])) for v in xs]
    serve.delete("dot")


@pytest.mark.parametrize(
    "body, status, message",
    [
        (b"{not json", 400, "malformed JSON"),
        (b"[1, 2]", 400, 'JSON object with "inputs"'),
        (b'{"inputs": {"x": [[1, 2]]}}', 422, "must have shape (rows, 8)"),
        (b'{"inputs": {"x": [["a", "b", "c", "d", "e", "f", "g", "h"]]}}', 422, "must be numeric"),
        (b'{"inputs": {"x": [[1,2,3,4,5,6,7,8], [1,2]]}}', 422, "rectangular"),
        (b'{"inputs": {"y": [[1,2,3,4,5,6,7,8]]}}', 422, "missing ['x'], unexpected ['y']"),
        (b'{"inputs": {"x": []}}', 422, "shape"),
        # Not strict JSON, or numbers no float32 can hold: a JSON 4xx, not a plain-text 500.
        (b'{"inputs": {"x": [[NaN, 1, 2, 3, 4, 5, 6, 7]]}}', 400, "NaN is not a JSON number"),
        (b'{"inputs": {"x": [[Infinity, 1, 2, 3, 4, 5, 6, 7]]}}', 400, "Infinity is not a JSON number"),
        (b'{"inputs": {"x": [[1e999, 1, 2, 3, 4, 5, 6, 7]]}}', 422, "1e999 overflows"),
        (b'{"inputs": {"x": [[1e39, 1, 2, 3, 4, 5, 6, 7]]}}', 422, "outside the float32 range"),
        (b'{"inputs": {"x": [[true, 1, 2, 3, 4, 5, 6, 7]]}}', 422, "got booleans"),
        (b'{"inputs": ' + b"[" * 2000 + b"]" * 2000 + b"}", 400, "nested too deeply"),
        (b'{"inputs": {"x": [[1,2,3,4,5,6,7,8]]}, "extra": 1}', 400, "unexpected keys"),
    ],
)
def test_bad_requests_are_4xx_and_the_replica_stays_healthy(serving, body, status, message):
    from ray import serve

    if "dot-fuzz" not in serve.status().applications:
        serve.run(_fuzz_dep().bind(), name="dot-fuzz", route_prefix="/fuzz")
    r = _post(serving, "/fuzz", data=body)
    assert r.status_code == status, r.text
    assert message in r.json()["error"]  # always a JSON answer
    ok = _post(serving, "/fuzz", {"inputs": {"x": [[1] * 8]}})
    assert ok.status_code == 200 and ok.json()["outputs"]["y"] == [36.0]


def _fuzz_dep():
    return _dot(max_body_bytes=4096, num_replicas=2, body_timeout_s=3.0)  # > a loaded machine's body pull


def _raw_http(port: int, head: bytes, body: bytes, timeout: float = 30) -> tuple[int, bytes]:
    """Sends raw bytes (e.g. a body shorter than its Content-Length); returns (status, body) of the answer."""
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(head + b"\r\n\r\n" + body)
        data = b""
        while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < _content_length(data):
            chunk = sock.recv(65536)  # a socket timeout fails the test: an answer must come
            if not chunk:
                break
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, data.partition(b"\r\n\r\n")[2]


def _content_length(data: bytes) -> int:
    for line in data.partition(b"\r\n\r\n")[0].split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


def test_short_body_bad_length_and_wrong_method_get_json_answers(serving):
    import json

    from ray import serve

    if "dot-fuzz" not in serve.status().applications:
        serve.run(_fuzz_dep().bind(), name="dot-fuzz", route_prefix="/fuzz")
    port = serving["port"]
    # A body shorter than its Content-Length: answered once body_timeout_s (3 s here) passes, never a hang.
    head = b"POST /fuzz HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: 100"
    status, body = _raw_http(port, head, b'{"inputs": ')
    assert status == 408, body
    assert "did not arrive within body_timeout_s=3" in json.loads(body)["error"]
    import requests

    r = requests.get(_url(serving, "/fuzz"), timeout=30)
    assert r.status_code == 405 and "POST" in r.json()["error"] and r.headers["allow"] == "POST"
    assert _post(serving, "/fuzz", {"inputs": {"x": [[1] * 8]}}).status_code == 200


def test_oversized_body_and_random_fuzz_keep_two_replicas_on_two_slices(serving):
    from ray import serve

    if "dot-fuzz" not in serve.status().applications:
        serve.run(_fuzz_dep().bind(), name="dot-fuzz", route_prefix="/fuzz")
    assert _replica_slices("dot-fuzz", "Dot") == set(serving["slices"])  # one whole slice per replica
    r = _post(serving, "/fuzz", data=b'{"inputs": {"x": [' + b"[1,2,3,4,5,6,7,8]," * 400 + b"[1,2,3,4,5,6,7,8]]}}")
    assert r.status_code == 413 and "exceeds the limit of 4096" in r.text
    rng = np.random.default_rng(1)
    for _ in range(40):
        junk = bytes(rng.integers(0, 256, rng.integers(1, 200)).astype(np.uint8))
        assert 400 <= _post(serving, "/fuzz", data=junk).status_code < 500
    status = serve.status().applications["dot-fuzz"]
    assert str(status.status).endswith("RUNNING")
    assert _post(serving, "/fuzz", {"inputs": {"x": [[0] * 8]}}).status_code == 200
    serve.delete("dot-fuzz")


def test_impossible_topology_fails_with_the_reason(serving):
    from ray import serve

    dep = slice_serve.deployment(
        accelerator_type="TPU-V6E",
        accelerator_config={"kind": "tpu", "topology": "8x8"},
        input_spec=SPEC,
        reservation_timeout_s=5,
        max_constructor_retry_count=1,
    )(Dot)
    t0 = time.monotonic()
    # rayslice's run() is serve.run whose exception carries the per-slice reason on one line.
    with pytest.raises(slice_serve.DeploymentFailed) as info:
        slice_serve.run(dep.bind(), name="too-big", route_prefix="/too-big")
    assert time.monotonic() - t0 < 60
    text = str(info.value)
    assert isinstance(info.value, RuntimeError) and "\n" not in text
    assert "no 1 slice(s) of v6e 8x8" in text and "serve-0: other shape" in text, text
    # Serve's own deployment message ends with the same one-line reason (Serve prefixes its traceback).
    message = serve.status().applications["too-big"].deployments["Dot"].message
    last = message.strip().splitlines()[-1]
    assert last.startswith("rayslice.errors.NoMatchingSlice: deployment Dot: no 1 slice(s) of v6e 8x8"), message
    assert "serve-0: other shape" in last
    assert slice_serve.failure_reason("too-big") in text
    serve.delete("too-big")


@pytest.mark.parametrize("worker", [0, 1], ids=["host0-the-replica-itself", "host1"])
def test_preempted_host_replica_is_replaced_on_another_slice(serving, worker):
    from ray import serve

    sim = serving["sim"]
    spare = sim.add_slice(SliceSpec("v6e", "2x4", chips_per_host=4, name=f"serve-spare-{worker}"))
    serving["slices"].append(spare)  # the fixture takes it down at the end
    serve.run(_dot().bind(), name="chaos", route_prefix="/chaos")
    before = _replica_slices("chaos", "Dot")
    assert len(before) == 1
    victim = before.pop()
    sim.preempt_host(victim, worker)
    # In-flight and later requests fail fast (never hang) until Serve replaces the replica.
    deadline = time.monotonic() + 90
    codes = []
    while time.monotonic() < deadline:
        r = _post(serving, "/chaos", {"inputs": {"x": [[1] * 8]}}, timeout=40)
        codes.append(r.status_code)
        if r.status_code == 200 and _replica_slices("chaos", "Dot") - {victim}:
            break
        time.sleep(0.5)
    assert codes[-1] == 200, codes
    after = _replica_slices("chaos", "Dot")
    assert victim not in after and len(after) == 1
    assert r.json()["outputs"]["y"] == [36.0]
    serve.delete("chaos")


def test_host_lost_during_a_request_is_503_and_the_replica_turns_unhealthy(serving, tmp_path):
    """A real kill of a host while a request is inside the model: 503 (JSON), not "the model raised" 500."""
    import concurrent.futures as cf

    from ray import serve

    sim = serving["sim"]
    victim = sim.add_slice(SliceSpec("v5e", "2x4", chips_per_host=4, name="lost-0"))  # the only v5e slice
    try:
        dep = slice_serve.deployment(
            accelerator_type="v5e",
            accelerator_config={"kind": "tpu", "topology": "2x4", "chips_per_vm": 4},
            input_spec=SPEC,
            request_timeout_s=30,
            reservation_timeout_s=3,
            health_check_period_s=1.0,
            # The replica itself stays on the head, so the kill hits only the gang.
            ray_actor_options={"num_cpus": 0, "resources": {"node:__internal_head__": 0.01}},
        )(serve_models.Gated)
        serve.run(dep.bind(str(tmp_path)), name="lost", route_prefix="/lost")
        assert _post(serving, "/lost", {"inputs": {"x": [[1] * 8]}}).json()["outputs"]["y"] == [36.0]
        gated = [[serve_models.GATE] + [0] * 7]
        with cf.ThreadPoolExecutor(1) as pool:
            future = pool.submit(_post, serving, "/lost", {"inputs": {"x": gated}}, None, 90)
            deadline = time.monotonic() + 60
            while not all((tmp_path / f"entered-{r}").exists() for r in (0, 1)):  # in flight on both hosts
                assert time.monotonic() < deadline and not future.done(), "the gated request never reached the hosts"
                time.sleep(0.05)
            sim.preempt_host(victim, 1)
            (tmp_path / "open").touch()  # host 0 now runs the step's collectives with a dead peer
            r = future.result()
        assert r.status_code == 503, r.text
        answer = r.json()
        assert answer["outcome"] == "preempted" and "(rank 1) was lost" in answer["error"], answer
        assert "the model raised" not in answer["error"]
        # The replica now reports unhealthy, so Serve takes it down to replace it.
        deadline = time.monotonic() + 60
        status = "HEALTHY"
        while status == "HEALTHY" and time.monotonic() < deadline:
            time.sleep(0.2)
            status = str(serve.status().applications["lost"].deployments["Gated"].status).rsplit(".", 1)[-1]
        assert status != "HEALTHY", status
    finally:
        serve.delete("lost")
        if any(h.alive for h in sim.slices[victim].hosts):
            sim.preempt_slice(victim)


def test_composes_behind_a_preprocessing_deployment(serving):
    from ray import serve

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class Scale:
        def __init__(self, model):
            self.model = model

        async def __call__(self, request):
            body = await request.json()
            x = np.asarray(body["values"], np.float32).reshape(-1, 8) / 10.0  # pre-processing
            out = await self.model.remote({"x": x})
            return {"y": out["y"].tolist()}

    serve.run(Scale.bind(_dot().bind(1.0)), name="composed", route_prefix="/composed")
    r = _post(serving, "/composed", {"values": list(range(10, 90, 10))})
    assert r.status_code == 200 and r.json()["y"] == [pytest.approx(float(expected(np.arange(1, 9)[None])[0]))]
    serve.delete("composed")


def test_serve_config_file_through_the_builder(serving, tmp_path):
    from ray import serve

    config = tmp_path / "serve.yaml"
    config.write_text(
        textwrap.dedent(f"""
        proxy_location: HeadOnly
        http_options: {{host: 127.0.0.1, port: {serving["port"]}}}
        applications:
          - name: from-yaml
            route_prefix: /yaml
            import_path: rayslice.serve.builder:app
            args:
              model: tests.serve_models:Dot
              accelerator_type: TPU-V6E
              accelerator_config: {{type: tpu, topology: 2x4, chips_per_host: 4}}
              input_spec: {{x: {{shape: [8], dtype: float32}}}}
              num_replicas: 1
              init_kwargs: {{scale: 3.0}}
    """)
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    serve_cli = os.path.join(os.path.dirname(sys.executable), "serve")
    out = subprocess.run(
        [serve_cli, "run", str(config), "--address", serving["sim"].address, "--non-blocking"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=root,
        env={**os.environ, "PYTHONPATH": root},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        r = _post(serving, "/yaml", {"inputs": {"x": [[1] * 8]}})
        if r.status_code == 200:
            break
        time.sleep(1)
    assert r.status_code == 200 and r.json()["outputs"]["y"] == [108.0]
    serve.delete("from-yaml")


def test_config_errors_name_the_value():
    with pytest.raises(ValueError, match="accelerator_config type 'gpu' is not supported; valid: tpu"):
        slice_serve.deployment(accelerator_type="TPU-V4", accelerator_config={"type": "gpu", "topology": "2x2x2"})
    with pytest.raises(ValueError, match="'3x3' is not a v6e topology"):
        slice_serve.deployment(accelerator_type="v6e", accelerator_config={"type": "tpu", "topology": "3x3"})
    with pytest.raises(ValueError, match="needs a 'topology'"):
        slice_serve.deployment(accelerator_type="v6e", accelerator_config={"type": "tpu"})
    with pytest.raises(ValueError, match="dtype 'object' is not numeric"):
        slice_serve.InputSpec.parse({"x": ((2,), "object")})


def test_a_model_error_is_500_and_the_replica_stays(serving):
    from ray import serve

    dep = slice_serve.deployment(accelerator_type="TPU-V6E", accelerator_config=V6E, input_spec=SPEC, max_batch_size=4)(
        serve_models.Picky
    )
    serve.run(dep.bind(), name="picky", route_prefix="/picky")
    bad = _post(serving, "/picky", {"inputs": {"x": [[-1] * 8]}})
    assert bad.status_code == 500 and "the model raised" in bad.text and "negative inputs" in bad.text
    assert _post(serving, "/picky", {"inputs": {"x": [[1] * 8]}}).json()["outputs"]["y"] == [36.0]
    too_many = _post(serving, "/picky", {"inputs": {"x": [[1] * 8] * 5}})
    assert too_many.status_code == 413 and "limit is 4" in too_many.text
    # Across more than one health-check period (2 s), the replica is never marked unhealthy.
    window = time.monotonic() + 3
    while time.monotonic() < window:
        assert str(serve.status().applications["picky"].status).endswith("RUNNING")
        time.sleep(0.5)
    assert _post(serving, "/picky", {"inputs": {"x": [[2] * 8]}}).status_code == 200
    serve.delete("picky")


def test_autoscaling_takes_and_releases_whole_slices(serving):
    import concurrent.futures as cf

    from ray import serve

    import rayslice

    # Two free serve slices are needed (the chaos test above broke one): the node pool adds one.
    free = [s for s in rayslice.list_slices() if s.name.startswith("serve-") and s.state == "free"]
    if len(free) < 2:
        sim = serving["sim"]
        name = sim.add_slice(SliceSpec("v6e", "2x4", chips_per_host=4, name=f"serve-{len(sim.slices)}"))
        serving["slices"].append(name)
    dep = _dot(
        autoscaling_config={
            "min_replicas": 1,
            "max_replicas": 2,
            "target_ongoing_requests": 1,
            "upscale_delay_s": 0,
            "downscale_delay_s": 2,
            "metrics_interval_s": 0.5,
            "look_back_period_s": 1,
        }
    )
    serve.run(dep.bind(), name="auto", route_prefix="/auto")
    assert len(_replica_slices("auto", "Dot")) == 1
    stop = time.monotonic() + 60
    seen = 1

    def load():
        while time.monotonic() < stop and seen < 2:
            _post(serving, "/auto", {"inputs": {"x": [[1] * 8]}})

    with cf.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(load) for _ in range(6)]
        while time.monotonic() < stop and seen < 2:
            seen = max(seen, len(_replica_slices("auto", "Dot")))
            time.sleep(0.5)
        for f in futures:
            f.result()
    assert seen == 2  # the second replica reserved a second whole slice
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(_replica_slices("auto", "Dot")) > 1:
        time.sleep(1)
    assert len(_replica_slices("auto", "Dot")) == 1  # scaling down released one slice
    serve.delete("auto")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _replica_slices("auto", "Dot"):
        time.sleep(0.5)
    assert _replica_slices("auto", "Dot") == set()  # deleting the app released the last one


def test_replica_core_runs_on_a_held_reservation_and_keeps_it(sim):
    """The replica's core takes a reservation the caller holds (Ray's tpu_slice=): it neither
    reserves nor releases it; every step ends as a RunOutcome value."""
    import asyncio

    from rayslice.errors import InvalidArgument, Outcome
    from rayslice.serve.replica import ReplicaCore, http_status

    cfg = slice_serve.SliceServeConfig.from_accelerator_config(
        "TPU-V4", {"kind": "tpu", "topology": "2x2x2"}, input_spec=SPEC, max_batch_size=4
    )
    spg = rayslice.slice_placement_group(cfg.request, timeout_s=60, progress=False)
    try:
        with pytest.raises(InvalidArgument, match="tpu_slice"):
            ReplicaCore(serve_models.Picky, slice_serve.SliceServeConfig("v6e", "4x4"), (), {}, tpu_slice=spg)
        core = ReplicaCore(serve_models.Picky, cfg, (), {}, tpu_slice=spg)
        try:
            assert core.slice_name == spg.slices[0].name
            good = asyncio.run(core.infer_many([core.validate({"x": [[1] * 8]})]))
            assert good[0]["y"].tolist() == [36.0] and core.last_outcome.ok and core.last_outcome.elapsed_s > 0
            bad = asyncio.run(core.infer_many([core.validate({"x": [[-1] * 8]})]))
            assert core.last_outcome.outcome is Outcome.FAILED and http_status(core.last_outcome) == 500
            assert "negative inputs" in str(bad[0]) and core.broken is None  # the model's error, not the slice's
            core.check_health()
            asyncio.run(core.check_health_async())  # pings in the gang's control group, off the event loop
            # A batch past SHARE_BYTES is put in the object store once and every host reads that one copy.
            from rayslice.serve.replica import SHARE_BYTES

            big = np.ones((SHARE_BYTES // 32 + 64, 8), np.float32)
            outcome, outs = asyncio.run(core.step({"x": big}, len(big)))
            assert outcome.ok and outs["y"].shape == (len(big),) and outs["y"].tolist() == [36.0] * len(big)
        finally:
            core.close()
        assert not spg.released  # held by the caller: still reserved after the core closed
    finally:
        spg.release()
