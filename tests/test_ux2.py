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


# -- the forecast with one flag -------------------------------------------------------------------
def run_forecast(tmp_path, *flags) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "forecast.json"
    r = subprocess.run([sys.executable, "-m", "deltafin.tools.forecast", *flags, "--json", str(out)],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "DELTAFIN_CACHE": str(tmp_path / "cache")})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return r, json.loads(out.read_text())


def test_forecast_answers_a_preset_and_a_budget_with_no_other_flag(tmp_path):
    """deltafin-forecast --preset P --memory-budget B alone: it probes this disk (a scratch file
    in the deltafin cache, gone after), states the store size, the budget's parts, how compute
    and messages were had, the shipped trace and its fit, and answers a range low <= high."""
    r, out = run_forecast(tmp_path, "--preset", "dsv2-lite", "--memory-budget", "6GiB")
    text = r.stdout
    for needle in ("assumes: store of dsv2-lite", "assumes: memory 6.00 GiB = dense", "assumes: disk probed here",
                   "assumes: compute not measured", "assumes: messages", "assumes: routing from "
                   "configs/routing_stats.json", "assumes: trace fit: the trace's own shape"):
        assert needle in text, text
    m = re.search(r"forecast: ([\d.e-]+) to ([\d.e-]+) tok/s decode \(middle ([\d.e-]+)\)", text)
    assert m and 0 < float(m[1]) <= float(m[3]) <= float(m[2]), text
    assert out["tok_s_low"] <= out["tok_s_middle"] <= out["tok_s_high"]
    assert out["memory_plan"]["fixed"] + out["n_slots"] * out["shape"]["record_bytes"] <= 6 << 30
    assert not list((tmp_path / "cache").glob(".deltafin-probe-*"))  # the scratch file went


def test_forecast_scales_the_shipped_trace_to_another_shape_and_says_so(tmp_path):
    """--preset kimi-k2 --cache-frac 0.15 alone: the DeepSeek-V2-Lite statistics stand in, scaled
    (x 8/6 misses, 60 layers), the budget that cache needs is named; a budget below what the
    model needs before any expert is refused with the figure."""
    r, out = run_forecast(tmp_path, "--preset", "kimi-k2", "--cache-frac", "0.15")
    assert "384 experts per layer, top-8, 60 MoE layers" in r.stdout and "misses x 8/6" in r.stdout
    assert "the budget needed: --memory-budget" in r.stdout
    assert out["tok_s_low"] <= out["tok_s_high"] and out["cache_frac"] == 0.15
    small = subprocess.run([sys.executable, "-m", "deltafin.tools.forecast", "--preset", "kimi-k2",
                            "--memory-budget", "4GiB"], capture_output=True, text=True, timeout=120)
    assert small.returncode != 0 and "is below what kimi-k2 needs before any expert" in small.stderr


def test_forecast_of_a_machine_not_at_hand_takes_its_disk_and_memory_bandwidth(tmp_path):
    """--disk-gbps and --memory-gbps replace the probes (a Mac forecast from Linux): the lines say
    they were given, and twice the disk gives a faster forecast of the same disk-bound preset."""
    outs = []
    for disk in ("3", "6"):
        r, out = run_forecast(tmp_path, "--preset", "kimi-k3", "--cache-frac", "0.08", "--disk-gbps", disk,
                              "--memory-gbps", "1000")
        assert f"assumes: disk given: {float(disk):.2f} GB/s" in r.stdout and "1000.0 GB/s (given)" in r.stdout
        outs.append(out)
    assert outs[0]["tok_s_middle"] < outs[1]["tok_s_middle"]
    assert not list((tmp_path / "cache").glob(".deltafin-probe-*"))


def test_shipped_routing_statistics_are_what_the_script_derives(tmp_path):
    """configs/routing_stats.json names its source and holds each (policy, fraction) case; the
    script's statistics of a trace agree with the replay's own hit rate."""
    import numpy as np

    from deltafin.runtime.traces import save_trace
    from deltafin.tools.replay import replay
    from deltafin.tools.routing_stats import derive, load_stats
    stats = load_stats()
    assert stats["source"].startswith("dsv2lite-dev.npz") and stats["experts"] == 64 and stats["top_k"] == 6
    for c in stats["cases"]:
        assert abs(sum(c["miss_hist"]) - 1) < 1e-3 and c["hit_rate_p10"] <= c["hit_rate_p90"]
        assert len(c["layer_hit_rate"]) == stats["moe_layers"]
    rng = np.random.default_rng(0)
    ids = np.array([[rng.choice(8, 2, replace=False) for _ in range(3)] for _ in range(40)])  # [tokens, layers, k]
    path = save_trace(tmp_path / "t.npz", ids.astype(np.uint8), [20, 20], ["a", "b"])
    mine = derive(path, 40, fractions=(0.5,), policies=("lru",))["cases"][0]
    assert mine["hit_rate"] == pytest.approx(replay(ids, mine["slots"], "lru")["hit_rate"], abs=1e-6)
