"""What one step yields, from every host's row count (private, pure).

The prefetch thread asks :func:`decide` once per step with the row counts
all hosts agreed on; every host gets the same answer, so every host takes
the same branch at the same step and no collective is left waiting.

Example:
    >>> decide([8, 8], 8, Ragged.RAISE, shards=8)
    <Step.FULL: 'full'>
    >>> decide([8, 3], 8, Ragged.PAD, shards=8), decide([0, 0], 8, Ragged.PAD, shards=8)
    (<Step.PAD: 'pad'>, <Step.END: 'end'>)
    >>> decide([3], 8, Ragged.RAISE, shards=4)
    Traceback (most recent call last):
    ...
    rayslice.data.options.RaggedBatchError: the last batch is partial: 3 row(s) left for batch_size 8; \
pass ragged='drop' or ragged='pad' (Ray's drop_last=True or paddings=0)
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from rayslice.data.options import Ragged, RaggedBatchError

_FIX = "pass ragged='drop' or ragged='pad' (Ray's drop_last=True or paddings=0)"


#: The policies under which :func:`decide` never yields a partial step (it ends the stream or raises):
#: there a host's last partial batch is only counted, never assembled (see ``_rebatch.Dropped``).
NEVER_PARTIAL = frozenset({Ragged.DROP, Ragged.RAISE})


class Step(str, enum.Enum):
    FULL = "full"  # every host has batch_size rows
    PAD = "pad"  # some host is short: pad every short host to batch_size
    KEEP = "keep"  # every host has the same, smaller count: yield it as is
    END = "end"  # stop here


def _left(counts: Sequence[int]) -> str:
    return ", ".join(f"host {p}: {c}" for p, c in enumerate(counts)) if len(counts) > 1 else str(counts[0])


def decide(counts: Sequence[int], batch_size: int, ragged: Ragged, shards: int, hosts: int | None = None) -> Step:
    """The step every host takes, given each host's rows (in process order) for this step.

    Args:
        counts: Rows each host has for this step (0 once its shard is done).
        batch_size: Rows per host per step.
        ragged: The last-batch policy.
        shards: Devices that split the batch dimension (for ``Ragged.KEEP``).
        hosts: Processes contributing rows (default ``len(counts)``; more when
            hosts do not agree and each assumes the others hold what it holds).

    Raises:
        RaggedBatchError: Under ``Ragged.RAISE`` for a partial step; under
            ``Ragged.KEEP`` when hosts hold different counts or the partial
            global batch does not split evenly over ``shards``.
    """
    if not counts or max(counts) == 0:
        return Step.END
    if min(counts) == batch_size:
        return Step.FULL
    if ragged is Ragged.DROP:
        return Step.END
    if ragged is Ragged.PAD:
        return Step.PAD
    if ragged is Ragged.RAISE:
        raise RaggedBatchError(
            f"the last batch is partial: {_left(counts)} row(s) left for batch_size {batch_size}; {_FIX}"
        )
    if len(set(counts)) > 1:
        raise RaggedBatchError(
            f"hosts hold different numbers of rows at the last batch ({_left(counts)}), "
            f"so it cannot be kept as one smaller global batch; {_FIX}"
        )
    hosts = hosts or len(counts)
    rows = counts[0] * hosts
    if rows % shards:
        raise RaggedBatchError(
            f"the last batch has {rows} row(s) over {hosts} host(s), which do not split "
            f"evenly over the {shards} devices that split the batch; {_FIX}"
        )
    return Step.KEEP
