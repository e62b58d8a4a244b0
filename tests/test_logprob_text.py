"""What a log-probability entry says of its token against the text the client gets: a token's
own bytes (a token holding part of a character has text U+FFFD, but bytes that spell the
character with its neighbours'), and where its text begins (text_offset), the same streamed or
not; and a whole chat answer's content equals its streamed deltas joined."""
from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from deltafin.protocol import messages as M
from deltafin.runtime.textside import TextSide
from deltafin.runtime.tokenizer import Tokenizer
from deltafin.workers.openai_shapes import completion_logprobs
from deltafin.workers.toolcalls import ReplySplitter, split_reply

TEXT = "héllo wörld, ünïcödé çà et là — 日本語のテキスト"


def _save(tok: HFTokenizer, path) -> Tokenizer:
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    return Tokenizer(path)


@pytest.fixture
def byte_level(tmp_path) -> Tokenizer:
    """A byte-level BPE (GPT-2's spelling, as Qwen, DeepSeek, Kimi and SmolLM2 use), trained
    with few merges, so most non-ASCII characters take several tokens."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world and more words"] * 10, trainer)
    return _save(tok, tmp_path / "bl")


def test_byte_level_tokens_spell_their_bytes(byte_level):
    ids = byte_level.encode(TEXT)
    split = [i for i in ids if byte_level.token_text(i) == "\ufffd"]
    assert split, "the text should have characters split over several tokens"
    assert b"".join(byte_level.token_bytes(i) for i in ids) == TEXT.encode("utf-8")
    assert all(len(byte_level.token_bytes(i)) == 1 for i in split)
    eos = byte_level.tok.token_to_id("<eos>")
    assert byte_level.token_bytes(eos) == b"<eos>"  # an added token: its text


def test_byte_fallback_tokens_spell_their_bytes(tmp_path):
    """sentencepiece's spelling (Llama, Mistral): "<0xNN>" entries for bytes, "▁" for a space."""
    vocab = {"<unk>": 0, "<0xC3>": 1, "<0xA9>": 2, "\u2581a": 3, "b": 4}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    t = _save(tok, tmp_path / "bf")
    assert [t.token_bytes(i) for i in (1, 2, 3, 4)] == [b"\xc3", b"\xa9", b" a", b"b"]
    assert t.token_text(1) == "\ufffd"


def _side_entries(tokenizer: Tokenizer, ids: list[int], stream: bool):
    """(text, logprob entries as sent: streamed messages' or done's) of a TextSide fed ids."""
    req = M.Generate(id=1, prompt="x", stream=stream, logprobs=1)
    side = TextSide(tokenizer, req, 3)
    sent = []
    for n, i in enumerate(ids):
        out = side.accept(M.Token(id=1, index=n, token_id=i, text="", logprobs=[{"token_id": i, "logprob": -1.0, "top": [[i, -1.0]]}]))
        sent += [out] if out is not None else []
    rest = side.flush()
    sent += [rest] if rest is not None else []
    done = side.done(M.Done(id=1, text="", token_ids=ids, finish_reason="length", stats={"prompt_tokens": 3}))
    entries = [e for m in sent for e in m.logprobs] if stream else done.logprobs
    return done.text, entries


def test_text_offsets_point_into_the_text_streamed_or_not(byte_level):
    eos = byte_level.tok.token_to_id("<eos>")
    ids = byte_level.encode(TEXT)
    ids = ids[:5] + [eos] + ids[5:]  # a special token: its name is in no text
    text, whole = _side_entries(byte_level, ids, stream=False)
    _, streamed = _side_entries(byte_level, ids, stream=True)
    assert text == TEXT
    offsets = completion_logprobs(whole)["text_offset"]
    assert offsets == completion_logprobs(streamed)["text_offset"]
    assert offsets == sorted(offsets) and offsets[-1] < len(text)
    for e, at in zip(whole, offsets):  # a token whose text is whole is found where it says
        if "\ufffd" not in e["token"] and e["token_id"] != eos:
            assert text[at:at + len(e["token"])] == e["token"], (e, at)
    assert b"".join(bytes(e["bytes"]) for e in whole if e["token_id"] != eos) == TEXT.encode("utf-8")


@pytest.mark.parametrize("text", [
    "  indented line\n    more\n",
    "<think>\nreasoning here\n</think>\n\nThe answer.\n",
    "<think>\nthe user wants weather\n</think>\n\nLet me look.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "a <tool_call>{not json}</tool_call> b ",
    "ends with spaces   ",
])
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_a_whole_chat_answer_is_its_streamed_deltas_joined(text, step):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    s = ReplySplitter(tools)
    events = [ev for at in range(0, len(text), step) for ev in s.feed(text[at:at + step])] + s.finish()
    streamed = {k: "".join(v for kind, v in events if kind == k) or None for k in ("reasoning", "content")}
    reasoning, content, calls = split_reply(text, tools, strip=False)
    assert (reasoning, content) == (streamed["reasoning"], streamed["content"])
    assert len(calls) == sum(kind == "tool_call" for kind, _ in events)
    if "<" not in text:  # no structure: the text as the model wrote it, its whitespace at the end too
        assert content == text.lstrip()
