"""The model on the devices: weights, KV cache and the compiled prefill / decode steps.

A :class:`ModelRunner` lives in every process that holds devices of the mesh:
once in a plain process (tests, a one-host deployment), or once per host of a
slice (inside gang processes: with ``"tensor"`` every host runs each step,
SPMD; with ``"data_tensor"`` a host runs the programs of its own slots, over
its own devices only, see :attr:`ModelRunner.host_local`). It keeps
per-slot state on the devices (KV cache, last token, position), so a step's
inputs are a few small integer and float arrays:

- ``prefill(slot, prompt, ...)``: runs the prompt (padded to a length bucket) on the slot group's devices
  through the model, fills that slot's cache, samples the first token;
- ``decode(active, ...)``: one token for every slot at once (fixed slot count; with
  :attr:`ModelRunner.host_local`, every slot this process holds).

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
import time
from typing import Any

import numpy as np

from rayslice.errors import InvalidArgument
from rayslice.serve.llm.model import (
    DATA_AXIS,
    MODEL_AXIS,
    LMConfig,
    cache_spec,
    check_params,
    make_mesh,
    module,
    param_specs,
    resolve_layout,
)
from rayslice.serve.llm.programs import collectives_spanning, compile_count, count_compiles

__all__ = [
    "Decode",
    "ModelRunner",
    "Prefill",
    "Step",
    "StepResult",
    "collectives_spanning",
    "compile_count",
    "merge_results",
    "sample",
]


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

    The batch slots are split over the mesh's ``"data"`` axis into
    :attr:`groups` equal groups (slot ``s`` belongs to group
    ``s // (num_slots // groups)``). A prefill runs on the devices of its
    slot's group only (one program per prompt bucket and group, over a
    ``[1, model]`` sub-mesh whose inputs are the full-mesh state's shards on
    those devices, and whose outputs become those shards again: no copy, no
    padding rows, no device outside the group), so each host prefills its own
    slots and the first token never waits on another host or group.

    ``host_local`` is true when the mesh spans several processes and every
    slot group lies inside one of them (``"data_tensor"``): the decode then
    also runs per process, over its own rows of the mesh, so no program of
    the runner spans processes and JAX needs no cross-process collectives.

    Args:
        lm: Model shape.
        params: Variables as host numpy arrays (from :func:`init_params` or a checkpoint).
        num_slots: Concurrent sequences (the decode batch); a multiple of the mesh's data axis.
        max_context: Cache length per slot (<= ``lm.max_len``).
        vocab_limit: Ids at or above it are never sampled (the tokenizer's vocabulary).
        devices: Devices of the mesh; every process of a multi-host mesh must pass the same list.
        layout: ``"auto"``, ``"tensor"`` or ``"data_tensor"`` (:func:`~rayslice.serve.llm.model.resolve_layout`).
        tensor_parallel: The model axis (default: the layout's largest).
        mesh: An explicit ("data", "model") mesh (instead of ``devices``, ``layout`` and ``tensor_parallel``).

    Example:
        >>> from rayslice.serve.llm.model import init_params
        >>> lm = LMConfig(d_model=16, num_layers=1, num_heads=2, d_ff=32, max_len=16)
        >>> r = ModelRunner(lm, init_params(lm), num_slots=2, max_context=16, vocab_limit=264)
        >>> r.warm_up((8,)) == len(r.local_groups) + 1  # a prefill per bucket and slot group, one decode
        True
        >>> res = r.step(Step(prefills=(Prefill(slot=1, tokens=(1, 2), bucket=8, temperature=0.0, top_p=1.0,
        ...                                      seed=0),)))
        >>> len(res.prefill_tokens), res.decode_tokens is None
        (1, True)
    """

    def __init__(
        self,
        lm: LMConfig,
        params: Any,
        *,
        num_slots: int,
        max_context: int,
        vocab_limit: int,
        devices: Any = None,
        layout: str = "auto",
        tensor_parallel: int | None = None,
        mesh: Any = None,
    ) -> None:
        import jax
        import jax.numpy as jnp
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        count_compiles()
        check_params(lm, params)
        self.lm, self.num_slots, self.max_context = lm, num_slots, max_context
        devs = jax.devices() if devices is None else list(devices)
        self.layout = resolve_layout(layout, len({d.process_index for d in devs}))
        self.mesh = make_mesh(devs, lm, self.layout, tensor_parallel) if mesh is None else mesh
        self.groups = int(self.mesh.shape[DATA_AXIS])
        if num_slots % self.groups:
            raise InvalidArgument(
                f"num_slots={num_slots} is not valid: expected a multiple of the mesh's data axis "
                f"({self.groups}: {dict(self.mesh.shape)}, layout {self.layout!r})"
            )
        self.per_group = num_slots // self.groups
        here = jax.process_index()
        self.local_groups = frozenset(
            g for g in range(self.groups) if any(d.process_index == here for d in self.mesh.devices[g].flat)
        )
        # Set by _host.host_setup once the compiled programs are known to have no collective between hosts: a host
        # then runs only the programs that touch its own slots (the others' results do not depend on it).
        self.skip_others = False
        self._local_devices = [d for d in self.mesh.devices.flat if d.process_index == here]
        mine = sorted(self.local_groups)
        # Every slot group inside one process, and several processes: each process runs programs over its own
        # devices only (its groups: a contiguous block of rows and slots), none spans processes. Then no
        # cross-process CPU collective implementation (gloo) is needed at all (see SliceGang's cpu_collectives).
        self.host_local = (
            bool(mine)
            and len({d.process_index for d in self.mesh.devices.flat}) > 1
            and all(len({d.process_index for d in self.mesh.devices[g].flat}) == 1 for g in range(self.groups))
            and mine == list(range(mine[0], mine[-1] + 1))
        )
        self._host_mesh: Any = None  # this process's rows of the mesh and their slots (used when host_local)
        if self.host_local:
            self._host_mesh = Mesh(self.mesh.devices[mine[0] : mine[-1] + 1], (DATA_AXIS, MODEL_AXIS))
        self._host_slots = (mine[0] * self.per_group, (mine[-1] + 1) * self.per_group) if self.host_local else (0, 0)
        self.replicated = NamedSharding(self.mesh, PartitionSpec())
        self.rows = NamedSharding(self.mesh, PartitionSpec(DATA_AXIS))  # a leading slot / group axis
        self.params = jax.tree.map(
            lambda a, spec: self._global(np.asarray(a), NamedSharding(self.mesh, spec)), params, param_specs(params)
        )
        dtype = jnp.dtype(lm.dtype)
        cache_shape = (lm.num_layers, num_slots, max_context, lm.num_heads, lm.head_dim)
        cache_sharding = NamedSharding(self.mesh, cache_spec())
        # The programs that touch every slot of this process (the cache's zeros, the decode) run over the whole
        # mesh, or with host_local over this process's rows only (their outputs: the full-mesh arrays' shards).
        lo, hi = self._host_slots if self.host_local else (0, num_slots)
        state_mesh = self._host_mesh if self.host_local else self.mesh
        state_cache = NamedSharding(state_mesh, cache_spec())
        state_shape = (lm.num_layers, hi - lo, *cache_shape[2:])
        zeros = jax.jit(
            lambda: (jnp.zeros(state_shape, dtype), jnp.zeros(state_shape, dtype)),
            out_shardings=(state_cache, state_cache),
        )
        k, v = zeros()
        if self.host_local:
            full = jax.ShapeDtypeStruct(cache_shape, dtype, sharding=cache_sharding)
            k, v = (self._assemble(full, self._by_device(a)) for a in (k, v))
        self.cache = (k, v)
        self.last = self._global(np.zeros(num_slots, np.int32), self.rows)
        self.pos = self._global(np.zeros(num_slots, np.int32), self.rows)
        model = module(lm)
        per_group = self.per_group

        def prefill(params, cache, last, pos, tokens, ints, floats):
            # One prompt into one slot of one slot group; everything here lives on that group's devices.
            # tokens [1, T]; ints [1, 3] = (length, slot in the group, seed); floats [1, 2] = (temperature, top_p).
            length, local, seed = ints[:, 0], ints[:, 1], ints[:, 2].astype(jnp.uint32)
            t = tokens.shape[1]
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], tokens.shape)
            logits, new = model.apply(params, tokens, positions, return_kv=True)  # new: [L, 1, T, H, D] x 2
            at_last = jnp.arange(t)[None, :] == (length - 1)[:, None]  # [1, T]
            row = jnp.where(at_last[..., None], logits, 0.0).sum(axis=1)  # [1, V], exact (one term)
            tok = sample(row, floats[:, 0], floats[:, 1], seed, length, vocab_limit)
            hit = jnp.arange(per_group) == local[0]  # [slots of the group]

            def write(c, n):  # c [L, slots of the group, S, H, D]: the prompt's keys / values at positions < T
                head = jnp.where(hit[None, :, None, None, None], n.astype(c.dtype), c[:, :, :t])
                return jax.lax.dynamic_update_slice(c, head, (0,) * c.ndim)

            cache = tuple(write(c, n) for c, n in zip(cache, new))
            return cache, jnp.where(hit, tok[0], last), jnp.where(hit, length[0], pos), tok

        def decode(params, cache, last, pos, active, seeds, floats):
            # active, seeds [S]; floats [S, 2] = (temperature, top_p): split over "data" like the slots.
            positions = jnp.minimum(pos, max_context - 1)
            logits, cache = model.apply(params, last[:, None], positions[:, None], cache)
            toks = sample(logits[:, 0], floats[:, 0], floats[:, 1], seeds.astype(jnp.uint32), pos + 1, vocab_limit)
            return cache, jnp.where(active, toks, last), jnp.where(active, pos + 1, pos), toks

        rows = NamedSharding(state_mesh, PartitionSpec(DATA_AXIS))
        if self.host_local:  # the decode's weights: views of the full-mesh weights' shards on this process
            self._host_params = jax.tree.map(lambda a: self._view(a, state_mesh), self.params)
        self._decode_rows = rows
        state_shardings = ((state_cache, state_cache), rows, rows)
        self._decode = jax.jit(decode, donate_argnums=(1,), out_shardings=(*state_shardings, rows))
        # A prefill runs on the devices of its slot group only (a [1, model] sub-mesh): no padding rows for the
        # other groups, and only the group's own all-reduces. Its inputs are views of the full-mesh arrays' shards
        # on those devices and its outputs become those shards again (no copy: see _run_on_group).
        self._groups: list[dict[str, Any]] = []
        for g in range(self.groups):
            sub = Mesh(self.mesh.devices[g : g + 1], (DATA_AXIS, MODEL_AXIS))
            local = any(d.process_index == here for d in sub.devices.flat)
            group_cache = NamedSharding(sub, cache_spec())
            group_rows = NamedSharding(sub, PartitionSpec(DATA_AXIS))
            entry: dict[str, Any] = {
                "mesh": sub,
                "devices": list(sub.devices.flat),
                "cache": group_cache,
                "state": NamedSharding(sub, PartitionSpec()),
                "rows": group_rows,
                "replicated": NamedSharding(sub, PartitionSpec()),
            }
            if local:
                entry["params"] = jax.tree.map(lambda a, sub=sub: self._view(a, sub), self.params)
                entry["prefill"] = jax.jit(
                    prefill,
                    donate_argnums=(1,),
                    out_shardings=((group_cache, group_cache), entry["state"], entry["state"], entry["replicated"]),
                )
            self._groups.append(entry)

    @staticmethod
    def _view(arr: Any, sub: Any) -> Any:
        """``arr`` (sharded over the full mesh) as an array over the sub-mesh ``sub``, from its shards there (no copy).

        Valid for arrays whose partition does not split the ``"data"`` axis (the weights): every device of the
        sub-mesh holds the same block it holds in the full mesh.
        """
        from jax.sharding import NamedSharding

        return ModelRunner._sub_array(ModelRunner._by_device(arr), arr.shape, NamedSharding(sub, arr.sharding.spec))

    @staticmethod
    def _by_device(arr: Any) -> dict[Any, Any]:
        """``arr``'s shards on this process, by device (single-device arrays: no copy)."""
        return {s.device: s.data for s in arr.addressable_shards}

    @staticmethod
    def _sub_array(by_device: dict[Any, Any], shape: tuple[int, ...], sharding: Any) -> Any:
        """The shards ``by_device`` on ``sharding``'s devices as one array of ``shape`` over them (no copy)."""
        import jax

        devs = [d for d in sharding.mesh.devices.flat if d in by_device]
        return jax.make_array_from_single_device_arrays(shape, sharding, [by_device[d] for d in devs])

    def _assemble(self, like: Any, by_device: dict[Any, Any]) -> Any:
        """The full-mesh array of ``like``'s shape and sharding whose shards here are ``by_device`` (no copy)."""
        import jax

        return jax.make_array_from_single_device_arrays(
            like.shape, like.sharding, [by_device[d] for d in self._local_devices]
        )

    def _host_state(self) -> tuple[Any, ...]:
        """The decode's inputs with host_local: weights, cache, last token and position over this process's rows."""
        from jax.sharding import NamedSharding

        lo, hi = self._host_slots

        def view(arr: Any, axis: int) -> Any:  # axis: the slot axis (split over "data")
            shape = (*arr.shape[:axis], hi - lo, *arr.shape[axis + 1 :])
            return self._sub_array(self._by_device(arr), shape, NamedSharding(self._host_mesh, arr.sharding.spec))

        cache = (view(self.cache[0], 1), view(self.cache[1], 1))
        return self._host_params, cache, view(self.last, 0), view(self.pos, 0)

    def _global(self, arr: np.ndarray, sharding: Any = None) -> Any:
        import jax

        sharding = self.replicated if sharding is None else sharding
        return jax.make_array_from_callback(arr.shape, sharding, lambda idx: arr[idx])

    @staticmethod
    def _local(arr: Any) -> np.ndarray:
        """The rows of a row-split array that this process holds; -1 in the rows other processes hold."""
        out = np.full(arr.shape, -1, np.int32)
        for shard in arr.addressable_shards:
            out[shard.index] = np.asarray(shard.data)
        return out

    def group_of(self, slot: int) -> int:
        return slot // self.per_group

    def run_prefills(self, prefills: tuple[Prefill, ...]) -> tuple[int, ...]:
        """First tokens of ``prefills`` (-1 for those whose slot group has no device in this process).

        Each prefill is one compiled program on its slot group's devices;
        programs of different groups are dispatched without waiting for each
        other, so they run at the same time on their own devices.
        """
        firsts = [-1] * len(prefills)
        pending = []
        for i, p in enumerate(prefills):
            g = self.group_of(p.slot)
            if g in self.local_groups:
                pending.append((i, self._prefill_on_group(g, p)))
        for i, tok in pending:
            firsts[i] = int(np.asarray(tok.addressable_shards[0].data)[0])
        return tuple(firsts)

    def _prefill_on_group(self, g: int, p: Prefill) -> Any:
        """Runs ``p`` on group ``g``'s devices; the state's shards there are replaced in place. Returns the token."""
        grp = self._groups[g]
        # The shards of the full-mesh state on this process's devices (taken before the call donates those of
        # the group's devices), and views of those on the group's devices.
        state = (self.cache[0], self.cache[1], self.last, self.pos)
        shards = [self._by_device(a) for a in state]
        lm = self.lm
        group_cache_shape = (lm.num_layers, self.per_group, self.max_context, lm.num_heads, lm.head_dim)
        shapes = (group_cache_shape, group_cache_shape, (self.per_group,), (self.per_group,))
        kinds = (grp["cache"], grp["cache"], grp["state"], grp["state"])
        views = [self._sub_array(by_dev, shape, sharding) for by_dev, shape, sharding in zip(shards, shapes, kinds)]
        tokens = np.zeros((1, p.bucket), np.int32)
        tokens[0, : len(p.tokens)] = p.tokens
        ints = np.array([[len(p.tokens), p.slot - g * self.per_group, p.seed & 0x7FFFFFFF]], np.int32)
        floats = np.array([[p.temperature, p.top_p]], np.float32)
        rep = grp["replicated"]
        (k, v), last, pos, tok = grp["prefill"](
            grp["params"],
            (views[0], views[1]),
            views[2],
            views[3],
            self._global(tokens, rep),
            self._global(ints, rep),
            self._global(floats, rep),
        )
        outs = (k, v, last, pos)
        full = [self._assemble(a, {**by_dev, **self._by_device(out)}) for a, by_dev, out in zip(state, shards, outs)]
        self.cache, self.last, self.pos = (full[0], full[1]), full[2], full[3]
        return tok

    def run_prefill(self, p: Prefill) -> int:
        return self.run_prefills((p,))[0]

    def run_decode(self, d: Decode) -> np.ndarray:
        """Tokens of every slot (-1 for the slots another process holds)."""
        floats = np.stack([d.temperature, d.top_p], axis=1).astype(np.float32)
        seeds = (np.asarray(d.seeds, np.int64) & 0x7FFFFFFF).astype(np.int32)
        if self.host_local:
            return self._run_host_decode(np.asarray(d.active, bool), seeds, floats)
        self.cache, self.last, self.pos, toks = self._decode(
            self.params,
            self.cache,
            self.last,
            self.pos,
            self._global(np.asarray(d.active, bool), self.rows),
            self._global(seeds, self.rows),
            self._global(floats, self.rows),
        )
        return self._local(toks)

    def _run_host_decode(self, active: np.ndarray, seeds: np.ndarray, floats: np.ndarray) -> np.ndarray:
        """The decode of this process's slots on its own devices; the state's shards are replaced in place."""
        import jax

        lo, hi = self._host_slots
        rows = self._decode_rows
        (k, v), last, pos, toks = self._decode(
            *self._host_state(),
            jax.device_put(active[lo:hi], rows),
            jax.device_put(seeds[lo:hi], rows),
            jax.device_put(floats[lo:hi], rows),
        )
        full = (self.cache[0], self.cache[1], self.last, self.pos)
        k, v, last, pos = (self._assemble(f, self._by_device(a)) for a, f in zip((k, v, last, pos), full))
        self.cache, self.last, self.pos = (k, v), last, pos
        out = np.full(self.num_slots, -1, np.int32)
        out[lo:hi] = np.asarray(toks)
        return out

    def step(self, step: Step) -> StepResult:
        """Runs one engine iteration.

        Call it in every process of the mesh with the same ``step``; with
        :attr:`skip_others` (no collective between processes), only in the
        processes holding the step's slots.

        Tokens of slots held by other processes are -1: :func:`merge_results`
        combines the results of every process.
        """
        t0 = time.perf_counter()
        firsts = self.run_prefills(step.prefills) if step.prefills else ()
        toks = None
        if step.decode is not None:
            if self.skip_others and not any(
                self.group_of(int(s)) in self.local_groups for s in np.flatnonzero(step.decode.active)
            ):
                toks = np.full(self.num_slots, -1, np.int32)
            else:
                toks = self.run_decode(step.decode)
        return StepResult(firsts, toks, time.perf_counter() - t0)

    def warm_up(self, buckets: tuple[int, ...]) -> int:
        """Compiles every program (a prefill per bucket and local slot group, one decode); returns compiles done."""
        before = compile_count()
        for g in sorted(self.local_groups):
            for b in buckets:
                slot = g * self.per_group
                self.run_prefill(Prefill(slot=slot, tokens=(0,), bucket=b, temperature=0.0, top_p=1.0, seed=0))
        n = self.num_slots
        self.run_decode(
            Decode(np.zeros(n, bool), np.zeros(n, np.float32), np.ones(n, np.float32), np.zeros(n, np.uint32))
        )
        return compile_count() - before

    def _first_local_group(self) -> int:
        return min(self.local_groups)

    def compiled_hlo(self, bucket: int | None = None) -> dict[str, str]:
        """The optimized HLO of the decode program and of one prefill program (``bucket``: the smallest here).

        The prefill is that of this process's first slot group (its partition
        ids number the group's devices, see :meth:`program_devices`). Compiles
        them ahead of time (it adds to :func:`compile_count`), so call it at
        set-up or in tests, not while serving.
        """
        import jax

        t = 8 if bucket is None else bucket
        if self.host_local:
            lo, hi = self._host_slots
            n, state = hi - lo, self._host_state()
            put: Any = lambda a: jax.device_put(a, self._decode_rows)
        else:
            n, state = self.num_slots, (self.params, self.cache, self.last, self.pos)
            put = lambda a: self._global(a, self.rows)
        rows = (np.zeros(n, bool), np.zeros(n, np.int32), np.zeros((n, 2), np.float32))
        dec = self._decode.lower(*state, *(put(a) for a in rows)).compile()
        grp = self._groups[self._first_local_group()]
        lm = self.lm
        cache = jax.ShapeDtypeStruct(
            (lm.num_layers, self.per_group, self.max_context, lm.num_heads, lm.head_dim),
            self.cache[0].dtype,
            sharding=grp["cache"],
        )
        slot_state = jax.ShapeDtypeStruct((self.per_group,), np.int32, sharding=grp["state"])
        rep = grp["replicated"]
        inputs = (
            jax.ShapeDtypeStruct((1, t), np.int32, sharding=rep),
            jax.ShapeDtypeStruct((1, 3), np.int32, sharding=rep),
            jax.ShapeDtypeStruct((1, 2), np.float32, sharding=rep),
        )
        pref = grp["prefill"].lower(grp["params"], (cache, cache), slot_state, slot_state, *inputs).compile()
        return {"decode": dec.as_text() or "", "prefill": pref.as_text() or ""}

    def program_devices(self) -> dict[str, list[Any]]:
        """The device of each partition id of the :meth:`compiled_hlo` programs (see :func:`collectives_spanning`)."""
        prefill = self._groups[self._first_local_group()]["devices"]
        decode = (self._host_mesh if self.host_local else self.mesh).devices.flat
        return {"decode": list(decode), "prefill": list(prefill)}

    def collectives_between_hosts(self, bucket: int | None = None) -> list[str]:
        """The collectives of the compiled programs whose devices lie on more than one host (process)."""
        devices = self.program_devices()
        out = []
        for name, text in self.compiled_hlo(bucket).items():
            hosts = [d.process_index for d in devices[name]]
            out += [f"{name}: {line}" for line in collectives_spanning(text, hosts)]
        return out


def merge_results(results: list[StepResult]) -> StepResult:
    """One result from every process's (each knows the tokens of the slots it holds).

    Example:
        >>> a = StepResult((5, -1), np.array([1, -1]), 0.01)
        >>> b = StepResult((-1, 7), np.array([-1, 2]), 0.02)
        >>> m = merge_results([a, b])
        >>> m.prefill_tokens, m.decode_tokens.tolist(), m.device_s
        ((5, 7), [1, 2], 0.02)
    """
    first = results[0]
    prefill = tuple(max(ts) for ts in zip(*(r.prefill_tokens for r in results))) if first.prefill_tokens else ()
    decode = None
    if first.decode_tokens is not None:
        decode = np.max(np.stack([np.asarray(r.decode_tokens) for r in results]), axis=0)
    return StepResult(prefill, decode, max(r.device_s for r in results))
