"""The demo's model: a Flax MLP regression, its training loop and inference (private).

The MLP (:data:`DEPTH` hidden layers of :data:`HIDDEN`) is big enough that a
step is real work on this machine's CPUs: the demo's goodput measures a
training run, not the plumbing around a toy.

Everything here runs inside gang processes (JAX is imported in the
functions, never at module import), so the demo's driver stays JAX-free.
"""

from __future__ import annotations

from typing import Any

import numpy as np

FEATURES = 8
HIDDEN = 512  # width of each hidden layer
DEPTH = 3  # hidden layers
_W = np.linspace(-1.0, 1.0, FEATURES).astype(np.float32)


def make_features(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Ray Data ``map_batches``: deterministic features and a noisy nonlinear target per row id."""
    ids = batch["id"].astype(np.int64)
    rng = np.random.default_rng(ids[0] if len(ids) else 0)
    x = np.stack([np.sin(ids * (k + 1) * 0.37) for k in range(FEATURES)], axis=1).astype(np.float32)
    y = (np.tanh(x @ _W) * 2.0 + 0.05 * rng.standard_normal(len(ids))).astype(np.float32)
    return {"id": ids, "x": x, "y": y}


def _model() -> Any:
    import flax.linen as nn

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(DEPTH):
                x = nn.relu(nn.Dense(HIDDEN)(x))
            return nn.Dense(1)(x)[:, 0]

    return MLP()


def data_mesh() -> Any:
    """1-D mesh over every device with Auto axes: the one the feeder's default batches use too.

    JAX refuses to mix arrays of meshes with different axis types in one
    ``jit``; ``batch_predict`` feeds batches with the default (Auto) sharding.
    """
    import jax
    from jax.sharding import AxisType

    return jax.make_mesh((jax.device_count(),), ("data",), axis_types=(AxisType.Auto,))


def init_state(mesh: Any, lr: float, *, abstract: bool = False) -> tuple[Any, Any, dict[str, Any]]:
    """(model, optimizer, state) with parameters replicated over ``mesh``.

    ``abstract=True``: the state's shapes, dtypes and shardings only
    (``jax.ShapeDtypeStruct`` leaves), the target a restore fills: nothing is
    computed only to be overwritten by the checkpoint.
    """
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding, PartitionSpec

    model, tx = _model(), optax.adam(lr)
    repl = NamedSharding(mesh, PartitionSpec())
    init, opt_init = jax.jit(model.init, out_shardings=repl), jax.jit(tx.init, out_shardings=repl)
    run = jax.eval_shape if abstract else (lambda f, *a: f(*a))
    params = run(init, jax.random.key(0), jnp.zeros((1, FEATURES)))
    return model, tx, {"params": params, "opt": run(opt_init, params)}


def train_loop(config: dict[str, Any]) -> None:
    """Data-parallel training over all hosts of the slice, one pass over its data shard.

    The loop hands its state to ``report`` every ``every`` steps; the run's
    ``CheckpointConfig`` (RAM tier and storage cadences) decides what is kept where.
    """
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding, PartitionSpec

    from rayslice.data import iter_jax_batches
    from rayslice.train import get_checkpoint, get_dataset_shard, report

    mesh = data_mesh()
    ckpt, data_state = get_checkpoint(), None
    # A restart restores into the state's abstract shapes and shardings (no initial parameters computed).
    model, tx, state = init_state(mesh, config["lr"], abstract=ckpt is not None)
    if ckpt is not None:
        state, data_state = ckpt.restore(state), ckpt.data_state("data")

    @jax.jit
    def step(state, batch):
        def loss_fn(p):
            return jnp.mean((model.apply(p, batch["x"]) - batch["y"]) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss

    it = iter_jax_batches(
        get_dataset_shard("train"),
        batch_size=config["batch_size"],
        columns=["x", "y"],
        ragged="drop",
        state=data_state,
        sharding=NamedSharding(mesh, PartitionSpec("data")),
    )
    for batch in it:
        state, loss = step(state, batch)
        n = it.state()["batches"]
        report({"loss": loss}, checkpoint={**state, "data": it} if n % config["every"] == 0 else None)


def load_params(checkpoint_path: str, lr: float = 1e-3) -> Any:
    """Restores trained parameters from a rayslice/Orbax checkpoint onto this process's mesh."""

    from rayslice.train import Checkpoint

    mesh = data_mesh()
    model, _, target = init_state(mesh, lr, abstract=True)
    state = Checkpoint(checkpoint_path).restore(target)  # the step is read from the step directory
    return model, state["params"]


def predict(loaded: Any, batch: dict[str, Any]) -> Any:
    model, params = loaded
    return model.apply(params, batch["x"])


class Regressor:
    """The trained model behind an HTTP API: restored from a checkpoint on every host of a slice."""

    def __init__(self, checkpoint_path: str) -> None:
        self.checkpoint_path = checkpoint_path

    def setup(self, ctx: Any) -> None:
        import jax
        from jax.sharding import NamedSharding, PartitionSpec

        self.model, self.params = load_params(self.checkpoint_path)
        mesh = data_mesh()
        self.repl = NamedSharding(mesh, PartitionSpec())
        self.forward = jax.jit(self.model.apply, out_shardings=self.repl)

    def __call__(self, batch: dict[str, Any]) -> Any:
        import jax

        x = batch["x"]
        # Every host holds the whole request batch: build the replicated input from local data.
        gx = jax.make_array_from_callback(x.shape, self.repl, lambda idx: x[idx])
        return {"y": self.forward(self.params, gx)}
