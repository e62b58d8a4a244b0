"""The model interface a family plugs into: each layer's cache kind sizes the budget and admission
(runtime/layerkinds.py) and makes the layer's cache (runtime/models/caches.py); the registry
(archinfo.ARCHS) is the one list of families; one dtype table (runtime/dtypes.py)."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from deltafin.runtime import archinfo, budget, dtypes
from deltafin.runtime.layerkinds import FullKV, LatentKV, RecurrentState, SlidingKV, sequence_kv_tokens
from deltafin.runtime.models import model_class
from deltafin.runtime.models.caches import KVCache, RecurrentCache, SlidingKVCache, make_cache
from deltafin.tools import synth


def _config(arch: str) -> dict:
    return synth.hub_config(arch, layers=3, experts=8, top_k=2, hidden=128, moe_intermediate=64, vocab=256)


def test_kinds_size_what_their_caches_hold():
    kv = FullKV(8, 8)
    assert kv.nbytes(300, 2) == 300 * 16 * 2 and kv.grown_bytes(300, 2) == 512 * 16 * 2
    win = SlidingKV(8, 8, window=100, chunk=64)
    assert win.nbytes(50, 2) == 50 * 16 * 2 and win.nbytes(10_000, 2) == 100 * 16 * 2
    assert win.grown_bytes(50, 2) == 256 * 16 * 2 and win.grown_bytes(10_000, 2) == (99 + 256) * 16 * 2
    rec = RecurrentState((4, 16, 16), conv_shape=(3, 96), state_itemsize=4)
    assert rec.nbytes(1, 2) == rec.nbytes(100_000, 2) == 4 * 16 * 16 * 4 + 3 * 96 * 2
    assert rec.grown_bytes(7, 2) == rec.nbytes(7, 2)


@pytest.mark.parametrize("arch", synth.TINY_ARCHS)
def test_the_budget_charges_each_layer_by_its_kind(arch):
    """Attention caches: the reserve is per-position bytes times positions, a sequence is charged
    whole cache steps; recurrent states (the hybrids' linear layers): one per sequence, the reserve
    holding one per sequence decoded together."""
    c = _config(arch) if not arch.startswith("deepseek") else {
        **_config(arch), "kv_lora_rank": 64, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32}
    kinds = archinfo.layer_caches(c)
    assert len(kinds) == c["num_hidden_layers"]
    assert isinstance(kinds[0], LatentKV) == (arch == "deepseek_v3")
    assert isinstance(kinds[0], RecurrentState) == (arch in ("qwen3_next", "qwen3_5_moe", "kimi_linear", "kimi_k3"))
    if any(isinstance(k, SlidingKV) for k in kinds):  # gpt-oss: its sliding layers hold their window only
        per = budget.kv_bytes_per_token(c, 2)
        assert budget.kv_reserve_bytes(c, 2, 512, 700) == sum(k.nbytes(700, 2) for k in kinds) < per * 700
        assert budget.sequence_cache_bytes(c, 300, 2) == sum(k.grown_bytes(300, 2) for k in kinds)
        return
    state = sum(k.nbytes(1, 2) for k in kinds if isinstance(k, RecurrentState))
    per = budget.kv_bytes_per_token(c, 2) - state
    assert per > 0 and budget.kv_reserve_bytes(c, 2, 512, 700) == per * 700 + state
    assert budget.kv_reserve_bytes(c, 2, 512, 700, sequences=3) == per * 700 + 3 * state
    assert budget.sequence_cache_bytes(c, 300, 2) == per * sequence_kv_tokens(300) + state


def test_the_registry_is_the_one_list_of_families():
    assert synth.TINY_ARCHS == tuple(archinfo.ARCHS)
    for name, info in archinfo.ARCHS.items():
        assert model_class({"model_type": name}).__module__.endswith(info.model.rsplit(".", 1)[0])
    assert archinfo.arch_for({"model_type": "kimi_k2"}) is archinfo.ARCHS["deepseek_v3"]
    with pytest.raises(archinfo.UnsupportedArchitecture, match="kimi_k2.*mixtral"):
        model_class({"model_type": "gpt2"})


def test_one_dtype_table():
    assert dtypes.canonical("bf16") == dtypes.canonical("mlx.core.bfloat16") == "bfloat16"
    assert dtypes.itemsize("float32") == 4 and dtypes.itemsize("half") == 2
    assert dtypes.canonical("auto") is None and dtypes.itemsize("uint32") is None
    assert all(getattr(mx, n) for n in dtypes.FLOAT_DTYPES)


def test_each_kind_makes_its_cache():
    assert type(make_cache(FullKV(1, 1))) is KVCache and type(make_cache(LatentKV(1, 1))) is KVCache
    assert type(make_cache(SlidingKV(1, 1, window=4))) is SlidingKVCache
    assert type(make_cache(RecurrentState((2, 2)))) is RecurrentCache


def test_the_sliding_window_returns_what_each_pass_may_see_and_stays_bounded():
    """Chunks then single tokens: each pass gets the window - 1 positions before it and its own,
    exactly the rows a full cache holds there, and the buffers never exceed the kind's bound."""
    rng = np.random.default_rng(0)
    window, chunk = 300, 64
    kind = SlidingKV(4 * 8, 4 * 8, window=window, chunk=chunk)
    win, full = make_cache(kind), KVCache()
    sizes = [chunk] * 7 + [1] * 400 + [chunk] * 3
    for n in sizes:
        k = mx.array(rng.standard_normal((1, 4, n, 8)).astype(np.float32))
        v = k + 1
        wk, wv = win.update_and_fetch(k, v)
        fk, fv = full.update_and_fetch(k, v)
        first = max(0, full.offset - n - (window - 1))
        assert win.visible == first and win.offset == full.offset
        assert np.array_equal(np.array(wk), np.array(fk[..., first:, :]))
        assert np.array_equal(np.array(wv), np.array(fv[..., first:, :]))
        assert win.nbytes <= kind.grown_bytes(win.offset, 4)
    assert win.nbytes < full.nbytes


def _toy_step(state, conv_in):
    """A stand-in linear-attention step: state' = 0.5 * state + sum of the conv window."""
    return 0.5 * state + conv_in.sum(axis=1, keepdims=True)


def test_recurrent_state_carries_over_passes_and_batches_by_rows():
    """One sequence: the conv window keeps the last kernel - 1 inputs and the state carries over
    passes. Several decoded together: their rows stacked, stepped once and put back give each
    what it gets alone, a sequence without state yet starting from zeros."""
    kind = RecurrentState((1, 6), conv_shape=(3, 6))
    rng = np.random.default_rng(1)
    xs = [mx.array(rng.standard_normal((1, 1, 6)).astype(np.float32)) for _ in range(5)]

    def alone(tokens):
        c = make_cache(kind)
        for x in tokens:
            full = c.conv_window(x)
            assert full.shape == (1, 3 + x.shape[1], 6)
            c.set_state(_toy_step(c.state if c.state is not None else mx.zeros((1, 1, 6)), full))
            c.advance(x.shape[1])
        return c

    a = alone(xs)
    assert a.offset == 5 and np.array_equal(np.array(a.conv), np.array(mx.concatenate(xs[2:], axis=1)))
    assert a.nbytes == kind.nbytes(5, 4)
    # B=2: one sequence four tokens in, one new; stepped together on the fifth token
    caches = [alone(xs[:4]), make_cache(kind)]
    state, conv = RecurrentCache.stack(caches)
    assert state.shape == (2, 1, 6) and not np.any(np.array(state[1]))
    x = mx.concatenate([xs[4], xs[0]], axis=0)
    full, conv = RecurrentCache.shift(conv, x, 3)
    RecurrentCache.unstack(caches, _toy_step(state, full), conv)
    for c in caches:
        c.advance(1)
    assert np.array_equal(np.array(caches[0].state), np.array(a.state))
    assert np.array_equal(np.array(caches[0].conv), np.array(a.conv))
    assert np.array_equal(np.array(caches[1].state), np.array(alone(xs[:1]).state))


def test_the_moe_block_runs_experts_in_a_latent_space_with_biases():
    """latent=(down, up): the experts see down(x) and the block returns up of their weighted sum;
    expert_bias[e] is added to expert e's output before weighting."""
    from functools import partial

    from deltafin.runtime.models import routing
    from deltafin.runtime.models.base import Linear, QuantSpec
    from deltafin.runtime.models.decoder import SparseMoE

    rng = np.random.default_rng(2)
    D, R, E = 8, 4, 6
    w = {n: mx.array(rng.standard_normal(s).astype(np.float32))
         for n, s in (("gate.weight", (E, D)), ("down.weight", (R, D)), ("up.weight", (D, R)))}
    lin = {n: Linear(w, n, QuantSpec(None)) for n in ("gate", "down", "up")}
    scale = mx.arange(1, E + 1, dtype=mx.float32)  # expert e multiplies its input by e + 1
    bias = mx.array(rng.standard_normal((E, R)).astype(np.float32))

    def experts(layer, x, inds):
        return mx.expand_dims(x, -2) * scale[inds][..., None]
    experts.keeps_shape = True
    route = partial(routing.softmax_topk, k=2, norm=True)
    moe = SparseMoE(0, lin["gate"], route, latent=(lin["down"], lin["up"]), expert_bias=bias)
    x = mx.array(rng.standard_normal((1, 3, D)).astype(np.float32))
    inds, scores = route(lin["gate"](x))
    z = lin["down"](x)
    want = lin["up"]((((mx.expand_dims(z, -2) * scale[inds][..., None]) + bias[inds]) * scores[..., None]).sum(-2))
    assert np.allclose(np.array(moe(x, experts)), np.array(want), atol=1e-5)
