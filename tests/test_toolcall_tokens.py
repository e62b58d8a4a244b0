"""Tool calls and reasoning written in special tokens (DeepSeek-V3 / V3.1, Kimi-K2, gpt-oss's
harmony channels), and thinking the chat template opens, from token ids to the client.

A byte-level tokenizer is built here with each family's markers as special tokens (as the real
tokenizers have them), so an answer's ids hold the markers as single tokens that decoding
skips; the runtime's text side must keep exactly those in a chat's text for the splitter, and
what is shown must never contain one. End to end, a tiny store's template opens the thinking
and a tiny store's tokenizer is rewritten so the model's own greedy answer is a harmony tool
call, then read with the official `openai` client, streamed and not."""
from __future__ import annotations

import json
import shutil

import anthropic
import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from deltafin.client import Client
from deltafin.protocol import messages as M
from deltafin.runtime import markers as K
from deltafin.runtime.store import Store
from deltafin.runtime.textside import TextSide, opening
from deltafin.runtime.tokenizer import Tokenizer
from deltafin.workers.openai_api import chat_request
from deltafin.workers.openai_shapes import ChatShape
from deltafin.workers.toolcalls import ReplySplitter, split_reply
from tests.test_http import http_runtime

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
CORPUS = ["the user wants the weather in Paris and Rome", 'get_weather {"city": "Paris", "days": 2}',
          "function json ``` assistant analysis final commentary to=functions.get_weather",
          "Let me look it up. Sure, here it is: sunny."]
EOS = "<|im_end|>"
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
PARIS, ROME = ("get_weather", {"city": "Paris", "days": 2}), ("get_weather", {"city": "Rome"})
DS_V3 = ('Let me look.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n'
         '{"city": "Paris", "days": 2}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>'
         'get_weather\n```json\n{"city": "Rome"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
CASES = {
    "deepseek_v3": (DS_V3, None, "Let me look.", [PARIS, ROME]),
    "deepseek_v3.1": ('<think>the user wants the weather</think>Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>'
                      'get_weather<｜tool▁sep｜>{"city": "Paris", "days": 2}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
                      "the user wants the weather", "Sure.", [PARIS]),
    "kimi_k2": ('Let me look.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0'
                '<|tool_call_argument_begin|>{"city": "Paris", "days": 2}<|tool_call_end|><|tool_call_begin|>'
                'functions.get_weather:1<|tool_call_argument_begin|>{"city": "Rome"}<|tool_call_end|>'
                '<|tool_calls_section_end|>', None, "Let me look.", [PARIS, ROME]),
    "glm45_special_tags": ('<think>the user wants the weather</think><tool_call>get_weather<arg_key>city</arg_key>'
                           '<arg_value>Paris</arg_value><arg_key>days</arg_key><arg_value>2</arg_value></tool_call>',
                           "the user wants the weather", None, [PARIS]),
    "gpt_oss_call": ('<|channel|>analysis<|message|>the user wants the weather<|end|><|start|>assistant'
                     '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
                     '{"city": "Paris", "days": 2}<|call|>', "the user wants the weather", None, [PARIS]),
    "gpt_oss_final": ('<|channel|>analysis<|message|>the user wants the weather<|end|><|start|>assistant'
                      '<|channel|>final<|message|>Sure, here it is: sunny.<|return|>',
                      "the user wants the weather", "Sure, here it is: sunny.", []),
    "gpt_oss_recipient_first": ('<|start|>assistant to=functions.get_weather<|channel|>commentary json'
                                '<|message|>{"city": "Rome"}', None, None, [ROME]),
}


def build_tokenizer(out, special: list[str], plain: list[str] = (), template: str = TEMPLATE) -> Tokenizer:
    """A byte-level BPE tokenizer with `special` as special tokens and `plain` as added text tokens
    (as Qwen's `<think>` is), saved as a store's tokenizer files and loaded by the runtime."""
    from tokenizers import Tokenizer as HF, decoders, models, pre_tokenizers, trainers
    hf = HF(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(CORPUS * 3, trainers.BpeTrainer(
        vocab_size=400, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf.add_special_tokens(["<|im_start|>", EOS, *special])
    hf.add_tokens(list(plain))
    out.mkdir(parents=True, exist_ok=True)
    hf.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS, "chat_template": template}))
    return Tokenizer(out)


def _chat_text(tok: Tokenizer, ids: list[int], opened: str = "", chat: bool = True) -> tuple[list, str]:
    """(streamed pieces, final text) of ids through a request's text side, one token at a time."""
    req = M.Generate(id=1, messages=[{"role": "user", "content": "hi"}] if chat else None,
                     prompt=None if chat else "hi", stream=True)
    side, pieces = TextSide(tok, req, 3, opened), []
    for i, t in enumerate(ids):
        out = side.accept(M.Token(id=1, index=i, token_id=t, text=""))
        pieces += [out.text] if out else []
    last = side.flush()
    pieces += [last.text] if last else []
    return pieces, side.done(M.Done(id=1, text="", token_ids=ids, finish_reason="stop", stats={})).text


def _split_streamed(pieces: list[str], tools) -> tuple:
    s, events = ReplySplitter(tools), []
    for p in pieces:
        events += s.feed(p)
    events += s.finish()
    joined = {k: "".join(v for kind, v in events if kind == k).strip() or None for k in ("reasoning", "content")}
    return joined["reasoning"], joined["content"], [v for kind, v in events if kind == "tool_call"]


def _no_markers(*texts) -> bool:
    return not any(m in (t or "") for t in texts for m in K.SPECIAL)


@pytest.mark.parametrize("family", CASES)
def test_special_token_calls_survive_detokenizing_and_are_parsed(tmp_path, family):
    """The answer's ids (markers as single special tokens) through the text side: a chat's text
    keeps the markers, the splitter finds reasoning, content and calls, whole, one token's piece
    at a time and one character at a time, and neither content nor reasoning holds a marker; a
    completion's text (not a chat) holds none either."""
    text, reasoning, content, calls = CASES[family]
    tok = build_tokenizer(tmp_path, list(K.KEPT))
    ids = tok.tok.encode(text, add_special_tokens=False).ids
    assert sum(i in tok.markers for i in ids) == sum(text.count(m) for m in K.KEPT)  # one token each
    pieces, whole = _chat_text(tok, ids)
    assert whole == text
    expected = (reasoning, content, [{"name": n, "arguments": a} for n, a in calls])
    assert split_reply(whole, [WEATHER]) == expected
    assert _split_streamed(pieces, [WEATHER]) == expected
    assert _split_streamed(list(whole), [WEATHER]) == expected
    assert _no_markers(*split_reply(whole, None)[:2])  # without tools: no calls, no markers shown
    assert split_reply(whole, None)[2] == []
    assert _no_markers(_chat_text(tok, ids, chat=False)[1])


def test_stray_and_broken_special_tokens_are_never_shown():
    """A special token out of place is dropped; a section that does not parse is content
    without its special tokens."""
    broken = "a<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{oops<｜tool▁call▁end｜>b"
    reasoning, content, calls = split_reply(broken, [WEATHER])
    assert calls == [] and _no_markers(content) and content.startswith("aget_weather{oops")
    assert split_reply("x<|message|>y<|constrain|>z", [WEATHER]) == (None, "xyz", [])


def test_only_the_answers_markers_are_kept(tmp_path):
    """Special tokens other than the markers (here the end of turn) are skipped in a chat's
    text as in any other."""
    tok = build_tokenizer(tmp_path, [*K.SPECIAL])
    ids = tok.tok.encode(f"hi{EOS}<|im_start|>there<|end|>", add_special_tokens=False).ids
    assert tok.decode(ids, markers=True) == "hithere<|end|>" and tok.decode(ids) == "hithere"


def test_logprob_entries_name_special_tokens_by_their_text(tmp_path):
    """A log-probability entry's `token` (and its top tokens') is the token's own text, special
    tokens included, while the answer's text skips them."""
    tok = build_tokenizer(tmp_path, list(K.KEPT))
    call, eos = tok.tok.token_to_id("<|tool_call_begin|>"), tok.tok.token_to_id(EOS)
    hi = tok.tok.encode("hi", add_special_tokens=False).ids
    req = M.Generate(id=1, prompt="x", stream=True, logprobs=2)
    side = TextSide(tok, req, 1)
    out = [side.accept(M.Token(id=1, index=i, token_id=t, text="", logprobs=[
        {"token_id": t, "logprob": -0.5, "top": [[t, -0.5], [eos, -1.0]]}])) for i, t in enumerate(hi + [call])]
    entries = [e for o in out if o for e in o.logprobs] + (side.flush().logprobs or [])
    assert [e["token"] for e in entries][-1] == "<|tool_call_begin|>"
    assert all(e["top"][1][2] == EOS for e in entries)
    assert "".join(o.text for o in out if o) == "hi"


THINKING_TEMPLATE = TEMPLATE + "<think>\n"


@pytest.mark.parametrize("special", [False, True])
def test_thinking_the_template_opened_is_reasoning(tmp_path, special):
    """The generation prompt ends with `<think>`, so the answer holds only `</think>`: the text
    starts with `<think>` and reasoning_content is split out, streamed and not (a text token as
    Qwen3's, or a special token)."""
    tags = [K.THINK, K.UNTHINK]
    tok = build_tokenizer(tmp_path, tags if special else [], [] if special else tags, THINKING_TEMPLATE)
    msgs = [{"role": "user", "content": "weather?"}]
    req = M.Generate(id=1, messages=msgs)
    assert opening(tok, req, tok.encode(msgs, chat=True)) == K.THINK
    assert opening(tok, M.Generate(id=1, messages=msgs), tok.encode("plain", chat=False)) == ""
    ids = tok.tok.encode("the user wants the weather</think>\n\nSure, here it is: sunny.", add_special_tokens=False).ids
    pieces, whole = _chat_text(tok, ids, opening(tok, req, tok.encode(msgs, chat=True)))
    _, p = chat_request({"messages": msgs})
    r = ChatCompletion.model_validate(ChatShape("m", p).whole(_gen(whole, ids)))
    assert r.choices[0].message.content == "Sure, here it is: sunny."
    assert r.choices[0].message.model_extra["reasoning_content"] == "the user wants the weather"
    shape = ChatShape("m", p)
    parts = shape.start() + [x for piece in pieces for x in shape.piece(piece)] + shape.end(_gen(whole, ids))
    deltas = [ChatCompletionChunk.model_validate_json(x.removeprefix("data: ")).choices[0].delta for x in parts[:-1]]
    assert "".join(d.content or "" for d in deltas).strip() == "Sure, here it is: sunny."
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas).strip() == "the user wants the weather"


def _gen(text: str, ids: list):
    from deltafin.client import Generation
    return Generation(text, ids, "stop", {"prompt_tokens": 5})


# -- real supervisor, real HTTP ----------------------------------------------------------------------
def _store_with(tiny_stores, tmp_path_factory, name: str, template: str):
    store = tmp_path_factory.mktemp(name) / "store"
    shutil.copytree(tiny_stores("qwen3_moe"), store)
    path = store / "tokenizer" / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "chat_template": template}))
    return store


def _clients(url: str):
    oa = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    return oa, oa.models.list().data[0].id


MSGS = [{"role": "user", "content": "weather in Paris?"}]


def test_http_answer_inside_the_thinking_the_template_opened(tiny_stores, tmp_path_factory):
    """A store whose generation prompt ends with `<think>`: the runtime's chat text starts with it,
    and the OpenAI endpoint returns what the model wrote as reasoning_content (no `</think>`
    follows in a random model's few tokens), streamed and not, with no content."""
    store = _store_with(tiny_stores, tmp_path_factory, "thinking", THINKING_TEMPLATE)
    with http_runtime(store) as (endpoint, url, _):
        with Client(endpoint, timeout=60) as c:
            ref = c.generate(MSGS, max_tokens=10)
        reasoning, content, _ = split_reply(ref.text, None)
        assert ref.text.startswith(K.THINK) and reasoning
        oa, model = _clients(url)
        msg = oa.chat.completions.create(model=model, messages=MSGS, max_tokens=10, temperature=0).choices[0].message
        assert (msg.model_extra.get("reasoning_content"), msg.content) == (reasoning, content)
        deltas = [ch.choices[0].delta for ch in oa.chat.completions.create(
            model=model, messages=MSGS, max_tokens=10, temperature=0, stream=True)]
        assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas).strip() == reasoning
        assert ("".join(d.content or "" for d in deltas).strip() or None) == content


def _byte_level(text: str) -> str:
    """text as a byte-level BPE vocabulary spells it (GPT-2's printable stand-ins for bytes)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in keep}
    table.update({b: chr(256 + n) for n, b in enumerate(b for b in range(256) if b not in table)})
    return "".join(table[b] for b in text.encode())


HARMONY = [(K.CHANNEL, True), ("commentary to=functions.get_weather ", False), (K.MESSAGE, True),
           ('{"city": "Paris"}', False), (K.CALL, True)]


def _renamed(tj: dict, renames: dict) -> dict:
    """tokenizer.json's content with vocabulary ids renamed: id -> (text, special); merges that
    made or used a renamed entry go."""
    vocab = tj["model"]["vocab"]
    spelled = {i: s for s, i in vocab.items()}
    old = {spelled[i] for i in renames}
    for i, (text, special) in renames.items():
        del vocab[spelled[i]]
        vocab[text if special else _byte_level(text)] = i
        if special:
            tj["added_tokens"].append({"id": i, "content": text, "single_word": False, "lstrip": False,
                                       "rstrip": False, "normalized": False, "special": True})
    tj["model"]["merges"] = [m for m in tj["model"]["merges"]
                             if not ({*m} & old or "".join(m) in old)]
    return tj


@pytest.fixture(scope="module")
def harmony_store(tiny_stores, tmp_path_factory):
    """A tiny store whose tokenizer spells the model's own greedy answer to a prompt as a harmony
    call of get_weather: the answer's first five ids (distinct, none in the prompt, all in the
    vocabulary) become `<|channel|>`, a header, `<|message|>`, the arguments and `<|call|>`
    (an end of sequence, as in gpt-oss); the prompt's ids stay what they were."""
    store = _store_with(tiny_stores, tmp_path_factory, "harmony", TEMPLATE)
    tdir = store / "tokenizer"
    original = json.loads((tdir / "tokenizer.json").read_text())
    prompts = [[{"role": "user", "content": w}] for w in ("weather in Paris?", "hi", "weather?", "tell me",
                                                           "Paris", "what now", "go on", "the sky")]
    with http_runtime(store) as (endpoint, _, _p), Client(endpoint, timeout=60) as c:
        answers = [c.generate(m, max_tokens=5).token_ids for m in prompts]
    for msgs, ids in zip(prompts, answers):
        tok = Tokenizer(tdir, Store(store).config)
        before = tok.encode(msgs, chat=True)
        if len(set(ids)) < 5 or set(ids) & set(before) or not all(i < len(original["model"]["vocab"]) for i in ids):
            continue
        tj = _renamed(json.loads(json.dumps(original)), {i: r for i, r in zip(ids, HARMONY)})
        (tdir / "tokenizer.json").write_text(json.dumps(tj))
        gen = json.loads((tdir / "generation_config.json").read_text())
        (tdir / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [gen["eos_token_id"], ids[4]]}))
        if Tokenizer(tdir, Store(store).config).encode(msgs, chat=True) == before:
            return store, msgs
        (tdir / "tokenizer.json").write_text(json.dumps(original))
        (tdir / "generation_config.json").write_text(json.dumps(gen))
    pytest.fail(f"no prompt's greedy answer can be spelled as a harmony call: {answers}")


def test_http_tool_call_in_harmony_special_tokens(harmony_store):
    """The model's answer is `<|channel|>commentary to=functions.get_weather <|message|>{"city":
    "Paris"}` then `<|call|>` (end of sequence): the openai client gets one get_weather call and no
    content, streamed and not; without tools the call is left out and nothing of it is shown; the
    anthropic client gets it as a tool_use block."""
    store, msgs = harmony_store
    with http_runtime(store) as (endpoint, url, _):
        with Client(endpoint, timeout=60) as c:
            ref = c.generate(msgs, max_tokens=8)
        assert ref.text == "".join(t for t, _ in HARMONY[:4]) and ref.finish_reason == "stop"
        oa, model = _clients(url)
        r = oa.chat.completions.create(model=model, messages=msgs, tools=[WEATHER], max_tokens=8, temperature=0)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
        assert [(t.function.name, json.loads(t.function.arguments)) for t in msg.tool_calls] == [
            ("get_weather", {"city": "Paris"})]
        chunks = list(oa.chat.completions.create(model=model, messages=msgs, tools=[WEATHER], max_tokens=8,
                                                 temperature=0, stream=True))
        calls = [t for ch in chunks for t in ch.choices[0].delta.tool_calls or []]
        assert [(t.function.name, json.loads(t.function.arguments)) for t in calls] == [
            ("get_weather", {"city": "Paris"})]
        assert not "".join(ch.choices[0].delta.content or "" for ch in chunks)
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        none = oa.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0)
        assert none.choices[0].message.content is None and not none.choices[0].message.tool_calls
        ac = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=120)
        tool = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}
        m = ac.messages.create(model=model, max_tokens=8, messages=msgs, tools=[tool], extra_body={"temperature": 0})
        assert [(b.type, b.name, b.input) for b in m.content] == [("tool_use", "get_weather", {"city": "Paris"})]
        assert m.stop_reason == "tool_use"
