"""The OpenAI API's answers: a whole response, or server-sent events as the runtime's pieces
arrive, for /v1/completions and /v1/chat/completions. The frontend (workers/frontend.py) drives
any shape alike: `whole(gen)` for a non-streamed answer; `start()`, `piece(text)` per token
message, then `end(gen)` or `failed(error)` for a streamed one, each a list of SSE strings;
`error_body(ApiError)` for a refused request. A chat's text is split into content,
`reasoning_content` and `tool_calls` (workers/toolcalls)."""
from __future__ import annotations

import json
import secrets
import time

from deltafin.workers.openai_api import ApiError, usage
from deltafin.workers.toolcalls import ReplySplitter, split_reply


def sse(data) -> str:
    return f"data: {json.dumps(data)}\n\n"


def call_id() -> str:
    return "call_" + secrets.token_hex(12)


def openai_call(call: dict, cid: str) -> dict:
    """A parsed tool call as OpenAI's: its arguments a JSON string."""
    return {"id": cid, "type": "function",
            "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])}}


def _token(text: str, lp: float, raw: list) -> dict:
    return {"token": text, "logprob": lp, "bytes": raw}


def chat_logprobs(entries: list) -> dict:
    """The runtime's log-probability entries as a chat choice's `logprobs`: each token's own
    bytes (those of a token holding part of a character joined with its neighbours' spell it)."""
    def tops(e):
        return [_token(t, lp, raw) for (_, lp, t), raw in zip(e["top"], e["top_bytes"])]
    return {"content": [{**_token(e["token"], e["logprob"], e["bytes"]), "top_logprobs": tops(e)}
                        for e in entries], "refusal": None}


def completion_logprobs(entries: list) -> dict:
    """The entries as a completion choice's legacy `logprobs`: text_offset where each token's
    text begins in the choice's text (the same streamed or not)."""
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t: lp for _, lp, t in e["top"]} for e in entries],
            "text_offset": [e["offset"] for e in entries]}


class CompletionShape:
    """/v1/completions: text as generated."""

    prefix, obj_whole, obj_chunk = "cmpl-", "text_completion", "text_completion"

    def __init__(self, model_id: str, p: dict, fingerprint: str | None = None):
        """fingerprint: the runtime's setting as `system_fingerprint` (runtime/lossy.py: exact or
        a lossy mode), in every frame."""
        self.model_id, self.p, self.fingerprint = model_id, p, fingerprint
        self.rid = self.prefix + secrets.token_hex(12)
        self.created = int(time.time())

    @staticmethod
    def error_body(e: ApiError) -> dict:
        return e.body()

    def _frame(self, obj: str, choices: list, **extra) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model_id,
                "system_fingerprint": self.fingerprint, "choices": choices, **extra}

    def whole(self, gen) -> dict:
        lps = completion_logprobs(gen.logprobs) if gen.logprobs is not None else None
        choice = {"index": 0, "text": gen.text, "finish_reason": gen.finish_reason, "logprobs": lps}
        return self._frame(self.obj_whole, [choice], usage=usage(gen))

    def _chunk(self, choice: dict) -> str:
        extra = {"usage": None} if self.p["include_usage"] else {}
        return sse(self._frame(self.obj_chunk, [{"index": 0, "logprobs": None, **choice}], **extra))

    def start(self) -> list[str]:
        return []

    def piece(self, text: str, lps: list | None = None) -> list[str]:
        choice = {"text": text, "finish_reason": None}
        if lps is not None:
            choice["logprobs"] = completion_logprobs(lps)
        return [self._chunk(choice)]

    def _finish(self, gen) -> list[str]:
        return [self._chunk({"text": "", "finish_reason": gen.finish_reason})]

    def end(self, gen) -> list[str]:
        out = self._finish(gen)
        if self.p["include_usage"]:
            out.append(sse(self._frame(self.obj_chunk, [], usage=usage(gen))))
        return out + ["data: [DONE]\n\n"]

    def failed(self, e: ApiError) -> list[str]:
        return [sse(e.body()), "data: [DONE]\n\n"]


class ChatShape(CompletionShape):
    """/v1/chat/completions: the answer split into content, reasoning and tool calls."""

    prefix, obj_whole, obj_chunk = "chatcmpl-", "chat.completion", "chat.completion.chunk"

    def __init__(self, model_id: str, p: dict, fingerprint: str | None = None):
        super().__init__(model_id, p, fingerprint)
        self.splitter = ReplySplitter(p["parse_tools"])
        self.calls = 0
        self.unsent: list | None = None  # logprob entries not yet sent (requests that ask)

    def _reason(self, gen, calls: int) -> str:
        return "tool_calls" if calls and gen.finish_reason == "stop" else gen.finish_reason

    def whole(self, gen) -> dict:
        # the text as the streamed deltas join: an editor's indentation and newlines are its own
        reasoning, content, calls = split_reply(gen.text, self.p["parse_tools"], strip=False)
        if not self.p["parallel_tool_calls"]:
            calls = calls[:1]
        message = {"role": "assistant", "content": content}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = [openai_call(c, call_id()) for c in calls]
        choice = {"index": 0, "message": message, "finish_reason": self._reason(gen, len(calls)),
                  "logprobs": chat_logprobs(gen.logprobs) if gen.logprobs is not None else None}
        return self._frame(self.obj_whole, [choice], usage=usage(gen))

    def start(self) -> list[str]:
        return [self._chunk({"delta": {"role": "assistant", "content": ""}, "finish_reason": None})]

    def _deltas(self, events: list) -> list[str]:
        out = []
        for kind, value in events:
            if kind == "tool_call":
                if self.calls and not self.p["parallel_tool_calls"]:
                    continue
                delta = {"tool_calls": [{"index": self.calls, **openai_call(value, call_id())}]}
                self.calls += 1
            else:
                delta = {"content" if kind == "content" else "reasoning_content": value}
            out.append(self._chunk({"delta": delta, "finish_reason": None, **self._logprobs()}))
        return out

    def _logprobs(self) -> dict:
        """The entries not yet sent, for the next chunk (the splitter may hold a token's text)."""
        if not self.unsent:
            return {}
        entries, self.unsent = self.unsent, []
        return {"logprobs": chat_logprobs(entries)}

    def piece(self, text: str, lps: list | None = None) -> list[str]:
        if lps is not None:
            self.unsent = (self.unsent or []) + lps
        return self._deltas(self.splitter.feed(text))

    def _finish(self, gen) -> list[str]:
        out = self._deltas(self.splitter.finish())
        return out + [self._chunk({"delta": {}, "finish_reason": self._reason(gen, self.calls),
                                   **self._logprobs()})]
