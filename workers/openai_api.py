"""The OpenAI API's side of the HTTP frontend: request bodies checked and turned into the
runtime's generate parameters, answers and errors in OpenAI's shapes (docs/HTTP.md).

Prompts stay text: a completion's prompt string and a chat's messages go to the runtime as they
are, and its request manager tokenizes them (chat template included); `usage` counts come back in
the final message's stats."""
from __future__ import annotations

import asyncio
import json
import math

from deltafin.client import (DeltafinError, ExpertUnavailableError, ProtocolMismatch, RequestError,
                             RuntimeBusy, RuntimeDeadError, RuntimeRestarting, RuntimeStopping,
                             RuntimeUnavailable)
from deltafin.protocol import messages as M
from deltafin.protocol.messages import MAX_ERROR_CHARS
from deltafin.runtime.tokenizer import TOO_LONG
from deltafin.workers.structured import ANY_OBJECT, SchemaError, grammar_of


class ApiError(Exception):
    """An error answered with OpenAI's body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        """OpenAI's error body; the message cut at MAX_ERROR_CHARS (it never echoes a body back)."""
        cut = len(self.message) > MAX_ERROR_CHARS
        message = self.message[:MAX_ERROR_CHARS] + "..." if cut else self.message
        return {"error": {"message": message, "type": self.type, "param": self.param,
                          "code": self.code}}


def api_error_from(e: Exception, param: str | None = None) -> ApiError:
    """The client library's exceptions as HTTP statuses: the request's fault 400 (a prompt over
    the context: `context_length_exceeded` naming param, the body's prompt field), the runtime
    busy 429, the runtime restarting, stopping, unreachable or a worker dead 503 (all worth a
    retry)."""
    code = getattr(e, "code", None)
    if isinstance(e, RequestError) and str(e).startswith(TOO_LONG):
        return ApiError(400, str(e), "invalid_request_error", param, "context_length_exceeded")
    if isinstance(e, RequestError):
        return ApiError(400, str(e), "invalid_request_error", code=code)
    if isinstance(e, RuntimeBusy):
        return ApiError(429, str(e), "rate_limit_error", code=code)
    if isinstance(e, (RuntimeRestarting, RuntimeStopping, RuntimeUnavailable, RuntimeDeadError)):
        return ApiError(503, str(e), "service_unavailable", code=code or "unavailable")
    if isinstance(e, (ExpertUnavailableError, ProtocolMismatch, DeltafinError)):
        return ApiError(500, str(e), "server_error", code=code)
    return ApiError(500, f"{type(e).__name__}: {e}", "server_error", code="internal")


# -- request bodies ---------------------------------------------------------------------------------
MAX_JSON_DEPTH = 32  # a body nested deeper is refused (chat messages need 4 levels)
INT_RANGE = (-(1 << 63), 1 << 64)  # what a msgpack integer holds


def parse_body(raw: bytes) -> dict:
    """A request body as a JSON object: invalid JSON, nesting deeper than MAX_JSON_DEPTH and
    integers msgpack cannot carry are refused with 400 naming the fault."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise ApiError(400, f"the body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the body is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    level, depth = [body], 0
    while level:
        depth += 1
        if depth > MAX_JSON_DEPTH:
            raise ApiError(400, f"the body nests deeper than {MAX_JSON_DEPTH} levels")
        below = []
        for v in level:
            for x in (v.values() if isinstance(v, dict) else v):
                if isinstance(x, (dict, list)):
                    below.append(x)
                elif isinstance(x, int) and not INT_RANGE[0] <= x < INT_RANGE[1]:
                    raise ApiError(400, f"an integer of {x.bit_length()} bits is out of range "
                                        f"[-2^63, 2^64)")
        level = below
    return body


# -- request fields ---------------------------------------------------------------------------------
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
    seed = _number(body, "seed", None, -(1 << 63), integer=True)  # OpenAI's: any int64
    seed = seed % (1 << 64) if seed is not None else None  # a negative one as its two's complement
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be a boolean", param="stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise ApiError(400, "'stream_options' must be an object", param="stream_options")
    return {"max_tokens": max_tokens, "temperature": float(_number(body, "temperature", 1.0, 0)),
            "top_p": float(_number(body, "top_p", 1.0, 0, 1, lo_open=True)), "seed": seed,
            "stop": ([s for s in stop if s] or None) if stop else None, "stream": stream,
            "include_usage": bool(opts.get("include_usage")) and stream, **penalties(body)}


def penalties(body: dict) -> dict:
    """top_k, min_p and the repetition, presence and frequency penalties (llama.cpp's and
    OpenAI's names; the runtime's definitions in docs/PROTOCOL.md), neutral where absent."""
    return {"top_k": _number(body, "top_k", 0, 0, integer=True),
            "min_p": float(_number(body, "min_p", 0.0, 0, 1)),
            "repetition_penalty": float(_number(body, "repetition_penalty", 1.0, 0, lo_open=True)),
            "presence_penalty": float(_number(body, "presence_penalty", 0.0, -2, 2)),
            "frequency_penalty": float(_number(body, "frequency_penalty", 0.0, -2, 2))}


def message_text(content, where: str) -> str:
    """A content field (named `where` in the error): a string, or a list of text parts (the
    newer OpenAI shape, Anthropic's text blocks), as one text."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ApiError(400, f"{where} must be a string or a list of text parts", param=where)


ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
         "tool": "tool"}


def _tool_call_in(call, where: str) -> dict:
    """An assistant message's tool call as chat templates take it: OpenAI's shape, its
    arguments a JSON object (templates write them with `tojson` or iterate over them)."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)):
        raise ApiError(400, f"{where} must be {{'type': 'function', 'function': {{'name', "
                            f"'arguments'}}}}", param=where)
    args = fn.get("arguments") or "{}"
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            raise ApiError(400, f"{where}.function.arguments must be a JSON object", param=where) from None
    if not isinstance(args, dict):
        raise ApiError(400, f"{where}.function.arguments must be a JSON object", param=where)
    out = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def chat_messages(body: dict) -> list[dict]:
    """The body's messages as the runtime takes them: {role, content}, with an assistant's
    `tool_calls` and a tool result's `tool_call_id` (and `name`) kept for the chat template."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ApiError(400, f"messages[{i}] must be an object with a role among "
                                f"{', '.join(ROLES)}", param=f"messages[{i}].role")
        content = m.get("content")
        msg = {"role": ROLES[m["role"]],
               "content": "" if content is None and m["role"] == "assistant" else message_text(content, f"messages[{i}].content")}
        calls = m.get("tool_calls") if m["role"] == "assistant" else None
        if calls:
            if not isinstance(calls, list):
                raise ApiError(400, f"messages[{i}].tool_calls must be a list", param=f"messages[{i}].tool_calls")
            msg["tool_calls"] = [_tool_call_in(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(calls)]
        for key in ("tool_call_id", "name"):
            if m["role"] == "tool" and isinstance(m.get(key), str):
                msg[key] = m[key]
        out.append(msg)
    return out


def chat_tools(body: dict) -> tuple[list | None, list | None, bool, str | None]:
    """(tools for the chat template, tools whose calls are parsed out of the answer, parallel
    calls allowed, the runtime's tool_choice) of a body's `tools`, `tool_choice` and
    `parallel_tool_calls`. tool_choice "none" shows no tools and parses none; "required" shows
    them all and a named function that one alone, and both are enforced while decoding (the
    runtime's tool_choice "required": a call of one of the tools shown)."""
    tools = body.get("tools")
    if tools is None or tools == []:
        if body.get("tool_choice") not in (None, "none", "auto"):
            raise ApiError(400, "'tool_choice' needs 'tools'", param="tool_choice")
        return None, None, True, None
    if not isinstance(tools, list) or not all(
            isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str) for t in tools):
        raise ApiError(400, "'tools' must be a list of {'type': 'function', 'function': {'name', "
                            "'description', 'parameters'}}", param="tools")
    choice = body.get("tool_choice", "auto")
    if choice == "none":
        return None, None, True, None
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        tools = [t for t in tools if t["function"]["name"] == name]
        if not tools:
            raise ApiError(400, "'tool_choice' names no function among the tools", param="tool_choice")
    elif choice not in ("auto", "required"):
        raise ApiError(400, "'tool_choice' must be 'none', 'auto', 'required' or "
                            "{'type': 'function', 'function': {'name'}}", param="tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ApiError(400, "'parallel_tool_calls' must be a boolean", param="parallel_tool_calls")
    return tools, tools, parallel, (None if choice == "auto" else "required")


def completion_request(body: dict, max_context: int) -> tuple:
    """(prompt text or token ids, generate parameters) of a /v1/completions body; token ids
    beyond max_context are refused here (the runtime would not decode so long a list)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, "'prompt' is empty", param="prompt")
    elif not (isinstance(prompt, list) and prompt
              and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
        raise ApiError(400, "'prompt' must be a string, a list of token ids, or a list of one "
                            "of either (batches are not supported)", param="prompt")
    if isinstance(prompt, list) and len(prompt) > max_context:
        raise ApiError(400, f"{len(prompt)} prompt tokens exceed the model's max_context "
                            f"({max_context})", param="prompt", code="context_length_exceeded")
    for key in ("echo", "suffix"):
        if body.get(key) not in (None, False, 0):
            raise ApiError(400, f"'{key}' is not supported", param=key)
    if _number(body, "best_of", 1, 1, integer=True) != 1:
        raise ApiError(400, "only best_of = 1 is supported", param="best_of")
    p = sampling(body, 16)  # OpenAI's default
    p["logprobs"] = _number(body, "logprobs", None, 0, 5, integer=True)
    p["json_schema"] = response_format(body)
    return (prompt if isinstance(prompt, str) else list(prompt)), p


def chat_request(body: dict) -> tuple[list[dict], dict]:
    """(messages, generate parameters) of a /v1/chat/completions body; max_tokens defaults to
    the rest of the context (None: the runtime counts it once the messages are tokenized)."""
    if body.get("functions"):
        raise ApiError(400, "'functions' is not supported (use 'tools')", param="functions")
    p = sampling(body, None)
    p["json_schema"] = response_format(body)
    p["tools"], p["parse_tools"], p["parallel_tool_calls"], p["tool_choice"] = chat_tools(body)
    if not isinstance(body.get("logprobs", False), bool):
        raise ApiError(400, "'logprobs' must be a boolean", param="logprobs")
    top = _number(body, "top_logprobs", None, 0, 20, integer=True)
    if top is not None and not body.get("logprobs"):
        raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    p["logprobs"] = (top or 0) if body.get("logprobs") else None
    return chat_messages(body), p


def response_format(body: dict) -> str | None:
    """The JSON Schema (text) a body's `response_format` asks the answer to match: any JSON object
    for {"type": "json_object"}, the schema of {"type": "json_schema", "json_schema": {"name",
    "schema"}}; None for text. Enforced while decoding (workers/structured.py), strict or not."""
    fmt = body.get("response_format")
    if fmt is None or fmt == {"type": "text"}:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_object":
        return ANY_OBJECT
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not (isinstance(spec, dict) and isinstance(spec.get("schema"), dict)):
            raise ApiError(400, "response_format json_schema needs {'json_schema': {'name', 'schema'}} "
                                "with the schema an object", param="response_format")
        return json.dumps(spec["schema"])
    raise ApiError(400, "response_format must be {'type': 'text'}, {'type': 'json_object'} or "
                        "{'type': 'json_schema', 'json_schema': {...}}", param="response_format")


SCHEMA_TIMEOUT_S = 5.0  # a JSON schema not compiled within this is refused


async def check_schema(p: dict) -> None:
    """The request's json_schema compiled off the event loop (llguidance bounds its work) before
    it is sent: an invalid one, or one not compiled within SCHEMA_TIMEOUT_S, is a 400 here."""
    if p.get("json_schema") is None:
        return
    try:
        await asyncio.wait_for(asyncio.to_thread(grammar_of, p["json_schema"]), SCHEMA_TIMEOUT_S)
    except SchemaError as e:
        raise ApiError(400, str(e), param="response_format", code="invalid_json_schema") from None
    except TimeoutError:
        raise ApiError(400, f"the JSON schema did not compile within {SCHEMA_TIMEOUT_S:g} s",
                       param="response_format", code="invalid_json_schema") from None


def generate_args(p: dict) -> dict:
    """The Client.generate / Client.stream keywords of the request's parameters."""
    args = {k: p[k] for k in ("max_tokens", "temperature", "top_p", "seed", "stop")}
    for key in (*M.SAMPLING_OPTIONS, "tools", "logprobs"):
        if p.get(key) is not None:
            args[key] = p[key]
    return args


def usage(gen) -> dict:
    """OpenAI's usage of a Generation: prompt tokens as the runtime counted them (after the chat
    template), generated tokens (EOS, which ends a generation, is not among them)."""
    n_prompt, n_out = int(gen.stats["prompt_tokens"]), len(gen.token_ids)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}

