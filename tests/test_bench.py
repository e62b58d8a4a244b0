"""deltafin-bench, deltafin-forecast and the memory cap, run for real on a tiny store.

No timing is asserted: the tests check that every contender ran (or says why not), that the
report holds the design notes' metrics, and that the bound and shares are the arithmetic the
docs promise, recomputed here from the report's own fields.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from deltafin.runtime.store import Store
from deltafin.runtime.traces import save_trace
from deltafin.tools import bench, bench_modes, bench_report, forecast
from deltafin.tools.memcap import MemoryCap
from deltafin.tools.peer_runner import PEERS, missing_package


def _trace(path: Path, store: Store, tokens: int = 64) -> Path:
    rng = np.random.default_rng(3)
    ids = np.stack([np.stack([rng.choice(store.n_experts, store.top_k, replace=False)
                              for _ in store.moe_layers]) for _ in range(tokens)]).astype(np.uint8)
    return save_trace(path, ids, [tokens], ["synthetic"])


@pytest.fixture(scope="module")
def bench_run(tiny_stores, tmp_path_factory):
    store = Store(tiny_stores("deepseek_v2"))
    out = tmp_path_factory.mktemp("bench")
    trace = _trace(out / "trace.npz", store)
    argv = ["--store", str(store.path), "--trace", str(trace), "--quick", "--prompt-tokens", "4",
            "--max-tokens", "4", "--cache-frac", "0.5", "--no-drop-cache", "--out", str(out / "run"),
            "--standin-moe-ms", "2", "--standin-dense-ms", "1"]
    assert bench.main(argv) == 0
    return store, trace, json.loads((out / "run" / "report.json").read_text()), out / "run"


def test_every_contender_runs_or_says_why(bench_run):
    _, _, report, _ = bench_run
    assert set(report["regimes"]) == {"standin", "real"}
    for regime, rr in report["regimes"].items():
        assert set(rr["contenders"]) == set(bench_modes.CONTENDERS)
        for name, r in rr["contenders"].items():
            if name in ("mlx-lm", *PEERS) and regime == "standin":
                assert not r["ok"] and "not applicable" in r["cause"]
                continue
            if name in PEERS and r.get("skipped"):  # not installed, or deepseek_v2 not streamed
                assert r["cause"]
                continue
            assert r["ok"], f"{regime}/{name}: {r.get('cause')}"
            assert r["generated_tokens"] == rr["max_tokens"]
            assert r["decode_tok_s"] > 0 and r["peak_tree_pss_bytes"] > 0
        for name in bench_modes.DELTAFIN_MODES:
            r = rr["contenders"][name]
            assert r["bench_mode"]["routing"].startswith("trace:")
            assert (r["bench_mode"]["standin"] is not None) == (regime == "standin")
            assert 0 <= r["hit_rate"] <= 1 and r["stage_latency"]["prepare"]["count"] > 0
            assert r["host_s_per_token"] > 0
            # a trace routes these passes: none runs ahead, so none misses (the figure is there)
            assert r["missed_passes"] == 0 and r["miss_s_per_token"] == 0
            assert r["miss_split_s_per_token"] == {"wait": 0, "sync": 0, "ipc": 0, "prepare": 0}
            if regime == "standin":  # compute's thread sleeps through the stand-in's layers
                assert r["host_s_per_token"] < r["time_per_token_s"]
            # the slots the bound assumes are the slots it ran with (or the report says so)
            assert r["slots_short"] == report["setup"]["n_slots"] - r["n_slots"] >= 0


def test_the_bound_and_shares_are_the_documented_arithmetic(bench_run):
    store, _, report, _ = bench_run
    s = report["setup"]
    for regime, rr in report["regimes"].items():
        b = rr["bound"]
        assert b["s_per_token"] == max(b["compute_s_per_token"], b["read_s_per_token"])
        reads = b["reads"]
        assert reads["bytes_per_token"] == pytest.approx(reads["reads_per_token"] * s["record_bytes"])
        assert b["read_s_per_token"] == pytest.approx(reads["bytes_per_token"] / (reads["gbps"] * 1e9))
        if regime == "standin":
            n_dense = s["layers"] - s["moe_layers"]
            assert b["compute_s_per_token"] == pytest.approx((s["moe_layers"] * 2 + n_dense * 1) / 1e3)
        else:  # measured over as many decode steps as the contenders decode, its median
            c = b["compute"]
            assert c["samples"] == max(3, rr["max_tokens"] - 1)
            assert 0 < c["s_per_token"] <= c["p90_s_per_token"] and c["mean_s_per_token"] > 0
        checked = 0
        for r in rr["contenders"].values():
            if r.get("ok"):
                assert r["share_of_bound"] == pytest.approx(r["decode_tok_s"] * b["s_per_token"])
            if r.get("ok") and r.get("bytes_read_per_token") is not None:
                # its own bound: max(compute, its own bytes per token at the probed rate)
                own = max(b["compute_s_per_token"], r["bytes_read_per_token"] / (report["disk"]["gbps"] * 1e9))
                assert r["own_bound_s_per_token"] == pytest.approx(own)
                assert r["time_over_own_bound"] == pytest.approx(1.0 / r["decode_tok_s"] / own)
                checked += 1
        assert checked > 0


def test_greedy_tokens_agree_across_deltafin_modes_and_mmap(bench_run):
    """Policy and expert source never change the output (real compute, same routing)."""
    _, _, report, _ = bench_run
    real = report["regimes"]["real"]["contenders"]
    tokens = {n: real[n]["token_ids"] for n in (*bench_modes.DELTAFIN_MODES, "mmap")}
    assert len({tuple(t) for t in tokens.values()}) == 1, tokens


def test_chart_and_table(bench_run):
    pytest.importorskip("matplotlib")
    _, _, report, run = bench_run
    png = run / "chart.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = bench_report.table(report)
    for name in bench_modes.CONTENDERS:
        assert name in text


@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe"])
def test_real_peers_run_on_the_exported_checkpoint_and_give_mlx_lms_tokens(arch, tiny_stores, tmp_path):
    """mlx-vlm and rapid-mlx on their own layouts of the store's mlx-lm export, routed by the
    gate: each gives mlx-lm's greedy tokens (the report says so), its expert budget is deltafin's
    share of the expert bytes, and rapid-mlx says why it skips an architecture it does not stream.
    A peer whose package is not installed is reported as skipped."""
    pytest.importorskip("mlx_lm")
    store = Store(tiny_stores(arch))
    argv = ["--store", str(store.path), "--trace", "none", "--regimes", "real", "--prompt-tokens", "6",
            "--max-tokens", "8", "--cache-frac", "0.5", "--no-drop-cache", "--out", str(tmp_path / "run"),
            "--contenders", ",".join(["mlx-lm", *PEERS])]
    at_peak = arch == "qwen3_moe" and not missing_package("mlx-vlm")
    if at_peak:  # and mlx-vlm again at deltafin's measured peak memory
        argv[-1] += ",deltafin,mlx-vlm@mem"
    assert bench.main(argv) == 0
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["setup"]["routing"] == "gate"
    # the bound's compute term: the median of as many decode steps as the contenders decode
    assert report["regimes"]["real"]["bound"]["compute"]["samples"] == 7
    rr = report["regimes"]["real"]["contenders"]
    assert rr["mlx-lm"]["ok"], rr["mlx-lm"].get("cause")
    share = report["setup"]["n_slots"] / report["setup"]["n_experts_total"]
    for name in PEERS:
        r = rr[name]
        missing = missing_package(name)
        if missing or (name == "rapid-mlx" and arch == "qwen3_moe"):
            assert r["skipped"] and not r["ok"]
            assert (missing or "not supported") in r["cause"]
            continue
        assert r["ok"], r.get("cause")
        assert r["generated_tokens"] == 8 and r["decode_tok_s"] > 0 and r["peak_tree_pss_bytes"] > 0
        assert 0 <= r["hit_rate"] <= 1 and r["bytes_read_per_token"] >= 0
        assert int(r["expert_cache_gb"] * 1e9) == share * store.expert_bytes_total  # as the peers read it
        assert r["vs_mlx_lm"] == {"exact": True, "first_divergence": None, "rounds_compared": 1, "rounds_exact": 1}
        assert r["token_ids"] == rr["mlx-lm"]["token_ids"]
    if not missing_package("mlx-vlm"):  # its layout is built once, beside the export
        assert (Path(str(store.path) + ".mlx-vlm") / "offload_index.json").exists()
    if at_peak:
        r, same, mine = rr["mlx-vlm@mem"], rr["mlx-vlm"], rr["deltafin"]
        assert r["ok"], r.get("cause")
        moved = (mine["peak_tree_pss_bytes"] - same["peak_tree_pss_bytes"]) / 1e9
        assert r["expert_cache_gb"] == pytest.approx(same["expert_cache_gb"] + moved)
        assert r["token_ids"] == rr["mlx-lm"]["token_ids"]


def test_a_peer_at_equal_memory_needs_both_peaks_first():
    s = SimpleNamespace(n_slots=4, store=SimpleNamespace(records=range(16), expert_bytes_total=16e9))
    ok = {"ok": True, "peak_tree_pss_bytes": 3e9}
    assert bench.equal_memory_gb(s, {"deltafin": [ok]}, "mlx-vlm")[0] is None
    assert bench.equal_memory_gb(s, {"deltafin": [{**ok, "peak_tree_pss_bytes": 4e9}], "mlx-vlm": [ok]},
                                 "mlx-vlm")[0] == pytest.approx(5.0, abs=1e-9)
    gb, why = bench.equal_memory_gb(s, {"deltafin": [{**ok, "peak_tree_pss_bytes": 1e6}],
                                        "mlx-vlm": [{**ok, "peak_tree_pss_bytes": 6e9}]}, "mlx-vlm")
    assert gb is None and "below" in why
    assert bench_modes.bad_contender("mlx-vlm@mem") is None and bench_modes.bad_contender("mlx-lm@mem")
    # every mode with settings of its own is a contender the bench takes by name
    for name in bench_modes.DELTAFIN_MODE_CONFIG:
        assert bench_modes.bad_contender(name) is None, name


def test_a_peer_without_its_package_is_skipped_with_the_cause(tiny_stores, monkeypatch):
    from deltafin.tools import peer_runner
    monkeypatch.setitem(peer_runner.PEERS, "mlx-vlm", "no_such_package_deltafin_test")
    store = Store(tiny_stores("qwen3_moe"))
    layout, why = bench.prepare_peers(["mlx-vlm"], store, None, "not asked")["mlx-vlm"]
    assert layout is None and "no_such_package_deltafin_test is not installed" in why
    s = bench.Setup(store=store, trace_path=None, trace_ids=None, history_path=None, n_slots=4, budget=1 << 30,
                    prompt_ids=[1], max_tokens=1, max_context=64, dtype="float32", standin_moe_ms=1.0,
                    standin_dense_ms=1.0, timeout_s=10.0, out=Path("."), peers={"mlx-vlm": (layout, why)})
    r = bench.run_contender(s, "real", "mlx-vlm", None, None)
    assert r == {"ok": False, "skipped": True, "cause": why}


def test_token_agreement_finds_the_first_divergence():
    assert bench_report.token_agreement([1, 2, 3], [1, 2, 3]) == {"exact": True, "first_divergence": None}
    assert bench_report.token_agreement([1, 5, 3], [1, 2, 3]) == {"exact": False, "first_divergence": 1}
    assert bench_report.token_agreement([1, 2], [1, 2, 3]) == {"exact": False, "first_divergence": 2}
    runs = [{"ok": True, "token_ids": [1, 2, 3]}, {"ok": True, "token_ids": [1, 2, 4]}, {"ok": False}]
    ref = [{"ok": True, "token_ids": [1, 2, 3]}] * 3
    assert bench_report.agreement_over_rounds(runs, ref) == {
        "exact": False, "first_divergence": 2, "rounds_compared": 2, "rounds_exact": 1}
    assert bench_report.agreement_over_rounds([{"ok": False}], ref) is None


def test_prefetch_contenders_parse_into_cache_overrides():
    assert bench_modes.prefetch_mode("deltafin-pf:t=0.6:d=1") == {
        "prefetch": True, "prefetch_threshold": 0.6, "prefetch_depth": 1}
    assert bench_modes.mode_config("deltafin-pf:d=3") == {"cache": {"prefetch": True, "prefetch_depth": 3}}
    assert bench_modes.bad_contender("deltafin-pf:t=0.6:d=1") is None and bench_modes.bad_contender("mmap") is None
    for bad, why in [("deltafin-pf:t=1.5", "prefetch_threshold"), ("deltafin-pf:d=0", "prefetch_depth"),
                     ("deltafin-pf:t=x", "bad value"), ("deltafin-pf:gate=off", "not t="),
                     ("deltafin-pf:x=1", "not t="),
                     ("deltafin-pf:t=", "not t=")]:
        assert why in bench_modes.bad_contender(bad)
    assert bench_modes.bad_contender("deltafin-fast") == "deltafin-fast"
    assert bench.main(["--contenders", "deltafin-pf:t=0.6,d=1"]) == 2  # commas split contenders


def test_rounds_summary_and_the_sweep_figure_are_medians_and_ratios():
    runs = [{"ok": True, "decode_tok_s": v, "hit_rate": h, "loader": {"disk_busy_share": b, "reads": 7},
             "peak_tree_pss_bytes": pk, "tag": i}
            for i, (v, h, b, pk) in enumerate([(1.0, 0.5, 0.0, 4000), (1.5, 0.9, 0.3, 1000), (1.2, 0.6, 0.1, 1100)])]
    runs.append({"ok": False, "cause": "boom"})
    r = bench_report.summarize_rounds(runs)
    assert r["decode_tok_s"] == 1.2 and r["tag"] == 2  # the round nearest the median
    # a peak is the highest round's; the disk's busy share the rounds' median (the rest kept)
    assert r["peak_tree_pss_bytes"] == 4000 and r["loader"] == {"disk_busy_share": pytest.approx(0.1), "reads": 7}
    assert [x["peak_tree_pss_bytes"] for x in r["rounds"]] == [4000, 1000, 1100, None]
    assert r["hit_rate"] == pytest.approx(0.6) and r["time_per_token_s"] == pytest.approx(1 / 1.2)
    assert r["decode_tok_s_spread"] == pytest.approx(1.5) and r["rounds_ok"] == 3
    assert [x["ok"] for x in r["rounds"]] == [True, True, True, False]
    two = bench_report.summarize_rounds(runs[:2])
    assert two["decode_tok_s"] == pytest.approx(1.25) and two["hit_rate"] == pytest.approx(0.7)
    assert bench_report.summarize_rounds(runs[:1]) is runs[0]
    assert bench_report.summarize_rounds(runs[3:] * 2)["rounds_ok"] == 0
    c = {"deltafin-pf:t=0.2:d=1": {"ok": True, "decode_tok_s": 1.5},
         "deltafin-pf:t=0.6:d=1": {"ok": True, "decode_tok_s": 1.8},
         "deltafin-no-prefetch": {"ok": True, "decode_tok_s": 1.6},
         "deltafin-sync-lru": {"ok": True, "decode_tok_s": 9.0},
         "deltafin-pf:t=0.8:d=1": {"ok": False}}
    sw = bench_report.prefetch_sweep(c)
    assert (sw["min_gated"], sw["max_fixed"]) == ("deltafin-pf:t=0.2:d=1", "deltafin-no-prefetch")
    assert sw["ratio"] == pytest.approx(1.5 / 1.6)
    assert bench_report.prefetch_sweep({"deltafin-no-prefetch": c["deltafin-no-prefetch"]}) is None


def test_prefetch_settings_run_alternating_in_rounds(tiny_stores, tmp_path):
    """A sweep for real: two prefetch settings and prefetch off, two rounds alternating; each
    round writes its own settings file, and the settings reach the router."""
    store = Store(tiny_stores("deepseek_v2"))
    trace = _trace(tmp_path / "trace.npz", store)
    names = ["deltafin-pf:t=0.3:d=2", "deltafin-pf:t=0.5:d=1", "deltafin-no-prefetch"]
    argv = ["--store", str(store.path), "--trace", str(trace), "--quick", "--prompt-tokens", "4",
            "--max-tokens", "3", "--cache-frac", "0.5", "--no-drop-cache", "--out", str(tmp_path / "run"),
            "--standin-moe-ms", "2", "--standin-dense-ms", "1", "--regimes", "standin",
            "--contenders", ",".join(names), "--rounds", "2"]
    assert bench.main(argv) == 0
    rr = json.loads((tmp_path / "run" / "report.json").read_text())["regimes"]["standin"]
    assert rr["rounds"] == 2 and list(rr["contenders"]) == names
    for name, r in rr["contenders"].items():
        assert r["ok"] and r["rounds_ok"] == 2 and len(r["rounds"]) == 2, r.get("cause")
        assert r["decode_tok_s"] == pytest.approx(np.median([x["decode_tok_s"] for x in r["rounds"]]))
        if "pf:" in name:  # the router's prefetcher ran with the setting the name gives
            assert r["prefetch_gate"]["gate"] is True
            assert set(r["prefetch_gate"]) >= {"precision_d1"}
        else:
            assert r["prefetch_gate"] is None
    for i in (1, 2):
        toml = (tmp_path / "run" / f"standin-deltafin-pf:t=0.3:d=2-r{i}.toml").read_text()
        assert "prefetch_threshold = 0.3" in toml and "prefetch_depth = 2" in toml
        assert (tmp_path / "run" / f"standin-deltafin-no-prefetch-r{i}.log").exists()
    assert rr["prefetch_sweep"]["min_gated"] in names[:2]
    assert rr["prefetch_sweep"]["max_fixed"] == names[2]


def test_the_real_bound_is_measured_again_every_round(tiny_stores, tmp_path, capsys):
    """In the real regime the bound's compute term is measured before every round, and the
    bound, the shares and /own use the median of those measurements."""
    store = Store(tiny_stores("deepseek_v2"))
    argv = ["--store", str(store.path), "--trace", "none", "--quick", "--prompt-tokens", "4",
            "--max-tokens", "5", "--cache-frac", "0.5", "--no-drop-cache", "--out", str(tmp_path / "run"),
            "--regimes", "real", "--contenders", "deltafin", "--rounds", "3"]
    assert bench.main(argv) == 0
    rr = json.loads((tmp_path / "run" / "report.json").read_text())["regimes"]["real"]
    b = rr["bound"]
    assert len(b["compute_rounds_s"]) == 3 and all(x > 0 for x in b["compute_rounds_s"])
    assert b["compute_s_per_token"] == pytest.approx(float(np.median(b["compute_rounds_s"])))
    assert b["s_per_token"] == max(b["compute_s_per_token"], b["read_s_per_token"])
    r = rr["contenders"]["deltafin"]
    assert r["share_of_bound"] == pytest.approx(r["decode_tok_s"] * b["s_per_token"])
    assert r["time_over_own_bound"] == pytest.approx(1.0 / r["decode_tok_s"] / r["own_bound_s_per_token"])
    assert r["own_bound_s_per_token"] >= b["compute_s_per_token"]
    assert "one per round" in capsys.readouterr().out


@pytest.mark.parametrize("calibrate", ["run", "micro"])
def test_forecast_checks_a_bench_report(bench_run, tmp_path, calibrate):
    store, trace, _, run = bench_run
    out = tmp_path / "f.json"
    assert forecast.main(["--check", str(run / "report.json"), "--trace", str(trace), "--json", str(out),
                          "--disk-gbps", "1.0", "--calibrate", calibrate]) == 0
    f = json.loads(out.read_text())
    assert f["calibration"]["mode"] == calibrate
    if calibrate == "run":  # constants measured by a real run of the runtime on the store
        cal = f["calibration"]["run"]
        assert cal["prepare_s_per_miss"] > 0 and cal["hop_s_per_missing_layer"] > 0
    assert {c["contender"] for c in f["cases"]} == set(bench_modes.DELTAFIN_MODES)
    for c in f["cases"]:
        fc = c["forecast"]
        parts = fc["compute_s"] + fc["rest_s"] + fc["read_s"] + fc["prepare_s"] + fc["messages_s"]
        assert fc["s_per_token"] == pytest.approx(parts)
        assert c["ratio"] == pytest.approx(c["forecast_tok_s"] / c["measured_tok_s"])


def test_forecast_model_prices_misses():
    """All-resident layers cost only compute; a miss costs two round trips, its read and a fill."""
    shape = forecast.Shape("t", n_moe=2, n_dense=1, n_experts=8, top_k=2, record_bytes=1_000_000)
    gbps = {1: 1.0, 2: 2.0}
    none = forecast.forecast(shape, np.zeros((3, 2)), 0.01, 1e-4, 1e-3, gbps, 2)
    assert none["s_per_token"] == pytest.approx(0.01)
    one = forecast.forecast(shape, np.array([[1, 0]] * 3), 0.01, 1e-4, 1e-3, gbps, 2)
    assert one["s_per_token"] - none["s_per_token"] == pytest.approx(2e-4 + 1e6 / 1e9 + 1e-3)
    two = forecast.forecast(shape, np.array([[2, 0]] * 3), 0.01, 1e-4, 1e-3, gbps, 2)
    assert two["read_s"] == pytest.approx(2e6 / 2e9)
    assert two["prepare_s"] == pytest.approx(2e-3)
    assert two["hit_rate"] == pytest.approx(1 - 6 / 12)
    cal = {"prepare_s_per_miss": 1e-3, "hop_s_per_missing_layer": 1e-4, "rest_s_per_token": 0.002,
           "wait_s_per_round": 5e-3}
    situ = forecast.forecast_in_situ(shape, np.array([[3, 0]] * 3), 0.01, cal, 2)
    assert situ["s_per_token"] == pytest.approx(0.01 + 0.002 + 1e-4 + 2 * 5e-3 + 3 * 1e-3)


def test_forecast_for_a_preset_uses_the_trace_at_the_same_cache_fraction(tmp_path):
    trace_dir = Path(__file__).resolve().parents[2] / "shared" / "traces"
    if not (trace_dir / "dsv2lite-test.npz").exists():
        pytest.skip("../shared/traces is not here")
    out = tmp_path / "k.json"
    assert forecast.main(["--preset", "kimi-k2", "--cache-frac", "0.1", "--cache-frac", "0.5",
                          "--trace", str(trace_dir / "dsv2lite-test.npz"), "--disk-gbps", "5",
                          "--hop-ms", "0.1", "--prepare-ms", "0", "--compute-ms-per-token", "30",
                          "--json", str(out)]) == 0
    cases = json.loads(out.read_text())["cases"]
    assert cases[0]["tok_s"] < cases[1]["tok_s"]  # a larger cache reads less
    assert cases[0]["misses_per_token"] > cases[1]["misses_per_token"]


def _cgroups_usable() -> bool:
    cap = MemoryCap(64 << 20, f"deltafin-test-probe-{os.getpid()}")
    ok = cap.enforced
    cap.remove()
    return ok


def test_memory_cap_kills_a_process_that_exceeds_it():
    if not _cgroups_usable():
        pytest.skip("no memory cgroup can be made here (not root, or not Linux)")
    cap = MemoryCap(96 << 20, f"deltafin-test-{os.getpid()}")
    try:
        grow = "b = bytearray(400 << 20)\nfor i in range(0, len(b), 4096): b[i] = 1\nprint('survived')"
        p = subprocess.run([sys.executable, "-c", grow], preexec_fn=cap.enter, capture_output=True, timeout=60)
        assert p.returncode != 0 and b"survived" not in p.stdout
        assert cap.oom_kills() >= 1
        assert cap.peak_bytes() <= (96 << 20) + (1 << 20)
    finally:
        cap.remove()


def test_memory_cap_lets_a_small_process_live():
    if not _cgroups_usable():
        pytest.skip("no memory cgroup can be made here (not root, or not Linux)")
    cap = MemoryCap(256 << 20, f"deltafin-test-small-{os.getpid()}")
    try:
        p = subprocess.run([sys.executable, "-c", "b = bytearray(8 << 20); print('ok')"], preexec_fn=cap.enter,
                           capture_output=True, timeout=60)
        assert p.returncode == 0 and cap.oom_kills() == 0
    finally:
        cap.remove()
