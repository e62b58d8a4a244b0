"""What a new user meets, continued: a chat's default max_tokens, the chat REPL's prompt cache
and Hugging Face cache ids, prefill progress and a token's time split, the forecast with one flag."""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import config_flags

ARCH = "mixtral"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- a chat's default max_tokens ----------------------------------------------------------------
def test_http_chat_without_max_tokens_takes_the_configured_default(tiny_stores, tmp_path):
    """Real processes: with [http] default_max_tokens = 3, an HTTP chat and a ZeroMQ chat that
    give no max_tokens stop at 3 tokens (`length`), the same tokens as max_tokens 3 given; one
    that gives max_tokens keeps it."""
    from deltafin.client import Client
    from deltafin.tools.run import running_supervisor
    port = free_port()
    store = tiny_stores(ARCH)
    messages = [{"role": "user", "content": "hello there, how are you"}]
    flags = config_flags(tmp_path, http={"default_max_tokens": 3})
    with running_supervisor(store, "4GiB", ["--http", f"127.0.0.1:{port}", *flags]) as (endpoint, proc):
        with Client(endpoint) as c:
            given = c.generate(messages, max_tokens=3, chat=True)
            default = c.generate(messages, max_tokens=None, chat=True)
            longer = c.generate(messages, max_tokens=8, chat=True)
        assert given.finish_reason == "length", "the tiny model ended early: pick another prompt"
        assert default.token_ids == given.token_ids and default.finish_reason == "length"
        assert len(longer.token_ids) > 3
        for line in proc.stdout:
            if line.startswith("HTTP "):
                break
        body = json.dumps({"model": store.name, "messages": messages, "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            answer = json.loads(r.read())
    assert answer["usage"]["completion_tokens"] == len(given.token_ids)
    assert answer["choices"][0]["message"]["content"] == given.text


# -- deltafin chat: the prompt cache, Hugging Face cache ids, prefill progress --------------------
def fake_hub_cache(root: Path, model_id: str) -> Path:
    """A Hugging Face hub cache (huggingface_hub's layout) holding a tiny checkpoint of model_id."""
    from deltafin.tools.synth import tiny
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = root / f"models--{model_id.replace('/', '--')}"
    tiny(ARCH, repo / "snapshots" / commit, seed=3)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    return root


def test_chat_takes_a_hub_cache_id_and_reuses_the_previous_turns(tmp_path):
    """Real processes, stdin a pipe: a model id found in a (fake) Hugging Face cache is converted
    and served, never downloaded; the chat's prompt cache gives turn 2 the first turn's blocks
    (the answer line counts them, the stats' hit counters rise) and the answer line splits a
    decode token's time; an id missing from the cache is refused with a hint."""
    env = {**os.environ, "DELTAFIN_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1",
           "HF_HUB_CACHE": str(fake_hub_cache(tmp_path / "hub", "acme/tiny-moe"))}
    long = "the quick brown fox jumps over the lazy dog " * 30  # ~330 tokens: two blocks of 128
    cmd = [sys.executable, "-m", "deltafin.tools.chat", "chat", "acme/tiny-moe", "--memory-budget", "2GiB",
           "--max-tokens", "4"]
    r = subprocess.run(cmd, input=f"{long}\n/stats\nand again\n/stats\n/quit\n", capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "the Hugging Face cache's snapshot" in r.stderr and "is a checkpoint: converting it once" in r.stderr
    assert re.search(r"prompt cache [\d.]+ \w+: each turn reuses", r.stderr)
    answers = re.findall(r"prefill (\d+) tokens \((\d+) from the prompt cache", r.stdout)
    assert len(answers) == 2 and int(answers[0][1]) == 0 and int(answers[1][1]) >= 256
    assert int(answers[1][0]) > int(answers[0][0])
    hits = [int(h) for h in re.findall(r"prompt cache: (\d+) hits of \d+ lookups", r.stdout)]
    assert len(hits) == 2 and hits[1] > hits[0]
    assert re.search(r"per token: compute [\d.]+ ms, waiting [\d.]+ ms, prepare [\d.]+ ms, messages [\d.]+ ms",
                     r.stdout)
    missing = subprocess.run([*cmd[:4], "acme/not-here"], input="", capture_output=True, text=True,
                             timeout=120, env=env)
    assert missing.returncode == 1 and "pass --download" in missing.stderr


# -- prefill progress and a token's time split ----------------------------------------------------
def slow_prefill_flags(tmp_path) -> list[str]:
    """A prefill of many small chunks, each a stand-in wait per layer: seconds long on any machine."""
    return [*config_flags(tmp_path, compute={"prefill_chunk": 8}), "--standin", "--standin-moe-ms", "15",
            "--standin-dense-ms", "15"]


def test_prefill_progress_in_the_stats_the_monitor_and_deltafin_run(tiny_stores, tmp_path):
    """Real processes: while a long prompt is prefilled chunk by chunk, the stats reply and the
    metrics stream say how far it is (0 < done < total, a rate), the monitor shows it and a
    token's time split; deltafin-run prints the progress before the answer."""
    import threading

    from deltafin.client import Client
    from deltafin.runtime.telemetry import metrics_endpoint
    from deltafin.tools.monitor import Feed, format_text
    from deltafin.tools.run import running_supervisor
    store = tiny_stores(ARCH)
    prompt = "the quick brown fox jumps over the lazy dog " * 20
    with running_supervisor(store, "4GiB", slow_prefill_flags(tmp_path)) as (endpoint, _proc):
        feed = Feed(metrics_endpoint(endpoint))
        with Client(endpoint, timeout=120) as c, Client(endpoint, timeout=120) as asker:
            t = threading.Thread(target=c.generate, args=(prompt,), kwargs={"max_tokens": 2})
            t.start()
            try:
                seen, shown = None, None
                for _ in range(400):
                    progress = asker.stats().get("prefill") or []
                    seen = seen or next((p for p in progress if 0 < p["done"] < p["total"]), None)
                    snaps = [s for s in feed.poll() if s.get("prefill") and s.get("window")]
                    shown = shown or (format_text(snaps[-1]) if snaps else None)
                    if seen and shown:
                        break
                    threading.Event().wait(0.05)
            finally:
                t.join(timeout=120)
                feed.close()
    assert seen and seen["tok_s"] and seen["total"] > 150, seen
    assert re.search(r"prefilling\s+\d+/\d+ tokens, [\d.,]+ tok/s", shown), shown
    assert re.search(r"token time\s+compute [\d.]+, waiting [\d.]+, prepare [\d.]+, messages [\d.]+ ms", shown), shown
    r = subprocess.run([sys.executable, "-m", "deltafin.tools.run", "--model", str(store), "--prompt", prompt,
                        "--max-tokens", "2", "--memory-budget", "4GiB", "--config", slow_prefill_flags(tmp_path)[1],
                        "--standin", "--standin-moe-ms", "15", "--standin-dense-ms", "15"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert re.search(r"prefill \d+/\d+ tokens, [\d.,]+ tok/s", r.stderr), r.stderr[-2000:]
