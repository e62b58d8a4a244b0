"""A resident decode token's graph: no more primitives than mlx-lm's, counted by
tools/graph_count.py; the pieces that made it so (the resident tier's views in expert order, uses
counted from shapes where no one needs the ids, sampling on [R, vocab] rows)."""
from __future__ import annotations

import mmap

import mlx.core as mx
import numpy as np
import pytest

from deltafin.protocol import messages as M
from deltafin.runtime.config import load_config
from deltafin.runtime.store import Store
from deltafin.runtime.tiers import layer_groups
from deltafin.runtime.traces import load_trace
from deltafin.workers.engine import Compute
from deltafin.workers.scheduler import sample_on_device
from deltafin.workers.sources import LocalExpertSource
from deltafin.workers.loader import Loader
from deltafin.workers.resident import ResidentTier
from deltafin.workers.router import Router

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v2"])
def test_a_resident_decode_token_has_no_primitive_more_than_mlx_lm(mlx_lm_stores, arch):
    from deltafin.tools import graph_count
    ckpt, store = mlx_lm_stores(arch)
    out = graph_count.compare(str(store), str(ckpt), PROMPT, token=3)
    extra = {k: v for k, v in out["primitives"].items() if v["deltafin"] > v["mlx_lm"]}
    assert not extra, f"{arch}: primitives deltafin adds per decode token: {extra}"
    assert out["primitives"]["GatherQMM"]["deltafin"] == 3 * len(Store(store).moe_layers)
    assert out["leaves"]["deltafin"] <= out["leaves"]["mlx_lm"]  # no array made on the host per token


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v2", "deepseek_v3"])
def test_a_step_of_four_rows_projects_and_ropes_once_per_layer(mlx_lm_stores, arch):
    """Sequences decoded together: a step of 4 rows runs every attention projection
    (and MLA's moves into and out of latent space) and every rope once per layer on the stacked
    rows, as a step of 1 row does; only the cache updates and the attention itself run per row."""
    from deltafin.tools import graph_count
    _, store = mlx_lm_stores(arch)
    counts = graph_count.batch_counts(str(store), PROMPT, [1, 4])
    one, four = counts[1]["primitives"], counts[4]["primitives"]
    rope = ("RoPE", "Cos")  # the fused kernel on a GPU; its composition (one Cos a call) on the CPU
    assert four["QuantizedMatmul"] == one["QuantizedMatmul"] > 0, (one, four)
    assert sum(four[k] for k in rope) == sum(one[k] for k in rope) > 0, (one, four)
    n_layers = Store(store).config["num_hidden_layers"]
    # per row and layer: SDPA, the cache's two updates, at most one concatenated output
    assert four["SliceUpdate"] <= 4 * one["SliceUpdate"] and counts[4]["total"] < 2 * counts[1]["total"], counts
    assert one["SliceUpdate"] == 2 * n_layers


def _fill_group(tier: ResidentTier, store: Store, layers: list, skip=None) -> None:
    """Every expert of `layers` into consecutive slots in expert order (as a preload fills them)."""
    for i, layer in enumerate(layers):
        for e in range(store.n_experts):
            if (layer, e) != skip:
                tier.fill(layer, e, i * store.n_experts + e, store.read_record(store.record(layer, e)))


def test_a_whole_resident_group_is_indexed_in_expert_order_in_the_pools_own_memory(tiny_stores):
    store = Store(tiny_stores("deepseek_v3"))
    groups = layer_groups(store)
    g = groups[store.moe_layers[0]]
    layers = [layer for layer in store.moe_layers if groups[layer] == g]
    tier = ResidentTier(store, mx.float32, {g: len(layers) * store.n_experts})
    last = (layers[-1], store.n_experts - 1)
    _fill_group(tier, store, layers, skip=last)
    assert all(tier.expert_weights(layer) is None for layer in layers)  # not all resident yet
    mx.synchronize()
    before = mx.get_active_memory()
    tier.fill(*last, len(layers) * store.n_experts - 1, store.read_record(store.record(*last)))
    assert mx.get_active_memory() - before < tier.nbytes / 8  # views, not copies of the pools
    for layer in layers:
        w = tier.expert_weights(layer)
        for e in (0, store.n_experts - 1):
            for name, ref in store.read_expert(layer, e).items():
                if ref.dtype == np.uint32:
                    np.testing.assert_array_equal(np.array(w[name][e]), ref)
    # A fill into the group (here: an expert read again into another layer's slot) drops the
    # views first, so the pool is updated in place, not copied while a view still shares it.
    del w
    layer0, layer1 = layers[0], layers[-1]
    mx.synchronize()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    tier.fill(layer0, 0, tier.slot_of[layer1][1], store.read_record(store.record(layer0, 0)))
    assert mx.get_peak_memory() - base < tier.nbytes / 8
    assert tier.expert_weights(layer0) is None and tier.expert_weights(layer1) is None


def _all_resident(store: Store, config: dict):
    n = len(store.records)
    pool = mmap.mmap(-1, n * store.max_record_bytes)
    router = Router(n, n_staging=n)
    loader = Loader(store, memoryview(pool), store.max_record_bytes)
    source = LocalExpertSource(router, loader)
    compute = Compute(store, config, source, memoryview(pool), store.max_record_bytes)
    assert compute.preload() == len(store.moe_layers)
    return compute, router, source, loader


def _config(**runtime) -> dict:
    cfg = load_config().to_dict()
    cfg["compute"].update(max_context=256, prefill_chunk=4)
    cfg["runtime"].update(runtime)
    return cfg


def test_all_resident_decode_reads_no_ids_back_and_counts_its_uses_from_shapes(tiny_stores):
    store = Store(tiny_stores("qwen3_moe"))
    compute, router, source, loader = _all_resident(store, _config())
    n = 6
    try:
        done = compute.generate(M.Generate(id=1, token_ids=PROMPT, max_tokens=n, stream=False))
    finally:
        loader.close()
    e, k, L = compute.experts, store.top_k, len(store.moe_layers)
    prefill_passes = -(-(len(PROMPT) - 1) // 4)
    assert len(done.token_ids) == n and compute.experts.tier.all_full()
    assert source.messages.get("used") == prefill_passes  # the decode passes told the router nothing
    assert e.counters.get("gate_syncs") == 0 and not e.passes and not e.unreported
    # each decode pass: one row, k distinct experts per MoE layer, all hits
    assert e.counters.get("uses") - router.stats()["uses"] == n * k * L
    assert e.counters.get("hits") == e.counters.get("uses")


def test_all_resident_decode_still_records_its_routing_where_a_trace_is_recorded(tiny_stores, tmp_path):
    store = Store(tiny_stores("qwen3_moe"))
    out = tmp_path / "rec.npz"
    compute, router, source, loader = _all_resident(store, _config(record_trace=str(out)))
    n = 6
    try:
        compute.generate(M.Generate(id=1, token_ids=PROMPT, max_tokens=n, stream=False))
    finally:
        loader.close()
    trace = load_trace(out)
    assert trace.lengths.tolist() == [len(PROMPT) + n - 1]
    decode = trace.ids[len(PROMPT):]  # the rows of decode passes: the gate's k distinct experts
    assert all(len(set(row.tolist())) == store.top_k for row in decode.reshape(-1, store.top_k))


def test_sampling_takes_rows_and_draws_from_the_nucleus_in_vocabulary_order():
    probs = np.array([[0.05, 0.3, 0.5, 0.15]], dtype=np.float32)  # nucleus at 0.7: tokens 2 and 1
    logits = mx.array(np.log(probs)).astype(mx.bfloat16)
    greedy = sample_on_device(logits, M.Generate(id=0, prompt="x"), None, mx.bfloat16)
    assert greedy.shape == (1,) and greedy.tolist() == [2]
    both = sample_on_device(mx.concatenate([logits, logits[:, ::-1]]), M.Generate(id=0, prompt="x"), None)
    assert both.tolist() == [2, 1]
    drawn = {int(sample_on_device(logits, M.Generate(id=0, prompt="x", temperature=1.0, top_p=0.7), mx.random.key(s)).item()) for s in range(64)}
    assert drawn == {1, 2}


def test_top_k_1_is_greedy_ties_included():
    """top_k 1 keeps the most likely token whatever the temperature: greedy's, so where the
    model's own values tie (common in bfloat16) the lower token id, as greedy picks it."""
    logits = mx.array([[0.0, 1.5, 3.0, 3.0, 3.0, -1.0]]).astype(mx.bfloat16)
    greedy = sample_on_device(logits, M.Generate(id=0, prompt="x"), None, mx.bfloat16).tolist()
    assert greedy == [2]
    for s in range(16):
        req = M.Generate(id=0, prompt="x", temperature=1.0, top_k=1, top_p=0.9, seed=s)
        assert sample_on_device(logits, req, mx.random.key(s), mx.bfloat16).tolist() == greedy
