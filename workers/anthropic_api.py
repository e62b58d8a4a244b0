"""Anthropic's Messages API (POST /v1/messages) over the runtime: a request body turned into
chat messages and generate parameters, the answer as a message of content blocks (`thinking`,
`text`, `tool_use`) or as Anthropic's stream of events (message_start, content_block_start /
delta / stop, message_delta, message_stop). The chat template renders the conversation with
the tools in OpenAI's shape (what templates take): `tool_use` blocks become an assistant's
`tool_calls`, `tool_result` blocks `tool` messages."""
from __future__ import annotations

import json
import secrets

from deltafin.workers.openai_api import ApiError, _number, message_text, penalties
from deltafin.workers.toolcalls import ReplySplitter, split_reply

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
               503: "overloaded_error"}
STOP_REASONS = {"length": "max_tokens", "cancelled": "end_turn"}


def _turn(m, i: int) -> list[dict]:
    """One Anthropic message as chat messages: a user's tool_result blocks as tool messages
    (first), its text as a user message; an assistant's text and tool_use blocks as one
    assistant message with tool_calls. Thinking blocks of earlier turns are left out."""
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        raise ApiError(400, f"messages.{i}: role must be 'user' or 'assistant'", param=f"messages.{i}")
    blocks = m.get("content")
    if isinstance(blocks, str):
        return [{"role": m["role"], "content": blocks}]
    if not isinstance(blocks, list):
        raise ApiError(400, f"messages.{i}.content must be a string or a list of blocks")
    texts, calls, results = [], [], []
    for j, b in enumerate(blocks):
        kind, where = b.get("type") if isinstance(b, dict) else None, f"messages.{i}.content.{j}"
        if kind == "text":
            texts.append(message_text([b], f"messages[{i}].content"))
        elif kind == "tool_use" and m["role"] == "assistant":
            if not (isinstance(b.get("name"), str) and isinstance(b.get("input"), dict)):
                raise ApiError(400, f"{where}: tool_use needs a string 'name' and an object 'input'")
            calls.append({"id": str(b.get("id", "")), "type": "function",
                          "function": {"name": b["name"], "arguments": b["input"]}})
        elif kind == "tool_result" and m["role"] == "user":
            results.append({"role": "tool", "tool_call_id": str(b.get("tool_use_id", "")),
                            "content": message_text(b.get("content", ""), f"{where}.content")})
        elif kind not in ("thinking", "redacted_thinking"):
            raise ApiError(400, f"{where}: blocks of type {kind!r} are not supported here "
                                f"(text, tool_use, tool_result)")
    out = results
    if texts or calls or not results:
        msg = {"role": m["role"], "content": "".join(texts)}
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def _tools(body: dict) -> tuple[list | None, bool, str | None]:
    """(tools in OpenAI's shape for the template and the parser, parallel calls allowed, the
    runtime's tool_choice) of `tools` and `tool_choice` (auto, any, a named tool, none): `any`
    and a named tool are the runtime's "required", enforced while decoding."""
    tools, choice = body.get("tools"), body.get("tool_choice") or {"type": "auto"}
    if not tools:
        return None, True, None
    if not isinstance(tools, list) or not all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                              for t in tools):
        raise ApiError(400, "tools must be a list of {name, description, input_schema}", param="tools")
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
        raise ApiError(400, "tool_choice.type must be auto, any, tool or none", param="tool_choice")
    if choice["type"] == "none":
        return None, True, None
    if choice["type"] == "tool":
        tools = [t for t in tools if t["name"] == choice.get("name")]
        if not tools:
            raise ApiError(400, "tool_choice names no tool among the tools", param="tool_choice")
    fns = [{"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                             "parameters": t.get("input_schema") or {}}} for t in tools]
    return (fns, not choice.get("disable_parallel_tool_use", False),
            None if choice["type"] == "auto" else "required")


def messages_request(body: dict) -> tuple[list[dict], dict]:
    """(chat messages, generate parameters) of a /v1/messages body."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(400, "messages: a non-empty list is required", param="messages")
    if body.get("max_tokens") is None:
        raise ApiError(400, "max_tokens: field required", param="max_tokens")
    chat = [{"role": "system", "content": message_text(body["system"], "system")}] if body.get("system") else []
    for i, m in enumerate(msgs):
        chat += _turn(m, i)
    stop = body.get("stop_sequences")
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise ApiError(400, "stop_sequences must be a list of strings", param="stop_sequences")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "stream must be a boolean", param="stream")
    tools, parallel, required = _tools(body)
    return chat, {"max_tokens": _number(body, "max_tokens", None, 1, integer=True),
                  "temperature": float(_number(body, "temperature", 1.0, 0, 1)),
                  "top_p": float(_number(body, "top_p", 1.0, 0, 1, lo_open=True)), "seed": None,
                  "stop": [s for s in stop if s] or None if stop else None, "stream": stream,
                  "include_usage": False, "tools": tools, "parse_tools": tools, "logprobs": None,
                  "parallel_tool_calls": parallel, "tool_choice": required, **penalties({"top_k": body.get("top_k")} if body.get("top_k") else {})}


def _event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n"


class MessagesShape:
    """The answer of /v1/messages (the frontend drives it as it drives workers/openai_shapes)."""

    def __init__(self, model_id: str, p: dict):
        self.model_id, self.p = model_id, p
        self.rid = "msg_" + secrets.token_hex(12)
        self.splitter = ReplySplitter(p["parse_tools"])
        self.blocks = 0          # content blocks started
        self.open: str | None = None  # the kind of the block open: "text" or "thinking"
        self.pending = ""  # whitespace at the open block's end: blocks are sent stripped, as whole
        self.calls = 0

    @staticmethod
    def error_body(e: ApiError) -> dict:
        return {"type": "error", "error": {"type": ERROR_TYPES.get(e.status, "api_error"),
                                           "message": e.body()["error"]["message"]}}

    def _stop(self, gen, calls: int) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence): a stop string names itself in the final stats."""
        if calls and gen.finish_reason == "stop":
            return "tool_use", None
        if gen.stats.get("stop_string") is not None:
            return "stop_sequence", gen.stats["stop_string"]
        return STOP_REASONS.get(gen.finish_reason, "end_turn"), None

    @staticmethod
    def _usage(gen) -> dict:
        return {"input_tokens": int(gen.stats["prompt_tokens"]), "output_tokens": len(gen.token_ids)}

    @staticmethod
    def _tool_use(call: dict) -> dict:
        return {"type": "tool_use", "id": "toolu_" + secrets.token_hex(12), "name": call["name"],
                "input": call["arguments"]}

    def whole(self, gen) -> dict:
        reasoning, content, calls = split_reply(gen.text, self.p["parse_tools"])
        if not self.p["parallel_tool_calls"]:
            calls = calls[:1]
        blocks = [{"type": "thinking", "thinking": reasoning, "signature": ""}] if reasoning else []
        blocks += [{"type": "text", "text": content}] if content else []
        blocks += [self._tool_use(c) for c in calls]
        reason, sequence = self._stop(gen, len(calls))
        return {"id": self.rid, "type": "message", "role": "assistant", "model": self.model_id,
                "content": blocks, "stop_reason": reason, "stop_sequence": sequence,
                "usage": self._usage(gen)}

    def start(self) -> list[str]:
        return [_event("message_start", {"type": "message_start", "message": {
            "id": self.rid, "type": "message", "role": "assistant", "model": self.model_id,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0}}})]

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        self.blocks += 1
        return [_event("content_block_stop", {"type": "content_block_stop", "index": self.blocks - 1})]

    def _block(self, block: dict) -> list[str]:
        return [_event("content_block_start", {"type": "content_block_start", "index": self.blocks,
                                               "content_block": block})]

    def _events(self, events: list) -> list[str]:
        out = []
        for kind, value in events:
            if kind == "tool_call":
                if self.calls and not self.p["parallel_tool_calls"]:
                    continue
                self.calls += 1
                use = self._tool_use(value)
                out += self._close() + self._block({**use, "input": {}})
                out.append(_event("content_block_delta", {
                    "type": "content_block_delta", "index": self.blocks,
                    "delta": {"type": "input_json_delta", "partial_json": json.dumps(use["input"])}}))
                self.open = "tool_use"
                out += self._close()
                continue
            block = "thinking" if kind == "reasoning" else "text"
            value = value.lstrip() if self.open != block else self.pending + value
            self.pending = value[len(value.rstrip()):]  # sent only if more text follows in the block
            value = value.rstrip()
            if not value:
                continue
            if self.open != block:
                out += self._close() + self._block({"type": "thinking", "thinking": "", "signature": ""}
                                                   if block == "thinking" else {"type": "text", "text": ""})
                self.open = block
            delta = ({"type": "thinking_delta", "thinking": value} if block == "thinking"
                     else {"type": "text_delta", "text": value})
            out.append(_event("content_block_delta", {"type": "content_block_delta", "index": self.blocks,
                                                      "delta": delta}))
        return out

    def piece(self, text: str, lps: list | None = None) -> list[str]:
        """lps: log-probabilities, which the Messages API has no place for."""
        return self._events(self.splitter.feed(text))

    def end(self, gen) -> list[str]:
        out = self._events(self.splitter.finish()) + self._close()
        reason, sequence = self._stop(gen, self.calls)
        out.append(_event("message_delta", {"type": "message_delta",
                                            "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                            "usage": self._usage(gen)}))
        return out + [_event("message_stop", {"type": "message_stop"})]

    def failed(self, e: ApiError) -> list[str]:
        return [_event("error", self.error_body(e))]
