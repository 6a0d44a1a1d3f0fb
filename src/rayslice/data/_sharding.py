"""The batch's sharding (private): the default one, and the checks on a given one.

The default mixes with the mesh the training code most likely uses: the mesh
set with ``jax.set_mesh`` when there is one (its ``"data"`` axis, else all
its axes), otherwise 1-D over all devices with **Auto** axes, the kind
``Mesh(devices, ("data",))`` builds (Ray's examples). JAX refuses to mix
arrays whose meshes differ in axis types in one ``jit`` ("Mesh for all
inputs should be equal"); an Auto-axes batch mixes with parameters on any
Auto-axes mesh. Code on an Explicit-axes mesh (``jax.make_mesh``'s default)
passes ``sharding=NamedSharding(mesh, P("data"))`` or sets ``jax.set_mesh``.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def default_sharding() -> Any:
    """``NamedSharding`` for the batch when none is given (see module docstring)."""
    import jax
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    get_mesh = getattr(jax.sharding, "get_mesh", None)
    ambient = get_mesh() if get_mesh is not None else None
    if ambient is not None and not ambient.empty:
        names = tuple(ambient.axis_names)
        return NamedSharding(ambient, PartitionSpec("data" if "data" in names else names))
    # jax.make_mesh picks the device order (as JAX recommends); Auto axes, as Mesh(...) has.
    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(AxisType.Auto,))
    return NamedSharding(mesh, PartitionSpec("data"))


def batch_sharding(sharding: Any, batch_size: int, process_count: int) -> tuple[Any, int]:
    """Checks the batch splits evenly; returns (first-dim sharding, devices splitting the first dim)."""
    from jax.sharding import NamedSharding, PartitionSpec

    first = sharding.spec[0] if len(sharding.spec) else None
    if first is None:
        raise ValueError(f"sharding {sharding.spec} does not split the batch (first) dimension over any mesh axis")
    axes = (first,) if isinstance(first, str) else tuple(first)
    shards = int(np.prod([sharding.mesh.shape[a] for a in axes]))
    global_batch = batch_size * process_count
    if global_batch % shards:
        raise ValueError(
            f"global batch {global_batch} (batch_size {batch_size} x {process_count} process(es)) is not "
            f"divisible by {shards}, the devices on mesh axes {axes} that split the batch dimension"
        )
    out = NamedSharding(sharding.mesh, PartitionSpec(first))
    indices = out.addressable_devices_indices_map((global_batch,)).values()
    local = {(idx[0].start, idx[0].stop) for idx in indices if idx is not None}
    local_rows = len(local) * (global_batch // shards)
    if local_rows != batch_size:
        raise ValueError(
            f"batch_size {batch_size} per host does not match this host's {len(local)} shard(s) of "
            f"{global_batch // shards} rows ({local_rows} rows) under mesh axes {axes}"
        )
    return out, shards
