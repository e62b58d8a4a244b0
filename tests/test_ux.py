"""What a new user meets: the budget explaining itself, sizes, a checkpoint given where a store is
wanted, help texts."""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tomllib
from importlib import import_module
from pathlib import Path

import pytest

from deltafin.runtime import budget
from deltafin.runtime.config import ConfigError, load_config, parse_size
from deltafin.runtime.store import Store, StoreError

ARCH = "mixtral"
ROOT = Path(__file__).resolve().parents[1]


# -- sizes ----------------------------------------------------------------------------------------
def test_sizes_mean_what_the_docs_say():
    """A bare letter is binary like the IEC names (400M = 400MiB); the SI names are decimal."""
    assert parse_size("400M") == parse_size("400MiB") == parse_size("400m") == 400 << 20
    assert parse_size("6G") == 6 << 30 and parse_size("6GB") == 6 * 10**9
    assert parse_size("400mb") == 400 * 10**6
    with pytest.raises(ConfigError, match="2\\^20"):
        parse_size("400 megs")
    with pytest.raises(ConfigError, match="more than 0"):
        load_config(None, {"runtime.memory_budget": "0M"})


# -- the plan -------------------------------------------------------------------------------------
def few_slot_budget(store: Store) -> str:
    """A budget whose expert slots at max_context 2048 are fewer than FEW_SLOTS of the experts
    (estimated as the supervisor does) while at 512 they are not."""
    cfg = load_config(None, {"compute.max_context": 512})
    plan = budget.plan_budget(store, cfg)
    total = sum(plan.group_experts.values())
    return str(plan.budget_for(int(budget.FEW_SLOTS * total) + 2))


def test_fit_context_lowers_max_context_for_slots_and_says_how_to_keep_it(tiny_stores):
    store = Store(tiny_stores(ARCH))
    size = few_slot_budget(store)
    total = sum(budget.plan_budget(store, load_config()).group_experts.values())
    cfg = load_config(None, {"runtime.memory_budget": size})
    before = budget.plan_budget(store, cfg).estimated_slots()
    assert before < budget.FEW_SLOTS * total  # the default context starves the experts
    note = budget.fit_context(store, cfg)
    assert cfg.compute.max_context < 2048 and "--max-context 2048" in note
    after = budget.plan_budget(store, cfg).estimated_slots()
    assert after >= budget.FEW_SLOTS * total > before
    # an explicit context is kept
    kept = load_config(None, {"runtime.memory_budget": size, "compute.max_context": 2048,
                              "compute.fit_context": False})
    assert budget.fit_context(store, kept) == "" and kept.compute.max_context == 2048


def test_the_plan_names_each_part_and_what_gives_more_slots(tiny_stores):
    store = Store(tiny_stores(ARCH))
    cfg = load_config(None, {"runtime.memory_budget": few_slot_budget(store), "compute.fit_context": False})
    plan = budget.plan_budget(store, cfg)
    lines = plan.explain(2048, 8, 128)
    assert lines == budget.plan_budget(store, cfg).explain(2048, 8, 128)  # deterministic
    text = "\n".join(lines)
    for part in ("dense weights", "KV cache", "max_context 2048", "activations", "token table", "staging",
                 "expert slots", "few slots", "--max-context 512", "--memory-budget"):
        assert part in text, part
    total = sum(plan.group_experts.values())
    vocab = int(store.config["vocab_size"])
    assert plan.token_table == vocab * budget.TOKEN_TABLE_BYTES_PER_TOKEN  # the store has a tokenizer
    assert re.search(rf"token table +\S+ \S+ \(constrained decoding's, {vocab} tokens\)", text)
    assert re.search(rf"expert slots +\d+ of {total} experts \(\d+%\)", text)
    # the suggested budget gives what it says
    suggested = re.search(r"--memory-budget (\S+) \(about (\d+)\)", text)
    cfg.runtime.memory_budget = suggested[1]
    assert budget.plan_budget(store, cfg).estimated_slots() >= int(suggested[2])


def test_supervisor_prints_its_plan_and_lowers_an_unasked_context(tiny_stores):
    """Real processes: the default command at a budget that max_context 2048 would starve."""
    path = tiny_stores(ARCH)
    size = few_slot_budget(Store(path))
    proc = subprocess.Popen([sys.executable, "-m", "deltafin.workers.supervisor", "--model", str(path),
                             "--memory-budget", size], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("READY"), proc.stderr.read()[-2000:]
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    assert "memory plan for a" in err and "max_context lowered from 2048 to" in err
    assert re.search(r"expert slots +\d+ of \d+ experts", err)


# -- a checkpoint where a store is wanted --------------------------------------------------------
def test_a_checkpoint_given_to_the_supervisor_is_converted_once_and_served(tmp_path, monkeypatch):
    """Store() names a checkpoint and the commands that take it; deltafin-supervisor --model
    CHECKPOINT converts it once into the deltafin cache (as `deltafin chat` does) and serves it, a
    second start reuses that store, and a MODEL that is neither is refused with exit 2."""
    from deltafin.client import Client
    from deltafin.tools.run import running_supervisor
    from deltafin.tools.synth import tiny
    src = tiny(ARCH, tmp_path / "ckpt", seed=3)
    with pytest.raises(StoreError, match=r"this is a checkpoint.*deltafin-convert .* OUT.*deltafin chat"):
        Store(src)
    monkeypatch.setenv("DELTAFIN_CACHE", str(tmp_path / "cache"))
    for _ in range(2):
        with running_supervisor(src, "2GiB", timeout=300) as (ep, _):
            with Client(ep, timeout=120) as c:
                assert len(c.generate([1, 2, 3], max_tokens=4).token_ids) == 4
    stores = list((tmp_path / "cache" / "stores").iterdir())
    assert len(stores) == 1 and (stores[0] / "manifest.json").exists()
    r = subprocess.run([sys.executable, "-m", "deltafin.workers.supervisor", "--model", str(tmp_path / "nothing")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "neither a deltafin store" in r.stderr


# -- help -----------------------------------------------------------------------------------------
class Parsed(Exception):
    pass


def command_parsers(monkeypatch) -> dict:
    """{console script: its argument parser}, each caught as its main() parses."""
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    found = {}

    def catch(self, *a, **k):
        found[name] = self
        raise Parsed
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", catch)
    for name, target in scripts.items():
        module, func = target.split(":")
        with pytest.raises(Parsed):
            getattr(import_module(module), func)(["--help"])
    return found


def all_parsers(p: argparse.ArgumentParser):
    yield p
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from all_parsers(sub)


def test_every_flag_of_every_command_has_help_showing_its_default(monkeypatch):
    missing = []
    for name, top in command_parsers(monkeypatch).items():
        for p in all_parsers(top):
            formatter = p._get_formatter()
            for action in p._actions:
                if not action.option_strings or isinstance(action, argparse._HelpAction):
                    continue
                text = formatter._get_help_string(action) if action.help else ""
                if not action.help or ("default" not in text and not action.required):
                    missing.append(f"{p.prog} {action.option_strings[0]}")
                if re.search(r"issue \d+", text, re.I):
                    missing.append(f"{p.prog} {action.option_strings[0]}: internal words")
            if re.search(r"issue \d+", p.format_help(), re.I):
                missing.append(f"{p.prog}: internal words")
    assert not missing, "\n".join(missing)


# -- sampling users expect ----------------------------------------------------------------------
def test_penalties_and_filters_equal_mlx_lm_definitions():
    """The penalties against mlx-lm's logits processors (last 20 tokens, prompt included), top_k
    and min_p against mlx-lm's filters: the same logits out, the same tokens kept."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.sample_utils import apply_min_p, apply_top_k, make_logits_processors

    from deltafin.protocol import messages as M
    from deltafin.workers.scheduler import PENALTY_CONTEXT, penalize
    rng = np.random.default_rng(0)
    logits = mx.array(rng.normal(0, 3, (1, 300)).astype(np.float32)).astype(mx.bfloat16)
    tokens = [int(t) for t in rng.integers(0, 40, 50)]  # repeats among them
    for kw in ({"repetition_penalty": 1.3}, {"presence_penalty": 0.7}, {"frequency_penalty": -0.4},
               {"repetition_penalty": 0.8, "presence_penalty": 1.1, "frequency_penalty": 0.5}):
        ref = mx.array(logits)  # mlx-lm's processors write into the array they are given
        for proc in make_logits_processors(**kw):
            ref = proc(mx.array(tokens), ref)
        req = M.Generate(id=0, prompt="x", **kw)
        ours = penalize(logits, req, mx.array(tokens[-PENALTY_CONTEXT:], dtype=mx.uint32))
        assert ours.dtype == ref.dtype and np.array_equal(np.array(ours.astype(mx.float32)),
                                                          np.array(ref.astype(mx.float32))), kw
    z = logits.astype(mx.float32)
    logprobs = z - mx.logsumexp(z, axis=-1, keepdims=True)
    from deltafin.workers.scheduler import sample_on_device
    for kw, ref in (({"top_k": 5}, apply_top_k(logprobs, 5)), ({"min_p": 0.1}, apply_min_p(logprobs, 0.1))):
        keep = set(np.flatnonzero(np.isfinite(np.array(ref[0]))))
        req = M.Generate(id=0, prompt="x", temperature=1.0, **kw)
        drawn = {int(sample_on_device(logits, req, mx.random.key(s)).item()) for s in range(300)}
        assert drawn <= keep and len(drawn) > 1, (kw, drawn, keep)


def test_sampling_options_on_zeromq_and_http_with_an_api_key(tiny_stores):
    """Real processes: top_k=1 samples the greedy answer, a seeded penalized request repeats
    itself and differs from the plain one, bad values are refused; HTTP takes the same options
    and, with --api-key, only requests carrying the key."""
    import json
    import socket
    import urllib.error
    import urllib.request

    from deltafin.client import Client, RequestError
    from deltafin.tools.run import running_supervisor
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    key = "s3cret-key"
    store = tiny_stores(ARCH)
    with running_supervisor(store, "4GiB", ["--http", f"127.0.0.1:{port}", "--api-key", key]) \
            as (endpoint, proc):
        with Client(endpoint) as c:
            greedy = c.generate("hello there", max_tokens=12)
            assert c.generate("hello there", max_tokens=12, temperature=1.5, top_k=1).token_ids == greedy.token_ids
            pen = dict(max_tokens=12, repetition_penalty=3.0, frequency_penalty=2.0)
            a = c.generate("hello there", **pen)
            assert a.token_ids == c.generate("hello there", **pen).token_ids != greedy.token_ids
            b = c.generate("hello there", temperature=0.9, seed=5, min_p=0.05, presence_penalty=1.0, max_tokens=12)
            assert b.token_ids == c.generate("hello there", temperature=0.9, seed=5, min_p=0.05,
                                              presence_penalty=1.0, max_tokens=12).token_ids
            for bad in ({"top_k": -1}, {"min_p": 1.5}, {"repetition_penalty": 0.0}, {"presence_penalty": 3.0}):
                with pytest.raises(RequestError):
                    c.generate("hello", max_tokens=2, **bad)
        url = f"http://127.0.0.1:{port}"
        for line in proc.stdout:
            if line.startswith("HTTP "):
                break
        body = json.dumps({"model": store.name, "prompt": "hello there", "max_tokens": 12, "temperature": 0,
                           "repetition_penalty": 3.0, "frequency_penalty": 2.0}).encode()

        def post(headers):
            req = urllib.request.Request(f"{url}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json", **headers})
            try:
                with urllib.request.urlopen(req, timeout=120) as r:
                    return r.status, json.loads(r.read())
            except urllib.error.HTTPError as e:
                return e.code, json.loads(e.read())
        assert post({})[0] == 401 and post({"Authorization": "Bearer wrong"})[0] == 401
        status, answer = post({"Authorization": f"Bearer {key}"})
        assert status == 200 and answer["choices"][0]["text"] == a.text
        with urllib.request.urlopen(f"{url}/health", timeout=60) as r:
            assert r.status == 200


# -- deltafin chat --------------------------------------------------------------------------------
def test_chat_converts_a_checkpoint_once_and_keeps_the_conversation(tmp_path):
    """Real processes, stdin a pipe: a checkpoint directory is converted into the cache (its
    size said), the REPL answers each turn with tok/s and the hit rate, /stats, /budget, /quit;
    a second start reuses the store."""
    import os

    from deltafin.tools.synth import tiny
    src = tiny(ARCH, tmp_path / "ckpt", seed=3)
    env = {**os.environ, "DELTAFIN_CACHE": str(tmp_path / "cache")}
    cmd = [sys.executable, "-m", "deltafin.tools.chat", "chat", str(src), "--memory-budget", "2GiB",
           "--max-tokens", "6"]
    r = subprocess.run(cmd, input="hello\nand again\n/stats\n/budget\n/quit\nnot read\n",
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "is a checkpoint: converting it once" in r.stderr and re.search(r"converted: [\d.]+ \w+ store", r.stderr)
    assert "memory plan for a 2.00 GiB budget" in r.stderr
    answers = re.findall(r"\[(\d+) tokens, [\d.]+ tok/s, hit rate \d+%, prefill (\d+) tokens \(", r.stdout)
    assert len(answers) == 2
    assert int(answers[1][1]) > int(answers[0][1]) + int(answers[0][0])  # the first turn is in the second's prompt
    assert "stage latencies" in r.stdout and "resident expert slots" in r.stdout
    again = subprocess.run(cmd, input="", capture_output=True, text=True, timeout=300, env=env)
    assert again.returncode == 0 and "using the store converted before" in again.stderr


# -- streams equal their final text -------------------------------------------------------------
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "deepseek_v2"])
def test_streamed_pieces_join_to_the_final_text_for_random_texts_and_stops(tiny_stores, arch):
    """Property: for random token sequences (any text the tokenizer can spell, half characters
    included) and random stop strings (pieces of that text, across token boundaries, and
    strangers), the streamed pieces join to exactly the final text, which ends before the first
    stop string."""
    import random

    from deltafin.protocol import messages as M
    from deltafin.runtime.textside import TextSide
    from deltafin.runtime.tokenizer import Tokenizer
    store = Store(tiny_stores(arch))
    tok = Tokenizer(store.tokenizer_dir, store.config)
    vocab = int(store.config["vocab_size"])
    rng = random.Random(29)
    for case in range(400):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 24))]
        full = tok.decode(ids)
        stops = []
        for _ in range(rng.randint(0, 3)):
            if full and rng.random() < 0.7:
                at = rng.randrange(len(full))
                stops.append(full[at:at + rng.randint(1, 5)])
            else:
                stops.append("".join(rng.choice("ab \n.é") for _ in range(rng.randint(1, 3))))
        req = M.Generate(id=1, prompt="x", stop=stops, stream=True)
        side, pieces = TextSide(tok, req, 1), []
        for i, t in enumerate(ids):
            out = side.accept(M.Token(id=1, index=i, token_id=t, text=""))
            pieces.append(out.text if out else "")
            if side.stopped:
                break
        last = side.flush()
        pieces.append(last.text if last else "")
        done = side.done(M.Done(id=1, text="", token_ids=ids, finish_reason="length", stats={}))
        assert "".join(pieces) == done.text, (case, ids, stops)
        assert not any(s in done.text for s in stops if s), (case, ids, stops)
        if not side.stopped:  # all of it, but for a last character still incomplete
            assert full.startswith(done.text) and not full[len(done.text):].strip("\ufffd"), (case, ids)


def test_openai_streams_equal_their_final_text_for_random_stops(tiny_stores):
    """Completions and chat over HTTP: for stop strings drawn from the greedy answer, the
    streamed text equals the non-streamed text."""
    import random

    openai = pytest.importorskip("openai")
    from deltafin.tools.run import running_supervisor
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = tiny_stores("qwen3_moe")
    rng = random.Random(7)
    with running_supervisor(store, "2GiB", ["--http", f"127.0.0.1:{port}"]) as (_ep, proc):
        for line in proc.stdout:
            if line.startswith("HTTP "):
                break
        api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
        for case in range(6):
            prompt = " ".join(rng.choice(["once", "upon", "a", "time", "fox", "é", "\n"]) for _ in range(5))
            base = api.completions.create(model=store.name, prompt=prompt, max_tokens=16, temperature=0).choices[0].text
            at = rng.randrange(max(1, len(base)))
            stop = [base[at:at + rng.randint(1, 3)] or "zz"]
            plain = api.completions.create(model=store.name, prompt=prompt, max_tokens=16, temperature=0, stop=stop)
            streamed = "".join(c.choices[0].text for c in api.completions.create(
                model=store.name, prompt=prompt, max_tokens=16, temperature=0, stop=stop, stream=True) if c.choices)
            assert streamed == plain.choices[0].text, (prompt, stop)
            msgs = [{"role": "user", "content": prompt}]
            plain = api.chat.completions.create(model=store.name, messages=msgs, max_tokens=16, temperature=0, stop=stop)
            streamed = "".join(c.choices[0].delta.content or "" for c in api.chat.completions.create(
                model=store.name, messages=msgs, max_tokens=16, temperature=0, stop=stop, stream=True) if c.choices)
            assert streamed == plain.choices[0].message.content, (prompt, stop)


def test_prefill_progress_is_one_line_on_a_terminal_and_a_line_per_step_in_a_log():
    from deltafin.tools.run import progress_line
    p0 = [{"done": 0, "total": 41, "tok_s": None}]
    p1 = [{"done": 32, "total": 41, "cached": 8, "tok_s": 7.5}]
    assert progress_line(p0, None, tty=True).startswith("\rprefill 0/41 tokens")
    assert progress_line(p0, [0], tty=True).startswith("\r")  # redrawn in place
    assert progress_line(p0, None, tty=False) == "prefill 0/41 tokens, –\n"
    assert progress_line(p0, [0], tty=False) is None  # nothing moved: no repeat in a log
    assert progress_line(p1, [0], tty=False) == "prefill 32/41 tokens (8 cached), 7.5 tok/s\n"


# -- monitor and replay ---------------------------------------------------------------------------
def test_replay_defaults_to_the_runtimes_policy_and_shows_progress(tmp_path, capsys):
    import json

    import numpy as np

    from deltafin.runtime.traces import save_trace
    from deltafin.tools import replay
    rng = np.random.default_rng(0)
    ids = np.stack([np.stack([rng.choice(8, 2, replace=False) for _ in range(2)]) for _ in range(600)])
    save_trace(tmp_path / "t.npz", ids.astype(np.uint8), [600], ["a"])
    out = tmp_path / "r.json"
    assert replay.main([str(tmp_path / "t.npz"), "--cache-frac", "0.5", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["policy"]["policy"] == load_config().cache.policy == "predictive"
    err = capsys.readouterr().err
    assert "predictive: 600 of 600 tokens" in err and "lru: 600 of 600 tokens" in err


def test_monitor_takes_the_client_endpoint_or_the_run_directory(tiny_stores):
    import json

    from deltafin.runtime.telemetry import live_runs, metrics_endpoint
    from deltafin.tools.run import running_supervisor
    with running_supervisor(tiny_stores(ARCH), "2GiB") as (endpoint, proc):
        run = next(r for r in live_runs() if r.pid == proc.pid)
        rundir = next(p for p in __import__("deltafin.runtime.shm", fromlist=["x"]).runs_root().iterdir()
                      if p.name == run.run_id)
        assert metrics_endpoint(endpoint) == metrics_endpoint(str(rundir)) == run.metrics != endpoint
        for given in (endpoint, str(rundir)):
            r = subprocess.run([sys.executable, "-m", "deltafin.tools.monitor", "--endpoint", given,
                                "--once", "--json"], capture_output=True, text=True, timeout=120)
            assert r.returncode == 0, r.stderr
            assert "memory" in json.loads(r.stdout.splitlines()[-1])
    with pytest.raises(ValueError, match="not a deltafin run directory"):
        metrics_endpoint(str(ROOT))
