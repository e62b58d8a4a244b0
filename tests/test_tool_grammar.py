"""tool_choice "required" grammars per tool-call format (workers/toolcalls): each compiled by
llguidance over a tokenizer holding the family's markers as added tokens (as the real ones do),
then walked token by token: a call written the way the family's template writes it is accepted
and parsed back by the project's own reply splitter; a wrong name, arguments off the schema, no
call at all, or a second call where only one is allowed are refused."""
from __future__ import annotations

import pytest

from deltafin.runtime import markers as K
from deltafin.workers.structured import TokenTable
from deltafin.workers.toolcalls import ToolChoiceError, split_reply, tool_grammar
from tests.test_toolcall_tokens import build_tokenizer

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}
PARIS = {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}

DS = (K.DEEPSEEK_CALLS_BEGIN, K.DEEPSEEK_CALLS_END, K.DEEPSEEK_CALL_BEGIN, K.DEEPSEEK_CALL_END, K.DEEPSEEK_SEP)
KIMI = (K.KIMI_SECTION_BEGIN, K.KIMI_SECTION_END, K.KIMI_CALL_BEGIN, K.KIMI_CALL_END, K.KIMI_ARGUMENT_BEGIN)
HARMONY = (K.START, K.CHANNEL, K.CONSTRAIN, K.MESSAGE, K.END, K.CALL, K.RETURN)
# format: (template text, special tokens, plain added tokens, a good answer (two calls), a bad one)
FORMATS = {
    "json": ("{{ '<tool_call>' }}<think>", [], [K.THINK, K.UNTHINK, K.TOOL_CALL, K.TOOL_CALL_END],
             '<think>hmm</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
             '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
             '<tool_call>\n{"name": "get_weather", "arguments": {"town": "Paris"}}\n</tool_call>'),
    "deepseek_v31": (K.DEEPSEEK_CALLS_BEGIN, list(DS), [],
                     f'{DS[0]}{DS[2]}get_weather{DS[4]}{{"city": "Paris", "days": 2}}{DS[3]}'
                     f'{DS[2]}get_time{DS[4]}{{"zone": "CET"}}{DS[3]}{DS[1]}',
                     f'{DS[0]}{DS[2]}get_weathr{DS[4]}{{"city": "Paris"}}{DS[3]}{DS[1]}'),
    "deepseek_v3": (K.DEEPSEEK_CALLS_BEGIN + "```json", list(DS), [],
                    f'{DS[0]}{DS[2]}function{DS[4]}get_weather\n```json\n{{"city": "Paris", "days": 2}}\n```{DS[3]}'
                    f'\n{DS[2]}function{DS[4]}get_time\n```json\n{{"zone": "CET"}}\n```{DS[3]}{DS[1]}',
                    f'{DS[0]}{DS[2]}function{DS[4]}get_weather\n```json\n{{"city": 5}}\n```{DS[3]}{DS[1]}'),
    "kimi": (K.KIMI_SECTION_BEGIN, list(KIMI), [],
             f'{KIMI[0]}{KIMI[2]}functions.get_weather:0{KIMI[4]}{{"city": "Paris", "days": 2}}{KIMI[3]}'
             f'{KIMI[2]}functions.get_time:1{KIMI[4]}{{"zone": "CET"}}{KIMI[3]}{KIMI[1]}',
             f'{KIMI[0]}{KIMI[2]}functions.get_weather:0{KIMI[4]}{{"days": 2}}{KIMI[3]}{KIMI[1]}'),
    "glm": ("<tool_call><arg_key>", [], [K.TOOL_CALL, K.TOOL_CALL_END, *K.GLM_ARGS],
            '<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days'
            '</arg_key>\n<arg_value>2</arg_value>\n</tool_call>\n<tool_call>get_time\n<arg_key>zone</arg_key>\n'
            '<arg_value>CET</arg_value>\n</tool_call>',
            '<tool_call>get_weather\n<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>'),
    "qwen_coder": ("<tool_call><function=", [], [K.TOOL_CALL, K.TOOL_CALL_END],
                   '<tool_call>\n<function=get_weather>\n<parameter=city>Paris</parameter>\n<parameter=days>2'
                   '</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n<parameter=zone>'
                   'CET</parameter>\n</function>\n</tool_call>',
                   '<tool_call>\n<function=get_weather>\n<parameter=days>two</parameter>\n</function>\n</tool_call>'),
    "minimax": ("<minimax:tool_call>", [], [K.MINIMAX_CALL, K.MINIMAX_CALL_END],
                '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
                '<parameter name="days">2</parameter>\n</invoke>\n<invoke name="get_time">\n'
                '<parameter name="zone">CET</parameter>\n</invoke>\n</minimax:tool_call>',
                '<minimax:tool_call>\n<invoke name="get_weather">\n</invoke>\n</minimax:tool_call>'),
    "harmony": ("<|channel|>", list(HARMONY), [],
                '<|channel|>analysis<|message|>the user wants the weather<|end|><|start|>assistant'
                '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
                '{"city": "Paris", "days": 2}<|call|>',
                '<|channel|>final<|message|>sunny<|return|>'),
}


def _walk(table: TokenTable, grammar: str, ids: list[int]) -> bool:
    """Whether the grammar takes ids one by one (each in the mask first) and may end there."""
    g = table.grammar(grammar=grammar)
    for i in ids:
        if not g.allowed()[i]:
            return False
        g.advance(i)
    return bool(g.allowed()[table.eos[0]]) or g.matcher.is_stopped()


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_call_in_the_format_is_taken_and_anything_else_refused(tmp_path, fmt):
    template, special, plain, good, bad = FORMATS[fmt]
    tok = build_tokenizer(tmp_path, special, plain, template)
    table = TokenTable(tmp_path, tok.eos_ids, tok.vocab_size)
    ids = tok.tok.encode(good, add_special_tokens=False).ids
    assert any(i in tok.added.values() for i in ids)  # the markers are single added tokens
    both = tool_grammar(template, tok.added, [WEATHER, TIME], parallel=True)
    assert _walk(table, both, ids), (fmt, both)
    calls = split_reply(tok.decode(ids, markers=True), [WEATHER, TIME])[2]
    assert calls[0] == PARIS, calls
    assert not _walk(table, both, tok.tok.encode(bad, add_special_tokens=False).ids)
    assert not _walk(table, both, tok.tok.encode("sunny", add_special_tokens=False).ids)
    weather_only = tool_grammar(template, tok.added, [WEATHER], parallel=True)
    one = tool_grammar(template, tok.added, [WEATHER, TIME], parallel=False)
    if fmt != "harmony":  # a harmony answer makes one call
        assert len(calls) == 2, calls
        assert not _walk(table, weather_only, ids)
        assert not _walk(table, one, ids)


def test_a_template_without_a_known_format_is_refused():
    with pytest.raises(ToolChoiceError, match="chat template"):
        tool_grammar("{{ messages }}", {}, [WEATHER], parallel=True)
