"""Bad input: the message decoder and the request checks under property-based fuzzing
(hypothesis), then the live client endpoint under garbage of every kind, REQ peers, oversized
frames and requests that must be refused at once, with exact answers before and after."""
from __future__ import annotations

import dataclasses
import math
import random

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltafin.client import Client, RequestError
from deltafin.protocol import messages as M
from deltafin.tools.run import running_supervisor

BIG = "4GiB"
LIMITS = M.RequestLimits(vocab_size=512, max_context=2048)

# -- the decoder ---------------------------------------------------------------------------------
scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**63, max_value=2**64 - 1),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
                    st.binary(max_size=20))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=8), inner, max_size=5)), max_leaves=20)
field_names = st.sampled_from(sorted({f for cls in M.REGISTRY.values()
                                      for f in cls.__dataclass_fields__} | {"type", "x"}))
messages = st.builds(lambda t, fields: {**fields, "type": t},
                     st.one_of(st.sampled_from(sorted(M.REGISTRY)), st.text(max_size=10), st.integers(-2**63, 2**63)),
                     st.dictionaries(field_names, values, max_size=8))


def _decoded_or_refused(raw: bytes):
    try:
        msg = M.decode(raw)
    except M.ProtocolError:
        return None
    # whatever decodes is a registered message whose fields have their declared kinds
    assert type(msg) in M.REGISTRY.values()
    assert M.decode(M.encode(msg)) == msg
    return msg


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=200))
def test_decoder_takes_any_bytes(raw):
    _decoded_or_refused(raw)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages)
def test_decoder_takes_any_msgpack_map(data):
    _decoded_or_refused(msgpack.packb(data, use_bin_type=True))


@settings(max_examples=300, deadline=None)
@given(st.builds(dict, id=st.integers(-5, 5),
                 prompt=st.one_of(st.none(), st.text(max_size=5)),
                 token_ids=st.one_of(st.none(), st.lists(st.one_of(st.integers(-3, 600), st.booleans(),
                                                                   st.floats(), st.text(max_size=2)), max_size=6)),
                 messages=st.one_of(st.none(), st.lists(st.dictionaries(
                     st.sampled_from(["role", "content", "name"]), st.one_of(st.text(max_size=3), st.integers(-9, 9))),
                     max_size=3)),
                 max_tokens=st.one_of(st.none(), st.integers(-3, 3000)), temperature=st.floats(), top_p=st.floats(),
                 seed=st.one_of(st.none(), st.integers(-2**63, 2**64 - 1)),
                 stop=st.one_of(st.none(), st.lists(st.one_of(st.text(max_size=3), st.integers(-9, 9)), max_size=3))))
def test_requests_the_checks_pass_are_servable(fields):
    """Whatever check_request lets through can be served as asked; the rest is BadRequest."""
    try:
        msg = M.decode(msgpack.packb({"type": "generate", **fields}))
    except M.ProtocolError:
        return
    try:
        M.check_request(msg, LIMITS)
    except M.BadRequest:
        return
    assert sum(x is not None for x in (msg.prompt, msg.token_ids, msg.messages)) == 1
    room = 1 if msg.max_tokens is None else msg.max_tokens  # nil: the rest, at least one token
    if msg.token_ids is not None:
        assert msg.token_ids and all(type(i) is int and 0 <= i < 512 for i in msg.token_ids)
        assert len(msg.token_ids) + room <= LIMITS.max_context
    elif msg.messages is not None:
        assert msg.messages and all(isinstance(m["role"], str) and isinstance(m["content"], str)
                                    for m in msg.messages)
    else:
        assert msg.prompt
    assert msg.max_tokens is None or 0 <= msg.max_tokens < LIMITS.max_context
    assert math.isfinite(msg.temperature) and msg.temperature >= 0
    assert math.isfinite(msg.top_p) and 0 < msg.top_p <= 1
    assert msg.seed is None or msg.seed >= 0
    assert msg.stop is None or all(isinstance(s, str) for s in msg.stop)


@pytest.mark.parametrize("fields,why", [
    ({"prompt": "a", "token_ids": [1]}, "exactly one"),
    ({}, "exactly one"),
    ({"token_ids": [True, 2]}, "token ids must be integers"),
    ({"token_ids": [1.0]}, "token ids must be integers"),
    ({"token_ids": [512]}, "token ids must be integers"),
    ({"token_ids": []}, "empty prompt"),
    ({"prompt": ""}, "empty prompt"),
    ({"prompt": "a", "temperature": float("nan")}, "temperature"),
    ({"prompt": "a", "temperature": float("inf")}, "temperature"),
    ({"prompt": "a", "top_p": 0.0}, "top_p"),
    ({"prompt": "a", "seed": -1}, "seed"),
    ({"prompt": "a", "stop": ["x", 3]}, "stop"),
    ({"prompt": "a", "max_tokens": 2048}, "max_tokens"),
    ({"token_ids": [1] * 2000, "max_tokens": 100}, "max_context"),
    ({"token_ids": [1] * 2048, "max_tokens": None}, "max_context"),
    ({"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, "exactly one"),
    ({"messages": []}, "messages must be"),
    ({"messages": [{"role": "user"}]}, "messages must be"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages must be"),
    ({"messages": [{"role": "user", "content": "x" * 100}]}, "max_prompt_bytes"),
])
def test_generate_refusals(fields, why):
    with pytest.raises(M.BadRequest, match=why):
        M.check_request(M.Generate(id=1, **fields), dataclasses.replace(LIMITS, max_prompt_bytes=64))


def test_logits_reply_bounded_by_the_message_limit():
    limits = M.RequestLimits(vocab_size=151_936, max_context=32_768)
    most = M.MAX_RESULT_BYTES // (151_936 * 4)
    M.check_request(M.Logits(id=1, token_ids=[1] * most), limits)
    with pytest.raises(M.BadRequest, match=f"at most {most} tokens"):
        M.check_request(M.Logits(id=1, token_ids=[1] * (most + 1)), limits)


def test_decoder_limits():
    with pytest.raises(M.ProtocolError, match="exceeds"):
        M.decode(b"\x00" * 100, limit=99)
    # a small frame that would become a huge list: refused by msgpack's array bound
    many = b"\xdd" + (M.MAX_ITEMS + 1).to_bytes(4, "big") + b"\xc0" * (M.MAX_ITEMS + 1)
    with pytest.raises(M.ProtocolError):
        M.decode(many)
    with pytest.raises(M.ProtocolError):
        M.decode(b"\x91" * 5000)  # nested past msgpack's stack


# -- the live endpoint ---------------------------------------------------------------------------
class Peer:
    def __init__(self, ctx, endpoint, kind=zmq.DEALER):
        self.sock = ctx.socket(kind)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def ask(self, *frames, timeout_s: float = 10.0):
        self.sock.send_multipart(list(frames))
        assert self.sock.poll(int(timeout_s * 1000)), f"no reply to {frames!r:.80}"
        return self.sock.recv_multipart()

    def error(self, *frames) -> dict:
        reply = self.ask(*frames)
        assert len(reply) == 1, reply
        m = msgpack.unpackb(reply[0])
        assert m["type"] == "error", m
        return m


def _garbage(rng: random.Random) -> list[bytes]:
    shapes = [b"", b"\xc1", b"\x81\xa4type\xa8generate", msgpack.packb([1, 2, 3]), msgpack.packb(7),
              msgpack.packb({"id": 1}), msgpack.packb({"type": 5, "id": 1}),
              msgpack.packb({"type": "teleport", "id": 1}),
              msgpack.packb({"type": "generate", "id": "one", "prompt": "x"}),
              msgpack.packb({"type": "generate", "id": 1, "prompt": "x", "colour": "red"}),
              msgpack.packb({"type": "generate", "id": 1, "prompt": ["x"]}),
              msgpack.packb({"type": "logits", "id": 1, "token_ids": "abc"}),
              msgpack.packb({"type": "hello", "id": 1, "version": 1.5}),
              M.encode(M.Shutdown(reason="from a client")), M.encode(M.Forward(client=b"x", payload=b"y")),
              M.encode(M.AttachPool(segment="x", n_slots=1, slot_bytes=1)), M.encode(M.Done(
                  id=1, text="", token_ids=[], finish_reason="stop", stats={})),
              msgpack.packb({"type": "generate", "id": 1, "prompt": "x"}) + b"trailing"]
    shapes += [bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 64))) for _ in range(40)]
    return shapes


def test_garbage_on_the_client_endpoint(tiny_stores):
    rng = random.Random(9)
    with running_supervisor(tiny_stores("mixtral"), BIG, ["--max-context", "140000"]) as (ep, _):
        with Client(ep, timeout=60) as c:
            ref = c.generate([5, 9, 200, 31], max_tokens=12).token_ids
            ref_logits = c.logits([5, 9, 200, 31])
        ctx = zmq.Context()
        try:
            p = Peer(ctx, ep)
            for frame in _garbage(rng):
                m = p.error(frame)
                assert m["code"] == "bad_message" and m["id"] is None or m["id"] == 1
            # multi-frame messages
            assert p.error(b"a", b"b")["code"] == "bad_message"
            assert "one frame" in p.error(msgpack.packb({"type": "hello", "id": 1, "version": 1}), b"x")["message"]
            # wrong protocol version
            assert p.error(M.encode(M.Hello(id=3, version=2)))["code"] == "version_mismatch"
            # well-formed requests that must be refused, each at once
            for fields in ({"prompt": "a", "token_ids": [1]}, {"token_ids": [True, 1]},
                           {"prompt": "a", "temperature": float("nan")}, {"prompt": "a", "seed": -1},
                           {"prompt": "a", "stop": [1, 2]}, {"prompt": "a", "max_tokens": 10**9}):
                m = p.error(msgpack.packb({"type": "generate", "id": 4, **fields}))
                assert (m["id"], m["code"]) == (4, "bad_request"), (fields, m)
            m = p.error(msgpack.packb({"type": "logits", "id": 5, "token_ids": [1] * 135_000}))
            assert m["code"] == "bad_request" and "message limit" in m["message"]
            # an oversized frame: ZeroMQ drops that connection; the runtime and others go on
            big = Peer(ctx, ep)
            big.sock.send(b"\x00" * (16 * 2**20 + 1))
            assert not big.sock.poll(500)
            big.sock.close(0)
            # REQ: one reply per request, in the REQ envelope; no token messages
            req = Peer(ctx, ep, zmq.REQ)
            hello = msgpack.unpackb(req.ask(M.encode(M.Hello(id=1, version=1)))[0])
            assert hello["type"] == "welcome" and hello["max_request_bytes"] == 16 * 2**20
            done = msgpack.unpackb(req.ask(M.encode(M.Generate(id=2, token_ids=[5, 9, 200, 31], max_tokens=12)))[0])
            assert done["type"] == "done" and done["token_ids"] == ref
            bad = msgpack.unpackb(req.ask(b"\xc1")[0])
            assert bad["type"] == "error" and bad["code"] == "bad_message"
            req.sock.close(0)
            p.sock.close(0)
        finally:
            ctx.destroy(linger=0)
        with Client(ep, timeout=60) as c:  # still exact
            assert c.generate([5, 9, 200, 31], max_tokens=12).token_ids == ref
            assert (c.logits([5, 9, 200, 31]) == ref_logits).all()
            with pytest.raises(RequestError, match="runtime.max_request_bytes"):
                c.generate("x" * (16 * 2**20), max_tokens=1)  # refused by the client itself
            assert c.health()["ok"]


def test_one_client_does_not_delay_another_ones_error(tiny_stores):
    """A refused request is answered by the supervisor while compute is busy with another."""
    with running_supervisor(tiny_stores("deepseek_v2"), BIG) as (ep, _):
        with Client(ep, timeout=60) as busy, Client(ep, timeout=60) as other:
            stream = busy.stream([100, 200, 300, 400], max_tokens=1000)
            next(stream)
            with pytest.raises(RequestError, match="temperature"):
                other.generate([1, 2], max_tokens=4, temperature=float("nan"))
            with pytest.raises(RequestError, match="exactly one"):
                other._call(M.Generate(id=other._next(), prompt="a", token_ids=[1]))
            rest = list(stream)  # the long generation was still running all along
            assert len(rest) > 100 and busy.last.finish_reason == "length"


def test_every_error_code_maps_to_an_exception_and_is_documented():
    from pathlib import Path

    from deltafin.client import ERRORS, DeltafinError
    assert set(ERRORS) == set(M.ErrorCode)
    for code in M.ErrorCode:
        assert issubclass(ERRORS[code], DeltafinError)
        with pytest.raises(ERRORS[code]) as got:
            _raise_error(code)
        assert got.value.code == code.value
    assert M.decode(M.encode(M.Error(id=1, code=M.ErrorCode.QUEUE_FULL, message="x"))).code == "queue_full"
    doc = (Path(__file__).resolve().parents[1] / "docs" / "PROTOCOL.md").read_text()
    table = doc[doc.index("| code | when |"):].split("\n\n")[0]
    documented = [row.split("`")[1] for row in table.splitlines()[2:]]
    assert documented == [c.value for c in M.ErrorCode]


def _raise_error(code):
    from deltafin.client import _raise
    _raise(M.Error(id=1, code=code.value, message="why"))


def test_wait_readable_spins_then_sleeps_and_still_times_out():
    """bench.spin_ms: a wait polls without sleeping first (a message that lands meanwhile ends it
    at once), then as before; with nothing coming the deadline still ends it."""
    import threading
    import time

    import zmq

    from deltafin.runtime.sockets import wait_readable
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        a.bind("inproc://spin")
        b.connect("inproc://spin")
        for delay in (0.005, 0.08):  # lands while spinning, then after the spin
            t = threading.Timer(delay, lambda: b.send(b"x"))
            t0 = time.perf_counter()  # before the timer starts: its delay counts from after t0
            t.start()
            wait_readable(a, 5.0, spin_s=0.03)
            assert delay <= time.perf_counter() - t0 < 2.0
            assert a.recv() == b"x"
            t.join()
        t0 = time.perf_counter()
        with pytest.raises(TimeoutError):
            wait_readable(a, 0.3, spin_s=0.1)
        assert 0.29 <= time.perf_counter() - t0 < 2.0
    finally:
        a.close(0)
        b.close(0)
        ctx.term()


def test_a_schema_error_names_the_request_it_answers():
    """A message whose type and integer id could be read, but whose fields do not fit: its
    `bad_message` error carries that id (a peer with several requests in flight knows which
    failed); an id that is not an integer leaves it nil."""
    from deltafin.protocol.codec import decode_request
    for data, rid in [({"type": "stats", "id": 2, "zzz": 1}, 2),
                      ({"type": "generate", "id": 5, "prompt": "x", "stop": "x"}, 5),
                      ({"type": "hello", "id": 7}, 7),
                      ({"type": "stats", "id": True, "zzz": 1}, None),
                      ({"type": "stats", "id": "2"}, None)]:
        with pytest.raises(M.ProtocolError) as err:
            decode_request(msgpack.packb(data), 1 << 20, 64)
        assert err.value.id == rid, (data, err.value)
    with pytest.raises(M.ProtocolError) as err:
        decode_request(msgpack.packb({"type": "nope", "id": 3}), 1 << 20, 64)
    assert err.value.id is None  # the type unknown: nothing of it is trusted
