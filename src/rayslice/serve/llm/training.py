"""Train the byte-level LM with ``rayslice.train.JaxTrainer`` on text that ships with Python.

The corpus is the standard library's own source (``.py`` files under
``sysconfig.get_paths()["stdlib"]``): always present, offline, licensed with
Python. The training loop (:func:`lm_train_loop`) runs on every host of a
slice: parameters replicated, the batch split over all devices (data
parallel), and checkpoints ``{"params": variables, "opt": optimizer state}``
through ``rayslice.train.report`` — exactly what
:func:`rayslice.serve.llm.weights.load_params` reads back for serving.

Example:
    >>> text = stdlib_corpus(max_bytes=10_000)
    >>> len(text) <= 10_000 and "def " in text
    True
"""

from __future__ import annotations

import functools
import os
import sysconfig
import tempfile
from typing import Any

import numpy as np

from rayslice.serve.llm.model import LMConfig
from rayslice.serve.llm.tokenizer import EOS_ID

DEFAULT_FILES = (
    "textwrap.py",
    "string.py",
    "glob.py",
    "fnmatch.py",
    "bisect.py",
    "heapq.py",
    "colorsys.py",
    "keyword.py",
    "shlex.py",
    "base64.py",
    "queue.py",
    "sched.py",
    "this.py",
)


def stdlib_corpus(max_bytes: int = 400_000, files: tuple[str, ...] = DEFAULT_FILES) -> str:
    """Source text of standard-library modules (the named ones first), up to ``max_bytes`` UTF-8 bytes."""
    root = sysconfig.get_paths()["stdlib"]
    names = [f for f in files if os.path.isfile(os.path.join(root, f))]
    names += sorted(f for f in os.listdir(root) if f.endswith(".py") and f not in names)
    parts, size = [], 0
    for name in names:
        with open(os.path.join(root, name), encoding="utf-8", errors="replace") as fh:
            text = fh.read()
        text = text.encode("utf-8")[: max_bytes - size].decode("utf-8", errors="ignore")
        parts.append(text)
        size += len(text.encode("utf-8")) + 1
        if size >= max_bytes:
            break
    return "\x00".join(parts)[:max_bytes]


def encode_corpus(text: str) -> np.ndarray:
    """Token ids: the UTF-8 bytes, with ``<|endoftext|>`` between documents (NUL separators)."""
    ids = np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)
    ids[ids == 0] = EOS_ID
    return ids


def _rows_of(batch: np.ndarray, idx: Any) -> np.ndarray:
    return batch[idx]


def lm_train_loop(config: dict[str, Any]) -> None:
    """``train_loop_per_worker`` for :class:`~rayslice.train.JaxTrainer` (runs on every host).

    ``config`` keys: ``lm`` (an :class:`LMConfig` as a dict), ``tokens`` (the
    corpus ids), ``steps``, ``batch_size`` (global, divisible by the device
    count), ``seq_len``, ``lr``, ``seed``, ``every`` (checkpoint interval).
    """
    import jax
    import optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from rayslice.serve.llm.model import init_params, loss_fn
    from rayslice.train import get_checkpoint, report

    lm = LMConfig(**config["lm"])
    tokens = np.asarray(config["tokens"], np.int32)
    mesh = Mesh(np.array(jax.devices()), ("data",))  # automatic sharding propagation (not explicit axes)
    repl, rows = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("data"))
    tx = optax.adamw(config.get("lr", 3e-3), weight_decay=0.0)
    host_params = init_params(lm, config.get("seed", 0))
    params = jax.tree.map(lambda a: jax.make_array_from_callback(a.shape, repl, lambda i: a[i]), host_params)
    state = {"params": params, "opt": jax.jit(tx.init, out_shardings=repl)(params)}
    ckpt = get_checkpoint()
    start = 0
    if ckpt is not None:
        state, start = ckpt.restore(state), int(ckpt.step or 0)

    @jax.jit
    def step(state: Any, batch: Any) -> Any:
        loss, grads = jax.value_and_grad(lambda p: loss_fn(lm, p, batch))(state["params"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss

    batch_size, seq_len, every = config["batch_size"], config["seq_len"], config.get("every", config["steps"])
    for i in range(start, config["steps"]):
        # The same global batch on every host (a seeded draw), each host placing its devices' rows.
        rng = np.random.default_rng((config.get("seed", 0), i))
        starts = rng.integers(0, len(tokens) - seq_len - 1, batch_size)
        batch = np.stack([tokens[s : s + seq_len + 1] for s in starts])
        gbatch = jax.make_array_from_callback(batch.shape, rows, functools.partial(_rows_of, batch))
        state, loss = step(state, gbatch)
        report({"loss": loss}, checkpoint=state if (i + 1) % every == 0 or i + 1 == config["steps"] else None)


def train_tiny_lm(
    *,
    lm: LMConfig | None = None,
    steps: int = 60,
    batch_size: int = 16,
    seq_len: int = 64,
    lr: float = 3e-3,
    seed: int = 0,
    corpus_bytes: int = 200_000,
    storage_path: str | None = None,
    name: str = "tiny-lm",
    topology: str = "2x2x2",
    accelerator_type: str = "TPU-V4",
    chips_per_host: int | None = None,
    progress: bool = False,
) -> Any:
    """Trains a byte-level LM on standard-library source with ``JaxTrainer`` on one slice.

    Needs a running Ray cluster (e.g. a ``SimulatedCluster``) with a free slice of
    ``topology``. The defaults train in seconds on 2 CPU cores.

    Returns:
        The ``rayslice.train.Result``; ``result.checkpoint.path`` is what
        ``LLMConfig(checkpoint=...)`` takes.

    Example:
        >>> result = train_tiny_lm(steps=40)  # doctest: +SKIP
        >>> app = build_app(LLMConfig(checkpoint=result.checkpoint.path))  # doctest: +SKIP
    """
    from rayslice.train import CheckpointConfig, JaxTrainer, RunConfig, ScalingConfig

    lm = lm or LMConfig()
    if seq_len + 1 > lm.max_len:
        raise ValueError(f"seq_len={seq_len} must be < lm.max_len={lm.max_len}")
    tokens = encode_corpus(stdlib_corpus(corpus_bytes))
    config = {
        "lm": lm.to_dict(),
        "tokens": tokens,
        "steps": steps,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "lr": lr,
        "seed": seed,
        "every": steps,
    }
    trainer = JaxTrainer(
        lm_train_loop,
        train_loop_config=config,
        scaling_config=ScalingConfig(
            topology=topology, accelerator_type=accelerator_type, chips_per_host=chips_per_host
        ),
        run_config=RunConfig(
            name=name,
            storage_path=storage_path or tempfile.mkdtemp(prefix="rayslice-lm-"),
            checkpoint_config=CheckpointConfig(num_to_keep=1),
            progress=progress,
        ),
    )
    result = trainer.fit()
    if result.error is not None:
        raise result.error
    return result
