"""Counters and latency samples with the metric names of DESIGN-NOTES (same names everywhere).

Every class here is safe to read from another thread while its owner adds to it: a worker's
metrics publisher (runtime/telemetry.py) snapshots them from a background thread while compute's
main thread is inside a forward pass. One uncontended lock per add costs well under a microsecond.
"""
from __future__ import annotations

import math
import threading
from collections import defaultdict, deque
from dataclasses import dataclass

import numpy as np

# Latency histograms: bin i holds samples in [2^(i/8), 2^((i+1)/8)) microseconds (9 % wide), so
# a percentile read from two cumulative histograms is within 4.5 % of the exact one.
BINS_PER_OCTAVE = 8


def latency_bin(seconds: float) -> int:
    us = seconds * 1e6
    return int(math.floor(math.log2(us) * BINS_PER_OCTAVE)) if us > 1.0 else 0


def bin_ms(index: int) -> float:
    """The geometric middle of a bin, in milliseconds."""
    return 2.0 ** ((index + 0.5) / BINS_PER_OCTAVE) / 1e3


def histogram_percentiles(counts: dict[int, int], qs=(50, 99)) -> dict:
    """{count, p50_ms, p99_ms} of a histogram {bin: count} (nearest rank, bin middles)."""
    total = sum(counts.values())
    if total <= 0:
        return {"count": 0}
    out = {"count": int(total)}
    order = sorted(b for b, n in counts.items() if n > 0)
    for q in qs:
        rank = max(1, math.ceil(q / 100 * total))
        seen = 0
        for b in order:
            seen += counts[b]
            if seen >= rank:
                out[f"p{q}_ms"] = bin_ms(b)
                break
    return out


class Counter:
    def __init__(self):
        self._c: dict[str, float] = defaultdict(float)
        self._lock = threading.Lock()

    def add(self, name: str, value: float = 1) -> None:
        with self._lock:
            self._c[name] += value

    def get(self, name: str) -> float:
        with self._lock:
            return self._c.get(name, 0)

    def snapshot(self) -> dict:
        with self._lock:
            items = list(self._c.items())
        return {k: (int(v) if float(v).is_integer() else v) for k, v in items}


class Latency:
    """Samples (seconds) of one stage. `summary()`: p50/p99 in milliseconds over the most recent
    `keep` samples, and `hist`, the cumulative histogram since start as [[bin, count], ...]
    (msgpack maps need string keys). Subtracting an earlier histogram gives percentiles over any
    interval (a sliding window, the time since a reset): full snapshots, never deltas."""

    def __init__(self, keep: int = 8192):
        self.samples: deque[float] = deque(maxlen=keep)
        self.count = 0
        self.total = 0.0
        self.bins: dict[int, int] = defaultdict(int)
        self._lock = threading.Lock()

    def add(self, seconds: float) -> None:
        with self._lock:
            self.samples.append(seconds)
            self.count += 1
            self.total += seconds
            self.bins[latency_bin(seconds)] += 1

    def summary(self) -> dict:
        """count, p50_ms, p99_ms, mean_ms, total_s, and `hist` (the cumulative histogram)."""
        with self._lock:
            hist = [[b, n] for b, n in sorted(self.bins.items())]
            if not self.samples:
                return {"count": 0, "hist": hist}
            a = np.fromiter(self.samples, dtype=np.float64, count=len(self.samples)) * 1e3
            count, total = self.count, self.total
        p50, p99 = np.percentile(a, [50, 99])
        return {"count": count, "p50_ms": float(p50), "p99_ms": float(p99), "mean_ms": float(a.mean()),
                "total_s": total, "hist": hist}


# -- the metric definitions (DESIGN-NOTES, "Metrics every benchmark and the monitor report") ---------
# One definition per name: what it counts, over what window, the function that computes it from
# counters, and how it is exported (runtime/prometheus.py). Telemetry's snapshots and windows,
# the monitor, deltafin-bench, the client's stats and compute's request stats all call these.
@dataclass(frozen=True)
class Metric:
    key: str           # the name in snapshots, windows, bench reports and the monitor
    counts: str        # what it counts
    window: str        # over what
    prom: str = ""     # the exported Prometheus family ("" : not exported)
    kind: str = "gauge"  # its Prometheus type
    help: str = ""     # its Prometheus HELP line


def tok_s(tokens: float, seconds: float | None) -> float | None:
    """decode_tok_s and prefill_tok_s: tokens / the wall time that produced them; None without time."""
    return tokens / seconds if seconds else None


def stall_share(wait_s: float, token_s: float | None) -> float | None:
    """Time compute waited for an expert / total token time (time spent producing tokens)."""
    return wait_s / token_s if token_s else None


def hit_rate(hits: float, uses: float) -> float | None:
    """Routed (token, layer, expert) uses found ready when needed / all uses (the router's counters)."""
    return hits / uses if uses else None


def prefetch_precision(used: float, prefetched: float) -> float | None:
    """Prefetched experts used before their eviction / prefetched experts."""
    return used / prefetched if prefetched else None


def prefetch_recall(avoided: float, misses_left: float) -> float | None:
    """Misses avoided by prefetch / the misses there would have been without it (avoided + left)."""
    return avoided / (avoided + misses_left) if avoided + misses_left else None


def bytes_per_token(nbytes: float, tokens: float) -> float | None:
    """Bytes read from the store / tokens processed (prompt and generated)."""
    return nbytes / tokens if tokens else None


def ssd_gbps(nbytes: float, seconds: float | None) -> float | None:
    """Bytes read / seconds, in GB/s (1e9 bytes)."""
    return nbytes / seconds / 1e9 if seconds else None


def stage_percentiles(summary: dict | None) -> dict | None:
    """A stage's latency as reported: {p50_ms, p99_ms, count}; None without samples."""
    if not summary or not summary.get("count"):
        return None
    return {"p50_ms": summary.get("p50_ms"), "p99_ms": summary.get("p99_ms"), "count": summary.get("count")}


def bound_s_per_token(compute_s: float, read_s: float) -> float:
    """The bound: max(compute-only time per token with every expert resident, Belady miss bytes
    per token at this budget / measured direct-read bandwidth)."""
    return max(compute_s, read_s)


def own_bound_s_per_token(compute_s: float, bytes_per_token: float | None, gbps: float | None) -> float | None:
    """A contender's own bound: max(compute-only time per token with every expert resident, the
    bytes it read per token at the probed direct-read rate); None without its bytes or a rate.
    Where no trace gives the Belady term, this is the bound a streaming run is held to."""
    if bytes_per_token is None or not gbps:
        return None
    return max(compute_s, bytes_per_token / (gbps * 1e9))


def share_of_bound(decode_tok_s: float | None, bound_s: float) -> float | None:
    """Measured tok/s as a share of 1/bound."""
    return decode_tok_s * bound_s if decode_tok_s else None


_SINCE = "since start: finished requests"
METRICS: dict[str, Metric] = {m.key: m for m in (
    Metric("decode_tok_s", "generated tokens / wall time of decode", f"{_SINCE}; a window: its wall time",
           "deltafin_decode_tokens_per_second", help="generated tokens per second of decode time, since start"),
    Metric("prefill_tok_s", "prompt tokens / prefill time", f"{_SINCE}; a window: its wall time",
           "deltafin_prefill_tokens_per_second", help="prompt tokens per second of prefill time, since start"),
    Metric("stage_latency", "per expert (read, prepare), per forward pass (compute), per layer that "
           "waited for reads (stall): p50 and p99", "the last 8192 samples; a window: its histogram",
           "deltafin_stage_latency_seconds", "histogram",
           "per expert read and prepare, per forward pass (compute), per layer that waited (stall)"),
    Metric("stall_share", "time compute waits for an expert / total token time",
           "since start: compute's forward passes; a request: its decode phase",
           "deltafin_stall_ratio", help="compute time spent waiting for expert reads / busy time"),
    Metric("hit_rate", "routed (token, layer, expert) uses found ready when needed / all uses",
           "since start (the router's counters)", "deltafin_hit_ratio",
           help="routed uses found resident / all uses, since start"),
    Metric("prefetch_precision", "prefetched and used before eviction / prefetched", "since start"),
    Metric("prefetch_recall", "misses avoided by prefetch / misses without it", "since start"),
    Metric("bytes_read_per_token", "bytes the loader read / tokens processed", "since start",
           "deltafin_bytes_read_per_token", help="bytes read per token processed, since start"),
    Metric("ssd_gbps", "bytes the loader read / time some read was in flight, GB/s",
           "since start; a window: its wall time"),
    Metric("bound", "max(compute-only s/token with all experts resident, Belady miss bytes per "
           "token at this budget / measured direct-read bandwidth)", "a bench regime"),
    Metric("share_of_bound", "decode tok/s as a share of 1/bound", "a bench regime"),
    Metric("active_requests", "requests relayed to compute and not finished", "now",
           "deltafin_active_requests", help="requests relayed to compute and not finished"),
)}

# The merged snapshot's `totals` exported as Prometheus counters (cumulative, since start).
TOTALS: dict[str, Metric] = {m.key: m for m in (
    Metric("requests", "finished generations", "since start", "deltafin_requests_total", "counter",
           "finished generations"),
    Metric("prefill_tokens", "prompt tokens through forward passes", "since start",
           "deltafin_prefill_tokens_total", "counter", "prompt tokens through forward passes"),
    Metric("decode_tokens", "generated tokens through forward passes", "since start",
           "deltafin_decode_tokens_total", "counter", "generated tokens through forward passes"),
    Metric("uses", "routed (token, layer, expert) uses", "since start", "deltafin_expert_uses_total",
           "counter", "routed (token, layer, expert) uses"),
    Metric("hits", "routed uses found resident", "since start", "deltafin_expert_hits_total", "counter",
           "routed uses found resident"),
    Metric("reads", "expert records read from the store", "since start", "deltafin_expert_reads_total",
           "counter", "expert records read from the store"),
    Metric("bytes_read", "bytes read from the store", "since start", "deltafin_bytes_read_total",
           "counter", "bytes read from the store"),
    Metric("prompt_cache_lookups", "prompts looked up in the prompt cache", "since start",
           "deltafin_prompt_cache_lookups_total", "counter", "prompts looked up in the prompt cache"),
    Metric("prompt_cache_hits", "prompts that started from a cached prefix", "since start",
           "deltafin_prompt_cache_hits_total", "counter", "prompts that started from a cached prefix"),
    Metric("prompt_cache_reused_tokens", "prompt tokens taken from the prompt cache, not prefilled",
           "since start", "deltafin_prompt_cache_reused_tokens_total", "counter",
           "prompt tokens taken from the prompt cache instead of prefilled"),
    Metric("prompt_cache_evicted_blocks", "prompt cache blocks evicted to make room", "since start",
           "deltafin_prompt_cache_evicted_blocks_total", "counter", "prompt cache blocks evicted to make room"),
)}
# The prompt cache's counters (workers/prompt_cache.py) among the totals, as prompt_cache_<key>.
PROMPT_CACHE_TOTALS = ("lookups", "hits", "reused_tokens", "evicted_blocks")
