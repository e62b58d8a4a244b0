"""The routing predictor alone (runtime/predictor.py). Its use in the router (predictive policy,
prefetch) is tested in tests/test_prefetch.py."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from deltafin.runtime.predictor import Prefetcher, PredictorError, ReadGate, RoutingPredictor
from deltafin.runtime.traces import load_trace

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


# -- prefetcher, without a router ------------------------------------------------------------------
def _plan_all(p: RoutingPredictor, f: Prefetcher, ids: np.ndarray) -> int:
    """Feeds the passes; after each layer asks for a plan with nothing resident; returns how many
    keys were planned."""
    planned = 0
    for token in ids:
        for layer, experts in enumerate(token.tolist()):
            p.observe(layer, experts)
            planned += len(f.plan(lambda key: False))
        p.end_pass()
    return planned


def test_prefetcher_gates_itself_off_when_its_precision_is_poor():
    """A random trace and no probability threshold: ungated, every step would plan all 64 experts
    of the next layer; the measured precision (about 6/64) closes the gate, and only probes go."""
    ids = _random_ids(1500, 4, 64, 6)
    p = RoutingPredictor(4, 64, history=512, neighbours=8, candidates=64)
    f = Prefetcher(p, threshold=0.0, min_precision=0.4, probe_every=16)
    planned = _plan_all(p, f, ids)
    assert f.precision(1) < 0.2
    assert f.stats()["gated_share_d1"] > 0.95
    assert planned < 0.02 * 64 * 3 * 1500


def test_an_ungated_prefetcher_reads_every_prediction():
    """gate=False is the fixed setting deltafin-bench's sweep compares the gate with: on the same
    random trace it never gates, and plans every key over the threshold (all 64 of each next
    layer, as the docstring above says the gated one would without its gate)."""
    ids = _random_ids(300, 4, 64, 6)
    p = RoutingPredictor(4, 64, history=512, neighbours=8, candidates=64)
    f = Prefetcher(p, threshold=0.0, min_precision=0.4, probe_every=16, gate=False)
    planned = _plan_all(p, f, ids)
    assert f.precision(1) < 0.2  # measured all the same
    assert f.stats()["gated_share_d1"] == 0.0
    assert planned == 64 * 3 * 300


def test_read_gate_measures_reads_and_gaps_and_prices_a_prefetch():
    """Times are given (seconds): two reads in flight together for 10 ms are 5 ms of disk each;
    the next need comes 4.5 ms after an answer, one layer on (later: 9 ms, two layers on)."""
    g = ReadGate(8, decay=1.0, follow=0.5)
    assert g.pays(0.01, 1, 100)                       # nothing measured: the precision gate rules
    for k in range(2):                                # 4 reads, two at a time, 10 ms per pair
        g.sent(k * 0.1), g.sent(k * 0.1)
        g.done(k * 0.1 + 0.01, 5_000_000), g.done(k * 0.1 + 0.01, 5_000_000)
    assert g.read_s() == pytest.approx(0.005)
    assert g.stats()["mb_per_s"] == pytest.approx(1000.0)
    for k in range(3):
        g.answered(1.0 + k, 6)
        g.need(1.0 + k + 0.0045, 7, missed=True)      # one layer on
    assert g.next_s == pytest.approx(0.0045) and g.layer_s == pytest.approx(0.0045)
    assert g.miss_share > 0.9
    g.miss_share = 1.0
    # distance 1, nothing ahead: ends 0.5 ms after the need comes; saves 4.5 ms if used (p 0.2:
    # 0.9 ms), costs its 0.5 ms overlap x (1 - 0.2) = 0.4 ms
    assert g.pays(0.2, 1, 0)
    assert not g.pays(0.2, 1, 1)                      # behind one read: ends 5.5 ms late, saves nothing
    # distance 3 (due in 13.5 ms), one ahead: ends at 10 ms, saves 5 ms if used; overlaps the next
    # need by 5 ms whatever it holds: pays from q = 1
    assert g.pays(1.0, 3, 1) and not g.pays(0.9, 3, 1)
    g.answered(5.0, 7)
    g.need(5.009, 1, missed=False)                    # 9 ms, 2 layers on (7 -> 0 -> 1)
    assert g.next_s == pytest.approx(0.00675) and g.layer_s == pytest.approx(0.0045)
    assert g.miss_share == pytest.approx(0.5)
    g.next_s = 1.0                                    # compute's time is long: the disk is idle
    assert g.pays(0.01, 1, 10) is False               # ... but a read 11 deep is late for layer 1
    g.layer_s = 1.0
    assert g.pays(0.01, 1, 10)
    assert g.stats()["refused"] == 3 and g.stats()["asked"] == 6


def test_prefetcher_stays_on_where_it_pays():
    p = RoutingPredictor(6, 32, history=512, neighbours=4, candidates=64)
    f = Prefetcher(p)  # the defaults: threshold 0.4, depth 1, min_precision 0.5
    planned = _plan_all(p, f, _chain_ids(1500, 6, 32))
    assert f.precision(1) > 0.9 and f.stats()["gated_share_d1"] < 0.05
    assert planned > 0.8 * 5 * 1500  # nearly every layer after the first, once learned


# -- the real traces --------------------------------------------------------------------------------
@pytest.mark.skipif(not (SHARED_TRACES / "dsv2lite-dev.npz").exists(), reason="shared traces absent")
def test_dev_trace_prefix_predictions():
    """The first 2,000 tokens of the dev split, starting cold: the predictor's top 6 for the next
    layer holds 0.559 of the experts used (pairwise co-occurrence from the previous layer: 0.47),
    and the keys it gives at least 0.4 are used as often as it says (calibration)."""
    ids = load_trace(SHARED_TRACES / "dsv2lite-dev.npz").ids[:2000]
    p = RoutingPredictor(26, 64)
    found = shown = 0
    said = happened = picked = 0.0
    for token in ids:
        rows = token.tolist()
        for layer in range(26):
            if layer > 0:
                actual = set(rows[layer])
                found += len(actual.intersection(e for e, _ in p.predict(layer, k=6)))
                shown += 6
                likely = np.flatnonzero(p.q[layer] >= 0.4)
                said += p.q[layer, likely].sum()
                happened += len(actual.intersection(likely.tolist()))
                picked += len(likely)
            p.observe(layer, rows[layer])
        p.end_pass()
    assert found / shown == pytest.approx(0.559, abs=0.005)
    assert abs(said / picked - happened / picked) < 0.05
