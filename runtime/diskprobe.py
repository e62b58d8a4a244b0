"""Direct-read bandwidth of a store's disk, measured the way the loader reads.

The loader keeps `loader.threads` direct reads in flight (preadv releases the GIL), each one a
whole record at a 16 KiB-aligned offset. The probe does the same for a fixed time: queue_depth
threads read random records (or random aligned ranges of a given size) spread over the store's
expert files, and report bandwidth, reads per second and per-read latency. The benchmark's
`bound` metric divides miss bytes by this bandwidth.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from deltafin.runtime.cli import Help
from deltafin.runtime.directio import DirectFile, aligned_buffer, round_up
from deltafin.runtime.store import ALIGN, Store, StoreError


def drop_page_cache() -> str | None:
    """Empties the OS page cache so buffered reads hit the disk. None on success, else why not."""
    if sys.platform.startswith("linux"):
        if os.geteuid() != 0:
            return "not root (writing /proc/sys/vm/drop_caches needs root)"
        os.sync()  # dirty pages cannot be dropped
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
        except OSError as e:
            return f"/proc/sys/vm/drop_caches: {e.strerror or e}"
        return None
    if sys.platform == "darwin":
        try:
            r = subprocess.run(["purge"], capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"purge: {e}"
        return None if r.returncode == 0 else f"purge exited {r.returncode}: {r.stderr.strip() or 'needs root'}"
    return f"no page-cache drop on {sys.platform}"


class ReadSampler:
    """Draws (file, offset, nbytes) for one read. At the store's own record size (record_bytes None,
    or the size every record is read with): a random record. At another size: a random
    ALIGN-aligned range in a file drawn in proportion to its length, so other sizes can be measured
    on the same files; files too small for one read are left out."""

    def __init__(self, store: Store, record_bytes: int | None):
        sizes = {r.read_nbytes for r in store.records.values()}
        want = None if record_bytes is None else round_up(int(record_bytes), ALIGN)
        self.fixed = None if want is None or sizes == {want} else want
        if self.fixed is None:
            self.records = [(r.file, r.offset, r.read_nbytes) for r in store.records.values()]
            self.files = sorted({r[0] for r in self.records})
            self.max_bytes = max(sizes)
            return
        spans = [(f, (store.path / f).stat().st_size) for f in sorted({r.file for r in store.records.values()})]
        spans = [(f, (n - self.fixed) // ALIGN + 1) for f, n in spans if n >= self.fixed]
        if not spans:
            raise StoreError(f"{store.path}: no expert file holds a {self.fixed}-byte read")
        self.files = [f for f, _ in spans]
        self.cum_starts = np.cumsum([k for _, k in spans])
        self.max_bytes = self.fixed

    def draw(self, rng: random.Random) -> tuple[str, int, int]:
        if self.fixed is None:
            return self.records[rng.randrange(len(self.records))]
        k = rng.randrange(int(self.cum_starts[-1]))
        i = int(np.searchsorted(self.cum_starts, k, side="right"))
        first = int(self.cum_starts[i - 1]) if i else 0
        return self.files[i], (k - first) * ALIGN, self.fixed


def probe_disk(path_or_store, record_bytes: int | None = None, queue_depth: int = 4,
               seconds: float = 3.0, drop_cache: bool = True, seed: int = 0) -> dict:
    """Reads for `seconds` with `queue_depth` concurrent direct reads; returns the figures.

    record_bytes None (or the store's record read size): whole random records of the store."""
    store = path_or_store if isinstance(path_or_store, Store) else Store(path_or_store)
    if queue_depth < 1 or seconds <= 0:
        raise ValueError("queue_depth >= 1 and seconds > 0 required")
    sampler = ReadSampler(store, record_bytes)
    # O_DIRECT skips the cache anyway; dropping it matters where reads fall back to buffered ones
    why_not = drop_page_cache() if drop_cache else "not asked (drop_cache=False)"
    files = {name: DirectFile(store.path / name) for name in sampler.files}
    try:
        elapsed, latencies, nbytes = timed_reads(files, sampler.draw, sampler.max_bytes, queue_depth, seconds, seed)
    finally:
        for f in files.values():
            f.close()
    lat = np.array([x for per in latencies for x in per]) if any(latencies) else np.zeros(1)
    total, reads = sum(nbytes), sum(len(per) for per in latencies)
    return {
        "path": str(store.path),
        "record_bytes": sampler.fixed or (int(round(total / reads)) if reads else 0),
        "record_source": "fixed size, random aligned offsets" if sampler.fixed else "random store records",
        "queue_depth": queue_depth,
        "seconds": elapsed,
        "reads": reads,
        "bytes": total,
        "gbps": total / elapsed / 1e9,
        "reads_s": reads / elapsed,
        "latency_p50_ms": float(np.percentile(lat, 50) * 1e3),
        "latency_p99_ms": float(np.percentile(lat, 99) * 1e3),
        "direct_io": all(f.direct for f in files.values()),
        "page_cache_dropped": why_not is None,
        "page_cache": "dropped" if why_not is None else f"not dropped: {why_not}",
        "files": len(files),
        "span_bytes": sum((store.path / name).stat().st_size for name in files),
    }


def timed_reads(files: dict, draw, max_bytes: int, queue_depth: int, seconds: float,
                seed: int = 0) -> tuple[float, list, list]:
    """queue_depth threads each read draw(rng) = (file name, offset, bytes) from `files` (open
    DirectFiles) until `seconds` have passed; (elapsed, latencies per thread, bytes per thread)."""
    latencies: list[list[float]] = [[] for _ in range(queue_depth)]
    nbytes = [0] * queue_depth
    errors: list[str] = []
    start = threading.Barrier(queue_depth + 1)
    deadline = [0.0]

    def reader(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        buf = aligned_buffer(max_bytes)
        view = memoryview(buf)
        try:
            start.wait(timeout=30)
            while time.perf_counter() < deadline[0]:
                name, offset, n = draw(rng)
                t0 = time.perf_counter()
                got = files[name].read_into(view[:n], offset, n)
                latencies[i].append(time.perf_counter() - t0)
                nbytes[i] += got
        except (OSError, threading.BrokenBarrierError) as e:
            errors.append(f"reader {i}: {e}")
        finally:
            view.release()
            buf.close()

    threads = [threading.Thread(target=reader, args=(i,), daemon=True) for i in range(queue_depth)]
    for t in threads:
        t.start()
    t_start = time.perf_counter()
    deadline[0] = t_start + seconds
    start.wait(timeout=30)
    for t in threads:
        t.join(timeout=seconds + 60)  # a read stuck for a minute is a broken disk, not a figure
    elapsed = time.perf_counter() - t_start
    if errors or any(t.is_alive() for t in threads):
        raise OSError("disk probe failed: " + ("; ".join(errors) or "a read did not return within a minute"))
    return elapsed, latencies, nbytes


def probe_scratch(directory, record_bytes: int, queue_depths=(1, 4), seconds: float = 0.5,
                  file_bytes: int = 128 << 20) -> dict:
    """Direct-read bandwidth of the disk holding `directory`, without a store: a scratch file of
    file_bytes (at least 4 records; random bytes, synced, deleted after) read in random aligned
    ranges of record_bytes at each queue depth. {"gbps_by_queue_depth", "direct_io", "path", ...}."""
    import tempfile
    size = round_up(max(file_bytes, 4 * int(record_bytes)), ALIGN)
    n = round_up(int(record_bytes), ALIGN)
    out = {"path": str(directory), "record_bytes": n, "file_bytes": size, "seconds_each": seconds}
    with tempfile.TemporaryDirectory(dir=directory, prefix=".deltafin-probe-") as td:
        path = Path(td) / "scratch.bin"
        chunk = os.urandom(1 << 20)
        with open(path, "wb") as f:
            for _ in range(size >> 20):
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        files = {"scratch": DirectFile(path)}
        draw = lambda rng: ("scratch", rng.randrange((size - n) // ALIGN + 1) * ALIGN, n)
        try:
            gbps = {}
            for q in queue_depths:
                elapsed, _, nbytes = timed_reads(files, draw, n, q, seconds)
                gbps[q] = sum(nbytes) / elapsed / 1e9
        finally:
            out["direct_io"] = files["scratch"].direct
            files["scratch"].close()
    return {**out, "gbps_by_queue_depth": gbps}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(formatter_class=Help, prog="python -m deltafin.runtime.diskprobe",
                                description="Direct-read bandwidth of a store's expert files.")
    p.add_argument("store")
    p.add_argument("--queue-depth", default="1,4,8", help="comma-separated list (default 1,4,8)")
    p.add_argument("--record-bytes", default="store",
                   help="comma-separated sizes in bytes, 'store' = the store's records (default)")
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--no-drop-cache", action="store_true")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    a = p.parse_args(argv)
    sizes = [None if s == "store" else int(s) for s in a.record_bytes.split(",")]
    store = Store(a.store)
    for size in sizes:
        for qd in (int(q) for q in a.queue_depth.split(",")):
            r = probe_disk(store, size, qd, a.seconds, drop_cache=not a.no_drop_cache)
            if a.json:
                print(json.dumps(r), flush=True)
            else:
                print(f"record {r['record_bytes'] / 2**20:7.2f} MiB  qd {qd:2d}  {r['gbps']:6.2f} GB/s  "
                      f"{r['reads_s']:8.1f} reads/s  p50 {r['latency_p50_ms']:7.2f} ms  "
                      f"p99 {r['latency_p99_ms']:7.2f} ms  direct={r['direct_io']}  {r['page_cache']}",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
