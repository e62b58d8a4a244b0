"""A chat answer's text split into reasoning, content and tool calls, as it streams.

Reasoning is the text between `<think>` and `</think>` (Qwen3, DeepSeek-R1 / V3.1, GLM-4.5,
MiniMax-M2, Kimi-K2-Thinking; the text side starts the answer with `<think>` where the chat
template opened it) and gpt-oss's `analysis` channel. Tool calls are the blocks the model's
family writes, recognised by their tags, so no model-specific setting is needed: written as text
(json_call.py: Qwen3 and Hermes JSON; xml_calls.py: GLM-4.5, Qwen3-Coder, MiniMax-M2), looked for
only when the request has tools, a block that does not parse staying in the content as written;
or in special tokens (special_calls.py: DeepSeek-V3 / V3.1, Kimi-K2; harmony.py: gpt-oss's
messages to `functions.NAME`), which the text side keeps in a chat's text (runtime/markers.py).
Special tokens are never content: every one is looked for, a stray one is dropped, and calls in
them are dropped when the request has no tools.

`ReplySplitter` takes text pieces in order and returns events: ("reasoning", text),
("content", text), ("tool_call", {name, arguments}); text that may begin a marker is held back
until the next piece shows whether it does. The whole text through one splitter gives the same
events joined as its pieces do."""
from __future__ import annotations

import re

from deltafin.runtime import markers as K
from deltafin.workers.toolcalls import harmony, json_call, special_calls, xml_calls
from deltafin.workers.toolcalls.grammar import Marks, ToolChoiceError

TEXT_BLOCKS = {json_call.START: json_call.END, K.MINIMAX_CALL: K.MINIMAX_CALL_END}
# special-token sections: they may also end with the answer (its end of sequence right after them)
SECTIONS = {K.DEEPSEEK_CALLS_BEGIN: K.DEEPSEEK_CALLS_END, K.KIMI_SECTION_BEGIN: K.KIMI_SECTION_END}
BLOCKS = {**TEXT_BLOCKS, **SECTIONS}
HEADERS = (K.START, K.CHANNEL)            # a harmony message's header starts with one of these
MESSAGE_ENDS = (K.END, K.CALL, K.RETURN)  # and its text ends with one of these
SPECIAL = re.compile("|".join(map(re.escape, K.SPECIAL)))


def parse_block(start: str, body: str, tools: list | None) -> list[dict]:
    """The calls of one block (between start and its end tag); ValueError when it holds none."""
    if start == K.DEEPSEEK_CALLS_BEGIN:
        return special_calls.parse_deepseek(body, tools)
    if start == K.KIMI_SECTION_BEGIN:
        return special_calls.parse_kimi(body, tools)
    if start == K.MINIMAX_CALL:
        return xml_calls.parse_minimax(body, tools)
    if json_call.accepts(body):
        return json_call.parse(body, tools)
    if "<function=" in body:
        return xml_calls.parse_coder(body, tools)
    return xml_calls.parse_glm(body, tools)


class ReplySplitter:
    """tools: the request's tools (None: tool calls are not looked for, their text is content).

    state: "content" or "reasoning" (text shown), "header" (a harmony header, until its
    `<|message|>`), "call" (a harmony message to a tool), or a block's start tag while inside
    that block."""

    def __init__(self, tools: list | None):
        self.tools = tools
        self.state = "content"
        self.fresh = True  # no text shown since the answer began or the last marker
        self.gap = ""      # the whitespace left out before the last marker (a broken block's own)
        self.buf = ""
        self.header = ""     # the header's first marker, while in "header"
        self.recipient = ""  # the tool a harmony "call" message is for
        self.calls = 0

    def _markers(self) -> list[str]:
        if self.state == "header":
            return [K.MESSAGE]
        if self.state == "call":
            return list(MESSAGE_ENDS)
        if self.state in BLOCKS:
            return [BLOCKS[self.state]]
        if self.state == "reasoning":
            return [K.UNTHINK, *K.SPECIAL]
        return [K.THINK, *K.SPECIAL, *(TEXT_BLOCKS if self.tools is not None else ())]

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
            # held: what may begin a marker, and the whitespace before it (a marker's own)
            shown = len(self.buf) - self._held()
            while shown and self.buf[shown - 1].isspace():
                shown -= 1
            self._text(self.buf[:shown], events)
            self.buf = self.buf[shown:]
        return events

    def finish(self) -> list[tuple]:
        """The events of the text still held at the end: a section or a harmony call the answer
        ended in is parsed, a text block never closed is content, a header is dropped."""
        events: list[tuple] = []
        if self.state in ("content", "reasoning"):
            self._text(self.buf, events)
        elif self.state in TEXT_BLOCKS:
            self._emit("content", self.state + self.buf, events)
        elif self.state != "header":
            self._transit("", self.buf, events)
        self.buf, self.state = "", "content"
        return events

    def _transit(self, marker: str, before: str, events: list) -> None:
        if self.state in ("content", "reasoning"):
            shown = before.rstrip()
            self.gap = before[len(shown):]
            self._text(shown, events)
            self._enter(marker)
            self.fresh = True
        elif self.state == "header":
            self.state, self.recipient = harmony.route(self.header + before)
        elif self.state == "call":
            self.state, self.fresh = "content", True
            self._calls(lambda: [special_calls.call(self.recipient, before)], before, events)
        else:
            start, self.state, self.fresh = self.state, "content", True
            self._calls(lambda: parse_block(start, before, self.tools), start + before + marker, events)

    def _enter(self, marker: str) -> None:
        """The state after a marker met in text; markers of no state here (a message's end, a
        stray special token) are dropped."""
        if marker in (K.THINK, K.UNTHINK):
            self.state = "reasoning" if marker == K.THINK else "content"
        elif marker in BLOCKS:
            self.state = marker
        elif marker in HEADERS:
            self.state, self.header = "header", marker
        elif marker in MESSAGE_ENDS:
            self.state = "content"

    def _calls(self, parse, written: str, events: list) -> None:
        """The calls parse() finds, as events (none without tools); where it finds none, the
        text as written is content (special tokens left out)."""
        try:
            calls = parse()
        except (ValueError, TypeError):
            self.fresh = False  # the text goes on as written, with the whitespace around it
            return self._emit("content", self.gap + SPECIAL.sub("", written), events)
        if self.tools is None:
            return
        for call in calls:
            events.append(("tool_call", call))
        self.calls += len(calls)

    def _held(self) -> int:
        """How many characters at the end of buf may begin one of the markers looked for."""
        markers = self._markers()
        for n in range(min(len(self.buf), max(map(len, markers)) - 1), 0, -1):
            if any(m.startswith(self.buf[-n:]) for m in markers):
                return n
        return 0

    def _text(self, text: str, events: list) -> None:
        """Shown text of the current state: whitespace that opens a run (the answer's start, or
        what follows a marker) is the structure's, left out; the whitespace before a marker too
        (`_transit`), so a whole answer's parts are its streamed events joined."""
        if self.fresh:
            text = text.lstrip()
        if text:
            self.fresh = False
            self._emit(self.state, text, events)

    @staticmethod
    def _emit(kind: str, text: str, events: list) -> None:
        if text:
            events.append((kind, text))


def split_reply(text: str, tools: list | None, strip: bool = True) -> tuple[str | None, str | None, list[dict]]:
    """(reasoning, content, tool calls) of a whole answer; reasoning and content stripped of
    the whitespace around them, None when empty; not strip: as the streamed events join (the
    splitter leaves out the whitespace that opens a run or precedes a marker), None when empty."""
    s = ReplySplitter(tools)
    parts = {"reasoning": "", "content": ""}
    calls = []
    for kind, value in s.feed(text) + s.finish():
        if kind == "tool_call":
            calls.append(value)
        else:
            parts[kind] += value
    if not strip:
        return parts["reasoning"] or None, parts["content"] or None, calls
    return parts["reasoning"].strip() or None, parts["content"].strip() or None, calls


FORMATS = (  # (a marker the template writes for a call, the format's name), most specific first
    (K.CHANNEL, "harmony"), (K.KIMI_SECTION_BEGIN, "kimi"), ("```json", "deepseek_v3"),
    (K.DEEPSEEK_CALLS_BEGIN, "deepseek_v31"), (K.MINIMAX_CALL, "minimax"), ("<arg_key>", "glm"),
    ("<function=", "qwen_coder"), (K.TOOL_CALL, "json"))
WRITERS = {"harmony": harmony.grammar, "kimi": special_calls.kimi_grammar,
           "deepseek_v3": special_calls.deepseek_v3_grammar, "deepseek_v31": special_calls.deepseek_v31_grammar,
           "minimax": xml_calls.minimax_grammar, "glm": xml_calls.glm_grammar,
           "qwen_coder": xml_calls.coder_grammar, "json": json_call.grammar}


def tool_format(template: str | None) -> str:
    """The tool-call format of a chat template; ToolChoiceError where it writes none known."""
    for marker, name in FORMATS:
        if template and marker in template and (name != "deepseek_v3" or K.DEEPSEEK_CALLS_BEGIN in template):
            return name
    raise ToolChoiceError("tool_choice 'required' (or a named tool) is enforced in the model's own "
                          "tool-call format, and this model's chat template writes none deltafin knows")


def tool_grammar(template: str | None, added: dict[str, int], tools: list, parallel: bool,
                 opened: str = "") -> str:
    """The Lark grammar of an answer that calls one or more of `tools` (exactly one where not
    parallel) in the template's format; opened: the marker the answer starts inside of
    (runtime/textside.opening)."""
    if not tools:
        raise ToolChoiceError("tool_choice 'required' needs tools")
    for t in tools:
        if not isinstance(t.get("function"), dict) or not isinstance(t["function"].get("parameters") or {}, dict):
            raise ToolChoiceError("a tool's function.parameters must be a JSON Schema object")
    fmt, mark = tool_format(template), Marks(added)
    lines = WRITERS[fmt](tools, mark, parallel)
    if fmt == "harmony":
        return "\n".join(["start: reasoning? calls", *lines])
    if opened == K.THINK:
        head, think = "reasoning", [mark.until("reasoning", K.UNTHINK)]
    elif template and K.THINK in template:
        head, think = "reasoning?", [f"reasoning: {mark(K.THINK)} thought", mark.until("thought", K.UNTHINK)]
    else:
        head, think = "", []
    return "\n".join([f"start: {head} SPACE? calls", "SPACE: /[ \\n]{1,2}/", *think, *lines])
