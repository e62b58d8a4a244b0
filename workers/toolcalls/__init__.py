"""A chat answer's text split into reasoning, content and tool calls, as it streams.

Reasoning is the text between `<think>` and `</think>` (Qwen3, DeepSeek-R1, GLM-4.5, MiniMax-M2,
Kimi-K2-Thinking); tool calls are the blocks the model's family writes (json_call.py: Qwen3 and
Hermes JSON; xml_calls.py: GLM-4.5, Qwen3-Coder, MiniMax-M2), recognised by their tags in the
text, so no model-specific setting is needed. A block that does not parse stays in the content
as written. Only markers the tokenizer decodes as text can be seen: formats built of special
tokens that decoding skips (DeepSeek-V3's, Kimi-K2's, gpt-oss's channels) are not parsed.

`ReplySplitter` takes text pieces in order and returns events: ("reasoning", text),
("content", text), ("tool_call", {name, arguments}); text that may begin a marker is held back
until the next piece shows whether it does. The whole text through one splitter gives the same
events joined as its pieces do."""
from __future__ import annotations

from deltafin.workers.toolcalls import json_call, xml_calls

THINK, UNTHINK = "<think>", "</think>"
MINIMAX_START, MINIMAX_END = "<minimax:tool_call>", "</minimax:tool_call>"
BLOCKS = {json_call.START: json_call.END, MINIMAX_START: MINIMAX_END}


def parse_block(start: str, body: str, tools: list | None) -> list[dict]:
    """The calls of one block (between start and its end tag); ValueError when it holds none."""
    if start == MINIMAX_START:
        return xml_calls.parse_minimax(body, tools)
    if json_call.accepts(body):
        return json_call.parse(body, tools)
    if "<function=" in body:
        return xml_calls.parse_coder(body, tools)
    return xml_calls.parse_glm(body, tools)


class ReplySplitter:
    """tools: the request's tools (None: tool calls are not looked for, their text is content)."""

    def __init__(self, tools: list | None):
        self.tools = tools
        self.state = "content"  # or "reasoning", or a block's start tag while inside that block
        self.buf = ""
        self.calls = 0

    def _markers(self) -> list[str]:
        if self.state == "reasoning":
            return [UNTHINK]
        if self.state != "content":
            return [BLOCKS[self.state]]
        return [THINK, *(BLOCKS if self.tools is not None else ())]

    def feed(self, piece: str) -> list[tuple]:
        self.buf += piece
        events: list[tuple] = []
        while True:
            found = [(at, m) for m in self._markers() if (at := self.buf.find(m)) >= 0]
            if not found:
                break
            at, marker = min(found)
            before, self.buf = self.buf[:at], self.buf[at + len(marker):]
            self._transit(marker, before, events)
        if self.state in ("content", "reasoning"):
            keep = self._held()
            self._emit(self.state, self.buf[:len(self.buf) - keep], events)
            self.buf = self.buf[len(self.buf) - keep:]
        return events

    def finish(self) -> list[tuple]:
        """The events of the text still held at the end (a block never closed is content)."""
        events: list[tuple] = []
        if self.state in ("content", "reasoning"):
            self._emit(self.state, self.buf, events)
        else:
            self._emit("content", self.state + self.buf, events)
        self.buf, self.state = "", "content"
        return events

    def _transit(self, marker: str, before: str, events: list) -> None:
        if self.state in ("content", "reasoning"):
            self._emit(self.state, before, events)
            self.state = {THINK: "reasoning", UNTHINK: "content"}.get(marker, marker)
            return
        start = self.state
        self.state = "content"
        try:
            calls = parse_block(start, before, self.tools)
        except (ValueError, TypeError):
            return self._emit("content", start + before + marker, events)
        for call in calls:
            events.append(("tool_call", call))
        self.calls += len(calls)

    def _held(self) -> int:
        """How many characters at the end of buf may begin one of the markers looked for."""
        for n in range(min(len(self.buf), max(map(len, self._markers())) - 1), 0, -1):
            if any(m.startswith(self.buf[-n:]) for m in self._markers()):
                return n
        return 0

    @staticmethod
    def _emit(kind: str, text: str, events: list) -> None:
        if text:
            events.append((kind, text))


def split_reply(text: str, tools: list | None) -> tuple[str | None, str | None, list[dict]]:
    """(reasoning, content, tool calls) of a whole answer; reasoning and content stripped of
    the whitespace around them, None when empty."""
    s = ReplySplitter(tools)
    parts = {"reasoning": "", "content": ""}
    calls = []
    for kind, value in s.feed(text) + s.finish():
        if kind == "tool_call":
            calls.append(value)
        else:
            parts[kind] += value
    return parts["reasoning"].strip() or None, parts["content"].strip() or None, calls
