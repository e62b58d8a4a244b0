"""Benchmark modes: routing from a trace, the compute stand-in, trace recording, the mmap baseline.

In-process where the roles suffice (Compute + LocalExpertSource), real supervisor processes where
the flags, the recording file or the merged stats are what is checked."""
from __future__ import annotations

import mmap
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest

from deltafin.client import Client
from deltafin.protocol import messages as M
from deltafin.runtime.config import ConfigError, load_config
from deltafin.runtime.store import Store
from deltafin.runtime.traces import load_trace, save_trace
from deltafin.tools.run import running_supervisor
from deltafin.tools.mmap_baseline import MmapExperts, MmapSource, run_inprocess
from deltafin.workers.engine import Compute
from deltafin.workers.sources import LocalExpertSource
from deltafin.workers.loader import Loader
from deltafin.workers.router import Router

BIG = "4GiB"
ARCH = "deepseek_v3"  # a dense first layer, two MoE layers, 8 experts, top-2
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
NORMAL = {"routing": "gate", "standin": None, "expert_source": "slots"}


def _config(prefill_chunk: int = 128, **bench) -> dict:
    """The defaults (what the runtime runs), a shorter context, and the given [bench] keys."""
    cfg = load_config().to_dict()
    cfg["compute"].update(max_context=256, prefill_chunk=prefill_chunk)
    cfg["bench"].update(bench)
    return cfg


def _decode_passes(done: M.Done) -> int:
    """Forward passes after the prefill: one per generated token but the last, unless an EOS
    (never part of token_ids) ended the answer."""
    return len(done.token_ids) - (done.finish_reason == "length")


def _in_process(store: Store, config: dict, n_slots: int):
    pool = mmap.mmap(-1, n_slots * store.max_record_bytes)
    router, loader = Router(n_slots), Loader(store, memoryview(pool), store.max_record_bytes)
    compute = Compute(store, config, LocalExpertSource(router, loader), memoryview(pool), store.max_record_bytes)
    return compute, router, loader


def _random_trace(path, store: Store, tokens: int, seed: int = 5, top_k=None, layers=None):
    """A trace of distinct uniform random experts per (token, layer)."""
    rng = np.random.default_rng(seed)
    k, n_layers = top_k or store.top_k, layers or len(store.moe_layers)
    ids = np.argsort(rng.random((tokens, n_layers, store.n_experts)), axis=-1)[..., :k].astype(np.uint8)
    save_trace(path, ids, np.array([tokens]), np.array(["synthetic"]))
    return ids


def _expected_uses(trace: np.ndarray, store: Store, passes: list[int]) -> Counter:
    """(layer, expert) -> how many passes used it: a pass over n tokens takes the trace's next n
    rows (wrapping around), and asks for each layer's distinct experts once."""
    uses, cursor = Counter(), 0
    for n in passes:
        rows = trace[(cursor + np.arange(n)) % len(trace)]
        for j, layer in enumerate(store.moe_layers):
            uses.update((layer, int(e)) for e in np.unique(rows[:, j]))
        cursor += n
    return uses


def test_trace_routing_makes_the_router_see_the_trace(tiny_stores, tmp_path):
    store = Store(tiny_stores(ARCH))
    trace = _random_trace(tmp_path / "t.npz", store, tokens=7)  # shorter than the run: wraps around
    cfg = _config(prefill_chunk=4, routing_trace=str(tmp_path / "t.npz"))
    compute, router, loader = _in_process(store, cfg, len(store.records))
    assert compute.bench_mode["routing"] == f"trace:{tmp_path / 't.npz'}"
    compute.logits(PROMPT)                                    # 3 passes: 4 + 4 + 2 tokens
    done = compute.generate(M.Generate(id=1, token_ids=PROMPT[:5], max_tokens=4, stream=False))
    passes = [4, 4, 2] + [4, 1] + [1] * _decode_passes(done)  # the prompt's last token alone
    assert router.uses == _expected_uses(trace, store, passes)
    assert done.stats["bench_mode"]["routing"].startswith("trace:")
    assert compute.stats()["bench_mode"] == done.stats["bench_mode"]
    loader.close()


def test_a_trace_that_does_not_fit_is_refused_at_start(tiny_stores, tmp_path):
    store = Store(tiny_stores(ARCH))
    cases = {"k.npz": ({"top_k": store.top_k + 1}, "routes 3 experts per token"),
             "l.npz": ({"layers": len(store.moe_layers) - 1}, "has 1 MoE layers, the store has 2")}
    for name, (shape, message) in cases.items():
        _random_trace(tmp_path / name, store, tokens=4, **shape)
        with pytest.raises(ConfigError, match=message):
            _in_process(store, _config(routing_trace=str(tmp_path / name)), 4)
    ids = np.full((2, len(store.moe_layers), store.top_k), store.n_experts, dtype=np.uint8)
    save_trace(tmp_path / "e.npz", ids, np.array([2]), np.array(["x"]))
    with pytest.raises(ConfigError, match="expert id 8 is out of range"):
        _in_process(store, _config(routing_trace=str(tmp_path / "e.npz")), 4)
    # the supervisor refuses it before any worker starts, with the same words
    r = subprocess.run([sys.executable, "-m", "deltafin.workers.supervisor", "--model", str(store.path),
                        "--routing-trace", str(tmp_path / "k.npz")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "routes 3 experts per token" in r.stderr and "top_k=2" in r.stderr
    r = subprocess.run([sys.executable, "-m", "deltafin.workers.supervisor", "--model", str(store.path),
                        "--record-trace", str(tmp_path / "no" / "such.npz")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "runtime.record_trace" in r.stderr and "directory does not exist" in r.stderr


def test_mmap_source_gives_the_runtimes_logits(tiny_stores):
    store = Store(tiny_stores(ARCH))
    compute, _, loader = _in_process(store, _config(), store.top_k)  # a tight pool: evictions
    slots = compute.logits(PROMPT)
    loader.close()
    source = MmapSource(store)
    mapped = Compute(store, _config(), source, None, 0, experts_cls=MmapExperts)
    assert mapped.bench_mode == {**NORMAL, "expert_source": "mmap"}
    np.testing.assert_array_equal(mapped.logits(PROMPT), slots)
    assert mapped.experts.counters.get("hits") == mapped.experts.counters.get("uses") > 0
    source.close()
    # and the real runtime (supervisor, workers, shared memory) agrees bit for bit
    with running_supervisor(store.path, BIG, ["--max-slots", str(store.top_k)]) as (ep, _):
        with Client(ep, timeout=60) as c:
            np.testing.assert_array_equal(c.logits(PROMPT), slots)


def test_run_inprocess_mmap_matches_slots_and_honours_bench_modes(tiny_stores, tmp_path):
    store = Store(tiny_stores(ARCH))
    cfg = _config()
    a = run_inprocess(store.path, cfg, PROMPT, 6, source="mmap", cold=True)
    b = run_inprocess(store.path, cfg, PROMPT, 6, source="slots")
    assert a["token_ids"] == b["token_ids"] and len(a["token_ids"]) == 6
    assert a["bench_mode"]["expert_source"] == "mmap" and b["bench_mode"]["expert_source"] == "slots"
    assert a["ttft_s"] > 0
    # the mmap baseline copies at every use; the runtime copies each expert once (here the
    # preload of a tier that holds them all), never per use
    assert a["bytes_touched"] == a["expert_uses"] * store.record(store.moe_layers[0], 0).nbytes
    assert b["bytes_touched"] == store.expert_bytes_total < a["bytes_touched"]
    assert b["messages"]["need"] == len(store.moe_layers)  # the preload's, none while generating
    assert a["stage_latency"]["prepare"]["count"] == a["expert_uses"] > 0
    # the stand-in routed from a trace, through the mmap source
    trace = _random_trace(tmp_path / "t.npz", store, tokens=9)
    cfg = _config(routing_trace=str(tmp_path / "t.npz"), standin=True, standin_moe_ms=2.0, standin_dense_ms=1.0)
    s = run_inprocess(store.path, cfg, PROMPT[:4], 5, source="mmap")
    assert s["bench_mode"]["standin"] == {"moe_ms": 2.0, "dense_ms": 1.0}
    assert s["generated_tokens"] == 5
    # the prompt's first 3 tokens, its last one alone (as mlx-lm), then one pass per token but the last
    expected = _expected_uses(trace, store, [3, 1] + [1] * 4)
    assert s["expert_uses"] == sum(expected.values())


def test_standin_generates_with_real_reads(tiny_stores):
    store = Store(tiny_stores(ARCH))
    n_layers = store.config["num_hidden_layers"]
    moe_ms, dense_ms, n = 4.0, 2.0, 6
    # in-process first, with token 0 made an EOS: the stand-in still runs to max_tokens
    compute, _, loader = _in_process(store, _config(standin=True, standin_moe_ms=moe_ms,
                                                    standin_dense_ms=dense_ms), store.top_k)
    compute.eos_ids = {0}
    done = compute.generate(M.Generate(id=3, token_ids=PROMPT, max_tokens=n, stream=False))
    assert done.token_ids == [0] * n and done.finish_reason == "length"
    assert done.stats["bench_mode"] == {"routing": "random", "standin": {"moe_ms": moe_ms, "dense_ms": dense_ms},
                                        "expert_source": "slots"}
    loader.close()
    # the real runtime: a pool of top_k slots, so every layer reads
    flags = ["--standin", "--standin-moe-ms", str(moe_ms), "--standin-dense-ms", str(dense_ms),
             "--max-slots", str(store.top_k)]
    with running_supervisor(store.path, BIG, flags) as (ep, _):
        with Client(ep, timeout=60) as c:
            assert c.health()["workers"]["compute"]["bench_mode"]["routing"] == "random"
            gen = c.generate(PROMPT, max_tokens=n)
            stats = c.stats()
    assert len(gen.token_ids) == n
    assert stats["workers"]["loader"]["bytes"] > 0 and stats["workers"]["loader"]["reads"] > 0
    assert stats["workers"]["loader"]["demand_pieces"] == 4  # the default, no more than the 4 threads
    assert stats["bench_mode"] == gen.stats["bench_mode"] and gen.stats["bench_mode"]["standin"]
    per_pass = (len(store.moe_layers) * moe_ms + (n_layers - len(store.moe_layers)) * dense_ms) / 1e3
    # a lower bound only: every decode pass waits at least its layers' stand-in time
    assert gen.stats["decode_s"] >= (n - 1) * per_pass
    assert gen.stats["prefill_s"] >= per_pass
    # compute's own thread's CPU time while decoding: its work, not the stand-in's sleeps
    dec = gen.stats["decode"]
    assert 0 < dec["host_s"] < dec["total_s"] - 0.5 * (n - 1) * per_pass


def _gate_routing(store: Store, requests: list[tuple[list[int], int]]) -> np.ndarray:
    """The gate's ids, per token and MoE layer, seen at the model's call to its expert provider
    (not through the recording code): the reference a recorded trace must equal."""
    compute, _, loader = _in_process(store, _config(), len(store.records))
    real, passes_seen = compute.experts, {}

    class Spy:
        def __getattr__(self, name):
            return getattr(real, name)

        def begin_pass(self, n, **kw):
            p = real.begin_pass(n, **kw)
            passes_seen[p] = []
            return p

        def discard(self, p):  # a pass launched ahead and not wanted: not part of the routing
            del passes_seen[p]
            real.discard(p)

        def __call__(self, layer, x, inds):
            seen = passes_seen[real.pass_no]
            # a layer computed again (running ahead, it chose a missing expert): what was seen
            # from its first call on ran on a wrong input
            again = next((i for i, (at, _) in enumerate(seen) if at == layer), None)
            if again is not None:
                del seen[again:]
            seen.append((layer, np.array(inds).reshape(-1, inds.shape[-1])))
            return real(layer, x, inds)
    compute.experts = Spy()
    for ids, n in requests:
        compute.generate(M.Generate(id=1, token_ids=ids, max_tokens=n, stream=False))
    loader.close()
    seen = [use for p in sorted(passes_seen) for use in passes_seen[p]]
    L = len(store.moe_layers)
    passes = [np.stack([inds for _, inds in seen[i:i + L]], axis=1) for i in range(0, len(seen), L)]
    assert all([layer for layer, _ in seen[i:i + L]] == store.moe_layers for i in range(0, len(seen), L))
    return np.concatenate(passes)


def test_recorded_trace_is_the_gates_routing_and_replays_to_the_same_tokens(tiny_stores, tmp_path):
    store = Store(tiny_stores(ARCH))
    requests = [(PROMPT, 8), ([7, 7, 1, 2], 5)]
    out, again = tmp_path / "rec.npz", tmp_path / "again.npz"
    with running_supervisor(store.path, BIG, ["--record-trace", str(out), "--max-slots", "4"]) as (ep, _):
        with Client(ep, timeout=60) as c:
            first = [c.generate(ids, max_tokens=n) for ids, n in requests]
            assert c.stats()["bench_mode"] == NORMAL and first[0].stats["bench_mode"] == NORMAL
    trace = load_trace(out)
    # every token processed: the prompt and every generated token but the last
    assert trace.lengths.tolist() == [len(ids) + _decode_passes(g) for (ids, _), g in zip(requests, first)]
    names = trace.names.tolist()  # the client's request ids
    assert len(set(names)) == 2 and all(n.isdigit() for n in names)
    assert trace.ids.shape[1:] == (len(store.moe_layers), store.top_k)
    np.testing.assert_array_equal(trace.ids, _gate_routing(store, requests))
    # the same requests routed from the recording: same experts, so the same greedy tokens
    flags = ["--routing-trace", str(out), "--record-trace", str(again), "--max-slots", "4"]
    with running_supervisor(store.path, BIG, flags) as (ep, _):
        with Client(ep, timeout=60) as c:
            replayed = [c.generate(ids, max_tokens=n) for ids, n in requests]
            assert c.stats()["bench_mode"]["routing"] == f"trace:{out}"
    assert [g.token_ids for g in replayed] == [g.token_ids for g in first]
    np.testing.assert_array_equal(load_trace(again).ids, trace.ids)


def test_run_command_records_a_trace_and_says_the_mode(tiny_stores, tmp_path):
    store = tiny_stores(ARCH)
    out = tmp_path / "run.npz"
    r = subprocess.run([sys.executable, "-m", "deltafin.tools.run", "--model", str(store), "--prompt", "hello",
                        "--max-tokens", "4", "--memory-budget", BIG, "--record-trace", str(out),
                        "--max-slots", "3", "--standin", "--standin-moe-ms", "0.5"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "BENCHMARK MODE: routing random, compute stand-in (0.5 ms per MoE layer" in r.stderr
    assert "time to first token" in r.stderr and "3 expert slots" in r.stderr
    trace = load_trace(out)
    assert len(trace.lengths) == 1 and trace.lengths[0] == trace.tokens > 3


def test_trace_routing_fills_slots_in_place_mid_pass(tiny_stores, tmp_path):
    """Routing from a trace reads no gate back, so nothing else evaluates a layer's input before
    its misses are filled: were the pass's pending graph still holding the pools, each fill
    would copy a whole pool (on the 26-layer store compute grew to 22 GB). Every fill of a
    prefill and of the decode steps writes its slot in the pool's own buffer."""
    import mlx.core as mx
    store = Store(tiny_stores(ARCH))
    _random_trace(tmp_path / "t.npz", store, tokens=11)
    cfg = _config(routing_trace=str(tmp_path / "t.npz"))
    compute, router, loader = _in_process(store, cfg, store.top_k * 2)  # misses in every layer
    tier = compute.experts.tier
    fill, moved = tier.fill, []

    def address(a) -> int:
        return np.asarray(a).__array_interface__["data"][0]

    def spy(layer, expert, slot, record):
        pools = tier.pools[tier.group_of[layer]]
        before = {n: address(p) for n, p in pools.items()}
        fill(layer, expert, slot, record)
        moved.extend(n for n, p in pools.items() if address(p) != before[n])
    tier.fill = spy
    done = compute.generate(M.Generate(id=1, token_ids=PROMPT, max_tokens=4, stream=False))
    assert len(done.token_ids) == 4 and tier.fills > len(store.moe_layers)
    assert moved == [], f"{len(moved)} pool copies in {tier.fills} fills"
    loader.close()
    mx.clear_cache()
