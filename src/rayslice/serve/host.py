"""What runs on each host of a serving slice (inside gang processes).

The user's model object lives here, one per host, created after
``jax.distributed`` is up; every request batch is run on every host (SPMD) and
host 0 returns the result.
"""

from __future__ import annotations

from typing import Any

import numpy as np

_MODEL: Any = None
_SAMPLER: Any = None


def setup_model(user_cls: type, args: tuple, kwargs: dict, deployment: str = "") -> str:
    """Creates the user's object on this host and runs its ``setup(ctx)``."""
    global _MODEL, _SAMPLER
    from rayslice.gang import host_context
    from rayslice.metrics import HostSampler

    ctx = host_context()
    obj = user_cls(*args, **kwargs)
    setup = getattr(obj, "setup", None)
    if callable(setup):
        setup(ctx)
    _MODEL = obj
    _SAMPLER = HostSampler(
        {"slice": ctx.slice_name, "worker_id": str(ctx.worker_id), "run": deployment or type(obj).__name__}
    ).start()
    return type(obj).__name__


def _gather(value: Any) -> Any:
    # A result sharded over several hosts is gathered so host 0 holds all of it
    # (a collective: every host takes this same path).
    import jax
    from jax.experimental import multihost_utils

    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        if value.is_fully_replicated:
            return value.addressable_data(0)  # every host already holds all of it
        return multihost_utils.process_allgather(value, tiled=True)
    return value


def infer(inputs: Any, rows: int) -> dict[str, np.ndarray] | None:
    """Runs the model on one (padded) batch; host 0 returns the first ``rows`` rows.

    ``inputs`` is the batch's columns, or a ref to them (a large batch is put
    in the object store once and shared by every host).
    """
    import time

    import jax

    if _MODEL is None:
        raise RuntimeError("the model was not set up on this host")
    if not isinstance(inputs, dict):  # one ray.put of a large batch, shared by every host
        import ray

        inputs = ray.get(inputs)
    t0 = time.perf_counter()
    out = _MODEL(inputs)
    outs = out if isinstance(out, dict) else {"output": out}
    outs = {k: _gather(v) for k, v in outs.items()}
    if _SAMPLER is not None:
        _SAMPLER.record_step(time.perf_counter() - t0)
    if jax.process_index() != 0:
        return None
    result = {}
    for k, v in outs.items():
        arr = np.asarray(v)
        if arr.ndim == 0 or arr.shape[0] < rows:
            raise ValueError(f"output {k!r} has shape {arr.shape}; expected a leading batch dimension of {rows}+")
        result[k] = arr[:rows]
    return result
