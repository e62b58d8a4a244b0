"""The request manager: every generate and logits request of every client, from the moment the
supervisor takes it to its final message, and all of its text.

- **The bound over all clients.** At most compute.max_inflight requests (max_batch running +
  max_queue waiting) are in flight at once; one more is answered `queue_full` at once. Compute's
  own queue keeps only its batch admission.
- **Fair share.** A client (one connection) alone may use the whole bound; while another client
  has requests in flight, one client holds at most half of it (`fair_share`), and its requests
  beyond are answered `queue_full`. A client under its half is admitted even when the bound is
  reached, if a client over its half filled it: then up to max_inflight + fair_share requests are
  in flight (the excess waits in compute's queue, in arrival order).
- **Text.** A prompt text or chat messages are tokenized here (chat template included) on a
  thread of their own, so a long prompt never stalls the tokens of others, while requests still
  reach compute in arrival order; compute gets token ids, and each of compute's tokens becomes the
  client's text piece here (runtime/textside.py). A stop string ends the request for the client
  at once and cancels it in compute, whose later messages for it are dropped.
- **Cancel.** Asked by the client, sent for a client whose connection closed mid-stream, or made
  by a stop string; counted by cause.

ZeroMQ clients and the HTTP frontend (a client of the same endpoint that sends text and chat
messages, never token ids of its own making) are served alike.
"""
from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

from deltafin.protocol import messages as M
from deltafin.runtime.procs import WakePipe
from deltafin.runtime.textside import TextSide, as_token_ids, opening, prompt_ids
from deltafin.runtime.tokenizer import PromptTooLong, Tokenizer, TokenizerError
from deltafin.workers.toolcalls import ToolChoiceError, tool_grammar


def tokenize_error(rid: int, e: Exception) -> M.Error:
    """The answer to a prompt that cannot be tokenized: too long, no chat template, a template
    that refused the messages, tool_choice "required" with a template of no known tool-call
    format (`bad_request`); anything else is a bug (`internal`)."""
    from jinja2.exceptions import TemplateError
    if isinstance(e, (PromptTooLong, TokenizerError, TemplateError, ToolChoiceError)):
        return M.Error(id=rid, code=M.ErrorCode.BAD_REQUEST, message=str(e))
    return M.Error(id=rid, code=M.ErrorCode.INTERNAL, message=f"{type(e).__name__}: {e}")


class RequestManager:
    """Requests are keyed (client identity, request id). reply(ident, msg) -> bool sends to a
    client (False: it is gone); forward(ident, raw) sends a client's message to compute;
    finished(key, stopped) is told when compute ends a request (stopped: one a stop string had
    already ended for the client)."""

    def __init__(self, tokenizer: Tokenizer, compute, limits: M.RequestLimits, reply, forward,
                 finished, log, default_max_tokens: int = 0):
        self.tokenizer = tokenizer
        self.compute = compute  # the typed config's compute section
        self.default_max_tokens = default_max_tokens  # http.default_max_tokens: for max_tokens nil
        self.limits = limits
        self.reply, self.forward, self.finished, self.log = reply, forward, finished, log
        self.inflight: dict[tuple, float] = {}   # key -> start time
        self.cancelling: set[tuple] = set()       # in flight, cancel sent to compute (or due once forwarded)
        # Requests taken, in arrival order, not yet forwarded to compute: (key, request, its
        # frame, the tokenization of its prompt or None). The head goes once it is ready.
        self.admitting: deque[tuple] = deque()
        self.sides: dict[tuple, TextSide] = {}    # generate requests forwarded: their text
        # Ended for the client by a stop string, still in compute until its final message:
        # they hold their place in the in-flight bound, and their ids stay taken.
        self.stopping: dict[tuple, float] = {}
        # cancels sent: asked by the client, its peer vanished, or a stop string ended the request
        self.cancels = {"client": 0, "client_gone": 0, "stop": 0}
        # Prompts are tokenized on one thread (tokenizers releases the GIL); each end wakes the
        # serving loop through a pipe (`tokenized_fd`, polled with the sockets).
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        self.tokenized = WakePipe()
        self.tokenized_fd = self.tokenized.fd

    # -- from clients -------------------------------------------------------------------------------
    def submit(self, ident: bytes, raw: bytes, msg) -> None:
        """A generate or logits request: refused at once (bad, duplicate id, bound reached),
        else taken and forwarded in arrival order."""
        try:
            M.check_request(msg, self.limits)
        except M.BadRequest as e:
            return self._refuse(ident, msg.id, M.ErrorCode.BAD_REQUEST, str(e))
        key = (ident, msg.id)
        if key in self.inflight or key in self.stopping:
            return self._refuse(ident, msg.id, M.ErrorCode.BAD_REQUEST, f"request id {msg.id} is already in flight")
        cc = self.compute
        full = self._full(ident)
        if full:
            return self._refuse(ident, msg.id, M.ErrorCode.QUEUE_FULL, full)
        self.inflight[key] = time.monotonic()
        tokenized = None
        if isinstance(msg, M.Generate) and msg.token_ids is None:
            tokenized = self.pool.submit(prompt_ids, self.tokenizer, msg, cc.max_context)
            tokenized.add_done_callback(self._wake_tokenized)
        self.admitting.append((key, msg, raw, tokenized))
        self.admit()

    @property
    def fair_share(self) -> int:
        """Requests one client may hold while others have requests in flight: half the bound."""
        return max(1, self.compute.max_inflight // 2)

    def _full(self, ident: bytes) -> str | None:
        """Why one more request of this client is refused `queue_full` (the bound, or its fair
        share), else None."""
        cc, share = self.compute, self.fair_share
        held: dict[bytes, int] = {}
        for who, _ in (*self.inflight, *self.stopping):
            held[who] = held.get(who, 0) + 1
        n, mine = sum(held.values()), held.get(ident, 0)
        if mine >= share and n > mine:
            return (f"this client has {mine} of the {n} requests in flight: while other clients have "
                    f"requests in flight one holds at most {share} (half of compute.max_batch + "
                    f"compute.max_queue); retry later")
        hogged = any(k > share for k in held.values())
        if n >= cc.max_inflight and not (mine < share and hogged and n < cc.max_inflight + share):
            running = "one" if cc.max_batch == 1 else f"compute.max_batch={cc.max_batch}"
            return (f"{n} requests are in flight: {running} running and "
                    f"compute.max_queue={cc.max_queue} waiting; retry later")
        return None

    def cancel(self, ident: bytes, rid: int) -> None:
        """The client's `cancel`."""
        if (ident, rid) not in self.inflight:
            return self._refuse(ident, rid, M.ErrorCode.UNKNOWN_REQUEST, f"no request {rid} of this client is in flight")
        self._cancel(ident, rid, "client")

    def _refuse(self, ident: bytes, rid, code: str, message: str) -> None:
        self.reply(ident, M.Error(id=rid, code=code, message=message))

    def _cancel(self, ident: bytes, rid: int, why: str) -> None:
        """Asks compute to stop request (ident, rid), once: it answers with the request's final
        message (done "cancelled", or error "cancelled" for logits), which ends it here. A
        request still being tokenized gets its cancel right after it is forwarded (`admit`)."""
        if (ident, rid) in self.cancelling:
            return
        self.cancelling.add((ident, rid))
        self.cancels[why] += 1
        if why == "client_gone":
            self.log(f"a client vanished with request {rid} in flight: cancelled")
        if not any(key == (ident, rid) for key, *_ in self.admitting):
            self.forward(ident, M.encode(M.Cancel(id=rid)))

    def _wake_tokenized(self, _future: Future) -> None:
        """On the tokenize thread: a prompt is ready (or refused); the serving loop forwards it."""
        self.tokenized.wake()

    def on_tokenized(self) -> None:
        """The serving loop saw `tokenized_fd` readable."""
        self.tokenized.drain()
        self.admit()

    def admit(self) -> None:
        """Forwards the requests taken to compute in arrival order, each once its prompt is
        tokenized; a prompt that cannot be tokenized is answered here."""
        while self.admitting:
            key, msg, raw, tokenized = self.admitting[0]
            if tokenized is not None and not tokenized.done():
                return  # the next ones wait behind it: compute serves in arrival order
            self.admitting.popleft()
            ident = key[0]
            if isinstance(msg, M.Generate):
                try:
                    ids = tokenized.result() if tokenized is not None else list(msg.token_ids)
                    opened = opening(self.tokenizer, msg, ids)
                    grammar = self._tool_grammar(msg, opened)
                except Exception as e:
                    self.inflight.pop(key, None)
                    self.cancelling.discard(key)
                    self.reply(ident, tokenize_error(msg.id, e))
                    continue
                self.sides[key] = TextSide(self.tokenizer, msg, len(ids), opened)
                if tokenized is not None or msg.max_tokens is None or grammar is not None:
                    raw = M.encode(as_token_ids(msg, ids, self.compute.max_context, self.default_max_tokens,
                                                grammar))
            self.forward(ident, raw)
            if key in self.cancelling:  # cancelled while it waited here
                self.forward(ident, M.encode(M.Cancel(id=msg.id)))

    def _tool_grammar(self, msg: M.Generate, opened: str) -> str | None:
        """The Lark grammar compute enforces for tool_choice "required" (workers/toolcalls), or
        None; ToolChoiceError where the model's format is not known."""
        if msg.tool_choice is None:
            return None
        return tool_grammar(self.tokenizer.chat_template, self.tokenizer.added, msg.tools,
                            msg.parallel_tool_calls, opened)

    # -- from compute -------------------------------------------------------------------------------
    def on_reply(self, ident: bytes, reply) -> None:
        """Compute's message for a client's request: relayed with its text, or dropped (after
        the stop string that ended the request for the client)."""
        key = (ident, getattr(reply, "id", None))
        final = isinstance(reply, (M.Done, M.LogitsResult, M.Error))
        if final:
            self.cancelling.discard(key)
        if key in self.stopping:  # answered already at its stop string: the rest is dropped
            if final:
                del self.stopping[key]
                self.finished(key, True)
            return
        side = self.sides.get(key)
        if side is not None and isinstance(reply, M.Token):
            reply = side.accept(reply)
            if side.stopped:
                return self._end_at_stop(key, side, reply)
            if reply is None:
                return
        elif side is not None and final:
            del self.sides[key]
            if isinstance(reply, M.Done):
                rest = side.flush()
                if rest is not None:
                    self.reply(ident, rest)
                reply = side.done(reply)
        if final and self.inflight.pop(key, None) is not None:
            self.finished(key, False)
        if not self.reply(ident, reply) and key in self.inflight:
            # The client vanished mid-stream (or stopped reading): its request goes, and the
            # next one in the queue starts within a token.
            self._cancel(*key, "client_gone")

    def _end_at_stop(self, key: tuple, side: TextSide, last: M.Token | None) -> None:
        """A stop string completed: the client gets the text up to it and its `done` now, and
        compute a cancel; the request keeps its place until compute's final message for it."""
        ident, rid = key
        del self.sides[key]
        self.inflight.pop(key, None)
        self.stopping[key] = time.monotonic()
        if last is not None:
            self.reply(ident, last)
        self.reply(ident, side.done())
        self._cancel(ident, rid, "stop")

    # -- the runtime's own events -------------------------------------------------------------------
    def fail_all(self, code: str, message: str) -> None:
        """Workers died: every request in flight gets `error` code; a tokenization still
        running ends unseen."""
        for ident, rid in list(self.inflight):
            self.reply(ident, M.Error(id=rid, code=code, message=message))
        self.inflight.clear()
        self.cancelling.clear()
        self.admitting.clear()
        self.sides.clear()
        self.stopping.clear()

    def close(self) -> None:
        """A tokenization still running finishes on its own (bounded by max_prompt_bytes)."""
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.tokenized.close()
