"""deltafin-replay: a routing trace through the router's own slot table, policies and prefetcher.

  deltafin-replay TRACE --cache-frac F [--policy P] [--rank probability|recency] [--prefetch]
                  [--prefetch-threshold P] [--prefetch-depth D] [--prefetch-min-precision P]
                  [--history TRAIN.npz] [--tokens N]
                  [--experts N] [--record-bytes N] [--json OUT] [--splits]

Every (token, MoE layer) of the trace becomes one `need` of that token's top-k experts, in
trace order (`drive_need`), answered by an instant loader (each read order comes back `loaded` at
once). So the hit rate is the policy's alone, with the runtime's pins and one global slot budget.
With --prefetch the router also orders, each time it answers a need, reads of what its
prefetcher predicts for the next layer(s); they take slots and count as reads like any other,
and the policy is replayed once more without prefetch for the recall. LRU and Belady (the offline
optimum) run on the same trace and cache size for reference.
docs/TRACES.md describes the format and how the figures are counted.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from deltafin.protocol import messages as M
from deltafin.runtime.cache import POLICIES, Policy, Predictive, make_policy, policy_names
from deltafin.runtime.cli import Help
from deltafin.runtime.config import load_config
from deltafin.runtime.directio import round_up
from deltafin.runtime.store import ALIGN, Store, StoreError, record_layout
from deltafin.runtime.traces import Trace, TraceError, load_trace
from deltafin.workers.router import PREFETCH_DEFAULTS, Router, RouterError
from deltafin.workers.sources import drive_need

# Expert counts of the MoE models deltafin knows (Mixtral 8, Qwen2-MoE 60, OLMoE/DSV2-Lite 64,
# Qwen3 128, DeepSeek-V2 160, DeepSeek-V3 256, Kimi-K2 384): a trace may never use the
# highest ids, so the count inferred from the ids is rounded up to the next of these.
PROGRESS_EVERY = 256  # tokens between progress calls
PROGRESS_S = 2.0  # seconds between progress lines at most
KNOWN_EXPERT_COUNTS = (8, 16, 32, 40, 60, 64, 128, 160, 256, 384)


def expert_record_bytes(hidden: int = 2048, intermediate: int = 1408, bits: int = 4,
                        group_size: int = 64) -> int:
    """Bytes a direct read of one expert record fetches (docs/STORE.md): gate/up/down weights
    packed `bits` per weight in uint32, bf16 scales and biases per group, each tensor on 64
    bytes, the record rounded up to the store alignment. The defaults are DeepSeek-V2-Lite's
    (4,866,048 bytes)."""
    def proj(out: int, inp: int) -> dict:
        # shape-only arrays: record_layout reads shapes and dtypes, never the data
        return {"weight": np.broadcast_to(np.uint32(0), (out, inp * bits // 32)),
                "scales": np.broadcast_to(np.uint16(0), (out, inp // group_size)),
                "biases": np.broadcast_to(np.uint16(0), (out, inp // group_size))}
    shapes = {"gate_proj": (intermediate, hidden), "up_proj": (intermediate, hidden),
              "down_proj": (hidden, intermediate)}
    tensors = {f"{p}.{k}": a for p, (o, i) in shapes.items() for k, a in proj(o, i).items()}
    return round_up(record_layout(tensors, {})["nbytes"], ALIGN)


DSV2_LITE_RECORD_BYTES = expert_record_bytes()


def layer_read_bytes(store) -> list[int]:
    """Bytes a read of one expert of each MoE layer of a store fetches (a layer's records share
    one layout; mixed recipes give layers of other sizes)."""
    return [store.record(layer, 0).read_nbytes for layer in store.moe_layers]


def infer_experts(ids: np.ndarray) -> int:
    """The model's expert count from the ids: max id + 1, rounded up to a known count."""
    seen = int(ids.max()) + 1 if ids.size else 1
    return next((n for n in KNOWN_EXPERT_COUNTS if n >= seen), seen)


def n_slots_for(cache_frac: float, n_layers: int, n_experts: int) -> int:
    return max(1, round(cache_frac * n_layers * n_experts))


def future_uses(ids: np.ndarray) -> np.ndarray:
    """[uses, 2] (layer, expert) in the order replay asks the router for them (Belady's future)."""
    t, n_layers, k = ids.shape
    srt = np.sort(ids, axis=2)
    if (srt[:, :, 1:] == srt[:, :, :-1]).any():
        raise TraceError("a token lists the same expert twice in one layer; top-k ids must differ")
    out = np.empty((t, n_layers, k, 2), dtype=np.int32)
    out[..., 0] = np.arange(n_layers)[None, :, None]
    out[..., 1] = ids
    return out.reshape(-1, 2)


def per_layer_bytes(record_bytes, n_layers: int) -> np.ndarray:
    """Bytes of one expert read per MoE layer, from one size or a size per layer."""
    per_layer = np.asarray(record_bytes, dtype=np.int64)
    if per_layer.ndim and len(per_layer) != n_layers:
        raise TraceError(f"{len(per_layer)} record sizes (one per MoE layer) for a trace of {n_layers} layers")
    return np.broadcast_to(per_layer, (n_layers,))


def replay(trace_or_ids, n_slots: int, policy: str | Policy = "lru",
           record_bytes=DSV2_LITE_RECORD_BYTES, per_step: bool = False,
           prefetch: bool | dict = False, n_experts: int | None = None,
           policy_options: dict | None = None, predictor_options: dict | None = None,
           n_staging: int | None = None, history: str | None = None, progress=None) -> dict:
    """Replays the trace through a `Router`; returns the hit rate and read volume.

    `record_bytes`: the bytes of one expert read, or a sequence of them per MoE layer of the
    trace (a store whose layers' records differ in size).

    `policy`: a registered name (an offline one such as "belady" is given the trace's future
    here; "predictive" the router's routing predictor) or a Policy instance. `prefetch`: True or a
    dict of `Prefetcher` options (threshold, depth, min_precision, ...). `policy_options` go to the
    policy (predictive: rank), `predictor_options` to the routing predictor. `n_staging`: the
    router's staging slots (None: one per resident slot). `history`: a routing trace the
    router's predictor learns first (as cache.routing_history does at start; its last 4,096
    tokens), where there is a predictor. per_step: also return
    "reads_per_step", the demand reads (misses) of every (token, layer) as an int array
    [tokens, layers] (what the forecast prices)."""
    ids = trace_or_ids.ids if isinstance(trace_or_ids, Trace) else np.asarray(trace_or_ids)
    if ids.ndim != 3:
        raise TraceError(f"ids must be [tokens, moe_layers, top_k], got shape {ids.shape}")
    n_layers = ids.shape[1]
    if isinstance(policy, str):
        cls = POLICIES.get(policy)
        if cls is not None and not cls.online:
            policy = make_policy(policy, future=future_uses(ids))
    if prefetch and not isinstance(policy, str) and not policy.online:
        raise TraceError(f"prefetch is replayed with online policies only, not {policy.name}")
    router = Router(n_slots, policy, n_staging=n_staging, moe_layers=range(n_layers),
                    n_experts=n_experts or infer_experts(ids), prefetch=prefetch,
                    policy_options=policy_options, predictor_options=predictor_options)
    if history and router.predictor is not None:
        router.learn_history(history, 4096)

    per_layer = per_layer_bytes(record_bytes, n_layers)
    read_bytes = [0]

    def instant_read(r: M.Read) -> M.Loaded:
        nbytes = int(per_layer[r.layer])
        read_bytes[0] += nbytes
        return M.Loaded(slot=r.slot, generation=r.generation, layer=r.layer, expert=r.expert,
                        read_us=0, nbytes=nbytes)

    counters = router.counters
    t0 = time.perf_counter()
    req = 0
    steps = np.zeros(ids.shape[:2], dtype=np.int32) if per_step else None
    for t, token in enumerate(ids):
        row = token.tolist()  # per token: python ints for the router, without a list of the whole trace
        for layer in range(n_layers):
            before = counters.get("reads") - counters.get("prefetch_reads")
            drive_need(router, req, layer, row[layer], instant_read, lambda fill: None)  # no compute
            req += 1
            if steps is not None:
                steps[t, layer] = counters.get("reads") - counters.get("prefetch_reads") - before
        router.end_pass()  # end of the token's forward pass
        if progress is not None and (t + 1) % PROGRESS_EVERY == 0:
            progress(router.policy_name, t + 1, ids.shape[0])
    if progress is not None:
        progress(router.policy_name, ids.shape[0], ids.shape[0])
    stats = router.stats()
    uses, hits, reads, tokens = stats.get("uses", 0), stats.get("hits", 0), stats.get("reads", 0), ids.shape[0]
    out = {"policy": router.policy_name, "n_slots": n_slots, "tokens": tokens, "uses": uses, "hits": hits,
           "reads": reads, "hit_rate": hits / uses if uses else None,
           "reads_per_token": reads / tokens if tokens else None,
           "bytes_read_per_token": read_bytes[0] / tokens if tokens else None,
           "evictions": stats.get("evictions", 0), "seconds": time.perf_counter() - t0,
           **({"reads_per_step": steps} if per_step else {})}
    if router.prefetcher is not None:
        f = router.prefetcher
        out.update({"prefetch": {k: getattr(f, k) for k in ("threshold", "depth", "min_precision")},
                    "demand_reads": reads - stats["prefetch_reads"],
                    **{k: stats[k] for k in ("prefetch_reads", "prefetch_used", "prefetch_hits",
                                             "prefetch_wasted", "prefetch_precision", "prefetch_gate")},
                    # recall as one run counts it (the router's figure); replay_report replaces
                    # prefetch_recall by the comparison with a replay without prefetch
                    "prefetch_coverage": stats["prefetch_recall"]})
    return out


def add_recall(with_prefetch: dict, without: dict) -> None:
    """prefetch_recall (DESIGN-NOTES): misses avoided by prefetch / misses without it, from a
    replay of the same policy without prefetch on the same trace and cache."""
    before = without["uses"] - without["hits"]
    after = with_prefetch["uses"] - with_prefetch["hits"]
    with_prefetch["prefetch_recall"] = (before - after) / before if before else None


def replay_report(trace: Trace, cache_frac: float, policy: str = "lru",
                  record_bytes=DSV2_LITE_RECORD_BYTES, n_experts: int | None = None,
                  prefetch: bool | dict = False, policy_options: dict | None = None,
                  history: str | None = None, progress=None) -> dict:
    """`policy` on the trace at a cache of `cache_frac` of all experts, with LRU and Belady on the
    same trace and cache size as references (keys "policy", "lru", "belady"). With `prefetch`,
    "policy" is replayed with it and "no_prefetch" without (for prefetch_recall)."""
    n_experts = n_experts or infer_experts(trace.ids)
    if trace.ids.size and int(trace.ids.max()) >= n_experts:
        raise TraceError(f"the trace uses expert id {int(trace.ids.max())} but n_experts is {n_experts}")
    n_slots = n_slots_for(cache_frac, trace.n_layers, n_experts)

    def run(name, pf=False):
        return replay(trace, n_slots, name, record_bytes, prefetch=pf, n_experts=n_experts,
                      policy_options=policy_options if name == policy else None, history=history,
                      progress=progress)
    runs = {"policy": run(policy, prefetch)}
    if prefetch:
        runs["no_prefetch"] = run(policy)
        add_recall(runs["policy"], runs["no_prefetch"])
    plain = runs.get("no_prefetch", runs["policy"])
    for ref in ("lru", "belady"):
        runs[ref] = plain if ref == policy else run(ref)
    for r in runs.values():
        r["bytes_vs_lru"] = r["reads"] / runs["lru"]["reads"] if runs["lru"]["reads"] else None
    return {"tokens": trace.tokens, "requests": len(trace.lengths), "n_layers": trace.n_layers,
            "n_experts": n_experts, "top_k": trace.top_k, "cache_frac": cache_frac, "n_slots": n_slots,
            "record_bytes": record_bytes, **runs}


def sibling_splits(path: Path) -> dict[str, Path]:
    """PREFIX-train/dev/test.npz next to PREFIX-SPLIT.npz (the layout of shared/traces)."""
    prefix = path.stem.rsplit("-", 1)[0]
    found = {s: path.with_name(f"{prefix}-{s}{path.suffix}") for s in ("train", "dev", "test")}
    return {s: p for s, p in found.items() if p.exists()} or {path.stem: path}


def format_table(reports: dict[str, dict]) -> str:
    rows = [f"{'trace':<12} {'policy':<22} {'slots':>6} {'hit rate':>9} {'reads/token':>12} "
            f"{'MiB read/token':>15} {'vs LRU':>7} {'pf precision':>13} {'pf recall':>10}"]
    for label, rep in reports.items():
        shown = []
        for key in ("policy", "no_prefetch", "lru", "belady"):
            r = rep.get(key)
            if r is None or any(r is x for x in shown):
                continue  # the policy asked for is a reference too: one row
            shown.append(r)
            name = r["policy"] + (" + prefetch" if "prefetch_reads" in r else "")
            name += "" if key in ("policy", "no_prefetch") else " (ref)"
            pf, rc = r.get("prefetch_precision"), r.get("prefetch_recall")
            rows.append(f"{label:<12} {name:<22} {r['n_slots']:>6} {r['hit_rate']:>9.3f} "
                        f"{r['reads_per_token']:>12.2f} {r['bytes_read_per_token'] / 2**20:>15.1f} "
                        f"{r['bytes_vs_lru']:>6.2f}x {'' if pf is None else f'{pf:.3f}':>13} "
                        f"{'' if rc is None else f'{rc:.3f}':>10}")
    return "\n".join(rows)


class Progress:
    """Prints a replay's progress to stderr at most every PROGRESS_S seconds."""

    def __init__(self):
        self.last = time.monotonic()

    def __call__(self, policy: str, done: int, total: int) -> None:
        now = time.monotonic()
        if now - self.last >= PROGRESS_S or done == total:
            self.last = now
            print(f"deltafin-replay: {policy}: {done:,} of {total:,} tokens", file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(formatter_class=Help, prog="deltafin-replay", description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", type=Path, help="routing trace .npz (docs/TRACES.md)")
    ap.add_argument("--cache-frac", type=float, required=True,
                    help="cache size as a share of all experts (n_layers x n_experts), e.g. 0.25")
    ap.add_argument("--policy", default=load_config().cache.policy, choices=policy_names(),
                    help="replacement policy (default: the runtime's, cache.policy); lru and belady "
                         "are always reported too")
    ap.add_argument("--rank", choices=Predictive.RANKS, default="probability",
                    help="eviction order of the predictive policy (default probability; recency "
                         "measured better at 10%% of the experts)")
    ap.add_argument("--prefetch", action="store_true",
                    help="the router reads what its routing predictor expects in the next layers "
                         "(self-gated); the policy is also replayed without it, for the recall")
    ap.add_argument("--prefetch-threshold", type=float, default=PREFETCH_DEFAULTS["threshold"],
                    help="read a key ahead when its predicted probability of use is at least this "
                         f"(default {PREFETCH_DEFAULTS['threshold']})")
    ap.add_argument("--prefetch-depth", type=int, default=PREFETCH_DEFAULTS["depth"],
                    help=f"layers ahead to prefetch (default {PREFETCH_DEFAULTS['depth']})")
    ap.add_argument("--prefetch-min-precision", type=float, default=PREFETCH_DEFAULTS["min_precision"],
                    help="a layer distance whose measured prefetch precision falls under this only "
                         f"probes (default {PREFETCH_DEFAULTS['min_precision']})")
    ap.add_argument("--history", type=Path, default=None,
                    help="a routing trace the predictor learns before the replay (its last 4,096 "
                         "tokens; cache.routing_history in the runtime), e.g. the -train split")
    ap.add_argument("--tokens", type=int, default=None,
                    help="replay only the trace's first N tokens (e.g. the window a deltafin-bench "
                         "run processes: prompt + max_tokens - 1)")
    ap.add_argument("--experts", type=int, default=None,
                    help="experts per layer (default: max id + 1, rounded up to a known model's count)")
    ap.add_argument("--record-bytes", type=int, default=DSV2_LITE_RECORD_BYTES,
                    help=f"bytes per expert read (default {DSV2_LITE_RECORD_BYTES}: DeepSeek-V2-Lite, 4-bit, group 64)")
    ap.add_argument("--store", type=Path, default=None,
                    help="take the bytes per expert read from this store's records, per MoE layer "
                         "(instead of --record-bytes)")
    ap.add_argument("--json", type=Path, default=None, help="also write the report here")
    ap.add_argument("--splits", action="store_true",
                    help="replay every split next to TRACE (PREFIX-train/dev/test.npz), one row each")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if not 0 < args.cache_frac <= 1:
        print("deltafin-replay: --cache-frac must be within (0, 1]", file=sys.stderr)
        return 2
    if args.prefetch and not POLICIES[args.policy].online:
        print(f"deltafin-replay: --prefetch needs an online policy, not {args.policy}", file=sys.stderr)
        return 2
    prefetch = {"threshold": args.prefetch_threshold, "depth": args.prefetch_depth,
                "min_precision": args.prefetch_min_precision} if args.prefetch else False
    paths = sibling_splits(args.trace) if args.splits else {args.trace.stem: args.trace}
    reports = {}
    try:
        record_bytes = layer_read_bytes(Store(args.store)) if args.store else args.record_bytes
        for label, path in paths.items():
            trace = load_trace(path)
            if args.tokens:
                trace = trace.head(args.tokens)
            reports[label] = {"trace": str(path), **replay_report(
                trace, args.cache_frac, args.policy, record_bytes, args.experts, prefetch,
                {"rank": args.rank} if args.policy == "predictive" else None,
                str(args.history) if args.history else None, Progress())}
    except (TraceError, RouterError, StoreError) as e:
        print(f"deltafin-replay: {e}", file=sys.stderr)
        return 2
    first = next(iter(reports.values()))
    per_read = np.mean(first["record_bytes"])
    print(f"{first['n_layers']} MoE layers x {first['n_experts']} experts, top-{first['top_k']}; cache "
          f"{args.cache_frac:g} = {first['n_slots']} slots; {per_read:.0f} bytes per expert read")
    print(format_table({label[:12]: r for label, r in reports.items()}))
    if args.json:
        out = reports if args.splits else first
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
