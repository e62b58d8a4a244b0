"""The text side of a generation, kept out of the MLX process.

Compute runs token ids only: it takes a generate request's `token_ids` and answers with `token`
messages that carry ids (their text empty) and a `done` whose text is empty. The text around
that lives here, one `TextSide` per generate request: the prompt text tokenized (chat template
included) before compute sees the request, and compute's ids turned back into the client's text
pieces (streaming detokenizer), cut at the first stop string exactly where compute used to cut.
The supervisor keeps one per request in flight; `generate` wraps an in-process `Compute` the
same way, so tools and tests see the same text as clients of the runtime.
"""
from __future__ import annotations

import dataclasses

from deltafin.protocol import messages as M
from deltafin.runtime.tokenizer import StreamDecoder, Tokenizer


def prompt_ids(tokenizer: Tokenizer, req: M.Generate, max_context: int) -> list[int]:
    """The ids compute runs for req: its token_ids, or its prompt tokenized (chat template where
    asked). Raises PromptTooLong (more than max_context tokens), TokenizerError (no chat
    template) or jinja2's TemplateError (the template refused the messages)."""
    if req.token_ids is not None:
        return list(req.token_ids)
    return tokenizer.encode(req.prompt, chat=req.chat, max_tokens=max_context)


def as_token_ids(req: M.Generate, ids: list[int]) -> M.Generate:
    """The request as compute takes it: ids in place of the prompt text."""
    return dataclasses.replace(req, prompt=None, token_ids=list(ids), chat=False)


class TextSide:
    """One generate request's text: ids in, client text out. `accept` takes each of compute's
    tokens in order; `stopped` turns true at the token whose text completes a stop string, after
    which the request is over for the client (`done`) and compute is to be stopped."""

    def __init__(self, tokenizer: Tokenizer, req: M.Generate, prompt_tokens: int):
        self.req = req
        self.prompt_tokens = prompt_tokens
        self.decoder = StreamDecoder(tokenizer)
        self.stops = [s for s in (req.stop or []) if s]
        self.text = ""
        self.stopped = False

    @property
    def token_ids(self) -> list[int]:
        return self.decoder.ids

    def accept(self, token: M.Token) -> M.Token | None:
        """compute's token as the client's (its text piece filled in), or None where there is
        nothing to send: a piece still empty (half a character), a request not streamed, or
        a token after the stop."""
        if self.stopped:
            return None
        piece = self.decoder.add(token.token_id)
        self.text += piece
        hit = next((s for s in self.stops if s in self.text), None)
        if hit:
            cut = self.text.index(hit)
            piece = piece[:max(0, len(piece) - (len(self.text) - cut))]
            self.text, self.stopped = self.text[:cut], True
        if not (piece and self.req.stream):
            return None
        return M.Token(id=self.req.id, index=token.index, token_id=token.token_id, text=piece)

    def done(self, done: M.Done | None = None) -> M.Done:
        """The client's final message: compute's `done` (its ids and stats) with the text; after
        a stop, finish_reason "stop" with the ids up to the one that completed the stop string
        (without compute's `done`: the stats say prompt and generated tokens only)."""
        if not self.stopped:
            return dataclasses.replace(done, text=self.text)
        ids = list(self.token_ids)
        stats = dict(done.stats) if done is not None else {"prompt_tokens": self.prompt_tokens}
        stats["generated_tokens"] = len(ids)
        return M.Done(id=self.req.id, text=self.text, token_ids=ids, finish_reason="stop", stats=stats)


def generate(compute, tokenizer: Tokenizer, req: M.Generate, emit=None) -> M.Done:
    """One request on an in-process `Compute` (workers/engine.py), text handled as the
    supervisor handles it: emit gets the client's token messages (streamed requests), a stop
    string ends the sequence after the token that completed it."""
    ids = prompt_ids(tokenizer, req, compute.max_context)
    side = TextSide(tokenizer, req, len(ids))

    def relay(token: M.Token) -> None:
        out = side.accept(token)
        if out is not None and emit is not None:
            emit(out)
    done = compute.generate(as_token_ids(req, ids), emit=relay, between_tokens=lambda: side.stopped)
    return side.done(done)
