"""deltafin-forecast: decode tok/s of a model at a memory budget on this machine, before the download.

The runtime handles each MoE layer in turn: when every chosen expert is resident, compute runs it
with no message and no copy; when m of them are not, compute asks the router, the loader's threads
read them in parallel into staging slots, and compute fills its resident tier from them. So per
decode token

    t = compute + rest + sum over layers with m > 0 of [messages + reads(m) + fill(m)]

where m, a layer's misses at that token, comes from replaying a routing trace through the
router's own policy classes at the slot count. With a store, `--calibrate run` (the default there)
measures the constants in situ: two short runs of the real runtime on the store (compute stand-in,
a stretch of the trace the forecast is not asked about, 5% and 30% of the experts) give the fill
time per missing layer and per miss, the message time per missing layer, the per-token remainder,
and the wait per missing layer and per round of ceil(m / threads) reads, as the runtime's own processes see them on this machine (CRC checks,
copies competing with reads, scheduling). `--calibrate micro` (what a preset without a store gets,
with --disk-gbps etc.) prices reads from a direct-read probe at the record size and queue depths
1..threads, messages from a socket round trip between two processes, fills from the prepare code
alone. Compute is given (stand-in waits or ms per token) or measured with every expert resident.
docs/BENCHMARKS.md compares forecasts with deltafin-bench.

`--preset P --memory-budget B` (or one `--cache-frac F`) and no measurement given: a range of
tok/s from the routing statistics shipped with the package and probes of this machine, every
assumption printed (tools/forecast_preset.py).

`--hosts N --link-gbps G` (experts sharded over N hosts, workers/distributed.py; docs/DISTRIBUTED.md):
each host has the same slots (the per-host budget) and owns experts e % N of every layer, so rank
r's misses come from replaying only its share of the trace through the policy at the host's slot
count. A layer ends when the slowest rank has its experts, then every rank exchanges the layer's
partial [rows, top_k, hidden] outputs (one all_sum); so per decode token

    t = compute + sum over layers of [max over ranks of (messages + reads + fills of its misses)
                                      + exchange(top_k x hidden x act_bytes)] + exchange(8 bytes)

with a ring all_sum of B bytes over N ranks costing 2(N-1) steps of the link latency plus
2(N-1)/N x B over the link bandwidth (reduce-scatter then all-gather). Compute is not divided by
N: the dense layers are replicated and the expert math of one token is small next to them at
decode (an assumption, reported; it makes the forecast conservative).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from deltafin.runtime.cli import Help
from deltafin.runtime.config import format_size, load_config
from deltafin.tools.forecast_calib import calibrate_runs, measure_disk, measure_hop, measure_prepare


def log(msg: str) -> None:
    print(f"deltafin-forecast: {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------ shapes

class Shape:
    """What the forecast needs of a model: layers, experts, top-k, record bytes. layer_bytes: the
    bytes one read of an expert of each MoE layer fetches (a store's layers may differ: mixed
    recipes quantize some layers' experts at other bits); record_bytes: their mean."""

    def __init__(self, name, n_moe, n_dense, n_experts, top_k, record_bytes, store=None, layer_bytes=None,
                 assumptions=()):
        self.name, self.n_moe, self.n_dense = name, n_moe, n_dense
        self.n_experts, self.top_k, self.store = n_experts, top_k, store
        self.layer_bytes = np.full(n_moe, record_bytes, dtype=np.float64) if layer_bytes is None \
            else np.asarray(layer_bytes, dtype=np.float64)
        self.record_bytes = int(round(self.layer_bytes.mean())) if n_moe else record_bytes
        self.assumptions = list(assumptions)  # what a preset's shape assumes (synth_configs.PRESET_ASSUMPTIONS)

    @classmethod
    def of_store(cls, store):
        n_layers = int(store.config["num_hidden_layers"])
        layer_bytes = [store.record(layer, 0).read_nbytes for layer in store.moe_layers]
        return cls(store.path.name, len(store.moe_layers), n_layers - len(store.moe_layers), store.n_experts,
                   store.top_k, max(layer_bytes), store, layer_bytes)

    @classmethod
    def of_preset(cls, preset: str, layers: int | None = None, bits: int = 4, group_size: int = 64):
        from deltafin.runtime import archinfo
        from deltafin.tools.replay import expert_record_bytes
        from deltafin.tools.synth_configs import PRESET_ASSUMPTIONS, PRESETS
        if preset not in PRESETS:
            raise SystemExit(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
        c = PRESETS[preset]
        n_layers = layers or int(c["num_hidden_layers"])
        n_dense = min(n_layers, int(c.get("first_k_dense_replace") or 0))
        width = int(c.get("routed_expert_hidden_size") or c["hidden_size"])  # Kimi K3's experts: the latent width
        rec = expert_record_bytes(width, int(c["moe_intermediate_size"]), bits, group_size)
        return cls(preset, n_layers - n_dense, n_dense, archinfo.n_experts(c), archinfo.top_k(c), rec,
                   assumptions=PRESET_ASSUMPTIONS.get(preset, ()))

    def slots_at(self, frac: float) -> int:
        """Expert slots for a cache of `frac` of all experts (at least one token's top-k)."""
        return max(self.top_k, round(frac * self.n_moe * self.n_experts))

    def to_dict(self) -> dict:
        return {"name": self.name, "moe_layers": self.n_moe, "dense_layers": self.n_dense,
                "experts_per_layer": self.n_experts, "top_k": self.top_k, "record_bytes": self.record_bytes,
                "expert_bytes_total": int(self.layer_bytes.sum()) * self.n_experts,
                "assumptions": self.assumptions}


# ------------------------------------------------------------------------------------ the model

def forecast_in_situ(shape: Shape, steps: np.ndarray, compute_s: float, cal: dict, threads: int) -> dict:
    """Decode time per token from misses per step and the constants of `calibrate_run`: a layer
    with m > 0 misses costs a message exchange, ceil(m / threads) rounds of reads and m fills of
    the resident tier; a layer whose experts are all resident costs nothing beyond compute."""
    m = steps.astype(np.float64)
    missing = (m > 0).sum(axis=1)
    read = np.ceil(m / threads).sum(axis=1) * cal["wait_s_per_round"] + missing * cal.get("wait_s_per_missing_layer", 0.0)
    prepare = m.sum(axis=1) * cal["prepare_s_per_miss"] + missing * cal.get("prepare_s_per_missing_layer", 0.0)
    messages = missing * cal["hop_s_per_missing_layer"]
    per_token = compute_s + cal["rest_s_per_token"] + messages + prepare + read
    t = float(per_token.mean())
    return {"s_per_token": t, "tok_s": 1.0 / t, "compute_s": compute_s, "rest_s": cal["rest_s_per_token"],
            "read_s": float(read.mean()), "prepare_s": float(prepare.mean()), "messages_s": float(messages.mean()),
            "misses_per_token": float(m.sum(axis=1).mean()),
            "hit_rate": 1.0 - float(m.sum() / (m.shape[0] * m.shape[1] * shape.top_k)),
            "bytes_read_per_token": float((m * shape.layer_bytes).sum(axis=1).mean())}


def routing_steps(shape: Shape, trace_ids: np.ndarray, n_slots: int, policy: str, tokens: slice | None) -> np.ndarray:
    """Misses per (token, MoE layer) from a replay of the trace at this slot count. A trace of
    another shape (e.g. the DeepSeek-V2-Lite trace for Kimi-K2) is replayed at the same cache
    fraction and its misses scaled by top-k and tiled over the layers: an assumption, reported."""
    from deltafin.tools.replay import infer_experts, replay
    same = trace_ids.shape[1] >= shape.n_moe and trace_ids.shape[2] == shape.top_k and \
        int(trace_ids.max()) < shape.n_experts
    if same:
        ids = trace_ids[:, :shape.n_moe, :]
        steps = replay(ids, n_slots, policy, record_bytes=shape.layer_bytes, per_step=True)["reads_per_step"]
    else:
        frac = n_slots / (shape.n_moe * shape.n_experts)
        t_layers, t_k = trace_ids.shape[1], trace_ids.shape[2]
        t_slots = max(t_k, round(frac * t_layers * infer_experts(trace_ids)))
        raw = replay(trace_ids, t_slots, policy, per_step=True)["reads_per_step"] * (shape.top_k / t_k)
        steps = np.tile(raw, (1, -(-shape.n_moe // t_layers)))[:, :shape.n_moe]
    return steps if tokens is None else steps[tokens]


def replay_share(ids: np.ndarray, n_slots: int, policy: str, rank: int, hosts: int, n_experts: int) -> np.ndarray:
    """Misses per (token, layer) of rank `rank`'s router, which only ever sees experts e % hosts ==
    rank: the trace's other experts are computed elsewhere."""
    from deltafin.protocol import messages as M
    from deltafin.workers.router import Router
    from deltafin.workers.sources import drive_need
    router = Router(n_slots, policy, moe_layers=range(ids.shape[1]), n_experts=n_experts)

    def instant_read(r):
        return M.Loaded(slot=r.slot, generation=r.generation, layer=r.layer, expert=r.expert, read_us=0, nbytes=1)
    steps = np.zeros(ids.shape[:2], dtype=np.float64)
    req = 0
    for t, token in enumerate(ids):
        for layer, row in enumerate(token.tolist()):
            own = [e for e in row if e % hosts == rank]
            if not own:
                continue
            before = router.counters.get("reads")
            drive_need(router, req, layer, own, instant_read, lambda fill: None)
            req += 1
            steps[t, layer] = router.counters.get("reads") - before
        router.end_pass()
    return steps


def share_steps(shape: Shape, trace_ids: np.ndarray, n_slots: int, policy: str, hosts: int) -> np.ndarray:
    """Misses per rank [hosts, tokens, layers] at n_slots per host. A trace of another shape is
    replayed at the same per-host cache fraction, its misses scaled by top-k and tiled over the
    layers (as routing_steps does)."""
    from deltafin.tools.replay import infer_experts
    same = trace_ids.shape[1] >= shape.n_moe and trace_ids.shape[2] == shape.top_k and \
        int(trace_ids.max()) < shape.n_experts
    if same:
        ids = trace_ids[:, :shape.n_moe, :]
        return np.stack([replay_share(ids, n_slots, policy, r, hosts, shape.n_experts) for r in range(hosts)])
    frac = n_slots / (shape.n_moe * shape.n_experts)
    t_layers, t_k, t_experts = trace_ids.shape[1], trace_ids.shape[2], infer_experts(trace_ids)
    t_slots = max(t_k, round(frac * t_layers * t_experts))
    out = []
    for r in range(hosts):
        raw = replay_share(trace_ids, t_slots, policy, r, hosts, t_experts) * (shape.top_k / t_k)
        out.append(np.tile(raw, (1, -(-shape.n_moe // t_layers)))[:, :shape.n_moe])
    return np.stack(out)


def ring_all_sum_s(nbytes: float, hosts: int, link_gbps: float, latency_s: float) -> float:
    """One ring all_sum of nbytes over `hosts` ranks: 2(N-1) steps (reduce-scatter, all-gather),
    each a link latency, moving 2(N-1)/N x nbytes over the link. Zero on one host."""
    if hosts <= 1:
        return 0.0
    return 2 * (hosts - 1) * latency_s + 2 * (hosts - 1) / hosts * nbytes * 8 / (link_gbps * 1e9)


def forecast_hosts(shape: Shape, steps: np.ndarray, compute_s: float, hop_s: float, prepare_s: float,
                   gbps: dict, threads: int, hosts: int, link_gbps: float, latency_s: float,
                   hidden: int, act_bytes: int = 2) -> dict:
    """Decode time per token on `hosts` hosts from each rank's misses steps[rank, tokens, layers]
    (the module doc's formula); each rank's layer cost is priced as `forecast` prices one host's.
    A rank's hit rate takes its uses as top_k / hosts per layer (an even share)."""
    m = steps.astype(np.float64)
    q = np.minimum(np.maximum(np.ceil(m), 1), threads).astype(int)
    bw = np.vectorize(lambda d: gbps[min(d, max(gbps))])(q) * 1e9
    cost = np.where(m > 0, m * shape.layer_bytes / bw + 2 * hop_s, 0.0) + m * prepare_s  # [rank, t, layer]
    slowest = cost.max(axis=0)  # the layer's all_sum waits for the last rank
    exchange_bytes = shape.top_k * hidden * act_bytes  # one decode row's partial outputs
    exchange = shape.n_moe * ring_all_sum_s(exchange_bytes, hosts, link_gbps, latency_s) + \
        ring_all_sum_s(8, hosts, link_gbps, latency_s)  # + the between-tokens exchange (stop, routing digest)
    per_token = compute_s + slowest.sum(axis=1) + exchange
    t = float(per_token.mean())
    per_rank_misses = m.sum(axis=2).mean(axis=1)
    return {"hosts": hosts, "s_per_token": t, "tok_s": 1.0 / t, "compute_s": compute_s,
            "experts_s": float(slowest.sum(axis=1).mean()), "exchange_s": exchange,
            "exchanges_per_token": shape.n_moe + 1 if hosts > 1 else 0,
            "exchange_bytes": exchange_bytes if hosts > 1 else 0,
            "misses_per_token_per_rank": per_rank_misses.tolist(),
            "hit_rate_per_rank": [1.0 - float(m[r].sum()) / max(1.0, m.shape[1] * m.shape[2] * shape.top_k / hosts)
                                  for r in range(hosts)],
            "bytes_read_per_token_per_rank": (m * shape.layer_bytes).sum(axis=2).mean(axis=1).tolist()}


def forecast(shape: Shape, steps: np.ndarray, compute_s: float, hop_s: float, prepare_s: float,
             gbps: dict, threads: int) -> dict:
    """Decode time per token from misses per step [tokens, layers] and the micro calibrations: a
    layer with m > 0 misses costs two message round trips (compute <-> router, router <-> loader),
    its reads at the bandwidth of min(m, threads) reads in flight, and m fills."""
    m = steps.astype(np.float64)
    q = np.minimum(np.maximum(np.ceil(m), 1), threads).astype(int)
    bw = np.vectorize(lambda d: gbps[min(d, max(gbps))])(q) * 1e9
    read = np.where(m > 0, m * shape.layer_bytes / bw, 0.0)
    messages = np.where(m > 0, 2 * hop_s, 0.0)
    fills = m * prepare_s
    per_token = compute_s + (read + messages + fills).sum(axis=1)
    t = float(per_token.mean())
    return {"s_per_token": t, "tok_s": 1.0 / t, "compute_s": compute_s, "rest_s": 0.0,
            "read_s": float(read.sum(axis=1).mean()), "prepare_s": float(fills.sum(axis=1).mean()),
            "messages_s": float(messages.sum(axis=1).mean()),
            "misses_per_token": float(m.sum(axis=1).mean()),
            "hit_rate": 1.0 - float(m.sum() / (m.shape[0] * m.shape[1] * shape.top_k)),
            "bytes_read_per_token": float((m * shape.layer_bytes).sum(axis=1).mean())}


# ------------------------------------------------------------------------------------ main

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(formatter_class=Help, prog="deltafin-forecast", description=__doc__.splitlines()[0])
    p.add_argument("--store", help="an expert store (its shapes; calibrations measured on its records)")
    p.add_argument("--preset", help="a preset shape instead of a store: kimi-k2, kimi-k3, dsv2-lite, qwen3-30b-a3b")
    p.add_argument("--layers", type=int, help="layers of the preset (default: the preset's own)")
    p.add_argument("--cache-frac", type=float, action="append",
                   help="expert slots as a share of all experts (repeatable: 0.1 --cache-frac 0.25 ...)")
    p.add_argument("--memory-budget", help="a whole-tree budget instead: slots as the runtime sizes them (a store's "
                   "plan, or a preset's estimated one)")
    p.add_argument("--trace", help="routing trace (default: ../shared/traces/dsv2lite-test.npz when present)")
    p.add_argument("--policy", default=None, help="cache policy (default: the config's)")
    p.add_argument("--compute-ms-per-token", type=float, help="compute time per token (real compute, given)")
    p.add_argument("--standin-moe-ms", type=float, help="compute as the stand-in: ms per MoE layer")
    p.add_argument("--standin-dense-ms", type=float, help="compute as the stand-in: ms per dense layer")
    p.add_argument("--measure-compute", action="store_true", help="measure compute with every expert resident "
                   "(loads the whole store into memory)")
    p.add_argument("--disk-gbps", type=float, help="direct-read bandwidth to assume instead of probing")
    p.add_argument("--memory-gbps", type=float, help="a preset's forecast: memory bandwidth to assume instead of "
                   "measuring it here (with --disk-gbps: a machine you do not have)")
    p.add_argument("--hop-ms", type=float, help="message round trip to assume instead of measuring")
    p.add_argument("--prepare-ms", type=float, help="prepare time per expert to assume instead of measuring")
    p.add_argument("--calibrate", choices=("run", "micro"), help="with a store: 'run' (default) measures the "
                   "constants in a short run of the runtime; 'micro' from a disk probe, a socket round trip "
                   "and the prepare code alone (what a preset without a store gets, with --disk-gbps etc.)")
    p.add_argument("--check", help="a deltafin-bench report.json: forecast its stand-in runs and compare")
    p.add_argument("--hosts", type=int, help="experts sharded over this many hosts (same budget each; "
                   "docs/DISTRIBUTED.md); forces --calibrate micro")
    p.add_argument("--link-gbps", type=float, default=40.0, help="with --hosts: link bandwidth between "
                   "hosts, Gb/s (default 40)")
    p.add_argument("--link-latency-us", type=float, default=50.0, help="with --hosts: one ring step's "
                   "latency, microseconds (default 50)")
    p.add_argument("--json", help="write the forecast here")
    return p


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    cfg = load_config()
    threads = cfg.loader.threads
    policy = a.policy or cfg.cache.policy
    if one_flag(a):
        from deltafin.tools.forecast_preset import forecast_preset
        from deltafin.tools.synth import PRESETS
        shape = Shape.of_preset(a.preset, a.layers)
        config = dict(PRESETS[a.preset], num_hidden_layers=shape.n_moe + shape.n_dense)
        out = forecast_preset(a, cfg, shape, config, policy, threads)
        if a.json:
            Path(a.json).write_text(json.dumps(out, indent=1, default=str))
        return 0
    report = json.loads(Path(a.check).read_text()) if a.check else None
    inputs = _inputs(a, report)
    if inputs is None:
        return 2
    store, shape, trace_path, trace_ids = inputs
    calibrated = _calibrate(a, store, shape, trace_ids, threads, policy)
    if calibrated is None:
        return 2
    calib, price = calibrated
    if report:
        out = _check(a, report, shape, trace_ids, policy, calib, price)
    else:
        out = _forecast_cases(a, cfg, store, shape, trace_ids, trace_path, policy, threads, calib, price)
        if out is None:
            return 2
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1, default=str))
    return 0


def one_flag(a) -> bool:
    """A preset with a budget or one cache fraction and no measurement given (but the disk's and
    memory's bandwidth, for another machine): the forecast that answers from the shipped routing
    statistics and probes of this machine (tools/forecast_preset.py)."""
    given = (a.store, a.check, a.trace, a.hosts, a.prepare_ms, a.hop_ms, a.calibrate,
             a.standin_moe_ms, a.standin_dense_ms, a.compute_ms_per_token)
    return bool(a.preset) and all(g is None for g in given) and not a.measure_compute and \
        (a.memory_budget is not None or len(a.cache_frac or []) == 1)


def _inputs(a, report: dict | None) -> tuple | None:
    """(store or None, its shape or the preset's, trace path, trace rows); None (after saying
    why) when the store or the trace is missing."""
    from deltafin.runtime.store import Store
    from deltafin.runtime.traces import load_trace
    from deltafin.tools.bench import find_default_trace
    store_path = a.store or (report["setup"]["store"] if report else None)
    if not store_path and not a.preset:
        log("give --store, --preset or --check")
        return None
    store = Store(store_path) if store_path else None
    shape = Shape.of_store(store) if store else Shape.of_preset(a.preset, a.layers)
    for note in shape.assumptions:
        log(f"{shape.name} assumes: {note}")
    trace_path = Path(a.trace) if a.trace else find_default_trace()
    if trace_path is None:
        log("no routing trace found: give --trace")
        return None
    return store, shape, trace_path, load_trace(trace_path).ids


def _calibrate(a, store, shape: Shape, trace_ids: np.ndarray, threads: int, policy: str) -> tuple | None:
    """The calibrations, measured here unless given, and the pricing of routing steps they make:
    (calibration, price(steps, compute_s)); None (after saying why) when one cannot be had."""
    mode = a.calibrate or ("run" if store is not None and not a.hosts else "micro")
    if a.hosts and mode != "micro":
        log("--hosts prices each rank with the micro calibration: use --calibrate micro")
        return None
    calib = {"mode": mode}
    if mode == "run":
        if store is None:
            log("--calibrate run needs a store")
            return None
        log("calibrating: two short runs of the runtime on the store (stand-in compute, 5% and 30%)")
        cal = calib["run"] = calibrate_runs(store, trace_ids, threads, policy)

        def price(steps, compute_s):
            return forecast_in_situ(shape, steps, compute_s, cal, threads)
    else:
        if a.disk_gbps:
            gbps = {q: a.disk_gbps for q in range(1, threads + 1)}
            calib["disk"] = {"gbps_by_queue_depth": gbps, "how": "given"}
        elif store is not None:
            log("probing direct reads at queue depths 1..%d" % threads)
            calib["disk"] = measure_disk(store, threads, 1.5)
            gbps = calib["disk"]["gbps_by_queue_depth"]
        else:
            log("a preset has no store to probe: give --disk-gbps")
            return None
        hop = {"s": a.hop_ms / 1e3, "how": "given"} if a.hop_ms is not None else measure_hop(shape.top_k)
        if a.prepare_ms is not None:
            prep = {"s_per_expert": a.prepare_ms / 1e3, "how": "given"}
        elif store is not None:
            prep = measure_prepare(store)
        else:
            log("a preset has no store to measure prepare on: give --prepare-ms")
            return None
        calib.update(hop=hop, prepare=prep)

        def price(steps, compute_s):
            return forecast(shape, steps, compute_s, hop["s"], prep["s_per_expert"], gbps, threads)
    return calib, price


def _check(a, report: dict, shape: Shape, trace_ids: np.ndarray, policy: str, calib: dict, price) -> dict:
    """--check: the forecast of each deltafin contender of a deltafin-bench report's stand-in
    regime against its measured decode rate."""
    cases = []
    for regime, rr in report["regimes"].items():
        if regime != "standin":
            continue
        st = rr["standin"]
        compute_s = (shape.n_moe * st["moe_ms"] + shape.n_dense * st["dense_ms"]) / 1e3
        s = report["setup"]
        n_prompt, n_tokens = s["prompt_tokens"], s["prompt_tokens"] + rr["max_tokens"] - 1
        rows = np.take(trace_ids, np.arange(n_tokens) % len(trace_ids), axis=0)
        for name, c in rr["contenders"].items():
            if not name.startswith("deltafin") or not c.get("ok"):
                continue
            pol = next((x for x in ("lfuda", "lru") if x in name), policy)
            steps = routing_steps(shape, rows, s["n_slots"], pol, slice(n_prompt, n_tokens))
            f = price(steps, compute_s)
            cases.append({"contender": name, "cache_frac": s["cache_frac"], "policy": pol,
                          "forecast_tok_s": f["tok_s"], "measured_tok_s": c["decode_tok_s"],
                          "ratio": f["tok_s"] / c["decode_tok_s"], "forecast": f})
    out = {"check": a.check, "shape": shape.to_dict(), "calibration": calib, "cases": cases}
    for c in cases:
        print(f"{c['contender']:<20} cache {c['cache_frac']:.0%}: forecast {c['forecast_tok_s']:.2f} tok/s, "
              f"measured {c['measured_tok_s']:.2f} tok/s, ratio {c['ratio']:.2f}")
    return out


def _compute_s(a, cfg, store, shape: Shape) -> tuple[float, str]:
    """Compute seconds per token and how they were had: given, measured with every expert
    resident, or the stand-in's waits."""
    if a.compute_ms_per_token is not None:
        return a.compute_ms_per_token / 1e3, "given"
    if a.measure_compute and store is not None:
        from deltafin.tools.bench import Setup
        from deltafin.tools.bench_bound import resident_compute_s_per_token
        log("measuring compute with every expert resident")
        s = Setup(store=store, trace_path=None, trace_ids=None, n_slots=0, budget=0, prompt_ids=[1, 2, 3, 4],
                  max_tokens=0, max_context=64, dtype="float32", standin_moe_ms=0, standin_dense_ms=0,
                  timeout_s=0, out=Path("."))
        return resident_compute_s_per_token(s, 3)["s_per_token"], "measured, every expert resident"
    moe = a.standin_moe_ms if a.standin_moe_ms is not None else cfg.bench.standin_moe_ms
    dense = a.standin_dense_ms if a.standin_dense_ms is not None else cfg.bench.standin_dense_ms
    compute_s = (shape.n_moe * moe + shape.n_dense * dense) / 1e3
    return compute_s, f"stand-in: {moe} ms per MoE layer, {dense} ms per dense layer"


def _forecast_cases(a, cfg, store, shape: Shape, trace_ids: np.ndarray, trace_path: Path, policy: str,
                    threads: int, calib: dict, price) -> dict | None:
    """The forecast at each cache share (or on 1..N hosts); None (after saying why) when
    --memory-budget has no store."""
    compute_s, how = _compute_s(a, cfg, store, shape)
    calib["compute"] = {"s_per_token": compute_s, "how": how}
    fracs = a.cache_frac or [0.25]
    if a.memory_budget:
        if store is None:
            log("--memory-budget needs --store")
            return None
        from deltafin.tools.bench import plan_budget_for_slots
        from deltafin.runtime.config import parse_size
        budget = parse_size(a.memory_budget)
        base = plan_budget_for_slots(store, 0, cfg.compute.max_context, "float32")
        n = max(0, int((budget / 1.05 - base / 1.05) // shape.record_bytes))
        fracs = [n / (shape.n_moe * shape.n_experts)]
    if a.hosts:
        return _main_hosts(a, shape, store, trace_ids, trace_path, fracs, policy, compute_s, calib,
                           calib["hop"]["s"], calib["prepare"]["s_per_expert"],
                           calib["disk"]["gbps_by_queue_depth"], threads)
    cases = []
    for frac in fracs:
        n_slots = shape.slots_at(frac)
        steps = routing_steps(shape, trace_ids, n_slots, policy, None)
        f = price(steps, compute_s)
        cases.append({"cache_frac": frac, "n_slots": n_slots, "policy": policy,
                      "cache_bytes": n_slots * shape.record_bytes, **f})
        print(f"{shape.name}: cache {frac:.0%} ({n_slots} slots, {format_size(n_slots * shape.record_bytes)}), "
              f"{policy}: {f['tok_s']:.2f} tok/s (compute {f['compute_s'] * 1e3:.1f} ms, reads "
              f"{f['read_s'] * 1e3:.1f} ms, prepare {f['prepare_s'] * 1e3:.1f} ms, messages "
              f"{f['messages_s'] * 1e3:.1f} ms per token; hit rate {f['hit_rate']:.2f})")
    return {"shape": shape.to_dict(), "trace": str(trace_path), "calibration": calib, "cases": cases}


def _hidden(shape: Shape, store) -> int:
    if store is not None:
        return int(store.config["hidden_size"])
    from deltafin.tools.synth_configs import PRESETS
    return int(PRESETS[shape.name]["hidden_size"])


def _main_hosts(a, shape, store, trace_ids, trace_path, fracs, policy, compute_s, calib, hop_s, prep_s,
                gbps, threads) -> int:
    """--hosts: the forecast on 1..N hosts side by side (1, 2, 4, ... up to N, and N); returns the report."""
    counts = sorted({h for h in (1, 2, 4, 8) if h <= a.hosts} | {a.hosts})
    hidden = _hidden(shape, store)
    calib["link"] = {"gbps": a.link_gbps, "latency_us": a.link_latency_us, "how": "given"}
    cases = []
    for frac in fracs:
        n_slots = shape.slots_at(frac)
        for hosts in counts:
            steps = share_steps(shape, trace_ids, n_slots, policy, hosts)
            f = forecast_hosts(shape, steps, compute_s, hop_s, prep_s, gbps, threads, hosts, a.link_gbps,
                               a.link_latency_us / 1e6, hidden)
            cases.append({"cache_frac_per_host": frac, "n_slots_per_host": n_slots, "policy": policy,
                          "cache_bytes_per_host": n_slots * shape.record_bytes, **f})
            print(f"{shape.name}: {hosts} host(s), cache {frac:.0%} of all experts per host ({n_slots} slots, "
                  f"{format_size(n_slots * shape.record_bytes)} each), {policy}: {f['tok_s']:.2f} tok/s "
                  f"(compute {f['compute_s'] * 1e3:.1f} ms, experts {f['experts_s'] * 1e3:.1f} ms, exchange "
                  f"{f['exchange_s'] * 1e3:.2f} ms = {f['exchanges_per_token']} x {f['exchange_bytes']} B per token; "
                  f"hit rate per rank {', '.join(f'{h:.2f}' for h in f['hit_rate_per_rank'])})")
    return {"shape": shape.to_dict(), "trace": str(trace_path), "calibration": calib, "cases": cases}


if __name__ == "__main__":
    sys.exit(main())
