"""A decoder-only transformer in JAX/Flax, tensor-parallel over every device of a slice.

One definition serves training and inference: :class:`Transformer` runs a
causal forward pass over whole sequences (training, with
``rayslice.train.JaxTrainer``) or, given a KV cache, writes the new keys and
values at their positions and attends over the cache (prefill and decode).

Tensor parallelism: attention heads and the MLP's hidden units are split over
the mesh axis ``"model"`` (:func:`param_specs`), and so is the KV cache
(:func:`cache_spec`); embeddings and norms are replicated. XLA inserts the
all-reduces after the attention output and the MLP, across hosts when the mesh
spans several (gloo on CPU, ICI on TPU).

JAX is imported inside the functions that need it, so importing this module
(e.g. in a driver or the Serve controller) stays cheap.

Example:
    >>> cfg = LMConfig(d_model=32, num_layers=1, num_heads=4, d_ff=64, max_len=32)
    >>> params = init_params(cfg, seed=0)
    >>> logits = forward(cfg, params, np.zeros((1, 5), np.int32))
    >>> logits.shape
    (1, 5, 264)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from rayslice._validate import check_choice, check_int
from rayslice.errors import InvalidArgument

MODEL_AXIS = "model"
DATA_AXIS = "data"


@dataclasses.dataclass(frozen=True)
class LMConfig:
    """Shape of the transformer. Validated on construction.

    Args:
        vocab_size: Embedding rows; at least the tokenizer's vocabulary (ids
            beyond it are never sampled). A multiple of 8 keeps shapes friendly.
        d_model: Width of the residual stream.
        num_layers: Transformer blocks.
        num_heads: Attention heads (split over the ``model`` mesh axis, so the
            device count of the mesh's model axis must divide it).
        d_ff: Hidden units of each MLP (split like the heads).
        max_len: Longest sequence (positions are learned embeddings).
        dtype: Parameter and activation dtype.

    Example:
        >>> LMConfig().head_dim
        8
        >>> LMConfig(d_model=30, num_heads=8)
        Traceback (most recent call last):
        ...
        rayslice.errors.InvalidArgument: d_model=30 is not valid: expected a multiple of num_heads=8
    """

    vocab_size: int = 264
    d_model: int = 64
    num_layers: int = 2
    num_heads: int = 8
    d_ff: int = 256
    max_len: int = 256
    dtype: str = "float32"

    def __post_init__(self) -> None:
        check_int("vocab_size", self.vocab_size, minimum=2)
        check_int("d_model", self.d_model, minimum=1)
        check_int("num_layers", self.num_layers, minimum=1)
        check_int("num_heads", self.num_heads, minimum=1)
        check_int("d_ff", self.d_ff, minimum=1)
        check_int("max_len", self.max_len, minimum=2)
        check_choice("dtype", self.dtype, ("float32", "bfloat16"))
        if self.d_model % self.num_heads:
            raise InvalidArgument(
                f"d_model={self.d_model} is not valid: expected a multiple of num_heads={self.num_heads}"
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _module(cfg: LMConfig) -> Any:
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    dtype = jnp.dtype(cfg.dtype)
    init = nn.initializers.normal(0.02)
    out_init = nn.initializers.normal(0.02 / math.sqrt(2 * cfg.num_layers))

    def attend(q: Any, k: Any, v: Any, q_pos: Any, k_pos: Any) -> Any:
        # q [B,T,H,D], k/v [B,S,H,D]; a key is visible when its position <= the query's.
        scores = jnp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(cfg.head_dim)
        mask = k_pos[:, None, None, :] <= q_pos[:, None, :, None]
        scores = jnp.where(mask, scores.astype(jnp.float32), -1e30)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        return jnp.einsum("bhts,bshd->bthd", probs, v)

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x: Any, positions: Any, cache: tuple[Any, Any] | None) -> tuple[Any, Any]:
            h = nn.LayerNorm(dtype=dtype, name="ln1")(x)
            shape = (cfg.num_heads, cfg.head_dim)
            q = nn.DenseGeneral(shape, use_bias=False, dtype=dtype, kernel_init=init, name="attn_q")(h)
            k = nn.DenseGeneral(shape, use_bias=False, dtype=dtype, kernel_init=init, name="attn_k")(h)
            v = nn.DenseGeneral(shape, use_bias=False, dtype=dtype, kernel_init=init, name="attn_v")(h)
            if cache is None:
                a = attend(q, k, v, positions, positions)
                new_cache = None
            else:
                ck, cv = cache  # [B, S, H, D]
                rows = jnp.arange(x.shape[0])[:, None]
                ck = ck.at[rows, positions].set(k.astype(ck.dtype))
                cv = cv.at[rows, positions].set(v.astype(cv.dtype))
                k_pos = jnp.broadcast_to(jnp.arange(ck.shape[1])[None], (x.shape[0], ck.shape[1]))
                a = attend(q, ck, cv, positions, k_pos)
                new_cache = (ck, cv)
            x = x + nn.DenseGeneral(
                cfg.d_model, axis=(-2, -1), use_bias=False, dtype=dtype, kernel_init=out_init, name="attn_o"
            )(a)
            h = nn.LayerNorm(dtype=dtype, name="ln2")(x)
            h = nn.gelu(nn.Dense(cfg.d_ff, dtype=dtype, kernel_init=init, name="mlp_in")(h))
            x = x + nn.Dense(cfg.d_model, dtype=dtype, kernel_init=out_init, name="mlp_out")(h)
            return x, new_cache

    class Transformer(nn.Module):
        """Causal LM: tokens [B, T] (+ positions [B, T], optional KV caches) -> logits [B, T, V]."""

        @nn.compact
        def __call__(self, tokens: Any, positions: Any = None, cache: Any = None) -> Any:
            if positions is None:
                positions = jnp.broadcast_to(jnp.arange(tokens.shape[1])[None], tokens.shape)
            embed = nn.Embed(cfg.vocab_size, cfg.d_model, embedding_init=init, dtype=dtype, name="embed")
            pos_embed = self.param("pos_embed", init, (cfg.max_len, cfg.d_model))
            x = embed(tokens) + pos_embed[positions].astype(dtype)
            new_k, new_v = [], []
            for i in range(cfg.num_layers):
                layer_cache = None if cache is None else (cache[0][i], cache[1][i])
                x, c = Block(name=f"block_{i}")(x, positions, layer_cache)
                if c is not None:
                    new_k.append(c[0])
                    new_v.append(c[1])
            x = nn.LayerNorm(dtype=dtype, name="ln_f")(x)
            logits = embed.attend(x).astype(jnp.float32)  # tied input/output embedding
            if cache is None:
                return logits
            return logits, (jnp.stack(new_k), jnp.stack(new_v))

    return Transformer()


_MODULES: dict[LMConfig, Any] = {}


def module(cfg: LMConfig) -> Any:
    """The Flax module for ``cfg`` (one instance per config, so traces are reused)."""
    if cfg not in _MODULES:
        _MODULES[cfg] = _module(cfg)
    return _MODULES[cfg]


def init_params(cfg: LMConfig, seed: int = 0) -> dict[str, Any]:
    """Random initial variables as host numpy arrays (the same on every process for a seed)."""
    import jax

    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        variables = jax.jit(module(cfg).init)(jax.random.key(seed), np.zeros((1, 2), np.int32))
    return jax.tree.map(np.asarray, variables)


def forward(cfg: LMConfig, params: Any, tokens: Any) -> Any:
    """Causal logits [B, T, vocab] for whole sequences (no cache), as used in training."""
    return module(cfg).apply(params, tokens)


def loss_fn(cfg: LMConfig, params: Any, tokens: Any) -> Any:
    """Mean next-token cross-entropy of ``tokens`` [B, T] (predicting tokens[:, 1:])."""
    import jax
    import jax.numpy as jnp

    logits = forward(cfg, params, tokens[:, :-1])
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    return -picked.mean()


def _spec_for(path: tuple[str, ...], ndim: int) -> tuple[Any, ...]:
    """Partition of one parameter: heads / MLP hidden units on the model axis, the rest replicated."""
    names = set(path)
    leaf = path[-1]
    if names & {"attn_q", "attn_k", "attn_v"} and leaf == "kernel":
        return (None, MODEL_AXIS, None)  # [d_model, heads, head_dim]
    if "attn_o" in names and leaf == "kernel":
        return (MODEL_AXIS, None, None)  # [heads, head_dim, d_model]
    if "mlp_in" in names:
        return (None, MODEL_AXIS) if leaf == "kernel" else (MODEL_AXIS,)
    if "mlp_out" in names and leaf == "kernel":
        return (MODEL_AXIS, None)
    return (None,) * ndim


def param_specs(params: Any) -> Any:
    """A ``PartitionSpec`` per parameter (same tree structure as ``params``).

    Example:
        >>> cfg = LMConfig(d_model=16, num_layers=1, num_heads=2, d_ff=32, max_len=8)
        >>> specs = param_specs(init_params(cfg))
        >>> specs["params"]["block_0"]["attn_q"]["kernel"]
        P(None, 'model', None)
    """
    import jax
    from jax.sharding import PartitionSpec

    def one(path: Any, leaf: Any) -> Any:
        keys = tuple(str(getattr(p, "key", getattr(p, "name", p))) for p in path)
        return PartitionSpec(*_spec_for(keys, np.ndim(leaf)))

    return jax.tree_util.tree_map_with_path(one, params)


def cache_spec() -> Any:
    """The KV cache [layers, slots, positions, heads, head_dim] is split over heads."""
    from jax.sharding import PartitionSpec

    return PartitionSpec(None, None, None, MODEL_AXIS, None)


def mesh_shape(num_devices: int, cfg: LMConfig) -> tuple[int, int]:
    """(data, model): the largest model axis dividing the heads and MLP width; the rest replicates.

    Example:
        >>> mesh_shape(8, LMConfig(num_heads=8, d_ff=256))
        (1, 8)
        >>> mesh_shape(8, LMConfig(d_model=48, num_heads=6, d_ff=96))
        (4, 2)
    """
    model = math.gcd(num_devices, cfg.num_heads, cfg.d_ff)
    return num_devices // model, model


def make_mesh(devices: Any, cfg: LMConfig) -> Any:
    """A ("data", "model") mesh over ``devices`` (e.g. ``jax.devices()``: every host of the slice)."""
    from jax.sharding import Mesh

    devices = list(devices)
    data, model = mesh_shape(len(devices), cfg)
    return Mesh(np.array(devices, dtype=object).reshape(data, model), (DATA_AXIS, MODEL_AXIS))


def check_params(cfg: LMConfig, params: Any) -> None:
    """Raises ``ValueError`` naming the first parameter whose shape does not match ``cfg``."""
    import jax

    want = jax.eval_shape(lambda: init_params_shapes(cfg))
    got_flat = {jax.tree_util.keystr(p): np.shape(v) for p, v in jax.tree_util.tree_leaves_with_path(params)}
    want_flat = {jax.tree_util.keystr(p): tuple(v.shape) for p, v in jax.tree_util.tree_leaves_with_path(want)}
    missing = sorted(set(want_flat) - set(got_flat))
    if missing:
        raise ValueError(
            f"the weights have no parameter {missing[0]} (model config {cfg}); they hold {sorted(got_flat)[:4]}..."
        )
    for k, shape in want_flat.items():
        if tuple(got_flat[k]) != shape:
            raise ValueError(
                f"parameter {k} has shape {tuple(got_flat[k])} but the model config {cfg} "
                f"needs {shape}: the checkpoint was trained with another LMConfig"
            )


def init_params_shapes(cfg: LMConfig) -> Any:
    import jax

    return module(cfg).init(jax.random.key(0), np.zeros((1, 2), np.int32))
