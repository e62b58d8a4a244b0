"""Trace files (runtime/traces.py), the recorder, and deltafin-replay (tools/replay.py)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from deltafin.runtime.traces import TraceError, TraceRecorder, load_trace, save_trace
from deltafin.tools import replay as R

SHARED_TRACES = Path(__file__).parents[2] / "shared" / "traces"


def _ids(rows) -> np.ndarray:
    """[tokens, 1 layer, k] from a list of per-token expert lists."""
    return np.array(rows, dtype=np.uint8)[:, None, :]


# -- trace files --------------------------------------------------------------------------------
@pytest.mark.parametrize("n_experts, dtype", [(64, np.uint8), (384, np.uint16)])
def test_trace_round_trip(tmp_path, n_experts, dtype):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, n_experts, size=(7, 3, 2)).astype(dtype)
    path = save_trace(tmp_path / "t.npz", ids, [3, 4], ["p1", "p2"])
    t = load_trace(path)
    np.testing.assert_array_equal(t.ids, ids)
    assert t.ids.dtype == dtype and t.lengths.tolist() == [3, 4] and t.names.tolist() == ["p1", "p2"]
    assert (t.tokens, t.n_layers, t.top_k, t.n_experts) == (7, 3, 2, int(ids.max()) + 1)
    assert [(n, len(x)) for n, x in t.requests()] == [("p1", 3), ("p2", 4)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.npz"]  # no temporary left behind


def test_an_interrupted_save_keeps_the_old_trace(tmp_path, monkeypatch):
    path = save_trace(tmp_path / "t.npz", np.zeros((2, 1, 1), dtype=np.uint8), [2], ["old"])

    def crash(f, **arrays):
        f.write(b"PK\x03\x04 half a zip")
        raise KeyboardInterrupt
    monkeypatch.setattr(np, "savez_compressed", crash)
    with pytest.raises(KeyboardInterrupt):
        save_trace(path, np.ones((3, 1, 1), dtype=np.uint8), [3], ["new"])
    assert load_trace(path).names.tolist() == ["old"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.npz"]


def test_bad_trace_files_are_named_clearly(tmp_path):
    with pytest.raises(TraceError, match="cannot read a routing trace"):
        load_trace(tmp_path / "missing.npz")
    (tmp_path / "text.npz").write_text("not a zip")
    with pytest.raises(TraceError, match="cannot read a routing trace"):
        load_trace(tmp_path / "text.npz")
    np.savez(tmp_path / "other.npz", x=np.zeros(3))
    with pytest.raises(TraceError, match=r"missing \['ids', 'lengths', 'names'\]"):
        load_trace(tmp_path / "other.npz")
    ids = np.zeros((4, 2, 2), dtype=np.uint8)
    np.savez(tmp_path / "short.npz", ids=ids, lengths=np.array([3]), names=np.array(["a"]))
    with pytest.raises(TraceError, match="lengths sum to 3 but ids has 4 tokens"):
        load_trace(tmp_path / "short.npz")
    np.savez(tmp_path / "flat.npz", ids=ids[:, 0], lengths=np.array([4]), names=np.array(["a"]))
    with pytest.raises(TraceError, match=r"ids must be \[tokens, moe_layers, top_k\]"):
        load_trace(tmp_path / "flat.npz")
    np.savez(tmp_path / "obj.npz", ids=ids, lengths=np.array([4]), names=np.array([{"a": 1}], dtype=object))
    with pytest.raises(TraceError, match="cannot read a routing trace"):  # pickled arrays are refused
        load_trace(tmp_path / "obj.npz")
    with pytest.raises(TraceError, match="names must be one str per entry"):
        save_trace(tmp_path / "n.npz", ids, [4], ["a", "b"])
    assert not (tmp_path / "n.npz").exists()


def test_recorder_collects_forward_passes(tmp_path):
    rec = TraceRecorder(n_experts=64)
    buf = np.array([[[1, 2], [3, 4]], [[5, 6], [7, 8]]])
    rec.append(buf)
    buf[:] = 0                     # the caller reuses its buffer: the recorder kept a copy
    rec.append(np.array([[[9, 10], [11, 12]]]))
    rec.end_request("first")
    rec.append(np.array([[[13, 14], [15, 16]]]))
    with pytest.raises(TraceError, match="rows of shape"):
        rec.append(np.zeros((1, 3, 2), dtype=np.int64))
    with pytest.raises(TraceError, match="out of range"):
        rec.append(np.full((1, 2, 2), 300))
    assert rec.trace().names.tolist() == ["first", "(unfinished)"]
    rec.end_request("second")
    t = load_trace(rec.save(tmp_path / "r.npz"))
    assert t.ids.dtype == np.uint8 and t.lengths.tolist() == [3, 1] and t.names.tolist() == ["first", "second"]
    assert t.ids[:, 0, 0].tolist() == [1, 5, 9, 13] and t.ids[3, 1].tolist() == [15, 16]


# -- replay -------------------------------------------------------------------------------------
def test_record_bytes_of_deepseek_v2_lite():
    h, i = 2048, 1408
    packed = i * h // 2                  # 4 bits per weight
    scales_biases = 2 * i * (h // 64) * 2  # bf16 scale and bias per group of 64
    assert R.expert_record_bytes() == 3 * (packed + scales_biases) == 4_866_048
    assert R.expert_record_bytes(hidden=64, intermediate=32) == 16384  # rounded up to the alignment


def test_infer_experts():
    assert R.infer_experts(np.array([[[63]]])) == 64
    assert R.infer_experts(np.array([[[3]]])) == 8
    assert R.infer_experts(np.array([[[59]]])) == 60
    assert R.infer_experts(np.array([[[300]]])) == 384


HAND = _ids([[0, 1], [0, 1], [2, 3], [0, 1]])


def test_replay_counts_by_hand():
    # 3 slots. LRU: t0 reads 0,1; t1 hits both; t2 reads 2 (free slot) and 3 (evicts 0, released
    # before 1); t3 misses 0 (evicts 1), then misses 1 (evicts 2): 2 hits of 8, 6 reads.
    lru = R.replay(HAND, 3, "lru", record_bytes=100)
    assert (lru["hits"], lru["uses"], lru["reads"], lru["tokens"]) == (2, 8, 6, 4)
    assert lru["hit_rate"] == 0.25 and lru["reads_per_token"] == 1.5 and lru["bytes_read_per_token"] == 150
    # Belady: at t2, 3 evicts 1 (next used after 0), so t3 hits 0: 3 hits, 5 reads
    opt = R.replay(HAND, 3, "belady", record_bytes=100)
    assert (opt["hits"], opt["reads"], opt["policy"]) == (3, 5, "belady")
    # enough slots for all four: only the first use of each expert reads
    assert R.replay(HAND, 4, "lfuda")["reads"] == 4


def test_replay_refuses_duplicate_experts_for_belady():
    with pytest.raises(TraceError, match="same expert twice"):
        R.replay(_ids([[1, 1]]), 2, "belady")


def test_replay_report_and_cli(tmp_path, capsys):
    for split in ("train", "dev"):
        save_trace(tmp_path / f"x-{split}.npz", HAND, [2, 2], ["a", "b"])
    rep = R.replay_report(load_trace(tmp_path / "x-dev.npz"), 0.375, "lfuda", record_bytes=100, n_experts=8)
    assert rep["n_slots"] == 3 and rep["lru"]["hits"] == 2 and rep["belady"]["hits"] == 3
    assert rep["policy"]["policy"] == "lfuda" and rep["n_layers"] == 1

    out = tmp_path / "r.json"
    assert R.main([str(tmp_path / "x-dev.npz"), "--cache-frac", "0.375", "--policy", "lru", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["n_experts"] == 8 and got["n_slots"] == 3 and got["policy"]["hit_rate"] == 0.25
    assert got["record_bytes"] == 4_866_048
    table = capsys.readouterr().out
    assert "belady (ref)" in table and "0.375" in table

    assert R.main([str(tmp_path / "x-dev.npz"), "--cache-frac", "0.5", "--splits", "--experts", "4",
                   "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert sorted(got) == ["dev", "train"] and got["train"]["n_slots"] == 2

    assert R.main([str(tmp_path / "missing.npz"), "--cache-frac", "0.5"]) == 2
    assert "cannot read a routing trace" in capsys.readouterr().err
    assert R.main([str(tmp_path / "x-dev.npz"), "--cache-frac", "0.5", "--experts", "2"]) == 2
    assert "n_experts is 2" in capsys.readouterr().err


def test_cli_predictive_policy_with_prefetch(tmp_path, capsys):
    """--policy predictive --prefetch: the policy with prefetch, once more without it (for the
    recall), LRU and Belady; precision and recall in the table and the JSON."""
    chain = (np.random.default_rng(0).integers(0, 8, 300)[:, None] + np.arange(3)[None, :]) % 8
    save_trace(tmp_path / "c-dev.npz", chain.astype(np.uint8)[:, :, None], [300], ["chain"])
    out = tmp_path / "r.json"
    assert R.main([str(tmp_path / "c-dev.npz"), "--cache-frac", "0.5", "--policy", "predictive", "--prefetch",
                   "--prefetch-threshold", "0.3", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    pf, base = got["policy"], got["no_prefetch"]
    assert pf["policy"] == base["policy"] == "predictive" and pf["prefetch"]["threshold"] == 0.3
    assert pf["prefetch_reads"] > 0 and pf["reads"] == pf["demand_reads"] + pf["prefetch_reads"]
    assert pf["prefetch_precision"] == pf["prefetch_used"] / pf["prefetch_reads"]
    misses = base["uses"] - base["hits"]
    assert pf["prefetch_recall"] == (misses - (pf["uses"] - pf["hits"])) / misses > 0.2
    assert pf["bytes_vs_lru"] == pf["reads"] / got["lru"]["reads"]
    table = capsys.readouterr().out
    assert "predictive + prefetch" in table and f"{pf['prefetch_recall']:.3f}" in table
    assert R.main([str(tmp_path / "c-dev.npz"), "--cache-frac", "0.5", "--policy", "belady", "--prefetch"]) == 2
    assert "needs an online policy" in capsys.readouterr().err


def test_cli_tokens_window_and_history(tmp_path):
    """--tokens N replays the trace's first N tokens (requests cut to fit); --history warms the
    predictor first, as cache.routing_history does: on a chain (expert at layer l = e0 + l) a
    history of it lets prefetch work from the first token of a short window."""
    rng = np.random.default_rng(1)
    chain = lambda n: ((rng.integers(0, 8, n)[:, None] + np.arange(3)[None, :]) % 8).astype(np.uint8)[:, :, None]
    save_trace(tmp_path / "c-dev.npz", chain(60), [25, 35], ["a", "b"])
    save_trace(tmp_path / "c-train.npz", chain(2000), [2000], ["t"])
    head = load_trace(tmp_path / "c-dev.npz").head(30)
    assert head.tokens == 30 and head.lengths.tolist() == [25, 5] and head.names.tolist() == ["a", "b"]
    assert load_trace(tmp_path / "c-dev.npz").head(60).lengths.tolist() == [25, 35]
    got = {}
    for name, extra in (("cold", []), ("warm", ["--history", str(tmp_path / "c-train.npz")])):
        out = tmp_path / f"{name}.json"
        assert R.main([str(tmp_path / "c-dev.npz"), "--cache-frac", "0.25", "--policy", "predictive",
                       "--prefetch", "--tokens", "30", "--json", str(out), *extra]) == 0
        got[name] = json.loads(out.read_text())
    assert got["cold"]["tokens"] == got["warm"]["tokens"] == 30
    assert got["warm"]["policy"]["prefetch_reads"] > got["cold"]["policy"]["prefetch_reads"]
    assert got["warm"]["policy"]["hit_rate"] > got["cold"]["policy"]["hit_rate"] + 0.2


@pytest.mark.skipif(not (SHARED_TRACES / "dsv2lite-dev.npz").exists(), reason="shared traces not present")
def test_dev_trace_matches_the_reference_figures():
    """ANCHORS.md, dev split at 25% of the experts: LRU 0.446, Belady 0.716."""
    trace = load_trace(SHARED_TRACES / "dsv2lite-dev.npz")
    n_slots = R.n_slots_for(0.25, trace.n_layers, R.infer_experts(trace.ids))
    assert n_slots == 416
    assert R.replay(trace, n_slots, "lru")["hit_rate"] == pytest.approx(0.446, abs=0.005)
    assert R.replay(trace, n_slots, "belady")["hit_rate"] == pytest.approx(0.716, abs=0.005)
