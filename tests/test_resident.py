"""The resident tier (workers/resident.py), the budget's two tiers (runtime/budget.py, tiers.py),
the zero-copy probe, and what a resident expert costs: no copy, no message, no sync per use."""
from __future__ import annotations

import contextlib
import mmap
import threading
import time
from dataclasses import replace
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest

from deltafin.protocol import messages as M
from deltafin.runtime import budget as budget_module, tiers
from deltafin.runtime.budget import plan_budget
from deltafin.runtime.config import load_config
from deltafin.runtime.models.switch import in_token_order, pairs_of, run_pairs, switch_glu, uniform_quant
from deltafin.runtime.store import Store
from deltafin.workers import resident
from deltafin.workers.engine import Compute
from deltafin.workers.sources import LocalExpertSource
from deltafin.workers.loader import Loader
from deltafin.workers.resident import ResidentTier
from deltafin.workers.router import Router

ARCH = "deepseek_v3"  # a dense first layer, two MoE layers, 8 experts, top-2
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]


def _config(**cache) -> dict:
    cfg = load_config().to_dict()
    cfg["compute"].update(max_context=256, prefill_chunk=4)
    cfg["cache"].update(cache)
    return cfg


def _compute(store: Store, n_slots: int, n_staging: int | None = None, config=None):
    n_staging = n_staging or n_slots
    pool = mmap.mmap(-1, n_staging * store.max_record_bytes)
    router = Router(n_slots, n_staging=n_staging)
    loader = Loader(store, memoryview(pool), store.max_record_bytes)
    source = LocalExpertSource(router, loader)
    compute = Compute(store, config or _config(), source, memoryview(pool), store.max_record_bytes)
    return compute, router, source, loader


def _record(store: Store, layer: int, expert: int) -> memoryview:
    return store.read_record(store.record(layer, expert))


def test_a_second_pass_over_resident_experts_makes_no_fill_no_message_no_sync(tiny_stores):
    store = Store(tiny_stores(ARCH))
    compute, router, source, loader = _compute(store, len(store.records))
    assert compute.preload() == len(store.moe_layers)  # the tier holds every expert: read them in
    fills, sent = compute.experts.tier.fills, source.messages.snapshot()
    assert fills == len(store.records) and sent == {"need": 2, "filled": fills}
    first = compute.logits(PROMPT)
    again = compute.logits(PROMPT)
    np.testing.assert_array_equal(first, again)
    e = compute.experts
    assert e.tier.fills == fills                      # no copy per use
    assert source.messages.get("need") == 2 and source.messages.get("filled") == fills
    passes = 2 * -(-len(PROMPT) // 4)
    assert source.messages.get("used") == passes      # one report per pass, never waited for
    assert e.counters.get("gate_syncs") == 0          # the ids never came back before the pass ended
    assert router.stats()["hits"] == router.stats()["uses"] == e.counters.get("uses") > 0
    loader.close()


def test_resident_hits_in_a_partial_tier_cost_a_sync_but_no_message(tiny_stores):
    store = Store(tiny_stores(ARCH))
    compute, router, source, loader = _compute(store, len(store.records) - 1)  # never all resident
    compute.logits(PROMPT[:4])
    sent, fills = source.messages.snapshot(), compute.experts.tier.fills
    compute.logits(PROMPT[:4])  # the same tokens: the same experts, all resident by now
    assert compute.experts.tier.fills == fills
    assert source.messages.get("need") == sent["need"] and source.messages.get("used") == sent.get("used", 0) + 1
    assert compute.experts.counters.get("gate_syncs") == 2 * len(store.moe_layers)
    loader.close()


def test_updating_a_slot_does_not_copy_the_pool(tiny_stores):
    store = Store(tiny_stores(ARCH))
    layer = store.moe_layers[0]
    n = 256
    tier = ResidentTier(store, mx.float32, {store.record(layer, 0).layout: n})
    pool_bytes = tier.nbytes
    record = _record(store, layer, 3)
    tier.fill(layer, 3, 7, record)  # first use of the kernels, outside the measurement
    mx.eval(list(tier.weights(layer).values()))
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    tier.fill(layer, 3, 200, record)
    extra = mx.get_peak_memory() - base
    assert extra < pool_bytes / 8, f"a one-slot fill took {extra} bytes beyond a pool of {pool_bytes}"
    w = tier.weights(layer)
    ref = store.read_expert(layer, 3)
    for name, arr in ref.items():
        if arr.dtype == np.uint32:
            np.testing.assert_array_equal(np.array(w[name][200]), arr)


def test_a_fill_follows_an_expert_the_router_moved(tiny_stores):
    """The router may read an expert again into another slot within one need (a victim chosen for
    an earlier expert of the same need); fills can arrive in any order (loader threads)."""
    store = Store(tiny_stores(ARCH))
    layer = store.moe_layers[0]
    tier = ResidentTier(store, mx.float32, {store.record(layer, 0).layout: 4})
    tier.fill(layer, 4, 3, _record(store, layer, 4))
    tier.fill(layer, 4, 0, _record(store, layer, 4))   # moved: slot 3 is free now
    tier.fill(layer, 2, 3, _record(store, layer, 2))   # slot 3 refilled: 4 stays at slot 0
    assert tier.slot_of[layer][4] == 0 and tier.slot_of[layer][2] == 3
    assert tier.count[layer] == 2 and tier.holds(layer, 4, 0) and tier.holds(layer, 2, 3)
    assert tier.missing(layer, range(store.n_experts)) == [0, 1, 3, 5, 6, 7]


def _stacked_experts(rng, n_experts: int, d: int, f: int) -> dict:
    """Random SwiGLU experts quantized 4-bit g64, stacked [E, out, in] as mlx-lm holds them."""
    w = {}
    for name, shape in (("gate_proj", (f, d)), ("up_proj", (f, d)), ("down_proj", (d, f))):
        parts = [mx.quantize(mx.array(rng.standard_normal(shape).astype(np.float32)), 64, 4) for _ in range(n_experts)]
        for i, part in enumerate(("weight", "scales", "biases")):
            w[f"{name}.{part}"] = mx.stack([p[i] for p in parts])
    return w


def test_gather_on_pools_by_slot_equals_gather_on_stacked_experts():
    """Each row's result depends only on its row and its expert, not on the slot numbering, on
    the sorted (>= 64 pairs) and the unsorted path alike."""
    E, D, F = 8, 128, 64
    rng = np.random.default_rng(0)
    w = _stacked_experts(rng, E, D, F)
    where = rng.permutation(20)[:E]  # expert e lives in slot where[e] of a 20-slot pool
    pool = {k: mx.zeros((20, *v.shape[1:]), dtype=v.dtype) for k, v in w.items()}
    for k in pool:
        for e in range(E):
            pool[k][int(where[e])] = w[k][e]
    quant = uniform_quant(w, 4, 64)
    for rows in (1, 5, 40):  # 40 rows x top-2 = 80 pairs: the sorted path
        x = mx.array(rng.standard_normal((rows, D)).astype(np.float32))
        inds = mx.array(np.argsort(rng.random((rows, E)), axis=1)[:, :2].astype(np.uint32))
        stacked = switch_glu(x, inds, w, quant)
        pooled = switch_glu(x, mx.array(where.astype(np.uint32))[inds], pool, quant)
        np.testing.assert_array_equal(np.array(stacked), np.array(pooled))


@pytest.mark.parametrize("pad", [False, True])
def test_a_layer_in_chunks_equals_the_one_call_padded_or_not(pad):
    """Chunks of a layer's experts (run_pairs, joined by in_token_order) give the one call's rows,
    whether each chunk runs on its own rows or padded to the layer's row count as on a GPU (where
    the row count picks the kernel); on the sorted and the unsorted path."""
    E, D, F = 8, 128, 64
    rng = np.random.default_rng(1)
    w = _stacked_experts(rng, E, D, F)
    quant = uniform_quant(w, 4, 64)
    for rows in (3, 40):  # 6 pairs: unsorted; 80 pairs: sorted
        x = mx.array(rng.standard_normal((rows, D)).astype(np.float32))
        ids = np.argsort(rng.random((rows, E)), axis=1)[:, :2].astype(np.uint32)
        whole = switch_glu(x, mx.array(ids), w, quant)
        ids1, pieces, order = ids.reshape(-1), [], []
        for chunk in ([0, 1, 2], [3, 4, 5], [6, 7]):
            pairs = pairs_of(ids1, np.isin(ids1, chunk))
            if pairs.size:
                pieces.append(run_pairs(x, 2, pairs, ids1[pairs], w, quant, ids1.size, pad=pad))
                order.append(pairs)
        joined = in_token_order(pieces, order, (rows,), 2, D)
        np.testing.assert_array_equal(np.array(whole), np.array(joined))


def test_the_resident_tier_reports_its_slots_and_runs_exactly(tiny_stores):
    """Two resident slots or every expert: the tier reports what it holds, the logits are equal."""
    store = Store(tiny_stores(ARCH))
    compute, _, _, loader = _compute(store, store.top_k)
    assert compute.stats()["expert_tier"]["resident_slots"] == {store.record(store.moe_layers[0], 0).layout: 2}
    tight = compute.logits(PROMPT)
    loader.close()
    compute, _, _, loader = _compute(store, len(store.records))
    np.testing.assert_array_equal(compute.logits(PROMPT), tight)
    loader.close()


def test_a_pass_launched_ahead_and_dropped_leaves_no_trace(tiny_stores, tmp_path):
    """With every expert resident the next pass is launched before the last token is read; when
    the answer stops (EOS) that pass is dropped: tokens, the recorded routing and the uses the
    router saw are those of the run that never launches ahead."""
    store = Store(tiny_stores(ARCH))
    runs = {}
    for name in ("ahead", "in_step"):
        cfg = _config()
        cfg["runtime"]["record_trace"] = str(tmp_path / f"{name}.npz")
        compute, router, source, loader = _compute(store, len(store.records), config=cfg)
        compute.preload()
        compute.experts.force_sync = name == "in_step"  # no launching ahead, every layer read back
        first = compute.generate(M.Generate(id=1, token_ids=PROMPT, max_tokens=12, stream=False))
        compute.eos_ids = {first.token_ids[4]}  # the answer now stops at its 5th token
        done = compute.generate(M.Generate(id=2, token_ids=PROMPT, max_tokens=12, stream=False))
        sampled = compute.generate(M.Generate(id=3, token_ids=PROMPT, max_tokens=8, temperature=0.9,
                                              top_p=0.8, seed=5, stream=False))
        runs[name] = (first.token_ids, done.token_ids, done.finish_reason, sampled.token_ids,
                      Counter(router.uses), np.load(tmp_path / f"{name}.npz", allow_pickle=False)["ids"],
                      compute.experts.counters.get("gate_syncs"))
        loader.close()
    ahead, in_step = runs["ahead"], runs["in_step"]
    assert ahead[2] == "stop" and len(ahead[1]) < 5 + 1
    assert ahead[:5] == in_step[:5]
    np.testing.assert_array_equal(ahead[5], in_step[5])
    assert ahead[6] == 0 < in_step[6]


def test_budget_counts_both_tiers(tiny_stores):
    store = Store(tiny_stores(ARCH))
    cfg = load_config(None, {"runtime.memory_budget": "1GiB", "compute.dtype": "float32",
                             "loader.threads": 3})
    plan = plan_budget(store, cfg)
    (group,) = plan.group_experts
    per = plan.resident_bytes[group]
    assert plan.staging_slots == 6 and plan.staging == 6 * store.max_record_bytes  # 2 x 3 threads
    # float32 scales and biases: the resident expert is the record's packed weights + floats at 4 B
    layout = store.layouts[group]
    assert per == sum(t["nbytes"] if t["dtype"] == "uint32" else t["nbytes"] // 2 * 4
                      if t["dtype"] in ("float16", "bfloat16") else t["nbytes"] for t in layout["tensors"])
    assert plan.minimum == (plan.dense + plan.processes + plan.reserves + plan.staging
                            + store.top_k * per)
    # sizing: what is left after the measured tree, the reserves and the staging ring
    quantum = budget_module.MEASURE_QUANTUM  # the measurement is rounded up to it: take one on it
    measured = -(-(plan.dense + 80 * 2**20) // quantum) * quantum
    budget = plan.budget_for(5)
    plan.budget = budget + (measured - plan.dense - plan.processes)
    assert plan.size_pool(measured) == 5 and plan.resident == {group: 5}
    assert plan.size_pool(measured, cap=3) == 3
    plan.budget = 10 * 2**30
    assert plan.size_pool(measured) == len(store.records)  # never more than every expert
    with pytest.raises(Exception, match="below the minimum"):
        plan.budget = plan.minimum - 1
        plan.size_pool(measured)


def test_the_plan_says_before_start_whether_experts_stream(tiny_stores):
    """What compute decides its MLX CUDA graphs on before its first kernel (bench.cuda_graphs
    "auto"): the estimate leaves experts out at a small budget or under cache.max_slots."""
    store = Store(tiny_stores(ARCH))
    plan = plan_budget(store, load_config(None, {"runtime.memory_budget": "4GiB"}))
    n = len(store.records)
    assert plan.estimated_slots() >= n and not plan.streams() and not plan.streams(cap=n)
    assert plan.streams(cap=n - 1)
    plan.budget = plan.budget_for(n // 2)
    assert plan.streams()


def test_resident_slots_split_among_layouts():
    sizes, per = {"A": 100, "B": 20}, {"A": 10, "B": 50}
    out = tiers.split_resident(sizes, per, room=(50 * 10 + 10 * 50))
    assert out == {"A": 50, "B": 10}  # the same half of each
    assert tiers.split_resident(sizes, per, room=10**9) == sizes
    assert sum(tiers.split_resident(sizes, per, room=10**9, cap=60).values()) == 60


def test_resident_compare_tool_runs_both_with_nothing_read_while_generating(mlx_lm_stores):
    from deltafin.tools import resident_compare
    qpath, store = mlx_lm_stores("qwen3_moe")
    out = resident_compare.run(str(store), str(qpath), PROMPT, tokens=5, rounds=1, log=lambda m: None)
    assert out["all_same_tokens"] and len(out["rounds"]) == 1
    assert out["fills_while_generating"] == 0 and out["needs_while_generating"] == 0
    assert out["gate_syncs_while_generating"] == 0  # every layer resident: ids never read back
    assert out["preloaded_layers"] == len(Store(store).moe_layers)
    assert out["median_ratio"] > 0 and out["median_cpu_ratio"] > 0


def test_the_runtime_allocates_the_resident_tier_the_budget_counted(tiny_stores):
    """The supervisor sizes the resident tier at the bytes a resident expert takes; compute's pools
    are exactly that, and the staging segment is the small ring."""
    from deltafin.client import Client
    from deltafin.tools.run import running_supervisor
    store = Store(tiny_stores(ARCH))
    with running_supervisor(store.path, "4GiB", ["--max-slots", "5"]) as (ep, _):
        with Client(ep, timeout=60) as c:
            c.generate(PROMPT, max_tokens=3)
            s = c.stats()
    mem, tier = s["memory"], s["workers"]["compute"]["expert_tier"]
    (group, per), = mem["resident_bytes"].items()
    assert mem["n_slots"] == 5 and mem["resident"] == {group: 5} == tier["resident_slots"]
    assert tier["resident_bytes"] == 5 * per
    assert mem["staging_bytes"] == mem["staging_slots"] * mem["slot_bytes"]
    assert mem["staging_slots"] == max(2 * store.top_k, 2 * 4)  # 2 x loader.threads (4)


@pytest.fixture(scope="module")
def bf16_store(tmp_path_factory):
    """A tiny store converted from a bfloat16 checkpoint: bfloat16 scales and biases."""
    from deltafin.tools import convert
    from deltafin.tools.synth import tiny
    root = tmp_path_factory.mktemp("bf16")
    src = tiny(ARCH, root / "hf", seed=11, dtype="bfloat16")
    assert convert.main([str(src), str(root / "store"), "--no-progress"]) == 0
    return Store(root / "store")


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_host_writes_fill_the_pools_exactly_as_mlx_does(bf16_store, dtype):
    """On the CPU a fill writes the pools' memory with numpy (ResidentTier.host); the pools must
    hold the very bits MLX's own copy and conversion gives, scales and biases included."""
    store = bf16_store
    layer = store.moe_layers[0]
    g = store.record(layer, 0).layout
    direct = ResidentTier(store, dtype, {g: 4}, host_writes=True)
    graph = ResidentTier(store, dtype, {g: 4}, host_writes=False)
    assert direct.host[g] and not graph.host[g]
    hows = {how for how, _ in direct.host[g].values()}
    assert hows == {mx.float32: {"bytes", "bf16>f32"}, mx.bfloat16: {"bytes"}, mx.float16: {"bytes"}}[dtype]
    for slot, expert in ((2, 5), (0, 1), (2, 3)):  # slot 2 written twice
        for tier in (direct, graph):
            tier.fill(layer, expert, slot, _record(store, layer, expert))
    for name, pool in graph.weights(layer).items():
        a, b = direct.weights(layer)[name], pool
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.array(a.view(mx.uint8) if a.dtype == mx.bfloat16 else a),
                                      np.array(b.view(mx.uint8) if b.dtype == mx.bfloat16 else b))


@pytest.mark.parametrize("held_by", ["pass", "hits_first"])
def test_a_fill_in_place_first_evaluates_the_pass_reading_the_slot(tiny_stores, held_by):
    """MLX graphs are lazy: a pass may hold an unevaluated use of slot 0 when a fill overwrites
    slot 0 in place (an earlier layer's output, or a layer's hits computing while its misses are
    read). SlotExperts.apply evaluates such uses first, so they compute with the expert the slot
    held when they were built."""
    store = Store(tiny_stores(ARCH))
    compute, router, source, loader = _compute(store, 4)
    e, layer = compute.experts, store.moe_layers[0]
    assert e.tier.host[e.tier.group_of[layer]], "the CPU backend writes the pools in place"
    x = mx.array(np.random.default_rng(1).standard_normal((1, store.config["hidden_size"])).astype(np.float32))
    quant = e.tier.quant(layer)

    def fill(expert: int) -> None:
        rec = _record(store, layer, expert)
        e.staging[:len(rec)] = rec
        e.apply(M.Fill(req=0, slot=0, staging=0, layer=layer, expert=expert, generation=0))

    fill(3)
    expected = np.array(switch_glu(x, mx.array([[0]], dtype=mx.uint32), e.tier.weights(layer), quant))
    e.begin_pass(1)
    pending = switch_glu(x, mx.array([[0]], dtype=mx.uint32), e.tier.weights(layer), quant)
    if held_by == "pass":
        e._reads_pools(pending, layer)
    else:
        e._inflight = {"layer": layer, "group": e.tier.group_of[layer], "slots": {0}, "pieces": [pending],
                       "waiting": set(), "stream": False}
    fill(6)  # slot 0 now holds expert 6
    np.testing.assert_array_equal(np.array(pending), expected)
    assert not np.array_equal(np.array(switch_glu(x, mx.array([[0]], dtype=mx.uint32), e.tier.weights(layer), quant)),
                              expected)
    loader.close()


def test_a_fill_in_place_waits_only_for_graphs_of_the_layer_whose_slot_it_takes(tiny_stores):
    """A slot is read only by graphs of the layer whose expert it held: a fill into a slot of
    another layer leaves the pass's pending graph alone (no settle, no device drain); one into a
    slot of a layer with a graph still open settles first; a read-back of a layer's routing
    proves the graphs of the layers before it done."""
    store = Store(tiny_stores(ARCH))
    compute, router, source, loader = _compute(store, 4)
    e = compute.experts
    a, b = store.moe_layers[0], store.moe_layers[1]
    assert e.tier.group_of[a] == e.tier.group_of[b]
    x = mx.array(np.random.default_rng(1).standard_normal((1, store.config["hidden_size"])).astype(np.float32))
    quant = e.tier.quant(a)

    def fill(layer: int, expert: int, slot: int) -> None:
        rec = _record(store, layer, expert)
        e.staging[:len(rec)] = rec
        e.apply(M.Fill(req=0, slot=slot, staging=0, layer=layer, expert=expert, generation=0))

    fill(a, 3, 0)
    fill(b, 2, 1)
    expected = np.array(switch_glu(x, mx.array([[0]], dtype=mx.uint32), e.tier.weights(a), quant))
    e.begin_pass(1)
    pending = switch_glu(x, mx.array([[0]], dtype=mx.uint32), e.tier.weights(a), quant)
    e._reads_pools(pending, a)
    before = e.counters.get("settles")
    fill(b, 5, 1)  # layer b's slot: no graph of b is open
    assert "reads" in e.current and e.counters.get("settles") == before
    fill(b, 6, 2)  # a slot never filled
    assert "reads" in e.current and e.counters.get("settles") == before
    fill(b, 7, 3)
    e.tier.drop(b, 3)
    fill(a, 5, 3)  # emptied, but held by b last: still no graph of b open
    assert "reads" in e.current and e.counters.get("settles") == before
    fill(a, 6, 0)  # layer a's slot, read by the pending graph: it is evaluated first
    assert e.counters.get("settles") == before + 1
    np.testing.assert_array_equal(np.array(pending), expected)
    # a later layer's routing read back: the graphs of the layers before it are done
    for layer in (a, b):
        e._reads_pools(switch_glu(x, mx.array([[0]], dtype=mx.uint32), e.tier.weights(layer), quant), layer)
    assert e._may_read(a) and e._may_read(b)
    e._done_below(b)
    assert not e._may_read(a) and e._may_read(b)  # b's own graph may still run (launched ahead)
    # slot 0 is read by any layer running ahead on a missing expert: a graph of b still open
    # makes a fill of slot 0 settle, whichever layer held it
    before = e.counters.get("settles")
    fill(b, 1, 1)
    assert e.counters.get("settles") == before + 1  # (slot 1 was b's: settled)
    e._reads_pools(switch_glu(x, mx.array([[1]], dtype=mx.uint32), e.tier.weights(b), quant), b)
    e._done_below(b)
    e.tier.drop(a, 0)
    e.tier.last_layer[e.tier.group_of[a]][0] = None  # as if never filled
    fill(a, 2, 0)
    assert e.counters.get("settles") == before + 2
    loader.close()


@pytest.mark.parametrize("hits_first,stream", [(True, False), (False, True), (True, True)])
def test_a_layer_in_pieces_gives_the_same_logits_as_waiting_for_every_expert(tiny_stores, hits_first, stream):
    """A layer with misses computes in pieces while they are read: its hits first
    (Pipeline.hits_first), each miss as its fill lands (stream_misses). The logits are
    those of the layer waiting for all its experts, bit for bit, in prefill and in single-token
    passes; and the pieces did run (counted)."""
    store = Store(tiny_stores(ARCH))
    n_slots = len(store.records) // 2  # hits and misses in most layers
    out = {}
    for on in (True, False):
        compute, router, source, loader = _compute(store, n_slots, config=_config(policy="lru", prefetch=False))
        compute.experts.pipe = replace(compute.experts.pipe, hits_first=hits_first and on,
                                       stream_misses=stream and on)
        got = [compute.logits(PROMPT)] + [compute.logits([t]) for t in PROMPT[:6]]
        c = compute.experts.counters
        out[on] = (got, c.get("hits_first"), c.get("streamed_misses"))
        loader.close()
    assert bool(out[True][1]) == hits_first and bool(out[True][2]) == stream
    assert not out[False][1] and not out[False][2]
    for a, b in zip(out[True][0], out[False][0]):
        np.testing.assert_array_equal(a, b)


def test_fills_through_mlx_are_evaluated_where_no_graph_reads_the_pools(tiny_stores):
    """Fills written through MLX (a GPU backend) are left to the next graph that reads the pools;
    where none comes (the stand-in, a preload) `settle_writes` evaluates them, or every pending
    write would keep its record's copy alive."""
    store = Store(tiny_stores(ARCH))
    layer = store.moe_layers[0]
    tier = ResidentTier(store, mx.float32, {store.record(layer, 0).layout: 8}, host_writes=False)
    records = [_record(store, layer, e) for e in range(8)]
    nbytes = store.layout(layer)["nbytes"]
    base = mx.get_active_memory()
    for i in range(48):
        tier.fill(layer, i % 8, (i * 3) % 8, records[i % 8])
        tier.settle_writes()
    assert tier.pending_writes == 0
    grew = mx.get_active_memory() - base
    assert grew < 8 * nbytes, f"{grew} bytes still held after 48 fills of {nbytes}-byte records"


def test_the_cpu_backend_takes_host_writes():
    """The probe that turns host writes on: on the MLX CPU backend an array's memory is the
    host's, so a fill can write it in place (MLX CUDA's managed memory passes it too; measured on
    the lent H200, not here)."""
    if mx.default_device() != mx.cpu:
        pytest.skip("a GPU backend: the probe's answer is measured on the device")
    got = resident.probe_host_writes()
    assert got["host_writes"], got["why"]


def _is_cuda() -> bool:
    return mx.default_device() == mx.gpu and not resident.is_metal()


def test_pools_are_placed_in_host_memory_only_where_mlx_cuda_streams_experts(tiny_stores):
    """A tier with fewer slots than the model's experts asks for
    host placement (MLX CUDA: its managed pools advised to live in host memory); one holding
    every expert does not; elsewhere there is nothing to place and the tier says why."""
    store = Store(tiny_stores(ARCH))
    n_keys = len(store.records)
    for n_slots, asked in ((n_keys // 2, True), (n_keys, False)):
        compute, router, source, loader = _compute(store, n_slots)
        placement = compute.stats()["expert_tier"]["placement"]
        loader.close()
        if not asked:
            assert placement == {"placed": False, "why": "not asked"}
        elif _is_cuda():
            assert placement["placed"], placement["why"]
        else:
            assert not placement["placed"] and "not MLX CUDA" in placement["why"]


def test_pools_filled_by_the_driver_compute_what_host_pools_do(bf16_store):
    """MLX CUDA only: a tier whose pools live in device memory, filled by the driver's copies out
    of a pinned buffer (bytes as stored, and bfloat16 widened to float32), computes bit for bit
    what a tier in host memory written with numpy does; refilling a slot replaces its expert.
    Elsewhere the tier falls back to host writes and says there is nothing to place."""
    store = bf16_store
    layer = store.moe_layers[0]
    g = store.record(layer, 0).layout
    x = mx.array(np.random.default_rng(3).standard_normal((1, store.config["hidden_size"])).astype(np.float32))
    for dtype in (mx.float32, mx.bfloat16):
        tiers = [ResidentTier(store, dtype, {g: 4}, host_writes=True, on_host=True, copies=c) for c in (True, True, False)]
        tiers[1].defer_copies = True  # bench.batch_copies: waited for once, after the three fills
        if not _is_cuda():
            assert tiers[0].copies is None and "not MLX CUDA" in tiers[0].placement["why"]
        else:
            assert tiers[0].copies is not None and tiers[0].placement["where"] == "device", tiers[0].placement
            staging = np.zeros(4 << 20, dtype=np.uint8)
            assert tiers[0].copies.pin(staging)
        out = []
        for tier in tiers:
            for slot, expert in ((1, 5), (3, 2), (1, 7)):  # slot 1 refilled
                rec = _record(store, layer, expert)
                if tier.copies is not None:  # out of the pinned buffer, as from staging
                    staging[:len(rec)] = np.frombuffer(rec, dtype=np.uint8)
                    rec = memoryview(staging)[:len(rec)]
                tier.fill(layer, expert, slot, rec)
                if tier.defer_copies and tier.copies is not None:  # left queued; the same staging bytes are rewritten only once they are done
                    assert tier.copies.queued > 0
                    tier.settle_copies()
                    assert tier.copies.queued == 0
            out.append(np.array(switch_glu(x.astype(dtype), mx.array([[1, 3]], dtype=mx.uint32),
                                           tier.weights(layer), tier.quant(layer)).astype(mx.float32)))
            if tier.copies is not None:
                tier.copies.unpin()
        np.testing.assert_array_equal(out[0], out[2])
        np.testing.assert_array_equal(out[1], out[2])


def test_a_fills_copy_plan_writes_each_tensor_where_a_host_write_does(bf16_store):
    """bench.batch_copies queues a record's copies from addresses worked out once (`copy_plan`:
    the pool's address plus the slot's row, the record's plus the tensor's offset). Carried out
    here by memmove between the same real buffers, they leave every pool's bytes as `fill`'s
    host writes do, slot by slot, refills included (the driver's copy is checked on MLX CUDA
    above)."""
    import ctypes
    store = bf16_store
    layer = store.moe_layers[0]
    g = store.record(layer, 0).layout
    for dtype in (mx.float32, mx.bfloat16):
        planned, written = (ResidentTier(store, dtype, {g: 4}, host_writes=True) for _ in range(2))
        assert planned.rows[g], "no tensor held as stored"
        for slot, expert in ((1, 5), (3, 2), (1, 7), (0, 4)):
            rec = np.frombuffer(bytearray(_record(store, layer, expert)), dtype=np.uint8)
            for dst, src, n in planned.copy_plan(g, slot, rec):
                ctypes.memmove(dst, src, n)
            written.fill(layer, expert, slot, rec)
            for name in planned.rows[g]:
                np.testing.assert_array_equal(planned.host[g][name][1], written.host[g][name][1])
        held = {name for name, (how, _) in written.host[g].items() if how == "bytes"}
        assert set(planned.rows[g]) == held


def test_pools_in_host_memory_compute_what_device_pools_do(bf16_store):
    """MLX CUDA only: a tier placed in host memory takes host writes the device sees, and the
    experts computed from it equal those from a tier left in device memory."""
    if not _is_cuda():
        pytest.skip("MLX CUDA only: other backends have no placement to choose")
    store = bf16_store
    layer = store.moe_layers[0]
    g = store.record(layer, 0).layout
    tiers = [ResidentTier(store, mx.float32, {g: 4}, host_writes=True, on_host=on) for on in (True, False)]
    assert tiers[0].placement["placed"], tiers[0].placement["why"]
    x = mx.array(np.random.default_rng(2).standard_normal((1, store.config["hidden_size"])).astype(np.float32))
    out = []
    for tier in tiers:
        for slot, expert in ((1, 5), (3, 2)):
            tier.fill(layer, expert, slot, _record(store, layer, expert))
        out.append(np.array(switch_glu(x, mx.array([[1, 3]], dtype=mx.uint32), tier.weights(layer), tier.quant(layer))))
    np.testing.assert_array_equal(out[0], out[1])


@contextlib.contextmanager
def _data_plane(name: str):
    """A real data plane in one process: a ROUTER standing in for the router and compute's
    RouterClient on a DEALER, after the hello. Yields (router socket, compute's identity, client,
    compute's socket)."""
    import zmq
    from deltafin.runtime.sockets import make_socket, recv, send
    from deltafin.workers.sources import RouterClient
    ctx = zmq.Context.instance()
    router = make_socket(ctx, zmq.ROUTER)
    router.bind(f"inproc://{name}")
    dealer = make_socket(ctx, zmq.DEALER, identity="compute")
    dealer.connect(f"inproc://{name}")
    try:
        send(dealer, M.PeerHello(role="compute"))
        ident, _ = recv(router, routed=True)
        yield router, ident, RouterClient(dealer, timeout_s=5, alive=lambda: True), dealer
    finally:
        dealer.close(0)
        router.close(0)


def test_router_client_poll_applies_landed_fills_and_keeps_the_rest_for_the_need():
    """Between needs compute takes the fills the router sent (prefetch reads that landed) over
    the real data-plane sockets, answers each `filled`, applies a failed read, and leaves any
    other message for the next need, which it answers."""
    from deltafin.runtime.sockets import recv, send
    with _data_plane("poll-test") as (router, ident, client, dealer):
        applied = []
        assert client.poll(applied.append) == 0  # nothing arrived: no wait
        send(router, M.Fill(req=0, slot=3, staging=1, layer=2, expert=7, generation=5), to=ident)
        send(router, M.Slots(req=1, layer=4, slots=[[1, 0, 2]], hits=1, wait_us=0), to=ident)
        send(router, M.FillFailed(req=0, slot=4, layer=2, expert=8, error="read failed"), to=ident)
        deadline = time.monotonic() + 5
        while dealer.poll(0) == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)  # all three queued
        assert client.poll(applied.append) == 1
        assert [type(m) for m in applied] == [M.Fill, M.FillFailed]
        _, filled = recv(router, routed=True)
        assert filled == M.Filled(staging=1, generation=5)
        granted = client.need(4, [1], applied.append)  # answered by the Slots kept aside
        assert granted.slots == [(1, 0)] and granted.hits == 1
        _, need = recv(router, routed=True)
        assert isinstance(need, M.Need) and need.req == 1


def test_a_need_answered_early_takes_its_own_fills_and_holds_the_others_back():
    """bench.defer_needs over the real data-plane sockets: a need with `early` returns at the
    router's pending answer; `finish` then applies (and acknowledges) the need's own fill as it
    comes, holds a lease's fill that came before it, unacknowledged, until the final answer, and
    applies it after; a pending answer never ends `finish`."""
    from deltafin.runtime.sockets import recv, send
    with _data_plane("early-test") as (router, ident, client, _):
        applied = []
        slots = [[5, 2, 9], [6, 3, 4]]
        send(router, M.Slots(req=1, layer=0, slots=slots, hits=1, wait_us=0, pending=True), to=ident)
        granted = client.need(0, [5, 6], applied.append, early=True)
        _, need = recv(router, routed=True)
        assert need.early and granted.pending == 1 and granted.slots == [(5, 2), (6, 3)] and not applied
        send(router, M.Fill(req=1, slot=7, staging=0, layer=1, expert=4, generation=3), to=ident)  # a lease's
        send(router, M.Slots(req=1, layer=0, slots=slots, hits=1, wait_us=0, pending=True), to=ident)
        send(router, M.Fill(req=1, slot=2, staging=1, layer=0, expert=5, generation=9), to=ident)  # its own
        send(router, M.Slots(req=1, layer=0, slots=slots, hits=1, wait_us=500, pending=False), to=ident)
        done = client.finish(1, 0, [5], applied.append)
        assert done.pending == 0 and done.wait_s == 0.0005
        assert [(m.layer, m.expert) for m in applied] == [(0, 5), (1, 4)]  # its own first
        acks = [recv(router, routed=True)[1] for _ in range(2)]
        assert acks == [M.Filled(staging=1, generation=9), M.Filled(staging=0, generation=3)]


def test_fills_applied_together_are_acknowledged_in_one_message_and_before_any_wait():
    """Fewer data-plane messages over the real sockets: fills a poll finds together are
    acknowledged by one `filled` (`more`); in a need's wait a fill whose successor is already
    there waits for it, but once nothing more is readable the acknowledgement goes out before
    compute waits (the router may need that staging slot for the very read it waits for). A
    need's leases ride the need (`Need.leases`, reqs following its own)."""
    from deltafin.runtime.sockets import recv, send
    with _data_plane("acks-test") as (router, ident, client, dealer):
        applied, settled = [], []
        # bench.batch_copies: what the acknowledgement waits for first (the driver's copies of
        # the fills it covers), called once per acknowledgement, after all its fills
        client.before_ack = lambda: settled.append(len(applied))
        for staging in (0, 1, 2):
            send(router, M.Fill(req=0, slot=staging, staging=staging, layer=1, expert=staging,
                                generation=10 + staging), to=ident)
        deadline = time.monotonic() + 5
        while dealer.poll(0) == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)  # all three queued
        assert client.poll(applied.append) == 3
        assert settled == [3]
        _, filled = recv(router, routed=True)
        assert filled == M.Filled(staging=0, generation=10, more=[[1, 11], [2, 12]])
        assert M.unfold(filled) == [M.Filled(staging=s, generation=10 + s) for s in (0, 1, 2)]
        assert not router.poll(50)  # one message for the three

        # a need: its fill lands alone, so its acknowledgement is out before the answer comes
        granted = {}
        waiter = threading.Thread(target=lambda: granted.update(
            g=client.need(2, [4, 5], applied.append, leases=[(3, [1], False), (4, [2, 6], True)])))
        waiter.start()
        _, need = recv(router, routed=True)
        assert need.leases == [[3, [1], False], [4, [2, 6], True]] and need.req == 1
        assert [(m.req, m.layer, m.lease, m.sure) for m in M.unfold(need)] == \
            [(1, 2, False, False), (2, 3, True, False), (3, 4, True, True)]
        send(router, M.Fill(req=1, slot=6, staging=3, layer=2, expert=4, generation=20), to=ident)
        assert router.poll(5000), "the fill's acknowledgement waited for the answer"
        assert recv(router, routed=True)[1] == M.Filled(staging=3, generation=20)
        send(router, M.Fill(req=1, slot=7, staging=4, layer=2, expert=5, generation=21), to=ident)
        send(router, M.Slots(req=1, layer=2, slots=[[4, 6, 20], [5, 7, 21]], hits=0, wait_us=0),
             to=ident)
        waiter.join(5)
        assert granted["g"].slots == [(4, 6), (5, 7)]
        assert recv(router, routed=True)[1] == M.Filled(staging=4, generation=21)
        client.leases([(5, [0], False)])  # the next lease's req follows the folded ones
        assert recv(router, routed=True)[1].req == 4
        sent = client.messages.snapshot()
        assert sent == {"filled": 3, "folded_filled": 2, "need": 1, "folded_lease": 2, "lease": 1}
        assert settled == [3, 4, 5]

        client.fold = False  # bench.fold_sends off: a message each
        client.leases([(5, [1], False), (6, [2], True)], hints=[[5, [1]]])
        one, two = recv(router, routed=True)[1], recv(router, routed=True)[1]
        assert (one.layer, one.hints, one.leases, two.layer, two.hints, two.sure) == (5, [[5, [1]]], None, 6, None, True)
        send(router, M.Fill(req=0, slot=1, staging=5, layer=1, expert=1, generation=30), to=ident)
        send(router, M.Fill(req=0, slot=2, staging=6, layer=1, expert=2, generation=31), to=ident)
        time.sleep(0.05)
        assert client.poll(applied.append) == 2
        assert [recv(router, routed=True)[1] for _ in range(2)] == \
            [M.Filled(staging=5, generation=30), M.Filled(staging=6, generation=31)]
        assert settled == [3, 4, 5, 6, 7]  # one wait per fill


def test_a_malformed_folded_lease_or_ack_drops_the_whole_message():
    """`unfold` checks every part before the router acts on any: a bad lease or acknowledgement
    inside a message is a bad message (ProtocolError), never a half-taken one."""
    good = M.Need(req=7, layer=1, experts=[2], leases=[[2, [3], True]])
    assert [m.req for m in M.unfold(good)] == [7, 8]
    for leases in ([[2, [3]]], [[2, ["x"], False]], [[2, [3], 1]], [[True, [3], False]], [5]):
        with pytest.raises(M.ProtocolError):
            M.unfold(M.Need(req=7, layer=1, experts=[2], leases=leases))
    for more in ([[1]], [[1, "2"]], [None]):
        with pytest.raises(M.ProtocolError):
            M.unfold(M.Filled(staging=0, generation=1, more=more))
    assert M.unfold(M.Used(uses=[])) == [M.Used(uses=[])]


class _RecordingDriver:
    """The few CUDA driver calls DriverCopies makes, recorded (no GPU here): registrations of host
    memory by address."""

    def __init__(self):
        self.registered: dict[int, int] = {}

    def cuCtxSetCurrent(self, ctx):
        return 0

    def cuStreamCreate(self, stream, flags):
        return 0

    def cuMemHostRegister_v2(self, address, nbytes, flags):
        if address in self.registered:
            return 712  # CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED
        self.registered[address] = nbytes
        return 0

    def cuMemHostUnregister(self, address):
        return 0 if self.registered.pop(address, None) is not None else 713


def test_a_pinned_staging_stays_mapped_until_its_registration_ends():
    """DriverCopies.pin holds the staging memory it registers: unmapped under a registration, the
    driver kept its stale pages at that address and copied from them into the next buffer mapped
    there (an H100, docs/probes/ahead_race.py). So the buffer cannot be closed while pinned, and a
    copier let go without unpin (an in-process tier) ends its registration first."""
    cu = _RecordingDriver()
    copies = resident.DriverCopies((cu, 0, None))
    pool = mmap.mmap(-1, 1 << 20)
    assert copies.pin(memoryview(pool)) and len(cu.registered) == 1
    with pytest.raises(BufferError):  # held: not unmapped under the registration
        pool.close()
    other = mmap.mmap(-1, 1 << 20)
    assert copies.pin(memoryview(other))  # a new staging: the old one let go first
    assert list(cu.registered) == [np.frombuffer(other, dtype=np.uint8).ctypes.data]
    pool.close()
    del copies  # no unpin: the registration ends as the copier goes
    assert cu.registered == {}
    other.close()
    refused = resident.DriverCopies((cu, 0, None))
    taken = mmap.mmap(-1, 1 << 16)
    cu.registered[np.frombuffer(taken, dtype=np.uint8).ctypes.data] = 1 << 16  # someone else's
    assert not refused.pin(memoryview(taken)) and refused.pin_error == 712
