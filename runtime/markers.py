"""The tokens that structure a chat answer: thinking tags, tool-call tags and sections, gpt-oss's
channels.

Where a family's tokenizer makes one of these a special token, decoding skips it by default; a
chat's answer is decoded keeping these (and no other special token: runtime/tokenizer.py
`Tokenizer.decode(markers=True)`), so workers/toolcalls can split the answer into reasoning,
content and tool calls, and drops every one of them from what it shows.
"""
from __future__ import annotations

THINK, UNTHINK = "<think>", "</think>"

# Tool-call tags written as text by most tokenizers (special tokens in some): Qwen3 / Hermes /
# Qwen3-Coder / GLM-4.5 blocks, GLM-4.5's argument tags, MiniMax-M2's blocks.
TOOL_CALL, TOOL_CALL_END = "<tool_call>", "</tool_call>"
GLM_ARGS = ("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")
MINIMAX_CALL, MINIMAX_CALL_END = "<minimax:tool_call>", "</minimax:tool_call>"

# DeepSeek-V3 / V3.1 / R1: a section of calls, each `<begin>NAME-PART<sep>ARGS-PART<end>`.
DEEPSEEK_CALLS_BEGIN, DEEPSEEK_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DEEPSEEK_CALL_BEGIN, DEEPSEEK_CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
DEEPSEEK_SEP = "<｜tool▁sep｜>"

# Kimi-K2: `<begin>functions.NAME:INDEX<argument begin>JSON<end>` in a section.
KIMI_SECTION_BEGIN, KIMI_SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI_CALL_BEGIN, KIMI_CALL_END = "<|tool_call_begin|>", "<|tool_call_end|>"
KIMI_ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"

# gpt-oss (harmony): `<|start|>ROLE [to=RECIPIENT]<|channel|>CHANNEL [<|constrain|>json]<|message|>
# TEXT` ended by `<|end|>`, `<|call|>` (a tool call) or `<|return|>` (the answer's last message).
START, CHANNEL, CONSTRAIN, MESSAGE = "<|start|>", "<|channel|>", "<|constrain|>", "<|message|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"

# Markers that are never text: what is shown never contains them.
SPECIAL = (DEEPSEEK_CALLS_BEGIN, DEEPSEEK_CALLS_END, DEEPSEEK_CALL_BEGIN, DEEPSEEK_CALL_END, DEEPSEEK_SEP,
           KIMI_SECTION_BEGIN, KIMI_SECTION_END, KIMI_CALL_BEGIN, KIMI_CALL_END, KIMI_ARGUMENT_BEGIN,
           START, CHANNEL, CONSTRAIN, MESSAGE, END, CALL, RETURN)
# Every marker a chat's answer keeps, where the tokenizer makes it a special token.
KEPT = (THINK, UNTHINK, TOOL_CALL, TOOL_CALL_END, *GLM_ARGS, MINIMAX_CALL, MINIMAX_CALL_END, *SPECIAL)
