"""The OpenAI-compatible HTTP frontend as users run it: `deltafin-supervisor --http` with real
worker processes, the frontend as its child process, and the official `openai` package as the
client. Greedy answers are compared with the same requests through deltafin.client."""
from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import openai
import psutil
import pytest

from deltafin.client import Client
from deltafin.tools.run import running_supervisor

BIG = "4GiB"
PROMPT = "the quick brown fox"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _await_line(proc: subprocess.Popen, prefix: str, timeout: float = 120) -> str:
    """The next stdout line starting with prefix; read on a thread (the line may sit in the
    pipe's buffer already, read along with READY, where select would not see it)."""
    found: list[str] = []

    def read():
        for line in proc.stdout:
            if line.startswith(prefix):
                found.append(line[len(prefix):].strip())
                return
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    if not found:
        raise AssertionError(f"no `{prefix}` line within {timeout} s (exit code {proc.poll()})")
    return found[0]


@contextlib.contextmanager
def http_runtime(store):
    """(ZeroMQ endpoint, HTTP base url, supervisor process)."""
    port = _free_port()
    with running_supervisor(store, BIG, ["--http", f"127.0.0.1:{port}"]) as (endpoint, proc):
        url = _await_line(proc, "HTTP ")
        assert url == f"http://127.0.0.1:{port}"
        yield endpoint, url, proc


def _openai(url: str):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def _get(url: str) -> tuple[int, str, str]:
    """(status, content type, body) of a GET, errors included."""
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            return r.status, r.headers["Content-Type"], r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read().decode()


def _post(url: str, body: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _frontend(proc) -> psutil.Process:
    kids = [k for k in psutil.Process(proc.pid).children()
            if "deltafin.workers.frontend" in " ".join(k.cmdline())]
    assert len(kids) == 1
    return kids[0]


def test_completions_and_chat_match_the_zmq_client(tiny_stores):
    with http_runtime(tiny_stores("mixtral")) as (endpoint, url, _):
        with Client(endpoint, timeout=60) as c:
            ref = c.generate(PROMPT, max_tokens=12)
            ref_pieces = list(c.stream(PROMPT, max_tokens=12))
            ref_chat = c.generate("hi there", max_tokens=10, chat=True)
        oa = _openai(url)
        model = oa.models.list().data[0].id
        assert model == tiny_stores("mixtral").name

        r = oa.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
        assert r.choices[0].text == ref.text
        assert r.choices[0].finish_reason == ref.finish_reason
        assert r.usage.prompt_tokens == ref.stats["prompt_tokens"]
        assert r.usage.completion_tokens == len(ref.token_ids) == 12
        assert r.usage.total_tokens == r.usage.prompt_tokens + 12

        chunks = list(oa.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
        texts = [ch.choices[0].text for ch in chunks if ch.choices and ch.choices[0].finish_reason is None]
        assert texts == ref_pieces  # one event per token message, in order
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == ref.finish_reason
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
        assert chunks[-1].usage.prompt_tokens == ref.stats["prompt_tokens"]

        msgs = [{"role": "user", "content": "hi there"}]
        r = oa.chat.completions.create(model=model, messages=msgs, max_tokens=10, temperature=0)
        assert r.choices[0].message.role == "assistant"
        assert r.choices[0].message.content == ref_chat.text
        assert r.usage.prompt_tokens == ref_chat.stats["prompt_tokens"]
        assert r.usage.completion_tokens == len(ref_chat.token_ids)

        chunks = list(oa.chat.completions.create(model=model, messages=msgs, max_tokens=10,
                                                 temperature=0, stream=True))
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == ref_chat.text
        assert chunks[-1].choices[0].finish_reason == ref_chat.finish_reason
        assert all(ch.usage is None for ch in chunks)  # no include_usage: no usage chunk

        # A conversation, rendered with the chat template: another prompt than its last message.
        conv = [{"role": "system", "content": "be brief"}, *msgs,
                {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
        r = oa.chat.completions.create(model=model, messages=conv, max_tokens=4, temperature=0)
        assert r.usage.prompt_tokens > ref_chat.stats["prompt_tokens"]


def test_stop_seed_and_concurrent_requests(tiny_stores):
    with http_runtime(tiny_stores("mixtral")) as (endpoint, url, _):
        oa = _openai(url)
        model = oa.models.list().data[0].id
        with Client(endpoint, timeout=60) as c:
            text = c.generate(PROMPT, max_tokens=16).text
            k = next(k for k in range(1, len(text) - 1) if text.find(text[k:k + 2]) == k
                     and "\ufffd" not in text[k:k + 2])
            stop = text[k:k + 2]
            sampled = c.generate(PROMPT, max_tokens=12, temperature=0.9, top_p=0.9, seed=7)
        for s in (stop, [stop, "never-seen"]):
            r = oa.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0, stop=s)
            assert r.choices[0].text == text[:k]
            assert r.choices[0].finish_reason == "stop"
            chunks = list(oa.completions.create(model=model, prompt=PROMPT, max_tokens=16,
                                                temperature=0, stop=s, stream=True))
            assert "".join(ch.choices[0].text for ch in chunks) == text[:k]
            assert chunks[-1].choices[0].finish_reason == "stop"
        # temperature, top_p and seed reach the runtime: the same sample as the ZeroMQ client's
        r = oa.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0.9,
                                  top_p=0.9, seed=7)
        assert r.choices[0].text == sampled.text
        # max_completion_tokens is the chat's newer name for max_tokens
        r = oa.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}],
                                       max_completion_tokens=3, temperature=0)
        assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"

        # Concurrent streams each get their own replies: the same text as each one run alone.
        prompts = ["one two three", "four five", "six seven eight nine", PROMPT]
        alone = {p: oa.completions.create(model=model, prompt=p, max_tokens=10, temperature=0).choices[0].text
                 for p in prompts}
        together: dict[str, str] = {}

        def run(p):
            together[p] = "".join(ch.choices[0].text for ch in oa.completions.create(
                model=model, prompt=p, max_tokens=10, temperature=0, stream=True))
        threads = [threading.Thread(target=run, args=(p,)) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert together == alone


def test_bad_requests_get_openai_errors(tiny_stores):
    with http_runtime(tiny_stores("mixtral")) as (_, url, _proc):
        oa = _openai(url)
        model = oa.models.list().data[0].id

        def check(status, body, param=None, code=None):
            assert set(body) == {"error"}
            err = body["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"]
            assert err["type"] == ("invalid_request_error" if status < 500 else err["type"])
            assert err["param"] == param and (code is None or err["code"] == code)

        status, body = _post(f"{url}/v1/completions", b"{not json")
        assert status == 400
        check(status, body)
        status, body = _post(f"{url}/v1/chat/completions", json.dumps([1, 2]).encode())
        assert status == 400
        check(status, body)
        for bad, param in (({"messages": "hi"}, "messages"),
                           ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
                           ({"messages": [{"role": "user", "content": "x"}], "temperature": -1}, "temperature"),
                           ({"messages": [{"role": "user", "content": "x"}], "top_p": 0}, "top_p"),
                           ({"messages": [{"role": "user", "content": "x"}], "max_tokens": "9"}, "max_tokens"),
                           ({"messages": [{"role": "user", "content": "x"}], "stop": [1]}, "stop"),
                           ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "n")):
            status, body = _post(f"{url}/v1/chat/completions", json.dumps({"model": model, **bad}).encode())
            assert status == 400, bad
            check(status, body, param)
        for n in (3 << 20, 20000):  # never tokenized; tokenized (~2500 tokens in this vocabulary)
            long = json.dumps({"model": model, "prompt": "the fox " * (n // 8)}).encode()
            status, body = _post(f"{url}/v1/completions", long)
            assert status == 400
            check(status, body, "prompt", "context_length_exceeded")
        big = json.dumps({"model": model, "prompt": "x" * (5 << 20)}).encode()  # http.max_body_bytes: 4 MiB
        status, body = _post(f"{url}/v1/completions", big)
        assert status == 413, body
        check(status, body, code="request_too_large")
        status, body = _post(f"{url}/v1/completions", json.dumps({"prompt": "x"}).encode())
        assert status == 400
        check(status, body, "model")

        # the openai package sees the same: typed exceptions carrying the body
        with pytest.raises(openai.BadRequestError) as e:
            oa.completions.create(model=model, prompt="", max_tokens=4)
        assert e.value.status_code == 400 and e.value.body["param"] == "prompt"
        # refused by the runtime (prompt + max_tokens beyond the context): 400, also when streaming
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as e:
                oa.completions.create(model=model, prompt=PROMPT, max_tokens=10 ** 6, stream=stream)
            assert e.value.body["code"] == "bad_request" and "max_context" in e.value.body["message"]
        with pytest.raises(openai.NotFoundError) as e:
            oa.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=4)
        assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
        with pytest.raises(openai.NotFoundError):
            oa.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
        status, _, text = _get(f"{url}/v1/engines")
        assert status == 404
        check(status, json.loads(text), code="not_found")


def test_health_and_metrics(tiny_stores):
    from prometheus_client.parser import text_string_to_metric_families
    with http_runtime(tiny_stores("mixtral")) as (_, url, _proc):
        oa = _openai(url)
        model = oa.models.list().data[0].id
        oa.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0)
        status, ctype, text = _get(f"{url}/health")
        assert status == 200 and ctype.startswith("application/json")
        health = json.loads(text)
        assert health["status"] == "ok" and health["ok"] is True
        assert set(health["workers"]) == {"router", "loader", "compute"}

        status, ctype, text = _get(f"{url}/metrics")
        assert status == 200 and ctype.startswith("text/plain; version=0.0.4")
        families = {f.name: f for f in text_string_to_metric_families(text)}
        assert all(name.startswith("deltafin_") for name in families)
        counters = [line.split()[2] for line in text.splitlines() if line.endswith(" counter")]
        assert counters and all(name.endswith("_total") for name in counters)  # the parser strips it
        value = lambda name, **labels: next(s.value for s in families[name].samples
                                            if all(s.labels.get(k) == v for k, v in labels.items()))
        assert families["deltafin_requests"].type == "counter"
        assert value("deltafin_requests") >= 1
        assert value("deltafin_decode_tokens") >= 4
        assert value("deltafin_up") == 1
        assert value("deltafin_memory_budget_bytes") == 4 * 2 ** 30
        assert value("deltafin_http_requests", path="/v1/completions", status="200") == 1
        hist = families["deltafin_stage_latency_seconds"]
        assert hist.type == "histogram"
        buckets = [s for s in hist.samples if s.name.endswith("_bucket") and s.labels["stage"] == "compute"]
        counts = [s.value for s in buckets]
        assert counts == sorted(counts) and buckets[-1].labels["le"] == "+Inf"
        count = next(s.value for s in hist.samples
                     if s.name.endswith("_count") and s.labels["stage"] == "compute")
        assert counts[-1] == count > 0


def test_disconnect_mid_stream_and_frontend_restart(tiny_stores):
    with http_runtime(tiny_stores("mixtral")) as (endpoint, url, proc):
        oa = _openai(url)
        model = oa.models.list().data[0].id
        with Client(endpoint, timeout=60) as c:  # how long the answer is when nobody cancels it
            n_alone = len(c.generate(PROMPT, max_tokens=1500).token_ids)
            decoded = c.stats()["totals"]["decode_tokens"]
        assert n_alone > 100
        # The HTTP client goes away after two events of that answer.
        stream = oa.completions.create(model=model, prompt=PROMPT, max_tokens=1500, temperature=0,
                                       stream=True)
        for _, chunk in zip(range(2), stream):
            assert chunk.choices[0].finish_reason is None
        stream.close()
        deadline = time.monotonic() + 30
        while True:
            _, _, text = _get(f"{url}/metrics")
            if "deltafin_http_streams_cancelled_total 1.0" in text or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert "deltafin_http_streams_cancelled_total 1.0" in text
        if hasattr(Client, "cancel"):  # the protocol's cancel: the runtime stopped the request early
            with Client(endpoint, timeout=60) as c:
                deadline = time.monotonic() + 30
                while c.stats()["active_requests"] and time.monotonic() < deadline:
                    time.sleep(0.1)
                stats = c.stats()
            assert stats["active_requests"] == 0
            # compute took the cancel and ended the request before its end (alone it decodes
            # n_alone tokens; on a quiet machine 18-51 of 255 went before the cancel landed, 187
            # once with this machine's two cores busy, so the bound is the whole answer)
            assert stats["workers"]["compute"].get("cancelled", 0) >= 1, stats["workers"]["compute"]
            assert stats["totals"]["decode_tokens"] - decoded < n_alone
        r = oa.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0)
        assert r.usage.completion_tokens == 4

        # The frontend dies: the supervisor starts another on the same port; the runtime never stopped.
        first = _frontend(proc)
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=10)
        deadline = time.monotonic() + 60
        while True:
            try:
                r = oa.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0)
                break
            except (openai.APIConnectionError, openai.APIStatusError):
                assert time.monotonic() < deadline, "the frontend was not restarted"
                time.sleep(0.2)
        assert r.usage.completion_tokens == 4
        assert _frontend(proc).pid != first.pid
        with Client(endpoint, timeout=60) as c:
            assert c.health()["restarts"] == 0  # the workers were not touched


def test_http_is_loopback_unless_allowed(tmp_path):
    # refused before anything else is looked at (the store does not even exist)
    r = subprocess.run([sys.executable, "-m", "deltafin.workers.supervisor", "--model",
                        str(tmp_path / "none"), "--http", "0.0.0.0:8000"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--allow-remote" in r.stderr
    r = subprocess.run([sys.executable, "-m", "deltafin.workers.frontend", "--endpoint", "ipc:///nowhere",
                        "--listen", "192.0.2.1:8000"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--allow-remote" in r.stderr


def test_a_negative_seed_is_its_twos_complement():
    """OpenAI's seed is any int64: -1 samples as 2^64 - 1 does (the runtime's seeds are uint64)."""
    from deltafin.workers.openai_api import ApiError, sampling
    assert sampling({"seed": -1}, 16)["seed"] == sampling({"seed": (1 << 64) - 1}, 16)["seed"] == (1 << 64) - 1
    assert sampling({"seed": 7}, 16)["seed"] == 7 and sampling({}, 16)["seed"] is None
    with pytest.raises(ApiError, match="seed"):
        sampling({"seed": -(1 << 63) - 1}, 16)
