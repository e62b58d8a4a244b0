"""Routing statistics shipped with deltafin, so deltafin-forecast answers without a trace.

`python -m deltafin.tools.routing_stats TRACE.npz` derives them from a real routing trace
(docs/TRACES.md; the file shipped, configs/routing_stats.json, came from the first prompts of
../shared/traces/dsv2lite-dev.npz, DeepSeek-V2-Lite: 26 MoE layers, 64 experts, top-6): the trace
is replayed through the router's own policy classes (tools/replay.py) at each cache fraction
(slots as a share of all experts), and for each (policy, fraction) the file keeps

- `miss_hist`: the share of (token, layer) pairs with m = 0..top_k misses (demand reads),
- `hit_rate`: 1 - misses / uses over the whole replay, and its 10th and 90th percentiles over
  the trace's prompts (`hit_rate_p10`, `hit_rate_p90`): how much one workload differs from another,
- `layer_hit_rate`: the hit rate of each MoE layer.

A model of another shape reads them at its own cache fraction, with each miss count scaled by
its top-k over the trace's and the same distribution for every one of its MoE layers
(`scaled_misses`): an assumption the forecast states.
"""
from __future__ import annotations

import argparse
import json
import sys
from importlib import resources
from pathlib import Path

import numpy as np

from deltafin.runtime.cli import Help

FRACTIONS = (0.05, 0.1, 0.2, 0.3, 0.5)
POLICIES = ("lru", "predictive")  # predictive: with prefetch, as the runtime runs it by default
STATS_FILE = "routing_stats.json"


def prompt_slices(lengths, tokens: int) -> list[slice]:
    """The prompts' token ranges among the first `tokens` of a trace (whole prompts only)."""
    out, start = [], 0
    for n in lengths:
        if start + n > tokens:
            break
        out.append(slice(start, start + int(n)))
        start += int(n)
    return out


def derive_one(ids: np.ndarray, prompts: list[slice], policy: str, frac: float) -> dict:
    """The statistics of one replay at `frac` of the trace's experts."""
    from deltafin.tools.replay import infer_experts, replay
    n_layers, top_k = ids.shape[1], ids.shape[2]
    slots = max(top_k, round(frac * n_layers * infer_experts(ids)))
    steps = replay(ids, slots, policy, per_step=True, prefetch=policy == "predictive")["reads_per_step"]
    steps = np.asarray(steps, dtype=np.int64)
    hist = np.bincount(steps.ravel(), minlength=top_k + 1)[:top_k + 1] / steps.size
    per_prompt = [1 - steps[p].sum() / (steps[p].size * top_k) for p in prompts]
    return {"policy": policy, "fraction": frac, "slots": slots, "miss_hist": hist.round(6).tolist(),
            "hit_rate": round(1 - float(steps.sum()) / (steps.size * top_k), 6),
            "hit_rate_p10": round(float(np.percentile(per_prompt, 10)), 6),
            "hit_rate_p90": round(float(np.percentile(per_prompt, 90)), 6),
            "layer_hit_rate": (1 - steps.sum(axis=0) / (steps.shape[0] * top_k)).round(4).tolist()}


def derive(trace: Path, tokens: int, fractions=FRACTIONS, policies=POLICIES, workers: int = 1) -> dict:
    """The statistics of the trace's first `tokens` tokens (whole prompts) at every (policy, fraction)."""
    from concurrent.futures import ProcessPoolExecutor

    from deltafin.runtime.traces import load_trace
    from deltafin.tools.replay import infer_experts
    t = load_trace(trace)
    prompts = prompt_slices(t.lengths, tokens)
    ids = t.ids[:prompts[-1].stop]
    jobs = [(p, f) for p in policies for f in fractions]
    with ProcessPoolExecutor(workers) as pool:
        cases = list(pool.map(derive_one, *zip(*[(ids, prompts, p, f) for p, f in jobs])))
    return {"source": f"{trace.name}: its first {len(prompts)} prompts ({len(ids)} tokens)",
            "derived_by": "python -m deltafin.tools.routing_stats (tools/routing_stats.py)",
            "moe_layers": int(ids.shape[1]), "experts": int(infer_experts(ids)), "top_k": int(ids.shape[2]),
            "tokens": int(len(ids)), "prompts": len(prompts), "cases": cases}


def load_stats() -> dict:
    """The statistics shipped with the package (configs/routing_stats.json)."""
    return json.loads(resources.files("deltafin.configs").joinpath(STATS_FILE).read_text())


def case_at(stats: dict, policy: str, frac: float) -> tuple[dict, dict]:
    """The two derived cases of `policy` around cache fraction `frac` (the same one twice at or
    beyond the ends of the grid); a policy not derived reads as LRU's (the runtime's weakest)."""
    cases = sorted((c for c in stats["cases"] if c["policy"] == policy), key=lambda c: c["fraction"]) or \
        sorted((c for c in stats["cases"] if c["policy"] == "lru"), key=lambda c: c["fraction"])
    below = [c for c in cases if c["fraction"] <= frac] or cases[:1]
    above = [c for c in cases if c["fraction"] >= frac] or cases[-1:]
    return below[-1], above[0]


def interpolated(stats: dict, policy: str, frac: float) -> dict:
    """miss_hist and hit rates at `frac`, linear between the derived fractions around it."""
    lo, hi = case_at(stats, policy, frac)
    w = 0.0 if hi["fraction"] == lo["fraction"] else (frac - lo["fraction"]) / (hi["fraction"] - lo["fraction"])
    w = min(1.0, max(0.0, w))
    mix = lambda key: (1 - w) * np.asarray(lo[key]) + w * np.asarray(hi[key])
    return {"policy": lo["policy"], "fraction": frac, "miss_hist": mix("miss_hist"),
            **{k: float(mix(k)) for k in ("hit_rate", "hit_rate_p10", "hit_rate_p90")},
            "between": (lo["fraction"], hi["fraction"])}


def scaled_misses(stats: dict, case: dict, top_k: int, n_moe: int, hit_rate: float | None = None,
                  rows: int = 1000) -> np.ndarray:
    """Misses per (token, layer) [rows, n_moe] of a model with top_k experts per token and n_moe
    MoE layers whose layers each miss as the trace's distribution says: a row per 1/rows of
    probability, each miss count scaled by top_k / the trace's top-k; hit_rate (a percentile of
    the prompts') rescales the counts so their mean misses that rate."""
    hist = np.asarray(case["miss_hist"], dtype=np.float64)
    counts = np.round(hist / hist.sum() * rows).astype(int)
    m = np.repeat(np.arange(len(hist), dtype=np.float64), counts) * (top_k / stats["top_k"])
    if hit_rate is not None and m.mean() > 0:
        m = m * (1 - hit_rate) * top_k / m.mean()
    return np.repeat(m[:, None], n_moe, axis=1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(formatter_class=Help, prog="python -m deltafin.tools.routing_stats",
                                description="Derive the routing statistics deltafin-forecast ships with.")
    p.add_argument("trace", help="a routing trace (.npz, docs/TRACES.md)")
    p.add_argument("--tokens", type=int, default=1500, help="replay the first prompts up to this many tokens")
    p.add_argument("--workers", type=int, default=2, help="replays run in parallel")
    p.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "configs" / STATS_FILE),
                   help="where to write them")
    a = p.parse_args(argv)
    stats = derive(Path(a.trace), a.tokens, workers=a.workers)
    Path(a.out).write_text(json.dumps(stats, indent=1) + "\n")
    print(f"wrote {a.out}: {len(stats['cases'])} cases from {stats['source']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
