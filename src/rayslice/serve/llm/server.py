"""HTTP handling of the OpenAI routes over an :class:`~rayslice.serve.llm.engine.Engine` (starlette).

:class:`OpenAIServer` turns a starlette ``Request`` into a ``Response``: JSON
for non-streaming requests, a ``StreamingResponse`` of server-sent events for
``"stream": true`` (each chunk is sent as soon as the engine produces its
text). When the client goes away mid-stream, the response generator is closed
(Ray Serve cancels the request), which cancels the generation and frees its
slot before the next decode step. The same object serves inside a Ray Serve
replica (:mod:`rayslice.serve.llm.deployment`) or any ASGI app (tests).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from rayslice.serve.llm import api
from rayslice.serve.llm.engine import Delta, Engine, EngineError, Finished


class OpenAIServer:
    """Routes: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models[/{id}]``, ``/v1/rayslice/stats``.

    Args:
        engine: The engine (created lazily by the deployment, so pass it when ready).
        model: The model name clients must send.
        max_body_bytes: Larger bodies get 413.
        extra_stats: Adds fields to the stats route (e.g. the slice's name).
    """

    def __init__(
        self,
        engine: Engine,
        model: str,
        *,
        max_body_bytes: int = 1 << 20,
        extra_stats: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.engine = engine
        self.model = model
        self.max_body_bytes = max_body_bytes
        self.extra_stats = extra_stats
        self.created = api.now()
        cfg = engine.cfg
        self.limits = api.Limits(cfg.max_context, cfg.max_tokens_limit, cfg.default_max_tokens, cfg.max_prompt_tokens)

    @staticmethod
    def _json(payload: Any, status: int = 200) -> Any:
        from starlette.responses import JSONResponse

        return JSONResponse(payload, status_code=status)

    def _error(self, err: api.APIError) -> Any:
        return self._json(err.body(), err.status)

    async def handle(self, request: Any) -> Any:
        try:
            return await self._route(request)
        except api.APIError as e:
            return self._error(e)
        except EngineError as e:
            return self._error(
                api.APIError(
                    f"The model is unavailable: {e}. Retry the request.",
                    503,
                    type="server_error",
                    code="slice_unavailable",
                )
            )

    async def _route(self, request: Any) -> Any:
        path = request.url.path
        root = request.scope.get("root_path") or ""
        if root and path.startswith(root):
            path = path[len(root) :]
        path = "/" + path.strip("/")
        method = request.method
        if path == "/v1/models":
            self._only(method, "GET")
            return self._json(api.models_list(self.model, self.created, self.limits.max_context))
        if path.startswith("/v1/models/"):
            self._only(method, "GET")
            name = path[len("/v1/models/") :]
            if name != self.model:
                raise api.APIError(f"The model '{name}' does not exist", 404, param="model", code="model_not_found")
            return self._json(api.model_card(self.model, self.created, self.limits.max_context))
        if path == "/v1/rayslice/stats":
            self._only(method, "GET")
            return self._json({**self.engine.stats(), **(self.extra_stats() if self.extra_stats else {})})
        if path in ("/v1/completions", "/v1/chat/completions"):
            self._only(method, "POST")
            declared = request.headers.get("content-length")
            if declared and declared.isdigit() and int(declared) > self.max_body_bytes:
                raise api.APIError(
                    f"The request body of {declared} bytes exceeds the limit of {self.max_body_bytes}", 413
                )
            body = api.parse_json(await request.body(), self.max_body_bytes)
            parse = api.parse_chat if path.endswith("chat/completions") else api.parse_completion
            return await self._generate(parse(body, self.model, self.limits))
        raise api.APIError(f"Invalid URL ({method} {path})", 404, code="unknown_url")

    @staticmethod
    def _only(method: str, allowed: str) -> None:
        if method != allowed:
            raise api.APIError(f"Method {method} is not allowed here; use {allowed}", 405, code="method_not_allowed")

    async def _generate(self, spec: api.GenerationSpec) -> Any:
        try:
            req = self.engine.submit(spec.prompt, spec.params)
        except ValueError as e:  # the scheduler's own limits (kept in step with api's checks)
            raise api.APIError(str(e), code="context_length_exceeded") from None
        rid, created = api.new_id(spec.kind), api.now()
        if spec.stream:
            from starlette.responses import StreamingResponse

            return StreamingResponse(
                self._sse(spec, req, rid, created),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        text: list[str] = []
        ids: list[int] = []
        async for ev in self.engine.events(req):
            if isinstance(ev, Delta):
                text.append(ev.text)
                ids.extend(ev.token_ids)
            elif isinstance(ev, Finished):
                return self._json(
                    api.full_response(
                        spec,
                        rid,
                        created,
                        "".join(text),
                        _reason(ev),
                        ev.prompt_tokens,
                        ev.completion_tokens,
                        ids if spec.return_token_ids else None,
                    )
                )
        raise EngineError("the request ended without finishing")

    async def _sse(self, spec: api.GenerationSpec, req: Any, rid: str, created: int) -> AsyncIterator[str]:
        events = self.engine.events(req)
        try:
            if spec.kind == "chat":
                yield api.chunk(spec, rid, created, "", role=True)
            async for ev in events:
                if isinstance(ev, Delta):
                    if ev.text:
                        yield api.chunk(spec, rid, created, ev.text)
                elif isinstance(ev, Finished):
                    yield api.chunk(spec, rid, created, None if spec.kind == "chat" else "", _reason(ev))
                    if spec.include_usage:
                        yield api.chunk(
                            spec,
                            rid,
                            created,
                            None,
                            empty=True,
                            usage_obj=api.usage(ev.prompt_tokens, ev.completion_tokens),
                        )
                    yield api.DONE
                    return
        except EngineError as e:
            yield api.sse_error(
                api.APIError(
                    f"The model is unavailable: {e}. Retry the request.",
                    503,
                    type="server_error",
                    code="slice_unavailable",
                )
            )
        finally:
            await events.aclose()  # a client that went away: cancels the generation, frees the slot


def _reason(ev: Finished) -> str:
    return "stop" if ev.reason == "stop" else "length"
