"""Serving benchmark: a slice deployment vs a plain Ray Serve deployment of the same model.

Same cluster, same run, same model (an MLP, 8 -> 512 -> 512 -> 1, parameters
and inputs replicated), same ``serve.batch`` settings, same HTTP proxy:

* slice - ``rayslice.serve.deployment`` on a 2-host v4 ``2x2x2`` slice: each
  request batch is broadcast to both hosts, which run the same jitted step;
* plain - ``ray.serve.deployment`` whose replica runs the model itself, on one
  simulated host (4 devices);
* forward - the floor of any design whose replica is not itself a host: a
  plain Serve replica that forwards each batch to one Ray actor holding the
  model on one simulated host (one actor call per batch, nothing else).

Latency: sequential single-row HTTP requests (p50/p99), in interleaved rounds
(median round and spread reported). Throughput: requests/s with concurrent
clients. Added p50 = slice p50 - plain p50 of the same round; the floor's
added p50 = forward p50 - plain p50, and slice - forward is what the slice
deployment adds beyond one forwarded call (its other hosts, its checks).
"""

from __future__ import annotations

import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from _options import parse_command  # benchmarks/ is on the path: the script's folder, or run.py's

GOAL_ADDED_P50_MS = 2.0
BATCH = {"max_batch_size": 16, "batch_wait_timeout_s": 0.001}


class MLP:
    """The model both deployments serve (used on every host of the slice, or in the plain replica)."""

    def __init__(self, width: int = 512) -> None:
        self.width = width

    def setup(self, ctx: Any = None) -> None:
        import jax
        import jax.numpy as jnp
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        mesh = jax.make_mesh((jax.device_count(),), ("d",))
        self.repl = NamedSharding(mesh, P())
        k = jax.random.split(jax.random.key(0), 3)
        dims = [(8, self.width), (self.width, self.width), (self.width, 1)]
        self.params = [jax.device_put(jax.random.normal(kk, d) / np.sqrt(d[0]), self.repl) for kk, d in zip(k, dims)]

        def forward(params, x):
            for w in params[:-1]:
                x = jnp.tanh(x @ w)
            return (x @ params[-1])[:, 0]

        self.f = jax.jit(forward, out_shardings=self.repl)

    def __call__(self, batch: dict) -> Any:
        import jax

        x = batch["x"]
        # Every host holds the whole batch: build the replicated global array
        # from local data (jax.device_put to a multi-host sharding would add a
        # cross-host consistency check, ~1 ms on the simulator).
        gx = jax.make_array_from_callback(x.shape, self.repl, lambda idx: x[idx])
        return self.f(self.params, gx)


def _per_request(out: np.ndarray, xs: list[np.ndarray]) -> list[list[float]]:
    """A batch's outputs split back into each request's rows."""
    res, i = [], 0
    for x in xs:
        res.append(out[i : i + len(x)].tolist())
        i += len(x)
    return res


async def _rows_of(request: Any) -> np.ndarray:
    body = await request.json()
    return np.asarray(body["inputs"]["x"], np.float32)


def _plain_deployment() -> Any:
    from ray import serve

    @serve.deployment(ray_actor_options={"num_cpus": 0, "resources": {"TPU": 4}}, max_ongoing_requests=64)
    class PlainMLP:
        def __init__(self) -> None:
            self.model = MLP()
            self.model.setup()

        @serve.batch(**BATCH)
        async def run(self, xs: list[np.ndarray]) -> list[list[float]]:
            return _per_request(np.asarray(self.model({"x": np.concatenate(xs)})), xs)

        async def __call__(self, request: Any) -> Any:
            return {"outputs": {"output": await self.run(await _rows_of(request))}}

    return PlainMLP.bind()


def _median_ms(call: Any, n: int) -> float:
    """The median wall time of ``n`` calls of ``call()``, in ms."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def _model_host() -> Any:
    """The Ray actor class holding the model on one simulated host (4 devices): the forward floor's model."""
    import ray

    @ray.remote(num_cpus=0, resources={"TPU": 4})
    class ModelHost:
        def __init__(self) -> None:
            self.model = MLP()
            self.model.setup()

        def run(self, x: np.ndarray) -> np.ndarray:
            return np.asarray(self.model({"x": x}))

        def noop(self) -> int:
            return 1

        def compute(self, n: int, x: np.ndarray) -> float:
            """The model alone on one batch, in a tight loop: median ms."""
            return _median_ms(lambda: self.run(x), n)

    return ModelHost


def _forward_deployment() -> Any:
    from ray import serve

    model_host = _model_host()

    @serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=64)
    class ForwardMLP:
        def __init__(self) -> None:
            self.host = model_host.remote()

        @serve.batch(**BATCH)
        async def run(self, xs: list[np.ndarray]) -> list[list[float]]:
            return _per_request(await self.host.run.remote(np.concatenate(xs)), xs)

        async def __call__(self, request: Any) -> Any:
            return {"outputs": {"output": await self.run(await _rows_of(request))}}

    return ForwardMLP.bind()


def _latency(url: str, n: int) -> list[float]:
    import requests

    body = {"inputs": {"x": np.ones((1, 8), np.float32).tolist()}}
    s = requests.Session()
    for _ in range(10):  # warm-up: compile, connections
        s.post(url, json=body).raise_for_status()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        r = s.post(url, json=body)
        out.append(time.perf_counter() - t0)
        r.raise_for_status()
    return out


def _throughput(url: str, seconds: float, clients: int) -> float:
    import requests

    body = {"inputs": {"x": np.ones((1, 8), np.float32).tolist()}}
    stop = time.perf_counter() + seconds

    def client() -> int:
        s, done = requests.Session(), 0
        while time.perf_counter() < stop:
            s.post(url, json=body).raise_for_status()
            done += 1
        return done

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        total = sum(pool.map(lambda _: client(), range(clients)))
    return total / (time.perf_counter() - t0)


def run(requests_n: int = 200, seconds: float = 5.0, clients: int = 8, rounds: int = 5) -> dict[str, Any]:
    """Needs a connected simulated cluster with a free v4 2x2x2 slice and two more free v4 hosts.

    Latency is measured in ``rounds`` interleaved rounds (plain, slice,
    forward, plain, slice, forward ...) of ``requests_n`` sequential requests
    each, after a warm-up round; a round's added p50 is its slice p50 minus its
    plain p50 (and the floor's, forward minus plain), and the result reports
    the median round and the spread (min-max) over rounds.
    """
    from ray import cloudpickle, serve

    from rayslice import serve as slice_serve

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # hosts cannot import benchmarks/
    port = slice_serve.start_http()
    try:
        sliced = slice_serve.deployment(
            accelerator_type="TPU-V4",
            accelerator_config={"type": "tpu", "topology": "2x2x2"},
            input_spec={"x": ((8,), "float32")},
            **BATCH,
        )(MLP)
        slice_handle = serve.run(sliced.bind(), name="slice", route_prefix="/slice")
        host0_here = slice_handle.host0_here.remote().result(timeout_s=30)
        serve.run(_plain_deployment(), name="plain", route_prefix="/plain")
        serve.run(_forward_deployment(), name="forward", route_prefix="/forward")
        urls = {name: f"http://127.0.0.1:{port}/{name}" for name in ("plain", "slice", "forward")}
        for url in urls.values():  # warm-up round, not kept
            _latency(url, requests_n // 4)
        p50s: dict[str, list[float]] = {name: [] for name in urls}
        p99s: dict[str, list[float]] = {name: [] for name in urls}
        for _ in range(rounds):
            for name, url in urls.items():
                lat = sorted(_latency(url, requests_n))
                p50s[name].append(1000 * statistics.median(lat))
                p99s[name].append(1000 * lat[int(0.99 * (len(lat) - 1))])
        res: dict[str, Any] = {
            name: {
                "p50_ms": statistics.median(p50s[name]),
                "p99_ms": statistics.median(p99s[name]),
                "p50_rounds_ms": p50s[name],
                "rps": _throughput(url, seconds, clients),
            }
            for name, url in urls.items()
        }
    finally:
        serve.shutdown()
    for name, a, b in (
        ("added", "slice", "plain"),
        ("forward_added", "forward", "plain"),
        ("beyond_forward", "slice", "forward"),
    ):
        diff = [x - y for x, y in zip(p50s[a], p50s[b])]  # per round: the same moment of the machine
        res[f"{name}_p50_ms"] = statistics.median(diff)
        res[f"{name}_p50_spread_ms"] = (min(diff), max(diff))
        res[f"{name}_p50_rounds_ms"] = diff
    res["rounds"] = rounds
    res["slice"]["host0_here"] = host0_here  # the replica is host 0 of its slice (no hop to host 0)
    return res


def _noop(*_: Any) -> int:
    return 1


def _host_compute(calls: int, x: dict[str, np.ndarray]) -> float:
    """Runs on each slice host: the median time (ms) of the model on one batch, called in a tight loop."""
    from rayslice.serve import host

    return _median_ms(lambda: np.asarray(host._gather(host._MODEL(x))), calls)


def parts(calls: int = 200, rounds: int = 5) -> dict[str, Any]:
    """Where a slice request's added latency goes, without Serve or HTTP (driver-side Ray calls).

    Needs a connected simulated cluster with a free v4 2x2x2 slice and one
    more free v4 host. In ``rounds`` interleaved rounds of ``calls`` calls
    each (median per round; the result is the median round and [min, max]):

    * ``noop_actor`` - a no-op call to a plain actor (the hop alone);
    * ``noop_slice`` - a no-op packed call to both slice hosts, until host 0 answers;
    * ``model_actor`` - the model in one plain actor on one host (4 devices): the forward floor's call;
    * ``model_slice`` - ``rayslice.serve.host.infer`` on both hosts, until host 0 answers: the slice's step;
    * ``model_host0`` - the same call sent to host 0 only (host 1 idle; valid
      for this model only: no collective, so host 0 needs no peer);
    * ``compute_*_ms`` - the model alone in a tight loop on a host (both slice hosts
      at once; the plain actor alone).

    ``model_slice - model_host0`` is what host 1 running its copy of the step
    at the same time costs host 0 here (two simulated hosts share the
    machine's cores; a real host has its own); ``model_host0 - model_actor``
    is what rayslice's path to host 0 costs over a plain actor call.
    """
    import ray
    from ray import cloudpickle

    from rayslice.gang import CONTROL_GROUP, SliceGang
    from rayslice.placement import slice_placement_group
    from rayslice.serve import host

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # hosts cannot import benchmarks/
    x = {"x": np.ones((1, 8), np.float32)}

    with slice_placement_group("2x2x2", "TPU-V4", progress=False) as spg:
        gang = SliceGang(spg, actor_options={"max_concurrency": 2, "concurrency_groups": {CONTROL_GROUP: 1}}).start()
        actor = _model_host().remote()
        try:
            gang.run(host.setup_model, MLP, (), {}, "parts", timeout_s=120)
            ray.get(actor.noop.remote(), timeout=120)
            cases = {
                "noop_actor": lambda: ray.get(actor.noop.remote()),
                "noop_slice": lambda: ray.get(gang.run_async_packed(_noop, x, 1)[0]),
                "model_actor": lambda: ray.get(actor.run.remote(x["x"])),
                "model_slice": lambda: ray.get(gang.run_async_packed(host.infer, x, 1)[0]),
                "model_host0": lambda: ray.get(gang.run_async_on([0], host.infer, x, 1)[0]),
            }
            for call in cases.values():  # warm-up: compile, connections
                for _ in range(20):
                    call()
            per_round: dict[str, list[float]] = {k: [] for k in (*cases, "compute_slice_ms", "compute_actor_ms")}
            for _ in range(rounds):
                for name, call in cases.items():
                    per_round[name].append(_median_ms(call, calls))
                    ray.get(gang.run_async(_noop))  # host 1's calls done before the next case
                per_round["compute_slice_ms"].append(max(gang.run(_host_compute, calls, x, timeout_s=120)))
                per_round["compute_actor_ms"].append(ray.get(actor.compute.remote(calls, x["x"])))
        finally:
            ray.kill(actor)
            gang.shutdown()

    def spread(values: list[float]) -> dict[str, Any]:
        return {"median_ms": statistics.median(values), "spread_ms": (min(values), max(values))}

    out: dict[str, Any] = {k: spread(v) for k, v in per_round.items()}
    for name, a, b in (
        ("host1_costs_host0", "model_slice", "model_host0"),
        ("path_to_host0", "model_host0", "model_actor"),
        ("slice_vs_actor", "model_slice", "model_actor"),
    ):
        out[name] = spread([p - q for p, q in zip(per_round[a], per_round[b])])
    out.update(calls=calls, rounds=rounds)
    return out


_USAGE = "bench_serve.py {parts [calls=N] [rounds=N] | run [requests_n=N] [seconds=S] [clients=N] [rounds=N]}"


def main(argv: list[str]) -> int:
    """``parts`` or ``run`` with ``key=value`` options, on a cluster of its own; one JSON line; 2 on bad words."""
    import json

    try:
        target, kwargs = parse_command(argv, {"parts": parts, "run": run}, _USAGE)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    from rayslice.sim import SimulatedCluster, SliceSpec

    with SimulatedCluster([SliceSpec("TPU-V4", "2x2x2", name="bench-a"), SliceSpec("TPU-V4", "2x2x2")]):
        print(json.dumps(target(**kwargs)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
