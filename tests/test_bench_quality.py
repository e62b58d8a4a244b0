"""deltafin-bench --quality (tools/bench_quality.py): perplexity and top-1 agreement through each
deltafin contender's own runtime, against the exact run, beside its speed; the SVG plot.

Real processes on a tiny store: the exact contenders (the default and the synchronous LRU mode,
both streaming a quarter of the experts) give the perplexity of the store with every expert
resident computed here in-process, so their ratio to exact is 1 and they agree on every position;
a lossy contender names its setting and is scored against the exact run."""
from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import numpy as np
import pytest

from deltafin.runtime.store import Store
from deltafin.tools import bench, bench_modes, bench_quality
from deltafin.tools import eval as ev

LOSSY = "deltafin-lossy@1:0.5"


@pytest.fixture(scope="module")
def quality_run(tiny_stores, tmp_path_factory):
    store = Store(tiny_stores("mixtral"))
    out = tmp_path_factory.mktemp("benchq")
    argv = ["--store", str(store.path), "--trace", "none", "--regimes", "real", "--quick", "--prompt-tokens", "4",
            "--max-tokens", "4", "--cache-frac", "0.25", "--no-drop-cache", "--out", str(out / "run"),
            "--contenders", f"deltafin,deltafin-sync-lru,{LOSSY}", "--quality", "--quality-tokens", "48",
            "--quality-window", "24", "--plot", str(out / "trade.svg")]
    assert bench.main(argv) == 0
    return store, json.loads((out / "run" / "report.json").read_text()), out / "trade.svg"


def test_exact_contenders_score_as_the_resident_store_and_lossy_names_its_setting(quality_run):
    store, report, _ = quality_run
    d = report["setup"]["quality"]
    wins = ev.windows(ev.token_ids(store, ev.load_text(None)[0], 48), 24)
    assert d["tokens"] == 48 and d["windows"] == len(wins) == 2
    ref = ev.compare(ev.store_reference(str(store.path), wins), None, wins)["runtime"]
    rows = {q["contender"]: q for q in report["regimes"]["real"]["quality"]}
    assert list(rows) == ["deltafin", "deltafin-sync-lru", LOSSY]
    for name in ("deltafin", "deltafin-sync-lru"):
        q = rows[name]
        assert q["setting"] == "exact" and q["rerouted_per_position"] == 0
        assert q["ppl"] == pytest.approx(ref["ppl"], rel=1e-12), "streamed exact = every expert resident"
        assert q["ppl_vs_exact"] == 1.0 and q["top1_agreement"] == 1.0
        assert q["decode_tok_s"] > 0 and q["bytes_read_per_token"] is not None and q["hit_rate"] is not None
    q = rows[LOSSY]
    assert q["setting"] == "cache_aware(margin=1,max_share=0.5)"
    assert q["ppl_vs_exact"] == pytest.approx(q["ppl"] / ref["ppl"], rel=1e-12)
    assert 0.0 <= q["top1_agreement"] <= 1.0
    assert report["regimes"]["real"]["contenders"][LOSSY]["quality"]["setting"] == q["setting"]


def test_the_plot_is_svg_with_one_point_per_setting(quality_run):
    _, report, svg = quality_run
    root = ET.parse(svg).getroot()
    ns = {"s": "http://www.w3.org/2000/svg"}
    points = root.findall(".//s:circle[@class='point']", ns)
    assert len(points) == len(report["regimes"]["real"]["quality"]) == 3
    titles = [p.find("s:title", ns).text for p in points]
    assert any(t.startswith("cache_aware(margin=1,max_share=0.5)") for t in titles)
    ys = [float(p.get("cy")) for p in points]
    rates = [q["decode_tok_s"] for q in report["regimes"]["real"]["quality"]]
    assert np.argmax(rates) == np.argmin(ys), "faster settings are drawn higher"


def test_quality_flags_are_checked():
    p = bench.build_parser()
    ok = p.parse_args(["--quality", "--trace", "none", "--regimes", "real"])
    assert bench_quality.problem(ok, ["real"], ["deltafin", LOSSY]) is None
    assert "--trace none" in bench_quality.problem(p.parse_args(["--quality"]), ["real"], ["deltafin"])
    assert "regimes real" in bench_quality.problem(ok, ["standin", "real"], ["deltafin"])
    assert "deltafin" in bench_quality.problem(ok, ["real"], [LOSSY])
    assert "--plot needs" in bench_quality.problem(p.parse_args(["--plot", "x.svg"]), ["real"], ["deltafin"])


def test_lossy_contenders_parse_into_the_runtimes_flags():
    assert bench_modes.mode_flags("deltafin-lossy@0.3") == ["--lossy", "cache_aware", "--lossy-margin", "0.3"]
    assert bench_modes.mode_flags(LOSSY) == ["--lossy", "cache_aware", "--lossy-margin", "1",
                                             "--lossy-max-share", "0.5"]
    assert bench_modes.is_deltafin(LOSSY) and bench_modes.bad_contender(LOSSY) is None
    assert "margin" in bench_modes.bad_contender("deltafin-lossy@2")
    assert "<margin>" in bench_modes.bad_contender("deltafin-lossy@x")
    assert "<margin>" in bench_modes.bad_contender("deltafin-lossy@0.1:0.5:1")


def test_a_refused_quality_pass_keeps_the_speed_figures_and_says_why():
    """A runtime that refuses the windows (over its reply limit) is scored as having no quality
    figure; the others are still scored against the exact run, and the table says why."""
    win = [5, 1, 2]
    logits = np.zeros((3, 8), np.float32)
    logits[:, 1], logits[:, 2] = 2.0, 1.0
    scores = [ev.next_token_scores(logits, win)]
    quality = lambda: {"setting": "exact", "rerouted": 0, "scores": list(scores)}
    runs = {"deltafin": [{"ok": True, "quality": quality()}],
            "deltafin-sync-lru": [{"ok": True, "quality": quality()}],
            LOSSY: [{"ok": True, "quality": {"error": "RequestError: over the reply limit"}}]}
    bench_quality.score_round(runs)
    rr = {"contenders": {n: {**rs[-1], "decode_tok_s": 1.0} for n, rs in runs.items()}}
    rr["quality"] = bench_quality.rows(rr)
    assert [q["contender"] for q in rr["quality"]] == ["deltafin", "deltafin-sync-lru"]
    assert all(q["ppl_vs_exact"] == 1.0 and q["top1_agreement"] == 1.0 for q in rr["quality"])
    report = {"setup": {"quality": {"tokens": 3, "text": "t", "window": 3, "reference": "deltafin"}},
              "regimes": {"real": rr}}
    text = bench_quality.table(report)
    assert f"{LOSSY:<24}no quality figure: RequestError: over the reply limit" in text
    assert "scores" not in runs["deltafin"][0]["quality"]
