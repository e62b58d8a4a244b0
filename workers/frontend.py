"""deltafin-http: an OpenAI-compatible HTTP frontend, its own process and a ZeroMQ client.

Like vLLM's API server in front of its engine core, the frontend holds no model: it speaks HTTP
(Starlette on uvicorn) to editors, agents and chat front ends, and the deltafin protocol
(deltafin.client) to the runtime, so either side can be restarted alone. It serves
GET /v1/models, POST /v1/completions and /v1/chat/completions (server-sent events, one event per
token as the runtime produces it), GET /health and GET /metrics (Prometheus text exposition of
the runtime's metrics snapshot). docs/HTTP.md describes the endpoints.

- Prompts are tokenized here with the store's own tokenizer files (the runtime names its store
  in `welcome`) and sent as token ids: a chat's messages are rendered with the model's chat
  template exactly as the runtime renders `chat: true` (runtime/tokenizer.py), and the prompt
  length is known for `usage` and the default `max_tokens` of a chat.
- Each HTTP request borrows a Client of its own from a pool (ZeroMQ sockets are not thread-safe,
  and replies of concurrent requests must not mix); a Client whose request failed or was cancelled
  is closed rather than returned, so no late reply can reach the next request.
- A streaming request runs Client.stream on a thread of its own that hands each piece to the
  event loop; when the HTTP client disconnects, the thread stops consuming, sends `cancel` where
  the client library has it, and closes the Client.

`FrontendProcess` is the supervisor's side (`deltafin-supervisor --http HOST:PORT`): it starts
`deltafin-http` as a child once the runtime serves, prints `HTTP http://HOST:PORT`, restarts the
child when it dies and stops it with the supervisor.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import secrets
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from jinja2.exceptions import TemplateError
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from deltafin.client import (Client, DeltafinError, ExpertUnavailableError, ProtocolMismatch,
                             RequestError, RuntimeBusy, RuntimeDeadError, RuntimeRestarting,
                             RuntimeUnavailable)
from deltafin.runtime.prometheus import prometheus_text
from deltafin.runtime.security import LOOPBACK_HOSTS
from deltafin.runtime.store import Store
from deltafin.runtime.tokenizer import Tokenizer

LISTENING = "LISTENING"        # the child's one stdout line once it serves: `LISTENING http://...`
RETRY_AFTER_S = 2              # Retry-After on 429 and 503
CHILD_STOP_GRACE_S = 3.0       # SIGTERM, then SIGKILL
RESTART_BACKOFF_S = (0.5, 10.0)  # first and longest wait before restarting a child that died


# -- errors -----------------------------------------------------------------------------------------
class FrontendError(RuntimeError):
    """The frontend cannot serve this runtime (its store's tokenizer is out of reach)."""


class ApiError(Exception):
    """An error answered with OpenAI's body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def api_error_from(e: Exception) -> ApiError:
    """The client library's exceptions as HTTP statuses: the request's fault 400, the runtime
    busy 429, the runtime restarting, unreachable or a worker dead 503 (all worth a retry)."""
    code = getattr(e, "code", None)
    if isinstance(e, RequestError):
        return ApiError(400, str(e), "invalid_request_error", code=code)
    if isinstance(e, RuntimeBusy):
        return ApiError(429, str(e), "rate_limit_error", code=code)
    if isinstance(e, (RuntimeRestarting, RuntimeUnavailable, RuntimeDeadError)):
        return ApiError(503, str(e), "service_unavailable", code=code or "unavailable")
    if isinstance(e, (ExpertUnavailableError, ProtocolMismatch, DeltafinError)):
        return ApiError(500, str(e), "server_error", code=code)
    return ApiError(500, f"{type(e).__name__}: {e}", "server_error", code="internal")


# -- request bodies ---------------------------------------------------------------------------------
def _number(body: dict, key: str, default, lo=None, hi=None, lo_open=False, integer=False):
    v = body.get(key)
    if v is None:
        return default
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok or (not integer and not math.isfinite(v)):
        raise ApiError(400, f"'{key}' must be {'an integer' if integer else 'a number'}", param=key)
    if (lo is not None and (v <= lo if lo_open else v < lo)) or (hi is not None and v > hi):
        rng = f"{'(' if lo_open else '['}{lo}, {hi if hi is not None else 'inf'}]"
        raise ApiError(400, f"'{key}' must be in {rng}; got {v}", param=key)
    return v


def sampling(body: dict, max_tokens_default: int | None) -> dict:
    """The generate parameters shared by completions and chat; OpenAI options the runtime cannot
    honour are refused, not ignored, unless they hold their neutral value."""
    if _number(body, "n", 1, 1, integer=True) != 1:
        raise ApiError(400, "only n = 1 is supported", param="n")
    for key in ("presence_penalty", "frequency_penalty"):
        if _number(body, key, 0, -2, 2) != 0:
            raise ApiError(400, f"'{key}' is not supported (only 0)", param=key)
    if body.get("logit_bias"):
        raise ApiError(400, "'logit_bias' is not supported", param="logit_bias")
    max_tokens = body.get("max_completion_tokens")
    key = "max_completion_tokens"
    if max_tokens is None:
        max_tokens, key = body.get("max_tokens"), "max_tokens"
    max_tokens = _number({key: max_tokens}, key, max_tokens_default, 0, integer=True)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise ApiError(400, "'stop' must be a string or a list of strings", param="stop")
    seed = _number(body, "seed", None, 0, integer=True)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be a boolean", param="stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise ApiError(400, "'stream_options' must be an object", param="stream_options")
    return {"max_tokens": max_tokens, "temperature": float(_number(body, "temperature", 1.0, 0)),
            "top_p": float(_number(body, "top_p", 1.0, 0, 1, lo_open=True)), "seed": seed,
            "stop": ([s for s in stop if s] or None) if stop else None, "stream": stream,
            "include_usage": bool(opts.get("include_usage")) and stream}


def message_text(content, i: int) -> str:
    """A message's content: a string, or a list of text parts (the newer OpenAI shape)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts",
                   param=f"messages[{i}].content")


ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
         "tool": "tool"}


def chat_messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ApiError(400, f"messages[{i}] must be an object with a role among "
                                f"{', '.join(ROLES)}", param=f"messages[{i}].role")
        content = m.get("content")
        out.append({"role": ROLES[m["role"]],
                    "content": "" if content is None and m["role"] == "assistant" else message_text(content, i)})
    return out


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
                    raise
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
                 connect_timeout: float = 60.0):
        self.pool = ClientPool(endpoint, timeout, keys)
        info = self.pool.connect(connect_timeout)
        self.store_path = Path(info.model)
        self.model_id = self.store_path.name
        self.max_context = info.max_context
        # A body larger than the runtime's request limit could not be relayed anyway; it is
        # refused while arriving, before any of it is parsed or tokenized.
        self.max_body = info.max_request_bytes
        self.created = int(time.time())
        try:  # the store's own files: the tokenizer the runtime uses, whatever the runtime's cwd
            store = Store(self.store_path)
            self.tokenizer = Tokenizer(store.tokenizer_dir, store.config)
        except Exception as e:
            self.pool.close()
            raise FrontendError(f"cannot read the tokenizer of the runtime's store {self.store_path} "
                                f"({e}); run deltafin-http on the runtime's machine, from the "
                                f"supervisor's directory when its --model was relative") from None
        # No token stands for more characters than its stored spelling has (byte-level BPE spells
        # each byte with one character), so a longer text surely holds more than max_context
        # tokens: refused at once, never tokenized.
        longest = max((len(t) for t in self.tokenizer.tok.get_vocab(with_added_tokens=True)), default=1)
        self.max_prompt_chars = self.max_context * max(1, longest)
        self.http_counts = {"requests": {}, "cancelled": 0, "started": time.time()}
        routes = [Route("/v1/models", self.models, methods=["GET"]),
                  Route("/v1/models/{model:path}", self.model, methods=["GET"]),
                  Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                  Route("/health", self.health, methods=["GET"]),
                  Route("/metrics", self.metrics, methods=["GET"])]
        self.app = Starlette(routes=routes, exception_handlers={404: self._not_found, 405: self._not_allowed})
        self.app.add_middleware(_CountRequests, counts=self.http_counts)

    def close(self) -> None:
        self.pool.close()

    # -- helpers ------------------------------------------------------------------------------------
    @staticmethod
    def error(e: ApiError):
        headers = {"Retry-After": str(RETRY_AFTER_S)} if e.status in (429, 503) else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    async def _not_found(self, request, exc):
        return self.error(ApiError(404, f"no route {request.method} {request.url.path}",
                                   "invalid_request_error", code="not_found"))

    async def _not_allowed(self, request, exc):
        return self.error(ApiError(405, f"{request.method} is not allowed on {request.url.path}",
                                   "invalid_request_error", code="method_not_allowed"))

    async def _body(self, request) -> dict:
        raw = bytearray()
        async for part in request.stream():
            raw += part
            if len(raw) > self.max_body:
                raise ApiError(413, f"the body exceeds the runtime's {self.max_body} byte request "
                                    f"limit (runtime.max_request_bytes)", code="request_too_large")
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        model = body.get("model")
        if not isinstance(model, str):
            raise ApiError(400, "'model' is required (GET /v1/models lists it)", param="model")
        if model not in (self.model_id, str(self.store_path)):
            raise ApiError(404, f"the model '{model}' does not exist; this server runs "
                                f"'{self.model_id}'", "invalid_request_error", "model", "model_not_found")
        return body

    async def _encode(self, prompt, chat: bool) -> list[int]:
        """The runtime's tokenization (`chat: true` renders the whole conversation with the chat
        template), on a worker thread so a long prompt never stalls other requests' streams."""
        chars = len(prompt) if isinstance(prompt, str) else sum(len(m["content"]) for m in prompt)
        if chars > self.max_prompt_chars:
            raise ApiError(400, f"the prompt's {chars} characters hold more than the "
                                f"{self.max_context} tokens of the context (max_context)",
                           param="messages" if chat else "prompt", code="context_length_exceeded")
        try:
            ids = await run_in_threadpool(self.tokenizer.encode, prompt, chat)
        except TemplateError as e:
            raise ApiError(400, f"the model's chat template refused the messages: {e}",
                           param="messages") from None
        except Exception as e:
            raise ApiError(400, f"cannot tokenize the prompt: {e}",
                           param="messages" if chat else "prompt") from None
        if len(ids) >= self.max_context:  # the runtime would refuse it too, after a longer trip
            raise ApiError(400, f"the prompt's {len(ids)} tokens leave no room in the context of "
                                f"{self.max_context} tokens (max_context)",
                           param="messages" if chat else "prompt", code="context_length_exceeded")
        return ids

    def _model_card(self) -> dict:
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "deltafin",
                "max_model_len": self.max_context}

    async def _call(self, fn, *args):
        """A blocking Client call on a worker thread; the Client goes back to the pool only after
        a clean answer."""
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
            raise api_error_from(e) from None

    # -- routes -------------------------------------------------------------------------------------
    async def models(self, request):
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request):
        if request.path_params["model"] not in (self.model_id, str(self.store_path)):
            return self.error(ApiError(404, f"the model '{request.path_params['model']}' does not exist",
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
            body = await self._body(request)
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]  # a batch of one
            if isinstance(prompt, str):
                if not prompt:
                    raise ApiError(400, "'prompt' is empty", param="prompt")
                ids = await self._encode(prompt, False)
            elif (isinstance(prompt, list) and prompt
                  and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
                ids = list(prompt)
            else:
                raise ApiError(400, "'prompt' must be a string, a list of token ids, or a list of one "
                                    "of either (batches are not supported)", param="prompt")
            for key in ("echo", "suffix", "logprobs"):
                if body.get(key) not in (None, False, 0):
                    raise ApiError(400, f"'{key}' is not supported", param=key)
            if _number(body, "best_of", 1, 1, integer=True) != 1:
                raise ApiError(400, "only best_of = 1 is supported", param="best_of")
            params = sampling(body, 16)  # OpenAI's default for completions
        except ApiError as e:
            return self.error(e)
        return await self._answer(ids, params, chat=False)

    async def chat_completions(self, request):
        try:
            body = await self._body(request)
            for key in ("tools", "functions"):
                if body.get(key):
                    raise ApiError(400, f"'{key}' is not supported", param=key)
            if body.get("logprobs"):
                raise ApiError(400, "'logprobs' is not supported", param="logprobs")
            fmt = body.get("response_format")
            if fmt not in (None, {"type": "text"}):
                raise ApiError(400, "only response_format {'type': 'text'} is supported",
                               param="response_format")
            ids = await self._encode(chat_messages(body), True)
            params = sampling(body, max(0, self.max_context - len(ids)))  # OpenAI: up to the context
        except ApiError as e:
            return self.error(e)
        return await self._answer(ids, params, chat=True)

    # -- generation ---------------------------------------------------------------------------------
    def _gen_args(self, p: dict) -> dict:
        return {k: p[k] for k in ("max_tokens", "temperature", "top_p", "seed", "stop")}

    async def _answer(self, ids: list[int], p: dict, chat: bool):
        rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        if p["stream"]:
            return await self._stream(rid, ids, p, chat)
        try:
            gen = await self._call(lambda c: c.generate(ids, **self._gen_args(p)))
        except ApiError as e:
            return self.error(e)
        choice = ({"index": 0, "message": {"role": "assistant", "content": gen.text},
                   "finish_reason": gen.finish_reason, "logprobs": None} if chat else
                  {"index": 0, "text": gen.text, "finish_reason": gen.finish_reason, "logprobs": None})
        return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                             "created": int(time.time()), "model": self.model_id, "choices": [choice],
                             "usage": self._usage(len(ids), gen)})

    @staticmethod
    def _usage(n_prompt: int, gen) -> dict:
        n_out = len(gen.token_ids)  # EOS, which ends a generation, is not among them
        return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}

    async def _stream(self, rid: str, ids: list[int], p: dict, chat: bool):
        """Server-sent events, one per token message of the runtime. The first piece (or the
        error) is awaited before the response starts, so a refused request still gets its HTTP
        status (400, 429, 503) rather than a 200 stream holding an error."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        pump = _StreamPump(self.pool, ids, self._gen_args(p), loop, events)
        pump.start()
        try:
            first = await events.get()
        except asyncio.CancelledError:
            pump.cancel()
            raise
        if first[0] == "error":
            return self.error(api_error_from(first[1]))
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(piece: str | None, finish: str | None, role: bool = False) -> str:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({"content": piece} if piece else {})
                choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": piece or "", "finish_reason": finish, "logprobs": None}
            data = {"id": rid, "object": obj, "created": created, "model": self.model_id, "choices": [choice]}
            if p["include_usage"]:
                data["usage"] = None
            return f"data: {json.dumps(data)}\n\n"

        async def body():
            event = first
            if chat:
                yield chunk(None, None, role=True)
            while True:
                kind, value = event
                if kind == "piece":
                    yield chunk(value, None)
                elif kind == "done":
                    yield chunk(None, value.finish_reason)
                    if p["include_usage"]:
                        yield "data: " + json.dumps({"id": rid, "object": obj, "created": created,
                                                     "model": self.model_id, "choices": [],
                                                     "usage": self._usage(len(ids), value)}) + "\n\n"
                    break
                else:  # the runtime failed mid-stream: the status is sent already
                    yield f"data: {json.dumps(api_error_from(value).body())}\n\n"
                    break
                event = await events.get()
            yield "data: [DONE]\n\n"

        return _EventStream(body(), on_close=lambda finished: self._closed(pump, finished))

    def _closed(self, pump: "_StreamPump", finished: bool) -> None:
        if not finished:
            self.http_counts["cancelled"] += 1
            pump.cancel()


class _StreamPump:
    """Runs Client.stream on a thread of its own (the Client's socket never leaves it) and hands
    ("piece", text), then ("done", Generation) or ("error", exception) to the event loop."""

    def __init__(self, pool: ClientPool, ids, args: dict, loop, events: asyncio.Queue):
        self.pool, self.ids, self.args, self.loop, self.events = pool, ids, args, loop, events
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
            pieces = c.stream(self.ids, **self.args)
            for piece in pieces:
                if self.stop.is_set():
                    break
                self._put(("piece", piece))
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

    PATHS = {"/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics"}

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


# -- the supervisor's side ---------------------------------------------------------------------------
def parse_listen(listen: str, allow_remote: bool) -> tuple[str, int]:
    """HOST:PORT ([::1]:PORT for IPv6); loopback only unless allow_remote."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"--listen {listen!r}: expected HOST:PORT, e.g. 127.0.0.1:8000")
    if host not in LOOPBACK_HOSTS and not allow_remote:
        raise ValueError(f"{host} is not a loopback address; pass --allow-remote to serve HTTP to "
                         f"other machines (anyone who reaches the port can use the model)")
    return host.strip("[]"), int(port)


class FrontendProcess:
    """deltafin-http as a child of the supervisor: started once the runtime serves, restarted
    when it dies (after a pause that grows while it keeps dying at once), stopped with the
    supervisor. One thread does all of it: the child's parent-death signal follows the thread
    that started it, so that thread lives as long as any child it started."""

    def __init__(self, endpoint: str, listen: str, allow_remote: bool = False, keys: str | None = None,
                 log=None, announce=None):
        self.endpoint, self.allow_remote, self.keys = endpoint, allow_remote, keys
        self.host, self.port = parse_listen(listen, allow_remote)
        self.log = log or (lambda m: print(f"deltafin-http: {m}", file=sys.stderr, flush=True))
        self.announce = announce or (lambda url: print(f"HTTP {url}", flush=True))
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None
        self.starts = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="http-frontend", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _spawn(self) -> subprocess.Popen:
        host = f"[{self.host}]" if ":" in self.host else self.host
        cmd = [sys.executable, "-m", "deltafin.workers.frontend", "--endpoint", self.endpoint,
               "--listen", f"{host}:{self.port}", "--parent-pid", str(os.getpid())]
        cmd += ["--allow-remote"] if self.allow_remote else []
        cmd += ["--keys", self.keys] if self.keys else []
        # Its own session: a terminal's Ctrl-C reaches the supervisor, which stops the frontend
        # itself, rather than both at once (which would look like a death to restart from).
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                start_new_session=True)

    def _await_listening(self, p: subprocess.Popen, timeout: float) -> str | None:
        deadline, buf = time.monotonic() + timeout, b""
        while b"\n" not in buf and time.monotonic() < deadline and not self._stop.is_set():
            ready, _, _ = select.select([p.stdout], [], [], 0.2)
            if ready:
                chunk = os.read(p.stdout.fileno(), 4096)
                if not chunk:
                    break
                buf += chunk
        p.stdout.close()  # the child prints one line, then writes only to stderr
        line = buf.split(b"\n", 1)[0].decode(errors="replace")
        return line.split(None, 1)[1] if line.startswith(LISTENING + " ") else None

    def _run(self) -> None:
        pause = RESTART_BACKOFF_S[0]
        while not self._stop.is_set():
            t0 = time.monotonic()
            with self._lock:
                if self._stop.is_set():
                    return
                p = self.proc = self._spawn()
                self.starts += 1
            url = self._await_listening(p, timeout=120)
            if url is None and self.url is None and not self._stop.is_set():
                # Never served (port taken, runtime unreachable): its own stderr said why, and
                # starting it again would fail the same way. The ZeroMQ endpoint serves on.
                p.wait()
                self.log(f"the HTTP frontend could not start on {self.host}:{self.port} (exit code "
                         f"{p.returncode}); the runtime serves without it")
                return
            if url:
                if self.url is None:
                    self.url = url
                    self.announce(url)
                else:
                    self.log(f"restarted (pid {p.pid}), serving {url} again")
                if self.port == 0:  # keep the port the first child got across restarts
                    self.port = int(url.rsplit(":", 1)[1].rstrip("/"))
            code = p.wait()
            if self._stop.is_set():
                return
            pause = RESTART_BACKOFF_S[0] if time.monotonic() - t0 > 30 else min(pause * 2, RESTART_BACKOFF_S[1])
            self.log(f"the HTTP frontend (pid {p.pid}) exited with code {code}; restarting it in {pause:.1f} s")
            self._stop.wait(pause)

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            p = self.proc
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=CHILD_STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
        self._thread.join(timeout=5)


# -- the process -----------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="deltafin-http", description=(
        "OpenAI-compatible HTTP API (/v1/models, /v1/completions, /v1/chat/completions, /health, "
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
    import uvicorn
    # A client that disconnects mid-stream makes asyncio log each write already queued for it.
    logging.getLogger("asyncio").setLevel(logging.ERROR)
    try:
        front = HttpFrontend(a.endpoint, timeout=a.timeout, keys=a.keys)
    except FrontendError as e:
        print(f"deltafin-http: error: {e}", file=sys.stderr)
        return 1
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

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets=sockets)
            if self.started:
                print(f"{LISTENING} {url}", flush=True)
                os.dup2(2, 1)  # nothing else goes to stdout: the supervisor stops reading it
                print(f"deltafin-http: serving {front.model_id} on {url}", file=sys.stderr, flush=True)

    config = uvicorn.Config(front.app, log_level="warning", access_log=False, lifespan="off",
                            timeout_graceful_shutdown=2, server_header=False)
    try:
        Server(config).run(sockets=[sock])
    finally:
        front.close()
        sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
