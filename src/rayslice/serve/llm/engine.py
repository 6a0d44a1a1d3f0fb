"""Continuous batching: requests join and leave a fixed set of slots between decode steps.

The :class:`Scheduler` is pure Python (no JAX, no Ray): each iteration it
admits waiting requests into free slots (a *prefill* each, padded to the
smallest prompt-length bucket), decodes one token for every running slot in a
single fixed-shape step, turns tokens into text (incremental UTF-8, stop
strings held back until they cannot match) and frees the slots of finished or
cancelled requests. A long generation therefore never holds short ones back:
a new request starts at the next iteration, not when the batch drains.

The :class:`Engine` drives a scheduler with an *executor* that runs the
steps: :class:`LocalExecutor` on this process's devices, or the slice
deployment's executor, which runs each step on every host of a slice.

Example:
    >>> cfg = EngineConfig(num_slots=4, max_context=64, prefill_buckets=(16, 64), max_tokens_limit=32)
    >>> cfg.bucket_for(10), cfg.bucket_for(17)
    (16, 64)
    >>> SamplingParams(max_tokens=8, temperature=0.0).greedy
    True
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any, Protocol

import numpy as np

from rayslice._validate import check_float, check_int, check_optional, check_str_list
from rayslice.errors import InvalidArgument
from rayslice.serve.llm.runner import Decode, Prefill, Step, StepResult
from rayslice.serve.llm.tokenizer import ByteTokenizer, IncrementalDecoder, StopMatcher


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Slots, context and compiled shapes of an engine. Validated on construction.

    Args:
        num_slots: Sequences decoded together (the fixed decode batch).
        max_context: Prompt plus completion tokens per sequence (the KV cache length).
        prefill_buckets: Prompt lengths that are compiled; a prompt is padded to
            the smallest bucket that holds it. The largest must be <= max_context.
        max_tokens_limit: The largest ``max_tokens`` a request may ask for.
        default_max_tokens: ``max_tokens`` of a completion request that gives none.
        max_prefills_per_step: New requests admitted per iteration (bounds the
            delay a burst of arrivals adds to running streams).
    """

    num_slots: int = 16
    max_context: int = 256
    prefill_buckets: tuple[int, ...] = (32, 64, 128, 256)
    max_tokens_limit: int = 256
    default_max_tokens: int = 16
    max_prefills_per_step: int = 4

    def __post_init__(self) -> None:
        check_int("num_slots", self.num_slots, minimum=1, maximum=4096)
        check_int("max_context", self.max_context, minimum=2)
        check_int("max_tokens_limit", self.max_tokens_limit, minimum=1)
        check_int("default_max_tokens", self.default_max_tokens, minimum=1, maximum=self.max_tokens_limit)
        check_int("max_prefills_per_step", self.max_prefills_per_step, minimum=1)
        buckets = tuple(self.prefill_buckets)
        if (
            not buckets
            or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in buckets)
            or list(buckets) != sorted(set(buckets))
            or buckets[-1] > self.max_context
        ):
            raise InvalidArgument(
                f"prefill_buckets={buckets!r} is not valid: expected increasing positive "
                f"integers, the largest <= max_context={self.max_context}"
            )
        object.__setattr__(self, "prefill_buckets", buckets)

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt: it must fit a bucket and leave room for one generated token."""
        return min(self.prefill_buckets[-1], self.max_context - 1)

    def bucket_for(self, n: int) -> int:
        for b in self.prefill_buckets:
            if b >= n:
                return b
        raise ValueError(f"a prompt of {n} tokens exceeds the largest bucket {self.prefill_buckets[-1]}")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request samples. Validated on construction.

    Args:
        max_tokens: Tokens to generate at most.
        temperature: 0 is greedy; otherwise logits are divided by it (<= 2).
        top_p: Nucleus sampling: the smallest set of tokens whose mass reaches it.
        stop: Up to 4 strings; generation stops before the first one (not returned).
        seed: Makes sampling reproducible (None: random).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        check_int("max_tokens", self.max_tokens, minimum=1)
        object.__setattr__(self, "temperature", check_float("temperature", self.temperature, minimum=0.0, maximum=2.0))
        object.__setattr__(
            self, "top_p", check_float("top_p", self.top_p, minimum=0.0, maximum=1.0, exclusive_min=True)
        )
        stop = check_str_list("stop", list(self.stop))
        if len(stop) > 4 or any(not s for s in stop):
            raise InvalidArgument(f"stop={list(stop)!r} is not valid: expected at most 4 non-empty strings")
        object.__setattr__(self, "stop", tuple(stop))
        check_optional(check_int, "seed", self.seed, minimum=0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclasses.dataclass(frozen=True)
class Delta:
    """New text (possibly empty) and the token ids that produced it."""

    text: str
    token_ids: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Finished:
    """The end of a request: ``reason`` is "stop" (EOS or a stop string), "length" or "cancelled"."""

    reason: str
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float | None


class EngineError(RuntimeError):
    """The engine cannot serve (its devices or hosts failed); the request should be retried elsewhere."""


class Request:
    """One generation: its slot, tokens so far, and the queue its events go to."""

    _ids = itertools.count()

    def __init__(self, prompt: Sequence[int], params: SamplingParams, stop_ids: Sequence[int]) -> None:
        self.id = next(Request._ids)
        self.prompt = tuple(int(t) for t in prompt)
        self.params = params
        self.seed = params.seed if params.seed is not None else secrets.randbits(31)
        self.stop_ids = frozenset(stop_ids)
        self.slot: int | None = None
        self.generated: list[int] = []
        self.decoder = IncrementalDecoder()
        self.matcher = StopMatcher(params.stop)
        self.events: asyncio.Queue[Delta | Finished | BaseException] | None = None
        self.outbox: list[Delta | Finished] = []  # events when no queue is attached (pure use)
        self.finished: Finished | None = None
        self.cancelled = False
        self.created = time.perf_counter()
        self.first_token_at: float | None = None

    def emit(self, event: Delta | Finished) -> None:
        if self.events is not None:
            self.events.put_nowait(event)
        else:
            self.outbox.append(event)


class Scheduler:
    """Slot bookkeeping and text (pure): ``plan()`` a step, run it elsewhere, ``apply()`` its result.

    Args:
        cfg: Slots, context and buckets.
        tokenizer: Turns tokens into text (byte-level by default).
        groups: The slots form this many equal groups (the hosts of a
            ``"data_tensor"`` layout, each prefilling one prompt per program
            run): a new request takes a free slot of the group with the fewest
            requests admitted in this step, then the most free slots.

    Example:
        >>> s = Scheduler(EngineConfig(num_slots=4, max_context=32, prefill_buckets=(32,)), groups=2)
        >>> reqs = [s.add([1, 2], SamplingParams(max_tokens=2)) for _ in range(3)]
        >>> step = s.plan()
        >>> [p.slot for p in step.prefills]
        [0, 2, 1]
    """

    def __init__(self, cfg: EngineConfig, tokenizer: ByteTokenizer | None = None, groups: int = 1) -> None:
        check_int("groups", groups, minimum=1)
        if cfg.num_slots % groups:
            raise InvalidArgument(f"groups={groups} is not valid: expected a divisor of num_slots={cfg.num_slots}")
        self.cfg = cfg
        self.groups = groups
        self.tokenizer = tokenizer or ByteTokenizer()
        self.waiting: collections.deque[Request] = collections.deque()
        self.slots: list[Request | None] = [None] * cfg.num_slots
        self.lengths = [0] * cfg.num_slots  # tokens in each slot's cache
        self.stats = {"steps": 0, "prefills": 0, "decode_steps": 0, "tokens": 0, "finished": 0, "cancelled": 0}
        self._planned: tuple[list[Request], list[Request]] | None = None

    # -- requests in and out ----------------------------------------------------
    def validate(self, prompt: Sequence[int], params: SamplingParams) -> None:
        """Raises ``ValueError`` when the request cannot fit (prompt or max_tokens too long)."""
        if not prompt:
            raise ValueError("the prompt is empty: it needs at least one token")
        if len(prompt) > self.cfg.max_prompt_tokens:
            raise ValueError(
                f"the prompt is {len(prompt)} tokens; this model's context allows at most "
                f"{self.cfg.max_prompt_tokens} prompt tokens (context length {self.cfg.max_context})"
            )
        if params.max_tokens > self.cfg.max_tokens_limit:
            raise ValueError(f"max_tokens={params.max_tokens} exceeds the limit of {self.cfg.max_tokens_limit}")
        if len(prompt) + params.max_tokens > self.cfg.max_context:
            raise ValueError(
                f"this model's maximum context length is {self.cfg.max_context} tokens; the request "
                f"asks for {len(prompt) + params.max_tokens} ({len(prompt)} in the prompt, "
                f"{params.max_tokens} for the completion)"
            )

    def add(self, prompt: Sequence[int], params: SamplingParams) -> Request:
        self.validate(prompt, params)
        req = Request(prompt, params, self.tokenizer.stop_ids)
        self.waiting.append(req)
        return req

    def cancel(self, req: Request) -> None:
        """Frees the request's slot (or drops it from the queue) before the next step."""
        if req.finished is not None or req.cancelled:
            return
        req.cancelled = True
        self.stats["cancelled"] += 1
        if req.slot is None:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
            self._finish(req, "cancelled")
        # A request in a slot is finished when the current step's result is applied
        # (or right away, when no step is running): see apply() and reap().

    def reap(self) -> None:
        """Finishes cancelled requests that hold a slot (call between steps)."""
        for req in self.slots:
            if req is not None and req.cancelled and req.finished is None:
                self._finish(req, "cancelled")

    @property
    def busy_slots(self) -> int:
        return sum(r is not None for r in self.slots)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or self.busy_slots > 0

    # -- one iteration --------------------------------------------------------------
    def plan(self) -> Step | None:
        """The next step: prefills for waiting requests that get a free slot, a decode for running ones."""
        self.reap()
        running = [r for r in self.slots if r is not None]
        admitted: list[Request] = []
        per = self.cfg.num_slots // self.groups
        free = [[i for i in range(g * per, (g + 1) * per) if self.slots[i] is None] for g in range(self.groups)]
        new = [0] * self.groups
        while self.waiting and any(free) and len(admitted) < self.cfg.max_prefills_per_step:
            g = min((g for g in range(self.groups) if free[g]), key=lambda g: (new[g], -len(free[g]), g))
            req = self.waiting.popleft()
            req.slot = free[g].pop(0)
            new[g] += 1
            self.slots[req.slot] = req
            admitted.append(req)
        if not admitted and not running:
            self._planned = None
            return None
        prefills = tuple(
            Prefill(
                slot=_slot(r),
                tokens=r.prompt,
                bucket=self.cfg.bucket_for(len(r.prompt)),
                temperature=r.params.temperature,
                top_p=r.params.top_p,
                seed=r.seed,
            )
            for r in admitted
        )
        decode = None
        if running:
            n = self.cfg.num_slots
            active, temp = np.zeros(n, bool), np.zeros(n, np.float32)
            top_p, seeds = np.ones(n, np.float32), np.zeros(n, np.uint32)
            for r in running:
                active[r.slot], temp[r.slot], top_p[r.slot], seeds[r.slot] = (
                    True,
                    r.params.temperature,
                    r.params.top_p,
                    r.seed,
                )
            decode = Decode(active, temp, top_p, seeds)
        self._planned = (admitted, running)
        return Step(prefills, decode)

    def apply(self, result: StepResult) -> None:
        """Feeds a step's tokens to their requests; finishes and frees slots."""
        if self._planned is None:
            raise RuntimeError("apply() without a planned step")
        admitted, running = self._planned
        self._planned = None
        self.stats["steps"] += 1
        self.stats["prefills"] += len(admitted)
        for req, tok in zip(admitted, result.prefill_tokens):
            self.lengths[_slot(req)] = len(req.prompt)
            self._token(req, int(tok))
        if running:
            self.stats["decode_steps"] += 1
            assert result.decode_tokens is not None
            for req in running:
                self.lengths[_slot(req)] += 1
                self._token(req, int(result.decode_tokens[_slot(req)]))
        self.reap()

    def fail_all(self, error: BaseException) -> None:
        """Every queued and running request gets ``error`` (the engine cannot continue)."""
        for req in [*self.waiting, *(r for r in self.slots if r is not None)]:
            if req.finished is None:
                req.finished = Finished("error", len(req.prompt), len(req.generated), None)
                if req.events is not None:
                    req.events.put_nowait(error)
        self.waiting.clear()
        self.slots = [None] * self.cfg.num_slots
        self._planned = None

    # -- internals ------------------------------------------------------------------
    def _token(self, req: Request, tok: int) -> None:
        if req.finished is not None:
            return  # cancelled while the step ran: the token is dropped
        if req.first_token_at is None:
            req.first_token_at = time.perf_counter()
        req.generated.append(tok)
        self.stats["tokens"] += 1
        if tok in req.stop_ids:
            self._emit_text(req, req.decoder.flush(), (tok,), final=True)
            self._finish(req, "stop")
            return
        text, stopped = req.matcher.feed(req.decoder.feed(tok))
        req.emit(Delta(text, (tok,)))
        if stopped:
            self._finish(req, "stop")
        elif len(req.generated) >= req.params.max_tokens or self.lengths[_slot(req)] >= self.cfg.max_context:
            self._emit_text(req, req.decoder.flush(), (), final=True)
            self._finish(req, "length")

    def _emit_text(self, req: Request, text: str, ids: tuple[int, ...], final: bool) -> None:
        out, stopped = req.matcher.feed(text)
        if final and not stopped:
            out += req.matcher.flush()
        if out or ids:
            req.emit(Delta(out, ids))

    def _finish(self, req: Request, reason: str) -> None:
        ttft = None if req.first_token_at is None else req.first_token_at - req.created
        req.finished = Finished(reason, len(req.prompt), len(req.generated), ttft)
        if reason != "cancelled":
            self.stats["finished"] += 1
        if req.slot is not None and self.slots[req.slot] is req:
            self.slots[req.slot] = None
        req.emit(req.finished)


def _slot(req: Request) -> int:
    if req.slot is None:
        raise RuntimeError(f"request {req.id} holds no slot")
    return req.slot


class Executor(Protocol):
    """Runs a step on the devices (in this process, or on every host of a slice)."""

    slot_groups: int  # the scheduler's slot groups (see Scheduler)

    async def run(self, step: Step) -> StepResult: ...

    def compiles(self) -> int: ...


class LocalExecutor:
    """Runs steps on this process's devices (a thread, so the event loop keeps streaming)."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.slot_groups = int(getattr(runner, "groups", 1))

    async def run(self, step: Step) -> StepResult:
        return await asyncio.to_thread(self.runner.step, step)

    def compiles(self) -> int:
        from rayslice.serve.llm.programs import compile_count

        return compile_count()


class Engine:
    """Drives a :class:`Scheduler` with an executor, one iteration after another, while there is work.

    ``generate(prompt_ids, params)`` is an async iterator of :class:`Delta`
    events ending with one :class:`Finished`; leaving it early (a client that
    went away) cancels the request and frees its slot before the next step.
    """

    def __init__(self, executor: Executor, cfg: EngineConfig, tokenizer: ByteTokenizer | None = None) -> None:
        self.executor = executor
        self.cfg = cfg
        self.scheduler = Scheduler(cfg, tokenizer, groups=int(getattr(executor, "slot_groups", 1)))
        self.broken: EngineError | None = None
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self.step_times: collections.deque[float] = collections.deque(maxlen=1000)
        self.device_times: collections.deque[float] = collections.deque(maxlen=1000)
        self.prefill_step_times: collections.deque[float] = collections.deque(maxlen=1000)
        self.prefill_device_times: collections.deque[float] = collections.deque(maxlen=1000)

    def _ensure_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._task.get_loop() is not loop:
            self._wake = asyncio.Event()
            self._task = loop.create_task(self._loop())

    async def _loop(self) -> None:
        assert self._wake is not None
        while True:
            step = self.scheduler.plan()
            if step is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            t0 = time.perf_counter()
            try:
                result = await self.executor.run(step)
            except Exception as e:  # the devices or a host failed: nothing more can run here
                self.broken = e if isinstance(e, EngineError) else EngineError(f"the model step failed: {e}")
                self.scheduler.fail_all(self.broken)
                return
            self.step_times.append(time.perf_counter() - t0)
            self.device_times.append(result.device_s)
            if step.decode is None:  # a step that only prefills: what a first token waits for on an idle engine
                self.prefill_step_times.append(time.perf_counter() - t0)
                self.prefill_device_times.append(result.device_s)
            self.scheduler.apply(result)

    def submit(self, prompt: Sequence[int], params: SamplingParams) -> Request:
        """Queues a request (raises ``ValueError`` if it cannot fit, :class:`EngineError` if broken)."""
        if self.broken is not None:
            raise self.broken
        req = self.scheduler.add(prompt, params)
        req.events = asyncio.Queue()
        self._ensure_loop()
        assert self._wake is not None
        self._wake.set()
        return req

    def cancel(self, req: Request) -> None:
        self.scheduler.cancel(req)
        if self.scheduler._planned is None:  # no step in flight: free the slot now
            self.scheduler.reap()

    async def events(self, req: Request) -> AsyncGenerator[Delta | Finished, None]:
        """The request's events; closing the iterator early cancels the request."""
        assert req.events is not None
        try:
            while True:
                ev = await req.events.get()
                if isinstance(ev, BaseException):
                    raise ev
                yield ev
                if isinstance(ev, Finished):
                    return
        finally:
            if req.finished is None:
                self.cancel(req)

    async def generate(self, prompt: Sequence[int], params: SamplingParams) -> AsyncIterator[Delta | Finished]:
        req = self.submit(prompt, params)
        async for ev in self.events(req):
            yield ev

    async def complete(self, prompt: Sequence[int], params: SamplingParams) -> tuple[str, list[int], Finished]:
        """Runs a request to the end: (text, generated token ids, finish)."""
        text: list[str] = []
        ids: list[int] = []
        async for ev in self.generate(prompt, params):
            if isinstance(ev, Delta):
                text.append(ev.text)
                ids.extend(ev.token_ids)
            else:
                return "".join(text), ids, ev
        raise EngineError("the request ended without finishing")

    def stats(self) -> dict[str, Any]:
        s = self.scheduler
        return {
            **s.stats,
            "slots_total": self.cfg.num_slots,
            "slots_busy": s.busy_slots,
            "waiting": len(s.waiting),
            "compiles": self.executor.compiles(),
            "broken": None if self.broken is None else str(self.broken),
            "step_ms_p50": _p50_ms(self.step_times),
            "device_step_ms_p50": _p50_ms(self.device_times),
            "prefill_step_ms_p50": _p50_ms(self.prefill_step_times),
            "prefill_device_ms_p50": _p50_ms(self.prefill_device_times),
        }

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass


def _p50_ms(values: Any) -> float | None:
    v = sorted(values)
    return round(1000 * v[len(v) // 2], 3) if v else None


def local_engine(
    lm: Any,
    cfg: EngineConfig,
    params: Any = None,
    *,
    seed: int = 0,
    devices: Any = None,
    layout: str = "auto",
    tensor_parallel: int | None = None,
    mesh: Any = None,
    warm_up: bool = True,
) -> Engine:
    """An engine on this process's devices (random weights from ``seed`` when ``params`` is None).

    ``devices``, ``layout``, ``tensor_parallel`` and ``mesh`` are :class:`~rayslice.serve.llm.runner.ModelRunner`'s.

    Example:
        >>> from rayslice.serve.llm.model import LMConfig
        >>> lm = LMConfig(d_model=32, num_layers=1, num_heads=4, d_ff=64, max_len=32)
        >>> eng = local_engine(lm, EngineConfig(num_slots=2, max_context=32, prefill_buckets=(8, 32),
        ...                    max_tokens_limit=8, default_max_tokens=4))
        >>> text, ids, fin = asyncio.run(eng.complete([104, 105], SamplingParams(max_tokens=4, temperature=0)))
        >>> fin.reason, fin.completion_tokens
        ('length', 4)
    """
    from rayslice.serve.llm.model import init_params
    from rayslice.serve.llm.runner import ModelRunner

    tok = ByteTokenizer()
    if params is None:
        params = init_params(lm, seed)
    runner = ModelRunner(
        lm,
        params,
        num_slots=cfg.num_slots,
        max_context=cfg.max_context,
        vocab_limit=tok.vocab_size,
        devices=devices,
        layout=layout,
        tensor_parallel=tensor_parallel,
        mesh=mesh,
    )
    if warm_up:
        runner.warm_up(cfg.prefill_buckets)
    return Engine(LocalExecutor(runner), cfg, tok)
