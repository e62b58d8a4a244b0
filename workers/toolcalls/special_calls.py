"""Tool calls written in special tokens (runtime/markers.py), one section of calls per answer:

- DeepSeek-V3: `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`, a newline, ARGS fenced as a
  ```json block, `<｜tool▁call▁end｜>`; V3.1: `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>`;
  the calls inside `<｜tool▁calls▁begin｜>` ... `<｜tool▁calls▁end｜>`.
- Kimi-K2: `<|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>ARGS<|tool_call_end|>`
  inside `<|tool_calls_section_begin|>` ... `<|tool_calls_section_end|>`.

ARGS is a JSON object. The last call's end marker may be missing (the answer ended there)."""
from __future__ import annotations

import json
import re

from deltafin.runtime import markers as K
from deltafin.workers.toolcalls.grammar import alternatives, repeat, schema


def _until(end: str) -> str:
    return f"(.*?)(?:{re.escape(end)}|\\Z)"


DEEPSEEK_CALL = re.compile(f"{re.escape(K.DEEPSEEK_CALL_BEGIN)}(.*?){re.escape(K.DEEPSEEK_SEP)}"
                           + _until(K.DEEPSEEK_CALL_END), re.DOTALL)
FENCED = re.compile(r"\s*([^\n`]+?)\s*\n```(?:json)?[ \t]*\n(.*?)\n?```\s*\Z", re.DOTALL)
KIMI_CALL = re.compile(f"{re.escape(K.KIMI_CALL_BEGIN)}(.*?){re.escape(K.KIMI_ARGUMENT_BEGIN)}"
                       + _until(K.KIMI_CALL_END), re.DOTALL)
KIMI_NAME = re.compile(r"\s*(?:functions\.)?(.+?)(?::\d+)?\s*\Z", re.DOTALL)


def call(name: str, args: str) -> dict:
    """{name, arguments} of a name and a JSON object's text; ValueError when they are not."""
    name = name.strip()
    value = json.loads(args) if args.strip() else {}
    if not name or not isinstance(value, dict):
        raise ValueError("a tool call needs a name and a JSON object of arguments")
    return {"name": name, "arguments": value}


def parse_deepseek(body: str, tools: list | None) -> list[dict]:
    calls = []
    for head, rest in DEEPSEEK_CALL.findall(body):
        fenced = FENCED.match(rest) if head.strip() == "function" else None
        calls.append(call(*fenced.groups()) if fenced else call(head, rest))
    if not calls:
        raise ValueError("no tool call in the DeepSeek section")
    return calls


def parse_kimi(body: str, tools: list | None) -> list[dict]:
    calls = [call(KIMI_NAME.match(head).group(1), args) for head, args in KIMI_CALL.findall(body)]
    if not calls:
        raise ValueError("no tool call in the Kimi section")
    return calls


def deepseek_v31_grammar(tools: list, mark, parallel: bool) -> list[str]:
    """Lark rules `calls`: a section of `<begin>NAME<sep>ARGS<end>` calls (DeepSeek-V3.1)."""
    return [f"calls: {mark(K.DEEPSEEK_CALLS_BEGIN)} {repeat('call', parallel)} {mark(K.DEEPSEEK_CALLS_END)}",
            *alternatives(tools, lambda t: f"{mark(K.DEEPSEEK_CALL_BEGIN)} {json.dumps(t['function']['name'])} "
                                            f"{mark(K.DEEPSEEK_SEP)} {schema(t)} {mark(K.DEEPSEEK_CALL_END)}")]


def deepseek_v3_grammar(tools: list, mark, parallel: bool) -> list[str]:
    """Lark rules `calls`: a section of `<begin>function<sep>NAME` + a ```json fenced ARGS +
    `<end>` calls (DeepSeek-V3 / R1)."""
    return [f"calls: {mark(K.DEEPSEEK_CALLS_BEGIN)} {repeat('call', parallel, mark(chr(10)))} "
            f"{mark(K.DEEPSEEK_CALLS_END)}",
            *alternatives(tools, lambda t: f"{mark(K.DEEPSEEK_CALL_BEGIN)} \"function\" {mark(K.DEEPSEEK_SEP)} "
                                            f"{json.dumps(t['function']['name'] + chr(10) + '```json' + chr(10))} "
                                            f"{schema(t)} \"\\n```\" {mark(K.DEEPSEEK_CALL_END)}")]


def kimi_grammar(tools: list, mark, parallel: bool) -> list[str]:
    """Lark rules `calls`: a section of `<begin>functions.NAME:INDEX<argument begin>ARGS<end>`
    calls (Kimi-K2)."""
    return [f"calls: {mark(K.KIMI_SECTION_BEGIN)} {repeat('call', parallel)} {mark(K.KIMI_SECTION_END)}",
            "INDEX: /[0-9]{1,3}/",
            *alternatives(tools, lambda t: f"{mark(K.KIMI_CALL_BEGIN)} "
                                            f"{json.dumps('functions.' + t['function']['name'] + ':')} INDEX "
                                            f"{mark(K.KIMI_ARGUMENT_BEGIN)} {schema(t)} {mark(K.KIMI_CALL_END)}")]
