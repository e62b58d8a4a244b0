"""The bound deltafin-bench reports each contender against (../shared/DESIGN-NOTES.md): compute
per token with every expert resident, and Belady's reads per token over the probed bandwidth."""
from __future__ import annotations

import time

import numpy as np

from deltafin.tools.bench import Setup


def resident_compute_s_per_token(s: Setup, tokens: int) -> dict:
    """Compute-only decode time per token with every expert resident (stacked, no copies, no
    messages), in this process, uncapped: the compute term of the bound in the real regime."""
    import mlx.core as mx
    from deltafin.runtime.models import build_model
    from deltafin.runtime.models.switch import ResidentExperts
    store = s.store
    t0 = time.perf_counter()
    model = build_model(store.config, store.dense_weights(), store.manifest.get("dense_quantization"), s.dtype)
    layers = {}
    for layer in store.moe_layers:
        per = [store.read_expert(layer, e) for e in range(store.n_experts)]
        stacked = {}
        for name in per[0]:
            a = mx.array(np.stack([p[name] for p in per]))
            if per[0][name].dtype == np.uint16:  # bfloat16 bits
                a = a.view(mx.bfloat16)
            if mx.issubdtype(a.dtype, mx.floating) and a.dtype != model.dtype:
                a = a.astype(model.dtype)
            stacked[name] = a
        mx.eval(stacked)
        layers[layer] = stacked
        del per
    resident = ResidentExperts(layers, quant={layer: store.layout(layer)["quant"] for layer in store.moe_layers})
    routed = _trace_provider(resident, s) if s.trace_ids is not None else resident
    load_s = time.perf_counter() - t0
    cache = model.make_cache()
    mx.eval(model(mx.array(s.prompt_ids, dtype=mx.int32), cache, routed))
    times = []
    tok = 0
    for _ in range(tokens):
        t = time.perf_counter()
        logits = model(mx.array([tok], dtype=mx.int32), cache, routed)
        tok = int(mx.argmax(logits[-1]).item())
        times.append(time.perf_counter() - t)
    del layers, resident, model
    mx.clear_cache()
    return {"s_per_token": float(np.median(times)), "mean_s_per_token": float(np.mean(times)),
            "p90_s_per_token": float(np.percentile(times, 90)), "samples": len(times), "load_s": load_s,
            "how": "this process, every expert stacked in MLX memory, gather_qmm, median decode step"}


def _trace_provider(resident, s: Setup):
    """Routes from the trace's rows, as the runtime does in trace mode (cursor over tokens)."""
    import mlx.core as mx
    ids, moe = s.trace_ids, s.store.moe_layers
    state = {"cursor": 0, "seen": set()}

    def provider(layer, x, inds):
        n = inds.shape[0]
        rows = np.take(ids, np.arange(state["cursor"], state["cursor"] + n) % len(ids), axis=0)
        y = resident(layer, x, mx.array(rows[:, moe.index(layer), :].astype(np.int32)))
        if layer == moe[-1]:
            state["cursor"] += n
        return y
    return provider


def belady_read_s_per_token(s: Setup, probe_gbps: float) -> dict:
    """Belady (offline optimum) misses per decode token at deltafin's slot count over the tokens
    the run processes, times the record size, over the probed direct-read bandwidth."""
    from deltafin.tools.replay import replay
    n_prompt, n_total = len(s.prompt_ids), len(s.prompt_ids) + s.max_tokens - 1
    ids = _run_rows(s, n_total)
    full = replay(ids, s.n_slots, "belady", record_bytes=s.record_bytes)
    head = replay(ids[:n_prompt], s.n_slots, "belady", record_bytes=s.record_bytes)
    n_dec = n_total - n_prompt
    reads = max(0, full["reads"] - head["reads"]) / max(1, n_dec)
    bytes_per_token = reads * s.record_bytes
    return {"reads_per_token": reads, "bytes_per_token": bytes_per_token,
            "s_per_token": bytes_per_token / (probe_gbps * 1e9), "gbps": probe_gbps,
            "belady_hit_rate_run": full["hit_rate"]}


def _run_rows(s: Setup, n: int) -> np.ndarray:
    if s.trace_ids is None:
        raise ValueError("the bound needs routing from a trace")
    return np.take(s.trace_ids, np.arange(n) % len(s.trace_ids), axis=0)[:, :s.n_moe, :]
