"""Application builder for Serve config files (``serve run`` / ``serve deploy``).

A config file names this builder and describes the model in ``args``::

    applications:
      - name: regressor
        route_prefix: /
        import_path: rayslice.serve.builder:app
        args:
          model: my_package.models:Regressor     # the class with setup(ctx) and __call__(batch)
          accelerator_type: TPU-V4
          accelerator_config: {kind: tpu, topology: 2x2x2}   # Ray Serve LLM's key; "type" works too
          input_spec: {x: {shape: [8], dtype: float32}}
          num_replicas: 1                          # or autoscaling_config: {...}
          init_kwargs: {checkpoint: /path/to/checkpoints/40}

Every other key of ``args`` that :func:`rayslice.serve.deployment` knows is
passed to it; the rest go to ``ray.serve.deployment``.

Example:
    >>> build({"model": "json:JSONDecoder", "accelerator_type": "TPU-V4"})
    Traceback (most recent call last):
    ...
    rayslice.errors.InvalidArgument: args={'model': 'json:JSONDecoder', 'accelerator_type': 'TPU-V4'} is not valid: \
expected the keys 'model', 'accelerator_type' and 'accelerator_config' (missing 'accelerator_config')
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from typing import Any

from rayslice._validate import check_str, fail
from rayslice.serve.deployment import deployment

__all__ = ["app", "build"]


def _import(path: object) -> Any:
    text = check_str("args['model']", path)
    module, _, name = text.partition(":")
    if not module or not name:
        raise fail("args['model']", path, "'package.module:ClassName'")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise fail(
            "args['model']", path, f"an importable 'package.module:ClassName' ({type(e).__name__}: {e})"
        ) from None


def build(args: Mapping[str, Any]) -> Any:
    """Builds the Serve application described by ``args`` (see module docstring).

    Raises:
        InvalidArgument: a missing or bad key, named with its value.
    """
    if not isinstance(args, Mapping):
        raise fail("args", args, "a mapping (the application's args in the Serve config file)", got_type=True)
    args = dict(args)
    missing = [k for k in ("model", "accelerator_type", "accelerator_config") if k not in args]
    if missing:
        raise fail(
            "args",
            args,
            "the keys 'model', 'accelerator_type' and 'accelerator_config' (missing "
            + ", ".join(map(repr, missing))
            + ")",
        )
    model = _import(args.pop("model"))
    init_args = args.pop("init_args", ())
    if isinstance(init_args, str | bytes | Mapping) or not isinstance(init_args, Sequence):
        raise fail("args['init_args']", init_args, "a list of constructor arguments", got_type=True)
    init_kwargs = args.pop("init_kwargs", {})
    if not isinstance(init_kwargs, Mapping) or not all(isinstance(k, str) for k in init_kwargs):
        raise fail("args['init_kwargs']", init_kwargs, "a mapping of constructor keyword arguments", got_type=True)
    # deployment() takes the slice options itself and hands the rest to Serve.
    dep = deployment(**args)(model)
    return dep.bind(*init_args, **dict(init_kwargs))


def app(args: dict[str, Any]) -> Any:
    """The ``import_path`` target: ``rayslice.serve.builder:app``."""
    return build(args)
