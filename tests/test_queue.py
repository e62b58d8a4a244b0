"""Requests scheduled, never nested, and prompts bounded before tokenizing
(item 1): real supervisor and workers. Requests run one at a time in arrival order from compute's
bounded queue; a full queue is refused at once with `queue_full`; `cancel` removes a queued
request or stops a running one within a token; a client that vanishes mid-stream has its request
cancelled; a 100 MB prompt is refused before compute tokenizes it while another client is served.
The conftest checks that no process or segment is left behind."""
from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from deltafin.client import Client, RequestError, RuntimeBusy
from deltafin.protocol import messages as M
from deltafin.tools.run import running_supervisor
from conftest import config_flags  # noqa: E402

BIG = "4GiB"
LONG = [100, 200, 300, 400]   # a prompt the tiny store does not stop early on (as tests/test_protocol.py)


def _await_in_flight(watcher: Client, n: int, timeout: float = 30.0) -> None:
    """Until the supervisor counts n requests in flight (the waits of a queue are not guessed)."""
    deadline = time.monotonic() + timeout
    while watcher.stats()["active_requests"] != n:
        assert time.monotonic() < deadline, f"never {n} requests in flight"
        time.sleep(0.01)


def _compute(stats: dict) -> dict:
    return stats["workers"]["compute"]


# -- the queue itself, in-process ---------------------------------------------------------------------
def test_request_queue_is_a_fifo_with_cancel():
    from deltafin.workers.scheduler import RequestQueue
    q = RequestQueue()                        # one running, the others wait
    a, b = q.add(b"x", M.Generate(id=1, token_ids=[1])), q.add(b"y", M.Generate(id=1, token_ids=[2]))
    assert q.next() is a                      # oldest first
    assert q.cancel(b"x", 1) is None and a.cancelled  # running: marked, answered by its loop
    assert q.cancel(b"y", 1) is b             # waiting: removed, answered by the caller
    assert q.cancel(b"y", 1) is None          # gone already
    c = q.add(b"z", M.Generate(id=1, token_ids=[3]))
    q.finish()
    assert q.next() is c and q.next() is None
    q.finish()
    assert q.stats()["cancelled_waiting"] == 1 and q.stats()["cancelled_running"] == 1


def test_prompt_bytes_are_bounded_before_tokenizing(tiny_stores):
    from deltafin.runtime.store import Store
    from deltafin.runtime.tokenizer import PromptTooLong, Tokenizer
    store = Store(tiny_stores("deepseek_v2"))
    tok = Tokenizer(store.tokenizer_dir, store.config)
    bound = tok.prompt_bytes_bound(64)
    assert bound == 64 * tok.max_token_bytes
    with pytest.raises(PromptTooLong, match="bytes"):
        tok.encode("a" * (bound + 1), max_tokens=64)
    with pytest.raises(PromptTooLong, match="bytes"):
        tok.encode("\u00e9" * (bound // 2 + 1), max_tokens=64)  # two bytes a character
    with pytest.raises(PromptTooLong, match="tokens"):  # within the bytes, beyond the tokens
        tok.encode(" ".join(["x"] * 200), max_tokens=64)
    assert tok.encode("hello there", max_tokens=64) == tok.encode("hello there")
    # A long text within the bytes is counted in pieces and refused before it is tokenized whole.
    from deltafin.runtime.tokenizer import PIECE_CHARS, pieces
    most = PIECE_CHARS // 4            # tokens; a piece of "xy " holds more than this
    many = "xy " * (PIECE_CHARS // 3 * 2)
    assert PIECE_CHARS < len(many) < tok.prompt_bytes_bound(most)
    with pytest.raises(PromptTooLong, match=f"first {len(next(pieces(many)))} characters"):
        tok.encode(many, max_tokens=most)
    fits = "hello there, " * (PIECE_CHARS // 6)  # long, but within the tokens: tokenized whole
    assert tok.encode(fits, max_tokens=len(tok.encode(fits))) == tok.encode(fits)
    assert "".join(pieces(many)) == many and max(map(len, pieces(many))) <= PIECE_CHARS
    # No token of the vocabulary stands for more text than the bound assumes.
    assert max(len(tok.decode([i]).encode()) for i in range(tok.vocab_size)) <= tok.max_token_bytes
    assert M.prompt_too_long("x" * 10, 10) is None and "11 bytes" in M.prompt_too_long("\u00e9" * 5 + "x", 10)


# -- with real processes --------------------------------------------------------------------------------
def test_requests_run_one_at_a_time_in_arrival_order(tiny_stores, tmp_path):
    """Two clients' requests sent while a third generates wait their turn, in arrival order, and
    none runs inside another (compute's [start, end] event numbers never overlap); each one's
    answer is the one it gets alone and its stats time excludes its wait (queue_s)."""
    with running_supervisor(tiny_stores("deepseek_v2"), BIG, config_flags(tmp_path, compute={"max_batch": 1})) as (ep, _):
        with Client(ep, timeout=120) as a, Client(ep, timeout=120) as b, \
                Client(ep, timeout=120) as c, Client(ep, timeout=120) as watcher:
            alone_b = b.generate([1, 2, 3], max_tokens=8).token_ids
            alone_c = c.generate([7, 8, 9], max_tokens=8).token_ids
            first = a.stream(LONG, max_tokens=200)
            next(first)                        # a is generating
            sent_b = M.Generate(id=b._next(), token_ids=[1, 2, 3], max_tokens=8, stream=False)
            b._send(sent_b)
            _await_in_flight(watcher, 2)       # b is queued before c is sent
            sent_c = M.Generate(id=c._next(), token_ids=[7, 8, 9], max_tokens=8, stream=False)
            c._send(sent_c)
            _await_in_flight(watcher, 3)
            done_c = c._recv(sent_c.id)
            done_b = b._recv(sent_b.id)
            list(first)
            done_a = first.result
            assert watcher.stats()["workers"]["compute"]["queue"]["waiting"] == 0
    assert done_b.token_ids == alone_b and done_c.token_ids == alone_c
    assert len(done_a.token_ids) == 200 and done_a.finish_reason == "length"
    a0, a1 = done_a.stats["order"]
    b0, b1 = done_b.stats["order"]
    c0, c1 = done_c.stats["order"]
    assert a0 < a1 < b0 < b1 < c0 < c1, (done_a.stats["order"], done_b.stats["order"], done_c.stats["order"])
    assert done_b.stats["queue_s"] > 0 and done_c.stats["queue_s"] > 0
    print(f"a {done_a.stats['total_s']:.3f} s; b waited {done_b.stats['queue_s']:.3f} s, ran "
          f"{done_b.stats['total_s']:.3f} s; c waited {done_c.stats['queue_s']:.3f} s, ran {done_c.stats['total_s']:.3f} s")


def test_a_full_queue_is_refused_at_once_with_queue_full(tiny_stores, tmp_path):
    with running_supervisor(tiny_stores("deepseek_v2"), BIG, config_flags(tmp_path, compute={"max_queue": 1, "max_batch": 1})) as (ep, _):
        with Client(ep, timeout=60) as a, Client(ep, timeout=60) as b, Client(ep, timeout=60) as c:
            running = a.stream(LONG, max_tokens=1500)
            next(running)
            waiting = b.stream([1, 2, 3], max_tokens=8)
            _await_in_flight(c, 2)
            with pytest.raises(RuntimeBusy, match="in flight: one running and compute.max_queue=1") as refused:
                c.generate([4, 5, 6], max_tokens=4)
            assert refused.value.code == "queue_full"
            assert c.health()["ok"]            # answered by the supervisor meanwhile
            running.cancel()
            assert list(waiting) and b.last.finish_reason == "length"  # b ran once a stopped
            list(running)
            assert running.result.finish_reason == "cancelled"
            assert len(c.generate([4, 5, 6], max_tokens=4).token_ids) == 4  # room again


def test_cancel_removes_a_queued_request_and_stops_a_running_one(tiny_stores, tmp_path):
    with running_supervisor(tiny_stores("deepseek_v2"), BIG, config_flags(tmp_path, compute={"max_batch": 1})) as (ep, _):
        with Client(ep, timeout=60) as a, Client(ep, timeout=60) as b:
            before = b.generate(LONG, max_tokens=12).token_ids
            running = a.stream(LONG, max_tokens=1500)
            for _ in range(3):
                next(running)
            queued = b.stream([1, 2, 3], max_tokens=50)
            _await_in_flight(b, 2)
            queued.cancel()
            assert list(queued) == [] and queued.result.finish_reason == "cancelled"
            assert queued.result.token_ids == [] and queued.result.stats["generated_tokens"] == 0
            assert b.stats()["active_requests"] == 1   # a is still running meanwhile
            more = [next(running) for _ in range(3)]
            assert more
            running.cancel()
            list(running)
            done = running.result
            assert done.finish_reason == "cancelled" and 6 <= len(done.token_ids) < 1500
            n = min(len(before), len(done.token_ids))  # it may stop before 12 tokens
            assert done.token_ids[:n] == before[:n]    # what it produced was exact
            # What it held is free: the next request runs, and gives the same tokens as the first time.
            assert b.generate(LONG, max_tokens=12).token_ids == before
            with pytest.raises(RequestError, match="no request") as unknown:
                b._call(M.Cancel(id=12345))
            assert unknown.value.code == "unknown_request"
            stats = b.stats()
    compute = _compute(stats)
    assert compute["cancelled"] == 2
    assert compute["queue"]["cancelled_waiting"] == 1 and compute["queue"]["cancelled_running"] == 1
    assert stats["cancels"]["client"] == 2 and stats["active_requests"] == 0


def test_a_client_that_vanishes_mid_stream_has_its_request_cancelled(tiny_stores):
    """The supervisor's next reply to the closed socket fails (ROUTER_MANDATORY): it cancels the
    request, so another client's request starts within a token, not after 1500 of them."""
    with running_supervisor(tiny_stores("deepseek_v2"), BIG) as (ep, _):
        with Client(ep, timeout=60) as b:
            ref = b.generate([1, 2, 3], max_tokens=4).token_ids
            tokens0 = _compute(b.stats())["generated_tokens"]
            gone = Client(ep, timeout=60)
            stream = gone.stream(LONG, max_tokens=1500)
            next(stream)
            next(stream)
            gone.close()                          # vanishes mid-stream
            t0 = time.monotonic()
            done = b.generate([1, 2, 3], max_tokens=4)
            took = time.monotonic() - t0
            stats = b.stats()
    assert done.token_ids == ref
    compute = _compute(stats)
    assert stats["cancels"]["client_gone"] == 1 and compute["cancelled"] == 1
    produced = compute["generated_tokens"] - tokens0 - len(ref)
    assert 2 <= produced < 1500, produced       # the vanished client's generation was cut short
    print(f"next request answered {took:.3f} s after the client vanished; queue_s "
          f"{done.stats['queue_s']:.3f} s; the vanished one produced {produced} of 1500 tokens")


def test_a_100_mb_prompt_is_refused_before_tokenizing_while_another_client_is_served(tiny_stores, tmp_path):
    cfg = config_flags(tmp_path, runtime={"max_request_bytes": "128MiB"})
    with running_supervisor(tiny_stores("deepseek_v2"), BIG, cfg) as (ep, _):
        with Client(ep, timeout=60) as big, Client(ep, timeout=60) as other:
            ref = other.generate("hello there", max_tokens=6).token_ids
            limit = big.info.max_prompt_bytes
            assert 0 < limit < 100_000_000
            answers: list = []

            def normal() -> None:
                answers.append(other.generate("hello there", max_tokens=6).token_ids)
            t = threading.Thread(target=normal)
            prompt = "a" * 100_000_000
            # The Python client refuses by welcome's bound, unsent (a smaller bound than the
            # runtime's shows it was not the runtime that refused).
            real, big.info = big.info, dataclasses.replace(big.info, max_prompt_bytes=10)
            with pytest.raises(RequestError, match="max_prompt_bytes"):
                big.generate("a" * 11, max_tokens=4)
            big.info = real
            raw = M.encode(M.Generate(id=big._next(), prompt=prompt, max_tokens=4))  # as any peer may
            t.start()
            t0 = time.monotonic()
            big.sock.send(raw)
            with pytest.raises(RequestError, match="max_prompt_bytes") as refused:
                big._recv(M.decode(raw).id)
            took = time.monotonic() - t0
            t.join(timeout=60)
            assert refused.value.code == "bad_request"
            with pytest.raises(RequestError, match="max_prompt_bytes"):  # just past the bound
                big._call(M.Generate(id=big._next(), prompt="a" * (limit + 1), max_tokens=4))
            stats = big.stats()
    assert answers == [ref]
    assert _compute(stats)["queue"]["queued"] == 2   # compute never saw the refused prompts
    print(f"100 MB prompt refused by the runtime {took:.3f} s after the send (bound {limit} bytes)")


def _send_many(c: Client, n: int, max_tokens: int) -> dict:
    """n requests sent at once on one socket, then every final reply, by id."""
    ids = []
    for _ in range(n):
        msg = M.Generate(id=c._next(), token_ids=[1, 2, 3], max_tokens=max_tokens, stream=False)
        c._send(msg)
        ids.append(msg.id)
    finals = {}
    while len(finals) < n:
        assert c.sock.poll(60_000), f"{n - len(finals)} requests never answered"
        m = M.decode(c.sock.recv())
        assert m.id in ids and m.id not in finals, m
        finals[m.id] = m
    return finals


def test_hundreds_of_requests_from_one_client_queue_and_never_nest(tiny_stores, tmp_path):
    """Once, ~245 requests in flight from one client ended in RecursionError (each ran inside
    the one before): now 300 wait their turn and all get their answer."""
    with running_supervisor(tiny_stores("deepseek_v2"), BIG, config_flags(tmp_path, compute={"max_queue": 300, "max_batch": 1})) as (ep, _):
        with Client(ep, timeout=60) as c:
            ref = c.generate([1, 2, 3], max_tokens=2).token_ids
            finals = _send_many(c, 300, 2)
    assert all(isinstance(m, M.Done) and m.token_ids == ref for m in finals.values()), \
        {type(m).__name__ + getattr(m, "message", "")[:80] for m in finals.values()}
    orders = sorted(m.stats["order"] for m in finals.values())
    assert all(a[1] < b[0] for a, b in zip(orders, orders[1:]))  # one after the other


def test_a_flood_beyond_the_queue_is_refused_and_the_rest_answered(tiny_stores):
    """The default queue (16 waiting): of 40 requests sent at once, those beyond 1 + 16 in
    flight are refused with queue_full, every other one is answered."""
    with running_supervisor(tiny_stores("deepseek_v2"), BIG) as (ep, _):
        with Client(ep, timeout=60) as c:
            ref = c.generate([1, 2, 3], max_tokens=40).token_ids
            finals = _send_many(c, 40, 40)
            assert c.stats()["active_requests"] == 0
    done = [m for m in finals.values() if isinstance(m, M.Done)]
    refused = [m for m in finals.values() if isinstance(m, M.Error)]
    assert all(m.code == "queue_full" for m in refused) and len(refused) >= 1
    assert len(done) >= 17 and all(m.token_ids == ref for m in done)
