"""When and where a run's memory peaks: each process of a real supervisor's tree sampled (PSS, every
20 ms) from its start to its end, one greedy request in between.

  python docs/probes/pss_timeline.py STORE SHARE [RUNS [CONFIG]]

Each run starts a supervisor (`--memory-budget 4GiB --max-slots` at SHARE of the store's experts,
`--config CONFIG` where given),
waits for READY, asks 64 greedy tokens, stops it. Prints per run the phases' times (start, READY,
request sent, answered, stopped), each process's peak PSS and the phase it fell in, and the tree's
peak per phase. With MLX_PTX_CACHE_DIR set to an empty directory the first run compiles MLX CUDA's
kernels (a fresh machine's first run) and the next find them: whether the ~4 GB first-round peak
of docs/BENCHMARKS.md stop 66 is that compilation, in which process and phase.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import psutil

from deltafin.client import Client
from deltafin.runtime.store import Store
from deltafin.tools.run import _await_ready, reap
from deltafin.tools.treesampler import TreeSampler

PROMPT = [1, 504, 3458, 314, 260, 6123, 4876, 47, 198]


def role(pid: int) -> str:
    """The worker's name (forked workers set it, runtime/forkserver.py), else its command line's."""
    try:
        proc = psutil.Process(pid)
        cmd = proc.name() + " " + " ".join(proc.cmdline())
    except psutil.Error:
        return "?"
    for name in ("compute", "router", "loader", "frontend", "forkserver", "supervisor"):
        if name in cmd:
            return name
    return cmd[-40:]


def sample(root: int, stop: threading.Event, out: list) -> None:
    """(t, {pid: pss}) every 20 ms until stop."""
    names: dict[int, str] = {}
    while not stop.is_set():
        try:
            pids = [root] + [c.pid for c in psutil.Process(root).children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        for p in pids:
            if p not in names or names[p] == "?":
                names[p] = role(p)
        out.append((time.perf_counter(), {names[p] + f"-{p}": TreeSampler._pss(p) for p in pids}))
        stop.wait(0.02)


def one_run(store: str, slots: int, config: str | None = None) -> None:
    marks = {"start": time.perf_counter()}
    cmd = [sys.executable, "-m", "deltafin.workers.supervisor", "--model", store,
           "--memory-budget", "4GiB", "--max-slots", str(slots), *(["--config", config] if config else [])]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    samples: list = []
    stop = threading.Event()
    th = threading.Thread(target=sample, args=(proc.pid, stop, samples), daemon=True)
    th.start()
    try:
        ep = _await_ready(proc, 600)
        marks["ready"] = time.perf_counter()
        with Client(ep, timeout=300) as c:
            marks["request"] = time.perf_counter()
            done = c.generate(PROMPT, max_tokens=64)
            marks["answered"] = time.perf_counter()
            heap = (c.stats().get("workers", {}).get("compute") or {}).get("heap")
    finally:
        reap(proc, 15, signal.SIGINT)
        marks["stopped"] = time.perf_counter()
        stop.set()
        th.join(timeout=5)
    t0 = marks["start"]
    order = list(marks)

    def phase(t: float) -> str:
        name = order[0]
        for k in order:
            if t >= marks[k]:
                name = k
        return name
    print("phases (s from start):", {k: round(v - t0, 2) for k, v in marks.items()},
          f"decode {done.stats.get('decode_tok_s') or 0:.1f} tok/s", "compute's heap trims:", heap)
    peaks: dict[str, tuple[int, float]] = {}
    tree: dict[str, int] = {}
    for t, per in samples:
        for name, pss in per.items():
            if pss > peaks.get(name, (0, 0.0))[0]:
                peaks[name] = (pss, t)
        ph = phase(t)
        tree[ph] = max(tree.get(ph, 0), sum(per.values()))
    for name, (pss, t) in sorted(peaks.items(), key=lambda kv: -kv[1][0]):
        print(f"  {name:24s} peak {pss / 2**20:8.1f} MiB at {t - t0:6.2f} s ({phase(t)})")
    print("  tree peak per phase (MiB):", {k: round(v / 2**20, 1) for k, v in tree.items()})


def main() -> None:
    store, share = sys.argv[1], float(sys.argv[2])
    runs = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    config = sys.argv[4] if len(sys.argv) > 4 else None
    slots = int(len(Store(store).records) * share)
    print("MLX_PTX_CACHE_DIR", os.environ.get("MLX_PTX_CACHE_DIR"), "config", config,
          "MALLOC_MMAP_THRESHOLD_", os.environ.get("MALLOC_MMAP_THRESHOLD_"))
    for r in range(runs):
        subprocess.run("sync; echo 3 > /proc/sys/vm/drop_caches", shell=True, stderr=subprocess.DEVNULL)
        print(f"run {r}")
        one_run(store, slots, config)


if __name__ == "__main__":
    main()
