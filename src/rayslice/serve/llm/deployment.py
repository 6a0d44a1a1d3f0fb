"""A Ray Serve application whose replica owns one whole slice and serves the LLM over the OpenAI API.

Each replica reserves one slice (rayslice's reservation: one bundle per host,
never straddling two slices), starts one gang process per host with
``jax.distributed`` up, and builds the model on every host over *all* devices
of the slice (tensor-parallel weights and KV cache). The replica runs the
continuous-batching scheduler. With the default ``"data_tensor"`` layout the
hosts split the slots and no program spans two hosts: an engine iteration
goes to the hosts holding its slots, each runs it on its own devices (with no
gloo on the simulator: ``SliceGang(cpu_collectives=False)``) and returns the
sampled tokens of its slots. With ``"tensor"`` every iteration is one SPMD
step that all hosts run. The replica answers HTTP (non-streaming JSON or
server-sent events).

When a host is lost, the running step fails (the other hosts' results are
watched, so a dead host is noticed even while another waits in a collective),
every in-flight request gets 503 (an SSE error event when already streaming),
new requests get 503 at once, and ``check_health`` fails, so Serve replaces
the replica, which reserves another slice.

``build_app(config, local=True)`` serves the same model in a plain Serve
deployment on the replica's own process (no slice; the benchmark's baseline).

Example:
    >>> cfg = LLMConfig(accelerator_type="TPU-V4", topology="2x2x2")
    >>> cfg.engine.num_slots, cfg.lm.num_heads
    (16, 8)
    >>> app = build_app(cfg)  # doctest: +SKIP
    >>> serve.run(app, name="llm", route_prefix="/")  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from typing import Any

import numpy as np

from rayslice._validate import check_choice, check_float, check_int, check_optional, check_str, fail
from rayslice.errors import describe
from rayslice.serve.llm import _host
from rayslice.serve.llm.engine import Engine, EngineConfig, EngineError
from rayslice.serve.llm.model import LAYOUTS, LMConfig, mesh_shape, resolve_layout
from rayslice.serve.llm.runner import Step, StepResult, merge_results
from rayslice.serve.llm.tokenizer import ByteTokenizer
from rayslice.topology import Topology


@dataclasses.dataclass(frozen=True)
class LLMConfig:
    """What an LLM deployment serves and where. Validated on construction.

    Args:
        model_name: The ``model`` clients send (and ``/v1/models`` lists).
        lm: The transformer's shape (must match the checkpoint).
        engine: Slots, context, compiled shapes and limits.
        checkpoint: A ``JaxTrainer`` run, checkpoints or step directory (the
            newest complete step is used); None: random weights from ``seed``
            (a smoke test).
        seed: Random-initialisation seed.
        accelerator_type: Generation of the slice, e.g. "TPU-V4".
        topology: Slice shape, e.g. "2x2x2".
        chips_per_host: Host layout for v5e/v6e "2x4".
        reservation_timeout_s: Longest wait for a slice when a replica starts.
        init_timeout_s: Deadline for the host processes, weights and compilation.
        step_timeout_s: Deadline of one engine step across the slice (a host
            that stops answering fails the step: 503 and a replacement).
        max_body_bytes: Larger request bodies get 413.
        layout: How the model lies on the slice's devices: ``"tensor"``
            (tensor-parallel over every device of every host: the least memory
            per device, one cross-host all-reduce per layer half on every
            step), ``"data_tensor"`` (tensor-parallel inside each host, the
            hosts splitting the batch slots: no collective between hosts) or
            ``"auto"`` (``"data_tensor"``, the lowest latency). See docs/llm.md.
        tensor_parallel: Devices per tensor-parallel group (the mesh's model
            axis); None: the largest the layout allows. Smaller groups mean
            cheaper all-reduces and more slot groups, larger ones less memory
            per device.
    """

    model_name: str = "rayslice-tiny-lm"
    lm: LMConfig = dataclasses.field(default_factory=LMConfig)
    engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)
    checkpoint: str | None = None
    seed: int = 0
    accelerator_type: str = "TPU-V4"
    topology: str = "2x2x2"
    chips_per_host: int | None = None
    reservation_timeout_s: float = 60.0
    init_timeout_s: float = 180.0
    step_timeout_s: float = 30.0
    max_body_bytes: int = 1 << 20
    layout: str = "auto"
    tensor_parallel: int | None = None

    def __post_init__(self) -> None:
        check_str("model_name", self.model_name)
        if not isinstance(self.lm, LMConfig):
            raise TypeError(f"lm={self.lm!r} is not valid: expected an LMConfig")
        if not isinstance(self.engine, EngineConfig):
            raise TypeError(f"engine={self.engine!r} is not valid: expected an EngineConfig")
        if self.engine.max_context > self.lm.max_len:
            raise ValueError(f"engine.max_context={self.engine.max_context} exceeds lm.max_len={self.lm.max_len}")
        if self.lm.vocab_size < ByteTokenizer.vocab_size:
            raise ValueError(
                f"lm.vocab_size={self.lm.vocab_size} is below the tokenizer's {ByteTokenizer.vocab_size} ids"
            )
        check_optional(check_str, "checkpoint", self.checkpoint)
        check_int("seed", self.seed, minimum=0)
        for name in ("reservation_timeout_s", "init_timeout_s", "step_timeout_s"):
            check_float(name, getattr(self, name), minimum=0, exclusive_min=True)
        check_int("max_body_bytes", self.max_body_bytes, minimum=1)
        check_choice("layout", self.layout, LAYOUTS)
        check_optional(check_int, "tensor_parallel", self.tensor_parallel, minimum=1)
        topo = self.topology_info  # validates the shape
        # The mesh every host will build (model.make_mesh over the slice's devices), known now: a combination the
        # slice cannot take fails here, not in each replica after a slice was reserved and its processes started.
        layout = resolve_layout(self.layout, topo.num_hosts)
        data, _ = mesh_shape(
            topo.num_devices,
            self.lm,
            layout=layout,
            devices_per_host=topo.devices_per_host,
            tensor_parallel=self.tensor_parallel,
        )
        if self.engine.num_slots % data:
            raise fail(
                "engine.num_slots",
                self.engine.num_slots,
                f"a multiple of {data}, the slot groups of the {layout!r} layout on {topo.num_devices} devices "
                f"of {self.accelerator_type} {topo.name} (tensor_parallel={self.tensor_parallel})",
            )

    @property
    def topology_info(self) -> Topology:
        return Topology.parse(self.topology, self.accelerator_type, chips_per_host=self.chips_per_host)

    def engine_kwargs(self) -> dict[str, Any]:
        e = self.engine
        return {
            "num_slots": e.num_slots,
            "max_context": e.max_context,
            "prefill_buckets": e.prefill_buckets,
            "vocab_limit": ByteTokenizer.vocab_size,
            "layout": self.layout,
            "tensor_parallel": self.tensor_parallel,
        }


class SliceExecutor:
    """Runs each engine step on the hosts of one reserved slice that hold its slots (every host with ``"tensor"``).

    Each host answers for the slots it holds; the replica merges the answers.
    """

    def __init__(self, cfg: LLMConfig) -> None:
        from rayslice.gang import SliceGang
        from rayslice.placement import slice_placement_group

        self.cfg = cfg
        self.gang: Any = None
        self.spg: Any = slice_placement_group(
            cfg.topology,
            cfg.accelerator_type,
            chips_per_host=cfg.chips_per_host,
            timeout_s=cfg.reservation_timeout_s,
            name=f"llm-{cfg.model_name}-{uuid.uuid4().hex[:6]}",
            progress=False,
        )
        try:
            self.slice_name = self.spg.slices[0].name
            hosts = len(self.spg.slices[0].hosts)
            self.gang = SliceGang(
                self.spg,
                init_timeout_s=cfg.init_timeout_s,
                name=f"llm-{cfg.model_name}",
                actor_options={"max_concurrency": 2},
                # "data_tensor": every program runs on one host's devices, so the simulator's CPU devices need
                # no gloo (its collectives between two devices of one process would go over TCP).
                cpu_collectives=resolve_layout(cfg.layout, hosts) != "data_tensor",
            ).start()
            self.host_info = self.gang.run(
                _host.host_setup, cfg.lm, cfg.engine_kwargs(), cfg.checkpoint, cfg.seed, timeout_s=cfg.init_timeout_s
            )
        except BaseException:
            self.close()
            raise
        self._compiles = sum(i["compiles"] for i in self.host_info)
        self.slot_groups = int(self.host_info[0]["mesh"]["data"])
        self.layout = str(self.host_info[0]["layout"])
        # With no collective between hosts, a host runs only the programs of its own slots (_host.host_step),
        # and its state changes only by them: a step goes to the hosts that hold its work, the others stay idle.
        # (A host lost while idle is found by the replica's health check, or by the next step it is sent.)
        self._skip = all(i["skips_others"] for i in self.host_info)
        self._groups_of_rank = [frozenset(i["local_groups"]) for i in self.host_info]
        self._per_group = cfg.engine.num_slots // self.slot_groups

    def ranks_with_work(self, step: Step) -> list[int]:
        """The hosts a step is sent to (every host unless hosts skip the others' slots)."""
        ranks = list(range(len(self._groups_of_rank)))
        if not self._skip:
            return ranks
        groups = {p.slot // self._per_group for p in step.prefills}
        if step.decode is not None:
            groups |= {int(s) // self._per_group for s in np.flatnonzero(step.decode.active)}
        return [r for r in ranks if self._groups_of_rank[r] & groups] or ranks

    async def run(self, step: Step) -> StepResult:
        if self.gang is None:
            raise EngineError("the slice was released")
        loop = asyncio.get_running_loop()
        started = loop.time()
        ranks = self.ranks_with_work(step)
        refs = self.gang.run_async_on(ranks, _host.host_step, step)
        futures = [asyncio.ensure_future(_await(r)) for r in refs]
        pending = set(futures)
        while pending:
            remaining = started + self.cfg.step_timeout_s - loop.time()
            if remaining <= 0:
                break
            done, pending = await asyncio.wait(pending, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            for f in done:
                if f.exception() is not None:  # the slice is broken
                    for p in pending:
                        p.cancel()
                    rank = ranks[futures.index(f)]
                    raise EngineError(f"slice {self.slice_name}: host rank {rank} failed: {describe(f.exception())}")
        if pending:
            for f in futures:
                f.cancel()
            raise EngineError(
                f"slice {self.slice_name}: {len(pending)} host(s) did not finish a step within "
                f"{self.cfg.step_timeout_s:g} s"
            )
        return merge_results([f.result() for f in futures])

    def compiles(self) -> int:
        """Compilations on every host of the slice (fetched from the hosts)."""
        if self.gang is None:
            return self._compiles
        try:
            return sum(s["compiles"] for s in self.gang.run(_host.host_stats, timeout_s=10))
        except Exception:
            return -1

    def check_health(self) -> None:
        lost = self.gang.lost_hosts(timeout_s=5.0) if self.gang is not None else [0]
        if lost:
            raise RuntimeError(f"host process(es) of rank {lost} on slice {self.slice_name} are gone")

    def close(self) -> None:
        if self.gang is not None:
            self.gang.shutdown()
            self.gang = None
        if self.spg is not None:
            self.spg.release()
            self.spg = None


def _this_node() -> str | None:
    try:
        import ray

        return str(ray.get_runtime_context().get_node_id())
    except Exception:  # not in a Ray worker (a local test)
        return None


async def _await(ref: Any) -> Any:
    return await ref


class LLMServer:
    """The replica: an engine over a slice (or this process's devices) behind the OpenAI routes."""

    def __init__(self, cfg: LLMConfig, local: bool = False) -> None:
        from rayslice.serve.llm.server import OpenAIServer

        self.cfg = cfg
        self.local = local
        self.executor: Any
        if local:
            from rayslice.serve.llm.engine import local_engine
            from rayslice.serve.llm.weights import load_params

            params = None if cfg.checkpoint is None else load_params(cfg.checkpoint)
            self.engine = local_engine(
                cfg.lm, cfg.engine, params, seed=cfg.seed, layout=cfg.layout, tensor_parallel=cfg.tensor_parallel
            )
            self.executor = self.engine.executor
            runner = self.executor.runner
            extra = {
                "slice": None,
                "hosts": 1,
                "mesh": dict(runner.mesh.shape),
                "devices": int(runner.mesh.devices.size),
                "layout": runner.layout,
            }
        else:
            self.executor = SliceExecutor(cfg)
            self.engine = Engine(self.executor, cfg.engine, ByteTokenizer())
            extra = {
                "slice": self.executor.slice_name,
                "hosts": len(self.executor.host_info),
                "mesh": self.executor.host_info[0]["mesh"],
                "devices": self.executor.host_info[0]["device_count"],
                "layout": self.executor.layout,
                "cross_host_collectives": self.executor.host_info[0]["cross_host_collectives"],
            }
        extra["replica_node_id"] = _this_node()  # where the replica's own process runs
        self.server = OpenAIServer(
            self.engine, cfg.model_name, max_body_bytes=cfg.max_body_bytes, extra_stats=lambda: extra
        )

    async def __call__(self, request: Any) -> Any:
        return await self.server.handle(request)

    def check_health(self) -> None:
        if self.engine.broken is not None:
            raise RuntimeError(str(self.engine.broken))
        if isinstance(self.executor, SliceExecutor):
            self.executor.check_health()

    def __del__(self) -> None:
        ex = getattr(self, "executor", None)
        if isinstance(ex, SliceExecutor):
            ex.close()


def llm_deployment(cfg: LLMConfig, *, local: bool = False, **serve_options: Any) -> Any:
    """The ``ray.serve.Deployment`` (unbound) serving ``cfg``; ``serve_options`` go to ``serve.deployment``."""
    from ray import serve

    if not isinstance(cfg, LLMConfig):
        raise TypeError(f"cfg={cfg!r} is not valid: expected an LLMConfig")
    options = {
        "ray_actor_options": {"num_cpus": 0},
        "max_constructor_retry_count": 3,
        "health_check_period_s": 2.0,
        "health_check_timeout_s": 10.0,
        "max_ongoing_requests": 4 * cfg.engine.num_slots + 16,
        "name": "LLMLocal" if local else "LLMServer",
        **serve_options,
    }
    return serve.deployment(LLMServer, **options)


def build_app(cfg: LLMConfig, *, local: bool = False, **serve_options: Any) -> Any:
    """The Serve application: ``serve.run(build_app(cfg), route_prefix="/")`` then point an OpenAI client at it.

    Args:
        cfg: Model, engine and slice.
        local: Serve in the replica's own process (no slice reserved).
        **serve_options: ``num_replicas``, ``health_check_period_s``, ... for ``serve.deployment``.
    """
    return llm_deployment(cfg, local=local, **serve_options).bind(cfg, local)


def app(args: dict[str, Any]) -> Any:
    """``import_path`` target for Serve config files: ``rayslice.serve.llm.deployment:app``.

    ``args`` are :class:`LLMConfig` fields; ``lm`` and ``engine`` are dicts of their fields.
    """
    args = dict(args)
    lm = LMConfig(**args.pop("lm", {}))
    eng = args.pop("engine", {})
    if "prefill_buckets" in eng:
        eng = {**eng, "prefill_buckets": tuple(eng["prefill_buckets"])}
    local = bool(args.pop("local", False))
    return build_app(LLMConfig(lm=lm, engine=EngineConfig(**eng), **args), local=local)
