"""Configuration for :class:`~rayslice.train.JaxTrainer`, in Ray Train's vocabulary.

Every config is a frozen dataclass validated on construction: a bad value
raises :class:`~rayslice.errors.InvalidArgument` (a ``TypeError`` and a
``ValueError``) naming the parameter, the bad value and what is valid.
Ray Train's field names work (``num_workers``, ``resources_per_worker``,
``placement_strategy``, ``max_preemption_failures``,
``checkpoint_score_attribute``, ``worker_runtime_env``); rayslice's own
(``num_slices``, ``resources_per_host``, ``max_preemptions``) stay.

Example:
    >>> sc = ScalingConfig(topology="2x2x2", accelerator_type="TPU-V4", num_workers=4)
    >>> sc.num_slices, sc.num_workers, str(sc.request)
    (2, 4, '2 x v4 2x2x2 (8 chips, 2 hosts x 4)')
    >>> RunConfig().name is None  # each fit() picks a fresh run name
    True
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rayslice._validate import (
    check_bool,
    check_choice,
    check_float,
    check_instance,
    check_int,
    check_optional,
    check_resources,
    check_str,
    fail,
)
from rayslice.request import SliceRequest
from rayslice.topology import Topology
from rayslice.train.checkpoint import checkpoints_dir, run_dir

__all__ = ["CheckpointConfig", "FailureConfig", "RunConfig", "ScalingConfig", "UserCallback"]

PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_SPREAD", "STRICT_PACK")


def cast_int(value: int | None) -> int:
    """``value`` once validation filled it in (never None after ``__post_init__``)."""
    assert value is not None
    return value


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScalingConfig:
    """Where to train: one worker per host of ``num_slices`` whole slices.

    The request (:attr:`request`, a :class:`~rayslice.request.SliceRequest`)
    is built once here and passed down whole to the reservation.

    Args:
        topology: Slice shape, e.g. "2x2x2" (or a ``Topology`` / ``SliceRequest``).
        accelerator_type: Generation, e.g. "TPU-V4" (not needed with a ``Topology``).
        num_workers: Ray Train's count: hosts over all slices. Must equal
            hosts per slice x ``num_slices``; alone, it sets ``num_slices``.
        use_tpu: Must be True: rayslice trains on slices (Ray Train's flag).
        num_slices: Slices, all reserved together (multi-slice: one global mesh).
            Default: ``num_workers`` / hosts per slice, else 1.
        chips_per_host: Host layout for v5e/v6e "2x4".
        resources_per_host: Extra Ray resources per host bundle (e.g. ``{"CPU": 1}``).
        resources_per_worker: Ray Train's name for the same, with an optional
            ``"TPU"`` entry that must equal the chips per host.
        placement_strategy: Ray's placement strategy name. Each host's bundle
            is pinned to its physical host by label, so "PACK", "SPREAD" and
            "STRICT_SPREAD" place alike; "STRICT_PACK" (one node) is refused
            for multi-host slices.
        reservation_timeout_s: Longest wait for free slices, per attempt.
        init_timeout_s: Deadline for all processes to start and form the JAX mesh.
        min_slices: Elastic training (see ``docs/elastic.md``): the fewest
            slices to train on. The run starts on as many whole slices as are
            free (at least ``min_slices``, at most ``num_slices``, waiting up
            to ``reservation_timeout_s`` for ``min_slices``), goes on at once
            on the survivors when a slice is lost, and grows back at a
            checkpoint boundary when slices are free again. Default:
            ``num_slices`` (not elastic).
        regrow_every_s: Least seconds between a resize and a grow-back.
        keep_global_batch: True (default): the global batch stays constant;
            on ``k`` of ``num_slices`` slices the function runs
            ``get_context().grad_accum_steps`` (= ``num_slices / k``)
            micro-steps of the same per-host batch per step, so only sizes
            dividing ``num_slices`` are taken. False: every size from
            ``min_slices`` up; the global batch shrinks with the world.
        mesh: The full-size mesh the function builds, ``{axis: size}`` (one
            size may be -1), outermost (across slices) axis first. An elastic
            run shrinks only that first axis (``get_context().mesh_shape``
            has the shape for the current size), so the other axes must fit
            in one slice. None: one data-parallel axis over every device.

    Example:
        >>> sc = ScalingConfig(topology="2x2x2", accelerator_type="TPU-V4", num_slices=4, min_slices=2)
        >>> sc.elastic, sc.elastic_sizes
        (True, (2, 4))
        >>> ScalingConfig(topology="2x2x2", accelerator_type="TPU-V4", num_workers=3)
        Traceback (most recent call last):
        ...
        rayslice.errors.InvalidArgument: num_workers=3 is not valid: expected a multiple of 2 (hosts per v4 2x2x2 slice)
    """

    topology: str | Topology | SliceRequest | None = None
    accelerator_type: str | None = None
    num_workers: int | None = None
    use_tpu: bool = True
    num_slices: int | None = None
    chips_per_host: int | None = None
    resources_per_host: Mapping[str, float] | None = None
    resources_per_worker: Mapping[str, float] | None = None
    placement_strategy: str = "PACK"
    reservation_timeout_s: float = 600.0
    init_timeout_s: float = 180.0
    min_slices: int | None = None
    regrow_every_s: float = 60.0
    keep_global_batch: bool = True
    mesh: Mapping[str, int] | None = None
    _request: SliceRequest = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.use_tpu, bool) or not self.use_tpu:
            raise fail("use_tpu", self.use_tpu, "True (rayslice trains on whole TPU slices)")
        if self.topology is None:
            raise fail(
                "topology",
                None,
                "a slice shape such as '2x2x2' (with accelerator_type='TPU-V4'), a Topology or a SliceRequest",
            )
        if not isinstance(self.topology, str | Topology | SliceRequest):
            raise fail(
                "topology", self.topology, "a shape string such as '2x2x2', a Topology or a SliceRequest", got_type=True
            )
        check_optional(check_str, "accelerator_type", self.accelerator_type)
        check_optional(check_int, "num_slices", self.num_slices, minimum=1, maximum=4096)
        check_optional(check_int, "num_workers", self.num_workers, minimum=1)
        check_optional(check_int, "chips_per_host", self.chips_per_host, minimum=1)
        check_choice("placement_strategy", self.placement_strategy, PLACEMENT_STRATEGIES)
        for name in ("reservation_timeout_s", "init_timeout_s"):
            object.__setattr__(self, name, check_float(name, getattr(self, name), minimum=0, exclusive_min=True))
        extra = self._extra_resources()
        if isinstance(self.topology, SliceRequest):
            base = SliceRequest.parse(self.topology, resources_per_host=extra or None)
            topo = base.topology
        else:
            if isinstance(self.topology, str) and self.accelerator_type is None:
                raise fail(
                    "accelerator_type", None, "a TPU generation such as 'TPU-V4' or 'v6e' with a topology string"
                )
            topo = (
                self.topology
                if isinstance(self.topology, Topology)
                else Topology.parse(self.topology, str(self.accelerator_type), chips_per_host=self.chips_per_host)
            )
            base = None
        if not isinstance(self.topology, str) and self.chips_per_host not in (None, topo.chips_per_host):
            raise fail(
                "chips_per_host",
                self.chips_per_host,
                f"{topo.chips_per_host} (fixed by the {type(self.topology).__name__} given) or None",
            )
        hosts = topo.num_hosts
        slices = self.num_slices if self.num_slices is not None else (base.num_slices if base else None)
        if self.num_workers is not None:
            if slices is not None and self.num_workers != hosts * slices:
                raise fail(
                    "num_workers",
                    self.num_workers,
                    f"{hosts * slices} = {hosts} hosts per {topo.generation} {topo.name} slice "
                    f"x num_slices={slices} (one worker per host)",
                )
            if self.num_workers % hosts:
                raise fail(
                    "num_workers",
                    self.num_workers,
                    f"a multiple of {hosts} (hosts per {topo.generation} {topo.name} slice)",
                )
            slices = self.num_workers // hosts
        slices = 1 if slices is None else slices
        if self.placement_strategy == "STRICT_PACK" and hosts * slices > 1:
            raise fail(
                "placement_strategy",
                "STRICT_PACK",
                f"'PACK', 'SPREAD' or 'STRICT_SPREAD': {hosts * slices} hosts cannot share one node",
            )
        request = (
            SliceRequest.parse(base, num_slices=slices)
            if base is not None
            else SliceRequest.parse(topo, num_slices=slices, resources_per_host=extra)
        )
        object.__setattr__(self, "_request", request)
        object.__setattr__(self, "num_slices", slices)
        object.__setattr__(self, "num_workers", hosts * slices)
        if self.chips_per_host is None:
            object.__setattr__(self, "chips_per_host", topo.chips_per_host)
        self._check_tpu()
        self._check_elastic(slices, topo)

    def _check_elastic(self, slices: int, topo: Topology) -> None:
        """Validates the elastic fields (before any reservation)."""
        from rayslice.train.elastic import check_mesh, elastic_sizes

        if isinstance(self.min_slices, int) and not isinstance(self.min_slices, bool) and self.min_slices > slices:
            raise fail("min_slices", self.min_slices, f"an integer from 1 to num_slices={slices}")
        low = check_optional(check_int, "min_slices", self.min_slices, minimum=1, maximum=slices)
        object.__setattr__(self, "min_slices", slices if low is None else low)
        object.__setattr__(
            self, "regrow_every_s", check_float("regrow_every_s", self.regrow_every_s, minimum=0, maximum=86400)
        )
        check_bool("keep_global_batch", self.keep_global_batch)
        sizes = elastic_sizes(slices, cast_int(self.min_slices), self.keep_global_batch)
        if self.elastic and len(sizes) < 2:
            raise fail(
                "min_slices",
                self.min_slices,
                f"a value whose range {self.min_slices}..{slices} holds a divisor of num_slices={slices} "
                f"below it (the global batch is kept by num_slices / slices accumulation steps), "
                "or keep_global_batch=False",
            )
        if self.mesh is not None:
            full = check_mesh(self.mesh, slices, topo.num_devices, self.elastic)
            object.__setattr__(self, "mesh", full)

    @property
    def elastic(self) -> bool:
        """True when the run may train on fewer slices than ``num_slices`` (``min_slices < num_slices``)."""
        return cast_int(self.min_slices) < cast_int(self.num_slices)

    @property
    def elastic_sizes(self) -> tuple[int, ...]:
        """The slice counts the run may train on, ascending (only ``num_slices`` when not elastic)."""
        from rayslice.train.elastic import elastic_sizes

        return elastic_sizes(cast_int(self.num_slices), cast_int(self.min_slices), self.keep_global_batch)

    def _extra_resources(self) -> dict[str, float]:
        per_host = check_resources("resources_per_host", self.resources_per_host, forbidden=("TPU",))
        if self.resources_per_worker is None:
            return per_host
        if self.resources_per_host is not None:
            raise fail(
                "resources_per_worker",
                self.resources_per_worker,
                "None when resources_per_host is given (they are two names for the same thing)",
            )
        per_worker = check_resources("resources_per_worker", self.resources_per_worker)
        return {k: v for k, v in per_worker.items() if k != "TPU"}

    @property
    def request(self) -> SliceRequest:
        """The slice request, built once from these arguments."""
        return self._request

    @property
    def topology_info(self) -> Topology:
        """The parsed topology of one slice."""
        return self._request.topology

    @property
    def hosts_per_slice(self) -> int:
        return self._request.hosts_per_slice

    def _check_tpu(self) -> None:
        """Checks a ``"TPU"`` entry of ``resources_per_worker`` against the chips per host."""
        tpu = (self.resources_per_worker or {}).get("TPU")
        if tpu is not None and float(tpu) != float(self.topology_info.chips_per_host):
            raise fail(
                "resources_per_worker['TPU']",
                tpu,
                f"{self.topology_info.chips_per_host} (the chips of one {self.topology_info.generation} "
                f"{self.topology_info.name} host) or no 'TPU' entry",
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Which checkpoints to keep, and how to save them.

    Args:
        num_to_keep: Complete checkpoints kept on storage (None: all). With a
            score attribute the best ones are kept, otherwise the newest.
        checkpoint_score_attribute: A numeric metric reported with each
            checkpoint that ranks them (Ray's name).
        checkpoint_score_order: "max" or "min": which scores are best.
        async_save: Save arrays in the background: the next step does not wait for storage.
        ram_every_steps: The RAM tier (``rayslice.train.ramtier``): a pytree
            reported at a step that is a multiple of this is kept in host
            memory, on its host's node and as a replica on a buddy host (of
            another slice, or the next host of a one-slice run), and a restart
            restores from it when every shard is still reachable and it is at
            least as new as the newest storage checkpoint. None (default): off.
        storage_every_steps: Persistent (Orbax) cadence of reported pytrees:
            only steps that are a multiple of this go to storage (emergency
            saves of a preemption notice always do). None (default): every
            reported pytree goes to storage. Directory checkpoints
            (``Checkpoint.from_directory``) always go to storage.

    With either cadence set, a loop can pass its state at every step and let
    the config decide, or ask ``rayslice.train.save_requested()`` (True when
    the step about to be reported needs a checkpoint for any reason).

    Example:
        >>> CheckpointConfig(num_to_keep=2, checkpoint_score_attribute="loss", checkpoint_score_order="min").num_to_keep
        2
        >>> cc = CheckpointConfig(ram_every_steps=10, storage_every_steps=100)
        >>> [s for s in (10, 15, 100) if cc.ram_step(s)], [s for s in (10, 15, 100) if cc.storage_step(s)]
        ([10, 100], [100])
        >>> CheckpointConfig(ram_every_steps=0)
        Traceback (most recent call last):
        ...
        rayslice.errors.InvalidArgument: ram_every_steps=0 is not valid: expected an integer >= 1
    """

    num_to_keep: int | None = None
    checkpoint_score_attribute: str | None = None
    checkpoint_score_order: str = "max"
    async_save: bool = True
    ram_every_steps: int | None = None
    storage_every_steps: int | None = None

    def ram_step(self, step: int) -> bool:
        """Whether a pytree reported at ``step`` is kept in the RAM tier."""
        return self.ram_every_steps is not None and step % self.ram_every_steps == 0

    def storage_step(self, step: int) -> bool:
        """Whether a pytree reported at ``step`` goes to storage (an emergency save always does)."""
        return self.storage_every_steps is None or step % self.storage_every_steps == 0

    def __post_init__(self) -> None:
        check_optional(check_int, "ram_every_steps", self.ram_every_steps, minimum=1)
        check_optional(check_int, "storage_every_steps", self.storage_every_steps, minimum=1)
        check_optional(check_int, "num_to_keep", self.num_to_keep, minimum=1)
        check_optional(check_str, "checkpoint_score_attribute", self.checkpoint_score_attribute)
        check_choice("checkpoint_score_order", self.checkpoint_score_order, ("max", "min"))
        check_bool("async_save", self.async_save)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FailureConfig:
    """Separate restart budgets for lost hosts and for errors in user code.

    Args:
        max_failures: Restarts allowed after an error in user code (0: none, -1: unlimited).
        max_preemptions: Restarts allowed after a host/slice is lost (-1:
            unlimited; default 10).
        max_preemption_failures: Ray Train's name for ``max_preemptions``
            (give one of the two).
        heartbeat_timeout_s: A host whose heartbeat (published by its process
            every ``min(0.25, heartbeat_timeout_s / 4)`` s) stops for this long
            is lost: the attempt ends as a preemption at once, without waiting
            for Ray to declare its node dead (15 s or more with Ray's
            production health checks). The beat comes from a Python thread,
            so a live process holding its GIL (a long C call, a garbage
            collection, an oversubscribed machine) goes silent too: a silent
            host whose machine still answers (a TCP connect to its Ray
            node's raylet, see ``rayslice.train.liveness``) is given up to
            ``LIVE_HOST_GRACE_S`` (10 s) before it is taken for lost.
        step_timeout_s: A host that is alive but completes no step for this
            long is hung (a stuck collective): the attempt ends with outcome
            ``timeout``, counted against ``max_failures``. None (default): not
            checked. The first step of each attempt (compile, restore) and the
            final checkpoint wait are not timed.
        preemption_notices: Watch for preemption notices on every host
            (SIGTERM, the GCE metadata server, Ray node draining) and turn
            one into an emergency checkpoint at the next step boundary that
            every host agrees on, then a clean stop and a restart from that
            step (see ``rayslice.train.notice``). Default True.
        notice_poll_s: Seconds between polls of the GCE metadata server and
            of Ray's draining nodes.
        warm_spares: Keep one pre-started gang process (``import jax`` done,
            no chips held) on each host of a free slice of the run's shape,
            which the next attempt adopts instead of starting cold
            (``rayslice.warm.WarmPool``): a restart on spare capacity skips
            process start and imports. Default True.

    Example:
        >>> FailureConfig(max_preemption_failures=3).max_preemptions
        3
        >>> FailureConfig(step_timeout_s=30).step_timeout_s
        30.0
    """

    max_failures: int = 0
    max_preemptions: int | None = None
    max_preemption_failures: int | None = None
    heartbeat_timeout_s: float = 1.0
    step_timeout_s: float | None = None
    preemption_notices: bool = True
    notice_poll_s: float = 1.0
    warm_spares: bool = True

    def __post_init__(self) -> None:
        check_int("max_failures", self.max_failures, minimum=-1)
        check_bool("preemption_notices", self.preemption_notices)
        check_bool("warm_spares", self.warm_spares)
        object.__setattr__(
            self, "notice_poll_s", check_float("notice_poll_s", self.notice_poll_s, minimum=0.05, maximum=600)
        )
        check_optional(check_int, "max_preemptions", self.max_preemptions, minimum=-1)
        check_optional(check_int, "max_preemption_failures", self.max_preemption_failures, minimum=-1)
        a, b = self.max_preemptions, self.max_preemption_failures
        if a is not None and b is not None and a != b:
            raise fail("max_preemption_failures", b, f"{a} (the max_preemptions given) or None: they are one budget")
        value = 10 if a is None and b is None else (a if a is not None else b)
        object.__setattr__(
            self,
            "heartbeat_timeout_s",
            check_float("heartbeat_timeout_s", self.heartbeat_timeout_s, minimum=0.2, maximum=600),
        )
        object.__setattr__(
            self,
            "step_timeout_s",
            check_optional(check_float, "step_timeout_s", self.step_timeout_s, minimum=0, exclusive_min=True),
        )
        object.__setattr__(self, "max_preemptions", value)
        object.__setattr__(self, "max_preemption_failures", value)


class UserCallback:
    """Ray Train's callback shape: override the hooks you need (both run in the driver).

    Pass instances in ``RunConfig(callbacks=[...])``, alongside plain
    callables (which get rank 0's ``{"step", "metrics", "attempt"}`` dict).

    Example:
        >>> class Losses(UserCallback):
        ...     def __init__(self):
        ...         self.seen = []
        ...     def after_report(self, run_context, metrics, checkpoint):
        ...         self.seen.append(metrics[0]["loss"])  # one dict per worker, rank order
    """

    def after_report(self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Any) -> None:
        """After every worker reported a step: their metrics (``metrics[rank]``) and the step's checkpoint."""

    def after_exception(self, run_context: Any, worker_exceptions: dict[int, BaseException]) -> None:
        """After an attempt failed: the exception by world rank (``-1`` when no rank is known)."""


_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_SCHEMES = ("gs://", "s3://", "file://")


def _check_callback(i: int, cb: object) -> object:
    if (
        isinstance(cb, UserCallback)
        or callable(getattr(cb, "after_report", None))
        or callable(getattr(cb, "after_exception", None))
    ):
        return cb
    if callable(cb):
        return cb
    raise fail(
        f"callbacks[{i}]",
        cb,
        "a callable taking rank 0's report dict, or a UserCallback "
        "(an object with after_report(run_context, metrics, checkpoint))",
        got_type=True,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Where a run keeps its checkpoints, and how it handles failures.

    Args:
        name: Run name (a directory under ``storage_path``). None: every
            ``fit()`` starts a fresh run with a new unique name. Resuming is
            explicit: pass the name of the run to continue.
        storage_path: Storage every host can reach (on real slices a shared or
            cloud path: ``gs://``, ``s3://``, ``file://``; on the simulator a
            local directory). None: ``~/rayslice_results``.
        storage_filesystem: Only None (or a local ``pyarrow.fs.LocalFileSystem``):
            rayslice reaches storage through Orbax and ``etils.epath``; give a
            URL in ``storage_path`` instead.
        checkpoint_config: Which checkpoints to keep (None: defaults).
        failure_config: Restart budgets (None: defaults).
        worker_runtime_env: A Ray runtime environment for the worker processes.
        progress: Show a live progress line in the driver.
        callbacks: Called in the driver: plain callables with rank 0's
            ``{"step", "metrics", "attempt"}`` per step, and
            :class:`UserCallback`-shaped objects (``after_report``,
            ``after_exception``).
        compilation_cache: JAX's persistent compilation cache, on for every
            attempt so that a restart loads its programs instead of compiling
            them again. True (default): ``<storage_path>/<name>/compile_cache``,
            shared by every host and attempt of the run (JAX writes entries
            from process 0 only and every host reads them, so the directory
            must be shared; a node-local disk would leave the hosts of the
            next attempt, often other machines, with nothing). A string: that
            directory instead (e.g. one bucket shared by many runs of the same
            model). False: off. A cache that cannot be used is reported once
            and never fails the run.

    Example:
        >>> RunConfig(name="a b")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        rayslice.errors.InvalidArgument: name='a b' is not valid: expected letters, digits, '_', '-', '.' ...
    """

    name: str | None = None
    storage_path: str | None = "~/rayslice_results"
    storage_filesystem: Any = None
    checkpoint_config: CheckpointConfig | None = dataclasses.field(default_factory=CheckpointConfig)
    failure_config: FailureConfig | None = dataclasses.field(default_factory=FailureConfig)
    worker_runtime_env: Mapping[str, Any] | None = None
    progress: bool = True
    callbacks: Sequence[Callable[[dict[str, Any]], None] | UserCallback] | None = ()
    compilation_cache: bool | str = True

    def __post_init__(self) -> None:
        if self.name is not None and (not isinstance(self.name, str) or not _NAME.match(self.name)):
            raise fail(
                "name",
                self.name,
                "letters, digits, '_', '-', '.' (starting with a letter or digit), or None for a fresh name",
            )
        if self.storage_path is None:
            object.__setattr__(self, "storage_path", "~/rayslice_results")
        import os

        if isinstance(self.storage_path, os.PathLike):
            object.__setattr__(self, "storage_path", os.fspath(self.storage_path))
        path = check_str("storage_path", self.storage_path)
        if "://" in path and not path.startswith(_SCHEMES):
            raise fail("storage_path", path, "a local path or a gs://, s3:// or file:// URL")
        if self.storage_filesystem is not None and type(self.storage_filesystem).__name__ != "LocalFileSystem":
            raise fail(
                "storage_filesystem",
                self.storage_filesystem,
                "None: custom filesystems are not supported (rayslice writes through Orbax/etils.epath); "
                "give a gs://, s3:// or file:// URL as storage_path",
            )
        if self.checkpoint_config is None:
            object.__setattr__(self, "checkpoint_config", CheckpointConfig())
        if self.failure_config is None:
            object.__setattr__(self, "failure_config", FailureConfig())
        check_instance(
            "checkpoint_config", self.checkpoint_config, CheckpointConfig, "a rayslice.train.CheckpointConfig"
        )
        check_instance("failure_config", self.failure_config, FailureConfig, "a rayslice.train.FailureConfig")
        if self.worker_runtime_env is not None and not isinstance(self.worker_runtime_env, Mapping):
            raise fail(
                "worker_runtime_env", self.worker_runtime_env, "a dict (a Ray runtime_env) or None", got_type=True
            )
        check_bool("progress", self.progress)
        callbacks = () if self.callbacks is None else self.callbacks
        if isinstance(callbacks, str | bytes | Mapping) or not isinstance(callbacks, Sequence):
            raise fail("callbacks", callbacks, "a list of callables or UserCallbacks", got_type=True)
        object.__setattr__(self, "callbacks", tuple(_check_callback(i, cb) for i, cb in enumerate(callbacks)))
        if not isinstance(self.compilation_cache, bool):
            if not isinstance(self.compilation_cache, str) or not self.compilation_cache.strip():
                raise fail(
                    "compilation_cache",
                    self.compilation_cache,
                    "True, False or a directory path/URL",
                    got_type=not isinstance(self.compilation_cache, str),
                )
            cache = self.compilation_cache
            if "://" in cache and not cache.startswith(_SCHEMES):
                raise fail("compilation_cache", cache, "True, False, a local path or a gs://, s3:// or file:// URL")

    def compilation_cache_dir(self, run_path: str) -> str | None:
        """The compilation cache directory of a run at ``run_path`` (None: off).

        Example:
            >>> RunConfig().compilation_cache_dir("/data/run-a")
            '/data/run-a/compile_cache'
        """
        if self.compilation_cache is False:
            return None
        if self.compilation_cache is True:
            return f"{run_path.rstrip('/')}/compile_cache"
        return run_dir(str(self.compilation_cache), "").rstrip("/")

    def run_path_for(self, name: str) -> str:
        """``storage_path/name``, with ``~`` expanded for local paths."""
        return run_dir(str(self.storage_path), name)

    @property
    def run_path(self) -> str:
        """``storage_path/name`` (only for a named run: unnamed runs get their name in ``fit()``)."""
        if self.name is None:
            raise ValueError(
                "RunConfig(name=None) has no run path yet: each fit() picks a fresh name "
                "(see result.path), or pass name=... to choose one"
            )
        return self.run_path_for(self.name)

    @property
    def checkpoint_path(self) -> str:
        """Where this named run's checkpoints live."""
        return checkpoints_dir(self.run_path)
