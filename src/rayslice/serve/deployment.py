"""Ray Serve deployments whose replicas each own one whole slice.

``@rayslice.serve.deployment(accelerator_type=..., accelerator_config={"type": "tpu",
"topology": ...})`` turns a model class into an ordinary Ray Serve deployment.
Each replica holds no accelerator itself: at start-up it reserves one whole
slice (rayslice's reservation, so bundles never scatter over two slices),
starts one gang process per host with ``jax.distributed`` up, and creates the
model on every host (``setup(ctx)`` runs there). Requests are batched
(``serve.batch``) into one SPMD step that every host runs; host 0 answers.

If no slice can be reserved before ``reservation_timeout_s``, the constructor
raises the reservation's explanation and Serve marks the deployment failed,
instead of leaving it DEPLOYING. ``check_health`` fails when any host process
is gone, so Serve replaces the replica, which reserves another slice.

Example:
    >>> from ray import serve
    >>> from rayslice import serve as slice_serve
    >>> @slice_serve.deployment(accelerator_type="TPU-V4",
    ...                         accelerator_config={"type": "tpu", "topology": "2x2x2"},
    ...                         input_spec={"x": ((8,), "float32")})
    ... class Model:
    ...     def setup(self, ctx): ...
    ...     def __call__(self, batch): return batch["x"].sum(axis=1)
    >>> serve.run(Model.bind())  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import Mapping
from typing import Any

import numpy as np

from rayslice.errors import GangError, Outcome, classify, describe
from rayslice.serve.schema import InputSpec, RequestError, parse_body, rows_of, validate_untyped
from rayslice.topology import Topology

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SliceServeConfig:
    """How a slice deployment reserves, batches and validates. Validated on construction."""

    accelerator_type: str
    topology: str
    chips_per_host: int | None = None
    input_spec: InputSpec | None = None
    reservation_timeout_s: float = 60.0
    init_timeout_s: float = 120.0
    request_timeout_s: float = 30.0
    max_batch_size: int = 32
    batch_wait_timeout_s: float = 0.002
    max_body_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        self.topology_info  # noqa: B018 - validates the shape
        for name in ("reservation_timeout_s", "init_timeout_s", "request_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0")
        if self.max_batch_size < 1 or self.max_body_bytes < 1 or self.batch_wait_timeout_s < 0:
            raise ValueError("max_batch_size and max_body_bytes must be >= 1, batch_wait_timeout_s >= 0")

    @property
    def topology_info(self) -> Topology:
        return Topology.parse(self.accelerator_type, self.topology, chips_per_host=self.chips_per_host)

    @classmethod
    def from_accelerator_config(cls, accelerator_type: str, accelerator_config: Mapping[str, Any],
                                **kwargs: Any) -> SliceServeConfig:
        """From Serve-style ``accelerator_config={"type": "tpu", "topology": "2x2x2"}``."""
        cfg = dict(accelerator_config or {})
        kind = str(cfg.pop("type", "tpu")).lower()
        if kind != "tpu":
            raise ValueError(f"accelerator_config type {kind!r} is not supported; valid: tpu")
        if "topology" not in cfg:
            raise ValueError("accelerator_config needs a 'topology', e.g. {'type': 'tpu', 'topology': '2x2x2'}")
        topology = cfg.pop("topology")
        chips = cfg.pop("chips_per_host", None)
        if cfg:
            raise ValueError(f"unknown accelerator_config keys {sorted(cfg)}; valid: type, topology, chips_per_host")
        spec = kwargs.pop("input_spec", None)
        if spec is not None and not isinstance(spec, InputSpec):
            spec = InputSpec.parse(spec, max_rows=kwargs.get("max_batch_size", 32))
        return cls(accelerator_type, topology, chips_per_host=chips, input_spec=spec, **kwargs)


def _bucket(n: int, cap: int) -> int:
    """Pads batches to powers of two (up to ``cap``) so jit compiles a few shapes, not one per size."""
    size = 1
    while size < n:
        size *= 2
    return min(size, max(cap, n))


class _ReplicaCore:
    """The slice behind one replica: reservation, gang, model on every host."""

    def __init__(self, user_cls: type, cfg: SliceServeConfig, args: tuple, kwargs: dict) -> None:
        from rayslice.gang import SliceGang
        from rayslice.placement import slice_placement_group
        from rayslice.serve import host

        self.cfg = cfg
        self.spg = None
        self.gang = None
        self.broken: GangError | None = None
        # Raises ReservationTimeout / NoMatchingSlice with the per-slice report:
        # Serve shows it as the reason the deployment failed.
        self.spg = slice_placement_group(cfg.topology, cfg.accelerator_type, chips_per_host=cfg.chips_per_host,
                                         timeout_s=cfg.reservation_timeout_s,
                                         name=f"serve-{user_cls.__name__}-{uuid.uuid4().hex[:6]}", progress=False)
        try:
            self.gang = SliceGang(self.spg, init_timeout_s=cfg.init_timeout_s, name=user_cls.__name__,
                                  actor_options={"max_concurrency": 2}).start()
            self.gang.run(host.setup_model, user_cls, args, kwargs, user_cls.__name__, timeout_s=cfg.init_timeout_s)
        except BaseException:
            self.close()
            raise
        self.slice_name = self.spg.slices[0].name

    def validate(self, inputs: Any) -> dict[str, np.ndarray]:
        out = self._validate(inputs)
        if rows_of(out) > self.cfg.max_batch_size:  # whatever the spec's own limit: Serve's batcher would fail
            raise RequestError(f"{rows_of(out)} rows in one request; the limit is {self.cfg.max_batch_size}",
                               status=413)
        return out

    def _validate(self, inputs: Any) -> dict[str, np.ndarray]:
        if self.cfg.input_spec is not None:
            return self.cfg.input_spec.validate(inputs)
        return validate_untyped(inputs)

    async def infer_many(self, items: list[dict[str, np.ndarray]]) -> list[Any]:
        """One SPMD step for a batch of requests; returns each request's outputs (or the error)."""
        from rayslice.serve import host

        if self.broken is not None:  # a host already failed: answer at once, Serve is replacing us
            return [self.broken] * len(items)
        try:
            merged = {k: np.concatenate([it[k] for it in items]) for k in items[0]}
        except ValueError as e:  # requests whose columns differ (only without an input_spec)
            return [RequestError(f"requests in one batch do not match: {e}")] * len(items)
        rows = rows_of(merged)
        size = _bucket(rows, self.cfg.max_batch_size)
        if size > rows:
            merged = {k: np.concatenate([v, np.zeros((size - rows, *v.shape[1:]), v.dtype)]) for k, v in merged.items()}
        refs = self.gang.run_async(host.infer, merged, rows)
        # Host 0 answers; the other hosts' completions are checked in the
        # background (a failure there marks the replica unhealthy), so a
        # request does not also wait for the slowest host to report back.
        for ref in refs[1:]:
            asyncio.ensure_future(self._watch(ref))
        try:
            outs = await asyncio.wait_for(refs[0], timeout=self.cfg.request_timeout_s)
        except Exception as e:  # the model raised, a host was lost, or the deadline: an error, never a hang
            outcome = classify(e)
            what = "the model raised" if outcome is Outcome.FAILED else f"slice {self.slice_name} failed this request"
            err = GangError(f"{what}: {describe(e)}", outcome=outcome)
            return [err] * len(items)
        start = 0
        answers = []
        for it in items:
            n = rows_of(it)
            answers.append({k: v[start:start + n] for k, v in outs.items()})
            start += n
        return answers

    async def _watch(self, ref: Any) -> None:
        try:
            await asyncio.wait_for(ref, timeout=self.cfg.request_timeout_s)
        except Exception as e:
            outcome = classify(e)
            if outcome is not Outcome.FAILED:  # an error in the model is the request's, not the slice's
                self.broken = GangError(f"slice {self.slice_name}: a host failed: {describe(e)}", outcome=outcome)

    def check_health(self) -> None:
        if self.broken is not None:
            raise RuntimeError(str(self.broken))
        lost = self.gang.lost_hosts(timeout_s=5.0) if self.gang else [0]
        if lost:
            raise RuntimeError(f"host process(es) of rank {lost} on slice {getattr(self, 'slice_name', '?')} are gone")

    def close(self) -> None:
        if self.gang is not None:
            self.gang.shutdown()
            self.gang = None
        if self.spg is not None:
            self.spg.release()
            self.spg = None


def make_replica_class(user_cls: type, cfg: SliceServeConfig) -> type:
    """The class Ray Serve runs as a replica, wrapping ``user_cls`` (which runs on the hosts)."""
    from ray import serve
    from starlette.requests import Request
    from starlette.responses import JSONResponse

    class SliceReplica:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self._core = _ReplicaCore(user_cls, cfg, args, kwargs)

        # Batches are counted in rows, not requests: one SPMD step holds at most max_batch_size rows.
        @serve.batch(max_batch_size=cfg.max_batch_size, batch_wait_timeout_s=cfg.batch_wait_timeout_s,
                     batch_size_fn=lambda items: sum(rows_of(it) for it in items))
        async def _batched(self, items: list[dict[str, np.ndarray]]) -> list[Any]:
            return await self._core.infer_many(items)

        async def _infer(self, inputs: Any) -> dict[str, np.ndarray]:
            out = await self._batched(self._core.validate(inputs))
            if isinstance(out, BaseException):
                raise out
            return out

        async def __call__(self, request: Any) -> Any:
            if not isinstance(request, Request):
                return await self._infer(request)  # a DeploymentHandle call: numpy in, numpy out
            try:
                declared = int(request.headers.get("content-length") or 0)
                if declared > cfg.max_body_bytes:
                    raise RequestError(f"request body of {declared} bytes exceeds the limit of {cfg.max_body_bytes}",
                                       status=413)
                outputs = await self._infer(parse_body(await request.body(), cfg.max_body_bytes))
            except RequestError as e:
                return JSONResponse({"error": str(e)}, status_code=e.status)
            except GangError as e:
                return JSONResponse({"error": str(e)}, status_code=500 if e.outcome is Outcome.FAILED else 503)
            return JSONResponse({"outputs": {k: v.tolist() for k, v in outputs.items()}})

        def check_health(self) -> None:
            self._core.check_health()

        def slice_name(self) -> str:
            return self._core.slice_name

        def __del__(self) -> None:
            core = getattr(self, "_core", None)
            if core is not None:
                core.close()

    SliceReplica.__name__ = user_cls.__name__
    SliceReplica.__qualname__ = user_cls.__qualname__
    SliceReplica.__doc__ = user_cls.__doc__
    return SliceReplica


def start_http(port: int | None = None, host: str = "127.0.0.1") -> int:
    """Starts Ray Serve with its HTTP proxy on the head node only, at an explicit port.

    Args:
        port: The port; when None, one the OS reports free is used (a short
            race with other programs, acceptable for tests and demos).
        host: Interface to listen on.

    Returns:
        The port the proxy listens on.
    """
    import socket

    from ray import serve

    if port is None:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
    serve.start(proxy_location="HeadOnly", http_options={"host": host, "port": port})
    return port


def deployment(_cls: type | None = None, *, accelerator_type: str, accelerator_config: Mapping[str, Any],
               input_spec: Mapping[str, Any] | InputSpec | None = None, reservation_timeout_s: float = 60.0,
               init_timeout_s: float = 120.0, request_timeout_s: float = 30.0, max_batch_size: int = 32,
               batch_wait_timeout_s: float = 0.002, max_body_bytes: int = 1 << 20, **serve_options: Any) -> Any:
    """Makes a model class a Ray Serve deployment whose replicas each own one whole slice.

    Args:
        accelerator_type: Generation, e.g. "TPU-V4".
        accelerator_config: ``{"type": "tpu", "topology": "2x2x2"[, "chips_per_host": 4]}``.
        input_spec: Per-column row shape and dtype, e.g. ``{"x": ((8,), "float32")}``;
            requests that do not match get HTTP 422.
        reservation_timeout_s: Longest wait for a slice at replica start-up.
        init_timeout_s: Deadline for the host processes and ``setup``.
        request_timeout_s: Deadline of one SPMD step; past it the request fails (503).
        max_batch_size: Rows batched into one SPMD step (requests are batched
            until their rows reach it; also the per-request row limit).
        batch_wait_timeout_s: How long a batch waits for more requests.
        max_body_bytes: Larger HTTP bodies get 413.
        **serve_options: Passed to ``ray.serve.deployment`` (``num_replicas``,
            ``autoscaling_config``, ``name``, ``health_check_period_s`` ...).

    Returns:
        A ``ray.serve.Deployment``: ``.bind(...)`` passes arguments to the
        model's constructor on every host.
    """
    cfg = SliceServeConfig.from_accelerator_config(
        accelerator_type, accelerator_config, input_spec=input_spec, reservation_timeout_s=reservation_timeout_s,
        init_timeout_s=init_timeout_s, request_timeout_s=request_timeout_s, max_batch_size=max_batch_size,
        batch_wait_timeout_s=batch_wait_timeout_s, max_body_bytes=max_body_bytes)

    def wrap(cls: type) -> Any:
        from ray import serve

        if not callable(getattr(cls, "__call__", None)):
            raise TypeError(f"{cls.__name__} must define __call__(self, batch)")
        options = {"ray_actor_options": {"num_cpus": 0}, "max_constructor_retry_count": 3,
                   "health_check_period_s": 2.0, "health_check_timeout_s": 10.0,
                   "max_ongoing_requests": 4 * cfg.max_batch_size, **serve_options}
        return serve.deployment(make_replica_class(cls, cfg), **options)

    return wrap(_cls) if _cls is not None else wrap
