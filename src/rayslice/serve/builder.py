"""Application builder for Serve config files (``serve run`` / ``serve deploy``).

A config file names this builder and describes the model in ``args``::

    applications:
      - name: regressor
        route_prefix: /
        import_path: rayslice.serve.builder:app
        args:
          model: my_package.models:Regressor     # the class with setup(ctx) and __call__(batch)
          accelerator_type: TPU-V4
          accelerator_config: {type: tpu, topology: 2x2x2}
          input_spec: {x: {shape: [8], dtype: float32}}
          num_replicas: 1                          # or autoscaling_config: {...}
          init_kwargs: {checkpoint: /path/to/checkpoints/40}

Every other key of ``args`` that :func:`rayslice.serve.deployment` knows is
passed to it; the rest go to ``ray.serve.deployment``.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from rayslice.serve.deployment import deployment

def _import(path: str) -> Any:
    module, _, name = path.partition(":")
    if not module or not name:
        raise ValueError(f"model {path!r} must be 'package.module:ClassName'")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot import model {path!r}: {e}") from None


def build(args: Mapping[str, Any]) -> Any:
    """Builds the Serve application described by ``args`` (see module docstring)."""
    args = dict(args)
    for key in ("model", "accelerator_type", "accelerator_config"):
        if key not in args:
            raise ValueError(f"args needs {key!r}; got {sorted(args)}")
    model = _import(args.pop("model"))
    init_args = tuple(args.pop("init_args", ()))
    init_kwargs = dict(args.pop("init_kwargs", {}))
    # deployment() takes the slice options itself and hands the rest to Serve.
    dep = deployment(**args)(model)
    return dep.bind(*init_args, **init_kwargs)


def app(args: dict[str, Any]) -> Any:
    """The ``import_path`` target: ``rayslice.serve.builder:app``."""
    return build(args)
