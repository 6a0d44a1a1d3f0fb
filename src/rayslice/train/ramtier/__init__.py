"""The RAM checkpoint tier: every few steps each host keeps its shards in host memory, with a replica on a peer.

With ``CheckpointConfig(ram_every_steps=N)`` every N steps each host copies
the shards of the reported pytree it holds (``addressable_shards``, keyed by
their global index) to host memory, synchronously (so a donated buffer can be
reused at once), and hands them to two **RAM stores**: its own node's and a
buddy's. A store (:class:`RamStore`) is a small Ray actor, one per node
(``num_cpus=0``, pinned to its node by ``NodeAffinitySchedulingStrategy``),
created by the driver and living for the whole ``fit()``, so the RAM copies
outlive the training processes of a failed attempt (each attempt starts
fresh ones). The buddy is the host with the same worker id on the next slice
when the run has several slices (a slice is the usual unit of loss), else
the next host of the same slice. The payload travels through Ray's object
store (``ray.put`` once, two actor calls); the copy to the stores runs in a
background thread and the host says in its step records when both stores
acknowledged a step.

A store keeps, per owner rank, two steps: the newest step that every rank
completed (the driver *pins* it) and one in flight; entries older than the
pinned step, or of earlier attempts, are dropped. While the driver's pin lags
and a buddy's replica in the same store is older than the owner's newest
steps, the owner's steps from the buddy's on are kept too (at most four):
the step complete on every rank may be one of them. Its bytes are reported
(``Result.ram_tier_bytes``: the peak held by one node's store).

At each restart the driver asks every store it can still reach (those on
nodes of lost hosts count as unreachable at once; the others get a short
deadline) what it holds, and :func:`choose_restore` (a pure function) picks:
the newest RAM step whose every rank is held by a reachable store (all from
the same attempt), if it is at least the newest complete storage step;
otherwise the newest complete storage checkpoint. The choice and its reason
are a :class:`RestoreChoice` in ``Result.restores`` and in the progress line.
Inside the worker, ``get_checkpoint()`` then returns a :class:`RamCheckpoint`
(the :class:`~rayslice.train.Checkpoint` interface, ``tier == "ram"``) whose
``restore(target)`` rebuilds every leaf from the stored shards for the
target's sharding: the values are bitwise identical to the saved ones. The
restoring world may differ from the saving one (an elastic resize): a target
shard that no host saved as such is assembled from the saved shards that
overlap it (:func:`~rayslice.train.ramtier.restore.assemble`). Once a step of
a new attempt is complete, the stores only earlier attempts used are killed
(their nodes may be gone unnoticed); the driver also starts stores on the
spare hosts a restart would take (:meth:`RamTier.prestart`), so that a
restart finds them up.

Example:
    >>> choice = choose_restore(
    ...     world_size=2,
    ...     holdings={"a0": [(0, 1, 40, 2), (1, 1, 40, 2)], "a1": []},
    ...     unreachable={"a1": "its host was lost"},
    ...     storage_step=30,
    ...     placement={1: {0: ("a0", "a1"), 1: ("a1", "a0")}},
    ...     labels={"a0": "slice-a worker 0", "a1": "slice-a worker 1"},
    ... )
    >>> choice.tier, choice.step, choice.reason
    ('ram', 40, 'RAM step 40: every shard reachable (rank 1 from its replica on slice-a worker 0)')
"""

from rayslice.train.ramtier.choice import RestoreChoice, buddy_ranks, choose_restore, retained
from rayslice.train.ramtier.driver import PING_DEADLINE_S as PING_DEADLINE_S
from rayslice.train.ramtier.driver import RamTier
from rayslice.train.ramtier.restore import RamCheckpoint
from rayslice.train.ramtier.restore import ram_checkpoint as ram_checkpoint
from rayslice.train.ramtier.store import STORE_PREFIX as STORE_PREFIX
from rayslice.train.ramtier.store import RamStore, store_name
from rayslice.train.ramtier.writer import RamWriter
from rayslice.train.ramtier.writer import host_copy as host_copy

__all__ = [
    "RamCheckpoint",
    "RamStore",
    "RamTier",
    "RamWriter",
    "RestoreChoice",
    "buddy_ranks",
    "choose_restore",
    "retained",
    "store_name",
]
