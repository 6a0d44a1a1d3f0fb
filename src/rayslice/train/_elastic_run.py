"""The driver's side of an elastic run (private): free slices counted, rows sharded, resizes kept.

One :class:`ElasticRun` per ``fit()`` of an elastic run applies the pure
rules of :mod:`rayslice.train.elastic` to the live cluster: how many slices
to reserve now (:func:`count_free_slices`, from Ray's node labels and
resources), each attempt's elastic epoch, shards and context
(:meth:`ElasticRun.begin`; the epochs kept in ``<run>/elastic.json``), the
seconds each resize cost, and when to grow back (:meth:`ElasticRun.grow_target`;
:func:`request_grow` asks the hosts to save and stop).

Example:
    >>> from rayslice.train import ScalingConfig
    >>> sc = ScalingConfig(topology="2x2x2", accelerator_type="TPU-V4", num_slices=4, min_slices=2)
    >>> run = ElasticRun(sc, "/tmp/runs/demo", say=print)
    >>> run.policy.sizes, run.path                  # no attempt yet: nothing to grow from
    ((2, 4), '/tmp/runs/demo/elastic.json')
    >>> run.grow_target() is None
    True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from rayslice.train.elastic import (
    GROW_REASON,
    ElasticEpoch,
    Layout,
    ResizeEvent,
    SizePolicy,
    dumps_epochs,
    grad_accum_steps,
    initial_layout,
    loads_epochs,
    mesh_shape,
    next_epoch,
    num_rows,
)


def count_free_slices(request: Any, avoid: Iterable[str] = (), released: Iterable[str] = ()) -> int:
    """Whole slices of ``request``'s type and shape free now (Ray: the cluster's node labels and resources).

    ``released``: slices this run has just given back, counted while every
    host is alive even if the snapshot still shows them held (Ray frees a
    removed group's resources a moment later). ``avoid``: never counted.
    """
    from rayslice.cluster import list_slices
    from rayslice.planning import plan

    snapshot = list_slices()
    skip, mine = set(avoid), set(released) - set(avoid)
    p = plan(request, snapshot, num_slices=1, exclude=skip)
    complete = {s.name for s in snapshot if s.is_complete}
    return sum(v.usable or (v.matches_shape and v.slice_name in mine and v.slice_name in complete) for v in p.verdicts)


def shard_datasets(ds: Any, layout: Layout) -> list[Any]:
    """One Ray Dataset per host holding exactly its ranges of the materialized ``ds``, in order."""
    cuts = sorted({b for host in layout for r in host for b in r if b > 0})
    pieces = ds.split_at_indices(cuts) if cuts else [ds]
    starts = [0, *cuts]
    out = []
    for host in layout:
        parts = [pieces[starts.index(s)] for s, e in host if e > s]
        # A piece per range: every range starts at a cut and ends at the next one (all ends are cuts).
        if len(parts) == 1:
            out.append(parts[0])
        elif not parts:
            out.append(ds.limit(0).materialize())
        else:
            # Blocks in range order (Dataset.union interleaves its inputs): a host's position
            # (rows read) must name the same rows after a restart.
            import ray.data

            out.append(ray.data.from_arrow_refs([ref for part in parts for ref in part.to_arrow_refs()]))
    return out


def request_grow(slices: int) -> bool:
    """Runs in a gang process: ask every host to save at the next agreed step and stop, to grow to ``slices``.

    False when the attempt does not watch notices (``FailureConfig(preemption_notices=False)``).
    """
    from rayslice.train import worker

    s = worker._SESSION
    if s is None or s.agreement is None:
        return False
    s.agreement.announce(GROW_REASON, slices=int(slices))
    return True


@dataclasses.dataclass(frozen=True)
class AttemptPlan:
    """What one attempt of an elastic run gets: its epoch, the shards, and the context fields."""

    epoch: ElasticEpoch
    shards: dict[str, list[Any]]
    context: dict[str, Any]


class ElasticRun:
    """The driver's bookkeeping of an elastic run: sizes, epochs (kept in ``<run>/elastic.json``), resizes.

    Args:
        scaling: The run's ``ScalingConfig`` (elastic).
        run_path: ``<storage_path>/<name>``.
        say: Where resize messages go.
        clock: Monotonic clock.
    """

    def __init__(
        self, scaling: Any, run_path: str, say: Callable[[str], None], clock: Callable[[], float] | None = None
    ) -> None:
        import time

        self.clock = clock or time.monotonic
        self.scaling = scaling
        self.num_slices = int(scaling.num_slices)
        self.policy = SizePolicy(tuple(scaling.elastic_sizes), float(scaling.regrow_every_s))
        self.hosts_per_slice = int(scaling.hosts_per_slice)
        self.devices_per_slice = int(scaling.topology_info.num_devices)
        self.path = f"{run_path.rstrip('/')}/elastic.json"
        self.say = say
        self.epochs: list[ElasticEpoch] = []
        self.resizes: list[ResizeEvent] = []
        self.t0 = self.clock()
        self.last_resize = self.t0
        self.last_step_at: float | None = None
        self.reason = "restart"  # why the next attempt may have another size
        self.slices: int | None = None  # slices of the running (or last) attempt
        self.names: list[str] = []  # their names
        self.grow_asked = False
        self.grow_off = False
        self._next_check = 0.0

    # -- reserving ---------------------------------------------------------------
    def request(self, request: Any, avoid: Iterable[str]) -> Any:
        """``request`` with the number of slices to reserve now: the most that are free, else the least allowed."""
        from rayslice.request import SliceRequest

        free = count_free_slices(request, avoid, released=self.names)
        k = self.policy.choose(free) or self.policy.min_slices
        return SliceRequest.parse(request, num_slices=k)

    # -- an attempt --------------------------------------------------------------
    def begin(
        self,
        restore_step: int | None,
        spg: Any,
        datasets: Mapping[str, Any],
        root: str,
        restored_meta: Mapping[str, Any] | None = None,
    ) -> AttemptPlan:
        """The epoch, shards and context of an attempt on the reservation ``spg`` restoring ``restore_step``.

        ``restored_meta``: the metadata saved with the restored step when it is not on storage (a RAM tier
        step): its data states say where each host's rows stood.
        """
        slices, world = int(spg.num_slices), int(spg.num_hosts)
        if not self.epochs:
            self.epochs = self._load(datasets)
        if not self.epochs:
            layouts = {k: initial_layout(int(ds.count()), world) for k, ds in datasets.items()}
            self.epochs = [ElasticEpoch(0, 0, slices, world, layouts)]
            self._save()
        positions = lambda n, e: self._positions(root, restore_step, n, e, restored_meta)
        epoch = next_epoch(self.epochs, restore_step, slices, world, positions)
        before = self.slices if self.slices is not None else self.epochs[-1].slices
        if epoch is not self.epochs[-1]:
            self.epochs.append(epoch)
            self._save()
        if before != slices and (self.slices is not None or epoch.index > 0):
            now = self.clock()
            event = ResizeEvent(now - self.t0, restore_step or 0, before, slices, self.reason, None, epoch.index)
            self.resizes.append(event)
            self.last_resize = now
            self.say(f"elastic: {event}")
        self.slices, self.names = slices, [s.name for s in spg.slices]
        self.reason, self.grow_asked = "restart", False
        shards = {k: shard_datasets(ds, epoch.layouts[k]) for k, ds in datasets.items() if k in epoch.layouts}
        context = {
            "max_slices": self.num_slices,
            "elastic_epoch": epoch.index,
            "grad_accum_steps": grad_accum_steps(self.num_slices, slices, self.scaling.keep_global_batch),
            "mesh_shape": mesh_shape(self.scaling.mesh, self.num_slices, slices, self.devices_per_slice),
            "data_resplit_step": epoch.start_step if epoch.index > 0 else None,
        }
        return AttemptPlan(epoch, shards, context)

    def on_step(self) -> None:
        """A step completed (rank 0 reported): closes the seconds lost of a resize that waited for it."""
        now = self.clock()
        if self.resizes and self.resizes[-1].lost_s is None:
            start = self.last_step_at if self.last_step_at is not None else self.t0 + self.resizes[-1].at_s
            self.resizes[-1] = dataclasses.replace(self.resizes[-1], lost_s=max(0.0, now - start))
        self.last_step_at = now

    def grow_target(self, every_s: float = 1.0) -> int | None:
        """The size to grow to now, checking the cluster at most every ``every_s`` (None: stay)."""
        now = self.clock()
        if self.grow_asked or self.grow_off or self.slices is None or now < self._next_check:
            return None
        self._next_check = now + every_s
        if self.slices >= self.policy.max_slices or now - self.last_resize < self.policy.regrow_every_s:
            return None
        from rayslice.request import SliceRequest

        return self.policy.grow_to(
            self.slices, count_free_slices(SliceRequest.parse(self.scaling.request)), now - self.last_resize
        )

    # -- storage -----------------------------------------------------------------
    def _positions(
        self, root: str, step: int | None, name: str, epoch: ElasticEpoch, meta: Mapping[str, Any] | None = None
    ) -> list[int] | None:
        from rayslice.train.checkpoint import Checkpoint, step_dir

        if step is None:
            return None
        if meta is not None and int(meta.get("step", -1)) == step:
            states = dict(meta.get("data_states") or {})
        else:
            try:
                states = Checkpoint(step_dir(root, step), step).metadata().get("data_states", {})
            except (FileNotFoundError, ValueError):
                states = {}
        per_rank = states.get(name)
        if per_rank is None and len(states) == 1 and len(epoch.layouts) == 1:
            per_rank = next(iter(states.values()))
        if per_rank is None or len(per_rank) != epoch.world_size:
            self.say(
                f"elastic: no saved position of dataset {name!r} for {epoch.world_size} hosts at step {step} "
                "(checkpoint its iterator under the dataset's name): its rows are split again from their start"
            )
            return None
        layout = epoch.layouts[name]
        return [
            num_rows(h) if (st or {}).get("finished") else min(int((st or {}).get("rows", 0)), num_rows(h))
            for st, h in zip(per_rank, layout)
        ]

    def _save(self) -> None:
        from rayslice.train.checkpoint import _path

        p = _path(self.path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(dumps_epochs(self.epochs))

    def _load(self, datasets: Mapping[str, Any]) -> list[ElasticEpoch]:
        from rayslice.train.checkpoint import _path

        p = _path(self.path)
        if not p.exists():
            return []
        epochs = loads_epochs(p.read_text())
        if epochs and set(epochs[0].layouts) != set(datasets):
            self.say("elastic: the datasets changed since this run's elastic.json: splitting them from the start")
            return []
        return epochs


__all__ = ["AttemptPlan", "ElasticRun", "count_free_slices", "request_grow", "shard_datasets"]
