"""The routing predictor alone (runtime/predictor.py). Its policy and prefetch integration was
written against the router before Speed I and waits in docs/parked/ for the pipeline issue."""
from __future__ import annotations

import numpy as np
import pytest

from deltafin.runtime.predictor import Prefetcher, PredictorError, RoutingPredictor


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
