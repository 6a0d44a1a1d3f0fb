"""The model on the devices: weights, KV cache and the compiled prefill / decode steps.

A :class:`ModelRunner` lives in every process that holds devices of the mesh:
once in a plain process (tests, a one-host deployment), or once per host of a
slice (inside gang processes, where every host runs each step: SPMD). It keeps
per-slot state on the devices (KV cache, last token, position), so a step's
inputs are a few small integer and float arrays:

- ``prefill(slot, prompt, ...)``: runs the prompt (padded to a length bucket)
  through the model, fills that slot's cache, samples the first token;
- ``decode(active, ...)``: one token for every slot at once (fixed slot count).

Shapes are fixed by :class:`~rayslice.serve.llm.engine.EngineConfig` (one
program per prompt bucket, one decode program), compiled by :meth:`warm_up`;
:func:`compile_count` counts XLA compilations in this process, so "nothing
recompiles after warm-up" is checkable.

Sampling runs inside the compiled step: greedy when ``temperature == 0``,
else temperature plus top-p (nucleus), with a key derived from the request's
seed and the token's position, so a seeded request gives the same tokens
whatever else is batched with it.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import numpy as np

from rayslice.serve.llm.model import LMConfig, cache_spec, check_params, init_params, make_mesh, module, param_specs

_COMPILES = 0
_LISTENING = False
_LOCK = threading.Lock()
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def _on_event(event: str, duration_secs: float, **kwargs: Any) -> None:
    global _COMPILES
    if event == _COMPILE_EVENT:
        with _LOCK:
            _COMPILES += 1


def compile_count() -> int:
    """XLA compilations in this process since the first runner was created."""
    return _COMPILES


def _listen() -> None:
    global _LISTENING
    import jax

    with _LOCK:
        if not _LISTENING:
            jax.monitoring.register_event_duration_secs_listener(_on_event)
            _LISTENING = True


@dataclasses.dataclass(frozen=True)
class Prefill:
    """One request entering a slot."""

    slot: int
    tokens: tuple[int, ...]
    bucket: int
    temperature: float
    top_p: float
    seed: int


@dataclasses.dataclass(frozen=True)
class Decode:
    """One token for every slot whose ``active`` flag is set (arrays of length ``num_slots``)."""

    active: np.ndarray  # bool
    temperature: np.ndarray  # float32
    top_p: np.ndarray  # float32
    seeds: np.ndarray  # uint32


@dataclasses.dataclass(frozen=True)
class Step:
    """What every process runs for one engine iteration: prefills, then an optional decode."""

    prefills: tuple[Prefill, ...] = ()
    decode: Decode | None = None


@dataclasses.dataclass(frozen=True)
class StepResult:
    prefill_tokens: tuple[int, ...]
    decode_tokens: np.ndarray | None
    device_s: float = 0.0  # time the step took on the (first) host, transfers to it excluded


def sample(logits: Any, temperature: Any, top_p: Any, seeds: Any, steps: Any, vocab_limit: int) -> Any:
    """Tokens [B] from logits [B, V]: greedy where temperature is 0, else temperature + top-p."""
    import jax
    import jax.numpy as jnp

    ids = jnp.arange(logits.shape[-1])
    logits = jnp.where(ids[None] < vocab_limit, logits, -jnp.inf)
    greedy = jnp.argmax(logits, axis=-1)
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    sorted_desc = -jnp.sort(-scaled, axis=-1)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of the tokens ranked above this one
    kept = before < top_p[:, None]  # the top token is always kept
    threshold = jnp.min(jnp.where(kept, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    masked = jnp.where(scaled >= threshold, scaled, -jnp.inf)
    keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seeds, steps)
    sampled = jax.vmap(jax.random.categorical)(keys, masked)
    return jnp.where(temperature > 0, sampled, greedy).astype(jnp.int32)


class ModelRunner:
    """Weights, KV cache and compiled steps over ``devices`` (default: every device of every host).

    Args:
        lm: Model shape.
        params: Variables as host numpy arrays (from :func:`init_params` or a checkpoint).
        num_slots: Concurrent sequences (the decode batch).
        max_context: Cache length per slot (<= ``lm.max_len``).
        vocab_limit: Ids at or above it are never sampled (the tokenizer's vocabulary).
        devices: Devices of the mesh; every process of a multi-host mesh must pass the same list.
    """

    def __init__(
        self, lm: LMConfig, params: Any, *, num_slots: int, max_context: int, vocab_limit: int, devices: Any = None
    ) -> None:
        import jax
        import jax.numpy as jnp
        from jax.sharding import NamedSharding, PartitionSpec

        _listen()
        check_params(lm, params)
        self.lm, self.num_slots, self.max_context = lm, num_slots, max_context
        self.mesh = make_mesh(jax.devices() if devices is None else devices, lm)
        self.replicated = NamedSharding(self.mesh, PartitionSpec())
        self.params = jax.tree.map(
            lambda a, spec: self._global(np.asarray(a), NamedSharding(self.mesh, spec)), params, param_specs(params)
        )
        dtype = jnp.dtype(lm.dtype)
        cache_shape = (lm.num_layers, num_slots, max_context, lm.num_heads, lm.head_dim)
        cache_sharding = NamedSharding(self.mesh, cache_spec())
        zeros = jax.jit(
            lambda: (jnp.zeros(cache_shape, dtype), jnp.zeros(cache_shape, dtype)),
            out_shardings=(cache_sharding, cache_sharding),
        )
        self.cache = zeros()
        self.last = self._global(np.zeros(num_slots, np.int32))
        self.pos = self._global(np.zeros(num_slots, np.int32))
        model = module(lm)
        repl = self.replicated
        state_shardings = ((cache_sharding, cache_sharding), repl, repl)

        def prefill(params, cache, last, pos, tokens, ints, floats):
            # tokens [1, T]; ints = [length, slot, seed]; floats = [temperature, top_p]
            length, slot, seed = ints[0], ints[1], ints[2].astype(jnp.uint32)
            positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
            one = tuple(jax.lax.dynamic_slice_in_dim(c, slot, 1, axis=1) for c in cache)
            logits, one = model.apply(params, tokens, positions, one)
            cache = tuple(jax.lax.dynamic_update_slice_in_dim(c, o, slot, axis=1) for c, o in zip(cache, one))
            row = jax.lax.dynamic_index_in_dim(logits[0], length - 1, axis=0, keepdims=True)  # [1, V]
            tok = sample(row, floats[0:1], floats[1:2], seed[None], length[None], vocab_limit)[0]
            return cache, last.at[slot].set(tok), pos.at[slot].set(length), tok

        def decode(params, cache, last, pos, active, seeds, floats):
            positions = jnp.minimum(pos, max_context - 1)
            logits, cache = model.apply(params, last[:, None], positions[:, None], cache)
            toks = sample(logits[:, 0], floats[0], floats[1], seeds.astype(jnp.uint32), pos + 1, vocab_limit)
            return cache, jnp.where(active, toks, last), jnp.where(active, pos + 1, pos), toks

        self._prefill = jax.jit(prefill, donate_argnums=(1,), out_shardings=(*state_shardings, repl))
        self._decode = jax.jit(decode, donate_argnums=(1,), out_shardings=(*state_shardings, repl))

    def _global(self, arr: np.ndarray, sharding: Any = None) -> Any:
        import jax

        sharding = self.replicated if sharding is None else sharding
        return jax.make_array_from_callback(arr.shape, sharding, lambda idx: arr[idx])

    @staticmethod
    def _local(arr: Any) -> np.ndarray:
        return np.asarray(arr.addressable_data(0))

    def run_prefill(self, p: Prefill) -> int:
        tokens = np.zeros((1, p.bucket), np.int32)
        tokens[0, : len(p.tokens)] = p.tokens
        ints = np.array([len(p.tokens), p.slot, p.seed & 0x7FFFFFFF], np.int32)
        floats = np.array([p.temperature, p.top_p], np.float32)
        self.cache, self.last, self.pos, tok = self._prefill(
            self.params, self.cache, self.last, self.pos, self._global(tokens), self._global(ints), self._global(floats)
        )
        return int(self._local(tok))

    def run_decode(self, d: Decode) -> np.ndarray:
        floats = np.stack([d.temperature, d.top_p]).astype(np.float32)
        seeds = (np.asarray(d.seeds, np.int64) & 0x7FFFFFFF).astype(np.int32)
        self.cache, self.last, self.pos, toks = self._decode(
            self.params,
            self.cache,
            self.last,
            self.pos,
            self._global(np.asarray(d.active, bool)),
            self._global(seeds),
            self._global(floats),
        )
        return self._local(toks)

    def step(self, step: Step) -> StepResult:
        """Runs one engine iteration (call it in every process of the mesh with the same ``step``)."""
        t0 = time.perf_counter()
        firsts = tuple(self.run_prefill(p) for p in step.prefills)
        toks = None if step.decode is None else self.run_decode(step.decode)
        return StepResult(firsts, toks, time.perf_counter() - t0)

    def warm_up(self, buckets: tuple[int, ...]) -> int:
        """Compiles every program (one per prompt bucket, plus decode); returns compiles done."""
        before = compile_count()
        for b in buckets:
            self.run_prefill(Prefill(slot=0, tokens=(0,), bucket=b, temperature=0.0, top_p=1.0, seed=0))
        n = self.num_slots
        self.run_decode(
            Decode(np.zeros(n, bool), np.zeros(n, np.float32), np.ones(n, np.float32), np.zeros(n, np.uint32))
        )
        return compile_count() - before


# -- inside gang processes (one per host of the slice) ----------------------------------------------

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
    )
    compiles = _RUNNER.warm_up(tuple(engine_kwargs["prefill_buckets"]))
    return {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "device_count": jax.device_count(),
        "mesh": dict(_RUNNER.mesh.shape),
        "warm_up_compiles": compiles,
        "compiles": compile_count(),
    }


def host_step(step: Step) -> StepResult | None:
    """One engine iteration on this host; host 0 returns the tokens."""
    import jax

    if _RUNNER is None:
        raise RuntimeError("the model was not set up on this host")
    out = _RUNNER.step(step)
    return out if jax.process_index() == 0 else None


def host_stats() -> dict[str, int]:
    return {"compiles": compile_count()}
