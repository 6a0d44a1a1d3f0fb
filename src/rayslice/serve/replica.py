"""The replica behind a slice deployment: one whole slice, a gang on it, outcomes as values.

Every SPMD step ends as a :class:`~rayslice.errors.RunOutcome` (the value
type the training controller uses), classified once: the model raised
(FAILED, HTTP 500), a host was lost (PREEMPTED, 503: the replica turns
unhealthy so Serve replaces it) or the deadline passed (TIMEOUT, 503). A
collective failing on host 0 is often only the echo of another host dying, so
a failed step pings every host before it is called the model's fault.

Example:
    >>> http_status(RunOutcome.of(ValueError("bad input"))), http_status(Outcome.PREEMPTED)
    (500, 503)
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from rayslice._validate import check_bool, check_instance, fail
from rayslice.errors import GangError, Outcome, ReservationError, RunOutcome, describe
from rayslice.serve.config import SliceServeConfig
from rayslice.serve.schema import InputSpec, RequestError, parse_body, rows_of, validate_untyped

if TYPE_CHECKING:
    from rayslice.placement import SlicePlacementGroup

__all__ = ["http_status", "make_replica_class"]

logger = logging.getLogger(__name__)


def http_status(outcome: RunOutcome | Outcome) -> int:
    """The HTTP status for how an SPMD step ended: 200 OK, 500 the model raised, 503 otherwise.

    Example:
        >>> http_status(RunOutcome.of(ValueError("bad input"))), http_status(Outcome.PREEMPTED)
        (500, 503)
    """
    kind = outcome.outcome if isinstance(outcome, RunOutcome) else outcome
    return {Outcome.OK: 200, Outcome.FAILED: 500}.get(kind, 503)


def _bucket(n: int, cap: int) -> int:
    """Pads batches to powers of two (up to ``cap``) so jit compiles a few shapes, not one per size."""
    size = 1
    while size < n:
        size *= 2
    return min(size, max(cap, n))


def _one_line_reservation_error(e: ReservationError, deployment: str) -> ReservationError:
    """The reservation's message and per-slice report on one line (Serve shows the last line first)."""
    head = str(e).splitlines()[0] if str(e) else type(e).__name__
    report = "; ".join(line.strip().removeprefix("- ") for line in (e.report or "").splitlines() if line.strip())
    err = type(e)(f"deployment {deployment}: {head}" + (f" ({report})" if report else ""))
    err.report = e.report
    return err


class ReplicaCore:
    """The slice behind one replica: reservation, gang, model on every host.

    Args:
        user_cls: The model class (created on every host).
        cfg: The deployment's config; ``cfg.request`` is what is reserved.
        args, kwargs: Constructor arguments for ``user_cls``.
        tpu_slice: A reservation the caller already holds: run on it, neither
            reserve nor release it (its topology must match ``cfg.request``).
        host0_in_process: Be host 0 of the slice in this process when it can:
            when this process runs on host 0 of a free slice of the requested
            shape, that slice is reserved and host 0's share of every step
            runs here (no Ray call on the way to the answer); otherwise, or
            with a held reservation whose host 0 is elsewhere, every host is
            a gang actor. :attr:`host0_here` says which it became.
    """

    def __init__(
        self,
        user_cls: type,
        cfg: SliceServeConfig,
        args: tuple,
        kwargs: dict,
        *,
        tpu_slice: SlicePlacementGroup | None = None,
        host0_in_process: bool = False,
    ) -> None:
        from rayslice.gang import CONTROL_GROUP, SliceGang
        from rayslice.placement import SlicePlacementGroup, slice_placement_group
        from rayslice.serve import host

        self.cfg = cfg
        self.name = user_cls.__name__
        self.spg: SlicePlacementGroup | None = None
        self.gang: SliceGang | None = None
        self.broken: RunOutcome | None = None  # set once a host is lost: the replica is unhealthy
        self.last_outcome: RunOutcome | None = None
        self.owns_slice = tpu_slice is None
        check_bool("host0_in_process", host0_in_process)
        node, headed = _where_this_process_runs() if host0_in_process else (None, None)
        if tpu_slice is not None:
            check_instance("tpu_slice", tpu_slice, SlicePlacementGroup)
            if tpu_slice.released:
                raise fail("tpu_slice", tpu_slice, "a reservation that is still held (this one was released)")
            if tpu_slice.topology != cfg.request.topology or tpu_slice.num_slices != 1:
                raise fail("tpu_slice", tpu_slice, f"a held reservation of one slice of {cfg.request.topology}")
            self.spg = tpu_slice
        else:
            try:
                self.spg = slice_placement_group(
                    cfg.request,
                    timeout_s=cfg.reservation_timeout_s,
                    name=f"serve-{self.name}-{uuid.uuid4().hex[:6]}",
                    progress=False,
                    prefer_slices=[headed] if headed else (),
                )
            except ReservationError as e:  # Serve shows it as the reason the deployment failed
                raise _one_line_reservation_error(e, self.name) from None
        self.host0_here = node is not None and self.spg.slices[0].hosts[0].node_id == node
        try:
            # Liveness pings (health checks, classifying a failed step) run in their own
            # concurrency group on every host, so they never queue behind a step.
            self.gang = SliceGang(
                self.spg,
                init_timeout_s=cfg.init_timeout_s,
                name=self.name,
                actor_options={"max_concurrency": 2, "concurrency_groups": {CONTROL_GROUP: 1}},
                local_rank0=self.host0_here,
            ).start()
            self.gang.run(host.setup_model, user_cls, args, kwargs, self.name, timeout_s=cfg.init_timeout_s)
        except BaseException:
            self.close()
            raise
        self.slice_name = self.spg.slices[0].name

    def validate(self, inputs: Any) -> dict[str, np.ndarray]:
        """One request's inputs as numpy columns, or :class:`RequestError`."""
        spec = self.cfg.input_spec
        out = spec.validate(inputs) if isinstance(spec, InputSpec) else validate_untyped(inputs)
        if rows_of(out) > self.cfg.max_batch_size:  # whatever the spec's own limit: Serve's batcher would fail
            raise RequestError(
                f"{rows_of(out)} rows in one request; the limit is {self.cfg.max_batch_size}", status=413
            )
        return out

    async def infer_many(self, items: list[dict[str, np.ndarray]]) -> list[Any]:
        """One SPMD step for a batch of requests; returns each request's outputs (or the error)."""
        if self.broken is not None:  # a host already failed: answer at once, Serve is replacing us
            return [self.error(self.broken)] * len(items)
        try:
            merged = {k: np.concatenate([it[k] for it in items]) for k in items[0]}
        except (ValueError, KeyError) as e:  # requests whose columns differ (only without an input_spec)
            return [RequestError(f"requests in one batch do not match: {e}")] * len(items)
        rows = rows_of(merged)
        size = _bucket(rows, self.cfg.max_batch_size)
        if size > rows:
            merged = {k: np.concatenate([v, np.zeros((size - rows, *v.shape[1:]), v.dtype)]) for k, v in merged.items()}
        outcome, outs = await self.step(merged, rows)
        if not outcome.ok:
            return [self.error(outcome)] * len(items)
        start = 0
        answers = []
        for it in items:
            n = rows_of(it)
            answers.append({k: v[start : start + n] for k, v in outs.items()})
            start += n
        return answers

    async def step(self, inputs: dict[str, np.ndarray], rows: int) -> tuple[RunOutcome, dict[str, np.ndarray]]:
        """Runs one padded batch on every host; the outcome as a value, and host 0's outputs when OK.

        Host 0's answer ends the request. Waiting on every host, not only host
        0, matters: when a host dies before a collective, host 0 can wait in
        that collective for a long time, while the dead host's own call fails
        as soon as Ray notices. The other hosts' completions are checked after
        the answer (a lost or late host marks the replica unhealthy), so a
        request does not also wait for the slowest host to report back.
        """
        from rayslice.serve import host

        t0 = time.monotonic()
        if self.gang is None:
            outcome = RunOutcome(Outcome.CANCELLED, RuntimeError("the replica is shut down"))
            self.last_outcome = outcome
            return outcome, {}
        # The step serialized once for every host (a large batch: one ray.put, read by each host).
        refs = self.gang.run_async_packed(host.infer, _shared(inputs), rows)
        answer = _Answer(self, [asyncio.wrap_future(ref.future()) for ref in refs], t0 + self.cfg.request_timeout_s)
        try:
            outs = await answer.future
        except asyncio.CancelledError:  # the request went away: stop waiting for the hosts
            answer.drop()
            raise
        except Exception as e:  # the model raised, a host was lost, or the deadline: an error, never a hang
            answer.drop()
            outcome = await self._failure(e, time.monotonic() - t0)
            self.last_outcome = outcome
            return outcome, {}
        self.last_outcome = RunOutcome.success(time.monotonic() - t0)
        return self.last_outcome, outs

    async def _failure(self, exc: BaseException, elapsed_s: float) -> RunOutcome:
        """Classifies a failed step once. A collective failing on host 0 is often only the echo
        of another host dying: the hosts are pinged, and a lost one makes it PREEMPTED."""
        outcome = RunOutcome.of(exc, elapsed_s=elapsed_s)
        if outcome.outcome is not Outcome.PREEMPTED and self.gang is not None:
            lost = await asyncio.to_thread(self.gang.lost_hosts, min(5.0, self.cfg.request_timeout_s))
            if lost:
                outcome = dataclasses.replace(outcome, outcome=Outcome.PREEMPTED, rank=lost[0])
        if outcome.outcome is Outcome.PREEMPTED and self.broken is None:
            self.broken = outcome
            logger.warning(
                "slice %s lost a host (rank %s): %s", getattr(self, "slice_name", "?"), outcome.rank, outcome.message
            )
        return outcome

    def _host_failed(self, rank: int, err: BaseException) -> None:
        """Another host failed after host 0 answered: the slice's fault (a lost or late host), not the request's."""
        outcome = RunOutcome.of(err)
        if outcome.outcome not in (Outcome.FAILED, Outcome.OK) and self.broken is None:
            self.broken = outcome  # an error in the model is the request's, not the slice's

    def error(self, outcome: RunOutcome) -> GangError:
        """The error a request gets for a failed step (its ``outcome`` picks the HTTP status)."""
        where = f"slice {getattr(self, 'slice_name', '?')}"
        if outcome.outcome is Outcome.FAILED:
            text = f"the model raised: {outcome.message}"
        elif outcome.outcome is Outcome.PREEMPTED:
            rank = "" if outcome.rank is None else f" (rank {outcome.rank})"
            text = (
                f"{where} failed this request: a host{rank} was lost; the replica is unhealthy and "
                f"Serve is replacing it; retry: {outcome.message}"
            )
        elif outcome.outcome is Outcome.TIMEOUT:
            text = f"{where} failed this request: no answer within request_timeout_s={self.cfg.request_timeout_s:g}"
        else:
            text = f"{where} failed this request ({outcome.outcome.value}): {outcome.message}"
        return GangError(text, outcome=outcome.outcome, rank=outcome.rank)

    def check_health(self) -> None:
        """Raises (one line) when a host was lost or does not answer a ping within 5 s."""
        if self.broken is not None:
            raise RuntimeError(str(self.error(self.broken)))
        self._raise_lost(self.gang.lost_hosts(timeout_s=5.0) if self.gang else [0])

    async def check_health_async(self) -> None:
        """:meth:`check_health` without blocking the event loop (requests keep flowing meanwhile)."""
        if self.broken is not None:
            raise RuntimeError(str(self.error(self.broken)))
        if self.gang is None:
            self._raise_lost([0])
            return
        pings = [asyncio.wrap_future(ref.future()) for ref in self.gang.ping_async()]
        done, _ = await asyncio.wait(pings, timeout=5.0)
        lost = [rank for rank, f in enumerate(pings) if f not in done or f.exception() is not None]
        for f in pings:
            f.cancel()
        self._raise_lost(lost)

    def _raise_lost(self, lost: list[int]) -> None:
        if lost:
            raise RuntimeError(f"host process(es) of rank {lost} on slice {getattr(self, 'slice_name', '?')} are gone")

    def close(self) -> None:
        """Stops the host processes; releases the slice unless the caller holds it. Idempotent."""
        if self.gang is not None:
            self.gang.shutdown()
            self.gang = None
        if self.spg is not None:
            if self.owns_slice:
                self.spg.release()
            self.spg = None


def _where_this_process_runs() -> tuple[str, str | None]:
    """This process's node id, and the slice it is host 0 of (None when it is not a slice's host 0)."""
    import ray

    from rayslice.cluster import LABEL_SLICE, LABEL_WORKER_ID

    ctx = ray.get_runtime_context()
    labels = {k: v[0] if isinstance(v, list) and v else v for k, v in (ctx.get_node_labels() or {}).items()}
    headed = labels.get(LABEL_SLICE) if str(labels.get(LABEL_WORKER_ID, "")) == "0" else None
    return ctx.get_node_id(), str(headed) if headed else None


class _Answer:
    """Host 0's answer to one step, settled by callbacks on the hosts' futures (no task per host).

    :attr:`future` gets host 0's result or error; another host's failure fails
    it at once unless it is an error in the model (host 0 reports that one
    itself); the deadline fails it with ``TimeoutError``. After a successful
    answer, a host that fails or misses the deadline is reported to the
    replica (:meth:`ReplicaCore._host_failed`), which turns unhealthy.
    """

    def __init__(self, core: ReplicaCore, hosts: list[asyncio.Future], deadline: float) -> None:
        loop = asyncio.get_running_loop()
        self.core = core
        self.hosts = hosts
        self.future: asyncio.Future = loop.create_future()
        self.left = len(hosts)
        self.timer = loop.call_later(max(deadline - time.monotonic(), 0.0), self._deadline)
        for rank, f in enumerate(hosts):
            f.add_done_callback(functools.partial(self._done, rank))

    def _answered(self) -> bool:
        return self.future.done() and not self.future.cancelled() and self.future.exception() is None

    def _done(self, rank: int, f: asyncio.Future) -> None:
        self.left -= 1
        if self.left == 0:
            self.timer.cancel()
        if f.cancelled():
            return
        err = f.exception()
        if rank == 0:
            if not self.future.done():
                if err is None:
                    self.future.set_result(f.result())
                else:
                    self.future.set_exception(err)
            return
        if err is None:
            return
        if self.future.done():
            if self._answered():
                self.core._host_failed(rank, err)
            return
        outcome = RunOutcome.of(err).outcome
        if outcome is not Outcome.FAILED:  # a model error on another host is the request's: host 0 says it
            lost = GangError(f"host {rank}: {describe(err)}", outcome=outcome, rank=rank)
            lost.__cause__ = err
            self.future.set_exception(lost)

    def _deadline(self) -> None:
        timeout_s = self.core.cfg.request_timeout_s
        if not self.future.done():
            self.future.set_exception(TimeoutError(f"no answer within request_timeout_s={timeout_s:g}"))
        elif self._answered():
            late = [rank for rank, f in enumerate(self.hosts) if not f.done()]
            if late:
                self.core._host_failed(
                    late[0], TimeoutError(f"host {late[0]} did not finish within request_timeout_s={timeout_s:g}")
                )

    def drop(self) -> None:
        """The step failed: stop waiting for the other hosts."""
        self.timer.cancel()
        for f in self.hosts:
            if not f.done():
                f.cancel()


#: Batches at least this large are put in the object store once and shared by every host;
#: smaller ones travel inline with each host's call (Ray inlines arguments below 100 KiB).
SHARE_BYTES = 100 * 1024


def _shared(inputs: dict[str, np.ndarray]) -> Any:
    """The batch as every host's call takes it: one ``ray.put`` when large, else the dict itself.

    Without it, Ray serializes a large argument into the object store once per
    host call; with it, the batch is serialized once and each host reads it.
    """
    if sum(v.nbytes for v in inputs.values()) < SHARE_BYTES:
        return inputs
    import ray

    return ray.put(inputs)


def _json_outputs(outputs: Mapping[str, np.ndarray]) -> dict[str, Any]:
    out = {}
    for k, v in outputs.items():
        arr = np.asarray(v)
        if arr.dtype.kind == "f" and not np.isfinite(arr).all():
            raise GangError(
                f"the model's output {k!r} holds NaN or Infinity, which JSON cannot carry", outcome=Outcome.FAILED
            )
        if arr.dtype.kind not in "fiub":
            raise GangError(
                f"the model's output {k!r} has dtype {arr.dtype}, which is not JSON-numeric", outcome=Outcome.FAILED
            )
        out[str(k)] = arr.tolist()
    return out


def make_replica_class(user_cls: type, cfg: SliceServeConfig) -> type:
    """The class Ray Serve runs as a replica, wrapping ``user_cls`` (which runs on the hosts)."""
    from ray import serve
    from starlette.requests import ClientDisconnect, Request
    from starlette.responses import JSONResponse

    async def read_body(request: Request) -> bytes:
        header = request.headers.get("content-length")
        if header is not None:
            if not header.strip().isdigit():
                raise RequestError(f"Content-Length {header[:40]!r} is not a non-negative integer", status=400)
            if int(header) > cfg.max_body_bytes:
                raise RequestError(
                    f"request body of {int(header)} bytes exceeds the limit of {cfg.max_body_bytes}", status=413
                )

        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(cfg.body_timeout_s):  # no task per request, unlike wait_for
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > cfg.max_body_bytes:
                        raise RequestError(
                            f"request body of more than {cfg.max_body_bytes} bytes exceeds the limit", status=413
                        )
                    chunks.append(chunk)
            return b"".join(chunks)
        except TimeoutError:
            declared = f" of the {header} bytes its Content-Length declares" if header else ""
            raise RequestError(
                f"the request body{declared} did not arrive within body_timeout_s={cfg.body_timeout_s:g} s", status=408
            ) from None
        except ClientDisconnect:
            raise RequestError("the client disconnected before sending its whole body", status=400) from None

    class SliceReplica:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            # Serve places the replica on host 0 of a slice of this shape when one is free
            # (deployment's label selector); the replica then is that host itself.
            self._core = ReplicaCore(user_cls, cfg, args, kwargs, host0_in_process=True)

        # Batches are counted in rows, not requests: one SPMD step holds at most max_batch_size rows.
        @serve.batch(
            max_batch_size=cfg.max_batch_size,
            batch_wait_timeout_s=cfg.batch_wait_timeout_s,
            batch_size_fn=lambda items: sum(rows_of(it) for it in items),
        )
        async def _batched(self, items: list[dict[str, np.ndarray]]) -> list[Any]:
            return await self._core.infer_many(items)

        async def _infer(self, inputs: Any) -> dict[str, np.ndarray]:
            out = await self._batched(self._core.validate(inputs))
            if isinstance(out, BaseException):
                raise out
            return out

        async def __call__(self, request: Any) -> Any:
            if not isinstance(request, Request):
                return await self._infer(request)  # a DeploymentHandle call: numpy in, numpy out
            try:
                if request.method != "POST":
                    return JSONResponse(
                        {"error": f'method {request.method} is not allowed; POST a JSON body {{"inputs": {{...}}}}'},
                        status_code=405,
                        headers={"Allow": "POST"},
                    )
                outputs = await self._infer(parse_body(await read_body(request), cfg.max_body_bytes))
                return JSONResponse({"outputs": _json_outputs(outputs)})
            except RequestError as e:
                return JSONResponse({"error": str(e)}, status_code=e.status)
            except GangError as e:
                return JSONResponse({"error": str(e), "outcome": e.outcome.value}, status_code=http_status(e.outcome))
            except Exception as e:  # a bug, still answered in JSON rather than Serve's plain-text 500
                logger.exception("slice deployment %s failed a request", user_cls.__name__)
                return JSONResponse({"error": f"internal error: {type(e).__name__}: {e}"}, status_code=500)

        async def check_health(self) -> None:
            await self._core.check_health_async()

        def slice_name(self) -> str:
            return self._core.slice_name

        def host0_here(self) -> bool:
            """Whether this replica's process is host 0 of its slice (else every host is a gang actor)."""
            return self._core.host0_here

        def __del__(self) -> None:
            core = getattr(self, "_core", None)
            if core is not None:
                core.close()

    SliceReplica.__name__ = user_cls.__name__
    SliceReplica.__qualname__ = user_cls.__qualname__
    SliceReplica.__doc__ = user_cls.__doc__
    return SliceReplica
