"""deltafin-forecast --preset P with --memory-budget B or --cache-frac F and nothing else: a
forecast of decode tok/s before the download, as a range, with every assumption stated.

- Routing: the statistics shipped with the package (configs/routing_stats.json, derived from a
  real DeepSeek-V2-Lite trace by tools/routing_stats.py): the distribution of misses per MoE layer
  and token at the preset's cache fraction (interpolated between the derived fractions), each
  miss count scaled by the preset's top-k over the trace's, the same for every MoE layer.
- Disk: a direct-read probe of this machine's disk (a scratch file in the deltafin cache, where
  `deltafin chat` puts its stores) at the preset's record size, queue depths 1 and loader.threads.
- Compute: assumed memory-bound, as MoE decode is: the bytes a token reads (the dense weights but
  the embedding table, and top-k experts of each MoE layer, all 4-bit) over this machine's
  memory bandwidth as a float32 matrix-vector product reaches it, times 1 (the bound) to 3
  (kernels reaching a third of it).
- Messages: a Need -> Slots round trip between two processes, measured; a fill (prepare): one
  copy of the record at the measured memory bandwidth.
- Memory: dense weights at 4 bits, KV for compute.max_context, activations of one prefill chunk,
  staging slots, interpreters (PROCESS_BYTES, assumed); what is left holds expert slots.

The range: the low end takes the slowest compute (x3) and the prompts whose hit rate is the
10th percentile of the trace's; the high end the fastest compute (x1) and the 90th percentile;
the middle x2 and the trace's own distribution.
"""
from __future__ import annotations

import re
import time

import numpy as np

from deltafin.runtime.config import format_size, parse_size
from deltafin.tools.routing_stats import interpolated, load_stats, scaled_misses

PROCESS_BYTES = 400 << 20  # interpreters and libraries of the supervisor and its workers (assumed)
COMPUTE_FACTORS = {"low": 3.0, "middle": 2.0, "high": 1.0}  # x the memory-bandwidth bound
EXPERT_TENSOR = re.compile(r"\.experts\.\d+\.")


def measure_memory_gbps(nbytes: int = 256 << 20, repeats: int = 5) -> dict:
    """This machine's memory read bandwidth as decode uses it: the best of `repeats` float32
    matrix-vector products (BLAS, every core) over a matrix of nbytes."""
    w = np.ones((nbytes // 4 // 4096, 4096), dtype=np.float32)
    x = np.ones(4096, dtype=np.float32)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        w @ x
        best = min(best, time.perf_counter() - t0)
    return {"gbps": nbytes / best / 1e9,
            "how": f"numpy matrix-vector product over {format_size(nbytes)}, best of {repeats}"}


def dense_params(config: dict) -> tuple[int, int, int]:
    """(parameters of 2-D tensors outside the routed experts, of 1-D tensors, of the embedding table)."""
    from deltafin.tools.synth import tensor_shapes
    mats = vecs = embed = 0
    for name, shape in tensor_shapes(config).items():
        if EXPERT_TENSOR.search(name):
            continue
        n = int(np.prod(shape))
        if len(shape) >= 2:
            mats += n
            embed += n if "embed_tokens" in name else 0
        else:
            vecs += n
    return mats, vecs, embed


def memory_plan(shape, config: dict, cfg, bits: int = 4, group_size: int = 64) -> dict:
    """The fixed parts of the budget (all but expert slots), in bytes, with how each was had."""
    from deltafin.runtime.budget import kv_reserve_bytes
    mats, vecs, embed = dense_params(config)
    per_param = (bits + 32 / group_size) / 8  # 4 bits plus a bf16 scale and bias per group
    cc = cfg.compute
    vocab, hidden = int(config["vocab_size"]), int(config["hidden_size"])
    staging = max(2 * shape.top_k, 2 * cfg.loader.threads)
    parts = {"dense": int(mats * per_param + vecs * 2),
             "kv": kv_reserve_bytes(config, 2, cc.max_context, cc.kv_tokens, cc.max_batch),
             "activations": cc.prefill_chunk * (vocab * 8 + hidden * 2 * 16),
             "staging": staging * shape.record_bytes, "processes": PROCESS_BYTES}
    return {"parts": parts, "fixed": sum(parts.values()), "token_bytes": int((mats - embed) * per_param),
            "max_context": cc.max_context, "max_batch": cc.max_batch, "staging_slots": staging}


def cache_share(a, shape, plan: dict) -> tuple[float, int, int]:
    """(cache fraction, slots, whole budget) from --memory-budget or --cache-frac."""
    total = shape.n_moe * shape.n_experts
    if a.memory_budget:
        budget = parse_size(a.memory_budget)
        slots = (budget - plan["fixed"]) // shape.record_bytes
        if slots < shape.top_k:
            raise SystemExit(f"deltafin-forecast: {a.memory_budget} is below what {shape.name} needs before any "
                             f"expert: {format_size(plan['fixed'] + shape.top_k * shape.record_bytes, up=True)} "
                             f"(dense weights, KV, staging, processes and {shape.top_k} expert slots)")
        slots = min(int(slots), total)
        return slots / total, slots, budget
    frac = a.cache_frac[0]
    slots = shape.slots_at(frac)
    return frac, slots, plan["fixed"] + slots * shape.record_bytes


def trace_fit(stats: dict, shape) -> str:
    """How the shipped trace stands in for the preset."""
    same = (stats["experts"], stats["top_k"]) == (shape.n_experts, shape.top_k)
    if same and stats["moe_layers"] == shape.n_moe:
        return "the trace's own shape: no scaling"
    return (f"{shape.name} has {shape.n_experts} experts per layer, top-{shape.top_k}, {shape.n_moe} MoE layers; "
            f"the trace ({stats['experts']} experts, top-{stats['top_k']}, {stats['moe_layers']} layers) stands in "
            f"at the same cache fraction, misses x {shape.top_k}/{stats['top_k']}, one distribution for every "
            f"layer: this assumes {shape.name} routes as concentrated over a share of its experts as "
            f"DeepSeek-V2-Lite does (not measured for it)")


def forecast_preset(a, cfg, shape, config: dict, policy: str, threads: int) -> dict:
    """The forecast's range and its assumptions (printed, and returned for --json)."""
    from deltafin.runtime.diskprobe import probe_scratch
    from deltafin.runtime.config import cache_dir
    from deltafin.tools.forecast import forecast, measure_hop
    plan = memory_plan(shape, config, cfg)
    frac, slots, budget = cache_share(a, shape, plan)
    stats = load_stats()
    case = interpolated(stats, policy, frac)
    where = cache_dir()
    where.mkdir(parents=True, exist_ok=True)
    if a.disk_gbps:
        disk = {"gbps_by_queue_depth": {1: a.disk_gbps, threads: a.disk_gbps}, "record_bytes": shape.record_bytes,
                "given": True}
    else:
        disk = probe_scratch(where, shape.record_bytes, sorted({1, threads}))
    measured = disk["gbps_by_queue_depth"]
    gbps = {q: float(np.interp(q, sorted(measured), [measured[d] for d in sorted(measured)]))
            for q in range(1, threads + 1)}  # between the depths probed: linear
    mem = {"gbps": a.memory_gbps, "how": "given"} if a.memory_gbps else measure_memory_gbps()
    hop = measure_hop(shape.top_k)
    prepare_s = shape.record_bytes / (mem["gbps"] * 1e9)
    bound_s = (plan["token_bytes"] + shape.top_k * shape.n_moe * shape.record_bytes) / (mem["gbps"] * 1e9)
    ends = {}
    for end, hit in (("low", case["hit_rate_p10"]), ("middle", None), ("high", case["hit_rate_p90"])):
        steps = scaled_misses(stats, case, shape.top_k, shape.n_moe, hit)
        ends[end] = forecast(shape, steps, bound_s * COMPUTE_FACTORS[end], hop["s"], prepare_s, gbps, threads)
    out = {"preset": shape.name, "shape": shape.to_dict(), "cache_frac": frac, "n_slots": slots, "budget": budget,
           "memory_plan": plan, "policy": policy, "routing": {k: v for k, v in case.items() if k != "miss_hist"},
           "routing_source": stats["source"], "disk": disk, "memory_gbps": mem, "hop": hop,
           "prepare_s_per_expert": prepare_s, "compute_bound_s": bound_s, "range": ends}
    for line in assumption_lines(a, shape, plan, out, stats, case):
        print(line)
    lo, mid, hi = (ends[k]["tok_s"] for k in ("low", "middle", "high"))
    print(f"forecast: {lo:.3g} to {hi:.3g} tok/s decode (middle {mid:.3g}) for {shape.name} at "
          f"{format_size(budget)}, {frac:.1%} of the experts cached")
    out["tok_s_low"], out["tok_s_high"], out["tok_s_middle"] = lo, hi, mid
    return out


def assumption_lines(a, shape, plan: dict, out: dict, stats: dict, case: dict) -> list[str]:
    """Every assumption of the forecast, one line each."""
    parts = plan["parts"]
    disk = out["disk"]
    bw = ", ".join(f"{q} in flight {g:.2f} GB/s" for q, g in disk["gbps_by_queue_depth"].items())
    lo, hi = case["between"]
    fracs = [c["fraction"] for c in stats["cases"]]
    grid = "" if min(fracs) <= out["cache_frac"] <= max(fracs) else \
        f" (outside the derived {min(fracs):.0%}..{max(fracs):.0%}: the nearest fraction's figures are used)"
    lines = [
        f"assumes: store of {shape.name} at 4 bits, group 64: {format_size(shape.to_dict()['expert_bytes_total'])} "
        f"of experts ({shape.n_moe} MoE layers x {shape.n_experts} experts of {format_size(shape.record_bytes)}) "
        f"+ {format_size(parts['dense'])} dense weights",
        f"assumes: memory {format_size(out['budget'])} = dense {format_size(parts['dense'])} + KV "
        f"{format_size(parts['kv'])} (max_context {plan['max_context']} x {plan['max_batch']} sequences, "
        f"configs/default.toml) + activations {format_size(parts['activations'])} + staging "
        f"{format_size(parts['staging'])} ({plan['staging_slots']} slots) + processes "
        f"{format_size(parts['processes'])} (assumed) + {out['n_slots']} expert slots "
        f"({out['cache_frac']:.1%} of {shape.n_moe * shape.n_experts} experts)"
        + ("" if a.memory_budget else f"; the budget needed: --memory-budget {format_size(out['budget'], up=True)}"),
        f"assumes: disk given: {a.disk_gbps:.2f} GB/s at every queue depth (--disk-gbps)" if disk.get("given") else
        f"assumes: disk probed here: {bw} ({format_size(disk['record_bytes'])} reads of a scratch file in "
        f"{disk['path']}, direct I/O {'on' if disk['direct_io'] else 'off: the page cache may overstate it'})",
        f"assumes: compute not measured (no store): memory-bound decode, "
        f"{format_size(plan['token_bytes'] + shape.top_k * shape.n_moe * shape.record_bytes)} read per token at "
        f"{out['memory_gbps']['gbps']:.1f} GB/s ({out['memory_gbps']['how']}) = "
        f"{out['compute_bound_s'] * 1e3:.1f} ms, x1 (high end) to x3 (low end)",
        f"assumes: messages {out['hop']['s'] * 1e3:.3f} ms per Need -> Slots round trip (measured, "
        f"{out['hop']['how']}), two per layer with misses; a fill {out['prepare_s_per_expert'] * 1e3:.2f} ms "
        f"(one copy of a record at the measured memory bandwidth)",
        f"assumes: routing from configs/routing_stats.json ({stats['source']}, DeepSeek-V2-Lite), policy "
        f"{out['policy']}: hit rate {case['hit_rate']:.1%} at {out['cache_frac']:.1%} (prompts' 10th..90th "
        f"percentile {case['hit_rate_p10']:.1%}..{case['hit_rate_p90']:.1%}), "
        + (f"interpolated between the derived {lo:.0%} and {hi:.0%}" if lo != hi else f"derived at {lo:.0%}")
        + grid,
        f"assumes: trace fit: {trace_fit(stats, shape)}",
    ]
    return lines + [f"assumes: {note}" for note in shape.assumptions]
