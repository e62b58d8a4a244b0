"""Agents' side of the HTTP frontend: tool calling and reasoning on /v1/chat/completions, and
Anthropic's Messages API on /v1/messages, with the official `openai` and `anthropic` clients.

The tiny models are random, so they never write a tool call of their own: the parsers are tested
on text of each family's format, the answers' shapes through the clients' own types (and the
anthropic client's own stream accumulator), and the HTTP round trips against a real supervisor
whose store's chat template renders tools: the prompt the runtime counts is the template's
rendering of the tools and of the tool calls and results in the history, and the answer is the
split of what the model generated, whatever it holds."""
from __future__ import annotations

import json
import shutil

import anthropic
import openai
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message, RawMessageStreamEvent
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import TypeAdapter

from deltafin.client import Client, Generation
from deltafin.runtime.store import Store
from deltafin.runtime.tokenizer import Tokenizer
from deltafin.workers.anthropic_api import MessagesShape, messages_request
from deltafin.workers.openai_api import chat_request
from deltafin.workers.openai_shapes import ChatShape
from deltafin.workers.toolcalls import ReplySplitter, split_reply
from tests.test_http import http_runtime

# A Qwen-style template written for these tests: tools in a system block, tool calls as
# <tool_call> JSON blocks, tool results as <tool_response> user turns.
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n"
    "{% endif %}# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools><|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n{% elif m.role != 'system' %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}\n<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
ANTHROPIC_WEATHER = {"name": "get_weather", "description": "the weather in a city",
                     "input_schema": WEATHER["function"]["parameters"]}
PROMPT = "the quick brown fox"
CALL_TEXT = ('<think>\nthe user wants weather\n</think>\n\nLet me look.\n<tool_call>\n'
             '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')


# -- parsers on text ---------------------------------------------------------------------------------
@pytest.mark.parametrize("text, calls", [
    (CALL_TEXT, [("get_weather", {"city": "Paris", "days": 2}), ("get_weather", {"city": "Rome"})]),
    ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
     "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
     [("get_weather", {"city": "Paris", "days": 3})]),                                   # GLM-4.5
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\n10\n</parameter>\n<parameter=days>\n2\n"
     "</parameter>\n</function>\n</tool_call>", [("get_weather", {"city": "10", "days": 2})]),  # Qwen3-Coder
    ("ok <minimax:tool_call>\n<invoke name=\"get_weather\">\n<parameter name=\"city\">Oslo</parameter>\n"
     "</invoke>\n<invoke name=\"f\">\n<parameter name=\"x\">[1, 2]</parameter>\n</invoke>\n"
     "</minimax:tool_call>", [("get_weather", {"city": "Oslo"}), ("f", {"x": [1, 2]})]),  # MiniMax-M2
])
def test_tool_calls_of_each_family_are_parsed_whole_and_streamed(text, calls):
    whole = split_reply(text, [WEATHER])
    assert [(c["name"], c["arguments"]) for c in whole[2]] == calls
    s, events = ReplySplitter([WEATHER]), []
    for ch in text:  # one character per piece: markers split across pieces
        events += s.feed(ch)
    events += s.finish()
    assert [(v["name"], v["arguments"]) for k, v in events if k == "tool_call"] == calls
    for kind, i in (("reasoning", 0), ("content", 1)):
        assert ("".join(v for k, v in events if k == kind).strip() or None) == whole[i]


def test_reasoning_and_text_apart_from_tool_calls():
    assert split_reply(CALL_TEXT, [WEATHER])[:2] == ("the user wants weather", "Let me look.")
    # without tools a tool call's text is content; a broken block stays content as written
    assert split_reply(CALL_TEXT, None)[1].startswith("Let me look.\n<tool_call>")
    broken = "a <tool_call>{not json}</tool_call> b"
    assert split_reply(broken, [WEATHER]) == (None, broken, [])
    assert split_reply("plain <b>text</b> <thi", [WEATHER]) == (None, "plain <b>text</b> <thi", [])
    assert split_reply("<think>cut short", None) == ("cut short", None, [])


def _gen(text: str, reason: str = "stop", stats=None) -> Generation:
    return Generation(text, list(range(7)), reason, stats or {"prompt_tokens": 5})


def test_openai_shapes_are_what_the_openai_client_reads():
    _, p = chat_request({"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]})
    r = ChatCompletion.model_validate(ChatShape("m", p).whole(_gen(CALL_TEXT)))
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content == "Let me look."
    assert msg.model_extra["reasoning_content"] == "the user wants weather"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [
        ("get_weather", {"city": "Paris", "days": 2}), ("get_weather", {"city": "Rome"})]
    shape, chunks = ChatShape("m", {**p, "parallel_tool_calls": False}), []
    parts = shape.start() + [x for ch in CALL_TEXT for x in shape.piece(ch)] + shape.end(_gen(CALL_TEXT))
    for part in parts[:-1]:
        chunks.append(ChatCompletionChunk.model_validate_json(part.removeprefix("data: ")))
    assert parts[-1] == "data: [DONE]\n\n"
    deltas = [c.choices[0].delta for c in chunks]
    calls = [t for d in deltas for t in d.tool_calls or []]
    assert [(t.index, t.function.name) for t in calls] == [(0, "get_weather")]  # not parallel: one
    assert "".join(d.content or "" for d in deltas).strip() == "Let me look."
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas).strip() == "the user wants weather"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def _accumulated(shape: MessagesShape, text: str, gen: Generation) -> Message:
    """The stream's events as the anthropic client reads and accumulates them."""
    parts = shape.start() + [x for ch in text for x in shape.piece(ch)] + shape.end(gen)
    adapter, snapshot = TypeAdapter(RawMessageStreamEvent), None
    for part in parts:
        name, data = part.split("\n")[:2]
        event = adapter.validate_python(json.loads(data.removeprefix("data: ")))
        assert name == f"event: {event.type}"
        snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs={})
    return snapshot


def test_anthropic_shapes_are_what_the_anthropic_client_reads():
    _, p = messages_request({"max_tokens": 9, "messages": [{"role": "user", "content": "hi"}],
                             "tools": [ANTHROPIC_WEATHER]})
    gen = _gen(CALL_TEXT)
    whole = Message.model_validate(MessagesShape("m", p).whole(gen))
    assert [b.type for b in whole.content] == ["thinking", "text", "tool_use", "tool_use"]
    assert whole.stop_reason == "tool_use" and whole.content[2].input == {"city": "Paris", "days": 2}
    streamed = _accumulated(MessagesShape("m", p), CALL_TEXT, gen)
    assert [b.model_dump(exclude={"id"}) for b in streamed.content] == [
        b.model_dump(exclude={"id"}) for b in whole.content]
    assert streamed.stop_reason == "tool_use" and streamed.usage.output_tokens == 7
    stopped = _gen("abc", stats={"prompt_tokens": 5, "stop_string": "xy"})
    assert MessagesShape("m", p).whole(stopped)["stop_sequence"] == "xy"
    assert MessagesShape("m", p).whole(_gen("abc", "length"))["stop_reason"] == "max_tokens"


# -- real supervisor, real HTTP ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def tool_store(tiny_stores, tmp_path_factory):
    """A tiny store whose chat template renders tools (a Qwen-style one)."""
    store = tmp_path_factory.mktemp("agents") / "store"
    shutil.copytree(tiny_stores("qwen3_moe"), store)
    path = store / "tokenizer" / "tokenizer_config.json"
    tc = json.loads(path.read_text())
    tc["chat_template"] = TOOL_TEMPLATE
    path.write_text(json.dumps(tc))
    return store


def _tokens(store, messages, tools=None) -> int:
    s = Store(store)
    return len(Tokenizer(s.tokenizer_dir, s.config).encode(messages, chat=True, tools=tools))


HISTORY = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "weather in Paris?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
RENDERED = [{**m, "content": m["content"] or ""} for m in HISTORY]
RENDERED[2] = {**RENDERED[2], "tool_calls": [{"id": "call_1", "type": "function", "function": {
    "name": "get_weather", "arguments": {"city": "Paris"}}}]}


def test_openai_tool_round_trip(tool_store):
    with http_runtime(tool_store) as (endpoint, url, _):
        with Client(endpoint, timeout=60) as c:
            ref = c.generate(RENDERED, max_tokens=12, tools=[WEATHER])
        oa = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        model = oa.models.list().data[0].id
        r = oa.chat.completions.create(model=model, messages=HISTORY, tools=[WEATHER], max_tokens=12,
                                       temperature=0)
        assert r.usage.prompt_tokens == _tokens(tool_store, RENDERED, [WEATHER]) == ref.stats["prompt_tokens"]
        assert r.usage.prompt_tokens > _tokens(tool_store, RENDERED)  # the tools are in the prompt
        reasoning, content, calls = split_reply(ref.text, [WEATHER])
        msg = r.choices[0].message
        assert (msg.content, msg.model_extra.get("reasoning_content")) == (content, reasoning)
        assert [t.function.name for t in msg.tool_calls or []] == [c["name"] for c in calls]
        assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")

        chunks = list(oa.chat.completions.create(model=model, messages=HISTORY, tools=[WEATHER],
                                                 tool_choice="auto", max_tokens=12, temperature=0,
                                                 stream=True))
        deltas = [ch.choices[0].delta for ch in chunks]
        assert ("".join(d.content or "" for d in deltas).strip() or None) == content
        assert [t.function.name for d in deltas for t in d.tool_calls or []] == [c["name"] for c in calls]
        none = oa.chat.completions.create(model=model, messages=HISTORY, tools=[WEATHER], tool_choice="none",
                                          max_tokens=1, temperature=0)
        assert none.usage.prompt_tokens == _tokens(tool_store, RENDERED)
        with pytest.raises(openai.BadRequestError, match="tool_choice"):
            oa.chat.completions.create(model=model, messages=HISTORY, tools=[WEATHER], max_tokens=1,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})


GREEDY = {"temperature": 0}  # the anthropic client has no temperature argument (the API has it)


def test_anthropic_messages_round_trip(tool_store):
    with http_runtime(tool_store) as (endpoint, url, _):
        history = [{"role": "user", "content": "weather in Paris?"},
                   {"role": "assistant", "content": [{"type": "tool_use", "id": "call_1", "name": "get_weather",
                                                      "input": {"city": "Paris"}}]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1",
                                                 "content": "sunny, 21 C"}]}]
        with Client(endpoint, timeout=60) as c:
            ref = c.generate(RENDERED, max_tokens=12, tools=[WEATHER])
            plain = c.generate([{"role": "user", "content": "hi"}], max_tokens=16)
        ac = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=120)
        model = openai.OpenAI(base_url=f"{url}/v1", api_key="unused").models.list().data[0].id
        r = ac.messages.create(model=model, max_tokens=12, system="be brief", messages=history,
                               tools=[ANTHROPIC_WEATHER], extra_body=GREEDY)
        assert r.usage.input_tokens == ref.stats["prompt_tokens"]  # the same rendering as OpenAI's
        assert r.usage.output_tokens == len(ref.token_ids)
        reasoning, content, calls = split_reply(ref.text, [WEATHER])
        assert [b.type for b in r.content] == (["thinking"] * bool(reasoning) + ["text"] * bool(content)
                                               + ["tool_use"] * len(calls))
        assert r.stop_reason in ("end_turn", "max_tokens", "tool_use")
        with ac.messages.stream(model=model, max_tokens=12, system="be brief", messages=history,
                                tools=[ANTHROPIC_WEATHER], extra_body=GREEDY) as s:
            streamed = s.get_final_message()
        assert [b.model_dump(exclude={"id"}) for b in streamed.content] == [
            b.model_dump(exclude={"id"}) for b in r.content]
        assert streamed.stop_reason == r.stop_reason

        text = plain.text
        k = next(k for k in range(1, len(text) - 1) if text.find(text[k:k + 2]) == k)
        r = ac.messages.create(model=model, max_tokens=16, messages=[{"role": "user", "content": "hi"}],
                               stop_sequences=[text[k:k + 2]], extra_body=GREEDY)
        assert (r.stop_reason, r.stop_sequence) == ("stop_sequence", text[k:k + 2])
        assert "".join(b.text for b in r.content if b.type == "text") == text[:k].strip()
        with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
            ac.messages.create(model=model, max_tokens=None, messages=history)


def test_logprobs_match_the_teacher_forced_logits(tiny_stores):
    """Each generated token's log-probability (and the top ones') as the runtime's logits request
    gives them for the prompt plus the answer, log-softmaxed; greedy picks the most likely."""
    import numpy as np
    store = tiny_stores("qwen3_moe")
    s = Store(store)
    prompt_ids = Tokenizer(s.tokenizer_dir, s.config).encode(PROMPT)
    with http_runtime(store) as (endpoint, url, _):
        oa = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        model = oa.models.list().data[0].id
        r = oa.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3)
        lp = r.choices[0].logprobs
        with Client(endpoint, timeout=60) as c:
            ids = c.generate(PROMPT, max_tokens=8).token_ids
            logits = c.logits(prompt_ids + ids[:-1]).astype(np.float64)
        ref = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
            - logits.max(-1, keepdims=True)
        ref = ref[len(prompt_ids) - 1:]
        assert len(lp.token_logprobs) == len(ids) == 8
        for i, tok in enumerate(ids):
            assert lp.token_logprobs[i] == pytest.approx(ref[i, tok], abs=1e-3)
            assert lp.token_logprobs[i] == max(lp.top_logprobs[i].values())  # greedy: the most likely
            top3 = sorted(ref[i])[::-1][:3]  # (the legacy map has one entry per distinct text)
            assert all(any(v == pytest.approx(t, abs=1e-3) for t in top3) for v in lp.top_logprobs[i].values())
        chunks = list(oa.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                            logprobs=3, stream=True))
        streamed = [x for ch in chunks if ch.choices[0].logprobs for x in ch.choices[0].logprobs.token_logprobs]
        assert streamed == lp.token_logprobs

        msgs = [{"role": "user", "content": "hi there"}]
        r = oa.chat.completions.create(model=model, messages=msgs, max_tokens=6, temperature=0,
                                       logprobs=True, top_logprobs=2)
        content = r.choices[0].logprobs.content
        assert len(content) == r.usage.completion_tokens
        assert all(e.logprob == e.top_logprobs[0].logprob and len(e.top_logprobs) == 2 for e in content)
        chunks = list(oa.chat.completions.create(model=model, messages=msgs, max_tokens=6, temperature=0,
                                                 logprobs=True, stream=True))
        streamed = [e for ch in chunks if ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
        assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
        assert all(e.top_logprobs == [] for e in streamed)
