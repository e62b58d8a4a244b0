"""deltafin-bench: deltafin against the alternatives, side by side in one run on one machine.

Every contender starts fresh, with the page cache dropped and its process tree capped at the same
memory budget: deltafin in its named modes, a memory-mapped baseline (the store read through the
page cache with no cache of its own), mlx-lm on the same weights, and the real peers mlx-vlm (expert
offload) and rapid-mlx (disk streaming), each on its own layout of those weights with its expert
budget at deltafin's share of the experts, routed by the model's gate. Two regimes: real compute on
this machine, and a compute stand-in (each layer's math replaced by a wait calibrated on a GPU)
where reading, preparing and orchestration decide. Each contender is reported against the bound
of ../shared/DESIGN-NOTES.md (with real compute, its compute term measured again before every
round: the median of those). Output: report.json, chart.png, a table on the terminal.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from deltafin.runtime import metrics
from deltafin.runtime.cli import Help
from deltafin.runtime.config import format_size, load_config, parse_size
from deltafin.runtime.procs import stop_process
from deltafin.runtime.store import Store
from deltafin.tools import bench_quality
from deltafin.tools.bench_modes import (CONTENDERS, EQUAL_MEMORY, LOSSY_PREFIX, PF_PREFIX, bad_contender, is_deltafin,
                                         mode_config, mode_flags)
from deltafin.tools.peer_runner import PEERS
from deltafin.tools.treesampler import TreeSampler

REGIMES = ("standin", "real")
PRESET_DEFAULT = "dsv2-lite"


def log(msg: str) -> None:
    print(f"deltafin-bench: {msg}", file=sys.stderr, flush=True)


def find_default_trace() -> Path | None:
    """../shared/traces/dsv2lite-test.npz beside the checkout or the working directory, if present."""
    here = Path(__file__).resolve()
    for base in (Path.cwd(), *Path.cwd().parents, *here.parents):
        cand = base / "shared" / "traces" / "dsv2lite-test.npz"
        if cand.exists():
            return cand
    return None


# ------------------------------------------------------------------------------------ setup

@dataclass
class Setup:
    store: Store
    trace_path: Path | None
    trace_ids: np.ndarray | None
    history_path: Path | None  # routing history deltafin's predictor learns from at start
    n_slots: int
    budget: int
    prompt_ids: list[int]
    max_tokens: int
    max_context: int
    dtype: str
    standin_moe_ms: float
    standin_dense_ms: float
    timeout_s: float
    out: Path
    disk: dict = field(default_factory=dict)
    drop_cache: bool = True
    cap: bool = True
    peers: dict = field(default_factory=dict)  # peer -> (its layout, or None and why it cannot run)
    tag: str = ""  # added to a contender's file names (the round, with --rounds)
    quality: list[list[int]] | None = None  # --quality: the held-out windows each deltafin run is asked for

    @property
    def record_bytes(self) -> int:
        return self.store.max_record_bytes

    @property
    def n_moe(self) -> int:
        return len(self.store.moe_layers)

    @property
    def n_dense(self) -> int:
        return int(self.store.config["num_hidden_layers"]) - self.n_moe


def plan_budget_for_slots(store: Store, n_slots: int, max_context: int, dtype: str) -> int:
    """The whole-tree budget at which deltafin gets `n_slots` expert slots: the runtime's own
    estimate of dense weights, reserves and processes, plus the slots, plus 5% for the estimate."""
    from deltafin.runtime.budget import plan_budget
    config = load_config(None, {"compute.max_context": max_context, "compute.dtype": dtype,
                                "runtime.memory_budget": "1TiB"})
    return int(plan_budget(store, config).budget_for(n_slots) * 1.05)


# ------------------------------------------------------------------------------------ contenders

def _signal_name(code: int | None) -> str | None:
    if code is None or code >= 0:
        return None
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def _exit_cause(code, cap, stderr_tail: str) -> str:
    if cap is not None and cap.oom_kills():
        return f"killed by the memory cap (cgroup OOM kill, exit {code})"
    sig = _signal_name(code)
    tail = stderr_tail.strip().splitlines()[-3:]
    return f"exit {sig or code}" + (f": {' | '.join(tail)}" if tail else "")


def _common_flags(s: Setup, regime: str) -> list[str]:
    flags = []
    if s.trace_path is not None:
        flags += ["--routing-trace", str(s.trace_path)]
    if s.history_path is not None:
        flags += ["--routing-history", str(s.history_path)]
    if regime == "standin":
        flags += ["--standin", "--standin-moe-ms", str(s.standin_moe_ms),
                  "--standin-dense-ms", str(s.standin_dense_ms)]
    return flags


def _await_preload(c, s: Setup) -> float | None:
    """With a slot for every expert, the runtime reads them all in after start-up (cache.preload),
    as mlx-lm loads its whole model before generating: wait for it, so decode is measured with
    every expert resident. Returns the seconds waited (None: nothing to preload)."""
    total = len(s.store.records)
    if s.n_slots < total:
        return None
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < s.timeout_s:
        tier = ((c.stats().get("workers") or {}).get("compute") or {}).get("expert_tier") or {}
        if tier.get("fills", 0) >= total:
            break
        time.sleep(0.2)
    return time.perf_counter() - t0


def run_deltafin(s: Setup, regime: str, mode: str, cap) -> dict:
    from deltafin.client import Client, DeltafinError
    from deltafin.tools.run import StartError, running_supervisor
    extra = ["--max-slots", str(s.n_slots), "--max-context", str(s.max_context), "--dtype", s.dtype,
             *_common_flags(s, regime), *mode_flags(mode)]
    sections = bench_quality.sections(mode_config(mode), s.quality)
    if sections:
        toml = s.out / f"{regime}-{mode}{s.tag}.toml"
        toml.write_text("".join(f"[{section}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in values.items())
                                for section, values in sections.items()))
        extra += ["--config", str(toml)]
    errlog = s.out / f"{regime}-{mode}{s.tag}.log"
    with open(errlog, "w") as err:
        try:
            with running_supervisor(s.store.path, str(s.budget), extra, timeout=s.timeout_s, stderr=err,
                                    preexec_fn=cap.enter if cap else None) as (endpoint, proc):
                sampler = TreeSampler(proc.pid).start()
                try:
                    with Client(endpoint, timeout=s.timeout_s) as c:
                        preload_s = _await_preload(c, s)
                        t0 = time.perf_counter()
                        gen = c.generate(s.prompt_ids, max_tokens=s.max_tokens)
                        wall = time.perf_counter() - t0
                        stats = c.stats()
                    quality = bench_quality.measure(endpoint, s.quality) if s.quality else None
                finally:
                    mem = sampler.stop()
        except (StartError, DeltafinError, OSError) as e:
            err.flush()
            return {"ok": False, "error": f"{type(e).__name__}: {e}",
                    "cause": _exit_cause(None, cap, errlog.read_text()[-2000:])}
    g = gen.stats
    got_slots = (stats.get("memory") or {}).get("n_slots")
    if got_slots is not None and got_slots < s.n_slots:
        log(f"[{regime}] {mode}: the runtime made {got_slots} of the {s.n_slots} expert slots asked for at "
            f"{format_size(s.budget)}; give a larger --memory-budget (--cache-frac still caps the slots)")
    dec = g.get("decode") or {}
    n_dec = dec.get("tokens") or max(0, len(gen.token_ids) - 1)
    split = {k: dec.get(f"{k}_s", 0.0) / n_dec for k in ("compute", "ipc", "wait", "prepare")} if n_dec else {}
    lat = stats.get("stage_latency") or {}
    pipe = ((stats.get("workers") or {}).get("compute") or {}).get("pipeline") or {}
    return {
        "ok": True, "wall_s": wall, "preload_s": preload_s,
        "generated_tokens": len(gen.token_ids), "token_ids": gen.token_ids,
        "decode_tok_s": g.get("decode_tok_s"), "prefill_tok_s": g.get("prefill_tok_s"), "ttft_s": g.get("ttft_s"),
        "stage_latency": {k: metrics.stage_percentiles(lat.get(k)) for k in ("read", "prepare", "compute")},
        "stall_share": metrics.stall_share(dec.get("wait_s", 0.0), dec.get("total_s")),
        "hit_rate": metrics.hit_rate(dec["hits"], dec["uses"]) if dec.get("uses") else stats.get("hit_rate"),
        "hit_rate_all_tokens": stats.get("hit_rate"),
        "bytes_read_per_token": metrics.bytes_per_token(dec["miss_bytes"], n_dec) if "miss_bytes" in dec else None,
        "bytes_read_per_token_all": stats.get("bytes_read_per_token"),
        "ssd_gbps": stats.get("ssd_gbps"),
        "ssd_share_of_probe": (stats["ssd_gbps"] / s.disk["gbps"]) if stats.get("ssd_gbps") and s.disk.get("gbps") else None,
        "prefetch_precision": stats.get("prefetch_precision"), "prefetch_recall": stats.get("prefetch_recall"),
        "prefetch_gate": ((stats.get("workers") or {}).get("router") or {}).get("prefetch_gate"),  # the prefetcher's own: its setting, precision and gated share
        "time_per_token_s": (1.0 / g["decode_tok_s"]) if g.get("decode_tok_s") else None,
        "split_per_token_s": split, "n_slots": got_slots,
        # compute's own thread's CPU time per token: near time_per_token_s, the host sets the pace
        "host_s_per_token": (dec["host_s"] / n_dec) if n_dec and "host_s" in dec else None,
        # passes run ahead that missed (a GPU's pipeline) and the time they spent after their
        # first miss, per decode token: what misses cost beyond the passes that kept every layer
        "missed_passes": pipe.get("missed_passes"),
        "miss_s_per_token": (pipe["miss_ms"] / 1e3 / n_dec) if n_dec and "miss_ms" in pipe else None,
        # and of it, per token, the waits for reads, read-backs and drains, messages and fills
        "miss_split_s_per_token": ({k: v / 1e3 / n_dec for k, v in pipe["miss_split_ms"].items()}
                                   if n_dec and "miss_split_ms" in pipe else None),
        # The budget estimate for --cache-frac's slots can fall short of what the supervisor
        # finds once it measures the tree (the real regime in float32: 234 of 416 slots at the
        # estimate): then the contender ran with fewer slots than the bound assumes.
        "slots_short": (s.n_slots - got_slots) if got_slots is not None and got_slots < s.n_slots else 0,
        "bench_mode": g.get("bench_mode"), "loader": _loader_figures(stats), **mem,
        **({"quality": quality} if quality else {}),
    }


def _loader_figures(stats: dict) -> dict:
    """Where the read time goes: reads by kind, how long an order waited for its first chunk,
    the share of the run with a read in flight (disk busy), the chunk size, and compute's stall
    per need that waited (router)."""
    ld = (stats.get("workers") or {}).get("loader") or {}
    return {"demand_reads": ld.get("demand_reads"), "prefetch_reads": ld.get("prefetch_reads"),
            "chunk_bytes": ld.get("chunk_bytes"), "chunk_reads": ld.get("chunk_reads"),
            "queue_wait": metrics.stage_percentiles(ld.get("queue_wait")), "disk_busy_share": ld.get("disk_busy_share"),
            "mean_in_flight": ld.get("mean_in_flight"), "bytes": ld.get("bytes"),
            "need_stall": metrics.stage_percentiles((stats.get("stage_latency") or {}).get("stall"))}


def _run_json_process(cmd: list[str], s: Setup, name: str, cap) -> tuple[dict | None, str | None, dict]:
    """Runs a contender process that writes its figures as JSON; returns (figures, failure, memory)."""
    out_json = s.out / f"{name}.json"
    errlog = s.out / f"{name}.log"
    out_json.unlink(missing_ok=True)
    with open(errlog, "w") as err:
        proc = subprocess.Popen(cmd + ["--json", str(out_json)], stdout=err, stderr=err,
                                preexec_fn=cap.enter if cap else None)
        sampler = TreeSampler(proc.pid).start()
        if not stop_process(proc, s.timeout_s, None, kill_s=10):
            mem = sampler.stop()
            return None, f"did not finish within {s.timeout_s:.0f} s", mem
        code = proc.returncode
        mem = sampler.stop()
    data = json.loads(out_json.read_text()) if out_json.exists() else None
    if code != 0 or not data or data.get("error"):
        cause = _exit_cause(code, cap, errlog.read_text()[-2000:])
        if data and data.get("error"):
            cause += f" ({data['error']})"
        return data, cause, mem
    return data, None, mem


def run_mmap(s: Setup, regime: str, cap) -> dict:
    cfg = {"compute": {"dtype": s.dtype, "max_context": s.max_context},
           "bench": {"routing_trace": str(s.trace_path or ""), "standin": regime == "standin",
                     "standin_moe_ms": s.standin_moe_ms, "standin_dense_ms": s.standin_dense_ms}}
    cmd = [sys.executable, "-m", "deltafin.tools.mmap_baseline", "--store", str(s.store.path), "--source", "mmap",
           "--prompt-ids", ",".join(map(str, s.prompt_ids)), "--max-tokens", str(s.max_tokens),
           "--config-json", json.dumps(cfg)]
    data, failure, mem = _run_json_process(cmd, s, f"{regime}-mmap{s.tag}", cap)
    if failure:
        return {"ok": False, "cause": failure, **mem}
    n_dec = max(1, (data.get("generated_tokens") or 1) - 1)
    dec = data.get("decode") or {}
    return {"ok": True, "generated_tokens": data.get("generated_tokens"), "token_ids": data.get("token_ids"),
            "decode_tok_s": data.get("decode_tok_s"), "prefill_tok_s": data.get("prefill_tok_s"),
            "ttft_s": data.get("ttft_s"),
            "stage_latency": {k: metrics.stage_percentiles((data.get("stage_latency") or {}).get(k)) for k in ("read", "prepare", "compute")},
            "stall_share": None, "hit_rate": None,
            "bytes_read_per_token": metrics.bytes_per_token(dec["disk_read_bytes"], n_dec) if "disk_read_bytes" in dec else None,
            "time_per_token_s": (1.0 / data["decode_tok_s"]) if data.get("decode_tok_s") else None,
            "split_per_token_s": {k: dec.get(f"{k}_s", 0.0) / n_dec for k in ("compute", "prepare")} if dec else {},
            "bench_mode": data.get("bench_mode"), **mem}


def run_mlxlm(s: Setup, regime: str, cap, ckpt: Path | None, dtype: str | None) -> dict:
    if regime == "standin":
        return {"ok": False, "skipped": True, "cause": "not applicable: mlx-lm computes for real (no stand-in)"}
    if ckpt is None:
        return {"ok": False, "skipped": True, "cause": "no mlx-lm checkpoint (export failed)"}
    cmd = [sys.executable, "-m", "deltafin.tools.mlxlm_runner", "--model", str(ckpt),
           "--prompt-ids", ",".join(map(str, s.prompt_ids)), "--max-tokens", str(s.max_tokens)]
    if dtype:
        cmd += ["--dtype", dtype]
    data, failure, mem = _run_json_process(cmd, s, f"{regime}-mlx-lm{s.tag}", cap)
    if failure:
        return {"ok": False, "cause": failure, **mem}
    return {"ok": True, "generated_tokens": data.get("generated_tokens"), "token_ids": data.get("token_ids"),
            "decode_tok_s": data.get("decode_tok_s"), "prefill_tok_s": data.get("prefill_tok_s"),
            "ttft_s": data.get("ttft_s"), "stage_latency": None, "stall_share": None, "hit_rate": None,
            "bytes_read_per_token": None,
            "time_per_token_s": (1.0 / data["decode_tok_s"]) if data.get("decode_tok_s") else None,
            "split_per_token_s": {}, "routing": "mlx-lm's own gate (not the trace)", **mem}


def peer_cache_gb(s: Setup) -> float:
    """A peer's expert budget in GB (1e9 bytes, as the peers take it): deltafin's share of the
    experts (its slots over all experts) times the bytes of all experts. Half a byte over, so that
    the peers' int(gb * 1e9) gives the whole byte count and not one byte (and one expert) less."""
    return (s.n_slots / len(s.store.records) * s.store.expert_bytes_total + 0.5) / 1e9


def peer_skip(s: Setup, regime: str, name: str) -> dict | None:
    """The report of a peer that does not run in this regime or on this machine, or None."""
    if regime == "standin":
        return {"ok": False, "skipped": True, "cause": f"not applicable: {name} computes for real (no stand-in)"}
    layout, why = s.peers.get(name, (None, "no layout (the mlx-lm checkpoint was not exported)"))
    return None if layout is not None else {"ok": False, "skipped": True, "cause": why}


def run_peer(s: Setup, regime: str, name: str, cap, cache_gb: float | None = None) -> dict:
    """name's run with its expert budget cache_gb (None: deltafin's share, peer_cache_gb)."""
    layout, _ = s.peers[name]
    cache_gb = peer_cache_gb(s) if cache_gb is None else cache_gb
    cmd = [sys.executable, "-m", "deltafin.tools.peer_runner", "--peer", name, "--model", str(layout),
           "--expert-cache-gb", repr(cache_gb), "--prompt-ids", ",".join(map(str, s.prompt_ids)),
           "--max-tokens", str(s.max_tokens)]
    data, failure, mem = _run_json_process(cmd, s, f"{regime}-{name}{s.tag}", cap)
    if failure:
        return {"ok": False, "cause": failure, **mem}
    n_dec = max(1, (data.get("generated_tokens") or 1) - 1)
    misses = data.get("decode_misses")
    return {"ok": True, "generated_tokens": data.get("generated_tokens"), "token_ids": data.get("token_ids"),
            "decode_tok_s": data.get("decode_tok_s"), "prefill_tok_s": data.get("prefill_tok_s"),
            "ttft_s": data.get("ttft_s"), "stage_latency": None, "stall_share": None,
            "hit_rate": data.get("hit_rate"), "hit_rate_all_tokens": data.get("hit_rate_all_tokens"),
            # the peers count misses, not bytes: misses x the store's expert record size
            "bytes_read_per_token": misses * s.record_bytes / n_dec if misses is not None else None,
            "time_per_token_s": (1.0 / data["decode_tok_s"]) if data.get("decode_tok_s") else None,
            "split_per_token_s": {}, "routing": f"{name}'s own gate (not a trace)",
            "expert_cache_gb": cache_gb, "expert_cache": data.get("expert_cache"), "peer_version": data.get("version"),
            "load_s": data.get("load_s"), **mem}


def run_contender(s: Setup, regime: str, name: str, ckpt: Path | None, mlxlm_dtype: str | None,
                  cache_gb: float | None = None) -> dict:
    """One contender's run; cache_gb: a peer's expert budget (None: deltafin's share)."""
    from deltafin.runtime.diskprobe import drop_page_cache
    from deltafin.tools.memcap import MemoryCap
    if name == "mlx-lm" and regime == "standin":
        return run_mlxlm(s, regime, None, ckpt, mlxlm_dtype)
    peer = name.removesuffix(EQUAL_MEMORY)
    skip = peer_skip(s, regime, peer) if peer in PEERS else None
    if skip is not None:
        return skip
    dropped = drop_page_cache() if s.drop_cache else "not asked (--no-drop-cache)"
    safe = "".join(ch if ch.isalnum() or ch in "._-" else "_" for ch in name)
    cap = MemoryCap(s.budget, f"deltafin-bench-{os.getpid()}-{regime}-{safe}{s.tag}") if s.cap else None
    try:
        if cap is not None:
            cap.reset_peak()
        load0 = os.getloadavg()[0]
        t0 = time.perf_counter()
        if is_deltafin(name):
            r = run_deltafin(s, regime, name, cap)
        elif name == "mmap":
            r = run_mmap(s, regime, cap)
        elif peer in PEERS:
            r = run_peer(s, regime, peer, cap, cache_gb)
        else:
            r = run_mlxlm(s, regime, cap, ckpt, mlxlm_dtype)
        r["run_s"] = time.perf_counter() - t0
        # this machine is shared: the 1-minute load average before and after says how much
        r["load_average"] = [load0, os.getloadavg()[0]]
        r["page_cache"] = "dropped" if dropped is None else f"not dropped: {dropped}"
        if cap is not None:
            r["cap"] = {**cap.describe(), "cgroup_peak_bytes": cap.peak_bytes(), "oom_kills": cap.oom_kills()}
        else:
            r["cap"] = {"limit_bytes": s.budget, "enforced": False, "why_not": "--no-cap"}
        return r
    finally:
        if cap is not None:
            cap.remove()


# ------------------------------------------------------------------------------------ main

QUICK = {"prompt_tokens": 8, "max_tokens": {"standin": 24, "real": 4}, "bound_tokens": 3}
FULL = {"prompt_tokens": 16, "max_tokens": {"standin": 64, "real": 12}, "bound_tokens": 5}


def resolve_store(a) -> Path:
    if a.store:
        return Path(a.store)
    from deltafin.runtime.config import cache_dir
    from deltafin.tools.synth import bench as synth_bench
    name = a.preset + (f"-L{a.layers}" if a.layers else "")
    path = cache_dir() / "bench" / name
    if not (path / "manifest.json").exists():
        log(f"building the {a.preset} store in {path} (random valid 4-bit data; once)")
        synth_bench(a.preset, path, layers=a.layers, force=True)
    return path


def load_routing(path: Path | None, store: Store) -> np.ndarray | None:
    if path is None:
        return None
    from deltafin.runtime.traces import load_trace
    ids = load_trace(path).ids
    if ids.shape[1] < len(store.moe_layers) or ids.shape[2] != store.top_k:
        raise SystemExit(f"trace {path} has {ids.shape[1]} layers x top-{ids.shape[2]}; the store needs "
                         f"{len(store.moe_layers)} x top-{store.top_k}")
    return ids


def export_checkpoint(store: Store) -> tuple[Path | None, str | None]:
    from deltafin.tools.export_mlx import export_mlx
    out = Path(str(store.path).rstrip("/") + ".mlx-lm")
    if (out / "config.json").exists():
        return out, None
    try:
        log(f"writing the mlx-lm checkpoint of the store to {out} (once)")
        return export_mlx(store.path, out), None
    except Exception as e:  # reported as the contender's failure, the rest of the run goes on
        return None, f"{type(e).__name__}: {e}"


def prepare_peers(peers: list[str], store: Store, ckpt: Path | None, ckpt_error: str | None) -> dict:
    """Each peer's layout of the exported checkpoint, built once beside it: {peer: (layout, None)},
    or (None, why) for a peer that cannot run (its package missing, an architecture it does not
    stream, no checkpoint, a failed build), reported as skipped."""
    from deltafin.tools.peer_runner import build_layout, cannot_run, layout_path
    out = {}
    for name in peers:
        why = cannot_run(name, store.config["model_type"])
        if why is None and ckpt is None:
            why = f"no mlx-lm checkpoint: {ckpt_error}"
        if why is not None:
            out[name] = (None, why)
            continue
        try:
            if not (layout_path(ckpt, name) / "config.json").exists():
                log(f"writing {name}'s layout of the checkpoint to {layout_path(ckpt, name)} (once)")
            out[name] = (build_layout(ckpt, name), None)
        except Exception as e:  # reported as the contender's failure, the rest of the run goes on
            out[name] = (None, f"layout build failed: {type(e).__name__}: {e}")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(formatter_class=Help, prog="deltafin-bench", description=__doc__.splitlines()[0])
    p.add_argument("--store", help=f"expert store (default: the {PRESET_DEFAULT} preset, built once in the cache)")
    p.add_argument("--preset", default=PRESET_DEFAULT, help="deltafin-synth bench preset when --store is not given")
    p.add_argument("--layers", type=int, help="layers of the preset store (default: the preset's own)")
    p.add_argument("--trace", help="routing trace .npz (default: ../shared/traces/dsv2lite-test.npz when "
                                   "present); 'none' routes by the gate")
    p.add_argument("--history", help="routing trace deltafin's predictor learns from at start (default: the "
                                     "trace's -train split beside a -test trace); 'none': start cold")
    p.add_argument("--cache-frac", type=float, default=0.25, help="expert slots as a share of all experts")
    p.add_argument("--regimes", default=",".join(REGIMES), help="standin,real")
    p.add_argument("--contenders", default=",".join(CONTENDERS),
                   help=",".join(CONTENDERS) + f"; prefetch settings as {PF_PREFIX}t=0.6:d=1; a peer at "
                   f"deltafin's measured peak memory as mlx-vlm{EQUAL_MEMORY} (after deltafin and mlx-vlm)")
    p.add_argument("--rounds", type=int, default=1, help="run the contenders this many times, alternating "
                   "(round 1: every contender, then round 2, ...); the report gives medians and the spread")
    p.add_argument("--standin-moe-ms", type=float, help="stand-in wait per MoE layer (default: config)")
    p.add_argument("--standin-dense-ms", type=float, help="stand-in wait per dense layer (default: config)")
    p.add_argument("--prompt-tokens", type=int, help="prompt tokens per request (default: 16, 8 with --quick)")
    p.add_argument("--max-tokens", type=int, help="tokens generated per contender (both regimes)")
    p.add_argument("--dtype", default="float32", help="compute dtype of deltafin (float32: fast on the MLX CPU)")
    p.add_argument("--mlxlm-dtype", help="cast mlx-lm's float weights (default: the checkpoint's, as mlx-lm runs)")
    p.add_argument("--probe-disk", action="store_true", help="measure direct-read bandwidth at the store's "
                   "record size and the loader's queue depth (otherwise a short probe runs anyway)")
    p.add_argument("--quick", action="store_true", help="short runs: under 10 minutes on a 2-core machine")
    p.add_argument("--no-cap", action="store_true", help="do not cap memory (cgroup)")
    p.add_argument("--memory-budget", help="the budget (and cap) instead of the estimate for --cache-frac's "
                   "slots; the slot count stays capped at --cache-frac (GPU backends measure larger processes "
                   "than the CPU estimate)")
    p.add_argument("--no-drop-cache", action="store_true", help="do not drop the page cache before contenders")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per contender before it is failed")
    p.add_argument("--out", help="output directory (default: ./deltafin-bench-<time>)")
    bench_quality.add_arguments(p)
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["concurrency"]:
        # `deltafin-bench concurrency ...`: requests decoded together (tools/bench_concurrency.py)
        from deltafin.tools import bench_concurrency
        return bench_concurrency.main(argv[1:])
    a = build_parser().parse_args(argv)
    chosen = _chosen(a)
    if chosen is None:
        return 2
    regimes, contenders = chosen
    preset = QUICK if a.quick else FULL
    out = Path(a.out or f"deltafin-bench-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    setup_common, setup = _prepare(a, preset, out)
    ckpt, ckpt_error = (None, None)
    if {"mlx-lm", *PEERS} & set(contenders) and "real" in regimes:
        ckpt, ckpt_error = export_checkpoint(setup_common["store"])
    setup_common["peers"] = prepare_peers([c for c in contenders if c in PEERS], setup_common["store"], ckpt, ckpt_error)
    setup["peers"] = {name: {"layout": str(lay) if lay else None, "cause": why}
                      for name, (lay, why) in setup_common["peers"].items()}
    from deltafin.tools.bench_report import machine_info
    report = {"tool": "deltafin-bench", "version": 1, "quick": a.quick,
              "command": " ".join(["deltafin-bench", *(argv if argv is not None else sys.argv[1:])]),
              "machine": machine_info(), "setup": setup, "disk": setup_common["disk"], "regimes": {}}
    if ckpt_error:
        report["setup"]["mlx_lm_checkpoint_error"] = ckpt_error
    for regime in regimes:
        s = Setup(**setup_common, max_tokens=setup["max_tokens"][regime])
        rr = _regime_with_bound(s, regime, a, preset)
        _run_rounds(s, regime, contenders, a, (ckpt, ckpt_error), rr, report)
    _write_report(report, out, t_start, a.plot)
    return 0


def _chosen(a) -> tuple[list[str], list[str]] | None:
    """The regimes and contenders asked for; None (after saying why) when one is unknown."""
    regimes = [r for r in a.regimes.split(",") if r]
    contenders = [c for c in a.contenders.split(",") if c]
    bad = [r for r in regimes if r not in REGIMES] + [why for why in map(bad_contender, contenders) if why]
    if bad or a.rounds < 1:
        log(f"unknown regime or contender: {', '.join(bad) or '-'} (regimes {REGIMES}, contenders {CONTENDERS}, "
            f"{PF_PREFIX}t=<threshold>:d=<depth> or {LOSSY_PREFIX}<margin>[:<max_share>]); --rounds >= 1")
        return None
    why = bench_quality.problem(a, regimes, contenders)
    if why:
        log(why)
        return None
    return regimes, contenders


def _prepare(a, preset: dict, out: Path) -> tuple[dict, dict]:
    """The store, routing, budget, prompt and probed disk every contender shares: (Setup's fields
    but max_tokens, the report's "setup")."""
    store = Store(resolve_store(a))
    trace_path = None if a.trace == "none" else (Path(a.trace) if a.trace else find_default_trace())
    trace_ids = load_routing(trace_path, store)
    if trace_path is None:
        log("no routing trace: experts are routed by the (random) gate; the bound's read term needs a trace")
    cfg = load_config()
    n_total = len(store.records)
    n_slots = max(store.top_k, int(round(a.cache_frac * n_total)))
    n_prompt = a.prompt_tokens or preset["prompt_tokens"]
    max_tokens = {r: a.max_tokens or preset["max_tokens"][r] for r in REGIMES}
    max_context = max(64, n_prompt + max(max_tokens.values()) + 16, a.quality_window if a.quality else 0)
    budget = parse_size(a.memory_budget) if a.memory_budget else plan_budget_for_slots(store, n_slots, max_context, a.dtype)
    rng = np.random.default_rng(0)
    prompt_ids = rng.integers(1, int(store.config["vocab_size"]), n_prompt).tolist()
    moe_ms = a.standin_moe_ms if a.standin_moe_ms is not None else cfg.bench.standin_moe_ms
    dense_ms = a.standin_dense_ms if a.standin_dense_ms is not None else cfg.bench.standin_dense_ms

    from deltafin.runtime.diskprobe import probe_disk
    qd = cfg.loader.threads
    log(f"probing direct reads of {format_size(store.max_record_bytes)} records at queue depth {qd}")
    disk = probe_disk(store.path, store.max_record_bytes, qd, seconds=5.0 if a.probe_disk else 2.0)
    gbps = disk["gbps"]
    how = "direct reads" if disk.get("direct_io", True) else "buffered reads: the filesystem refuses O_DIRECT"
    log(f"disk: {gbps:.2f} GB/s {how} ({disk.get('page_cache')})")

    history = None if a.history == "none" else Path(a.history) if a.history else (
        trace_path.with_name(trace_path.name.replace("-test", "-train")) if trace_path and "-test" in trace_path.name else None)
    if history is not None and not history.exists():
        history = None
    log(f"routing history for the predictor: {history or 'none (starts cold)'}")
    quality, quality_setup = bench_quality.prepare(a, store)
    setup_common = dict(store=store, trace_path=trace_path, trace_ids=trace_ids, history_path=history,
                        n_slots=n_slots, budget=budget, quality=quality,
                        prompt_ids=prompt_ids, max_context=max_context, dtype=a.dtype, standin_moe_ms=moe_ms,
                        standin_dense_ms=dense_ms, timeout_s=a.timeout, out=out, disk=disk,
                        drop_cache=not a.no_drop_cache, cap=not a.no_cap)
    setup = {"store": str(store.path), "store_name": store.path.name,
             "routing_history": str(history) if history else None,
             "architecture": store.manifest["architecture"], "layers": int(store.config["num_hidden_layers"]),
             "moe_layers": len(store.moe_layers), "n_experts_total": n_total, "top_k": store.top_k,
             "record_bytes": store.max_record_bytes, "expert_bytes_total": store.expert_bytes_total,
             "n_slots": n_slots, "cache_frac": n_slots / n_total, "budget_bytes": budget,
             "routing": f"trace:{trace_path.name}" if trace_path else "gate",
             "prompt_tokens": n_prompt, "max_tokens": max_tokens, "max_context": max_context,
             "compute_dtype": a.dtype, "loader_threads": qd, "quality": quality_setup}
    return setup_common, setup


def _regime_with_bound(s: Setup, regime: str, a, preset: dict) -> dict:
    """A regime's part of the report, with its bound measured and no contender yet."""
    from deltafin.tools.bench_bound import belady_read_s_per_token, resident_compute_s_per_token
    moe_ms, dense_ms = s.standin_moe_ms, s.standin_dense_ms
    if regime == "standin":
        compute = {"s_per_token": (s.n_moe * moe_ms + s.n_dense * dense_ms) / 1e3,
                   "how": f"stand-in waits: {s.n_moe} MoE layers x {moe_ms} ms + {s.n_dense} dense x {dense_ms} ms"}
        desc = (f"compute stand-in: {moe_ms} ms per MoE layer, {dense_ms} ms per dense layer "
                f"(calibration: configs/standin-h200.json unless given); reads, prepare and messages real")
    else:
        log("measuring compute-only time per token with every expert resident (the bound's compute term)")
        # as many decode steps as the contenders decode (the median of them): on a GPU shared with
        # others a handful of steps gave bounds 1.5x apart within minutes (stop 71, one H100)
        compute = resident_compute_s_per_token(s, max(preset["bound_tokens"], s.max_tokens - 1))
        desc = f"real compute on this machine ({a.dtype} activations), every stage real"
    reads = belady_read_s_per_token(s, s.disk["gbps"]) if s.trace_ids is not None else {"s_per_token": 0.0}
    rr = {"description": desc, "max_tokens": s.max_tokens,
          "bound": {**_bound_terms(compute["s_per_token"], reads["s_per_token"]), "compute": compute, "reads": reads},
          "contenders": {}}
    if regime == "standin":
        rr["standin"] = {"moe_ms": moe_ms, "dense_ms": dense_ms}
    return rr


def equal_memory_gb(s: Setup, runs: dict, peer: str) -> tuple[float | None, str | None]:
    """The peer's expert budget at deltafin's peak: its equal-share budget moved by deltafin's
    peak tree PSS minus its own, from this round's runs; (None, why) where they are missing."""
    mine, theirs = (runs.get(n, [])[-1:] for n in ("deltafin", peer))
    peaks = [r[0].get("peak_tree_pss_bytes") if r and r[0].get("ok") else None for r in (mine, theirs)]
    if None in peaks:
        return None, f"needs deltafin's and {peer}'s peaks at an equal share earlier in the round"
    gb = peer_cache_gb(s) + (peaks[0] - peaks[1]) / 1e9
    if gb <= 0:
        return None, f"deltafin's peak is {format_size(peaks[1] - peaks[0])} below {peer}'s at an equal share"
    return gb, None


def _bound_terms(compute_s: float, read_s: float) -> dict:
    """The bound's figures from its two terms (seconds per token)."""
    bound = metrics.bound_s_per_token(compute_s, read_s)
    return {"s_per_token": bound, "tok_s": 1.0 / bound, "limited_by": "compute" if compute_s >= read_s else "reads",
            "compute_s_per_token": compute_s, "read_s_per_token": read_s}


def _bound_again(s: Setup, rr: dict) -> None:
    """The real regime's compute term measured again before a later round, as many steps as
    before: the bound's compute term is then the median over the rounds so far, so a machine
    whose speed drifts during the bench (a GPU host shared with others) is held to the bound of
    the time its contenders ran, not of one moment before them."""
    from deltafin.tools.bench_bound import resident_compute_s_per_token
    b = rr["bound"]
    log("measuring the bound's compute term again before this round")
    again = resident_compute_s_per_token(s, b["compute"]["samples"])
    b["compute_rounds_s"] = b.get("compute_rounds_s", [b["compute"]["s_per_token"]]) + [again["s_per_token"]]
    b.update(_bound_terms(float(np.median(b["compute_rounds_s"])), b["read_s_per_token"]))


def _run_rounds(s: Setup, regime: str, contenders: list[str], a, checkpoint: tuple, rr: dict,
                report: dict) -> None:
    """Runs a regime's rounds; after each round the contenders' summaries so far go into rr, rr
    into the report and the report to report.json."""
    from deltafin.tools.bench_report import agreement_over_rounds, prefetch_sweep, summarize_rounds
    ckpt, ckpt_error = checkpoint
    runs: dict[str, list[dict]] = {name: [] for name in contenders}
    for i in range(a.rounds):  # every contender once per round, in the same order
        sr = replace(s, tag=f"-r{i + 1}" if a.rounds > 1 else "")
        if i and regime == "real":
            _bound_again(s, rr)
        bound = rr["bound"]["s_per_token"]
        for name in contenders:
            log(f"[{regime}] {name}" + (f" (round {i + 1} of {a.rounds})" if a.rounds > 1 else "") + " ...")
            if name == "mlx-lm" and ckpt is None and regime == "real":
                r = {"ok": False, "cause": f"no mlx-lm checkpoint: {ckpt_error}"}
            elif name.endswith(EQUAL_MEMORY):
                cache_gb, why = equal_memory_gb(sr, runs, name.removesuffix(EQUAL_MEMORY))
                r = {"ok": False, "cause": why} if why else run_contender(sr, regime, name, ckpt, a.mlxlm_dtype, cache_gb)
            else:
                r = run_contender(sr, regime, name, ckpt, a.mlxlm_dtype)
            r.pop("token_ids", None) if not r.get("ok") else None
            runs[name].append(r)
            log(f"[{regime}] {name}: " + (f"{r['decode_tok_s']:.2f} tok/s" if r.get("decode_tok_s") else r.get("cause", "?")))
        if s.quality:
            bench_quality.score_round(runs)
        for name in contenders:
            if runs[name]:
                r = summarize_rounds(runs[name])
                if r.get("ok") and r.get("decode_tok_s"):
                    r["share_of_bound"] = metrics.share_of_bound(r["decode_tok_s"], bound)
                    # time per token over the contender's own bound (its bytes read at the probed
                    # rate, or the compute term): issue 28's goal is <= 2 at 25% of the experts
                    own = metrics.own_bound_s_per_token(rr["bound"]["compute_s_per_token"],
                                                        r.get("bytes_read_per_token"), s.disk.get("gbps"))
                    r["own_bound_s_per_token"] = own
                    r["time_over_own_bound"] = (1.0 / r["decode_tok_s"]) / own if own else None
                if name != "mlx-lm" and "mlx-lm" in runs:
                    r["vs_mlx_lm"] = agreement_over_rounds(runs[name], runs["mlx-lm"])
                rr["contenders"][name] = r
        rr["rounds"] = i + 1
        rr["prefetch_sweep"] = prefetch_sweep(rr["contenders"])
        if s.quality:
            rr["quality"] = bench_quality.rows(rr)
        report["regimes"][regime] = rr
        (s.out / "report.json").write_text(json.dumps(report, indent=1, default=str))


def _write_report(report: dict, out: Path, t_start: float, plot: str | None) -> None:
    """report.json, chart.png (and the quality plot, where asked) and the table on the terminal."""
    from deltafin.tools.bench_report import chart, table
    report["elapsed_s"] = time.perf_counter() - t_start
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    why = chart(report, out / "chart.png")
    print(table(report) + bench_quality.table(report))
    if plot:
        print(bench_quality.plot(report, plot) or f"quality plot: {plot}")
    print(f"\nreport: {out / 'report.json'}" + (f"\nchart: {out / 'chart.png'}" if not why else f"\n{why}"))
    log(f"done in {report['elapsed_s']:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
