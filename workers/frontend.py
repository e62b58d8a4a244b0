"""deltafin-http: an OpenAI-compatible HTTP frontend, its own process and a ZeroMQ client.

Like vLLM's API server in front of its engine core, the frontend holds no model: it speaks HTTP
(Starlette on uvicorn) to editors, agents and chat front ends, and the deltafin protocol
(deltafin.client) to the runtime, so either side can be restarted alone. It serves
GET /v1/models, POST /v1/completions and /v1/chat/completions (OpenAI's API), POST /v1/messages
(Anthropic's Messages API; streamed answers as server-sent events, one event per token as the
runtime produces it), GET /health and GET /metrics (Prometheus text exposition of
the runtime's metrics snapshot). docs/HTTP.md describes the endpoints.

- No store and no tokenizer here: a prompt text or a chat's messages go to the runtime as they
  are (workers/openai_api.py shapes the bodies), its request manager tokenizes them with the
  model's chat template, and the prompt's token count comes back in the final message's stats
  (`usage`); a chat's default `max_tokens`, the rest of the context, is counted there too.
- Each HTTP request borrows a Client of its own from a pool (ZeroMQ sockets are not thread-safe,
  and replies of concurrent requests must not mix); a Client whose request failed or was cancelled
  is closed rather than returned, so no late reply can reach the next request.
- A streaming request runs Client.stream on a thread of its own that hands each piece to the
  event loop; when the HTTP client disconnects, the thread stops consuming, sends `cancel` where
  the client library has it, and closes the Client.

The supervisor's side, which starts this process with `deltafin-supervisor --http HOST:PORT`, is
workers/frontend_process.py.
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os
import resource
import socket
import sys
import threading
import time
from pathlib import Path

import uvicorn
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route
from uvicorn.protocols.http.h11_impl import H11Protocol

from deltafin.client import Client, DeltafinError, RuntimeUnavailable
from deltafin.protocol.messages import short
from deltafin.runtime import lossy
from deltafin.runtime.cli import Help
from deltafin.runtime.prometheus import prometheus_text
from deltafin.workers.frontend_process import LISTENING, parse_listen
from deltafin.workers.http_auth import API_KEY_ENV, BearerAuth
from deltafin.runtime.config import HttpConfig
from deltafin.workers.anthropic_api import MessagesShape, messages_request
from deltafin.workers.openai_api import (ApiError, api_error_from, chat_request, check_schema,
                                         completion_request, generate_args, parse_body)
from deltafin.workers.openai_shapes import ChatShape, CompletionShape

RETRY_AFTER_S = 2              # Retry-After on 429 and 503
PARSE_INLINE_BYTES = 64 << 10  # a larger body is parsed on a worker thread, off the event loop
WAITING_RESERVE, WAITING_MIN = 128, 64  # open files kept from connections waiting for a head


# -- the frontend ----------------------------------------------------------------------------------
class ClientPool:
    """Connected Clients, one per request in flight; at most `keep` idle ones are kept."""

    def __init__(self, endpoint: str, timeout: float, keys: str | None, keep: int = 8):
        self.endpoint, self.timeout, self.keys, self.keep = endpoint, timeout, keys, keep
        self._idle: list[Client] = []
        self._lock = threading.Lock()

    def connect(self, timeout: float):
        """Waits (up to timeout) until the runtime answers hello; returns its `welcome`."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                c = Client(self.endpoint, timeout=min(5.0, max(0.1, deadline - time.monotonic())),
                            keys=self.keys)
                break
            except RuntimeUnavailable:
                if time.monotonic() > deadline:
                    raise RuntimeUnavailable(f"no runtime answered at {self.endpoint} within "
                                             f"{timeout:.0f} s (is deltafin-supervisor serving there?)") from None
        c.timeout = self.timeout
        self.put(c)
        return c.info

    def get(self) -> Client:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return Client(self.endpoint, timeout=self.timeout, keys=self.keys)

    def put(self, c: Client) -> None:
        with self._lock:
            if len(self._idle) < self.keep:
                self._idle.append(c)
                return
        c.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for c in idle:
            c.close()


class HttpFrontend:
    """The OpenAI-compatible API over one deltafin runtime. `app` is the ASGI application."""

    def __init__(self, endpoint: str, timeout: float = 120.0, keys: str | None = None,
                 connect_timeout: float = 60.0, max_body: int = HttpConfig().body_bytes,
                 body_timeout: float = HttpConfig().body_timeout_s, api_key: str | None = None):
        self.pool = ClientPool(endpoint, timeout, keys)
        info = self.pool.connect(connect_timeout)
        self.store_path = info.model  # the runtime's store, named in `welcome`
        self.model_id = Path(info.model).name
        # the run's setting, exact or lossy, in every OpenAI response (runtime/lossy.py)
        self.fingerprint = lossy.fingerprint(info.lossy) if info.lossy else None
        self.max_context = info.max_context
        # A larger body is refused while arriving, before any of it is parsed (never more than
        # the runtime's request limit, which could not relay it).
        self.max_body = min(max_body, info.max_request_bytes or max_body)
        self.body_timeout = body_timeout
        self.created = int(time.time())
        self.http_counts = {"requests": {}, "cancelled": 0, "started": time.time()}
        routes = [Route("/v1/models", self.models, methods=["GET"]),
                  Route("/v1/models/{model:path}", self.model, methods=["GET"]),
                  Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                  Route("/v1/messages", self.messages, methods=["POST"]),
                  Route("/health", self.health, methods=["GET"]),
                  Route("/metrics", self.metrics, methods=["GET"])]
        self.app = Starlette(routes=routes, exception_handlers={404: self._not_found, 405: self._not_allowed})
        if api_key:
            self.app.add_middleware(BearerAuth, key=api_key)
        self.app.add_middleware(_CountRequests, counts=self.http_counts)

    def close(self) -> None:
        self.pool.close()

    # -- helpers ------------------------------------------------------------------------------------
    @staticmethod
    def error(e: ApiError, shape=CompletionShape):
        """e in the API's error body (shape: its answer's class or instance)."""
        headers = {"Retry-After": str(RETRY_AFTER_S)} if e.status in (429, 503) else None
        return JSONResponse(shape.error_body(e), status_code=e.status, headers=headers)

    async def _not_found(self, request, exc):
        return self.error(ApiError(404, f"no route {request.method} {request.url.path}",
                                   "invalid_request_error", code="not_found"))

    async def _not_allowed(self, request, exc):
        return self.error(ApiError(405, f"{request.method} is not allowed on {request.url.path}",
                                   "invalid_request_error", code="method_not_allowed"))

    async def _body(self, request) -> dict:
        """The body within http.body_timeout_s (else 408) and http.max_body_bytes (else 413), then
        parsed (off the event loop when large) and checked (workers/openai_api.parse_body)."""
        raw = bytearray()
        try:
            async with asyncio.timeout(self.body_timeout):
                async for part in request.stream():
                    raw += part
                    if len(raw) > self.max_body:
                        raise ApiError(413, f"the body exceeds the {self.max_body} byte limit "
                                            f"(http.max_body_bytes)", code="request_too_large")
        except TimeoutError:
            raise ApiError(408, f"the body did not arrive within {self.body_timeout:g} s "
                                f"(http.body_timeout_s)", code="request_timeout") from None
        body = (await run_in_threadpool(parse_body, bytes(raw)) if len(raw) > PARSE_INLINE_BYTES
                else parse_body(bytes(raw)))
        model = body.get("model")
        if not isinstance(model, str):
            raise ApiError(400, "'model' is required (GET /v1/models lists it)", param="model")
        if model not in (self.model_id, self.store_path):
            raise ApiError(404, f"the model {short(model)} does not exist; this server runs "
                                f"'{self.model_id}'", "invalid_request_error", "model", "model_not_found")
        return body

    def _model_card(self) -> dict:
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "deltafin",
                "max_model_len": self.max_context}

    async def _call(self, fn, *args, param: str | None = None):
        """A blocking Client call on a worker thread; the Client goes back to the pool only after
        a clean answer. param: the body's prompt field, named by a prompt over the context."""
        def run():
            c = self.pool.get()
            try:
                out = fn(c, *args)
            except BaseException:
                c.close()
                raise
            self.pool.put(c)
            return out
        try:
            return await run_in_threadpool(run)
        except ApiError:
            raise
        except Exception as e:
            raise api_error_from(e, param) from None

    # -- routes -------------------------------------------------------------------------------------
    async def models(self, request):
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request):
        if request.path_params["model"] not in (self.model_id, self.store_path):
            return self.error(ApiError(404, f"the model {short(request.path_params['model'])} does not exist",
                                       param="model", code="model_not_found"))
        return JSONResponse(self._model_card())

    async def health(self, request):
        try:
            h = await self._call(lambda c: c.health())
        except ApiError as e:
            return self.error(e)
        return JSONResponse({"status": "ok" if h["ok"] else h["state"], **h},
                            status_code=200 if h["ok"] else 503)

    async def metrics(self, request):
        try:
            snap = await self._call(lambda c: c.stats())
        except ApiError as e:
            return self.error(e)
        return PlainTextResponse(prometheus_text(snap, self.http_counts),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    async def completions(self, request):
        try:
            prompt, params = completion_request(await self._body(request), self.max_context)
            await check_schema(params)
        except ApiError as e:
            return self.error(e)
        return await self._answer(prompt, params, CompletionShape(self.model_id, params, self.fingerprint), "prompt")

    async def chat_completions(self, request):
        try:
            messages, params = chat_request(await self._body(request))
            await check_schema(params)
        except ApiError as e:
            return self.error(e)
        return await self._answer(messages, params, ChatShape(self.model_id, params, self.fingerprint), "messages")

    async def messages(self, request):
        try:
            messages, params = messages_request(await self._body(request))
        except ApiError as e:
            return self.error(e, MessagesShape)
        return await self._answer(messages, params, MessagesShape(self.model_id, params), "messages")

    # -- generation ---------------------------------------------------------------------------------
    async def _answer(self, prompt, p: dict, shape, param: str):
        """prompt: a text or token ids (completions), or chat messages: sent as they are, the
        runtime tokenizes them. shape: the API's answer (workers/openai_shapes.py,
        workers/anthropic_api.py); param: the body's prompt field, named by a prompt too long."""
        if p["stream"]:
            return await self._stream(prompt, p, shape, param)
        try:
            gen = await self._call(lambda c: c.generate(prompt, **generate_args(p)), param=param)
        except ApiError as e:
            return self.error(e, shape)
        return JSONResponse(shape.whole(gen))

    async def _stream(self, prompt, p: dict, shape, param: str):
        """Server-sent events, one per token message of the runtime. The first piece (or the
        error) is awaited before the response starts, so a refused request still gets its HTTP
        status (400, 429, 503) rather than a 200 stream holding an error."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        pump = _StreamPump(self.pool, prompt, generate_args(p), loop, events)
        pump.start()
        try:
            first = await events.get()
        except asyncio.CancelledError:
            pump.cancel()
            raise
        if first[0] == "error":
            return self.error(api_error_from(first[1], param), shape)

        async def body():
            event = first
            for part in shape.start():
                yield part
            while True:
                kind, value = event
                parts = (shape.piece(*value) if kind == "piece" else shape.end(value) if kind == "done"
                         else shape.failed(api_error_from(value)))  # mid-stream: the status is sent
                for part in parts:
                    yield part
                if kind != "piece":
                    break
                event = await events.get()

        return _EventStream(body(), on_close=lambda finished: self._closed(pump, finished))

    def _closed(self, pump: "_StreamPump", finished: bool) -> None:
        if not finished:
            self.http_counts["cancelled"] += 1
            pump.cancel()


class _StreamPump:
    """Runs Client.stream on a thread of its own (the Client's socket never leaves it) and hands
    ("piece", (text, its tokens' logprobs or None)), then ("done", Generation) or ("error", exception) to the event loop."""

    def __init__(self, pool: ClientPool, prompt, args: dict, loop, events: asyncio.Queue):
        self.pool, self.prompt, self.args, self.loop, self.events = pool, prompt, args, loop, events
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="http-stream", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def cancel(self) -> None:
        """Seen by the thread after the runtime's next message (each token, or the end)."""
        self.stop.set()

    def _put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the event loop is gone (the server is stopping)
            self.stop.set()

    def _run(self) -> None:
        c = None
        clean = False
        try:
            c = self.pool.get()
            pieces = c.stream(self.prompt, **self.args)
            for piece in pieces:
                if self.stop.is_set():
                    break
                self._put(("piece", (piece, getattr(pieces, "logprobs", None))))
            if self.stop.is_set():
                self._cancel(c, pieces)
            else:
                self._put(("done", c.last))
                clean = True
        except Exception as e:
            self._put(("error", e))
        finally:
            if c is not None:
                self.pool.put(c) if clean else c.close()

    @staticmethod
    def _cancel(c: Client, pieces) -> None:
        """The runtime's `cancel` where the client library has it (the stream's own `cancel`, or
        `Client.cancel(id)`): compute stops within a token. Without it, closing the Client is all
        a client can do, and the runtime finishes the request into a peer that is gone."""
        cancel = getattr(pieces, "cancel", None)
        rid, by_id = getattr(pieces, "id", None), getattr(c, "cancel", None)
        if cancel is None and rid is not None and by_id is not None:
            cancel = lambda: by_id(rid)
        try:
            if cancel is not None:
                cancel()
            close = getattr(pieces, "close", None)  # a generator: end it here, on its own thread
            if close is not None:
                close()
        except Exception:  # the Client is closed next anyway
            pass


class _EventStream(StreamingResponse):
    """An SSE response that reports how it ended: `on_close(True)` after its last byte,
    `on_close(False)` when the HTTP client went away first (Starlette then cancels the body)."""

    def __init__(self, content, on_close):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close
        self.finished = False

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close(self.finished)
            await self.body_iterator.aclose()

    async def stream_response(self, send) -> None:
        await super().stream_response(send)
        self.finished = True


class _CountRequests:
    """ASGI middleware counting answered requests by path and status, for /metrics."""

    PATHS = {"/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/messages", "/health",
             "/metrics"}

    def __init__(self, app, counts: dict):
        self.app, self.counts = app, counts

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"] if scope["path"] in self.PATHS else "other"

        async def counted(message):
            if message["type"] == "http.response.start":
                key = (path, str(message["status"]))
                self.counts["requests"][key] = self.counts["requests"].get(key, 0) + 1
            await send(message)
        await self.app(scope, receive, counted)


class HeadTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection that has not sent a complete request head
    within `header_timeout` seconds of opening or of its previous answer (slow or half-open
    connections: uvicorn's own keep-alive timer restarts with every byte, so a byte every few
    seconds would hold a connection forever). At most `max_waiting` connections wait for a head
    at once (`waiting`, shared by all, oldest first): a new one beyond closes the oldest, so
    idle connections cannot take every file the process may open."""

    def __init__(self, *args, header_timeout: float, max_waiting: int, waiting: dict, **kwargs):
        super().__init__(*args, **kwargs)
        self.header_timeout, self.max_waiting, self.waiting = header_timeout, max_waiting, waiting
        self._head_timer: asyncio.TimerHandle | None = None
        self._timed_cycle = None

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(self.header_timeout, self._head_late)
        self.waiting[self] = None

    def _disarm(self) -> None:
        self.waiting.pop(self, None)
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        self._disarm()
        if not self.transport.is_closing():
            self.transport.close()

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()
        while len(self.waiting) > self.max_waiting:
            next(iter(self.waiting))._head_late()

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not None and self.cycle is not self._timed_cycle:  # a head arrived
            self._timed_cycle = self.cycle
            self._disarm()

    def on_response_complete(self) -> None:
        self._arm()  # first: a pipelined next request's head, handled within, disarms it
        super().on_response_complete()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)


def raise_file_limit() -> int:
    """The soft limit on open files raised to the hard one (each connection is one): returns it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        want = 1 << 16 if hard == resource.RLIM_INFINITY else hard
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):  # macOS refuses beyond OPEN_MAX
            pass
    return soft


# -- the process -----------------------------------------------------------------------------------
class AnnouncingServer(uvicorn.Server):
    """uvicorn's server that says `LISTENING <url>` on stdout once it serves (the supervisor
    waits for that line), then sends stdout to stderr."""

    def __init__(self, config, url: str, model_id: str):
        super().__init__(config)
        self.url, self.model_id = url, model_id

    async def startup(self, sockets=None):
        await super().startup(sockets=sockets)
        if self.started:
            print(f"{LISTENING} {self.url}", flush=True)
            os.dup2(2, 1)  # nothing else goes to stdout: the supervisor stops reading it
            print(f"deltafin-http: serving {self.model_id} on {self.url}", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(formatter_class=Help, prog="deltafin-http", description=(
        "OpenAI- and Anthropic-compatible HTTP API (/v1/models, /v1/completions, /v1/chat/completions, "
        "/v1/messages, /health, "
        "/metrics) in front of a running deltafin runtime."))
    ap.add_argument("--endpoint", required=True, help="the runtime's endpoint (the READY line of "
                                                      "deltafin-supervisor)")
    ap.add_argument("--listen", default="127.0.0.1:8000", help="HOST:PORT to serve HTTP on "
                                                               "(default 127.0.0.1:8000; port 0: any free port)")
    ap.add_argument("--allow-remote", action="store_true",
                    help="allow a non-loopback HOST (no authentication: anyone who reaches the port "
                         "can use the model)")
    ap.add_argument("--keys", help="CURVE keys for a runtime served with --allow-remote (docs/SECURITY.md)")
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="seconds without a message from the runtime before a request fails (503)")
    d = HttpConfig()
    ap.add_argument("--header-timeout", type=float, default=d.header_timeout_s,
                    help="seconds a connection has to send a complete request head (http.header_timeout_s)")
    ap.add_argument("--body-timeout", type=float, default=d.body_timeout_s,
                    help="seconds a request's body may take after its head; then 408 (http.body_timeout_s)")
    ap.add_argument("--idle-timeout", type=float, default=d.idle_timeout_s,
                    help="seconds a kept-alive connection may stay silent (http.idle_timeout_s)")
    ap.add_argument("--max-body-bytes", type=int, default=d.body_bytes,
                    help="the largest request body; larger ones get 413 (http.max_body_bytes)")
    ap.add_argument("--api-key", help=f"require `Authorization: Bearer KEY` on every request but /health "
                                      f"(default: ${API_KEY_ENV}, else none)")
    ap.add_argument("--parent-pid", type=int, help=argparse.SUPPRESS)  # set by the supervisor
    a = ap.parse_args(argv)
    if a.parent_pid:
        from deltafin.workers.common import die_with_parent
        die_with_parent(a.parent_pid)
    try:
        host, port = parse_listen(a.listen, a.allow_remote)
    except ValueError as e:
        print(f"deltafin-http: error: {e}", file=sys.stderr)
        return 2
    # A client that disconnects mid-stream makes asyncio log each write already queued for it.
    logging.getLogger("asyncio").setLevel(logging.ERROR)
    if a.parent_pid is None:  # started by hand: say what the wait is for (the supervisor's has started it)
        print(f"deltafin-http: waiting for the runtime at {a.endpoint} ...", file=sys.stderr, flush=True)
    try:
        front = HttpFrontend(a.endpoint, timeout=a.timeout, keys=a.keys, max_body=a.max_body_bytes,
                             body_timeout=a.body_timeout, api_key=a.api_key or os.environ.get(API_KEY_ENV))
    except (DeltafinError, OSError) as e:
        print(f"deltafin-http: error: cannot reach the runtime at {a.endpoint}: {e}", file=sys.stderr)
        return 1
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(info[0], socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart rebinds at once
        sock.bind(info[4])
    except OSError as e:
        print(f"deltafin-http: error: cannot listen on {a.listen}: {e}", file=sys.stderr)
        front.close()
        return 2
    bound = sock.getsockname()
    shown = f"[{bound[0]}]" if info[0] == socket.AF_INET6 else bound[0]
    url = f"http://{shown}:{bound[1]}"

    # connections waiting for a head take at most half the files, less WAITING_RESERVE: the rest
    # holds the interpreter's, the ZeroMQ clients of requests in flight and connections accepted
    # in one burst (asyncio accepts up to `backlog` at once) before the oldest waiting are closed
    most = max(WAITING_MIN, raise_file_limit() // 2 - WAITING_RESERVE)
    protocol = functools.partial(HeadTimeoutProtocol, header_timeout=a.header_timeout,
                                 max_waiting=most, waiting={})
    config = uvicorn.Config(front.app, log_level="warning", access_log=False, lifespan="off",
                            timeout_graceful_shutdown=2, server_header=False, http=protocol,
                            timeout_keep_alive=a.idle_timeout, backlog=WAITING_RESERVE)
    try:
        AnnouncingServer(config, url, front.model_id).run(sockets=[sock])
    finally:
        front.close()
        sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
