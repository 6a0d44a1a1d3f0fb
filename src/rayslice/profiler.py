"""JAX profiles from every host of a slice at once.

Gang processes of a training run or a serve deployment are named Ray actors
(``<run or deployment>/<gang id>/<rank>`` in the ``rayslice`` namespace).
:func:`capture` (and ``rayslice profile NAME --seconds N``) asks every one of
them to record a JAX trace for the same ``N`` seconds, while the job runs, into
``<run path>/profiles/<timestamp>/<gang id>-host-<rank>/`` (TensorBoard/XProf layout:
``plugins/profile/<run>/*.xplane.pb``). No TensorFlow is needed.

:func:`init_jax_profiler` (inside a worker) also starts JAX's profiler server
and publishes its address, for tools that capture remotely (TensorBoard's
"capture profile", ``xprof``).

Example:
    >>> import rayslice
    >>> rayslice.profiler.capture("my-run", seconds=2)  # doctest: +SKIP
    {0: ['/.../profiles/20261130-101500/host-0/plugins/profile/.../host.xplane.pb'], 1: [...]}
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

from rayslice.gang import NAMESPACE, host_context

_KV_PREFIX = b"rayslice/profiler/"


def init_jax_profiler(port: int | None = None) -> int:
    """Starts JAX's profiler server in this gang process and publishes ``ip:port``.

    Returns:
        The port the server listens on.
    """
    import jax
    import ray
    from ray.experimental.internal_kv import _internal_kv_put

    if port is None:
        with socket.socket() as s:  # the server binds it right after; local to this host
            s.bind(("", 0))
            port = s.getsockname()[1]
    jax.profiler.start_server(port)
    ctx = host_context()
    key = _KV_PREFIX + f"{ctx.gang_name}/{ctx.rank}".encode()
    address = f"{ray.util.get_node_ip_address()}:{port}"
    _internal_kv_put(
        key,
        json.dumps({"address": address, "slice": ctx.slice_name, "worker_id": ctx.worker_id}),
        overwrite=True,
        namespace=b"rayslice",
    )
    return port


def _default_dir(gang: str) -> str:
    # Runs in a gang process: the job's own outputs (a training run's path), else the results root.
    ctx = host_context()
    if ctx.artifacts_dir:
        return os.path.join(ctx.artifacts_dir, "profiles")
    return os.path.join(os.path.expanduser("~/rayslice_results"), gang, "profiles")


_TRACE: dict[str, Any] = {}


def _start_trace(directory: str, seconds: float) -> None:
    # Runs in a gang process and returns at once: a timer stops the trace, so
    # the process's spare thread stays free for the driver's polls and health
    # checks while the trace records.
    import threading

    import jax

    if _TRACE.get("timer") is not None and _TRACE["timer"].is_alive():
        raise RuntimeError("a trace is already being recorded in this process")
    os.makedirs(directory, exist_ok=True)
    jax.profiler.start_trace(directory)
    timer = threading.Timer(seconds, jax.profiler.stop_trace)
    timer.daemon = True
    timer.start()
    _TRACE.update(timer=timer, directory=directory)


def _finish_trace(timeout_s: float) -> list[str]:
    timer, directory = _TRACE["timer"], _TRACE["directory"]
    timer.join(timeout_s)
    if timer.is_alive():
        raise TimeoutError(f"the trace into {directory} did not finish within {timeout_s:g} s")
    return sorted(os.path.join(root, f) for root, _, files in os.walk(directory) for f in files)


def gang_actors(gang: str) -> dict[str, Any]:
    """The live gang processes of ``gang`` (a run or deployment name), keyed ``<gang id>-host-<rank>``.

    Several gangs can share a name (the replicas of one deployment): each keeps
    its own id, so ranks are never mixed up.
    """
    import ray

    named = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAMESPACE]
    mine = [n for n in named if n.startswith(f"{gang}/")]
    if not mine:
        known = sorted({n.split("/")[0] for n in named})
        raise ValueError(f"no running gang named {gang!r}; running: {', '.join(known) or 'none'}")
    keys = {n: f"{n.split('/')[1]}-host-{int(n.rsplit('/', 1)[1])}" for n in mine}
    return {keys[n]: ray.get_actor(n, namespace=NAMESPACE) for n in sorted(mine, key=lambda n: keys[n])}


def capture(
    gang: str, seconds: float = 5.0, output_dir: str | None = None, timeout_s: float = 120.0
) -> dict[str, list[str]]:
    """Records a JAX trace on every host of ``gang`` at once.

    Args:
        gang: Training run name or serve deployment name.
        seconds: Trace length.
        output_dir: Root for the traces (default: the run's ``profiles/`` directory).
        timeout_s: Deadline for every host to finish writing.

    Returns:
        The files written, per host (``<gang id>-host-<rank>``).
    """
    import ray

    if not seconds > 0:
        raise ValueError(f"seconds={seconds} must be > 0")
    actors = gang_actors(gang)
    first = next(iter(actors.values()))
    root = output_dir or ray.get(first.call.remote(_default_dir, (gang,), {}), timeout=30)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    ray.get(
        [a.call.remote(_start_trace, (os.path.join(root, stamp, key), seconds), {}) for key, a in actors.items()],
        timeout=timeout_s,
    )
    time.sleep(seconds)  # the traces record meanwhile, on every host
    refs = {key: a.call.remote(_finish_trace, (timeout_s,), {}) for key, a in actors.items()}
    return dict(zip(refs, ray.get(list(refs.values()), timeout=timeout_s + 10)))
