"""LLM serving on a whole slice: an OpenAI-compatible, streaming, continuously batched JAX transformer.

A decoder-only transformer (:mod:`~rayslice.serve.llm.model`, Flax) is
sharded over every device of every host of one slice (tensor-parallel
weights, KV cache split on heads and batch slots; ``LLMConfig(layout=...)``
chooses whether tensor-parallel groups span hosts); an engine
(:mod:`~rayslice.serve.llm.engine`) batches requests continuously into fixed
slots with a KV cache (prefill + decode, bucketed prompt lengths: nothing
recompiles per request); a Ray Serve replica that owns the slice answers the
OpenAI HTTP API (:mod:`~rayslice.serve.llm.api`), streaming tokens as server-sent
events. Weights come from a ``rayslice.train.JaxTrainer`` checkpoint
(:func:`train_tiny_lm` trains one on the standard library's source) or random
initialisation; the tokenizer is byte-level (offline, nothing downloaded).

Example:
    >>> from rayslice.serve.llm import LLMConfig, EngineConfig
    >>> LLMConfig(engine=EngineConfig(num_slots=8)).engine.num_slots
    8
    >>> app = build_app(LLMConfig(checkpoint="/runs/tiny-lm"))  # doctest: +SKIP
"""

from rayslice.serve.llm.api import APIError
from rayslice.serve.llm.deployment import LLMConfig, LLMServer, app, build_app, llm_deployment
from rayslice.serve.llm.engine import Engine, EngineConfig, EngineError, SamplingParams, Scheduler, local_engine
from rayslice.serve.llm.model import LMConfig
from rayslice.serve.llm.programs import compile_count
from rayslice.serve.llm.tokenizer import ByteTokenizer
from rayslice.serve.llm.training import lm_train_loop, stdlib_corpus, train_tiny_lm
from rayslice.serve.llm.weights import load_params

__all__ = [
    "APIError",
    "ByteTokenizer",
    "Engine",
    "EngineConfig",
    "EngineError",
    "LLMConfig",
    "LLMServer",
    "LMConfig",
    "SamplingParams",
    "Scheduler",
    "app",
    "build_app",
    "compile_count",
    "llm_deployment",
    "lm_train_loop",
    "load_params",
    "local_engine",
    "stdlib_corpus",
    "train_tiny_lm",
]
