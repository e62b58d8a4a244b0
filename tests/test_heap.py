"""runtime/heap.py: the C heap's free pages given back once the process grew (a first run's
kernel compilation, docs/BENCHMARKS.md stop 67)."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from deltafin.runtime.heap import HeapTrim, _libc_trim, resident_bytes


def test_trims_only_past_the_threshold_and_counts_what_it_gave_back():
    rss = [100 << 20]
    calls = []

    def trim(pad):
        calls.append(pad)
        rss[0] -= 30 << 20  # what glibc gave back
        return 1

    h = HeapTrim(threshold=64 << 20, trim=trim, rss=lambda: rss[0])
    rss[0] += 63 << 20
    assert h.maybe() == 0 and calls == []           # under the threshold: not even a call
    rss[0] += 2 << 20
    assert h.maybe() == 30 << 20 and calls == [0]   # grown by 65 MiB: trimmed
    assert h.base == rss[0]                          # measured again from where the trim left it
    assert h.maybe() == 0 and calls == [0]
    assert h.stats()["trims"] == 1 and h.stats()["released_bytes"] == 30 << 20


def test_without_malloc_trim_or_procfs_it_does_nothing():
    assert HeapTrim(trim=None, rss=lambda: None).maybe() == 0
    h = HeapTrim(rss=lambda: None)
    assert h.maybe() == 0 and h.trims == 0


@pytest.mark.skipif(_libc_trim() is None or resident_bytes() is None, reason="glibc and /proc only")
def test_a_freed_burst_of_heap_comes_back_to_the_system():
    """In a fresh process: 256 MiB in 64 KiB blocks (on the heap, under glibc's mmap threshold),
    written, then freed except the last (the heap's top stays pinned, so free() alone cannot
    shrink it). The resident set stays high until HeapTrim asks glibc to give the pages back."""
    code = textwrap.dedent("""
        import ctypes
        from deltafin.runtime.heap import HeapTrim, resident_bytes
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc.restype = ctypes.c_void_p
        libc.malloc.argtypes = [ctypes.c_size_t]
        libc.free.argtypes = [ctypes.c_void_p]
        h = HeapTrim(threshold=64 << 20)
        blocks = [libc.malloc(64 << 10) for _ in range(4096)]
        for b in blocks:
            ctypes.memset(b, 1, 64 << 10)
        grown = resident_bytes()
        for b in blocks[:-1]:
            libc.free(b)
        held = resident_bytes()
        released = h.maybe()
        print(grown, held, resident_bytes(), released, h.trims)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    grown, held, after, released, trims = map(int, out.stdout.split())
    assert held > grown - (32 << 20), "free() alone gave the heap back: the test shows nothing"
    assert trims == 1
    assert released > 200 << 20 and after < held - (200 << 20)


@pytest.mark.skipif(_libc_trim() is None or resident_bytes() is None, reason="glibc and /proc only")
def test_compute_reports_its_heap_trims(tiny_stores):
    """The compute process keeps a HeapTrim from its start (a first run's kernels are compiled in
    its warm-up and first request) and reports it in its stats."""
    from deltafin.client import Client
    from deltafin.tools.run import running_supervisor
    with running_supervisor(tiny_stores("qwen3_moe"), "4GiB") as (ep, _):
        with Client(ep, timeout=60) as c:
            c.generate("hello", max_tokens=4)
            heap = c.stats()["workers"]["compute"]["heap"]
    assert heap["enabled"] is True
    assert heap["trims"] >= 0 and heap["released_bytes"] >= 0 and heap["trim_s"] >= 0
