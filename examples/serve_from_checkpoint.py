"""Train a model with JaxTrainer, then serve it from its Orbax checkpoint behind a JSON HTTP API.

Runs on the simulated cluster (no TPU needed):

    .venv/bin/python examples/serve_from_checkpoint.py

On a real cluster, drop the SimulatedCluster, ``ray.init(address=...)``, and
use shared storage (e.g. ``gs://bucket/runs``) for ``storage_path``.

    curl -s localhost:$PORT/model -d '{"inputs": {"x": [[0.1, 0.2, 0.3, 0.4]]}}'
    {"outputs": {"y": [...]}}
"""

from __future__ import annotations

import tempfile

import numpy as np
import requests
from ray import serve

from rayslice import serve as slice_serve
from rayslice.sim import SimulatedCluster, SliceSpec
from rayslice.train import CheckpointConfig, JaxTrainer, RunConfig, ScalingConfig

W = np.array([0.5, -1.0, 2.0, 0.25], np.float32)


def make_model():
    import flax.linen as nn

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(1)(nn.tanh(nn.Dense(32)(x)))[:, 0]

    return MLP()


def init_state(mesh):
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding, PartitionSpec

    model, tx = make_model(), optax.adam(1e-2)
    repl = NamedSharding(mesh, PartitionSpec())
    params = jax.jit(model.init, out_shardings=repl)(jax.random.key(0), jnp.zeros((1, 4)))
    return model, tx, {"params": params, "opt": jax.jit(tx.init, out_shardings=repl)(params)}


def train_loop(config):
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding, PartitionSpec

    from rayslice.data import iter_jax_batches
    from rayslice.train import get_checkpoint, get_context, report

    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    model, tx, state = init_state(mesh)
    ckpt = get_checkpoint()
    data_state = None
    if ckpt is not None:
        state, data_state = ckpt.restore(state), ckpt.data_state("data")
    x = np.random.default_rng(get_context().world_rank).standard_normal((1024, 4)).astype(np.float32)
    source = [{"x": x, "y": x @ W}]

    @jax.jit
    def step(state, batch):
        loss_of = lambda p: jnp.mean((model.apply(p, batch["x"]) - batch["y"]) ** 2)
        loss, g = jax.value_and_grad(loss_of)(state["params"])
        updates, opt = tx.update(g, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss

    it = iter_jax_batches(source, batch_size=32, ragged="drop", state=data_state,
                          sharding=NamedSharding(mesh, PartitionSpec("data")))
    for batch in it:
        state, loss = step(state, batch)
        n = it.state()["batches"]
        report({"loss": loss}, checkpoint={**state, "data": it} if n % 8 == 0 else None)


class Model:
    """Served on every host of one slice; restores the checkpoint onto that slice's mesh."""

    def __init__(self, checkpoint_path: str, step: int) -> None:
        self.checkpoint_path, self.step = checkpoint_path, step

    def setup(self, ctx):
        import jax
        from jax.sharding import NamedSharding, PartitionSpec

        from rayslice.train import Checkpoint

        mesh = jax.make_mesh((jax.device_count(),), ("data",))
        self.model, _, target = init_state(mesh)
        self.params = Checkpoint(self.checkpoint_path, self.step).restore(target)["params"]
        self.repl = NamedSharding(mesh, PartitionSpec())
        self.forward = jax.jit(self.model.apply, out_shardings=self.repl)

    def __call__(self, batch):
        import jax

        x = batch["x"]
        gx = jax.make_array_from_callback(x.shape, self.repl, lambda idx: x[idx])
        return {"y": self.forward(self.params, gx)}


def main() -> None:
    with SimulatedCluster([SliceSpec("TPU-V4", "2x2x2"), SliceSpec("TPU-V4", "2x2x2")]):
        result = JaxTrainer(train_loop, scaling_config=ScalingConfig(topology="2x2x2", accelerator_type="TPU-V4"),
                            run_config=RunConfig(name="example", storage_path=tempfile.mkdtemp(),
                                                 checkpoint_config=CheckpointConfig(num_to_keep=1))).fit()
        assert result.error is None, result.error
        print(f"trained: loss {result.metrics_history[0]['loss']:.3f} -> {result.metrics['loss']:.3f}; "
              f"checkpoint {result.checkpoint.path}")

        port = slice_serve.start_http()
        deployment = slice_serve.deployment(accelerator_type="TPU-V4",
                                            accelerator_config={"kind": "tpu", "topology": "2x2x2"},
                                            input_spec={"x": ((4,), "float32")})(Model)
        slice_serve.run(deployment.bind(result.checkpoint.path, result.checkpoint.step), name="model",
                        route_prefix="/model")  # serve.run that names the reason when a slice is missing
        x = np.array([[0.1, 0.2, 0.3, 0.4], [1.0, 0.0, -1.0, 0.5]], np.float32)
        r = requests.post(f"http://127.0.0.1:{port}/model", json={"inputs": {"x": x.tolist()}}, timeout=30)
        print("HTTP", r.status_code, r.json(), "expected about", (x @ W).tolist())
        serve.shutdown()


if __name__ == "__main__":
    main()
