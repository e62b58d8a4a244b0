"""Giving the C heap's free memory back to the system after a burst of allocations.

On a machine's first run MLX CUDA compiles its kernels with NVRTC inside compute's process (its
warm-up meets most of them, before the supervisor measures the tree; a request may meet more);
the compiler frees what it allocated, but glibc keeps freed heap pages mapped for reuse, so
compute's resident memory stayed about 2.9 GB higher than a run that finds its kernels cached
(H100, issue 28's store: docs/BENCHMARKS.md, stops 67-68). `HeapTrim` asks glibc (`malloc_trim`)
to give that back, only when the process grew by a threshold since it last asked (a call walks
the heap, so it is not made per token); `release_freed` asks once. Elsewhere than on glibc both
do nothing.
"""
from __future__ import annotations

import ctypes
import os
import time

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _libc_trim():
    """glibc's malloc_trim, or None (musl, macOS, Windows)."""
    try:
        libc = ctypes.CDLL("libc.so.6")  # glibc's name; no library search (it runs subprocesses)
        fn = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


def release_freed() -> None:
    """Hands the C heap's free pages back to the system now (nothing without glibc)."""
    trim = _libc_trim()
    if trim is not None:
        trim(0)


def resident_bytes() -> int | None:
    """This process's private resident memory from /proc/self/statm (one small read): the resident
    set less its shared pages (files and shared memory), so the slot pool filling up is not
    growth of the heap; None without procfs."""
    try:
        with open("/proc/self/statm") as f:
            fields = f.read().split()
        return (int(fields[1]) - int(fields[2])) * PAGE
    except (OSError, ValueError, IndexError):
        return None


class HeapTrim:
    """`maybe()` trims where the private resident memory grew by `threshold` bytes since the last
    trim (or since it was made), and counts what it gave back (`stats`)."""

    def __init__(self, threshold: int = 64 << 20, trim=None, rss=resident_bytes):
        self.threshold, self._rss = threshold, rss
        self._trim = _libc_trim() if trim is None else trim
        self.base = rss() if self._trim is not None else None
        self.trims = 0
        self.released = 0
        self.seconds = 0.0

    def maybe(self) -> int:
        """Trims if grown; returns the bytes the resident set fell by (0 where it did not trim)."""
        if self._trim is None or self.base is None:
            return 0
        now = self._rss()
        if now is None or now - self.base < self.threshold:
            return 0
        t0 = time.perf_counter()
        self._trim(0)
        after = self._rss() or now
        self.seconds += time.perf_counter() - t0
        freed = max(0, now - after)
        self.trims, self.released, self.base = self.trims + 1, self.released + freed, after
        return freed

    def stats(self) -> dict:
        return {"trims": self.trims, "released_bytes": self.released, "trim_s": round(self.seconds, 6),
                "enabled": self._trim is not None}
