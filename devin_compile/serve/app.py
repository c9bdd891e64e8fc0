"""The OpenAI-compatible HTTP app (Starlette): ``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``, vLLM's ``/tokenize`` and ``/detokenize`` (:mod:`.tokenizer_endpoints`), ``/health``, ``/metrics``
and ``/openapi.json`` (:mod:`.openapi`).

:class:`Server` owns an :class:`~devin_compile.runtime.async_engine.AsyncEngine` over an
``OptimizedModel``'s engine (started and closed by the app's lifespan). A request is parsed
and checked (:mod:`~devin_compile.serve.protocol`), its prompts tokenised (chat: the
tokenizer's chat template) and checked by the engine's admission check, then run as a
:class:`~devin_compile.serve.generation.Generation`. Streams are server-sent events ending
in ``data: [DONE]``. A client that goes away (streamed or not) aborts its request; with
``max_queue`` requests waiting for their first token, new ones get 429 + ``Retry-After``.
Errors are OpenAI-shaped JSON; a failing request never affects the others. In front of the
routes: the access log (:mod:`.access_log`), API keys (:mod:`.auth`) and the body limit
(:mod:`.limits`, with the per-request limits checked here); admission refusals are worded for
HTTP users by :mod:`.refusals`. Logprobs, when
asked for, ride on each choice (and each streamed chunk) in OpenAI's shapes
(:mod:`~devin_compile.text.logprob_format`); completions ``echo`` puts the prompt (and its logprobs)
first, and vLLM's ``prompt_logprobs`` rides on each completions choice (chat: on the response). With a :class:`~devin_compile.serve.tracing.Tracing`
whose ``trace_steps`` is on, the first traced request adds a step hook to the engine and every
engine step gets child spans under the requests it ran.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..runtime.admission import RequestRejected
from ..runtime.async_engine import AsyncEngine
from ..runtime.sampling import SamplingParams
from ..text.detokenizer import TextStream
from .access_log import AccessLog
from .auth import BearerKeys, unauthorized
from .generation import Choice, Generation
from ..text.logprob_format import LogprobFormatter
from .limits import BodyLimit, ServeLimits
from .metrics import CONTENT_TYPE, ServerMetrics
from .openapi import openapi_document
from .protocol import APIError, GenerationRequest, bad, check_model, parse_json, parse_request
from .refusals import http_refusal
from .request_fields import Facts
from .tokenizer_endpoints import detokenize, tokenize
from ..text.chat_template import chat_prompt_ids


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


class Server:
    """``opt``: an OptimizedModel with a tokenizer; ``model_name``: the id clients send as ``model``."""

    def __init__(self, opt, model_name: str = "smollm2", *, max_queue: int | None = None,
                 metrics: bool = True, tracing=None, api_keys=(), metrics_auth: bool = False,
                 limits: ServeLimits | None = None, access_log: bool = False) -> None:
        if opt.tokenizer is None:
            raise ValueError("the server needs a tokenizer: pass tokenizer= to optimize()")
        if metrics_auth and not api_keys:
            raise ValueError("metrics_auth (--metrics-auth) needs an API key (--api-key or DEVIN_API_KEY)")
        self.opt = opt
        self.tokenizer = opt.tokenizer
        self.model_name = model_name
        self.max_queue = max_queue
        self.limits = limits if limits is not None else ServeLimits()
        self.engine = AsyncEngine(opt.engine)
        self.queued = 0  # engine requests submitted that have no token yet
        self.metrics = ServerMetrics(opt.engine, lambda: self.queued) if metrics else None
        self.tracing = tracing  # a serve.tracing.Tracing, or None: no OpenTelemetry call at all
        self._step_hook = False  # added to the engine by the first request traced with trace_steps
        self.logprobs = LogprobFormatter(self.tokenizer)
        self.created = int(time.time())
        self.auth = BearerKeys(api_keys, metrics_auth) if api_keys else None
        self.metrics_auth = metrics_auth
        self._openapi = None  # built on first GET /openapi.json
        self.app = self._build_app(access_log)

    def _build_app(self, access_log: bool) -> Starlette:
        """The routes behind the middleware: access log (outermost), API keys, body limit."""
        middleware = [Middleware(AccessLog)] if access_log else []
        if self.auth is not None:
            middleware.append(Middleware(AuthenticationMiddleware, backend=self.auth, on_error=unauthorized))
        middleware.append(Middleware(BodyLimit, max_bytes=self.limits.max_body_bytes))
        return Starlette(routes=[
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics_endpoint, methods=["GET"]),
            Route("/openapi.json", self.openapi, methods=["GET"]),
        ], middleware=middleware, lifespan=self._lifespan, exception_handlers={
            HTTPException: self._http_error, APIError: self._api_error, Exception: self._internal_error})

    @asynccontextmanager
    async def _lifespan(self, app):
        yield
        await self.engine.close()  # aborts what is still in flight
        if self.tracing is not None:
            self.tracing.shutdown()  # flushes the spans

    # -- small endpoints --------------------------------------------------------
    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created, "owned_by": "devin-compile",
            "max_model_len": self.opt.engine.max_model_len}]})

    async def tokenize(self, request: Request) -> Response:
        return await self._text_endpoint(request, "tokenize", lambda body: tokenize(
            body, self.tokenizer, self.model_name, self.opt.engine.max_model_len))

    async def detokenize(self, request: Request) -> Response:
        return await self._text_endpoint(request, "detokenize",
                                         lambda body: detokenize(body, self.tokenizer, self.model_name))

    async def _text_endpoint(self, request: Request, endpoint: str, answer) -> Response:
        """A tokenizer-only endpoint (no engine work): parse, answer, count it in the metrics."""
        try:
            body = answer(parse_json(await request.body()))
        except APIError as e:
            self._done(endpoint, e.status, None, None)
            return error_response(e)
        self._done(endpoint, 200, None, None)
        return JSONResponse(body)

    async def health(self, request: Request) -> Response:
        if self.engine.error is not None:
            return JSONResponse({"status": "error", "error": str(self.engine.error)}, status_code=503)
        lost = getattr(getattr(self.opt, "rank_group", None), "failure", None)  # tensor parallelism: a rank died or hangs
        if lost is not None:
            return JSONResponse({"status": "error", "error": lost}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics_endpoint(self, request: Request) -> Response:
        if self.metrics is None:
            return error_response(APIError(404, "metrics are off (the server was started with --no-metrics)",
                                           type="not_found_error"))
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    async def openapi(self, request: Request) -> Response:
        if self._openapi is None:
            facts = Facts(self.model_name, self.opt.engine.admission.vocab_size, self.limits.max_n,
                          self.limits.max_tokens)
            self._openapi = openapi_document(facts, auth=self.auth is not None, metrics_auth=self.metrics_auth)
        return JSONResponse(self._openapi)

    async def _http_error(self, request: Request, exc: HTTPException) -> Response:
        return error_response(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                       type="not_found_error" if exc.status_code == 404 else "invalid_request_error",
                                       headers=exc.headers))  # e.g. 405's Allow

    async def _api_error(self, request: Request, exc: APIError) -> Response:
        return error_response(exc)

    async def _internal_error(self, request: Request, exc: Exception) -> Response:
        return error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error"))

    # -- generation -------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, chat: bool) -> Response:
        endpoint = "chat" if chat else "completions"
        received = time.perf_counter()
        span = None
        try:
            try:
                raw = await request.body()
            except ClientDisconnect:
                self._done(endpoint, 499, None, None)
                return Response(status_code=499)
            body = parse_json(raw)
            req = parse_request(body, chat)
            if self.tracing is not None:
                span = self.tracing.start(request.headers, req, chat, self.model_name, received)
            check_model(req.model, self.model_name)
            self.limits.check(req, body)
            choices = self._choices(req, chat)
            if self.max_queue is not None and self.queued + len(choices) > self.max_queue:
                raise APIError(429, f"the server's queue is full ({self.queued} requests waiting, --max-queue "
                                    f"{self.max_queue}); retry later", type="rate_limit_error",
                               code="queue_full", headers={"Retry-After": "1"})
        except APIError as e:
            self._done(endpoint, e.status, None, span, e.message)
            return error_response(e)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        gen = Generation(self, rid, choices, n=req.n, timeout=req.timeout, received=received)
        request.state.generation = gen  # its usage goes in the access log
        if span is not None and self.tracing.trace_steps:
            self._watch_steps(span, gen)
        if req.stream:
            def closed() -> None:  # the stream never started (the client left at once): abort, count it
                if not gen.closed:
                    gen.close()
                    self._done(endpoint, 499, gen, span)

            return _EventStream(self._sse(gen, req, chat, endpoint, span), closed, media_type="text/event-stream",
                                headers={"Cache-Control": "no-cache"})
        status, error = 200, None
        try:
            await _until_disconnect(request, gen.collect())
        except APIError as e:
            status, error = e.status, e.message
            return error_response(e)
        except _ClientGone:
            status = 499
            return Response(status_code=499)
        finally:
            gen.close()
            self._done(endpoint, status, gen, span, error)
        return JSONResponse(self._body(gen, req, chat))

    def _done(self, endpoint: str, status: int, gen: Generation | None, span, error: str | None = None) -> None:
        if self.metrics is not None:
            self.metrics.request_done(endpoint, status)
        if span is not None:
            if gen is not None:
                self.tracing.unwatch(gen.engine_ids)
            self.tracing.finish(span, gen, status, self.model_name, error)

    def _watch_steps(self, span, gen: Generation) -> None:
        """--trace-steps: the engine's steps that run ``gen``'s choices become child spans of ``span``."""
        if not self._step_hook:
            self._step_hook = True
            self.engine.add_step_hook(self._on_step)
        self.tracing.watch(span, gen.engine_ids)

    def _on_step(self, info) -> None:
        tracing = self.tracing
        if tracing is not None:
            tracing.on_step(info)

    def _choices(self, req: GenerationRequest, chat: bool) -> list[Choice]:
        """The request's choices (prompt x ``n``), each checked by the engine's admission check
        (its :class:`RequestRejected` becomes a 400 naming the request field at fault) after the
        server's limit on prompt tokens per request."""
        engine = self.opt.engine
        field = "messages" if chat else "prompt"
        out, total = [], 0
        try:
            for p, prompt in enumerate(req.prompts):
                ids = self._prompt_ids(prompt, chat)
                total += len(ids)
                self.limits.check_prompt_tokens(total, field)
                # OpenAI's default max_tokens: whatever room the context (and here the KV pool) leaves,
                # up to this server's --max-tokens-limit
                room = min(engine.admission.token_limit - len(ids), self.limits.max_tokens)
                max_tokens = req.max_tokens if req.max_tokens is not None else max(room, 1)
                echo = (prompt if isinstance(prompt, str) else self.tokenizer.decode(ids)) if req.echo else None
                for i in range(req.n):
                    params = SamplingParams(max_new_tokens=max_tokens, **req.sampling_kwargs(i))
                    engine.check_request(ids, params)
                    out.append(Choice(p * req.n + i, ids, params, TextStream(self.tokenizer, ids, req.stop),
                                      echo=echo))
        except RequestRejected as e:
            raise http_refusal(e, field) from None
        return out

    def _prompt_ids(self, prompt, chat: bool) -> list[int]:
        """Token ids of one prompt: chat messages through the tokenizer's chat template, else text or ids."""
        if not chat:
            return self.opt.engine.admission.encode(prompt)
        try:
            return chat_prompt_ids(self.tokenizer, prompt)
        except ValueError as e:
            raise bad("messages", str(e)) from None

    # -- response bodies ----------------------------------------------------------
    def _logprobs(self, c: Choice, entries: list | None, req: GenerationRequest, chat: bool) -> dict | None:
        """The OpenAI ``logprobs`` object of ``entries`` (None when the request did not ask)."""
        if req.logprobs is None:
            return None
        if chat:
            return self.logprobs.chat(entries or [])
        body, c.text_offset = self.logprobs.completion(entries or [], c.text_offset, req.logprobs)
        return body

    def _body(self, gen: Generation, req: GenerationRequest, chat: bool) -> dict:
        def lps(c: Choice):
            entries = c.output.logprobs if c.output is not None else None
            if c.echo is not None and c.prompt_logprobs is not None and req.logprobs is not None:
                entries = c.echo_entries() + (entries or [])
            return self._logprobs(c, entries, req, chat)

        def prompt_lps(c: Choice) -> dict:  # vLLM's prompt_logprobs, when asked
            k = req.prompt_logprobs
            return {} if k is None else {"prompt_logprobs": self.logprobs.prompt(c.prompt_logprobs or [], k)}

        body = {"id": gen.request_id, "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": self.model_name}
        if chat:
            body["choices"] = [{"index": c.index, "message": {"role": "assistant", "content": c.text.text},
                                "logprobs": lps(c), "finish_reason": c.finish_reason} for c in gen.choices]
            body.update(prompt_lps(gen.choices[0]))  # vLLM: one list for the request (every choice's prompt)
        else:
            body["choices"] = [{"index": c.index, "text": (c.echo or "") + c.text.text, "logprobs": lps(c),
                                "finish_reason": c.finish_reason, **prompt_lps(c)} for c in gen.choices]
        body["usage"] = gen.usage()
        return body

    def _chunk(self, gen: Generation, req: GenerationRequest, chat: bool, choices: list, usage=None) -> str:
        body = {"id": gen.request_id, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": self.model_name, "choices": choices}
        if req.include_usage:  # as OpenAI: then every chunk has "usage", null but in the last
            body["usage"] = usage
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    async def _sse(self, gen: Generation, req: GenerationRequest, chat: bool, endpoint: str, span):
        status, error = 499, None  # unless it ends otherwise: the client went away
        try:
            if chat:
                yield self._chunk(gen, req, chat, [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                                    "logprobs": None, "finish_reason": None} for c in gen.choices])
            async for c, delta, finish, logprobs in gen.events():
                if not delta and finish is None:
                    continue
                lps = self._logprobs(c, logprobs, req, chat)
                if chat:
                    choice = {"index": c.index, "delta": {"content": delta} if delta else {}, "logprobs": lps,
                              "finish_reason": finish}
                else:
                    choice = {"index": c.index, "text": delta, "logprobs": lps, "finish_reason": finish}
                yield self._chunk(gen, req, chat, [choice])
            if req.include_usage:
                yield self._chunk(gen, req, chat, [], gen.usage())
            yield "data: [DONE]\n\n"
            status = 200
        except APIError as e:
            status, error = e.status, e.message
            yield f"data: {json.dumps(e.body())}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            gen.close()
            self._done(endpoint, status, gen, span, error)


class _ClientGone(Exception):
    pass


class _EventStream(StreamingResponse):
    """A StreamingResponse that calls ``on_close`` however it ends, even when it is cancelled
    before its body iterator ever started (whose own ``finally`` then never runs)."""

    def __init__(self, content, on_close, **kw) -> None:
        super().__init__(content, **kw)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


async def _until_disconnect(request: Request, coro):
    """Await ``coro``; if the client disconnects first, cancel it and raise :class:`_ClientGone`."""
    task = asyncio.ensure_future(coro)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    raise _ClientGone()
