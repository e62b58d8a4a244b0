"""Peak proportional set size of a process tree, sampled from outside: what deltafin-bench and
the memory tests report as a contender's memory."""
from __future__ import annotations

import sys
import threading
import time

import psutil


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
                from deltafin.runtime.procmem import tree_memory
                total = tree_memory(pids)  # no segment is known here: a shared one counts in none
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
