"""The feeder's options, validated once and passed whole: :class:`FeederOptions` and :class:`Ragged`.

:func:`~rayslice.data.iter_jax_batches` builds one :class:`FeederOptions`
from its keywords (rayslice's own and Ray's ``Dataset.iter_jax_batches``
names alike, see :func:`build_options`) and hands it to the iterator; nothing
below re-reads a keyword. Every check runs here, at construction, without
JAX or Ray, and fails with :class:`~rayslice.errors.InvalidArgument` naming
the parameter, the bad value and what is valid.

Example:
    >>> o = FeederOptions(batch_size=8, ragged="pad", pad_value={"x": -1.0, "id": 0})
    >>> o.ragged, o.pad_value["x"]
    (<Ragged.PAD: 'pad'>, -1.0)
    >>> FeederOptions(batch_size=4.0)
    Traceback (most recent call last):
    ...
    rayslice.errors.InvalidArgument: batch_size=4.0 is not valid: expected an integer >= 1, got float
"""

from __future__ import annotations

import dataclasses
import enum
import numbers
import sys
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from rayslice._validate import (
    check_bool,
    check_callable,
    check_choice,
    check_float,
    check_int,
    check_optional,
    check_str,
    check_str_list,
    fail,
)

__all__ = ["FeederOptions", "Ragged", "RaggedBatchError", "build_options", "check_state"]


def on_device(dtype: np.dtype) -> bool:
    """Whether devices can hold ``dtype``: numbers and bools (incl. ml_dtypes' bfloat16 & co.), not
    strings, objects, datetimes or records."""
    return (
        dtype.kind in "biufc"
        or type(dtype).__module__.startswith("ml_dtypes")
        or getattr(dtype.type, "__module__", "").startswith("ml_dtypes")
    )


class RaggedBatchError(ValueError):
    """The last batch is partial and the policy refuses it (``ragged="raise"``, or an uneven ``"keep"``)."""


class Ragged(str, enum.Enum):
    """What happens to the last, partial batch; strings are accepted in any case.

    Example:
        >>> Ragged.parse("DROP"), Ragged.parse(Ragged.PAD)
        (<Ragged.DROP: 'drop'>, <Ragged.PAD: 'pad'>)
    """

    RAISE = "raise"  # RaggedBatchError naming the rows left, before any partial batch is yielded
    DROP = "drop"  # end at the first step where any host lacks a full batch (Ray: drop_last=True)
    PAD = "pad"  # pad to batch_size with pad_value, plus a mask (Ray: paddings=...)
    KEEP = "keep"  # yield the smaller last batch (Ray's default); it must split evenly over devices

    @classmethod
    def parse(cls, value: object, name: str = "ragged") -> Ragged:
        """A :class:`Ragged` from itself or its string, else InvalidArgument."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                return cls(value.strip().lower())
            except ValueError:
                pass
        raise fail(name, value, "one of " + ", ".join(repr(r.value) for r in cls))

    def __str__(self) -> str:
        return self.value


class _Frozen(dict):
    """A read-only dict that pickles (``MappingProxyType`` does not travel to hosts)."""

    def _refuse(self, *args: object, **kwargs: object) -> None:
        raise TypeError("FeederOptions mappings are read-only")

    __setitem__ = __delitem__ = update = pop = popitem = clear = setdefault = _refuse  # type: ignore[assignment]

    def __reduce__(self) -> tuple:
        return _Frozen, (dict(self),)

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(sorted(self.items(), key=lambda kv: kv[0])))


def _check_dtype(name: str, value: object) -> np.dtype:
    import ml_dtypes  # noqa: F401  registers bfloat16 & co. with numpy (no JAX import)

    if value is None or isinstance(value, bool | numbers.Number):
        raise fail(name, value, "a dtype such as np.float32, jnp.bfloat16 or 'int32'", got_type=True)
    try:
        dtype = np.dtype(value)  # type: ignore[call-overload]
    except TypeError:
        raise fail(name, value, "a dtype such as np.float32, jnp.bfloat16 or 'int32'", got_type=True) from None
    if not on_device(dtype):
        raise fail(name, value, "a numeric or bool dtype (devices hold no strings or objects)")
    return dtype


def _check_dtypes(value: object) -> np.dtype | Mapping[str, np.dtype] | None:
    if value is None:
        return None
    if isinstance(value, Mapping):
        if not all(isinstance(k, str) and k for k in value):
            raise fail("dtypes", value, "a dtype, or a mapping with column names (non-empty strings) as keys")
        return _Frozen({k: _check_dtype(f"dtypes[{k!r}]", v) for k, v in value.items()})
    return _check_dtype("dtypes", value)


def _check_scalar(name: str, value: object) -> Any:
    if isinstance(value, np.generic):
        value = value.item()
    if not isinstance(value, bool | numbers.Number | str | bytes):
        raise fail(name, value, "a scalar (int, float, bool) or a {column: scalar} mapping", got_type=True)
    return value


def _check_pad(name: str, value: object) -> Any:
    if isinstance(value, Mapping):
        if not all(isinstance(k, str) and k for k in value):
            raise fail(name, value, "a scalar, or a mapping with column names (non-empty strings) as keys")
        return _Frozen({k: _check_scalar(f"{name}[{k!r}]", v) for k, v in value.items()})
    return _check_scalar(name, value)


def _check_sharding(value: object) -> Any:
    if value is None:
        return None
    sharding_mod = sys.modules.get("jax.sharding")  # a user who built a sharding has imported JAX
    if sharding_mod is None or not isinstance(value, sharding_mod.NamedSharding):
        raise fail("sharding", value, "a jax.sharding.NamedSharding or None", got_type=True)
    return value


PIPELINES = ("auto", "thread", "sync")
STAGINGS = ("auto", "pinned", "pageable")
ASSEMBLIES = ("auto", "host", "device")


@dataclasses.dataclass(frozen=True, kw_only=True)
class FeederOptions:
    """Everything :func:`~rayslice.data.iter_jax_batches` needs besides its source; frozen, checked once.

    Attributes:
        batch_size: Rows per host per step (global arrays hold ``batch_size x
            jax.process_count()`` rows). Ray's default, 256.
        ragged: The last-batch policy, a :class:`Ragged` or its string.
        pad_value: Fill for ``Ragged.PAD``: one scalar, or ``{column: scalar}``
            naming every device column (host columns default to 0).
        mask_key: Name of the boolean real-row mask under ``Ragged.PAD``;
            ``None``: no mask (Ray's ``paddings`` behaviour).
        sharding: A ``NamedSharding`` splitting the batch dimension; None: the
            mesh set with ``jax.set_mesh``, else 1-D over all devices with
            Auto axes (mixes with ``Mesh(devices, ("data",))``).
        prefetch: Batches kept on device ahead of the consumer (>= 1) when
            the pipeline runs on a thread.
        pipeline: Where host work and transfers run: ``"thread"`` (a
            background thread keeps ``prefetch`` batches on device ahead),
            ``"sync"`` (in the consumer's ``next()``; no thread, no hand-off)
            or ``"auto"`` (default: ``"sync"`` on the CPU platform, where
            ``device_put`` of an aligned host batch is a zero-copy alias and a
            thread only adds hand-off cost, ``"thread"`` on accelerators).
            Ray's ``prefetch_batches=0`` means ``"sync"``. In one process on
            CPU devices, ``"sync"`` transfers up to 8 consecutive small batches
            (4 MiB in all) with one ``device_put`` call.
        staging: How host batches reach accelerators: ``"pinned"`` (through
            JAX ``memory_kind="pinned_host"`` buffers, then an asynchronous
            DMA to the devices), ``"pageable"`` (plain ``device_put``) or
            ``"auto"`` (default: on CUDA devices a batch that is a view of
            Ray's object store goes by DMA straight from the store, which is
            registered with CUDA once per process (at most 64 GiB); every
            other batch as ``"pageable"``, which was as fast as ``"pinned"``
            on an H200 host and ~50x faster on a TPU v5e host, where JAX
            copies numpy into ``pinned_host`` memory at 0.2-0.5 GB/s).
        assemble: Where a batch that spans several source blocks is joined:
            ``"host"`` (each block's rows written into one staging buffer, then
            one transfer), ``"device"`` (each device's rows of each block
            transferred as they are, then joined on the device: one host copy
            fewer; only piece layouts that recur are compiled, at most 16 per
            stream; where layouts do not recur, blocks larger than the batch's
            4 MB chunks are joined on a grid of equal chunks, and blocks of
            at least 4 MB that a grid would cut mostly across their ends are
            sent whole and the batch cut out of them on the device, where
            that sends at most twice its rows and their shapes recur (at most
            16 more per stream); other batches on the host) or ``"auto"``
            (default: ``"device"`` on TPUs, where it reached the full
            ``device_put`` rate on a TPU v5e host against about a third of it
            joined on the host; ``"host"`` elsewhere: on CPU devices an aligned
            staging buffer is aliased, not copied, and on GPUs the device join
            is not measured yet). Columns that ``collate_fn``, a cast or
            ``host_columns`` work on are joined on the host.
        transfer_threads: Threads issuing per-device transfers in parallel
            (0: every device's transfer from the feeder's own thread; None,
            the default: one per local device, at most 8, on accelerators
            with more than one local device, else 0).
        dtypes: One dtype for every device column (as Ray casts), or
            ``{column: dtype}``; cast on the host, refusing lossy int casts.
        columns: Columns to keep (a list; a lone string is refused).
        host_columns: Columns kept as numpy on the host, never sent to devices.
        collate_fn: Called on each exact host batch before casting (Ray's
            ``ArrowBatchCollateFn``/``NumpyBatchCollateFn``/``PandasBatchCollateFn``
            or any ``dict -> dict | ndarray`` callable); rows in = rows out.
        local_shuffle_buffer_size: Rows in a local shuffle buffer (None: off).
        local_shuffle_seed: Seed for it (needed to resume a shuffled stream).
        agree: Agree on per-step row counts across hosts (None: when multi-process).
        agreement_timeout_s: Longest wait for the slowest host at one step.
        agree_window: Steps covered by one agreement exchange.

    Example:
        >>> FeederOptions(columns="id")
        Traceback (most recent call last):
        ...
        rayslice.errors.InvalidArgument: columns='id' is not valid: expected a list of strings, e.g. ['id']
    """

    batch_size: int = 256
    ragged: Ragged = Ragged.RAISE
    pad_value: Any = 0
    mask_key: str | None = "mask"
    sharding: Any = None
    prefetch: int = 2
    pipeline: str = "auto"
    staging: str = "auto"
    assemble: str = "auto"
    transfer_threads: int | None = None
    dtypes: Any = None
    columns: tuple[str, ...] | None = None
    host_columns: tuple[str, ...] = ()
    collate_fn: Callable[[Any], Any] | None = None
    local_shuffle_buffer_size: int | None = None
    local_shuffle_seed: int | None = None
    agree: bool | None = None
    agreement_timeout_s: float = 600.0
    agree_window: int = 8

    def __post_init__(self) -> None:
        put = object.__setattr__
        check_int("batch_size", self.batch_size, minimum=1)
        put(self, "batch_size", int(self.batch_size))
        put(self, "ragged", Ragged.parse(self.ragged))
        put(self, "pad_value", _check_pad("pad_value", self.pad_value))
        put(self, "mask_key", check_optional(check_str, "mask_key", self.mask_key))
        put(self, "sharding", _check_sharding(self.sharding))
        put(self, "prefetch", check_int("prefetch", self.prefetch, minimum=1, maximum=1024))
        put(self, "pipeline", check_choice("pipeline", self.pipeline, PIPELINES))
        put(self, "staging", check_choice("staging", self.staging, STAGINGS))
        put(self, "assemble", check_choice("assemble", self.assemble, ASSEMBLIES))
        put(
            self,
            "transfer_threads",
            check_optional(check_int, "transfer_threads", self.transfer_threads, minimum=0, maximum=64),
        )
        put(self, "dtypes", _check_dtypes(self.dtypes))
        put(self, "columns", check_optional(check_str_list, "columns", self.columns))
        put(self, "host_columns", check_str_list("host_columns", self.host_columns))
        put(self, "collate_fn", check_optional(check_callable, "collate_fn", self.collate_fn))
        put(
            self,
            "local_shuffle_buffer_size",
            check_optional(check_int, "local_shuffle_buffer_size", self.local_shuffle_buffer_size, minimum=1),
        )
        put(
            self,
            "local_shuffle_seed",
            check_optional(check_int, "local_shuffle_seed", self.local_shuffle_seed, minimum=0, maximum=2**63 - 1),
        )
        put(self, "agree", check_optional(check_bool, "agree", self.agree))
        put(
            self,
            "agreement_timeout_s",
            check_float("agreement_timeout_s", self.agreement_timeout_s, minimum=0, exclusive_min=True),
        )
        put(self, "agree_window", check_int("agree_window", self.agree_window, minimum=1, maximum=4096))
        self._check_combinations()

    def _check_combinations(self) -> None:
        if self.local_shuffle_seed is not None and self.local_shuffle_buffer_size is None:
            raise fail(
                "local_shuffle_seed",
                self.local_shuffle_seed,
                "None unless local_shuffle_buffer_size is set (it seeds that shuffle)",
            )
        named = set(self.columns) if self.columns is not None else None
        for what, keys in (
            ("host_columns", self.host_columns),
            ("dtypes", self.dtypes if isinstance(self.dtypes, Mapping) else ()),
            ("pad_value", self.pad_value if isinstance(self.pad_value, Mapping) else ()),
        ):
            if named is not None and set(keys) - named:
                raise fail(
                    what,
                    list(keys) if what != "host_columns" else self.host_columns,
                    f"columns among columns={list(self.columns or ())}; unknown: {sorted(set(keys) - named)}",
                )
        clash = self.mask_key in self.host_columns or (named is not None and self.mask_key in named)
        if self.mask_key is not None and self.ragged is Ragged.PAD and clash:
            raise fail("mask_key", self.mask_key, "a name that is not also a data column")
        if self.assemble == "device" and self.staging == "pinned":
            raise fail(
                "assemble",
                self.assemble,
                "'auto' or 'host' when staging='pinned' (a batch is assembled on the host to stage it)",
            )
        if self.ragged is not Ragged.PAD and self.pad_value != 0:
            raise fail("pad_value", self.pad_value, f"0 (the default) unless ragged='pad' (ragged is {self.ragged})")

    def replace(self, **changes: Any) -> FeederOptions:
        """A copy with ``changes``, validated again."""
        return dataclasses.replace(self, **changes)


def check_state(state: object) -> dict[str, Any]:
    """A resume state (an iterator's ``state()``, possibly through JSON), checked; None: the start.

    Example:
        >>> check_state({"version": 1, "batches": -1, "rows": 0, "finished": False})
        Traceback (most recent call last):
        ...
        rayslice.errors.InvalidArgument: state['batches']=-1 is not valid: expected an integer >= 0
    """
    if state is None:
        return {"version": 1, "batches": 0, "rows": 0, "finished": False}
    if not isinstance(state, Mapping):
        raise fail("state", state, "None or a previous iterator's state() dict", got_type=True)
    unknown = set(state) - {"version", "batches", "rows", "finished"}
    if unknown:
        raise fail("state", state, f"only keys version, batches, rows, finished (unknown: {sorted(map(str, unknown))})")
    version = state.get("version", 1)
    if type(version) is not int or version != 1:  # 1.0 and True are not the format number
        raise fail("state['version']", state.get("version"), "1 (the only state format)")
    return {
        "version": 1,
        "batches": check_int("state['batches']", state.get("batches", 0), minimum=0),
        "rows": check_int("state['rows']", state.get("rows", 0), minimum=0),
        "finished": check_bool("state['finished']", state.get("finished", False)),
    }


def _one_of(name: str, value: Any, ray_name: str, ray_value: Any) -> Any:
    """``value`` or its Ray alias; both given and different is an error."""
    if value is not None and ray_value is not None and value != ray_value:
        raise fail(ray_name, ray_value, f"the same as {name}={value!r}, or left out (they are one setting)")
    return value if value is not None else ray_value


def build_options(
    *,
    batch_size: int | None = None,
    ragged: Ragged | str | None = None,
    pad_value: Any = None,
    mask_key: str | None = None,
    sharding: Any = None,
    prefetch: int | None = None,
    pipeline: str | None = None,
    staging: str | None = None,
    assemble: str | None = None,
    transfer_threads: int | None = None,
    dtypes: Any = None,
    columns: Any = None,
    host_columns: Any = None,
    collate_fn: Callable[[Any], Any] | None = None,
    local_shuffle_buffer_size: int | None = None,
    local_shuffle_seed: int | None = None,
    agree: bool | None = None,
    agreement_timeout_s: float | None = None,
    agree_window: int | None = None,
    drop_last: bool | None = None,
    paddings: Any = None,
    prefetch_batches: int | None = None,
    synchronize_batches: bool | None = None,
) -> FeederOptions:
    """One :class:`FeederOptions` from :func:`iter_jax_batches`'s keywords (None: not given).

    Ray's names map onto rayslice's: ``drop_last=True`` is ``ragged="drop"``;
    ``paddings`` is ``ragged="pad"`` with that ``pad_value`` and, as in Ray,
    no mask unless ``mask_key`` is given; ``prefetch_batches`` is
    ``prefetch``, and ``prefetch_batches=0`` (Ray: no prefetching) is
    ``pipeline="sync"``; ``synchronize_batches`` is ``agree``. When
    ``ragged`` is not given and any of Ray's own arguments is
    (``drop_last``, ``paddings``, ``prefetch_batches``, ``collate_fn``,
    ``synchronize_batches``, ``local_shuffle_*``), the last batch follows
    Ray's default (``Ragged.KEEP``); otherwise rayslice's (``Ragged.RAISE``).

    Example:
        >>> build_options(batch_size=8, drop_last=False).ragged
        <Ragged.KEEP: 'keep'>
        >>> build_options(batch_size=8).ragged, build_options(paddings=0).mask_key
        (<Ragged.RAISE: 'raise'>, None)
        >>> build_options(prefetch_batches=0).pipeline
        'sync'
        >>> build_options(drop_last=True, ragged="pad")
        Traceback (most recent call last):
        ...
        rayslice.errors.InvalidArgument: drop_last=True is not valid: expected False or left out when ragged='pad'
    """
    if drop_last is not None:
        check_bool("drop_last", drop_last)
    prefetch_alias = prefetch_batches
    if prefetch_batches is not None:
        check_int("prefetch_batches", prefetch_batches, minimum=0, maximum=1024)
        if prefetch_batches == 0:  # Ray: no prefetching at all
            if pipeline not in (None, "sync"):
                raise fail("prefetch_batches", 0, f"> 0 or left out when pipeline={pipeline!r} (0 means 'sync')")
            pipeline, prefetch_alias = "sync", None
    if paddings is not None:
        paddings = _check_pad("paddings", paddings)
    policy = Ragged.parse(ragged) if ragged is not None else None
    if drop_last and policy not in (None, Ragged.DROP):
        raise fail("drop_last", drop_last, f"False or left out when ragged={policy.value!r}")
    if paddings is not None and not drop_last and policy not in (None, Ragged.PAD):
        raise fail("paddings", paddings, f"None when ragged={policy.value!r} (paddings means ragged='pad')")
    ray_style = any(
        v is not None
        for v in (
            drop_last,
            paddings,
            prefetch_batches,
            collate_fn,
            synchronize_batches,
            local_shuffle_buffer_size,
            local_shuffle_seed,
        )
    )
    if drop_last:  # as in Ray, dropping wins over paddings
        policy, paddings = Ragged.DROP, None
    fill = _one_of("pad_value", pad_value, "paddings", paddings)
    if policy is None:
        policy = Ragged.PAD if fill is not None else Ragged.KEEP if ray_style else Ragged.RAISE
    if mask_key is None and not (paddings is not None and pad_value is None and ragged is None):
        mask_key = "mask"  # Ray's paddings alone yield no mask, like Ray; rayslice's spelling always has one
    given = {
        "batch_size": batch_size,
        "pad_value": fill,
        "sharding": sharding,
        "prefetch": _one_of("prefetch", prefetch, "prefetch_batches", prefetch_alias),
        "dtypes": dtypes,
        "pipeline": pipeline,
        "staging": staging,
        "assemble": assemble,
        "transfer_threads": transfer_threads,
        "columns": columns,
        "host_columns": host_columns,
        "collate_fn": collate_fn,
        "local_shuffle_buffer_size": local_shuffle_buffer_size,
        "local_shuffle_seed": local_shuffle_seed,
        "agree": _one_of("agree", agree, "synchronize_batches", synchronize_batches),
        "agreement_timeout_s": agreement_timeout_s,
        "agree_window": agree_window,
    }
    return FeederOptions(ragged=policy, mask_key=mask_key, **{k: v for k, v in given.items() if v is not None})
