"""Tool calls written as tags, arguments as text values typed by the tool's JSON schema:

- GLM-4.5 / 4.6: `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>`
- Qwen3-Coder: `<tool_call><function=NAME><parameter=K>V</parameter>...</function></tool_call>`
- MiniMax-M2: `<minimax:tool_call><invoke name="NAME"><parameter name="K">V</parameter>...</invoke>
  ...</minimax:tool_call>` (several invokes per block)."""
from __future__ import annotations

import json
import re

from deltafin.runtime import markers as K
from deltafin.workers.toolcalls.grammar import repeat, tagged_arguments

GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
CODER_FN = re.compile(r"<function=([^>\s]+)>(.*?)</function>", re.DOTALL)
CODER_PARAM = re.compile(r"<parameter=([^>\s]+)>(.*?)</parameter>", re.DOTALL)
MINIMAX_INVOKE = re.compile(r"<invoke name=\"?([^\">]+)\"?>(.*?)</invoke>", re.DOTALL)
MINIMAX_PARAM = re.compile(r"<parameter name=\"?([^\">]+)\"?>(.*?)</parameter>", re.DOTALL)


def _string_args(name: str, tools: list | None) -> set[str]:
    """The parameters the tool's schema declares as strings (kept as written)."""
    for t in tools or []:
        fn = t.get("function") or {}
        if fn.get("name") == name:
            props = (fn.get("parameters") or {}).get("properties") or {}
            return {k for k, v in props.items() if isinstance(v, dict) and v.get("type") == "string"}
    return set()


def _arguments(name: str, pairs, tools: list | None) -> dict:
    """Values as JSON where they parse and the schema does not declare a string, else text;
    one newline around a value (the formats put values on lines of their own) is dropped."""
    strings = _string_args(name, tools)
    out = {}
    for key, value in pairs:
        key = key.strip()
        value = value.removeprefix("\n").removesuffix("\n")
        if key not in strings:
            try:
                value = json.loads(value)
            except ValueError:
                pass
        out[key] = value
    return out


def parse_glm(body: str, tools: list | None) -> list[dict]:
    name = body.split("<arg_key>", 1)[0].strip()
    if not name or "<" in name:
        raise ValueError("a GLM tool call starts with the function's name")
    return [{"name": name, "arguments": _arguments(name, GLM_ARG.findall(body), tools)}]


def parse_coder(body: str, tools: list | None) -> list[dict]:
    calls = [{"name": n, "arguments": _arguments(n, CODER_PARAM.findall(inner), tools)}
             for n, inner in CODER_FN.findall(body)]
    if not calls:
        raise ValueError("no <function=...> in the tool call")
    return calls


def parse_minimax(body: str, tools: list | None) -> list[dict]:
    calls = [{"name": n.strip(), "arguments": _arguments(n.strip(), MINIMAX_PARAM.findall(inner), tools)}
             for n, inner in MINIMAX_INVOKE.findall(body)]
    if not calls:
        raise ValueError("no <invoke name=...> in the tool call")
    return calls


def _calls(tools: list, mark, parallel: bool, write, sep: str = "\n") -> list[str]:
    """Rules `calls` (blocks of one call each) and `call`: write(i, tool) a call's text."""
    return [f"calls: {repeat('call', parallel, mark(sep))}",
            f"call: {' | '.join(f'call{i}' for i in range(len(tools)))}",
            *(f"call{i}: {write(i, t)}" for i, t in enumerate(tools))]


def glm_grammar(tools: list, mark, parallel: bool) -> list[str]:
    """Lark rules `calls`: `<tool_call>NAME` + `<arg_key>K</arg_key><arg_value>V</arg_value>`
    per parameter + `</tool_call>` (GLM-4.5)."""
    key, value = K.GLM_ARGS[:2], K.GLM_ARGS[2]
    return [*_calls(tools, mark, parallel, lambda i, t: f"{mark(K.TOOL_CALL)} "
                    f"{json.dumps(t['function']['name'] + chr(10))} args{i} {mark(K.TOOL_CALL_END)}"),
            *tagged_arguments(tools, mark, lambda k: f"{mark(key[0])} {json.dumps(k)} {mark(key[1])} "
                              f"{mark(chr(10))} {mark(value)}", K.GLM_ARGS[3], mark(chr(10)))]


def coder_grammar(tools: list, mark, parallel: bool) -> list[str]:
    """Lark rules `calls`: `<tool_call>\n<function=NAME>\n` + `<parameter=K>\nV\n</parameter>\n`
    per parameter + `</function>\n</tool_call>` (Qwen3-Coder)."""
    return [*_calls(tools, mark, parallel, lambda i, t: f"{mark(K.TOOL_CALL)} "
                    f"{json.dumps(chr(10) + '<function=' + t['function']['name'] + '>' + chr(10))} args{i} "
                    f"\"</function>\\n\" {mark(K.TOOL_CALL_END)}"),
            *tagged_arguments(tools, mark, lambda k: json.dumps(f"<parameter={k}>"), "</parameter>", mark(chr(10)))]


def minimax_grammar(tools: list, mark, parallel: bool) -> list[str]:
    """Lark rules `calls`: `<minimax:tool_call>\n` + `<invoke name="NAME">\n` +
    `<parameter name="K">V</parameter>\n` per parameter + `</invoke>\n` per call +
    `</minimax:tool_call>` (MiniMax-M2: one block holds the calls)."""
    invokes = [f'call: {" | ".join(f"call{i}" for i in range(len(tools)))}',
               *(f"call{i}: {json.dumps(f'<invoke name={json.dumps(n)}>' + chr(10))} args{i} "
                 f"{json.dumps('</invoke>' + chr(10))}" for i, n in enumerate(t["function"]["name"] for t in tools))]
    return [f"calls: {mark(K.MINIMAX_CALL)} {mark(chr(10))} {repeat('call', parallel)} {mark(K.MINIMAX_CALL_END)}",
            *invokes, *tagged_arguments(tools, mark, lambda k: json.dumps(f'<parameter name="{k}">'),
                                        "</parameter>", mark(chr(10)))]
