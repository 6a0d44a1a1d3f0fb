"""The restore choice (pure): where each rank's replica lives, what a store keeps, and what a restart resumes from.

The driver gathers the facts (what every reachable store holds, which are
lost, the newest complete storage step); :func:`choose_restore` decides.

Example:
    >>> buddy_ranks([0, 0], [0, 1], 1, 2)  # one slice of two hosts: each keeps the other's replica
    [1, 0]
    >>> choose_restore(world_size=1, holdings={}, unreachable={}, storage_step=30, placement={}, labels={}).reason
    'storage step 30'
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

__all__ = ["RestoreChoice", "buddy_ranks", "choose_restore", "retained"]


def buddy_ranks(
    slice_index: Sequence[int], worker_id: Sequence[int], num_slices: int, hosts_per_slice: int
) -> list[int]:
    """Which rank keeps each rank's replica: same worker id on the next slice, else the next host of the slice.

    Args:
        slice_index: Each rank's slice index.
        worker_id: Each rank's worker id in its slice.
        num_slices: Slices in the run.
        hosts_per_slice: Hosts per slice.

    Example:
        >>> buddy_ranks([0, 0, 1, 1], [0, 1, 0, 1], 2, 2)   # two slices: the other slice's twin
        [2, 3, 0, 1]
        >>> buddy_ranks([0, 0], [0, 1], 1, 2)               # one slice: the next host
        [1, 0]
    """
    where = {(s, w): r for r, (s, w) in enumerate(zip(slice_index, worker_id))}
    out = []
    for r, (s, w) in enumerate(zip(slice_index, worker_id)):
        other = ((s + 1) % num_slices, w) if num_slices > 1 else (s, (w + 1) % hosts_per_slice)
        out.append(where.get(other, r))
    return out


#: The most steps a store keeps of one owner rank, however far the pin lags (bounds the tier's memory).
MAX_KEPT = 4


def retained(
    entries: Iterable[tuple[int, int]],
    pin: tuple[int, int] | None,
    keep: int = 2,
    floor: tuple[int, int] | None = None,
) -> set[tuple[int, int]]:
    """Which ``(attempt, step)`` entries of one owner rank a store keeps.

    The pinned entry (the newest step every rank completed) and the newest
    others, ``keep`` in all; entries older than the pin, or of an earlier
    attempt than the pin's, are obsolete. ``floor``: the oldest of the newest
    entries the store holds of its *other* owners (a buddy's replica that is
    late): entries of this owner from there on are kept too, since the step
    complete on every rank may be one of them while the driver's pin lags —
    at most :data:`MAX_KEPT` in all.

    Example:
        >>> sorted(retained([(1, 2), (1, 4), (1, 6)], pin=(1, 4)))
        [(1, 4), (1, 6)]
        >>> sorted(retained([(1, 2), (1, 4), (2, 4), (2, 6), (2, 8)], pin=(2, 4)))
        [(2, 4), (2, 8)]
        >>> sorted(retained([(1, 6), (1, 8), (1, 10)], pin=None, floor=(1, 6)))  # the buddy's replica is at 6
        [(1, 6), (1, 8), (1, 10)]
    """
    live = [e for e in set(entries) if pin is None or (e[0] >= pin[0] and e[1] >= pin[1])]
    live.sort(key=lambda e: (e[1], e[0]), reverse=True)
    kept = {pin} if pin is not None and pin in live else set()
    for e in live:
        if len(kept) >= keep:
            break
        kept.add(e)
    if floor is not None:
        for e in live:
            if len(kept) >= MAX_KEPT:
                break
            if e[0] == floor[0] and e[1] >= floor[1]:
                kept.add(e)
    return kept


@dataclasses.dataclass(frozen=True)
class RestoreChoice:
    """Where an attempt resumed from, and why.

    Attributes:
        attempt: The attempt that restored (1-based).
        tier: ``"ram"``, ``"storage"`` or ``"none"`` (a fresh start).
        step: The step restored (None for a fresh start).
        reason: Why this tier, e.g. ``"RAM step 40: every shard reachable
            (rank 3 from its replica on slice-b worker 1)"`` or
            ``"storage step 30: RAM step 40 unreachable: rank 2 lost with its replica"``.
        seconds: Time rank 0 spent inside ``restore()`` (None until it reported).
        sources: For RAM: each rank's stores holding its payload, best first.
        from_attempt: For RAM: the attempt that saved the step.

    Example:
        >>> RestoreChoice(2, "storage", 30, "storage step 30: no RAM step complete").tier
        'storage'
    """

    attempt: int
    tier: str
    step: int | None
    reason: str
    seconds: float | None = None
    sources: Mapping[int, tuple[str, ...]] = dataclasses.field(default_factory=dict, repr=False, compare=False)
    from_attempt: int | None = None


def _storage_choice(storage_step: int | None, why: str) -> RestoreChoice:
    if storage_step is None:
        return RestoreChoice(0, "none", None, f"fresh start: no complete checkpoint ({why})" if why else "fresh start")
    return RestoreChoice(0, "storage", storage_step, f"storage step {storage_step}" + (f": {why}" if why else ""))


def choose_restore(
    *,
    world_size: int,
    holdings: Mapping[str, Iterable[tuple[int, int, int, int]]],
    unreachable: Mapping[str, str],
    storage_step: int | None,
    placement: Mapping[int, Mapping[int, tuple[str, str]]],
    labels: Mapping[str, str],
    newest_ram: tuple[int, int] | None = None,
) -> RestoreChoice:
    """Picks the checkpoint a restart resumes from (pure: the driver gathers the facts).

    Args:
        world_size: Hosts of the attempt that will restore.
        holdings: For each store that answered: ``(owner rank, attempt, step,
            world size)`` of every payload it holds.
        unreachable: Stores that did not answer (or sit on a lost node), with why.
        storage_step: The newest complete storage checkpoint (None: none).
        placement: For each attempt, each rank's ``(primary store, replica store)``.
        labels: A store's place in words (``"slice-a worker 1"``).
        newest_ram: ``(attempt, step)`` of the newest RAM step every rank
            acknowledged, as the driver saw it (named when it is unreachable).

    Returns:
        A :class:`RestoreChoice` (its ``attempt`` is 0: the caller sets it).
        RAM wins when every rank of the world that saved one ``(attempt,
        step)`` is held by a reachable store and the step is at least
        ``storage_step``; that world may differ from ``world_size`` (an
        elastic resize: each host of the new world assembles its shards from
        the saved ones).

    Example:
        >>> c = choose_restore(world_size=2, holdings={"a0": [(0, 1, 40, 2)]}, unreachable={"a1": "host lost"},
        ...                    storage_step=30, placement={1: {0: ("a0", "a1"), 1: ("a1", "a0")}},
        ...                    labels={"a0": "slice-a worker 0", "a1": "slice-a worker 1"}, newest_ram=(1, 40))
        >>> c.tier, c.step
        ('storage', 30)
        >>> c.reason  # doctest: +ELLIPSIS
        'storage step 30: RAM step 40 unreachable: rank 1 lost (slice-a worker 1; its replica on ... does not hold it)'
    """
    held: dict[tuple[int, int], dict[int, list[str]]] = {}
    saved_by: dict[tuple[int, int], int] = {}  # the world size that saved each step
    for store, entries in holdings.items():
        for owner, attempt, step, world in entries:
            held.setdefault((attempt, step), {}).setdefault(owner, []).append(store)
            saved_by[(attempt, step)] = world
    complete = [k for k, owners in held.items() if all(r in owners for r in range(saved_by[k]))]
    best = max(complete, key=lambda k: (k[1], k[0]), default=None)
    if best is not None and (storage_step is None or best[1] >= storage_step):
        attempt, step = best
        where = placement.get(attempt, {})
        sources: dict[int, tuple[str, ...]] = {}
        via_replica = []
        for r in range(saved_by[best]):
            primary = where.get(r, ("", ""))[0]
            stores = sorted(held[best][r], key=lambda s: (s != primary, s))
            sources[r] = tuple(stores)
            if stores[0] != primary:
                via_replica.append(f"rank {r} from its replica on {labels.get(stores[0], stores[0])}")
        notes = via_replica + (
            [f"saved by {saved_by[best]} hosts, restored onto {world_size}"] if saved_by[best] != world_size else []
        )
        reason = f"RAM step {step}: every shard reachable" + (f" ({'; '.join(notes)})" if notes else "")
        return RestoreChoice(0, "ram", step, reason, sources=sources, from_attempt=attempt)
    if best is not None:  # complete in RAM, but storage is newer
        return _storage_choice(storage_step, f"newer than RAM step {best[1]}")
    target = newest_ram
    if target is None:
        partial = max(held, key=lambda k: (k[1], k[0]), default=None)
        target = partial
    if target is None:
        return _storage_choice(storage_step, "no RAM step complete" if placement else "")
    attempt, step = target
    if storage_step is not None and step < storage_step:
        return _storage_choice(storage_step, f"newer than RAM step {step}")
    owners = held.get((attempt, step), {})
    where = placement.get(attempt, {})
    missing = []
    for r in range(saved_by.get((attempt, step), len(where) or world_size)):
        if r in owners:
            continue
        primary, replica = where.get(r, ("", ""))
        p, q = labels.get(primary, primary or "?"), labels.get(replica, replica or "?")
        p_lost, q_lost = primary in unreachable, replica in unreachable
        if p_lost and (q_lost or replica == primary):
            missing.append(f"rank {r} lost with its replica ({p}, {q})")
        elif p_lost:
            missing.append(f"rank {r} lost ({p}; its replica on {q} does not hold it)")
        else:
            missing.append(f"rank {r} not saved ({p} and {q} do not hold it)")
    return _storage_choice(storage_step, f"RAM step {step} unreachable: " + "; ".join(missing))
