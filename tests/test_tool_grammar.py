"""tool_choice "required" grammars per tool-call format (workers/toolcalls): each compiled by
llguidance over a tokenizer holding the family's markers as added tokens (as the real ones do),
then walked token by token: a call written the way the family's template writes it is accepted
and parsed back by the project's own reply splitter; a wrong name, arguments off the schema, no
call at all, or a second call where only one is allowed are refused."""
from __future__ import annotations

import json

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
    if fmt == "harmony":  # the recipient may come before the channel; one call per answer
        first = tok.tok.encode(' to=functions.get_time<|channel|>commentary json<|message|>{"zone": "CET"}<|call|>',
                               add_special_tokens=False).ids
        assert _walk(table, both, first)
        assert split_reply("<|start|>assistant" + tok.decode(first, markers=True), [TIME])[2][0]["name"] == "get_time"
    else:
        assert len(calls) == 2, calls
        assert not _walk(table, weather_only, ids)
        assert not _walk(table, one, ids)


REF_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"$ref": "#/$defs/zone"}, "at": {"$ref": "#/$defs/at"}},
    "required": ["zone", "at"], "$defs": {"zone": {"enum": ["CET", "UTC"]},
                                          "at": {"type": "array", "items": {"$ref": "#/$defs/zone"}}}}}}
REF_CALLS = {"json": '<tool_call>\n{"name": "get_time", "arguments": {"zone": "%s", "at": ["UTC"]}}\n</tool_call>',
             "glm": '<tool_call>get_time\n<arg_key>zone</arg_key>\n<arg_value>"%s"</arg_value>\n'
                    '<arg_key>at</arg_key>\n<arg_value>["UTC"]</arg_value>\n</tool_call>'}


@pytest.mark.parametrize("fmt", REF_CALLS)
def test_arguments_schemas_keep_their_refs(tmp_path, fmt):
    template, special, plain, _, _ = FORMATS[fmt]
    tok = build_tokenizer(tmp_path, special, plain, template)
    table = TokenTable(tmp_path, tok.eos_ids, tok.vocab_size)
    grammar = tool_grammar(template, tok.added, [REF_TOOL], parallel=False)
    assert _walk(table, grammar, tok.tok.encode(REF_CALLS[fmt] % "CET", add_special_tokens=False).ids)
    assert not _walk(table, grammar, tok.tok.encode(REF_CALLS[fmt] % "EST", add_special_tokens=False).ids)


def test_a_template_without_a_known_format_is_refused():
    with pytest.raises(ToolChoiceError, match="chat template"):
        tool_grammar("{{ messages }}", {}, [WEATHER], parallel=True)
    with pytest.raises(ToolChoiceError, match="parameters must be"):
        tool_grammar("<tool_call>", {}, [{"type": "function", "function": {"name": "f", "parameters": [1]}}], True)


HERMES = ("{% if tools %}<|im_start|>system\nCall a tool: <tool_call>{\"name\": ..., \"arguments\": ...}"
          "</tool_call>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
          "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "<|im_start|>assistant\n")
SMALL = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                          "days": {"type": "integer", "minimum": 0, "maximum": 9}},
         "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": n, "parameters": SMALL}} for n in ("get_weather", "get_time")]
ASK = [{"role": "user", "content": "weather in Paris?"}]


def _valid(name: str, args: dict, names=("get_weather", "get_time")) -> bool:
    return (name in names and set(args) == {"city", "days"} and isinstance(args["city"], str)
            and len(args["city"]) <= 6 and isinstance(args["days"], int) and 0 <= args["days"] <= 9)


def _openai_checks(url: str) -> None:
    import openai
    oa = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    model = oa.models.list().data[0].id
    base = dict(model=model, messages=ASK, tools=TOOLS, max_tokens=200, temperature=0)
    plain = oa.chat.completions.create(**base).choices[0]
    assert not plain.message.tool_calls  # the random model writes no call of its own
    for choice, names in (("required", ("get_weather", "get_time")),
                          ({"type": "function", "function": {"name": "get_time"}}, ("get_time",))):
        out = oa.chat.completions.create(**base, tool_choice=choice, parallel_tool_calls=False).choices[0]
        calls = out.message.tool_calls
        assert out.finish_reason == "tool_calls" and len(calls) == 1, out
        assert _valid(calls[0].function.name, json.loads(calls[0].function.arguments), names), calls
        chunks = list(oa.chat.completions.create(**{**base, "temperature": 0.8}, tool_choice=choice,
                                                 stream=True, seed=3))
        deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
        assert deltas and all(d.function.name in names for d in deltas if d.function and d.function.name)
        args = "".join(d.function.arguments or "" for d in deltas if d.index == 0)
        assert _valid(deltas[0].function.name, json.loads(args), names), args


def _anthropic_checks(url: str) -> None:
    import anthropic
    ac = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=120)
    tools = [{"name": t["function"]["name"], "input_schema": SMALL} for t in TOOLS]
    for choice, temperature in (({"type": "any"}, 0.0), ({"type": "any", "disable_parallel_tool_use": True}, 1.0)):
        msg = ac.messages.create(model="store", max_tokens=200, messages=ASK, tools=tools, tool_choice=choice,
                                 extra_body={"temperature": temperature})
        uses = [b for b in msg.content if b.type == "tool_use"]
        assert uses and all(_valid(u.name, u.input) for u in uses), msg
        if choice.get("disable_parallel_tool_use"):  # (a random model may call on to max_tokens)
            assert msg.stop_reason == "tool_use" and len(uses) == 1, msg


def test_required_and_named_tool_calls_over_http(tiny_stores, tmp_path_factory):
    """A random tiny model under tool_choice required / a named function / Anthropic's any
    answers with a call of an offered tool whose arguments match its schema, streamed and not;
    a template of no known format is refused with a 400."""
    import openai
    from tests.test_http import http_runtime
    from tests.test_toolcall_tokens import _store_with
    store = _store_with(tiny_stores, tmp_path_factory, "hermes", HERMES)
    with http_runtime(store) as (_, url, _proc):
        _openai_checks(url)
        _anthropic_checks(url)
    with http_runtime(tiny_stores("qwen3_moe")) as (_, url, _proc):
        oa = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        with pytest.raises(openai.BadRequestError, match="tool-call format"):
            oa.chat.completions.create(model=oa.models.list().data[0].id, messages=ASK, tools=TOOLS,
                                       tool_choice="required", max_tokens=20)


def test_thinking_the_prompt_opened_must_close_before_the_call(tmp_path):
    template, special, plain, good, _ = FORMATS["json"]
    tok = build_tokenizer(tmp_path, special, plain, template)
    table = TokenTable(tmp_path, tok.eos_ids, tok.vocab_size)
    opened = tool_grammar(template, tok.added, [WEATHER, TIME], parallel=True, opened=K.THINK)
    call = good.split("</think>", 1)[1]
    assert _walk(table, opened, tok.tok.encode("the user wants Paris</think>" + call, add_special_tokens=False).ids)
    assert not _walk(table, opened, tok.tok.encode(call, add_special_tokens=False).ids)
    assert not _walk(table, opened, tok.tok.encode("Paris</think>sunny", add_special_tokens=False).ids)


def test_the_protocol_takes_tool_choice_only_as_it_can_enforce_it():
    from deltafin.protocol import messages as M
    chat = dict(id=1, messages=ASK, tools=TOOLS)
    for bad, why in ((dict(chat, tool_choice="auto"), "tool_choice must be"),
                     (dict(id=1, prompt="hi", tool_choice="required"), "needs chat messages and tools"),
                     (dict(chat, tool_choice="required", json_schema="{}"), "cannot be asked together"),
                     (dict(id=1, prompt="hi", grammar="start: \"a\"", json_schema="{}"), "cannot be asked together")):
        with pytest.raises(M.BadRequest, match=why):
            M.check_request(M.Generate(**bad), M.RequestLimits(vocab_size=512, max_context=2048))
