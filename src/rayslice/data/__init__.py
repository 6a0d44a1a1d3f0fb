"""JAX-native data feeding and batch inference on slices.

``iter_jax_batches`` turns Ray Data (or any batch iterable) into global,
device-sharded ``jax.Array`` batches; its options are one frozen
:class:`FeederOptions`, its last-batch policy a :class:`Ragged`.
``batch_predict`` runs a jitted function over every row of a Dataset on a
reserved slice (or one you already hold).

Example:
    >>> import numpy as np
    >>> from rayslice.data import iter_jax_batches
    >>> [b["x"].shape for b in iter_jax_batches([{"x": np.zeros(8)}], batch_size=4)]
    [(4,), (4,)]
"""

from rayslice.data.feeder import JaxBatchIterator, iter_jax_batches
from rayslice.data.options import FeederOptions, Ragged, RaggedBatchError
from rayslice.data.predict import batch_predict, local_rows

RAGGED_POLICIES = tuple(r.value for r in Ragged)

__all__ = [
    "RAGGED_POLICIES",
    "FeederOptions",
    "JaxBatchIterator",
    "Ragged",
    "RaggedBatchError",
    "batch_predict",
    "iter_jax_batches",
    "local_rows",
]
