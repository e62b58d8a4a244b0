"""Routing predictor and prefetcher (runtime/predictor.py), the predictive policy and prefetched
slots (runtime/cache.py), and their replay (tools/replay.py)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from deltafin.runtime.cache import CacheError, Predictive, SlotTable, make_policy
from deltafin.runtime.predictor import Prefetcher, PredictorError, RoutingPredictor
from deltafin.runtime.traces import load_trace
from deltafin.tools import replay as R
from deltafin.workers.router import Router, RouterError

SHARED_TRACES = Path(__file__).parents[2] / "shared" / "traces"


def _chain_ids(n_tokens: int, n_layers: int, n_experts: int, seed: int = 0) -> np.ndarray:
    """Top-1 routing where a token's expert at layer l is (e0 + l) mod n_experts, e0 random."""
    e0 = np.random.default_rng(seed).integers(0, n_experts, n_tokens)
    return ((e0[:, None] + np.arange(n_layers)[None, :]) % n_experts).astype(np.uint8)[:, :, None]


def _random_ids(n_tokens: int, n_layers: int, n_experts: int, k: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.argsort(rng.random((n_tokens, n_layers, n_experts)), axis=2)[:, :, :k].astype(np.uint8)


def _feed(p: RoutingPredictor, ids: np.ndarray) -> None:
    for token in ids:
        for layer, experts in enumerate(token.tolist()):
            p.observe(layer, experts)
        p.end_pass()


# -- predictor ------------------------------------------------------------------------------------
def test_predictor_learns_a_layer_to_layer_chain():
    p = RoutingPredictor(4, 16, history=256, neighbours=4, candidates=64)
    _feed(p, _chain_ids(300, 4, 16))
    p.observe(0, [5])
    (e, q), = p.predict(1, k=1)
    assert e == 6 and q > 0.9
    assert p.predict(3, k=1)[0][0] == 8 and p.predict(3, k=1)[0][1] > 0.7
    assert p.q[1].sum() - p.q[1, 6] < 0.5  # the others are unlikely
    assert p.distance(1) == 1 and p.distance(0) == 4  # layer 0's next occurrence is the next pass


def test_predictor_learns_token_to_token_reuse_with_one_layer():
    """One MoE layer: passes end only by end_pass. Each pass uses a hot expert (a new one every
    20 passes) and a random one: a key used in the last pass comes back about half the time (the
    hot one always, the random one rarely), a key unused for long almost never."""
    rng = np.random.default_rng(1)
    p = RoutingPredictor(1, 32, history=64, neighbours=4, candidates=16)
    hot = 0
    for t in range(400):
        if t % 20 == 0:
            hot = int(rng.integers(0, 32))
        p.observe(0, [hot, int(rng.integers(0, 32))])
        p.end_pass()
    p.observe(0, [hot])
    q = p.probabilities()[0]
    stale = p.passes - p.last_use[0] > 40
    assert 0.4 < q[hot] < 0.65
    assert stale.any() and q[stale].max() < 0.1


def test_chunks_of_one_layer_add_up_and_a_lower_layer_starts_a_pass():
    p = RoutingPredictor(3, 8, history=8, neighbours=1, candidates=2)
    p.observe(0, [1, 2])
    p.observe(0, [2, 3])        # a second chunk of layer 0: the same pass
    p.observe(1, [4])
    assert p.passes == 0 and p.cur_used[0].nonzero()[0].tolist() == [1, 2, 3]
    p.observe(0, [5])           # a lower layer: the previous pass is over
    assert p.passes == 1 and p.stored == 1
    assert int(p.sig[0, 0, 0]) == 0b1110 and int(p.sig[1, 0, 0]) == 0b10000
    with pytest.raises(PredictorError, match="layer 3 outside"):
        p.observe(3, [0])
    with pytest.raises(PredictorError, match="expert ids"):
        p.observe(1, [8])


def test_many_experts_use_several_mask_words():
    """200 experts: four 64-bit words per layer; the match must count every word."""
    p = RoutingPredictor(2, 200, history=64, neighbours=4, candidates=8)
    a, b = [[150, 199], [130, 140]], [[10, 11], [3, 70]]
    ids = np.array([a, b, b, b] * 15, dtype=np.uint16)  # the most recent passes are b's
    _feed(p, ids)
    p.observe(0, [150, 199])
    assert sorted(e for e, _ in p.predict(1, k=2)) == [130, 140]


def test_gate_lookahead_hints_count_their_precision():
    p = RoutingPredictor(3, 8, history=8, neighbours=1, candidates=2)
    p.observe(0, [0])
    before = p.hint_precision()
    p.hint(1, [3, 4])
    assert p.q[1, 3] >= before and p.q[1, 4] >= before
    p.observe(1, [3, 5])        # one of the two hinted experts was used
    p.observe(2, [0])
    assert p.hint_seen == 2.0 + 2 and p.hint_hit == 1.0 + 1
    with pytest.raises(PredictorError):
        p.hint(7, [0])


# -- predictive policy and prefetched slots -------------------------------------------------------
def test_predictive_policy_evicts_the_least_likely_key_first():
    pred = RoutingPredictor(2, 4, history=8, neighbours=1, candidates=2)
    policy = Predictive(pred)
    table = SlotTable(3, policy)
    for key in [(0, 0), (0, 1), (1, 2)]:
        table.release()
        slot, _ = table.acquire(key)
        table.loaded(slot, key, table.generation[slot])
    table.release()
    pred.q = np.zeros((2, 4))
    pred.q[0, 0] = pred.q[1, 2] = 0.1   # equal: the one released first goes first
    pred.q[0, 1] = 0.9                  # predicted: kept although it is not the most recent
    pred.version += 1
    table.acquire((1, 3))
    assert (0, 0) not in table.where and (0, 1) in table.where
    table.release()
    table.acquire((1, 0))
    assert (1, 2) not in table.where and (0, 1) in table.where
    with pytest.raises(CacheError, match="needs the model's shape"):
        make_policy("predictive")
    assert make_policy("predictive", n_layers=2, n_experts=4).predictor.n_layers == 2


def test_prefetched_slots_are_evictable_and_counted():
    table = SlotTable(2, make_policy("lru"))
    slot = table.prefetch("a")
    assert slot is not None and table.prefetch("a") is None  # resident already
    assert table.loaded(slot, "a", table.generation[slot])   # unpinned: evictable once loaded
    s_b = table.prefetch("b")
    table.loaded(s_b, "b", table.generation[s_b])
    table.acquire("a")                                        # used: counted once
    table.release()
    table.acquire("c")                                        # evicts b, never used
    assert (table.prefetches, table.prefetch_used, table.prefetch_wasted) == (2, 1, 1)
    table.acquire("a")                                        # everything pinned now
    assert table.prefetch("d") is None


def test_prefetch_replay_arithmetic_by_hand():
    """2 layers x 3 experts, top-1, 6 slots (everything fits); threshold 0 prefetches every
    non-resident expert of the next layer. Tokens (layer0, layer1): (0, 1), (1, 0), (0, 0).
    token 1: layer 0 misses (demand read); prefetch layer 1: 3 reads; layer 1 hits (prefetched).
    token 2: layer 0 misses; layer 1 all resident, nothing to prefetch; layer 1 hits (prefetched).
    token 3: both hit. Without prefetch: 4 misses (tokens 1 and 2), then 2 hits."""
    ids = np.array([[[0], [1]], [[1], [0]], [[0], [0]]], dtype=np.uint8)
    pf = {"threshold": 0.0, "min_precision": 0.0, "depth": 1}
    r = R.replay(ids, 6, "predictive", record_bytes=10, prefetch=pf, n_experts=3)
    assert (r["uses"], r["hits"], r["demand_reads"], r["prefetch_reads"], r["prefetch_used"]) == (6, 4, 2, 3, 2)
    assert r["reads"] == 5 and r["hit_rate"] == pytest.approx(4 / 6)
    assert r["reads_per_token"] == pytest.approx(5 / 3) and r["bytes_read_per_token"] == pytest.approx(50 / 3)
    assert r["prefetch_precision"] == pytest.approx(2 / 3)
    assert r["prefetch_coverage"] == pytest.approx(2 / (2 + 2))
    base = R.replay(ids, 6, "predictive", record_bytes=10, n_experts=3)
    assert (base["hits"], base["reads"]) == (2, 4)
    R.add_recall(r, base)
    assert r["prefetch_recall"] == pytest.approx((4 - 2) / 4)


def test_predictive_prefetch_follows_a_chain():
    """A deterministic chain: after the first layer of a token every later one is predicted."""
    ids = _chain_ids(1500, 6, 32)
    lru = R.replay(ids, 48, "lru", n_experts=32)
    pf = R.replay(ids, 48, "predictive", prefetch=True, n_experts=32)
    assert lru["hit_rate"] < 0.3
    assert pf["hit_rate"] > 0.75 and pf["prefetch_precision"] > 0.9
    assert pf["reads_per_token"] < 1.05 * lru["reads_per_token"]  # misses turned into hits, not extra reads


def test_prefetch_gates_itself_off_on_a_random_trace():
    """No structure to learn: with no probability threshold, the measured precision (about
    6/64) turns prefetch off, so the bytes read stay near those without prefetch; with the
    default threshold the calibrated probabilities never clear it."""
    ids = _random_ids(1500, 4, 64, 6)
    base = R.replay(ids, 64, "predictive", n_experts=64)
    gated = R.replay(ids, 64, "predictive", n_experts=64,
                     prefetch={"threshold": 0.0, "min_precision": 0.4, "depth": 1, "probe_every": 16})
    assert gated["prefetch_precision"] < 0.2
    assert gated["prefetch_gate"]["gated_share_d1"] > 0.95
    assert gated["reads_per_token"] < 1.1 * base["reads_per_token"]
    default = R.replay(ids, 64, "predictive", n_experts=64, prefetch=True)
    assert default["prefetch_reads"] < 0.01 * default["reads"]


def test_router_prefetch_orders_reads_for_unpinned_slots():
    pred = RoutingPredictor(2, 8, history=8, neighbours=1, candidates=2)
    router = Router(4, Predictive(pred), prefetcher=Prefetcher(pred, threshold=0.0, min_precision=0.0))
    reads, _ = router.need(1, 0, [1])
    assert [(r.layer, r.expert) for r in reads] == [(0, 1)]
    pre = router.prefetch()
    assert len(pre) == 3 and all(r.layer == 1 for r in pre)  # the free slots left: 3 of 4
    assert all(r.slot not in router.table.pinned for r in pre)
    assert router.stats()["prefetch_reads"] == 3
    router.hint([(1, 5), (1, 6)])  # gate lookahead reaches the predictor
    assert router.predictor.hinted[1].tolist() == [5, 6]
    with pytest.raises(RouterError, match="share one routing predictor"):
        Router(4, Predictive(pred), prefetcher=Prefetcher(RoutingPredictor(2, 8, history=8, neighbours=1,
                                                                           candidates=2)))


# -- the real traces ------------------------------------------------------------------------------
@pytest.mark.skipif(not (SHARED_TRACES / "dsv2lite-dev.npz").exists(), reason="shared traces absent")
def test_dev_trace_prefix_reaches_the_goal():
    """The first 2,000 tokens of the dev split at 25% of the experts: the goal of issue 8 (hit rate
    >= 0.58 at <= 1.2x LRU's bytes) with the figures measured (the whole split: docs/TRACES.md)."""
    ids = load_trace(SHARED_TRACES / "dsv2lite-dev.npz").ids[:2000]
    n_slots = R.n_slots_for(0.25, 26, 64)
    lru = R.replay(ids, n_slots, "lru")
    best = R.replay(ids, n_slots, "predictive", prefetch=True)
    assert lru["hit_rate"] == pytest.approx(0.4461, abs=5e-4)
    assert best["hit_rate"] == pytest.approx(0.639, abs=0.005)
    assert best["hit_rate"] >= 0.58
    assert best["bytes_read_per_token"] <= 1.2 * lru["bytes_read_per_token"]
    assert best["prefetch_precision"] == pytest.approx(0.721, abs=0.01)
