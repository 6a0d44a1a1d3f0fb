"""Ray Serve deployments whose replicas each own one whole slice.

``@rayslice.serve.deployment(accelerator_type=..., accelerator_config={"kind": "tpu",
"topology": ...})`` turns a model class into an ordinary Ray Serve deployment
(``"kind"`` is Ray Serve LLM's key; rayslice's older ``"type"`` works too).
Serve starts each replica on host 0 of a free slice of the requested shape
when there is one (:func:`replica_placement`); at start-up the replica
reserves one whole slice (rayslice's reservation, so bundles never scatter
over two slices; the slice it stands on first), becomes host 0 of it in its
own process when it stands there (else host 0 is a gang process too), starts
one gang process per other host with ``jax.distributed`` up, and creates the
model on every host (``setup(ctx)`` runs there). Requests are batched
(``serve.batch``) into one SPMD step that every host runs; host 0 answers.

The slice request is parsed once, when the deployment is declared
(:class:`SliceServeConfig` holds the :class:`~rayslice.request.SliceRequest`),
and passed whole to the reservation. Every SPMD step ends as a
:class:`~rayslice.errors.RunOutcome` value (see :mod:`rayslice.serve.replica`)
that decides the HTTP status: the model raised (500), a host was lost or the
step ran past its deadline (503). A host lost during a request is answered
503 and the replica reports unhealthy, so Serve replaces it.

If no slice can be reserved before ``reservation_timeout_s``, the constructor
raises the reservation's per-slice explanation on one line and Serve marks the
deployment failed, instead of leaving it DEPLOYING; :func:`run` puts that line
in the exception ``serve.run`` raises.

Example:
    >>> from ray import serve
    >>> from rayslice import serve as slice_serve
    >>> @slice_serve.deployment(accelerator_type="TPU-V4",
    ...                         accelerator_config={"kind": "tpu", "topology": "2x2x2"},
    ...                         input_spec={"x": ((8,), "float32")})
    ... class Model:
    ...     def setup(self, ctx): ...
    ...     def __call__(self, batch): return batch["x"].sum(axis=1)
    >>> serve.run(Model.bind())  # doctest: +SKIP
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Mapping
from typing import Any

from rayslice._validate import check_int, check_optional, check_str, fail
from rayslice.serve.config import SliceServeConfig, parse_accelerator_config
from rayslice.serve.replica import ReplicaCore, http_status, make_replica_class
from rayslice.serve.schema import InputSpec

_ReplicaCore = ReplicaCore  # the name this module used before the replica moved to rayslice.serve.replica

__all__ = [
    "DeploymentFailed",
    "SliceServeConfig",
    "deployment",
    "failure_reason",
    "http_status",
    "parse_accelerator_config",
    "replica_placement",
    "run",
    "start_http",
]


def start_http(port: int | None = None, host: str = "127.0.0.1") -> int:
    """Starts Ray Serve with its HTTP proxy on the head node only, at an explicit port.

    Args:
        port: The port; when None, one the OS reports free is used (a short
            race with other programs, acceptable for tests and demos).
        host: Interface to listen on.

    Returns:
        The port the proxy listens on.

    Example:
        >>> start_http(port=70000)
        Traceback (most recent call last):
        ...
        rayslice.errors.InvalidArgument: port=70000 is not valid: expected an integer >= 1 and <= 65535
    """
    import socket

    check_optional(check_int, "port", port, minimum=1, maximum=65535)
    check_str("host", host)
    from ray import serve

    if port is None:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
    serve.start(proxy_location="HeadOnly", http_options={"host": host, "port": port})
    return port


def replica_placement(cfg: SliceServeConfig) -> dict[str, Any]:
    """Where Serve starts a slice replica: on host 0 of a slice of the requested shape, else anywhere.

    A replica that starts on host 0 of a free slice reserves that slice and is
    host 0 itself (its share of every step runs in the replica's process: no
    Ray call between a request and its answer). When no such host is
    schedulable, Serve's fallback starts the replica anywhere and every host
    is a gang actor, as before; a shape no cluster has still fails at once
    (the replica's reservation says why). The replica takes no CPU or chip:
    the reservation holds the slice.

    Example:
        >>> cfg = SliceServeConfig.from_accelerator_config("TPU-V4", {"kind": "tpu", "topology": "2x2x2"})
        >>> replica_placement(cfg)["label_selector"]
        {'ray.io/tpu-pod-type': 'v4-16', 'ray.io/tpu-worker-id': '0'}
    """
    from rayslice.cluster import LABEL_POD_TYPE, LABEL_WORKER_ID

    host0 = {LABEL_POD_TYPE: cfg.request.topology.pod_type, LABEL_WORKER_ID: "0"}
    return {"num_cpus": 0, "label_selector": host0, "fallback_strategy": [{"label_selector": {}}]}


def _check_model_class(cls: object) -> type:
    if not inspect.isclass(cls):
        raise fail("model", cls, "a class with __call__(self, batch) (and optionally setup(self, ctx))", got_type=True)
    defined = [vars(k)["__call__"] for k in cls.__mro__ if k is not object and "__call__" in vars(k)]
    if not defined:
        raise fail("model", cls, f"a class that defines __call__(self, batch); {cls.__name__} does not")
    if not callable(defined[0]) and not isinstance(defined[0], staticmethod | classmethod):
        raise fail("model", cls, f"a class whose __call__ is a method; {cls.__name__}.__call__ is {defined[0]!r}")
    setup = inspect.getattr_static(cls, "setup", None)
    if setup is not None and not callable(setup) and not isinstance(setup, staticmethod | classmethod):
        raise fail("model", cls, f"a class whose setup is a method; {cls.__name__}.setup is {setup!r}")
    return cls


def deployment(
    _cls: type | None = None,
    *,
    accelerator_type: str,
    accelerator_config: Mapping[str, Any],
    input_spec: Mapping[str, Any] | InputSpec | None = None,
    reservation_timeout_s: float = 60.0,
    init_timeout_s: float = 120.0,
    request_timeout_s: float = 30.0,
    body_timeout_s: float = 10.0,
    max_batch_size: int = 32,
    batch_wait_timeout_s: float = 0.002,
    max_body_bytes: int = 1 << 20,
    **serve_options: Any,
) -> Any:
    """Makes a model class a Ray Serve deployment whose replicas each own one whole slice.

    Args:
        accelerator_type: Generation, e.g. "TPU-V4".
        accelerator_config: ``{"kind": "tpu", "topology": "2x2x2"[, "chips_per_host": 4]}``
            (Ray Serve LLM's shape; ``"type"`` for ``"kind"`` and ``"chips_per_vm"``
            work too), or Ray Serve LLM's ``TPUConfig`` object.
        input_spec: Per-column row shape and dtype, e.g. ``{"x": ((8,), "float32")}``;
            requests that do not match get HTTP 422.
        reservation_timeout_s: Longest wait for a slice at replica start-up.
        init_timeout_s: Deadline for the host processes and ``setup``.
        request_timeout_s: Deadline of one SPMD step; past it the request fails (503).
        body_timeout_s: Deadline for an HTTP body to arrive; past it the request gets 408.
        max_batch_size: Rows batched into one SPMD step (requests are batched
            until their rows reach it; also the per-request row limit).
        batch_wait_timeout_s: How long a batch waits for more requests.
        max_body_bytes: Larger HTTP bodies get 413.
        **serve_options: Passed to ``ray.serve.deployment`` (``num_replicas``,
            ``autoscaling_config``, ``name``, ``health_check_period_s`` ...).

    Returns:
        A ``ray.serve.Deployment`` (or a decorator making one): ``.bind(...)``
        passes arguments to the model's constructor on every host.

    Raises:
        InvalidArgument: a bad option (named, with its value), or a model
            that is not a class defining ``__call__``.

    Example:
        >>> class NoCall:
        ...     pass
        >>> deployment(NoCall, accelerator_type="TPU-V4", accelerator_config={"kind": "tpu", "topology": "2x2x2"})
        Traceback (most recent call last):
        ...
        rayslice.errors.InvalidArgument: model=<class 'rayslice.serve.deployment.NoCall'> is not valid: \
expected a class that defines __call__(self, batch); NoCall does not
    """
    cfg = SliceServeConfig.from_accelerator_config(
        accelerator_type,
        accelerator_config,
        input_spec=input_spec,
        reservation_timeout_s=reservation_timeout_s,
        init_timeout_s=init_timeout_s,
        request_timeout_s=request_timeout_s,
        body_timeout_s=body_timeout_s,
        max_batch_size=max_batch_size,
        batch_wait_timeout_s=batch_wait_timeout_s,
        max_body_bytes=max_body_bytes,
    )

    def wrap(cls: type) -> Any:
        _check_model_class(cls)
        from ray import serve

        options = {
            "max_constructor_retry_count": 3,
            "health_check_period_s": 2.0,
            "health_check_timeout_s": 10.0,
            "max_ongoing_requests": 4 * cfg.max_batch_size,
            **serve_options,
            "ray_actor_options": {**replica_placement(cfg), **(serve_options.get("ray_actor_options") or {})},
        }
        return serve.deployment(make_replica_class(cls, cfg), **options)

    return wrap(_cls) if _cls is not None else wrap


class DeploymentFailed(RuntimeError):
    """``serve.run`` failed; the message carries each failed deployment's reason on one line."""


_REASON = re.compile(r"^\s*rayslice\.errors\.(\w+): (.+)$")


def failure_reason(app_name: str) -> str:
    """The one-line reasons why an application's deployments failed ("" when none is known).

    Reads ``serve.status()``: a slice deployment that could not reserve its
    slice raised the reservation's per-slice report on one line, which is the
    last line of Serve's (multi-line) deployment message.
    """
    from ray import serve

    app = serve.status().applications.get(app_name)
    if app is None:
        return ""
    reasons = []
    for name, dep in app.deployments.items():
        lines = [f"{m.group(1)}: {m.group(2)}" for m in map(_REASON.match, (dep.message or "").splitlines()) if m]
        if lines:
            reasons.append(lines[-1])
        elif dep.message and str(dep.status).endswith(("DEPLOY_FAILED", "UNHEALTHY")):
            tail = [ln.strip() for ln in dep.message.strip().splitlines() if ln.strip()]
            reasons.append(f"{name}: {tail[-1] if tail else dep.message}")
    return "; ".join(reasons)


def run(target: Any, **kwargs: Any) -> Any:
    """``ray.serve.run`` that, when the application fails to deploy, says why in its exception.

    Serve's own exception says only "Failed to update the deployments [...]";
    this one (a :class:`DeploymentFailed`, also a ``RuntimeError``) adds each
    failed deployment's one-line reason, e.g. the per-slice report of a
    reservation that found no slice of that shape.

    Example:
        >>> handle = run(Model.bind(), name="model", route_prefix="/model")  # doctest: +SKIP
    """
    from ray import serve

    try:
        return serve.run(target, **kwargs)
    except RuntimeError as e:
        reason = failure_reason(kwargs.get("name", "default"))
        if not reason:
            raise
        raise DeploymentFailed(f"{str(e).strip()} Reason: {reason}") from e
