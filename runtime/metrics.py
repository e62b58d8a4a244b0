"""Counters and latency samples with the metric names of DESIGN-NOTES (same names everywhere)."""
from __future__ import annotations

from collections import defaultdict, deque

import numpy as np


class Counter:
    def __init__(self):
        self._c: dict[str, float] = defaultdict(float)

    def add(self, name: str, value: float = 1) -> None:
        self._c[name] += value

    def get(self, name: str) -> float:
        return self._c.get(name, 0)

    def snapshot(self) -> dict:
        return {k: (int(v) if float(v).is_integer() else v) for k, v in self._c.items()}


class Latency:
    """Recent samples (seconds) of one stage; p50/p99 in milliseconds."""

    def __init__(self, keep: int = 8192):
        self.samples: deque[float] = deque(maxlen=keep)
        self.count = 0
        self.total = 0.0

    def add(self, seconds: float) -> None:
        self.samples.append(seconds)
        self.count += 1
        self.total += seconds

    def summary(self) -> dict:
        if not self.samples:
            return {"count": 0}
        a = np.fromiter(self.samples, dtype=np.float64) * 1e3
        return {"count": self.count, "p50_ms": float(np.percentile(a, 50)),
                "p99_ms": float(np.percentile(a, 99)), "mean_ms": float(a.mean()),
                "total_s": self.total}
