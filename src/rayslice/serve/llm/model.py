"""A decoder-only transformer in JAX/Flax, tensor-parallel over every device of a slice.

One definition serves training and inference: :class:`Transformer` runs a
causal forward pass over whole sequences (training, with
``rayslice.train.JaxTrainer``) or, given a KV cache, writes the new keys and
values at their positions and attends over the cache (prefill and decode).

Sharding: attention heads and the MLP's hidden units are split over the mesh
axis ``"model"`` (:func:`param_specs`); the KV cache is split over heads on
``"model"`` and over batch slots on ``"data"`` (:func:`cache_spec`);
embeddings and norms are replicated. Each block is a *parallel* block
(attention and MLP read the same normalised input and their outputs are added
to the residual together, as in GPT-J and PaLM), so XLA needs one all-reduce
per layer among the devices of a ``"model"`` group instead of two. The
layout (:func:`resolve_layout`) decides whether that group spans hosts
(``"tensor"``) or stays inside one host with the hosts splitting the slots
(``"data_tensor"``, no collective between hosts).

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


def write_cache(cache: Any, new: Any, positions: Any) -> Any:
    """``cache`` [B, S, H, D] with ``new`` [B, T, H, D] written at ``positions`` [B, T] (distinct per row).

    Written as a select over the whole cache, not a scatter: every operation
    is elementwise along the batch (slot) axis, so a cache whose slots are
    split over devices is updated where it lives, without any collective. The
    values are copied exactly (no arithmetic on them).

    Example:
        >>> import jax.numpy as jnp
        >>> c = write_cache(jnp.zeros((2, 4, 1, 1)), jnp.ones((2, 1, 1, 1)), jnp.array([[1], [3]]))
        >>> c[..., 0, 0].tolist()
        [[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]]
    """
    import jax.numpy as jnp

    hit = positions[:, :, None] == jnp.arange(cache.shape[1])[None, None, :]  # [B, T, S]
    if new.shape[1] == 1:
        return jnp.where(hit[:, 0, :, None, None], new.astype(cache.dtype), cache)
    written = hit.any(axis=1)[:, :, None, None]
    picked = jnp.where(hit[..., None, None], new[:, :, None].astype(cache.dtype), 0).sum(axis=1)
    return jnp.where(written, picked, cache)


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
                new_cache = (k, v)  # the keys and values of these positions (prefill from position 0)
            else:
                ck, cv = cache  # [B, S, H, D]
                ck, cv = write_cache(ck, k, positions), write_cache(cv, v, positions)
                k_pos = jnp.broadcast_to(jnp.arange(ck.shape[1])[None], (x.shape[0], ck.shape[1]))
                a = attend(q, ck, cv, positions, k_pos)
                new_cache = (ck, cv)
            attn = nn.DenseGeneral(
                cfg.d_model, axis=(-2, -1), use_bias=False, dtype=dtype, kernel_init=out_init, name="attn_o"
            )(a)
            m = nn.gelu(nn.Dense(cfg.d_ff, dtype=dtype, kernel_init=init, name="mlp_in")(h))
            mlp = nn.Dense(cfg.d_model, dtype=dtype, kernel_init=out_init, name="mlp_out")(m)
            return x + (attn + mlp), new_cache

    class Transformer(nn.Module):
        """Causal LM: tokens [B, T] (+ positions [B, T], optional KV caches) -> logits [B, T, V].

        With a cache ``(k, v)`` [layers, B, S, H, D], the new keys and values are
        written at their positions and the queries attend over the cache; it
        returns ``(logits, new cache)``. Without one, ``return_kv=True`` also
        returns the keys and values of the sequence ``(k, v)`` [layers, B, T, H, D]
        (a prefill from position 0, written into a cache by the caller).
        """

        @nn.compact
        def __call__(self, tokens: Any, positions: Any = None, cache: Any = None, return_kv: bool = False) -> Any:
            if positions is None:
                positions = jnp.broadcast_to(jnp.arange(tokens.shape[1])[None], tokens.shape)
            embed = nn.Embed(cfg.vocab_size, cfg.d_model, embedding_init=init, dtype=dtype, name="embed")
            pos_embed = self.param("pos_embed", init, (cfg.max_len, cfg.d_model))
            x = embed(tokens) + pos_embed[positions].astype(dtype)
            new_k, new_v = [], []
            for i in range(cfg.num_layers):
                layer_cache = None if cache is None else (cache[0][i], cache[1][i])
                x, c = Block(name=f"block_{i}")(x, positions, layer_cache)
                new_k.append(c[0])
                new_v.append(c[1])
            x = nn.LayerNorm(dtype=dtype, name="ln_f")(x)
            logits = embed.attend(x).astype(jnp.float32)  # tied input/output embedding
            if cache is None and not return_kv:
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


LAYOUTS = ("auto", "tensor", "data_tensor")
"""Ways to lay the model over a slice's devices (see :func:`resolve_layout`)."""


def cache_spec() -> Any:
    """The KV cache [layers, slots, positions, heads, head_dim]: slots on ``"data"``, heads on ``"model"``.

    Example:
        >>> cache_spec()
        P(None, 'data', None, 'model', None)
    """
    from jax.sharding import PartitionSpec

    return PartitionSpec(None, DATA_AXIS, None, MODEL_AXIS, None)


def resolve_layout(layout: str, num_hosts: int) -> str:
    """The concrete layout for ``layout`` on a mesh of ``num_hosts`` processes.

    - ``"tensor"``: the ``"model"`` axis takes as many devices as divide the
      heads and the MLP width, across hosts; every decode step all-reduces
      across hosts (cheap on a TPU slice's ICI).
    - ``"data_tensor"``: the ``"model"`` axis stays inside one host; the
      ``"data"`` axis (hosts) splits the batch slots, so the weights are
      replicated on each host and a step has no collective between hosts.
    - ``"auto"``: ``"data_tensor"`` (the lowest latency: no cross-host
      collective on the critical path); the same as ``"tensor"`` on one host.

    Example:
        >>> resolve_layout("auto", 2), resolve_layout("tensor", 2), resolve_layout("auto", 1)
        ('data_tensor', 'tensor', 'data_tensor')
        >>> resolve_layout("pipeline", 2)
        Traceback (most recent call last):
        ...
        rayslice.errors.InvalidArgument: layout='pipeline' is not valid: expected one of 'auto', 'tensor', 'data_tensor'
    """
    check_choice("layout", layout, LAYOUTS)
    check_int("num_hosts", num_hosts, minimum=1)
    return "data_tensor" if layout == "auto" else layout


def mesh_shape(
    num_devices: int,
    cfg: LMConfig,
    *,
    layout: str = "tensor",
    devices_per_host: int | None = None,
    tensor_parallel: int | None = None,
) -> tuple[int, int]:
    """(data, model) for ``num_devices`` devices.

    ``"tensor"``: the largest model axis dividing the device count, the heads
    and the MLP width. ``"data_tensor"``: the same, but within one host's
    ``devices_per_host`` devices. The data axis takes the rest (it splits the
    batch slots). ``tensor_parallel`` sets the model axis instead (it must
    divide the heads, the MLP width and the devices it may span).

    Example:
        >>> mesh_shape(8, LMConfig(num_heads=8, d_ff=256))
        (1, 8)
        >>> mesh_shape(8, LMConfig(num_heads=8, d_ff=256), layout="data_tensor", devices_per_host=4)
        (2, 4)
        >>> mesh_shape(8, LMConfig(d_model=48, num_heads=6, d_ff=96))
        (4, 2)
        >>> mesh_shape(8, LMConfig(), layout="data_tensor", devices_per_host=4, tensor_parallel=2)
        (4, 2)
    """
    layout = resolve_layout(layout, 1)
    per_host = num_devices if devices_per_host is None else devices_per_host
    check_int("devices_per_host", per_host, minimum=1)
    if num_devices % per_host:
        raise InvalidArgument(
            f"devices_per_host={per_host} is not valid: expected a divisor of the device count {num_devices}"
        )
    span = num_devices if layout == "tensor" else per_host
    model = math.gcd(span, cfg.num_heads, cfg.d_ff)
    if tensor_parallel is not None:
        check_int("tensor_parallel", tensor_parallel, minimum=1)
        if model % tensor_parallel:
            raise InvalidArgument(
                f"tensor_parallel={tensor_parallel} is not valid: expected a divisor of {model} (it must divide "
                f"num_heads={cfg.num_heads}, d_ff={cfg.d_ff} and the {span} devices of the {layout!r} layout)"
            )
        model = tensor_parallel
    return num_devices // model, model


def make_mesh(devices: Any, cfg: LMConfig, layout: str = "tensor", tensor_parallel: int | None = None) -> Any:
    """A ("data", "model") mesh over ``devices`` (e.g. ``jax.devices()``: every host of the slice).

    Devices are ordered by host (process) then id, so with ``"data_tensor"``
    each row of the mesh (a ``"model"`` group) lies inside one host.
    """
    from jax.sharding import Mesh

    devices = sorted(devices, key=lambda d: (d.process_index, d.id))
    hosts = sorted({d.process_index for d in devices})
    per_host = [sum(d.process_index == h for d in devices) for h in hosts]
    if len(set(per_host)) != 1:
        raise InvalidArgument(f"devices={devices!r} is not valid: expected the same number of devices on every host")
    data, model = mesh_shape(
        len(devices),
        cfg,
        layout=resolve_layout(layout, len(hosts)),
        devices_per_host=per_host[0],
        tensor_parallel=tensor_parallel,
    )
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
