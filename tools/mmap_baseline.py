"""The memory-mapped baseline (the benchmark's "what llama.cpp mainline does" contender): one greedy
generation in this process with the store's expert files mmapped, read through the OS page cache,
no cache of deltafin's own and no workers. The same prepare code and kernels as the runtime.

    python -m deltafin.tools.mmap_baseline STORE --prompt-ids 1,2,3 --max-tokens 32 \\
        [--config-json '{"bench": {"routing_trace": "t.npz"}}'] [--cold] [--json OUT.json]
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import sys
import time

import mlx.core as mx
import numpy as np

from deltafin.protocol import messages as M
from deltafin.runtime.benchmode import Routing
from deltafin.runtime.cli import Help
from deltafin.runtime.config import Config, ConfigError, as_config, load_config
from deltafin.runtime.metrics import Counter
from deltafin.runtime.models.switch import in_token_order, run_pairs
from deltafin.runtime.store import Store, StoreError, views_from_buffer
from deltafin.tools.inprocess import local_router
from deltafin.workers.engine import Compute, disk_read_bytes
from deltafin.workers.passes import ExpertProvider


class MmapSource:
    """The memory-mapped baseline's expert source (what llama.cpp mainline does): the store's layer
    files mapped read-only, no cache of our own, so every use is a "hit" with no wait and a page
    fault reads from disk through the OS page cache. No router, loader or shared memory."""

    def __init__(self, store: Store):
        self.store, self.maps, self.files = store, {}, {}
        self.messages = Counter()

    def view(self, layer: int, expert: int):
        rec = self.store.record(layer, expert)
        m = self.maps.get(rec.file)
        if m is None:
            self.files[rec.file] = f = open(self.store.path / rec.file, "rb")
            m = self.maps[rec.file] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return memoryview(m)[rec.offset:rec.offset + rec.nbytes]

    def used(self, uses: list, ahead: bool = False) -> None:
        pass

    def hint(self, hints: list) -> None:
        pass

    def release(self) -> None:
        pass

    def close(self) -> None:
        for m in self.maps.values():
            try:
                m.close()
            except BufferError:  # a view is still alive somewhere; the mapping goes with it
                pass
        for f in self.files.values():
            f.close()


class MmapExperts(ExpertProvider):
    """The mmap baseline's provider: no cache of its own, so every use copies the chosen experts
    out of the page cache and stacks them (a per-use prepare stage the runtime does not have),
    at most top_k experts at a time, then runs the same gather_qmm kernels."""

    expert_source = "mmap"

    def __init__(self, store: Store, pool_buf, slot_bytes: int, source: MmapSource, dtype,
                 routing: Routing | None = None, max_chunk: int | None = None):
        super().__init__(store, source, dtype, routing)
        self.max_chunk = max_chunk or store.top_k

    def weights(self, layer: int, expert: int) -> dict:
        layout = self.store.layout(layer, expert)
        views = views_from_buffer(self.source.view(layer, expert), layout)
        self.counters.add("bytes", layout["nbytes"])
        out = {}
        for t in layout["tensors"]:
            a = mx.array(views[t["name"]])  # copies out of the page cache
            if t["dtype"] == "bfloat16":
                a = a.view(mx.bfloat16)
            if mx.issubdtype(a.dtype, mx.floating) and a.dtype != self.dtype:
                a = a.astype(self.dtype)
            out[t["name"]] = a
        return out

    def chunks(self, layer: int, experts: list[int]):
        """Per chunk of at most top_k experts: their bytes copied into MLX arrays stacked [C, ...]
        (the prepare stage); yields (expert ids in stack order, weights)."""
        for i in range(0, len(experts), self.max_chunk):
            chunk = experts[i:i + self.max_chunk]
            self.counters.add("uses", len(chunk))
            self.counters.add("hits", len(chunk))
            tp = time.perf_counter()
            per = [self.weights(layer, e) for e in chunk]
            w = {name: mx.stack([p[name] for p in per]) for name in per[0]}
            mx.eval(w)
            dt = time.perf_counter() - tp
            for _ in per:
                self.prepare.add(dt / len(per))
            self.t_prepare += dt
            yield chunk, w

    def fetch(self, layer: int) -> None:
        ids = self.routing.choose(layer, None)
        for _ in self.chunks(layer, np.unique(ids).tolist()):
            pass
        self._note(layer, ids, report=False, count=False)

    def __call__(self, layer: int, x, inds):
        lead, k, d = inds.shape[:-1], inds.shape[-1], x.shape[-1]
        x2 = x.reshape(-1, d)
        flat = self._host(self.routing.choose(layer, inds)).reshape(-1)
        self._note(layer, flat, report=False, count=False)
        quant = self.store.layout(layer)["quant"]
        pieces, order = [], []
        for stacked, w in self.chunks(layer, np.unique(flat).tolist()):
            local = np.full(int(flat.max()) + 1, -1, dtype=np.int64)
            local[stacked] = np.arange(len(stacked))
            pairs = np.nonzero(local[flat] >= 0)[0]
            pairs = pairs[np.argsort(local[flat[pairs]], kind="stable")]  # grouped by expert
            pieces.append(run_pairs(x2, k, pairs, local[flat[pairs]], w, quant, flat.size))
            order.append(pairs)
        return in_token_order(pieces, order, lead, k, d)


def evict_page_cache(store: Store) -> bool:
    """Asks the kernel to drop the store's expert files from the page cache (clean pages need no
    privileges), so an mmap run starts cold. False where posix_fadvise does not exist (macOS)."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for name in sorted({r.file for r in store.records.values()}):
        fd = os.open(store.path / name, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def run_inprocess(store_path, config: Config | dict, prompt_ids: list[int], max_tokens: int,
                  source: str = "mmap", cold: bool = False) -> dict:
    """One greedy generation by `Compute` in this process, no supervisor or workers. source:
    "mmap" (the memory-mapped baseline: experts read through the page cache, no cache of our own)
    or "slots" (router + loader wired in-process, cache.max_slots resident slots, 0 = every
    expert). config: a Config or its dict tree; [bench] is honoured.
    cold: drop the expert files from the page cache first. Returns the request's stats (as
    Done.stats) plus stage latencies, bytes touched and bytes the process read from disk."""
    store = Store(store_path)
    loader = None
    if source == "mmap":
        src = MmapSource(store)
        compute = Compute(store, config, src, None, 0, experts_cls=MmapExperts)
    elif source == "slots":
        src, staging, loader = local_router(store, config)
        compute = Compute(store, config, src, staging, store.max_record_bytes)
    else:
        raise ValueError(f"source {source!r}: use mmap or slots")
    if source == "slots" and as_config(config).cache.preload:
        compute.preload()
    try:
        page_cache_dropped = evict_page_cache(store) if cold else False
        disk0 = disk_read_bytes()
        done = compute.generate(M.Generate(id=1, token_ids=list(prompt_ids), max_tokens=max_tokens,
                                           stream=False))
        disk1 = disk_read_bytes()
        e = compute.experts
        tokens = done.stats["prompt_tokens"] + done.stats["generated_tokens"]
        return {**done.stats, "token_ids": done.token_ids,
                "stage_latency": {"read": loader.read_latency.summary() if loader else None,
                                  "prepare": e.prepare.summary(),
                                  "compute": compute.forward_latency.summary()},
                "expert_uses": int(e.counters.get("uses")),
                "bytes_touched": int(e.counters.get("bytes")),
                "bytes_touched_per_token": e.counters.get("bytes") / max(1, tokens),
                "disk_read_bytes": None if disk0 is None else disk1 - disk0,
                "page_cache_dropped": page_cache_dropped,
                "messages": src.messages.snapshot()}
    finally:
        if loader is not None:
            loader.close()
        if source == "mmap":
            src.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(formatter_class=Help, prog="deltafin-mmap-baseline", description=__doc__.split("\n\n")[0])
    p.add_argument("store", nargs="?", help="expert store directory")
    p.add_argument("--store", dest="store_opt", metavar="STORE", help="the same, as an option")
    p.add_argument("--prompt-ids", required=True, help="comma-separated token ids")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--config-json", default="{}",
                   help='overrides of the config tree as JSON, e.g. {"compute": {"dtype": "float32"}}')
    p.add_argument("--source", choices=("mmap", "slots"), default="mmap",
                   help="mmap: the baseline; slots: router + loader in-process, for comparison")
    p.add_argument("--cold", action="store_true", help="drop the expert files from the page cache first")
    p.add_argument("--json", metavar="OUT", help="write the stats here (default: stdout)")
    a = p.parse_args(argv)
    store = a.store or a.store_opt
    if not store:
        p.error("give the store directory")
    try:
        overrides = json.loads(a.config_json)
        if not isinstance(overrides, dict) or not all(isinstance(v, dict) for v in overrides.values()):
            raise ConfigError('--config-json must be {"section": {"key": value}, ...}')
        flat = {f"{section}.{key}": v for section, kv in overrides.items() for key, v in kv.items()}
        config = load_config(None, flat).to_dict()
        prompt = [int(t) for t in a.prompt_ids.split(",") if t.strip()]
        stats = run_inprocess(store, config, prompt, a.max_tokens, source=a.source, cold=a.cold)
    except (ConfigError, StoreError, ValueError) as e:  # ValueError: bad JSON, ids or prompt
        print(f"deltafin-mmap-baseline: error: {e}", file=sys.stderr)
        return 2
    text = json.dumps(stats, indent=1)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
