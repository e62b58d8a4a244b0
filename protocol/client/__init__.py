"""deltafin.client: script a running deltafin runtime over ZeroMQ.

    from deltafin.client import Client
    with Client("ipc:///tmp/deltafin-0/ab12cd34/client.ipc", timeout=60) as c:
        print(c.generate("Why is the sky blue?", max_tokens=64).text)
        for piece in c.stream("Tell me a story", max_tokens=32):
            print(piece, end="", flush=True)
        story = c.stream("Tell me a long story", max_tokens=2000)
        print(next(story)); story.cancel(); list(story)   # story.result.finish_reason == "cancelled"

Requests run one at a time in arrival order over all clients; a full queue raises RuntimeBusy
(code `queue_full`). A Client (one socket) is used from one thread.

Every wait has a deadline (`timeout`, seconds, measured since the last message received), and a
runtime that stops answering raises RuntimeUnavailable instead of hanging. A worker that dies
mid-request raises RuntimeDeadError at once; while the runtime restarts its workers, requests
raise RuntimeRestarting (`wait_until_serving` waits for the end of a restart).

A runtime served to other machines (`--allow-remote`) needs CURVE keys (docs/SECURITY.md):
`Client("tcp://host:5555", keys="~/.config/deltafin/keys")`, a directory holding the server's
`server.key` and this client's `NAME.key_secret`.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import numpy as np
import zmq

from deltafin.protocol import messages as M


class DeltafinError(RuntimeError):
    """An error reported by the runtime; `code` is the machine-readable kind."""

    code = "error"

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        self.code = code or self.code


class RequestError(DeltafinError):
    """The request was rejected (bad prompt, bad parameters, too long)."""


class RuntimeDeadError(DeltafinError):
    """A worker of the runtime died while the request was in flight."""


class ExpertUnavailableError(DeltafinError):
    """An expert could not be read (corrupt store, budget too small for a layer, loader failure)."""


class ProtocolMismatch(DeltafinError):
    """Client and runtime speak different protocol versions, or a message was malformed."""


class RuntimeUnavailable(DeltafinError):
    """No answer within the timeout."""


class RuntimeRestarting(DeltafinError):
    """The runtime is replacing its workers after one died; retry in a few seconds."""


class RuntimeStopping(DeltafinError):
    """The runtime stopped (SIGINT or SIGTERM) before the request finished; nothing more comes."""


class RuntimeBusy(DeltafinError):
    """The queue is full (`queue_full`: one request running and compute.max_queue waiting);
    retry later."""


class RequestCancelled(DeltafinError):
    """A `logits` request was cancelled (a cancelled generation returns finish_reason
    "cancelled" instead)."""


# Each code the runtime sends -> the exception the client raises for it.
ERRORS: dict[M.ErrorCode, type[DeltafinError]] = {
    M.ErrorCode.BAD_MESSAGE: ProtocolMismatch,
    M.ErrorCode.VERSION_MISMATCH: ProtocolMismatch,
    M.ErrorCode.BAD_REQUEST: RequestError,
    M.ErrorCode.UNKNOWN_REQUEST: RequestError,
    M.ErrorCode.NOT_LEADER: RequestError,
    M.ErrorCode.QUEUE_FULL: RuntimeBusy,
    M.ErrorCode.CANCELLED: RequestCancelled,
    M.ErrorCode.EXPERT_READ_FAILED: ExpertUnavailableError,
    M.ErrorCode.EXPERT_UNAVAILABLE: ExpertUnavailableError,
    M.ErrorCode.BUDGET_TOO_SMALL: ExpertUnavailableError,
    M.ErrorCode.BAD_CONFIG: DeltafinError,
    M.ErrorCode.WORKER_DIED: RuntimeDeadError,
    M.ErrorCode.RANK_LOST: RuntimeDeadError,
    M.ErrorCode.RESTARTING: RuntimeRestarting,
    M.ErrorCode.SHUTTING_DOWN: RuntimeStopping,
    M.ErrorCode.INTERNAL: DeltafinError,
}


def _raise(err: M.Error):
    """The exception of an `error` reply; a code this client does not know raises DeltafinError."""
    raise ERRORS.get(err.code, DeltafinError)(err.message, err.code)


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: dict = field(default_factory=dict)
    logprobs: list | None = None  # each token's {token_id, token, logprob, top, bytes, top_bytes, offset}, when asked


class Stream:
    """A streamed generation in flight: iterate it for the text pieces as they come; `id` is the
    request's id, `result` the final Generation once the iteration ended (also `client.last`),
    `logprobs` the log-probability entries of the tokens of the latest piece (when asked).
    `cancel()` stops it (queued: at once; running: within a token); the iteration then ends
    with `result.finish_reason == "cancelled"`."""

    def __init__(self, client: "Client", msg: M.Generate):
        self.client, self.id = client, msg.id
        self.result: Generation | None = None
        self.logprobs: list | None = None
        client._send(msg)

    def __iter__(self):
        return self

    def __next__(self) -> str:
        while self.result is None:
            reply = self.client._recv(self.id)
            if isinstance(reply, M.Token):
                self.logprobs = reply.logprobs
                return reply.text
            if isinstance(reply, M.Done):
                self.result = self.client.last = Generation(reply.text, list(reply.token_ids),
                                                            reply.finish_reason, reply.stats,
                                                            reply.logprobs)
        raise StopIteration

    def cancel(self) -> None:
        if self.result is None:
            self.client.cancel(self.id)


class Client:
    def __init__(self, endpoint: str, timeout: float = 120.0, handshake: bool = True,
                 keys: str | None = None):
        """keys: CURVE credentials for a runtime started with --allow-remote (a directory with
        `server.key` and one client `*.key_secret`, or the path of that secret file)."""
        self.endpoint, self.timeout = endpoint, timeout
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, M.MAX_MESSAGE_BYTES)
        if keys is not None:
            from deltafin.runtime.security import client_credentials
            try:
                server_public, public, secret = client_credentials(keys)
            except Exception:
                self.close()
                raise
            self.sock.curve_serverkey = server_public
            self.sock.curve_publickey = public
            self.sock.curve_secretkey = secret
        self.sock.connect(endpoint)
        self._ids = itertools.count(1)
        self.info: M.Welcome | None = None
        if handshake:
            try:
                self.info = self._call(M.Hello(id=self._next(), version=M.PROTOCOL_VERSION, client="python"))
            except BaseException:
                self.close()
                raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        if not self.sock.closed:
            self.sock.close(0)
            self.ctx.term()

    # -- plumbing -----------------------------------------------------------------------------------
    def _next(self) -> int:
        return next(self._ids)

    def _recv(self, rid: int):
        while True:
            if not self.sock.poll(int(self.timeout * 1000)):
                raise RuntimeUnavailable(f"no answer from {self.endpoint} within {self.timeout:.0f} s")
            try:
                msg = M.decode(self.sock.recv())
            except M.ProtocolError as e:
                raise ProtocolMismatch(f"malformed message from the runtime: {e}") from None
            if isinstance(msg, M.Error) and msg.id in (rid, None):
                _raise(msg)
            if getattr(msg, "id", None) == rid:
                return msg

    def _send(self, msg) -> None:
        try:
            raw = M.encode(msg)
        except M.ProtocolError as e:  # a value msgpack cannot carry (an integer beyond 64 bits)
            raise RequestError(str(e), "bad_request") from None
        limit = self.info.max_request_bytes if self.info else 0
        if limit and len(raw) > limit:  # the runtime would drop the connection, not answer
            raise RequestError(f"a {len(raw)} byte request exceeds the runtime's {limit} byte "
                               f"limit (runtime.max_request_bytes)", "bad_request")
        self.sock.send(raw)

    def _call(self, msg):
        self._send(msg)
        return self._recv(msg.id)

    def _generate_msg(self, prompt_or_ids, max_tokens, temperature, top_p, seed, stop, chat, stream,
                      tools=None, logprobs=None, sampling: dict | None = None):
        sampling = sampling or {}
        unknown = set(sampling) - set(M.SAMPLING_OPTIONS)
        if unknown:
            raise TypeError(f"unknown sampling option(s) {', '.join(sorted(unknown))}; "
                            f"known: {', '.join(M.SAMPLING_OPTIONS)}")
        prompt, ids, messages = None, None, None
        if isinstance(prompt_or_ids, str):
            prompt = prompt_or_ids
        elif prompt_or_ids and all(isinstance(m, dict) for m in prompt_or_ids):
            messages = [dict(m) for m in prompt_or_ids]
        else:
            ids = [int(i) for i in prompt_or_ids]
        text = prompt if messages is None else "".join(str(m.get("content", "")) for m in messages)
        # A prompt the runtime would refuse by its size is refused here, before it is encoded
        # and sent (100 MB take about a second each way): first a frame surely over the
        # endpoint's limit (which would drop the connection), then a text over max_prompt_bytes.
        limit = self.info.max_request_bytes if self.info else 0
        if text and limit and len(text) >= limit:  # the frame holds more than the prompt
            raise RequestError(f"a request of more than {len(text)} bytes exceeds the runtime's "
                               f"{limit} byte limit (runtime.max_request_bytes)", "bad_request")
        why = M.prompt_too_long(text, self.info.max_prompt_bytes) if text and self.info else None
        if why:
            raise RequestError(why, "bad_request")
        return M.Generate(id=self._next(), prompt=prompt, token_ids=ids, messages=messages,
                          max_tokens=max_tokens, temperature=float(temperature), top_p=float(top_p),
                          seed=seed, stop=list(stop) if stop else None, chat=chat, stream=stream,
                          tools=list(tools) if tools else None, logprobs=logprobs, **sampling)

    # -- API ----------------------------------------------------------------------------------------
    def generate(self, prompt_or_token_ids, max_tokens: int | None = 128, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int | None = None, stop=None, chat: bool = False,
                 tools=None, logprobs: int | None = None, **sampling) -> Generation:
        """prompt_or_token_ids: a prompt text, token ids, or chat messages ({role, content} maps,
        rendered with the model's chat template, with `tools` where given). max_tokens None: the
        rest of the context. logprobs k: each token's log-probability and the k most likely
        tokens' (Generation.logprobs). sampling: any of M.SAMPLING_OPTIONS (top_k, min_p,
        repetition_penalty, presence_penalty, frequency_penalty, and json_schema: a JSON Schema
        as text the answer must match; docs/PROTOCOL.md)."""
        msg = self._generate_msg(prompt_or_token_ids, max_tokens, temperature, top_p, seed, stop, chat,
                                 False, tools, logprobs, sampling)
        done = self._call(msg)
        return Generation(done.text, list(done.token_ids), done.finish_reason, done.stats, done.logprobs)

    def stream(self, prompt_or_token_ids, max_tokens: int | None = 128, temperature: float = 0.0,
               top_p: float = 1.0, seed: int | None = None, stop=None, chat: bool = False,
               tools=None, logprobs: int | None = None, **sampling) -> Stream:
        """Sends the request now and returns a Stream: iterating it yields text pieces as they
        are produced; `self.last` (and the stream's `result`) holds the final Generation;
        `cancel()` stops it. tools, logprobs, sampling: as for `generate`."""
        msg = self._generate_msg(prompt_or_token_ids, max_tokens, temperature, top_p, seed, stop, chat,
                                 True, tools, logprobs, sampling)
        self.last = None
        return Stream(self, msg)

    def cancel(self, request_id: int) -> None:
        """Asks the runtime to stop request `request_id` of this client, without waiting: its
        own final message (done with finish_reason "cancelled", or an error `cancelled` for
        logits) ends it. A request no longer in flight gets error `unknown_request`, which the
        request's own reader never sees (it has its final message already)."""
        self._send(M.Cancel(id=int(request_id)))

    def logits(self, token_ids) -> np.ndarray:
        """Teacher-forced next-token logits, float32 [tokens, vocab]."""
        r = self._call(M.Logits(id=self._next(), token_ids=[int(i) for i in token_ids]))
        return np.frombuffer(r.data, dtype=np.dtype(r.dtype)).reshape(r.shape).copy()

    def stats(self) -> dict:
        """The latest merged metrics snapshot (docs/PROTOCOL.md): answered at once, also in the
        middle of a long prompt, and counting every request whose reply came before."""
        return self._call(M.Stats(id=self._next())).stats

    def health(self) -> dict:
        r = self._call(M.Health(id=self._next()))
        return {"ok": r.ok, "workers": r.workers, "state": r.state, "restarts": r.restarts}

    def wait_until_serving(self, timeout: float = 60.0) -> dict:
        """While the runtime starts, or after a worker death: returns health once the workers
        serve (again)."""
        deadline = time.monotonic() + timeout
        while True:
            h = self.health()
            if h["ok"]:
                return h
            if time.monotonic() > deadline:
                raise RuntimeUnavailable(f"the runtime did not serve again within {timeout:.0f} s "
                                         f"(state {h['state']})")
            time.sleep(0.1)


def wait_until_ready(endpoint: str, timeout: float = 60.0) -> Client:
    """Connects once the runtime serves: it answers hello, and health says ok (the endpoint
    answers hello and health while the runtime starts; for scripts that start the supervisor
    themselves)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            c = Client(endpoint, timeout=min(5.0, max(0.1, deadline - time.monotonic())))
            break
        except RuntimeUnavailable:
            if time.monotonic() > deadline:
                raise
    try:
        c.wait_until_serving(max(0.0, deadline - time.monotonic()))
    except BaseException:
        c.close()
        raise
    return c


__all__ = ["Client", "Generation", "Stream", "DeltafinError", "RequestError", "RuntimeDeadError",
           "ExpertUnavailableError", "ProtocolMismatch", "RuntimeUnavailable", "RuntimeRestarting",
           "RuntimeStopping", "RuntimeBusy", "RequestCancelled", "wait_until_ready"]
