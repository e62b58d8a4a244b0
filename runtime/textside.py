"""The text side of a generation, kept out of the MLX process.

Compute runs token ids only: it takes a generate request's `token_ids` and answers with `token`
messages that carry ids (their text empty) and a `done` whose text is empty. The text around
that lives here, one `TextSide` per generate request: the prompt text or chat messages tokenized
(chat template included) before compute sees the request, and compute's ids turned back into the
client's text pieces (streaming detokenizer), cut at the first stop string. A chat's (a request
of `messages`) text keeps the special tokens that structure its answer (runtime/markers.py) and
starts with `<think>` where the chat template's generation prompt opened the thinking, so the
HTTP frontend can split it into reasoning, content and tool calls. The request manager
(workers/requests.py) keeps one per request in flight; `generate` wraps an in-process `Compute`
the same way, so tools and tests see the same text as clients of the runtime.
"""
from __future__ import annotations

import dataclasses

from deltafin.protocol import messages as M
from deltafin.runtime.markers import THINK
from deltafin.runtime.tokenizer import TOO_LONG, PromptTooLong, StreamDecoder, Tokenizer


def prompt_ids(tokenizer: Tokenizer, req: M.Generate, max_context: int) -> list[int]:
    """The ids compute runs for req: its token_ids, its prompt tokenized (chat template where
    asked), or its chat messages rendered with the chat template and tokenized. Raises
    PromptTooLong (more than max_context tokens, or, with max_tokens nil, no room left for one
    generated token), TokenizerError (no chat template) or jinja2's TemplateError (the template
    refused the messages)."""
    if req.token_ids is not None:
        ids = list(req.token_ids)
    elif req.messages is not None:
        ids = tokenizer.encode(req.messages, chat=True, max_tokens=max_context, tools=req.tools)
    else:
        ids = tokenizer.encode(req.prompt, chat=req.chat, max_tokens=max_context)
    if req.max_tokens is None and len(ids) >= max_context:
        raise PromptTooLong(f"{TOO_LONG}{len(ids)} tokens leaves no room in the context of "
                            f"{max_context} tokens (max_context)")
    return ids


def as_token_ids(req: M.Generate, ids: list[int], max_context: int, default_max_tokens: int = 0,
                 grammar: str | None = None) -> M.Generate:
    """The request as compute takes it: ids in place of the prompt text or messages, and
    max_tokens nil made the rest of the context, or default_max_tokens (http.default_max_tokens)
    where that is smaller and not 0; grammar: the one written for its tool_choice (which it
    replaces)."""
    rest = max_context - len(ids)
    if req.max_tokens is not None:
        max_tokens = req.max_tokens
    else:
        max_tokens = min(rest, default_max_tokens) if default_max_tokens > 0 else rest
    if grammar is not None:
        req = dataclasses.replace(req, grammar=grammar, tool_choice=None)
    return dataclasses.replace(req, prompt=None, messages=None, tools=None, token_ids=list(ids),
                               chat=False, max_tokens=max_tokens)


OPENING_TOKENS = 16  # the prompt's last tokens looked at for a thinking tag the template opened


def opening(tokenizer: Tokenizer, req: M.Generate, ids: list[int]) -> str:
    """The marker a chat's answer starts inside of: `<think>` where the rendered prompt ends
    with it (Qwen3 thinking, DeepSeek-R1 and MiniMax-M2 templates open the thinking in the
    generation prompt, so the answer holds only its `</think>`); "" otherwise."""
    if req.messages is None:
        return ""
    tail = tokenizer.decode(ids[-OPENING_TOKENS:], markers=True)
    return THINK if tail.rstrip().endswith(THINK) else ""


class TextSide:
    """One generate request's text: ids in, client text out. `accept` takes each of compute's
    tokens in order; `stopped` turns true at the token whose text completes a stop string, after
    which the request is over for the client (`done`) and compute is to be stopped.

    Streamed text equals the final text: while the text ends with the start of a stop string,
    the token's message waits (its text goes with a later token's message, or with `flush` at
    the end). Stop strings are looked for only where they can end: in the new text and the
    (longest stop - 1) characters before it, so the work per token does not grow with the
    answer. opened: the marker the answer starts inside of (`opening`): the text starts with it,
    where stop strings are not looked for."""

    def __init__(self, tokenizer: Tokenizer, req: M.Generate, prompt_tokens: int, opened: str = ""):
        self.req = req
        self.prompt_tokens = prompt_tokens
        self.decoder = StreamDecoder(tokenizer, markers=req.messages is not None)
        self.stops = [s for s in (req.stop or []) if s]
        self.longest = max((len(s) for s in self.stops), default=0)
        self.text = opened
        self.floor = len(opened)  # where the answer's own text begins
        self.sent = 0  # characters of text the client was sent in token messages
        self.last: M.Token | None = None  # compute's latest token
        self.stopped = False
        self.stop_string: str | None = None  # the stop string that ended the answer
        self.tokenizer = tokenizer
        self.logprobs: list = []  # each token's entry (requests that ask), its text added
        self.unsent = 0           # entries not yet sent in a token message

    @property
    def token_ids(self) -> list[int]:
        return self.decoder.ids

    def accept(self, token: M.Token) -> M.Token | None:
        """compute's token as the client's (its text piece filled in), or None where there is
        nothing to send now: a piece still empty (half a character), text that may begin a stop
        string, a request not streamed, or a token after the stop."""
        if self.stopped:
            return None
        self.last = token
        for e in token.logprobs or []:
            self.logprobs.append(self._named(e))
        before = len(self.text)
        self.text += self.decoder.add(token.token_id)
        cut = self._stop_at(max(self.floor, before - self.longest + 1))
        if cut is not None:
            self.text, self.stopped = self.text[:cut], True
        elif self._may_stop():
            return None
        return self._piece(token)

    def flush(self) -> M.Token | None:
        """At the end of an answer no stop string ended: the text (and log-probabilities) still
        held back, as a message of the last token (None when there is none to send)."""
        if self.last is None or self.stopped:
            return None
        return self._piece(self.last, final=True)

    def _named(self, entry: dict) -> dict:
        """A log-probability entry with each token's text: `token`, and a third item of `top`'s;
        its own bytes (`bytes`, and `top_bytes` in `top`'s order: a token holding part of a
        character has text U+FFFD but bytes of its own); and `offset`, where its text begins in
        the answer's text (`done`'s: the characters before it, whatever tokens added none)."""
        text, raw = self.tokenizer.token_text, self.tokenizer.token_bytes
        return {**entry, "token": text(entry["token_id"]), "bytes": list(raw(entry["token_id"])),
                "top": [[i, lp, text(i)] for i, lp in entry["top"]],
                "top_bytes": [list(raw(i)) for i, _ in entry["top"]], "offset": len(self.text)}

    def _piece(self, token: M.Token, final: bool = False) -> M.Token | None:
        """The text not yet sent, as token's message; at the end (final) also no text, where
        log-probability entries are still unsent (tokens whose text decoding held back)."""
        piece, self.sent = self.text[self.sent:], len(self.text)
        unsent = final and self.req.logprobs is not None and self.unsent < len(self.logprobs)
        if not ((piece or unsent) and self.req.stream):
            return None
        lps, self.unsent = self.logprobs[self.unsent:], len(self.logprobs)
        return M.Token(id=self.req.id, index=token.index, token_id=token.token_id, text=piece,
                       logprobs=lps if self.req.logprobs is not None else None)

    def _stop_at(self, start: int) -> int | None:
        """Where the earliest stop string occurring from `start` on begins (whichever of the
        request's stops it is, kept as `stop_string`); the text before `start` was scanned at
        earlier tokens."""
        found = [(at, s) for s in self.stops if (at := self.text.find(s, start)) >= 0]
        if not found:
            return None
        at, self.stop_string = min(found, key=lambda f: f[0])
        return at

    def _may_stop(self) -> bool:
        """True when the unsent text ends with the start of a stop string."""
        for at in range(max(self.sent, self.floor, len(self.text) - self.longest + 1), len(self.text)):
            tail = self.text[at:]
            if any(s.startswith(tail) for s in self.stops):
                return True
        return False

    def done(self, done: M.Done | None = None) -> M.Done:
        """The client's final message: compute's `done` (its ids and stats) with the text; after
        a stop, finish_reason "stop" with the ids up to the one that completed the stop string
        (without compute's `done`: the stats say prompt and generated tokens only), and the
        stop string in stats["stop_string"]."""
        lps = self.logprobs if self.req.logprobs is not None else None
        if not self.stopped:
            return dataclasses.replace(done, text=self.text, logprobs=lps)
        ids = list(self.token_ids)
        stats = dict(done.stats) if done is not None else {"prompt_tokens": self.prompt_tokens}
        stats["generated_tokens"] = len(ids)
        stats["stop_string"] = self.stop_string
        return M.Done(id=self.req.id, text=self.text, token_ids=ids, finish_reason="stop", stats=stats,
                      logprobs=lps)


def generate(compute, tokenizer: Tokenizer, req: M.Generate, emit=None) -> M.Done:
    """One request on an in-process `Compute` (workers/engine.py), text handled as the
    request manager handles it: emit gets the client's token messages (streamed requests), a
    stop string ends the sequence after the token that completed it."""
    ids = prompt_ids(tokenizer, req, compute.max_context)
    side = TextSide(tokenizer, req, len(ids), opening(tokenizer, req, ids))

    def relay(token: M.Token | None) -> None:
        out = side.accept(token) if token is not None else side.flush()
        if out is not None and emit is not None:
            emit(out)
    done = compute.generate(as_token_ids(req, ids, compute.max_context), emit=relay,
                            between_tokens=lambda: side.stopped)
    relay(None)
    return side.done(done)
