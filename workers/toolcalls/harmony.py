"""gpt-oss's harmony messages: `<|start|>assistant [to=RECIPIENT]<|channel|>CHANNEL [to=RECIPIENT]
[<|constrain|>json]<|message|>TEXT`, ended by `<|end|>`, `<|call|>` or `<|return|>` (the first
message of an answer has no `<|start|>assistant`: the prompt ends with it). The `analysis`
channel is reasoning, `final` and `commentary` without a recipient are content, a message to
`functions.NAME` is a call of NAME with a JSON object of arguments."""
from __future__ import annotations

import json
import re

from deltafin.runtime import markers as K
from deltafin.workers.toolcalls.grammar import alternatives, schema

RECIPIENT = re.compile(r"\bto=([^\s<]+)")
CHANNEL_NAME = re.compile(re.escape(K.CHANNEL) + r"\s*([\w.-]+)")


def route(header: str) -> tuple[str, str | None]:
    """What a message with this header is: ("call", tool name), ("reasoning", None) or
    ("content", None)."""
    to = RECIPIENT.search(header)
    if to:
        return "call", to.group(1).removeprefix("functions.")
    channel = CHANNEL_NAME.search(header)
    return ("reasoning" if channel and channel.group(1) == "analysis" else "content"), None


def grammar(tools: list, mark, parallel: bool) -> list[str]:
    """Lark rules `reasoning` (an analysis message) and `calls`: one commentary message to
    `functions.NAME` (the recipient after the channel or before it) with JSON arguments, ended
    by `<|call|>` (a harmony answer makes one call: `<|call|>` ends it)."""
    json_tag = f'(" " {mark(K.CONSTRAIN)} "json" | " json")?'

    def call(tool: dict) -> str:
        to = json.dumps(" to=functions." + tool["function"]["name"])
        headers = (f'{mark(K.CHANNEL)} "commentary" {to} {json_tag}',
                   f'{to} {mark(K.CHANNEL)} "commentary" {json_tag}')
        return f"({' | '.join(headers)}) {mark(K.MESSAGE)} {schema(tool)} {mark(K.CALL)}"
    return [f'reasoning: {mark(K.CHANNEL)} "analysis" {mark(K.MESSAGE)} /(?s:.*)/ {mark(K.END)} '
            f'{mark(K.START)} "assistant"',
            "calls: call", *alternatives(tools, call)]
