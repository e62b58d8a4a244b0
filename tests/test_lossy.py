"""The opt-in lossy mode ([lossy], runtime/lossy.py) and deltafin-eval (tools/eval.py).

Off by default, and then exact: a runtime streaming 25% of the experts gives the logits of the
store all resident, bit for bit. cache_aware reads fewer bytes, replaces at most max_share of a
token's experts (the runtime's own counters), changes the answer, and says so in its stats, its
welcome, the monitor and the HTTP responses' system_fingerprint. deltafin-eval's perplexity in
the exact mode is the one mlx-lm's own logits give on the same checkpoint."""
from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest

from deltafin.runtime import lossy
from deltafin.runtime.config import Config, ConfigError, load_config
from deltafin.runtime.store import Store
from deltafin.tools import eval as ev
from deltafin.tools.monitor import format_text
from deltafin.tools.run import running_supervisor
from deltafin.workers.supervisor_args import parser as supervisor_parser
from deltafin.workers.supervisor_args import run_config

from conftest import config_flags
from test_http import _await_line, _free_port

WINDOWS = [[(13 * i + 7 * j) % 500 + 3 for i in range(24)] for j in range(3)]


# -- the rerouting rule ----------------------------------------------------------------------------
def _check_reroute(ids, logits, resident, margin, share, new, n):
    """Every replacement is of a missing expert, by a resident one not already the token's,
    scored within the margin; at most the share per token; the count is right; no replaced
    expert is one the pass reads anyway; and (one row) no missing expert was left where the rule
    still allowed one more replacement."""
    cap = int(share * ids.shape[1] + 1e-9)
    assert n == int((new != ids).sum())
    read = set(new[~resident[new]].tolist())
    assert not read & set(ids[new != ids].tolist()), "a replaced expert is read for another row"
    for t in range(ids.shape[0]):
        z, changed = logits[t], np.flatnonzero(new[t] != ids[t])
        slack = margin * (z.max() - z.min())
        assert len(changed) <= cap
        assert len(set(new[t].tolist())) == ids.shape[1], "a token's experts stay distinct"
        for j in changed:
            assert not resident[ids[t, j]] and resident[new[t, j]]
            assert z[new[t, j]] >= z[ids[t, j]] - slack - 1e-12
        still = [j for j in range(ids.shape[1]) if not resident[new[t, j]]]
        free = [e for e in range(len(z)) if resident[e] and e not in new[t]]
        if ids.shape[0] == 1 and len(changed) < cap and still and free:  # one row: nothing read anyway
            assert max(z[e] for e in free) < min(z[new[t, j]] for j in still) - slack + 1e-12


@pytest.mark.parametrize("seed,n", [(s, n) for s in range(4) for n in (1, 3, 40)])
def test_reroute_keeps_its_rule_on_random_layers(seed, n):
    rng = np.random.default_rng(seed)
    E, k = 16, 4
    logits = rng.normal(size=(n, E))
    ids = np.argsort(-logits, axis=1)[:, :k]
    resident = rng.random(E) < 0.4
    for margin, share in ((0.0, 0.5), (0.1, 0.5), (0.3, 0.25), (1.0, 1.0)):
        new, count = lossy.reroute(ids, logits, resident, margin, share)
        _check_reroute(ids, logits, resident, margin, share, new, count)
        if margin == 1.0 and share == 1.0 and resident.sum() >= 2 * k:
            assert resident[new].all(), "a margin of the whole range replaces every missing expert"


def test_reroute_by_hand():
    logits = np.array([[5.0, 4.0, 3.9, 0.0, 1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 5.0, 4.5, 4.4, 0.0, 0.0, 0.0]])
    ids = np.array([[0, 1], [2, 3]])
    resident = np.array([1, 0, 1, 0, 1, 0, 0, 0], bool)
    new, n = lossy.reroute(ids, logits, resident, 0.1, 0.5)  # slack 0.5 on both rows
    assert new.tolist() == [[0, 2], [2, 4]] and n == 2
    new, n = lossy.reroute(ids, logits, resident, 0.0, 0.5)  # 3.9 < 4.0, 4.4 < 4.5: too far
    assert new.tolist() == ids.tolist() and n == 0
    new, n = lossy.reroute(ids, logits, resident, 1.0, 0.49)  # share under 1 of 2: nothing
    assert n == 0
    # expert 3 cannot be replaced in the second row (1.0 is far below 4.5) and is read anyway:
    # the first row keeps it rather than give up its choice for nothing
    rows = np.array([[0, 3], [2, 3]])
    scores = np.array([[5.0, 0.0, 0.0, 4.0, 3.9, 0.0, 0.0, 0.0], [0.0, 0.0, 5.0, 4.5, 1.0, 0.0, 0.0, 0.0]])
    new, n = lossy.reroute(rows, scores, resident, 0.02, 0.5)
    assert new.tolist() == rows.tolist() and n == 0
    new, n = lossy.reroute(rows[:1], scores[:1], resident, 0.02, 0.5)
    assert new.tolist() == [[0, 4]] and n == 1


# -- configuration ---------------------------------------------------------------------------------
def test_off_by_default_and_checked():
    assert Config().lossy.mode == "off" and load_config().lossy.mode == "off"
    assert lossy.name(Config().lossy) == "exact"
    for bad in ({"mode": "fast"}, {"margin": 1.5}, {"max_share": 0.0}):
        with pytest.raises(ConfigError, match="lossy"):
            Config.from_dict({"lossy": bad})
    with pytest.raises(ConfigError, match="distributed"):
        Config.from_dict({"lossy": {"mode": "cache_aware"}, "distributed": {"enabled": True}})
    a = supervisor_parser().parse_args(["--model", "x", "--lossy", "cache_aware", "--lossy-margin", "0.3",
                                        "--lossy-max-share", "0.25"])
    cfg = run_config(a).lossy
    assert (cfg.mode, cfg.margin, cfg.max_share) == ("cache_aware", 0.3, 0.25)
    assert lossy.fingerprint(lossy.name(cfg)) == "fp_deltafin_cache_aware_m0.3_s0.25"


# -- through the runtime ---------------------------------------------------------------------------
def _quarter_run(store, tmp_path, flags=(), http=False) -> dict:
    """A runtime on 25% of the store's experts, one position per pass, no prefetch (reads are
    the demand's alone): the windows' logits, its stats, its welcome's setting, and with http a
    completion's and a streamed chunk's system_fingerprint."""
    slots = len(Store(store).records) // 4
    extra = config_flags(tmp_path, compute={"prefill_chunk": 1}, cache={"prefetch": False})
    extra += ["--max-slots", str(slots), *flags]
    port = _free_port()
    if http:
        extra += ["--http", f"127.0.0.1:{port}"]
    with running_supervisor(store, "4GiB", extra) as (endpoint, proc):
        run = ev.runtime_pass(endpoint, WINDOWS, generate=0)
        from deltafin.client import Client
        with Client(endpoint) as c:
            run["snapshot"] = c.stats()
        if http:
            url = _await_line(proc, "HTTP ")
            run["fingerprints"] = _http_fingerprints(url, Store(store).path.name)
    return run


def _http_fingerprints(url: str, model: str) -> list:
    out = []
    for stream in (False, True):
        body = json.dumps({"model": model, "prompt": "hello there", "max_tokens": 3, "stream": stream}).encode()
        req = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            text = r.read().decode()
        if stream:
            chunks = [json.loads(line[6:]) for line in text.splitlines()
                      if line.startswith("data: {")]
            out += sorted({c["system_fingerprint"] for c in chunks})
        else:
            out.append(json.loads(text)["system_fingerprint"])
    return out


def test_exact_by_default_and_cache_aware_reads_less(tiny_stores, tmp_path):
    store = tiny_stores("mixtral")
    ref = ev.store_reference(str(store), WINDOWS)
    exact = _quarter_run(store, tmp_path)
    for got, want in zip(exact["logits"], ref):
        assert np.array_equal(got, want), "the default streams 25% of the experts and stays exact"
    assert exact["setting"] == "exact" and exact["lossy"]["exact"] and exact["lossy"]["rerouted"] == 0
    assert exact["bytes_read"] > 0

    fast = _quarter_run(store, tmp_path, ["--lossy", "cache_aware", "--lossy-margin", "1.0",
                                          "--lossy-max-share", "0.5"], http=True)
    name = "cache_aware(margin=1,max_share=0.5)"
    assert fast["setting"] == name
    info = fast["lossy"]
    assert info["mode"] == "cache_aware" and not info["exact"] and info["name"] == name
    assert info["rerouted"] > 0 and info["max_per_token"] == 1
    assert 1 <= info["rerouted_most"] <= 1, "at most max_share x top_k = 1 of a token's 2 experts"
    assert fast["bytes_read"] < exact["bytes_read"], (fast["bytes_read"], exact["bytes_read"])
    assert any(not np.array_equal(a, b) for a, b in zip(fast["logits"], ref)), "the answer changed"
    assert fast["fingerprints"] == [lossy.fingerprint(name)] * 2
    assert "LOSSY " + name in format_text(fast["snapshot"])
    assert " exact " in format_text(exact["snapshot"])


def test_eval_perplexity_equals_mlx_lm_logits(mlx_lm_stores, tmp_path):
    """deltafin-eval through a runtime at 25% of the experts, exact mode: its perplexity is the
    one computed here from mlx-lm's own logits on the same checkpoint, within 1e-4 relative."""
    import mlx.core as mx
    from mlx_lm.utils import load_model
    ckpt, store = mlx_lm_stores("qwen3_moe")
    out = tmp_path / "eval.json"
    assert ev.main(["--model", str(store), "--cache-frac", "0.25", "--tokens", "96", "--window", "48",
                    "--reference", "mlx-lm", "--mlx-model", str(ckpt), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    ids = ev.token_ids(Store(store), ev.load_text(None)[0], 96)
    model, _ = load_model(ckpt)
    nll = []
    for i in range(0, 96, 48):
        w = ids[i:i + 48]
        x = model(mx.array([w]))[0].astype(mx.float32)
        lp = x - mx.logsumexp(x, axis=-1, keepdims=True)
        nll += (-mx.take_along_axis(lp[:-1], mx.array(w[1:])[:, None], axis=-1)[:, 0]).tolist()
    ppl = float(np.exp(np.mean(nll)))
    assert result["setting"] == "exact" and result["tokens"] == 96
    assert abs(result["runtime"]["ppl"] / ppl - 1) < 1e-4, (result["runtime"]["ppl"], ppl)
    assert result["top1_agreement"] == 1.0
