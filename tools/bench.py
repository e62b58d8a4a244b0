"""deltafin-bench: deltafin against the alternatives, side by side in one run on one machine.

Every contender starts fresh, with the page cache dropped and its process tree capped at the same
memory budget: deltafin in its named modes, a memory-mapped baseline (the store read through the
page cache with no cache of its own) and mlx-lm on the same weights. Two regimes: real compute on
this machine, and a compute stand-in (each layer's math replaced by a wait calibrated on a GPU)
where reading, preparing and orchestration decide. Each contender is reported against the bound
of ../shared/DESIGN-NOTES.md. Output: report.json, chart.png, a table on the terminal.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import psutil

from deltafin.runtime import metrics
from deltafin.runtime.config import format_size, load_config, parse_size
from deltafin.runtime.procs import stop_process
from deltafin.runtime.store import Store

# deltafin's named modes: the runtime, the reference design ("sync-lru": synchronous layers,
# LRU, bench.pipeline "sync") and one mode per question still open (docs/BENCHMARKS.md).
DELTAFIN_MODES = {
    "deltafin": [],
    "deltafin-sync-lru": ["--policy", "lru"],
    "deltafin-lfuda": ["--policy", "lfuda"],
    "deltafin-no-prefetch": ["--prefetch", "off"],  # the default policy (predictive), no prefetch
    "deltafin-chunked": [],  # the default with each record read as 1 MiB chunks by all threads
    "deltafin-prefetch-0.7": [],  # the default, prefetch only from probability 0.7 (fewer bytes)
    "deltafin-no-stream-misses": [],  # the default with a layer's misses computed once all have landed
    "deltafin-no-leases": [],  # the default with gate lookahead as a hint only, not asked as a lease
}
# Modes' settings that have no flag of their own: written to a TOML file passed with --config.
DELTAFIN_MODE_CONFIG = {
    "deltafin-sync-lru": {"bench": {"pipeline": "sync"}},
    "deltafin-chunked": {"bench": {"chunk_bytes": 1 << 20}},
    "deltafin-prefetch-0.7": {"cache": {"prefetch_threshold": 0.7}},
    "deltafin-no-stream-misses": {"bench": {"stream_misses": False}},
    "deltafin-no-leases": {"bench": {"leases": False}},
}
CONTENDERS = [*DELTAFIN_MODES, "mmap", "mlx-lm"]
# Prefetch settings as contenders, for a sweep: "deltafin-pf:t=0.6:d=1" is the default with
# prefetch on at threshold 0.6, depth 1. Colons, not commas, so that --contenders still splits on
# commas.
PF_PREFIX = "deltafin-pf:"
PF_KEYS = {"t": ("prefetch_threshold", float), "d": ("prefetch_depth", int)}
REGIMES = ("standin", "real")
PRESET_DEFAULT = "dsv2-lite"


def prefetch_mode(name: str) -> dict:
    """The [cache] overrides a "deltafin-pf:t=..:d=.." contender names; ValueError
    for a malformed one."""
    if not name.startswith(PF_PREFIX):
        raise ValueError(f"{name}: not a {PF_PREFIX} contender")
    cache: dict = {"prefetch": True}
    for part in name[len(PF_PREFIX):].split(":"):
        key, _, value = part.partition("=")
        if key not in PF_KEYS or not value:
            raise ValueError(f"{name}: {part!r} is not t=<threshold> or d=<depth>")
        field_name, conv = PF_KEYS[key]
        try:
            cache[field_name] = conv(value)
        except (KeyError, ValueError):
            raise ValueError(f"{name}: bad value in {part!r}") from None
    load_config(None, {f"cache.{k}": v for k, v in cache.items()})  # the config's own range checks
    return cache


def is_deltafin(name: str) -> bool:
    return name in DELTAFIN_MODES or name.startswith(PF_PREFIX)


def mode_flags(name: str) -> list[str]:
    return DELTAFIN_MODES.get(name, [])


def mode_config(name: str) -> dict | None:
    """The TOML sections a deltafin mode writes for --config (None: no file)."""
    if name.startswith(PF_PREFIX):
        return {"cache": prefetch_mode(name)}
    return DELTAFIN_MODE_CONFIG.get(name)


def bad_contender(name: str) -> str | None:
    if name in CONTENDERS:
        return None
    if name.startswith(PF_PREFIX):
        try:
            prefetch_mode(name)
            return None
        except Exception as e:  # ValueError or the config's ConfigError
            return str(e)
    return name


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


# ------------------------------------------------------------------------------------ sampling

class TreeSampler:
    """Peak proportional set size of a process tree, sampled from outside every `interval` s."""

    def __init__(self, root_pid: int, interval: float = 0.01):
        self.root, self.interval = root_pid, interval
        self.peak = 0
        self.samples = 0
        self.elapsed = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _pss(pid: int) -> int:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0

    def _pids(self) -> list[int]:
        try:
            p = psutil.Process(self.root)
            return [self.root] + [c.pid for c in p.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def _run(self) -> None:
        t0 = time.perf_counter()
        listed = -1.0
        while not self._stop.is_set():
            tick = time.perf_counter()
            if tick - listed > 0.25:  # listing the tree scans every process: not on every sample
                pids, listed = self._pids(), tick
            if not pids:
                break
            if sys.platform.startswith("linux"):
                total = sum(self._pss(p) for p in pids)
            else:
                from deltafin.runtime.budget import tree_memory
                total = tree_memory(pids)
            self.peak = max(self.peak, total)
            self.samples += 1
            self._stop.wait(max(0.0, self.interval - (time.perf_counter() - tick)))  # a period, not a gap
        self.elapsed = time.perf_counter() - t0

    def start(self):
        self._thread.start()
        return self

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join(timeout=5)
        return {"peak_tree_pss_bytes": self.peak, "samples": self.samples,
                "mean_interval_ms": (self.elapsed / self.samples * 1e3) if self.samples else None}


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
    tag: str = ""  # added to a contender's file names (the round, with --rounds)

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
    sections = mode_config(mode)
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
        # The budget estimate for --cache-frac's slots can fall short of what the supervisor
        # finds once it measures the tree (the real regime in float32: 234 of 416 slots at the
        # estimate): then the contender ran with fewer slots than the bound assumes.
        "slots_short": (s.n_slots - got_slots) if got_slots is not None and got_slots < s.n_slots else 0,
        "bench_mode": g.get("bench_mode"), "loader": _loader_figures(stats), **mem,
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


def run_contender(s: Setup, regime: str, name: str, ckpt: Path | None, mlxlm_dtype: str | None) -> dict:
    from deltafin.runtime.diskprobe import drop_page_cache
    from deltafin.tools.memcap import MemoryCap
    if name == "mlx-lm" and regime == "standin":
        return run_mlxlm(s, regime, None, ckpt, mlxlm_dtype)
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


# ------------------------------------------------------------------------------------ the bound

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
    q = store.manifest["quantization"]
    resident = ResidentExperts(layers, q["bits"], q["group_size"])
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
    return {"s_per_token": float(np.median(times)), "samples": len(times), "load_s": load_s,
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


# ------------------------------------------------------------------------------------ rounds

# Figures a contender's summary over rounds gives as the median of its rounds.
ROUND_KEYS = ("decode_tok_s", "prefill_tok_s", "ttft_s", "hit_rate", "bytes_read_per_token",
              "bytes_read_per_token_all", "stall_share", "prefetch_precision", "prefetch_recall",
              "ssd_gbps")


def summarize_rounds(runs: list[dict]) -> dict:
    """One contender over its rounds (run alternating with the others, so that a slow spell of
    the shared machine falls on every contender): the round nearest the median decode rate, with
    ROUND_KEYS replaced by their medians over the rounds that ran, each round's figures under
    "rounds" and the decode rate's spread (max / min). A single round is returned as it is."""
    if len(runs) == 1:
        return runs[0]
    ok = [r for r in runs if r.get("ok") and r.get("decode_tok_s")]
    per_round = [{"ok": bool(r.get("ok")), "cause": r.get("cause"), "load_average": r.get("load_average"),
                  "disk_busy_share": (r.get("loader") or {}).get("disk_busy_share"),
                  **{k: r.get(k) for k in ROUND_KEYS}} for r in runs]
    if not ok:
        return {**runs[0], "rounds": per_round, "rounds_ok": 0}
    rates = [r["decode_tok_s"] for r in ok]
    mid = float(np.median(rates))
    out = dict(min(ok, key=lambda r: abs(r["decode_tok_s"] - mid)))
    for k in ROUND_KEYS:
        vals = [r[k] for r in ok if r.get(k) is not None]
        out[k] = float(np.median(vals)) if vals else None
    out["time_per_token_s"] = 1.0 / out["decode_tok_s"]
    out.update(rounds=per_round, rounds_ok=len(ok), decode_tok_s_spread=max(rates) / min(rates),
               decode_tok_s_range=[min(rates), max(rates)])
    return out


def prefetch_sweep(contenders: dict) -> dict | None:
    """Over the deltafin-pf contenders: the slowest prefetch setting against prefetch off
    (deltafin-no-prefetch), by decode tok/s."""
    gated, fixed = {}, {}
    for name, r in contenders.items():
        if not (r.get("ok") and r.get("decode_tok_s")):
            continue
        if name.startswith(PF_PREFIX):
            gated[name] = r["decode_tok_s"]
        elif name == "deltafin-no-prefetch":
            fixed[name] = r["decode_tok_s"]
    if not gated or not fixed:
        return None
    worst, best = min(gated, key=gated.get), max(fixed, key=fixed.get)
    return {"min_gated": worst, "min_gated_tok_s": gated[worst], "max_fixed": best,
            "max_fixed_tok_s": fixed[best], "ratio": gated[worst] / fixed[best], "goal": 0.97}


# ------------------------------------------------------------------------------------ output

def chart(report: dict, path: Path) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'deltafin[bench]'): no chart"
    regimes = [r for r in REGIMES if r in report["regimes"]]
    fig, axes = plt.subplots(2, len(regimes), figsize=(6.5 * len(regimes), 8), squeeze=False)
    colors = {"compute": "#4c72b0", "wait": "#dd8452", "prepare": "#55a868", "ipc": "#c44e52", "other": "#8c8c8c"}
    for col, regime in enumerate(regimes):
        rr = report["regimes"][regime]
        names = [n for n, r in rr["contenders"].items() if r.get("ok")]
        ax = axes[0][col]
        for i, n in enumerate(names):
            r = rr["contenders"][n]
            total = (r.get("time_per_token_s") or 0) * 1e3
            bottom = 0.0
            parts = list((r.get("split_per_token_s") or {}).items())
            parts.append(("other", max(0.0, total / 1e3 - sum(v for _, v in parts))))
            for k, v in parts:
                ax.bar(i, v * 1e3, bottom=bottom, color=colors.get(k, "#999"), label=k)
                bottom += v * 1e3
        ax.axhline(rr["bound"]["s_per_token"] * 1e3, color="k", ls="--", lw=1, label="bound")
        ax.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=8)
        ax.set_ylabel("ms per decode token")
        ax.set_title(f"{regime}: time per token by stage")
        handles, labels = ax.get_legend_handles_labels()
        uniq = dict(zip(labels, handles))
        ax.legend(uniq.values(), uniq.keys(), fontsize=7)
        ax = axes[1][col]
        all_names = list(rr["contenders"])
        vals = [rr["contenders"][n].get("decode_tok_s") or 0 for n in all_names]
        ax.bar(range(len(all_names)), vals, color="#4c72b0")
        ax.axhline(1.0 / rr["bound"]["s_per_token"], color="k", ls="--", lw=1, label="1 / bound")
        for i, n in enumerate(all_names):
            r = rr["contenders"][n]
            txt = f"{r['share_of_bound']:.0%}" if r.get("share_of_bound") is not None else (
                "skipped" if r.get("skipped") else "failed")
            ax.text(i, vals[i], txt, ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(all_names)), all_names, rotation=20, ha="right", fontsize=8)
        ax.set_ylabel("decode tok/s")
        ax.set_title(f"{regime}: decode tok/s against the bound")
        ax.legend(fontsize=7)
    s = report["setup"]
    fig.suptitle(f"{s['store_name']}: {s['n_slots']} of {s['n_experts_total']} expert slots "
                 f"({s['cache_frac']:.0%}), budget {format_size(s['budget_bytes'])}, routing {s['routing']}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def table(report: dict) -> str:
    lines = []
    for regime, rr in report["regimes"].items():
        b = rr["bound"]
        lines.append(f"\n[{regime}] {rr['description']}")
        lines.append(f"bound {b['s_per_token'] * 1e3:.1f} ms/token ({b['limited_by']}): compute "
                     f"{b['compute_s_per_token'] * 1e3:.1f} ms, Belady reads {b['read_s_per_token'] * 1e3:.1f} ms")
        w = max(20, *(len(n) + 1 for n in rr["contenders"]))
        lines.append(f"{'contender':<{w}}{'decode':>9}{'spread':>7}{'of bound':>9}{'prefill':>9}{'TTFT s':>8}{'hit':>6}"
                     f"{'MB/tok':>8}{'disk MB/tok':>12}{'stall':>7}{'read p50/p99 ms':>17}{'need wait p50':>14}{'disk busy':>10}"
                     f"{'pf prec':>8}{'pf rec':>7}{'peak MiB':>9}{'load':>10}")
        for name, r in rr["contenders"].items():
            if not r.get("ok"):
                lines.append(f"{name:<{w}}  {r.get('cause', 'failed')}")
                continue
            rd = (r.get("stage_latency") or {}).get("read")
            fmt = lambda v, f: (f.format(v) if v is not None else "-")
            lines.append(
                f"{name:<{w}}{fmt(r.get('decode_tok_s'), '{:.2f}'):>9}{fmt(r.get('decode_tok_s_spread'), '{:.2f}x'):>7}{fmt(r.get('share_of_bound'), '{:.0%}'):>9}"
                f"{fmt(r.get('prefill_tok_s'), '{:.2f}'):>9}{fmt(r.get('ttft_s'), '{:.2f}'):>8}"
                f"{fmt(r.get('hit_rate'), '{:.2f}'):>6}{fmt((r.get('bytes_read_per_token') or 0) / 1e6 if r.get('bytes_read_per_token') is not None else None, '{:.1f}'):>8}"
                f"{fmt((r['bytes_read_per_token_all'] / 1e6) if r.get('bytes_read_per_token_all') else None, '{:.1f}'):>12}"
                f"{fmt(r.get('stall_share'), '{:.0%}'):>7}"
                f"{(('%.1f/%.1f' % (rd['p50_ms'], rd['p99_ms'])) if rd else '-'):>17}"
                f"{fmt(((r.get('loader') or {}).get('need_stall') or {}).get('p50_ms'), '{:.1f}'):>14}"
                f"{fmt((r.get('loader') or {}).get('disk_busy_share'), '{:.0%}'):>10}"
                f"{fmt(r.get('prefetch_precision'), '{:.2f}'):>8}{fmt(r.get('prefetch_recall'), '{:.2f}'):>7}"
                f"{r.get('peak_tree_pss_bytes', 0) / 2**20:>9.0f}"
                f"{('%.1f-%.1f' % tuple(r['load_average'])) if r.get('load_average') else '-':>10}")
        if rr.get("rounds", 1) > 1:
            lines.append(f"{rr['rounds']} rounds, contenders alternating: medians per contender; spread = "
                         f"fastest / slowest round's decode tok/s")
        sw = rr.get("prefetch_sweep")
        if sw:
            lines.append(f"prefetch sweep: slowest self-gated {sw['min_gated']} {sw['min_gated_tok_s']:.2f} tok/s / "
                         f"fastest fixed {sw['max_fixed']} {sw['max_fixed_tok_s']:.2f} tok/s = {sw['ratio']:.2f}x "
                         f"(goal >= {sw['goal']})")
        for name, r in rr["contenders"].items():
            if r.get("slots_short"):
                lines.append(f"note: {name} ran with {r['n_slots']} expert slots, {r['slots_short']} fewer than "
                             f"the bound assumes (the budget held no more)")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ main

QUICK = {"prompt_tokens": 8, "max_tokens": {"standin": 24, "real": 4}, "bound_tokens": 3}
FULL = {"prompt_tokens": 16, "max_tokens": {"standin": 64, "real": 12}, "bound_tokens": 5}


def resolve_store(a) -> Path:
    if a.store:
        return Path(a.store)
    from deltafin.tools.demo_model import cache_dir
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deltafin-bench", description=__doc__.splitlines()[0])
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
                   help=",".join(CONTENDERS) + f"; and prefetch settings as {PF_PREFIX}t=0.6:d=1")
    p.add_argument("--rounds", type=int, default=1, help="run the contenders this many times, alternating "
                   "(round 1: every contender, then round 2, ...); the report gives medians and the spread")
    p.add_argument("--standin-moe-ms", type=float, help="stand-in wait per MoE layer (default: config)")
    p.add_argument("--standin-dense-ms", type=float, help="stand-in wait per dense layer (default: config)")
    p.add_argument("--prompt-tokens", type=int)
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
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["concurrency"]:
        # `deltafin-bench concurrency ...`: requests decoded together (tools/bench_concurrency.py)
        from deltafin.tools import bench_concurrency
        return bench_concurrency.main(argv[1:])
    a = build_parser().parse_args(argv)
    preset = QUICK if a.quick else FULL
    regimes = [r for r in a.regimes.split(",") if r]
    contenders = [c for c in a.contenders.split(",") if c]
    bad = [r for r in regimes if r not in REGIMES] + [why for why in map(bad_contender, contenders) if why]
    if bad or a.rounds < 1:
        log(f"unknown regime or contender: {', '.join(bad) or '-'} (regimes {REGIMES}, contenders {CONTENDERS}, "
            f"or {PF_PREFIX}t=<threshold>:d=<depth>); --rounds >= 1")
        return 2
    out = Path(a.out or f"deltafin-bench-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
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
    max_context = max(64, n_prompt + max(max_tokens.values()) + 16)
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
    log(f"disk: {gbps:.2f} GB/s direct reads ({disk.get('page_cache')})")

    history = None if a.history == "none" else Path(a.history) if a.history else (
        trace_path.with_name(trace_path.name.replace("-test", "-train")) if trace_path and "-test" in trace_path.name else None)
    if history is not None and not history.exists():
        history = None
    log(f"routing history for the predictor: {history or 'none (starts cold)'}")
    setup_common = dict(store=store, trace_path=trace_path, trace_ids=trace_ids, history_path=history,
                        n_slots=n_slots, budget=budget,
                        prompt_ids=prompt_ids, max_context=max_context, dtype=a.dtype, standin_moe_ms=moe_ms,
                        standin_dense_ms=dense_ms, timeout_s=a.timeout, out=out, disk=disk,
                        drop_cache=not a.no_drop_cache, cap=not a.no_cap)
    ckpt, ckpt_error = (None, None)
    if "mlx-lm" in contenders and "real" in regimes:
        ckpt, ckpt_error = export_checkpoint(store)
    report = {"tool": "deltafin-bench", "version": 1, "quick": a.quick,
              "command": " ".join(["deltafin-bench", *(argv if argv is not None else sys.argv[1:])]),
              "machine": machine_info(),
              "setup": {"store": str(store.path), "store_name": store.path.name,
                        "routing_history": str(history) if history else None,
                        "architecture": store.manifest["architecture"], "layers": int(store.config["num_hidden_layers"]),
                        "moe_layers": len(store.moe_layers), "n_experts_total": n_total, "top_k": store.top_k,
                        "record_bytes": store.max_record_bytes, "expert_bytes_total": store.expert_bytes_total,
                        "n_slots": n_slots, "cache_frac": n_slots / n_total, "budget_bytes": budget,
                        "routing": f"trace:{trace_path.name}" if trace_path else "gate",
                        "prompt_tokens": n_prompt, "max_tokens": max_tokens, "max_context": max_context,
                        "compute_dtype": a.dtype, "loader_threads": qd},
              "disk": disk, "regimes": {}}
    if ckpt_error:
        report["setup"]["mlx_lm_checkpoint_error"] = ckpt_error
    for regime in regimes:
        s = Setup(**setup_common, max_tokens=max_tokens[regime])
        if regime == "standin":
            compute = {"s_per_token": (s.n_moe * moe_ms + s.n_dense * dense_ms) / 1e3,
                       "how": f"stand-in waits: {s.n_moe} MoE layers x {moe_ms} ms + {s.n_dense} dense x {dense_ms} ms"}
            desc = (f"compute stand-in: {moe_ms} ms per MoE layer, {dense_ms} ms per dense layer "
                    f"(calibration: configs/standin-h200.json unless given); reads, prepare and messages real")
        else:
            log("measuring compute-only time per token with every expert resident (the bound's compute term)")
            compute = resident_compute_s_per_token(s, preset["bound_tokens"])
            desc = f"real compute on this machine ({a.dtype} activations), every stage real"
        reads = belady_read_s_per_token(s, gbps) if trace_ids is not None else {"s_per_token": 0.0}
        bound = metrics.bound_s_per_token(compute["s_per_token"], reads["s_per_token"])
        rr = {"description": desc, "max_tokens": s.max_tokens,
              "bound": {"s_per_token": bound, "tok_s": 1.0 / bound,
                        "limited_by": "compute" if compute["s_per_token"] >= reads["s_per_token"] else "reads",
                        "compute_s_per_token": compute["s_per_token"], "compute": compute,
                        "read_s_per_token": reads["s_per_token"], "reads": reads},
              "contenders": {}}
        if regime == "standin":
            rr["standin"] = {"moe_ms": moe_ms, "dense_ms": dense_ms}
        runs: dict[str, list[dict]] = {name: [] for name in contenders}
        for i in range(a.rounds):  # every contender once per round, in the same order
            sr = replace(s, tag=f"-r{i + 1}" if a.rounds > 1 else "")
            for name in contenders:
                log(f"[{regime}] {name}" + (f" (round {i + 1} of {a.rounds})" if a.rounds > 1 else "") + " ...")
                if name == "mlx-lm" and ckpt is None and regime == "real":
                    r = {"ok": False, "cause": f"no mlx-lm checkpoint: {ckpt_error}"}
                else:
                    r = run_contender(sr, regime, name, ckpt, a.mlxlm_dtype)
                r.pop("token_ids", None) if not r.get("ok") else None
                runs[name].append(r)
                log(f"[{regime}] {name}: " + (f"{r['decode_tok_s']:.2f} tok/s" if r.get("decode_tok_s") else r.get("cause", "?")))
            for name in contenders:
                if runs[name]:
                    r = summarize_rounds(runs[name])
                    if r.get("ok") and r.get("decode_tok_s"):
                        r["share_of_bound"] = metrics.share_of_bound(r["decode_tok_s"], bound)
                    rr["contenders"][name] = r
            rr["rounds"] = i + 1
            rr["prefetch_sweep"] = prefetch_sweep(rr["contenders"])
            report["regimes"][regime] = rr
            (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    report["elapsed_s"] = time.perf_counter() - t_start
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    why = chart(report, out / "chart.png")
    print(table(report))
    print(f"\nreport: {out / 'report.json'}" + (f"\nchart: {out / 'chart.png'}" if not why else f"\n{why}"))
    log(f"done in {report['elapsed_s']:.0f} s")
    return 0


def machine_info() -> dict:
    import platform

    import mlx.core as mx
    return {"platform": platform.platform(), "machine": platform.machine(), "cpus": os.cpu_count(),
            "memory_bytes": psutil.virtual_memory().total, "python": platform.python_version(),
            "mlx": mx.__version__, "mlx_device": str(mx.default_device())}


if __name__ == "__main__":
    sys.exit(main())
