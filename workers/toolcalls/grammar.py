"""What the tool-call grammars are built of (workers/toolcalls/__init__.py `tool_grammar`):
tool_choice "required" (OpenAI; Anthropic's `any` and `tool`) enforced while decoding: an
llguidance Lark grammar of the answer in the model family's own tool-call format, each call's
arguments an embedded `%json` of the tool's `parameters` schema, compiled in compute the way a
json_schema is (workers/structured.py).

The family's format is read off its chat template (`tool_format`: the markers the template writes
for an assistant's calls); each format module writes its calls' rules (`grammar(tools, mark,
parallel)`, rule `calls`). The answer may open with the reasoning the family writes before a
call: `<think>...</think>` where the template knows it (required to close where the generation
prompt opened it), gpt-oss's analysis message; content text before the calls is not allowed (an
answer under "required" is its calls, as OpenAI's is).

llguidance reads every added token of tokenizer.json as a special token, matched only by its id
(`<[ID]>`), never by the text of a terminal; `Marks` writes a marker as its token where the
tokenizer has it as one, as a string literal otherwise."""
from __future__ import annotations

import json
from collections.abc import Callable

from deltafin.workers.structured import JSON_STYLE  # arguments laid out as a json_schema's answer is

REGEX_META = set("\\.+*?()|[]{}^$#&-~/")  # escaped where a marker's text ends a lazy regex


class ToolChoiceError(ValueError):
    """tool_choice "required" cannot be enforced for this model or these tools: the message says why."""


class Marks:
    """added: {text: id} of the tokenizer's added tokens."""

    def __init__(self, added: dict[str, int]):
        self.added = added

    def __call__(self, text: str) -> str:
        """The grammar's item matching `text`: its token where it is one, else the literal."""
        return f"<[{self.added[text]}]>" if text in self.added else json.dumps(text)

    def until(self, name: str, end: str) -> str:
        """Rule `name`: any text, then the first `end`."""
        if end in self.added:
            return f"{name}: /(?s:.*)/ {self(end)}"
        escaped = "".join("\\" + c if c in REGEX_META else c for c in end)
        return f"{name}[lazy]: /(?s:.*){escaped}/"


def schema(tool: dict) -> str:
    """The `%json` item of a tool's arguments (its parameters schema; any object without one)."""
    params = dict(tool["function"].get("parameters") or {"type": "object"})
    params.setdefault("type", "object")
    return "%json " + json.dumps({**params, "x-guidance": JSON_STYLE})


def names(tools: list) -> list[str]:
    return [t["function"]["name"] for t in tools]


def repeat(item: str, parallel: bool, sep: str = "") -> str:
    """One item, or (parallel) one or more, `sep` between them."""
    return f"{item} ({sep} {item})*" if parallel else item


def alternatives(tools: list, write) -> list[str]:
    """Rule `call`: one alternative per tool, write(tool) its body."""
    return [f"call: {' | '.join(f'call{i}' for i in range(len(tools)))}",
            *(f"call{i}: {write(t)}" for i, t in enumerate(tools))]


def _resolved(sub, root: dict) -> dict:
    """A parameter's schema on its own: a local `$ref` followed, the root's definitions carried
    along for the refs inside it."""
    seen = 0
    while isinstance(sub, dict) and str(sub.get("$ref", "")).startswith("#/") and seen < 32:
        target = root
        for part in sub["$ref"][2:].split("/"):
            target = target.get(part, {}) if isinstance(target, dict) else {}
        sub, seen = target, seen + 1
    defs = {k: root[k] for k in ("$defs", "definitions") if k in root}
    return {**defs, **sub} if isinstance(sub, dict) else defs


def tagged_arguments(tools: list, mark: Marks, key: Callable[[str], str], end: str, sep: str = "") -> list[str]:
    """Rules `args{i}` of each tool: its declared parameters in the schema's order, the
    required ones always, the others optional, each key(name) VALUE end sep; a string VALUE is
    text (up to the first end), any other the parameter's `%json`."""
    rules = []
    for i, t in enumerate(tools):
        params = t["function"].get("parameters") or {}
        required, items = set(params.get("required") or ()), []
        for j, (name, sub) in enumerate((params.get("properties") or {}).items()):
            value = f"v{i}_{j}"
            sub = _resolved(sub, params)
            if sub.get("type") == "string":
                rules.append(mark.until(value, end))
            else:
                rules.append(f"{value}: %json {json.dumps({**sub, 'x-guidance': JSON_STYLE})} {mark(end)}")
            item = f"{key(name)} {value} {sep}"
            items.append(item if name in required else f"({item})?")
        rules.append(f"args{i}: {' '.join(items)}" if items else f"args{i}: {mark(' ')}?")
    return rules
