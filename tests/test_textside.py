"""Text outside the MLX process: the supervisor tokenizes and detokenizes, compute runs
token ids only and never loads a tokenizer; a stop string ends a request for the client at once
and cancels it in compute."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import zmq

from deltafin.client import Client, RequestError
from deltafin.protocol import messages as M
from deltafin.runtime.store import Store
from deltafin.runtime.textside import generate
from deltafin.runtime.tokenizer import Tokenizer, eos_ids
from deltafin.tools.run import running_supervisor
from deltafin.tools.inprocess import local_router
from deltafin.workers.engine import Compute

BIG = "2GiB"
PROMPT = "once upon a time"


def mapped_tokenizers(pid: int) -> list[str]:
    """The `tokenizers` library's shared objects mapped into process pid."""
    lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return sorted({ln.split()[-1] for ln in lines if "/tokenizers/" in ln and ".so" in ln})


def recv_until(sock, match, timeout_s: float = 60.0) -> list:
    """Every message the socket gets up to and including the first `match` accepts."""
    out = []
    while True:
        assert sock.poll(int(timeout_s * 1000)), f"no answer within {timeout_s} s; got {out}"
        out.append(M.decode(sock.recv()))
        if match(out[-1]):
            return out


def test_compute_never_loads_a_tokenizer_and_a_stop_ends_the_request_at_once(tiny_stores):
    store = tiny_stores("qwen3_moe")
    with running_supervisor(store, BIG) as (ep, proc):
        with Client(ep, timeout=60) as c:
            greedy = c.generate(PROMPT, max_tokens=40, chat=True)
            pieces = list(c.stream(PROMPT, max_tokens=40, chat=True))
            assert "".join(pieces) == greedy.text == c.last.text and c.last.token_ids == greedy.token_ids
            assert len(greedy.text) > 6, greedy.text
            stop = greedy.text[3:6]
            compute_pid = c.health()["workers"]["compute"]["pid"]
            before = c.stats()["workers"]["compute"]

            # A raw peer sees every message: the tokens up to the stop, one done, then nothing
            # more for the request (compute's own tokens and done for it are dropped).
            ctx = zmq.Context()
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(ep)
            try:
                sock.send(M.encode(M.Generate(id=7, prompt=PROMPT, max_tokens=200, chat=True, stop=[stop])))
                got = recv_until(sock, lambda m: isinstance(m, M.Done))
                sock.send(M.encode(M.Stats(id=8)))
                after = recv_until(sock, lambda m: isinstance(m, M.StatsResult))
            finally:
                sock.close(0)
                ctx.term()
            done = got[-1]
            assert done.finish_reason == "stop" and done.id == 7
            assert done.text == greedy.text[:greedy.text.index(stop)]
            assert all(isinstance(m, M.Token) and m.text for m in got[:-1]) and len(got) > 1
            # the ids up to the token that completed the stop string
            n = len(done.token_ids)
            assert done.token_ids == greedy.token_ids[:n] and done.stats["generated_tokens"] == n
            assert [m for m in after if getattr(m, "id", None) == 7] == []  # exactly one done
            stats = after[-1].stats
            compute = stats["workers"]["compute"]
            assert stats["cancels"]["stop"] == 1 and stats["active_requests"] == 0
            # compute was stopped by the cancel, far short of the 200 tokens asked
            assert compute["cancelled"] == before.get("cancelled", 0) + 1
            assert compute["generated_tokens"] - before["generated_tokens"] < 200

            # compute served prompt text, chat, streaming and a stop without a tokenizer; the
            # supervisor (which tokenized) has one mapped, so the check can see one
            assert mapped_tokenizers(compute_pid) == []
            assert mapped_tokenizers(proc.pid) != []
            assert c.health()["ok"]


def test_in_process_text_matches_the_runtime(tiny_stores):
    """`textside.generate` around an in-process Compute gives the runtime's text and ids."""
    store_path = tiny_stores("qwen3_moe")
    store = Store(store_path)
    from deltafin.runtime.config import load_config
    config = load_config(None, {}).to_dict()
    src, staging, loader = local_router(store, config)
    try:
        compute = Compute(store, config, src, staging, store.max_record_bytes)
        tok = Tokenizer(store.tokenizer_dir, store.config)
        pieces = []
        whole = generate(compute, tok, M.Generate(id=1, prompt=PROMPT, max_tokens=24, chat=True),
                         emit=lambda m: pieces.append(m.text))
        assert "".join(pieces) == whole.text and whole.finish_reason in ("length", "stop")
        stop = whole.text[2:5]
        cut = generate(compute, tok, M.Generate(id=2, prompt=PROMPT, max_tokens=24, chat=True, stop=[stop],
                                                stream=False))
        assert cut.finish_reason == "stop" and cut.text == whole.text[:whole.text.index(stop)]
        assert cut.token_ids == whole.token_ids[:len(cut.token_ids)]
        assert cut.stats["generated_tokens"] == len(cut.token_ids) < len(whole.token_ids)
    finally:
        loader.close()
    with running_supervisor(store_path, BIG) as (ep, _):
        with Client(ep, timeout=60) as c:
            assert c.generate(PROMPT, max_tokens=24, chat=True).text == whole.text
            remote = c.generate(PROMPT, max_tokens=24, chat=True, stop=[stop])
            assert (remote.text, remote.token_ids) == (cut.text, cut.token_ids)


def test_eos_ids_without_the_tokenizer_library(tiny_stores, tmp_path):
    """Compute's EOS ids (tokenizer files read as JSON) are the tokenizer's own, also where only
    tokenizer_config's eos_token names the token."""
    store = Store(tiny_stores("qwen3_moe"))
    assert eos_ids(store.tokenizer_dir, store.config) == Tokenizer(store.tokenizer_dir, store.config).eos_ids
    only_name = tmp_path / "tok"
    shutil.copytree(store.tokenizer_dir, only_name)
    (only_name / "generation_config.json").unlink()
    tc = json.loads((only_name / "tokenizer_config.json").read_text())
    expected = Tokenizer(only_name).eos_ids
    assert expected and eos_ids(only_name) == expected
    vocab = json.loads((only_name / "tokenizer.json").read_text())["model"]["vocab"]
    for name in ("<|im_start|>", next(t for t in vocab if t.isalpha())):  # an added token, a vocabulary one
        tc["eos_token"] = name
        (only_name / "tokenizer_config.json").write_text(json.dumps(tc))
        assert eos_ids(only_name) == Tokenizer(only_name).eos_ids != expected


def test_a_chat_request_without_a_template_is_refused_and_serving_goes_on(tiny_stores, tmp_path):
    """Tokenizing is the supervisor's: a chat prompt the tokenizer cannot render is answered
    with bad_request (in compute it took the process down)."""
    store = tmp_path / "store"
    shutil.copytree(tiny_stores("qwen3_moe"), store)
    tc_path = store / "tokenizer" / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    del tc["chat_template"]
    tc_path.write_text(json.dumps(tc))
    with running_supervisor(store, BIG) as (ep, proc):
        with Client(ep, timeout=60) as c:
            with pytest.raises(RequestError, match="no chat template"):
                c.generate(PROMPT, max_tokens=4, chat=True)
            assert c.generate(PROMPT, max_tokens=4).finish_reason in ("length", "stop")
            assert c.health()["ok"] and c.health()["restarts"] == 0 and proc.poll() is None


def test_requests_reach_compute_in_arrival_order_while_a_prompt_is_tokenized(tiny_stores):
    """A long prompt text is tokenized off the serving loop, yet what arrived after it is not
    forwarded before it: its refusal (too many tokens, found only by tokenizing) comes first."""
    with running_supervisor(tiny_stores("qwen3_moe"), BIG, ["--max-context", "262144"]) as (ep, _):
        with Client(ep, timeout=60) as c:
            assert c.generate([1, 2, 3], max_tokens=1).finish_reason in ("length", "stop")  # warm
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(ep)
        try:
            sock.send(M.encode(M.Generate(id=1, prompt="hi " * 300_000, max_tokens=1)))
            sock.send(M.encode(M.Generate(id=2, token_ids=[1, 2, 3], max_tokens=1)))
            sock.send(M.encode(M.Generate(id=3, prompt="once", max_tokens=1, stop=["x"])))
            got = recv_until(sock, lambda m: isinstance(m, M.Done) and m.id == 3)
        finally:
            sock.close(0)
            ctx.term()
        final = [(m.TYPE, m.id) for m in got if isinstance(m, (M.Done, M.Error))]
        assert final == [("error", 1), ("done", 2), ("done", 3)], final
        assert "exceeds max_context=262144" in got[0].message or "more than 262144" in got[0].message


class _Pieces:
    """A stand-in tokenizer: token id i decodes to pieces[i]; ids decode to their pieces joined."""

    def __init__(self, pieces):
        self.pieces = pieces

    def decode(self, ids, markers: bool = False) -> str:
        return "".join(self.pieces[i] for i in ids)


def _run_side(pieces, stop, stream=True):
    """(streamed token messages, final done) of a TextSide fed token ids 0, 1, ... in order."""
    from deltafin.runtime.textside import TextSide
    side = TextSide(_Pieces(pieces), M.Generate(id=3, prompt="x", stop=stop, stream=stream), 5)
    sent = []
    for i in range(len(pieces)):
        out = side.accept(M.Token(id=3, index=i, token_id=i, text=""))
        sent += [out] if out is not None else []
        if side.stopped:
            return sent, side.done()
    rest = side.flush()
    sent += [rest] if rest is not None else []
    done = M.Done(id=3, text="", token_ids=list(range(len(pieces))), finish_reason="length",
                  stats={"prompt_tokens": 5})
    return sent, side.done(done)


def test_a_stream_never_shows_the_start_of_a_stop_string():
    """The streamed pieces always join to the final text: text that may begin a stop string
    waits until it completes the stop (cut) or cannot any more (sent with a later token, or
    at the end); every message keeps its own token's index."""
    sent, done = _run_side([" Paris", ".\n", "\n", "More"], ["\n\n"])
    assert done.finish_reason == "stop" and done.text == " Paris."
    assert "".join(m.text for m in sent) == done.text and [m.index for m in sent] == [0, 2]
    sent, done = _run_side([" Paris", ".\n", "It", " is"], ["\n\n"])
    assert done.finish_reason == "length" and done.text == " Paris.\nIt is"
    assert "".join(m.text for m in sent) == done.text and [m.index for m in sent] == [0, 2, 3]
    sent, done = _run_side(["a", "b", "\n"], ["\n\n", "zz"])  # the answer ends inside a stop's start
    assert "".join(m.text for m in sent) == done.text == "ab\n" and sent[-1].index == 2
    # the stop string that occurs first in the text wins, whatever the request's order
    sent, done = _run_side(["xa", "bc"], ["c", "ab"])
    assert done.text == "x" and "".join(m.text for m in sent) == "x"
    # a request not streamed gets no token messages, the same final text
    sent, done = _run_side([" Paris", ".\n", "\n"], ["\n\n"], stream=False)
    assert sent == [] and done.text == " Paris."


def test_stop_strings_are_looked_for_only_near_the_new_text():
    """Each token scans the new text and (longest stop - 1) characters before it: the work per
    token does not grow with the answer (a stop string never found stays cheap)."""
    from deltafin.runtime.textside import TextSide

    scanned = []

    class Spy(TextSide):
        def _stop_at(self, start):
            scanned.append(len(self.text) - start)
            return super()._stop_at(start)
    side = Spy(_Pieces(["word "] * 4000), M.Generate(id=1, prompt="x", stop=["never seen"]), 1)
    for i in range(4000):
        side.accept(M.Token(id=1, index=i, token_id=i, text=""))
    assert not side.stopped and max(scanned) <= len("word ") + len("never seen") - 1
