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


class CompletionShape:
    """/v1/completions: text as generated."""

    prefix, obj_whole, obj_chunk = "cmpl-", "text_completion", "text_completion"

    def __init__(self, model_id: str, p: dict):
        self.model_id, self.p = model_id, p
        self.rid = self.prefix + secrets.token_hex(12)
        self.created = int(time.time())

    @staticmethod
    def error_body(e: ApiError) -> dict:
        return e.body()

    def _frame(self, obj: str, choices: list, **extra) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model_id,
                "choices": choices, **extra}

    def whole(self, gen) -> dict:
        choice = {"index": 0, "text": gen.text, "finish_reason": gen.finish_reason, "logprobs": None}
        return self._frame(self.obj_whole, [choice], usage=usage(gen))

    def _chunk(self, choice: dict) -> str:
        extra = {"usage": None} if self.p["include_usage"] else {}
        return sse(self._frame(self.obj_chunk, [{"index": 0, **choice, "logprobs": None}], **extra))

    def start(self) -> list[str]:
        return []

    def piece(self, text: str) -> list[str]:
        return [self._chunk({"text": text, "finish_reason": None})]

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

    def __init__(self, model_id: str, p: dict):
        super().__init__(model_id, p)
        self.splitter = ReplySplitter(p["parse_tools"])
        self.calls = 0

    def _reason(self, gen, calls: int) -> str:
        return "tool_calls" if calls and gen.finish_reason == "stop" else gen.finish_reason

    def whole(self, gen) -> dict:
        reasoning, content, calls = split_reply(gen.text, self.p["parse_tools"])
        if not self.p["parallel_tool_calls"]:
            calls = calls[:1]
        message = {"role": "assistant", "content": content}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = [openai_call(c, call_id()) for c in calls]
        choice = {"index": 0, "message": message, "finish_reason": self._reason(gen, len(calls)),
                  "logprobs": None}
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
            out.append(self._chunk({"delta": delta, "finish_reason": None}))
        return out

    def piece(self, text: str) -> list[str]:
        return self._deltas(self.splitter.feed(text))

    def _finish(self, gen) -> list[str]:
        out = self._deltas(self.splitter.finish())
        return out + [self._chunk({"delta": {}, "finish_reason": self._reason(gen, self.calls)})]
