"""The OpenAI HTTP API subset: request parsing and validation, responses, SSE chunks, errors (pure).

Routes (served by :mod:`rayslice.serve.llm.deployment`):

- ``POST /v1/completions``: ``prompt`` (a string, a one-string list, or a list
  of token ids), ``max_tokens`` (default ``EngineConfig.default_max_tokens``),
  ``temperature``, ``top_p``, ``stop``, ``seed``, ``stream``,
  ``stream_options.include_usage``; ``n`` must be 1.
- ``POST /v1/chat/completions``: ``messages`` (roles system / user /
  assistant, string content or a list of text parts) in the ChatML template of
  :mod:`~rayslice.serve.llm.tokenizer`; ``max_tokens`` or
  ``max_completion_tokens`` (default: as much as the context allows, up to the limit).
- ``GET /v1/models`` and ``GET /v1/models/{id}``.

Errors are OpenAI error objects, ``{"error": {"message", "type", "param",
"code"}}``, with 400 (invalid request), 404 (unknown model or route), 405,
413, 422 never (OpenAI answers 400), 503 (the slice failed; retry).

Extension (as vLLM's): ``"return_token_ids": true`` adds ``token_ids`` (the
generated ids) to each non-streaming choice.

Example:
    >>> spec = parse_completion({"model": "m", "prompt": "hi", "max_tokens": 4}, "m", Limits(64, 32, 16))
    >>> spec.prompt, spec.params.max_tokens, spec.stream
    ([104, 105], 4, False)
    >>> parse_completion({"model": "x", "prompt": "hi"}, "m", Limits(64, 32, 16))
    Traceback (most recent call last):
    ...
    rayslice.serve.llm.api.APIError: The model 'x' does not exist; available: m
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
import uuid
from collections.abc import Mapping
from typing import Any

from rayslice.serve.llm.engine import SamplingParams
from rayslice.serve.llm.tokenizer import ROLES, ByteTokenizer

_TOKENIZER = ByteTokenizer()

_COMMON = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "stop",
    "seed",
    "stream",
    "stream_options",
    "n",
    "user",
    "presence_penalty",
    "frequency_penalty",
    "logprobs",
    "return_token_ids",
}
COMPLETION_KEYS = _COMMON | {"prompt", "echo", "best_of", "suffix", "logit_bias"}
CHAT_KEYS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "logit_bias", "response_format"}


class APIError(Exception):
    """An error answered as an OpenAI error object with HTTP ``status``."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclasses.dataclass(frozen=True)
class Limits:
    """What a request may ask of the engine (from its :class:`EngineConfig`)."""

    max_context: int
    max_tokens_limit: int
    default_max_tokens: int
    max_prompt_tokens: int | None = None

    @property
    def prompt_limit(self) -> int:
        return self.max_prompt_tokens if self.max_prompt_tokens is not None else self.max_context - 1


@dataclasses.dataclass(frozen=True)
class GenerationSpec:
    """A validated request: prompt token ids, sampling, streaming options."""

    kind: str  # "completion" or "chat"
    prompt: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    return_token_ids: bool
    model: str


def parse_json(body: bytes, max_bytes: int = 1 << 20) -> dict[str, Any]:
    if len(body) > max_bytes:
        raise APIError(f"The request body of {len(body)} bytes exceeds the limit of {max_bytes}", 413)
    try:
        payload = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(f"We could not parse the JSON body of your request: {e}") from None
    if not isinstance(payload, dict):
        raise APIError(f"The request body must be a JSON object, got {type(payload).__name__}")
    return payload


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(body: Mapping[str, Any], key: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise APIError(f"{v!r} is not of type 'number' - '{key}'", param=key, code="invalid_type")
    if v < lo or v > hi or (lo_open and v == lo):
        raise APIError(
            f"'{key}' must be {'>' if lo_open else '>='} {lo:g} and <= {hi:g}, got {v}", param=key, code="invalid_value"
        )
    return float(v)


def _check_keys(body: Mapping[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise APIError(f"Unrecognized request argument supplied: {unknown[0]}", param=unknown[0])


def _check_model(body: Mapping[str, Any], model: str) -> str:
    name = body.get("model")
    if name is None:
        raise APIError("you must provide a model parameter", param="model", code="missing_required_parameter")
    if not isinstance(name, str):
        raise APIError(f"{name!r} is not of type 'string' - 'model'", param="model", code="invalid_type")
    if name != model:
        raise APIError(
            f"The model '{name}' does not exist; available: {model}", 404, param="model", code="model_not_found"
        )
    return name


def _unsupported(body: Mapping[str, Any]) -> None:
    n = body.get("n")
    if n is not None and (not _is_int(n) or n != 1):
        raise APIError(f"n={n!r} is not supported: only n=1", param="n", code="invalid_value")
    for key in ("best_of",):
        if body.get(key) not in (None, 1):
            raise APIError(f"'{key}' is not supported", param=key, code="invalid_value")
    for key in ("presence_penalty", "frequency_penalty"):
        if body.get(key) not in (None, 0, 0.0):
            raise APIError(f"'{key}' is not supported (only 0)", param=key, code="invalid_value")
    for key in ("logprobs", "top_logprobs", "echo", "suffix", "logit_bias", "response_format"):
        if body.get(key) not in (None, False, {}):
            raise APIError(f"'{key}' is not supported by this server", param=key, code="invalid_value")


def _params(
    body: Mapping[str, Any], limits: Limits, prompt_len: int, default_max: int, max_key: str = "max_tokens"
) -> SamplingParams:
    mt = body.get(max_key)
    if mt is None:
        mt = default_max
    elif not _is_int(mt):
        raise APIError(f"{mt!r} is not of type 'integer' - '{max_key}'", param=max_key, code="invalid_type")
    elif mt < 1:
        raise APIError(f"'{max_key}' must be >= 1, got {mt}", param=max_key, code="invalid_value")
    elif mt > limits.max_tokens_limit:
        raise APIError(
            f"'{max_key}' is too large: {mt}. This model supports at most {limits.max_tokens_limit} completion tokens",
            param=max_key,
            code="invalid_value",
        )
    if prompt_len > limits.prompt_limit:
        raise APIError(
            f"This model's maximum context length is {limits.max_context} tokens and prompts may hold "
            f"at most {limits.prompt_limit}; your prompt is {prompt_len} tokens",
            param="messages" if max_key != "max_tokens" or "messages" in body else "prompt",
            code="context_length_exceeded",
        )
    if prompt_len + mt > limits.max_context:
        raise APIError(
            f"This model's maximum context length is {limits.max_context} tokens. However, you "
            f"requested {prompt_len + mt} tokens ({prompt_len} in the prompt, {mt} in the completion). "
            "Please reduce the prompt or the completion length",
            param=max_key,
            code="context_length_exceeded",
        )
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,) if stop else ()
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(dict.fromkeys(s for s in stop if s))
    else:
        raise APIError(
            f"{stop!r} is not valid under any of the given schemas - 'stop': a string or a list of strings",
            param="stop",
            code="invalid_type",
        )
    if len(stops) > 4:
        raise APIError(f"'stop' holds {len(stops)} strings; at most 4 are allowed", param="stop", code="invalid_value")
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise APIError(f"{seed!r} is not of type 'integer' - 'seed'", param="seed", code="invalid_type")
    return SamplingParams(
        max_tokens=mt, temperature=temperature, top_p=top_p, stop=stops, seed=None if seed is None else seed % (1 << 31)
    )


def _stream_opts(body: Mapping[str, Any]) -> tuple[bool, bool, bool]:
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise APIError(f"{stream!r} is not of type 'boolean' - 'stream'", param="stream", code="invalid_type")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict) or not isinstance(opts.get("include_usage", False), bool):
        raise APIError(
            "'stream_options' must be an object like {\"include_usage\": true}",
            param="stream_options",
            code="invalid_type",
        )
    if opts and not stream:
        raise APIError("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    rti = body.get("return_token_ids", False)
    if not isinstance(rti, bool):
        raise APIError(
            f"{rti!r} is not of type 'boolean' - 'return_token_ids'", param="return_token_ids", code="invalid_type"
        )
    return stream, bool(opts.get("include_usage", False)), rti


def parse_completion(body: Mapping[str, Any], model: str, limits: Limits) -> GenerationSpec:
    """Validates a ``/v1/completions`` body (raises :class:`APIError`)."""
    _check_keys(body, COMPLETION_KEYS)
    name = _check_model(body, model)
    _unsupported(body)
    if "prompt" not in body:
        raise APIError("you must provide a prompt parameter", param="prompt", code="missing_required_parameter")
    p = body["prompt"]
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
        p = p[0]
    if isinstance(p, str):
        prompt = _TOKENIZER.encode(p)
    elif isinstance(p, list) and p and all(_is_int(t) for t in p):
        bad = [t for t in p if not 0 <= t < _TOKENIZER.vocab_size]
        if bad:
            raise APIError(
                f"token id {bad[0]} is out of range: valid ids are 0..{_TOKENIZER.vocab_size - 1}",
                param="prompt",
                code="invalid_value",
            )
        prompt = list(p)
    else:
        raise APIError(
            "'prompt' must be a string, a list of one string, or a non-empty list of token ids",
            param="prompt",
            code="invalid_type",
        )
    if not prompt:
        raise APIError("'prompt' is empty: it needs at least one token", param="prompt", code="invalid_value")
    stream, usage, rti = _stream_opts(body)
    params = _params(body, limits, len(prompt), limits.default_max_tokens)
    return GenerationSpec("completion", prompt, params, stream, usage, rti, name)


def _content(m: Mapping[str, Any], i: int) -> str:
    c = m.get("content")
    if isinstance(c, str):
        return c
    if isinstance(c, list):
        parts = []
        for part in c:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(
                    f"messages[{i}].content: only text parts are supported ({{'type': 'text', 'text': ...}}}})",
                    param=f"messages.[{i}].content",
                    code="invalid_value",
                )
            parts.append(part["text"])
        return "".join(parts)
    raise APIError(
        f"messages[{i}].content must be a string or a list of text parts",
        param=f"messages.[{i}].content",
        code="invalid_type",
    )


def parse_chat(body: Mapping[str, Any], model: str, limits: Limits) -> GenerationSpec:
    """Validates a ``/v1/chat/completions`` body (raises :class:`APIError`)."""
    _check_keys(body, CHAT_KEYS)
    name = _check_model(body, model)
    _unsupported(body)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise APIError(
            "'messages' must be a non-empty list of {role, content} objects",
            param="messages",
            code="invalid_type" if msgs is not None else "missing_required_parameter",
        )
    clean = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise APIError(f"messages[{i}] must be an object", param=f"messages.[{i}]", code="invalid_type")
        role = m.get("role")
        if role == "developer":
            role = "system"
        if role not in ROLES:
            raise APIError(
                f"messages[{i}].role={role!r} is not supported; valid: {', '.join(ROLES)}",
                param=f"messages.[{i}].role",
                code="invalid_value",
            )
        clean.append({"role": role, "content": _content(m, i)})
    prompt = _TOKENIZER.apply_chat_template(clean)
    stream, usage, rti = _stream_opts(body)
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    default = max(1, min(limits.max_tokens_limit, limits.max_context - len(prompt)))
    params = _params(body, limits, len(prompt), default, key)
    return GenerationSpec("chat", prompt, params, stream, usage, rti, name)


# -- responses ------------------------------------------------------------------------------------


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def full_response(
    spec: GenerationSpec,
    rid: str,
    created: int,
    text: str,
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
    token_ids: list[int] | None = None,
) -> dict[str, Any]:
    """A non-streaming ``text_completion`` or ``chat.completion`` object."""
    if spec.kind == "chat":
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": finish_reason,
            "logprobs": None,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
        obj = "text_completion"
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": spec.model,
        "choices": [choice],
        "usage": usage(prompt_tokens, completion_tokens),
    }


def chunk(
    spec: GenerationSpec,
    rid: str,
    created: int,
    text: str | None,
    finish_reason: str | None = None,
    *,
    role: bool = False,
    usage_obj: dict[str, int] | None = None,
    empty: bool = False,
) -> str:
    """One server-sent event: ``data: {...}\\n\\n``."""
    if spec.kind == "chat":
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choices = [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]
        obj = "chat.completion.chunk"
    else:
        choices = [{"index": 0, "text": text or "", "finish_reason": finish_reason, "logprobs": None}]
        obj = "text_completion"
    payload: dict[str, Any] = {
        "id": rid,
        "object": obj,
        "created": created,
        "model": spec.model,
        "choices": [] if empty else choices,
    }
    if usage_obj is not None or (spec.include_usage and not empty):
        payload["usage"] = usage_obj
    return f"data: {json.dumps(payload)}\n\n"


def sse_error(err: APIError) -> str:
    return f"data: {json.dumps(err.body())}\n\n"


DONE = "data: [DONE]\n\n"


def models_list(model: str, created: int, max_context: int) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(model, created, max_context)]}


def model_card(model: str, created: int, max_context: int) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": created, "owned_by": "rayslice", "max_model_len": max_context}


def now() -> int:
    return int(time.time())
