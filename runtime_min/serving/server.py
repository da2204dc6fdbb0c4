"""`dsneuron serve`: the OpenAI HTTP API over the scheduler (FastAPI on uvicorn).

    serve(session, host="127.0.0.1", port=8000, max_queue=128, api_key=None, model_name="artifacts",
          limits=Limits())

Endpoints (OpenAI API reference; runtime_min/serving/openai_protocol.py for the bodies):
GET /v1/models, POST /v1/completions, POST /v1/chat/completions (runtime_min/serving/chat.py: the
DeepSeek-V4 chat format), `stream: true` as server-sent events; GET /health (200; 503 once
draining, for an in-process drain: SIGTERM closes the socket); GET /metrics (Prometheus text: queue length, running rows, prompt and generated
tokens, finished requests by reason, rejected requests by status, time to first token, inter-token
latency and request latency histograms; with a prefix cache its lookups, hits, misses, hit tokens,
evictions, bytes and entries, as dsneuron_prefix_cache_*).

Prefix cache (--prefix-cache-gib, `prefix_cache_bytes`): a request starts from the state after the
longest cached prefix of its prompt and prefills only the rest (runtime_min/core/scheduler.py), with the
output it gets without the cache, bit for bit. Off for a sharded bundle (every rank's cache would
have to evict as rank 0's does).

Chat requests may carry tools, thinking mode and response_format (runtime_min/serving/openai_protocol.py):
the prompt is rendered by runtime_min/serving/chat.py, the reply split into content, reasoning and tool
calls by runtime_min/serving/dsml.py, and a JSON or forced tool-call reply constrained by
runtime_min/serving/grammar.py (one xgrammar compiler a server, a matcher a request).

Limits (`Limits`, the `serve` flags), each answered with a 4xx naming the flag before anything is
queued: at most --max-header-count request headers of --max-header-bytes bytes in all (431), the
body within MAX_BODY bytes (400) and received within --request-timeout seconds (408). A request
still running --request-timeout seconds after it arrived is ended ("abort"): a whole one is
answered 408, a stream gets an error event naming the limit. A stream silent for --sse-keepalive
seconds (a long prefill, a full queue) gets an SSE comment line, so proxies keep it open.

Requests become runtime_min/core/scheduler.py Requests, stepped by one engine thread
(runtime_min/serving/engine.py); each HTTP request waits on an asyncio queue that the engine's listener fills. Errors answer in the
OpenAI format ({"error": {message, type, param, code}}): 400 for a bad body (malformed JSON, a
body over MAX_BODY bytes, a bad field, a prompt or max_tokens past the context), 401 for a
missing or wrong API key (the /v1 routes, when a key is set), 404 for an unknown path or model,
429 when the queue is full, 503 while shutting down. An error is one request's: it
never reaches the rows of the others.

The queue bound counts requests waiting for a row: a burst is admitted while rows are free, and
more than --max-queue beyond them is answered 429 (with Retry-After); a request's prompts are
queued all or none. A client that disconnects cancels its requests (a streamed one when its stream
closes, a whole one within POLL_S): their rows are freed at the next step. SIGTERM closes the
listening socket at once (new connections are refused, so a load balancer moves on), and a whole
(non-streamed) request that never got a row is answered 503 to be retried elsewhere. The
queued and running requests go on until engine.SHUTDOWN_S before `grace` seconds are over (a Kubernetes-style grace period: the process is gone within it), then ends
the rest (finish_reason "abort", streams closed with their final chunk) and returns, so the
command exits 0. This module and its imports (fastapi, uvicorn, prometheus_client) are loaded by
the `serve` command only.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import secrets
import signal
import socket
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

import uvicorn
from fastapi import APIRouter, FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from dsneuron import UserError

from ..core.scheduler import QueueFull, Request, RequestError
from ..session import Session
from . import chat
from .engine import Channel, Closed, Engine, follow
from .grammar import GrammarError, Grammars
from .openai_protocol import (ChatChoice, ChatRequest, CompletionRequest, ProtocolError, Reply, parse, prompt_lists,
                              usage)

log = logging.getLogger("dsneuron.serve")

#: request bodies larger than this are refused (400): 4 MiB holds a prompt of the largest context
#: (65536 tokens) even at 6 bytes a character of JSON-escaped text, with room to spare
MAX_BODY = 4 * 2**20
#: seconds between checks that a client waiting for a whole (non-streamed) response is still there
POLL_S = 0.25


@dataclass(frozen=True)
class Limits:
    """The per-request limits of a server (module docstring): max_headers (count), max_header_bytes
    (names and values summed), request_timeout (seconds from arrival to the end), keepalive
    (seconds of stream silence before an SSE comment)."""

    max_headers: int = 100
    max_header_bytes: int = 16384
    request_timeout: float = 600.0
    keepalive: float = 15.0

    def check(self) -> None:
        """UserError naming the flag of a value out of range."""
        for flag, value, low in (("--max-header-count", self.max_headers, 1),
                                 ("--max-header-bytes", self.max_header_bytes, 256),
                                 ("--request-timeout", self.request_timeout, 0.001),
                                 ("--sse-keepalive", self.keepalive, 0.001)):
            if not value >= low:
                raise UserError(f"{flag} must be at least {low}, got {value}")


class HeaderLimits:
    """ASGI middleware: 431 naming the flag for a request with more headers, or more header
    bytes, than `limits` allow, before the app sees it."""

    def __init__(self, app, limits: Limits, on_reject: Callable[[int], None]):
        self.app, self.limits, self.on_reject = app, limits, on_reject

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            headers = scope.get("headers") or []
            size = sum(len(k) + len(v) for k, v in headers)
            why = (f"{len(headers)} request headers; this server takes at most {self.limits.max_headers} "
                   "(--max-header-count)" if len(headers) > self.limits.max_headers else
                   f"the request headers have {size} bytes; this server takes at most {self.limits.max_header_bytes} "
                   "(--max-header-bytes)" if size > self.limits.max_header_bytes else None)
            if why is not None:
                self.on_reject(431)
                err = ProtocolError(why, 431, param="headers", code="headers_too_large")
                await JSONResponse(err.body(), status_code=431)(scope, receive, send)
                return
        await self.app(scope, receive, send)


@dataclass
class Served:
    """What one app serves, kept as `app.state.served` for the routes: the engine, the model name
    clients send, the API key (None: no key asked), the limits, the grammar compiler of the bundle's
    tokenizer, the tokenizer without special-token parsing (runtime_min/serving/chat.py
    plain_tokenizer), the app's start (the model card's `created`) and the request hook
    (`create_app`)."""

    engine: Engine
    model_name: str
    api_key: str | None
    limits: Limits
    grammars: Grammars
    plain: Any
    started: float
    request_hook: Callable[[Request], None] | None = None

    @property
    def session(self) -> Session:
        return self.engine.session

    def fail(self, e: ProtocolError, headers: dict[str, str] | None = None) -> JSONResponse:
        """The OpenAI error response of `e`, counted as rejected."""
        self.engine.metrics.rejected.labels(str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    def check_key(self, request: HTTPRequest) -> None:
        """ProtocolError 401 unless the request carries the API key (when one is set)."""
        if self.api_key is None:
            return
        got = request.headers.get("authorization", "")
        scheme, _, token = got.partition(" ")
        if not (scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), self.api_key.encode())):
            raise ProtocolError("missing or wrong API key: send the header Authorization: Bearer <key> with the "
                                "key given to `dsneuron serve --api-key`", 401, code="invalid_api_key")

    def check_model(self, name: str) -> None:
        """ProtocolError 404 unless `name` is the served model's."""
        if name != self.model_name:
            raise ProtocolError(f"model {name!r} does not exist: this server serves {self.model_name!r} "
                                "(GET /v1/models)", 404, param="model", type="not_found_error", code="model_not_found")

    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": int(self.started), "owned_by": "dsneuron",
                "max_model_len": self.session.max_capacity}

    def prompt_ids(self, body: Any, chat_kind: bool) -> list[list[int]]:
        """The token ids of each prompt of a request body (a chat's messages rendered as one)."""
        session = self.session
        if chat_kind:
            try:
                return [[session.manifest.tokenizer.bos_token_id] + chat.encode(
                    body.messages, session.tokenizer, self.plain, body.prompt_tools, body.thinking)]
            except chat.ChatError as e:
                raise ProtocolError(str(e), param=e.param) from None
            except UnicodeEncodeError as e:
                raise ProtocolError(f"messages: not valid UTF-8 text (character {e.start} of a content)",
                                    param="messages") from None
        out = []
        for i, p in enumerate(prompt_lists(body.prompt)):
            where = "prompt" if isinstance(body.prompt, str) else f"prompt[{i}]"
            if isinstance(p, str):
                if not p:
                    raise ProtocolError(f"{where} is empty; a prompt needs at least one character", param="prompt")
                try:
                    out.append(session.encode(p, i))
                except UserError as e:
                    raise ProtocolError(f"{where}: {e}", param="prompt") from None
            else:
                bad = next((k for k, t in enumerate(p) if not 0 <= t < session.vocab_size), None)
                if bad is not None:
                    raise ProtocolError(f"{where}[{bad}]: token id {p[bad]} is outside the vocabulary "
                                        f"0..{session.vocab_size - 1}", param="prompt")
                out.append(p)
        return out

    def grammar(self, body: Any):
        """The grammar a chat reply must follow (runtime_min/serving/grammar.py), None for free text."""
        schema, forced = body.json_schema(), body.forced_tool()
        if schema is None and forced is False:
            return None
        if self.engine.sharded:  # the other ranks sample without the matcher: they would diverge
            raise ProtocolError("response_format and a forced tool_choice are not supported with a sharded bundle",
                                param="response_format" if schema is not None else "tool_choice")
        if schema is not None and forced is not False:
            raise ProtocolError("response_format json and a forced tool_choice exclude each other: the reply is "
                                "either JSON or a tool call", param="response_format")
        try:
            if schema is not None:
                return self.grammars.json_schema(schema)
            return self.grammars.tool_calls(chat.functions(body.tools), None if forced is True else forced,
                                            body.thinking)
        except GrammarError as e:
            raise ProtocolError(str(e), param="response_format" if schema is not None else "tools") from None
        except chat.ChatError as e:
            raise ProtocolError(str(e), param=e.param) from None

    def requests(self, body: Any, prompts: list[list[int]], chat_kind: bool, loop, queue) -> list[Request]:
        """One scheduler Request a prompt, its outputs put on `queue` in `loop` (Engine.listener)."""
        newer_name = chat_kind and body.max_completion_tokens is not None
        max_tokens = body.max_completion_tokens if newer_name else body.max_tokens
        grammar = self.grammar(body) if chat_kind else None
        out = []
        for i, ids in enumerate(prompts):
            n = max_tokens if max_tokens is not None else max(1, self.session.max_capacity - len(ids) + 1)
            seed = body.seed if body.seed is not None else secrets.randbits(64)
            r = Request(ids, n, body.temperature, body.top_p, seed, body.stops(),
                        listener=self.engine.listener(loop, queue, i),
                        constraint=None if grammar is None else grammar.constraint(),
                        max_tokens_name="max_completion_tokens" if newer_name else "max_tokens")
            if self.request_hook is not None:
                self.request_hook(r)
            out.append(r)
        return out

    def timed_out(self, reqs: list[Request]) -> ProtocolError:
        """Cancel `reqs`; the 408 naming --request-timeout."""
        for r in reqs:
            self.engine.cancel(r)
        return ProtocolError(f"the request ran past the time limit of {self.limits.request_timeout:g} s "
                             "(--request-timeout)", 408, code="request_timeout")


def create_app(engine: Engine, model_name: str, api_key: str | None = None, limits: Limits = Limits(),
               request_hook: Callable[[Request], None] | None = None) -> FastAPI:
    """The FastAPI app of `engine` serving `model_name` (module docstring): the routes of `router`
    over a `Served`. request_hook: called with each Request before it is queued (tests script what
    a request samples through it)."""
    app = FastAPI(title="dsneuron", docs_url=None, redoc_url=None, openapi_url=None)
    session = engine.session
    app.state.served = Served(engine, model_name, api_key, limits,
                              Grammars(session.tokenizer, session.vocab_size, session.manifest.tokenizer.eos_token_id),
                              chat.plain_tokenizer(session.tokenizer), time.time(), request_hook)
    app.add_middleware(HeaderLimits, limits=limits,
                       on_reject=lambda status: engine.metrics.rejected.labels(str(status)).inc())
    app.add_exception_handler(HTTPException, http_error)
    app.include_router(router)
    return app


def served(request: HTTPRequest) -> Served:
    """The `Served` of the app a request came to."""
    return request.app.state.served


async def http_error(request: HTTPRequest, exc: HTTPException) -> JSONResponse:
    """Starlette's HTTP errors (an unknown path, a wrong method) in the OpenAI error format."""
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return served(request).fail(ProtocolError(f"{request.method} {request.url.path}: {exc.detail}", exc.status_code,
                                              type=kind))


router = APIRouter()


@router.get("/health")
async def health(request: HTTPRequest) -> Response:
    return Response(status_code=503 if served(request).engine.draining else 200)


@router.get("/metrics")
async def prometheus(request: HTTPRequest) -> Response:
    return Response(generate_latest(served(request).engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def models(request: HTTPRequest) -> JSONResponse:
    s = served(request)
    try:
        s.check_key(request)
    except ProtocolError as e:
        return s.fail(e)
    return JSONResponse({"object": "list", "data": [s.model_card()]})


@router.get("/v1/models/{name}")
async def model(request: HTTPRequest, name: str) -> JSONResponse:
    s = served(request)
    try:
        s.check_key(request)
        s.check_model(name)
    except ProtocolError as e:
        return s.fail(e)
    return JSONResponse(s.model_card())


@router.post("/v1/completions")
async def completions(request: HTTPRequest) -> Response:
    return await _generate(request, chat_kind=False)


@router.post("/v1/chat/completions")
async def chat_completions(request: HTTPRequest) -> Response:
    return await _generate(request, chat_kind=True)


async def read_json(request: HTTPRequest) -> Any:
    """The request body as JSON; ProtocolError for a body over MAX_BODY bytes or one that is not JSON."""
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > MAX_BODY:
        raise ProtocolError(f"the request body has {int(size)} bytes; the limit is {MAX_BODY} bytes", param="body",
                            code="body_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY:
            raise ProtocolError(f"the request body exceeds the limit of {MAX_BODY} bytes", param="body",
                                code="body_too_large")
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ProtocolError(f"the request body is not valid JSON ({e})", param="body") from None
    except RecursionError:
        raise ProtocolError("the request body nests JSON too deeply", param="body") from None


async def _generate(request: HTTPRequest, chat_kind: bool) -> Response:
    s = served(request)
    timeout = s.limits.request_timeout
    deadline = time.monotonic() + timeout
    try:
        s.check_key(request)
        try:
            raw = await asyncio.wait_for(read_json(request), timeout)
        except TimeoutError:
            raise ProtocolError(f"the request body did not arrive within {timeout:g} s (--request-timeout)", 408,
                                param="body", code="request_timeout") from None
        body = parse(ChatRequest if chat_kind else CompletionRequest, raw)
        s.check_model(body.model)
        prompts = s.prompt_ids(body, chat_kind)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        reqs = s.requests(body, prompts, chat_kind, loop, queue)
    except ProtocolError as e:
        return s.fail(e)
    try:
        s.engine.submit(reqs)
    except RequestError as e:
        return s.fail(ProtocolError(str(e), param=e.param))
    except QueueFull as e:
        return s.fail(ProtocolError(str(e), 429, type="rate_limit_error", code="queue_full"), {"Retry-After": "1"})
    except Closed as e:
        return s.fail(ProtocolError(str(e), 503, type="service_unavailable", code="shutting_down"))
    s.engine.metrics.prompt_tokens.inc(sum(len(p) for p in prompts))
    reply = Reply(s.model_name, chat_kind)
    choices = [ChatChoice(body.thinking, bool(body.prompt_tools)) for _ in reqs] if chat_kind else []
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_stream(s, reply, reqs, queue, include_usage, choices, deadline),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    return await _whole(s, request, reply, reqs, queue, choices, deadline)


async def _whole(s: Served, request: HTTPRequest, reply: Reply, reqs: list[Request], queue: asyncio.Queue,
                 choices: list[ChatChoice], deadline: float) -> Response:
    engine = s.engine
    try:
        pending, checked = len(reqs), time.monotonic()
        while pending:
            if time.monotonic() > deadline:
                return s.fail(s.timed_out(reqs))
            try:
                _, _, reason = await asyncio.wait_for(queue.get(), POLL_S)
                pending -= reason is not None
            except TimeoutError:
                pass
            if pending and time.monotonic() - checked >= POLL_S:  # tokens may come faster than POLL_S
                checked = time.monotonic()
                if await request.is_disconnected():
                    for r in reqs:
                        engine.cancel(r)
                    return Response(status_code=499)  # nobody reads it
    finally:
        for r in reqs:
            if not r.finished:
                engine.cancel(r)
    failed = [r for r in reqs if r.finish_reason == "error"]
    if failed:
        return s.fail(ProtocolError(f"generation failed: {failed[0].error}", 500, type="server_error"))
    if engine.draining and all(r.finish_reason == "abort" and r.sampled == 0 for r in reqs):
        return s.fail(ProtocolError("the server shut down before this request got a row; retry it elsewhere", 503,
                                    type="service_unavailable", code="shutting_down"))
    out = reply.full([r.text for r in reqs], [r.finish_reason for r in reqs], total_usage(reqs), choices)
    for c in choices:
        if c.error:
            log.warning("%s: malformed tool-call markup, returned as text: %s", reply.id, c.error)
    return JSONResponse(out)


async def _stream(s: Served, reply: Reply, reqs: list[Request], queue: asyncio.Queue, include_usage: bool,
                  choices: list[ChatChoice], deadline: float) -> AsyncIterator[str]:
    def event(obj: dict) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    try:
        if reply.chat:
            yield event(reply.delta_chunk(0, {"role": "assistant", "content": ""}))
        pending = len(reqs)
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                yield event(s.timed_out(reqs).body())
                break
            try:
                index, piece, reason = await asyncio.wait_for(queue.get(), min(left, s.limits.keepalive))
            except TimeoutError:
                yield ": keepalive\n\n"
                continue
            pending -= reason is not None
            if reason == "error":
                yield event(ProtocolError(f"generation failed: {reqs[index].error}", 500, type="server_error").body())
            elif not reply.chat:
                if piece or reason is not None:
                    yield event(reply.chunk(index, piece, reason))
            else:
                c = choices[index]
                for delta in c.deltas(piece) + (c.finish(reason) if reason is not None else []):
                    yield event(reply.delta_chunk(index, delta))
                if reason is not None:
                    if c.error:
                        log.warning("%s: malformed tool-call markup, streamed as text: %s", reply.id, c.error)
                    yield event(reply.delta_chunk(index, {}, c.reason(reason)))
        if include_usage:
            yield event(reply.usage_chunk(total_usage(reqs)))
        yield "data: [DONE]\n\n"
    finally:  # the client went away (the generator is closed) or all ended
        for r in reqs:
            if not r.finished:
                s.engine.cancel(r)


def total_usage(reqs: list[Request]) -> dict:
    """The OpenAI usage of one HTTP request's prompts: prompt tokens, tokens sampled (EOS included)."""
    return usage(sum(len(r.prompt_ids) for r in reqs), sum(r.sampled for r in reqs))


class _Server(uvicorn.Server):
    """uvicorn's server with a graceful SIGTERM: drain the engine, then shut down; SIGTERM is not
    raised again afterwards, so the command exits 0 (uvicorn re-raises the signals it caught)."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]):
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig: int, frame) -> None:
        if not self.should_exit:
            self._on_exit()
        if sig == signal.SIGTERM:
            self.should_exit = True
        else:
            super().handle_exit(sig, frame)


def serve(session: Session, host: str = "127.0.0.1", port: int = 8000, max_queue: int = 128,
          api_key: str | None = None, model_name: str = "dsneuron", grace: float = 30.0,
          ready: Callable[[str], None] | None = None, sock: socket.socket | None = None,
          limits: Limits = Limits(), prefix_cache_bytes: int = 0, speculation=None) -> None:
    """Serve `session` at http://host:port until SIGTERM or Ctrl-C (module docstring); port 0 takes
    a free one; `sock`: a socket `listen` bound already (host and port are then its);
    prefix_cache_bytes: the prefix cache's budget (0: none; runtime_min/core/prefix_cache.py);
    speculation: a runtime_min/core/speculative.py Speculation the scheduler drafts and verifies
    with (None: none; not with a sharded bundle). ready(url) is
    called once the socket listens. Raises UserError for an address that cannot be bound; after
    Ctrl-C the KeyboardInterrupt uvicorn raises again.

    In a rank of a sharded bundle (a torch.distributed group of several processes,
    runtime_min/sharded.py) rank 0 serves and the other ranks `follow` it."""
    import torch.distributed as dist

    channel = None
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        channel = Channel()
        if dist.get_rank() != 0:
            follow(session, channel)
            return
    engine = Engine(session, max_queue, channel, prefix_cache_bytes, speculation)
    app = create_app(engine, model_name, api_key, limits)
    sock = sock or listen(host, port)
    # h11 refuses (400) a request line and headers past its own bound: keep it above --max-header-bytes so
    # HeaderLimits answers first, naming the flag
    config = uvicorn.Config(app, log_level="info", timeout_graceful_shutdown=int(grace) + 5,
                            h11_max_incomplete_event_size=limits.max_header_bytes + 16384)
    server = _Server(config, lambda: engine.drain(grace))
    engine.start()
    try:
        if ready is not None:
            ready(f"http://{host}:{sock.getsockname()[1]}")
        server.run(sockets=[sock])
    finally:
        engine.stop()
        sock.close()


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) and listening; UserError naming the address otherwise."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, kind, proto, _, addr = infos[0]
        sock = socket.socket(family, kind, proto)
    except (OSError, IndexError) as e:
        raise UserError(f"--host {host}: not an address of this host ({e})") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        hint = {errno.EADDRINUSE: " (is another server using the port?)",
                errno.EADDRNOTAVAIL: " (not an address of this host)",
                errno.EACCES: " (ports below 1024 need privileges)"}.get(e.errno, "")
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}{hint}") from None
    sock.set_inheritable(True)
    return sock
