"""JAX-native data feeding and batch inference on slices.

Example:
    >>> import numpy as np
    >>> from rayslice.data import iter_jax_batches
    >>> [b["x"].shape for b in iter_jax_batches([{"x": np.zeros(8)}], batch_size=4)]
    [(4,), (4,)]
"""

from rayslice.data.feeder import RAGGED_POLICIES, JaxBatchIterator, RaggedBatchError, iter_jax_batches
from rayslice.data.predict import batch_predict, local_rows

__all__ = ["RAGGED_POLICIES", "JaxBatchIterator", "RaggedBatchError", "batch_predict", "iter_jax_batches",
           "local_rows"]
