"""The model inside a slice's gang processes: one :class:`~rayslice.serve.llm.runner.ModelRunner` per host.

:class:`~rayslice.serve.llm.deployment.SliceExecutor` sends these functions
to every host of its gang: :func:`host_setup` once (builds the runner over
the slice's devices and compiles every program), then :func:`host_step` for
each engine step (each host answers for the slots it holds, merged by
:func:`~rayslice.serve.llm.runner.merge_results`), and :func:`host_stats`
for the replica's stats.

Example:
    >>> host_step(Step())  # nothing was set up in this process
    Traceback (most recent call last):
    ...
    RuntimeError: the model was not set up on this host
"""

from __future__ import annotations

from typing import Any

from rayslice.serve.llm.model import LMConfig, init_params
from rayslice.serve.llm.programs import compile_count
from rayslice.serve.llm.runner import ModelRunner, Step, StepResult

_RUNNER: ModelRunner | None = None


def host_setup(lm: LMConfig, engine_kwargs: dict[str, Any], checkpoint: str | None, seed: int) -> dict[str, Any]:
    """Builds this host's runner over every device of the slice and compiles every program."""
    global _RUNNER
    import jax

    from rayslice.serve.llm.weights import load_params

    params = init_params(lm, seed) if checkpoint is None else load_params(checkpoint)
    _RUNNER = ModelRunner(
        lm,
        params,
        num_slots=engine_kwargs["num_slots"],
        max_context=engine_kwargs["max_context"],
        vocab_limit=engine_kwargs["vocab_limit"],
        layout=engine_kwargs.get("layout", "auto"),
        tensor_parallel=engine_kwargs.get("tensor_parallel"),
    )
    no_gloo = getattr(jax.config, "jax_cpu_collectives_implementation", "gloo") is None
    if jax.process_count() > 1 and no_gloo and jax.default_backend() == "cpu" and not _RUNNER.host_local:
        raise RuntimeError(
            f"layout {_RUNNER.layout!r} (mesh {dict(_RUNNER.mesh.shape)}) runs programs across hosts, but the "
            "hosts were started without cross-process collectives (SliceGang(cpu_collectives=False))"
        )
    compiles = _RUNNER.warm_up(tuple(engine_kwargs["prefill_buckets"]))
    crossing = _RUNNER.collectives_between_hosts(min(engine_kwargs["prefill_buckets"]))
    _RUNNER.skip_others = not crossing and jax.process_count() > 1
    import gc

    gc.freeze()  # the model, its programs and JAX live as long as the replica: no full collection rescans them
    return {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "device_count": jax.device_count(),
        "mesh": dict(_RUNNER.mesh.shape),
        "layout": _RUNNER.layout,
        "cross_host_collectives": len(crossing),
        "skips_others": _RUNNER.skip_others,
        "host_local": _RUNNER.host_local,
        "local_groups": sorted(_RUNNER.local_groups),
        "warm_up_compiles": compiles,
        "compiles": compile_count(),
    }


def host_step(step: Step) -> StepResult:
    """One engine iteration on this host: the tokens of the slots it holds (see :func:`merge_results`)."""
    if _RUNNER is None:
        raise RuntimeError("the model was not set up on this host")
    return _RUNNER.step(step)


def host_stats() -> dict[str, int]:
    """This host's counters: ``compiles``, the XLA compilations in this process."""
    return {"compiles": compile_count()}
