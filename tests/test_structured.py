"""Structured output: response_format json_object / json_schema enforced while decoding
(workers/structured.py, the mask in workers/scheduler.py), over HTTP with the official `openai`
client and over ZeroMQ; a constrained row decoded with unconstrained ones leaves theirs as they
are alone.

The tiny model is random: left alone it never writes JSON, so JSON that parses (and matches
its schema) can only come from the mask."""
from __future__ import annotations

import json

import openai
import pytest

from deltafin.client import Client, RequestError
from deltafin.workers.structured import ANY_OBJECT, SchemaError, grammar_of
from tests.test_http import _post, http_runtime

SCHEMA = {"type": "object", "properties": {
    "ok": {"type": "boolean"}, "size": {"enum": ["small", "large"]},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
    "required": ["ok", "size", "tags"], "additionalProperties": False}
MODEL = "mixtral-store"  # the HTTP model id: the store directory's name
MESSAGES = [{"role": "user", "content": "the quick brown fox"}]


def matches(value, schema: dict) -> bool:
    """value against the subset of JSON Schema SCHEMA uses (type, enum, properties, required,
    additionalProperties false, items, maxItems)."""
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema.get("type")
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "array":
        return (isinstance(value, list) and len(value) <= schema.get("maxItems", len(value))
                and all(matches(v, schema["items"]) for v in value))
    if kind == "object":
        props = schema.get("properties", {})
        return (isinstance(value, dict) and set(schema.get("required", ())) <= set(value)
                and (schema.get("additionalProperties", True) or set(value) <= set(props))
                and all(matches(v, props[k]) for k, v in value.items() if k in props))
    raise ValueError(f"schema not covered: {schema}")


@pytest.mark.parametrize("text, why", [
    ("{", "not valid JSON"), ("[1]", "must be a JSON object"), ('{"type": "objectx"}', "objectx"),
    ('{"type": "string", "pattern": "(("}', "regex"),
    ('{"$ref": "#/definitions/nope"}', "nope")])
def test_an_invalid_schema_is_refused_with_why(text, why):
    with pytest.raises(SchemaError, match=why):
        grammar_of(text)
    assert grammar_of(json.dumps(SCHEMA)) and grammar_of(ANY_OBJECT)


def test_constrained_rows_beside_unconstrained_ones_in_process(tiny_stores):
    """The scheduler, every expert resident (passes launched before the last token is read): a
    constrained sequence's tokens are JSON matching SCHEMA, sampled once its grammar took the
    last token (an early pass waits unsampled), and the unconstrained ones beside it, greedy
    and sampled, give the tokens they give alone."""
    from deltafin.protocol import messages as M
    from deltafin.runtime.config import Config
    from deltafin.runtime.store import Store
    from deltafin.runtime.tokenizer import Tokenizer
    from deltafin.tools.inprocess import local_router
    from deltafin.workers.engine import Compute
    store = Store(tiny_stores("mixtral"))
    cfg = Config().to_dict()
    src, staging, loader = local_router(store, cfg)
    try:
        c = Compute(store, cfg, src, staging, store.max_record_bytes)
        c.preload()
        plain = [M.Generate(id=1, token_ids=[5, 6, 7], max_tokens=30),
                 M.Generate(id=2, token_ids=[9, 8], max_tokens=30, temperature=0.8, seed=4)]
        alone = [c.generate(r).token_ids for r in plain]
        shaped = M.Generate(id=3, token_ids=[1, 2, 3], max_tokens=60, temperature=0.7, seed=3,
                            json_schema=json.dumps(SCHEMA))
        seqs = [c.start(r) for r in (shaped, *plain)]
        c._begin_request()
        for seq in seqs:
            c.scheduler.add(seq)
        deferred = 0
        while c.scheduler.busy():
            c.scheduler.step()
            deferred += c.scheduler.ahead is not None and c.scheduler.ahead.tokens is None
        assert [s.out_ids for s in seqs[1:]] == alone
        assert seqs[0].finish == "stop" and deferred > 0
        assert matches(json.loads(Tokenizer(store.tokenizer_dir).decode(seqs[0].out_ids)), SCHEMA)
    finally:
        loader.close()


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def _http_checks(url: str) -> None:
    ai = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    base = {"model": MODEL, "messages": MESSAGES, "max_tokens": 200, "temperature": 0}
    out = ai.chat.completions.create(**base, response_format={"type": "json_object"})
    assert out.choices[0].finish_reason == "stop", out
    assert isinstance(json.loads(out.choices[0].message.content), dict)
    for temperature in (0, 1.0):
        out = ai.chat.completions.create(**{**base, "temperature": temperature}, seed=5,
                                         response_format=_schema_format(SCHEMA))
        assert matches(json.loads(out.choices[0].message.content), SCHEMA), out
    pieces = ai.chat.completions.create(**base, response_format=_schema_format(SCHEMA), stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in pieces if c.choices)
    assert matches(json.loads(text), SCHEMA), text
    out = ai.completions.create(model=MODEL, prompt="the quick brown fox", max_tokens=200, temperature=0,
                                extra_body={"response_format": _schema_format(SCHEMA)})
    assert matches(json.loads(out.choices[0].text), SCHEMA), out
    with pytest.raises(openai.BadRequestError, match="objectx"):
        ai.chat.completions.create(**base, response_format=_schema_format({"type": "objectx"}))
    status, body = _post(f"{url}/v1/chat/completions", json.dumps(
        {**base, "response_format": {"type": "xml"}}).encode())
    assert status == 400 and body["error"]["param"] == "response_format", body


def _mixed_batch(endpoint: str) -> None:
    """An unconstrained request, greedy and sampled, gives alone and beside a constrained one
    (which starts first and decodes in the same steps) the same tokens."""
    plain = [dict(max_tokens=40), dict(max_tokens=40, temperature=0.9, seed=7)]
    with Client(endpoint, timeout=120) as a, Client(endpoint, timeout=120) as b:
        alone = [b.generate([5, 6, 7, 8], **kw).token_ids for kw in plain]
        for kw in plain:
            stream = a.stream([1, 2, 3], max_tokens=120, temperature=0.7, seed=3,
                              json_schema=json.dumps(SCHEMA))
            first = next(stream)  # it decodes: the next request joins its steps
            got = b.generate([5, 6, 7, 8], **kw).token_ids
            constrained = first + "".join(stream)
            assert got == alone[plain.index(kw)], kw
            assert matches(json.loads(constrained), SCHEMA), constrained
        rows = a.stats()
        with pytest.raises(RequestError, match="objectx"):
            a.generate([1, 2, 3], json_schema='{"type": "objectx"}')
    batch = rows["workers"]["compute"]["batch"]
    assert batch["max_rows"] >= 2, batch


def test_json_over_http_and_zmq_and_beside_unconstrained_rows(tiny_stores):
    with http_runtime(tiny_stores("mixtral")) as (endpoint, url, _):
        _http_checks(url)
        _mixed_batch(endpoint)


def test_constrained_decoding_off_charges_no_token_table_and_refuses_schemas(tiny_stores):
    """--no-constrained: the plan has no token table and a json_schema request is refused with
    a message that says why, while an unconstrained one is answered."""
    from deltafin.runtime import budget
    from deltafin.runtime.config import load_config
    from deltafin.runtime.store import Store
    from deltafin.tools.run import running_supervisor
    store = tiny_stores("mixtral")
    on, off = (budget.plan_budget(Store(store), load_config(None, {"compute.constrained": c})) for c in (True, False))
    assert on.token_table > 0 and off.token_table == 0 and on.reserves - off.reserves == on.token_table
    with running_supervisor(store, "4GiB", ["--no-constrained"]) as (endpoint, _):
        with Client(endpoint, timeout=60) as c:
            assert len(c.generate([1, 2, 3], max_tokens=4).token_ids) == 4
            with pytest.raises(RequestError, match=r"constrained decoding is off"):
                c.generate([1, 2, 3], max_tokens=4, json_schema=ANY_OBJECT)
