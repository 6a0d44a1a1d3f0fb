"""Weights from an Orbax checkpoint written by ``rayslice.train.JaxTrainer`` (plain Orbax, any process).

``JaxTrainer`` writes ``<run>/checkpoints/<step>/state`` (an Orbax
``StandardSave`` of whatever the loop reported). The language-model loop
(:func:`rayslice.serve.llm.training.lm_train_loop`) reports
``{"params": <Flax variables>, "opt": <optimizer state>}``; serving reads the
``params`` entry back as host numpy arrays and places them on its own mesh, so
a model trained on one slice shape serves on any other.

Example:
    >>> resolve_step_dir("/nonexistent/run")
    Traceback (most recent call last):
    ...
    FileNotFoundError: no checkpoint at '/nonexistent/run': expected a step directory (.../checkpoints/<step>), \
a checkpoints directory or a run directory holding complete steps
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np


def _steps(directory: str) -> list[int]:
    if not os.path.isdir(directory):
        return []
    return sorted(int(n) for n in os.listdir(directory) if n.isdigit() and os.path.isdir(os.path.join(directory, n)))


def resolve_step_dir(path: str) -> str:
    """The step directory for a step, checkpoints or run directory (the newest complete step)."""
    path = os.path.abspath(os.path.expanduser(str(path))).rstrip("/")
    if os.path.isdir(os.path.join(path, "state")):
        return path
    for directory in (path, os.path.join(path, "checkpoints")):
        steps = _steps(directory)
        if steps:
            return os.path.join(directory, str(steps[-1]))
    raise FileNotFoundError(
        f"no checkpoint at {path!r}: expected a step directory (.../checkpoints/<step>), "
        "a checkpoints directory or a run directory holding complete steps"
    )


def load_params(path: str) -> dict[str, Any]:
    """The Flax variables (``{"params": ...}``) saved under ``"params"``, as host numpy arrays."""
    import jax
    import orbax.checkpoint as ocp

    state_dir = os.path.join(resolve_step_dir(path), "state")
    # Each host reads the weights for itself, as host arrays: no barrier with the other processes (which would
    # be a computation over every process's devices, refused where the hosts have no cross-process collectives).
    me = jax.process_index()
    alone = ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me})
    ckptr = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(multiprocessing_options=alone), multiprocessing_options=alone)
    tree = ckptr.metadata(state_dir).item_metadata.tree
    if not isinstance(tree, dict) or "params" not in tree:
        raise ValueError(
            f"checkpoint {state_dir} holds {sorted(tree) if isinstance(tree, dict) else type(tree)}; "
            "expected a 'params' entry (report(..., checkpoint={'params': variables, ...}))"
        )
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    state = ckptr.restore(state_dir, args=ocp.args.PyTreeRestore(restore_args=restore_args))
    params = state["params"]
    return params if "params" in params else {"params": params}
