"""Qwen3 / Qwen2.5 / Hermes tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
one JSON object per block."""
from __future__ import annotations

import json

from deltafin.runtime import markers
from deltafin.workers.toolcalls.grammar import alternatives, repeat, schema

START, END = markers.TOOL_CALL, markers.TOOL_CALL_END


def accepts(body: str) -> bool:
    return body.lstrip().startswith("{")


def parse(body: str, tools: list | None) -> list[dict]:
    """[{name, arguments}] of one block; ValueError when it is not such an object."""
    call = json.loads(body)
    if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
        raise ValueError("a tool call must be a JSON object with a string 'name'")
    args = call.get("arguments", call.get("parameters", {}))
    if isinstance(args, str):
        args = json.loads(args) if args.strip() else {}
    if not isinstance(args, dict):
        raise ValueError("a tool call's arguments must be a JSON object")
    return [{"name": call["name"], "arguments": args}]


def grammar(tools: list, mark, parallel: bool) -> list[str]:
    """Lark rules `calls` (workers/toolcalls/grammar.py): blocks of `{"name": NAME, "arguments":
    ARGS}` as the Qwen3 / Hermes templates write them, ARGS the tool's schema at the root of its
    own `%json` (so its `$ref`s resolve)."""
    nl = mark("\n")

    def call(tool: dict) -> str:
        head = f'{{"name": {json.dumps(tool["function"]["name"])}, "arguments": '
        return f"{mark(START)} {nl} {json.dumps(head)} {schema(tool)} {json.dumps('}')} {nl} {mark(END)}"
    return [f"calls: {repeat('call', parallel, nl)}", *alternatives(tools, call)]
