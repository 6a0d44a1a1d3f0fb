"""Models served by the serve tests (they run on the hosts of a slice)."""

from __future__ import annotations

import numpy as np

WEIGHTS = np.arange(1, 9, dtype=np.float32)


class Dot:
    """y = x @ (scale * w), computed with x sharded over every device of every host."""

    def __init__(self, scale: float = 1.0) -> None:
        self.scale = scale

    def setup(self, ctx) -> None:
        import jax
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        self.mesh = jax.make_mesh((jax.device_count(),), ("data",))
        self.rows = NamedSharding(self.mesh, P("data"))
        self.w = jax.device_put(WEIGHTS * self.scale, NamedSharding(self.mesh, P()))
        self.f = jax.jit(
            lambda x, w: {"y": x @ w, "total": (x @ w).sum() * 0 + x.sum()},
            out_shardings={"y": self.rows, "total": NamedSharding(self.mesh, P())},
        )
        self.hosts = jax.process_count()

    def __call__(self, batch):
        import jax

        x = batch["x"]
        n, d = x.shape[0], jax.device_count()
        padded = np.zeros((-(-n // d) * d, x.shape[1]), x.dtype)  # rows divisible over all devices
        padded[:n] = x
        gx = jax.make_array_from_callback(padded.shape, self.rows, lambda idx: padded[idx])
        out = self.f(gx, self.w)
        return {"y": out["y"], "hosts": np.full((padded.shape[0],), self.hosts, np.int32)}


class Picky(Dot):
    """Raises on a negative input, on every host (a bug in the model, not in the slice)."""

    def __call__(self, batch):
        if (batch["x"] < 0).any():
            raise ValueError("negative inputs are not supported")
        return super().__call__(batch)


GATE = 123.0  # a request whose first value is GATE waits at the gate


class Gated(Dot):
    """Requests starting with ``GATE`` wait, on every host, until ``<gate_dir>/open`` exists.

    Each host first writes ``<gate_dir>/entered-<rank>``: a test knows the
    request is in flight on every host, kills one, then opens the gate; the
    surviving host then runs the collective with a dead peer.
    """

    def __init__(self, gate_dir: str, scale: float = 1.0) -> None:
        super().__init__(scale)
        self.gate_dir = gate_dir

    def __call__(self, batch):
        import os
        import time

        import jax

        if (batch["x"][:, 0] == GATE).any():
            open(os.path.join(self.gate_dir, f"entered-{jax.process_index()}"), "w").close()
            deadline = time.monotonic() + 120
            while not os.path.exists(os.path.join(self.gate_dir, "open")) and time.monotonic() < deadline:
                time.sleep(0.01)
        return super().__call__(batch)


def expected(x: np.ndarray, scale: float = 1.0) -> np.ndarray:
    return x.astype(np.float32) @ (WEIGHTS * scale)


SPEC = {"x": ((8,), "float32")}
