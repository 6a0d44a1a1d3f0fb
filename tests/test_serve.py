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
    return slice_serve.deployment(accelerator_type="TPU-V6E", accelerator_config=V6E, input_spec=SPEC,
                                  **opts)(Dot)


def test_http_answer_is_computed_across_both_hosts(serving):
    from ray import serve

    handle = serve.run(_dot().bind(2.0), name="dot", route_prefix="/dot")
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


@pytest.mark.parametrize("body, status, message", [
    (b"{not json", 400, "malformed JSON"),
    (b"[1, 2]", 400, "JSON object with \\\"inputs\\\""),
    (b'{"inputs": {"x": [[1, 2]]}}', 422, "must have shape (rows, 8)"),
    (b'{"inputs": {"x": [["a", "b", "c", "d", "e", "f", "g", "h"]]}}', 422, "must be numeric"),
    (b'{"inputs": {"x": [[1,2,3,4,5,6,7,8], [1,2]]}}', 422, "rectangular"),
    (b'{"inputs": {"y": [[1,2,3,4,5,6,7,8]]}}', 422, "missing ['x'], unexpected ['y']"),
    (b'{"inputs": {"x": []}}', 422, "shape"),
])
def test_bad_requests_are_4xx_and_the_replica_stays_healthy(serving, body, status, message):
    from ray import serve

    if "dot-fuzz" not in serve.status().applications:
        serve.run(_dot(max_body_bytes=4096, num_replicas=2).bind(), name="dot-fuzz", route_prefix="/fuzz")
    r = _post(serving, "/fuzz", data=body)
    assert r.status_code == status, r.text
    assert message in r.text
    ok = _post(serving, "/fuzz", {"inputs": {"x": [[1] * 8]}})
    assert ok.status_code == 200 and ok.json()["outputs"]["y"] == [36.0]


def test_oversized_body_and_random_fuzz_keep_two_replicas_on_two_slices(serving):
    from ray import serve

    if "dot-fuzz" not in serve.status().applications:
        serve.run(_dot(max_body_bytes=4096, num_replicas=2).bind(), name="dot-fuzz", route_prefix="/fuzz")
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

    dep = slice_serve.deployment(accelerator_type="TPU-V6E", accelerator_config={"type": "tpu", "topology": "8x8"},
                                 input_spec=SPEC, reservation_timeout_s=5, max_constructor_retry_count=1)(Dot)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError):
        serve.run(dep.bind(), name="too-big", route_prefix="/too-big")
    assert time.monotonic() - t0 < 60
    message = serve.status().applications["too-big"].deployments["Dot"].message
    assert "no 1 slice(s) of v6e 8x8" in message and "serve-0: other shape" in message
    serve.delete("too-big")


def test_preempted_host_replica_is_replaced_on_another_slice(serving):
    from ray import serve

    sim = serving["sim"]
    serve.run(_dot().bind(), name="chaos", route_prefix="/chaos")
    before = _replica_slices("chaos", "Dot")
    assert len(before) == 1
    victim = before.pop()
    sim.preempt_host(victim, 1)
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
    config.write_text(textwrap.dedent(f"""
        proxy_location: HeadOnly
        http_options: {{host: 127.0.0.1, port: {serving['port']}}}
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
    """))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    serve_cli = os.path.join(os.path.dirname(sys.executable), "serve")
    out = subprocess.run([serve_cli, "run", str(config), "--address", serving["sim"].address, "--non-blocking"],
                         capture_output=True, text=True, timeout=240, cwd=root,
                         env={**os.environ, "PYTHONPATH": root})
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

    dep = slice_serve.deployment(accelerator_type="TPU-V6E", accelerator_config=V6E, input_spec=SPEC,
                                 max_batch_size=4)(serve_models.Picky)
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
    dep = _dot(autoscaling_config={"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1,
                                   "upscale_delay_s": 0, "downscale_delay_s": 2, "metrics_interval_s": 0.5,
                                   "look_back_period_s": 1})
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
