"""Counters and latency samples with the metric names of DESIGN-NOTES (same names everywhere).

Every class here is safe to read from another thread while its owner adds to it: a worker's
metrics publisher (runtime/telemetry.py) snapshots them from a background thread while compute's
main thread is inside a forward pass. One uncontended lock per add costs well under a microsecond.
"""
from __future__ import annotations

import math
import threading
from collections import defaultdict, deque

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
