"""What each process of the tree costs in memory, counted so that the tree's sum counts every
page once (the budget's measurement at start, `stats`' tree_bytes, the monitor).

- Linux: PSS, the proportional set size (a shared page split among the processes mapping it).
- macOS has no PSS, and its RSS counts a shared segment in every process that maps it. There a
  process counts its own memory, the larger of its USS (pages no other process maps) and its
  phys_footprint (what macOS charges it, MLX's Metal buffers included; libproc's
  proc_pid_rusage), and the run's shared-memory segments are added to the tree once.
- Anywhere with neither: RSS, which over-counts shared pages and so stays on the safe side.
"""
from __future__ import annotations

import ctypes
import sys
from typing import Iterable

import psutil

RUSAGE_INFO_V2 = 2    # proc_pid_rusage flavor: struct rusage_info_v2
FOOTPRINT_FIELD = 9   # its phys_footprint, in 64-bit words (after the 16-byte uuid and 7 counters)


def footprint(pid: int) -> int | None:
    """macOS: the process's phys_footprint in bytes; None elsewhere or where libproc refuses."""
    if sys.platform != "darwin":
        return None
    try:
        libproc = ctypes.CDLL("/usr/lib/libproc.dylib")
        info = (ctypes.c_uint64 * 24)()  # rusage_info_v2 is 20 words; room to spare
        if libproc.proc_pid_rusage(int(pid), RUSAGE_INFO_V2, ctypes.pointer(info)) != 0:
            return None
        return int(info[FOOTPRINT_FIELD])
    except (OSError, AttributeError):
        return None


def measure(proc: psutil.Process) -> dict:
    """{"rss", "pss", "uss", "own", "private"} of one process: `own` is what the tree's sum
    counts for it; `private` says it leaves shared segments out (they are added once)."""
    info = proc.memory_full_info()
    pss, uss = getattr(info, "pss", None), getattr(info, "uss", None)
    if pss is not None:
        return {"rss": info.rss, "pss": pss, "uss": uss, "own": pss, "private": False}
    mine = [v for v in (uss, footprint(proc.pid)) if v is not None]
    if mine:
        return {"rss": info.rss, "pss": None, "uss": uss, "own": max(mine), "private": True}
    return {"rss": info.rss, "pss": None, "uss": None, "own": info.rss, "private": False}


def tree_total(samples: Iterable[dict], shared_bytes: int = 0) -> int:
    """The tree's memory from measure()'s samples (None entries skipped): their `own` bytes,
    plus the shared segments (shared_bytes) once where a sample left them out."""
    samples = [s for s in samples if s and s.get("own") is not None]
    private = any(s["private"] for s in samples)
    return sum(s["own"] for s in samples) + (shared_bytes if private else 0)


def tree_memory(pids: list[int], shared_bytes: int = 0) -> int:
    """The memory of these processes together (gone or foreign ones count nothing)."""
    samples = []
    for pid in pids:
        try:
            samples.append(measure(psutil.Process(pid)))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return tree_total(samples, shared_bytes)


# The share of copy-on-write pages the budget keeps room for: a worker forked from the fork server
# shares its interpreter's pages until it writes them (refcounts). Measured on the 8 x 32 qwen3_moe
# store: 63.2 MiB shared at start, 52.4 after a first decode of 32 tokens (18% copied), 51.8 after
# three more of 64: the first requests copy what the workers' code paths touch, then it stops.
COW_RESERVE_SHARE = 0.3


def cow_shared(pids: list[int]) -> int:
    """Linux: bytes of private anonymous pages these processes still share copy-on-write (a
    page mapped by n of them counts n - 1 times: what copying them all would add); 0 elsewhere."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                kb = {k.rstrip(":"): int(v) for k, v, *_ in (line.split() for line in f) if v.isdigit()}
        except (OSError, ValueError):
            continue
        total += max(0, kb.get("Anonymous", 0) - kb.get("Pss_Anon", 0)) * 1024
    return total

