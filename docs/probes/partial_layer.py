"""Where a partially resident layer's time goes, in one process (no IPC): the runtime's Compute with
the router and loader wired in-process (tools/inprocess.py), greedy decode, alternating variants.

  python docs/probes/partial_layer.py STORE SLOTS [TOKENS] [ROUNDS] [VARIANTS]

Variants (comma-separated, default all): `resident` every expert resident (no read-back); `sync`
every expert resident but each MoE layer's routing read back (force_sync: the cost of the syncs
alone); `partial` SLOTS slots, the runtime's defaults; `partial-nopf` the same without prefetch (no
gate lookahead, hints or leases); `partial-lf` launch first (`bench.launch_first`); `partial-d8`
launch first, 8 layers unchecked; `partial-dev` streaming pools in device memory
(`bench.device_pools`); `partial-layer` each layer run ahead launched as built and checked at the
next (`bench.ahead_launch = "layer"`; `partial` launches and checks them once per pass, the
default); `partial-gpu` the GPU's pass structure on any backend (run ahead, early fills);
`resident-launch1` every expert resident with each MoE layer launched as built, `resident-launch2`
with one launch mid-pass (the same kernels in more launches: what a launch costs the host). Each
variant runs once per round, in turn, after one warm-up generation; prints ms per decode token per
round and the median, the tokens' agreement with the first variant's, and with PROFILE=NAME the top
of a cProfile of variant NAME's last run. With TIMING=1 the host's time inside MLX's evaluations is
split per decode token: `async_eval` (building and launching kernels), `eval` (launch and wait) and
the routing's read-backs (`_host`: the wait for the device), beside the rest of the host's time.
With NODES=1 (instead: it slows the host) each variant's graphs launched per decode token are
counted by primitive (`mx.export_to_dot` of what each `async_eval` and `eval` launches: on a GPU the
fused kernels show as one node each).
"""
from __future__ import annotations

import cProfile
import dataclasses
import io
import os
import pstats
import statistics
import sys
import time

from deltafin.protocol import messages as M
from deltafin.runtime.config import load_config
from deltafin.runtime.store import Store
from deltafin.tools.inprocess import local_router
from deltafin.workers.engine import Compute

PROMPT = [1, 504, 3458, 314, 260, 6123, 4876, 47, 198]


class Timing:
    """Wall time spent inside mx.async_eval, mx.eval and the routing's read-backs (patched in)."""

    def __init__(self):
        import mlx.core as mx
        from deltafin.workers.passes import ExpertProvider
        self.t = {"async_eval": 0.0, "eval": 0.0, "read_back": 0.0}
        self.n = dict.fromkeys(self.t, 0)
        for name in ("async_eval", "eval"):
            setattr(mx, name, self._wrap(name, getattr(mx, name)))
        ExpertProvider._host = self._wrap("read_back", ExpertProvider._host)

    def _wrap(self, key, fn):
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.t[key] += time.perf_counter() - t0
                self.n[key] += 1
        return timed

    def count_nodes(self) -> None:
        """Counts the primitives of the graphs each async_eval and eval launches (export_to_dot)."""
        import io
        import re
        import mlx.core as mx
        self.nodes: dict = {}

        def counting(launch):
            def counted(*arrays, **kw):
                flat = [a for a in arrays if isinstance(a, mx.array)]
                flat += [a for x in arrays if isinstance(x, (list, tuple)) for a in x if isinstance(a, mx.array)]
                dot = io.StringIO()
                if flat:
                    mx.export_to_dot(dot, *flat)
                for label in re.findall(r'label ="(\w+)", shape=rectangle', dot.getvalue()):
                    self.nodes[label] = self.nodes.get(label, 0) + 1
                return launch(*arrays, **kw)
            return counted
        mx.async_eval, mx.eval = counting(mx.async_eval), counting(mx.eval)

    def take_nodes(self) -> dict:
        nodes, self.nodes = self.nodes, {}
        return nodes

    def take(self) -> tuple[dict, dict]:
        t, n = dict(self.t), dict(self.n)
        self.t, self.n = dict.fromkeys(t, 0.0), dict.fromkeys(n, 0)
        return t, n


def make(store: Store, slots: int, prefetch: str, force_sync: bool, bench: dict | None = None) -> Compute:
    c = load_config(None)
    c = dataclasses.replace(c, cache=dataclasses.replace(c.cache, max_slots=slots, prefetch=prefetch))
    if bench:
        c = dataclasses.replace(c, bench=dataclasses.replace(c.bench, **bench))
    src, staging, _ = local_router(store, c)
    comp = Compute(store, c, src, staging, store.max_record_bytes)
    if slots >= len(store.records) and c.cache.preload:
        comp.preload()
    comp.experts.force_sync = force_sync
    return comp


def launch_after(comp: Compute, store: Store, name: str) -> None:
    """`resident-launch1`: every expert resident, each MoE layer's output launched (mx.async_eval)
    as soon as it is built; `resident-launch2`: only the middle layer's. The same kernels as
    `resident`, in more launches: what a launch of its own costs the host on this backend."""
    import mlx.core as mx
    moe = list(store.moe_layers)
    at = set(moe) if name == "resident-launch1" else {moe[len(moe) // 2 - 1]}
    plain = comp.experts._all_resident

    def launched(layer, x, inds, ids):
        y = plain(layer, x, inds, ids)
        if layer in at:
            mx.async_eval(y)
        return y
    comp.experts._all_resident = launched


def generate(comp: Compute, n: int, prompt=PROMPT):
    t0 = time.perf_counter()
    done = comp.generate(M.Generate(id=1, token_ids=list(prompt), max_tokens=n, stream=False))
    return done, time.perf_counter() - t0


def watch_moe(store: Store, tokens: int, watch) -> None:
    """Greedy decode of `tokens` in one process, every expert resident, with watch(moe, x) called
    at each MoE layer (its SparseMoE and input) before the layer runs (next_token.py, cross_gate.py)."""
    from deltafin.runtime.models import decoder as D
    plain = D.SparseMoE.__call__

    def watched(self, x, experts):
        watch(self, x)
        return plain(self, x, experts)
    D.SparseMoE.__call__ = watched
    try:
        generate(make(store, len(store.records), "auto", False), tokens)
    finally:
        D.SparseMoE.__call__ = plain


def main() -> None:
    store = Store(sys.argv[1])
    slots = int(sys.argv[2])
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 64
    rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 3
    names = (sys.argv[5] if len(sys.argv) > 5 else "resident,sync,partial,partial-nopf").split(",")
    all_slots = len(store.records)
    specs = {"resident": (all_slots, "auto", False), "sync": (all_slots, "auto", True),
             "partial": (slots, "auto", False), "partial-nopf": (slots, "off", False),
             "partial-lf": (slots, "auto", False, {"launch_first": True}),
             "partial-d8": (slots, "auto", False, {"launch_first": True, "ahead_depth": 8}),
             "partial-dev": (slots, "auto", False, {"device_pools": True}),
             "partial-layer": (slots, "auto", False, {"ahead_launch": "layer"}),
             "partial-gpu": (slots, "auto", False, {"run_ahead": True, "early_fills": True}),
             "resident-launch1": (all_slots, "auto", False), "resident-launch2": (all_slots, "auto", False)}
    timing = Timing() if os.environ.get("TIMING") or os.environ.get("NODES") else None
    if os.environ.get("NODES"):
        timing.count_nodes()
    comps = {name: make(store, *specs[name]) for name in names}
    for name, comp in comps.items():
        if name.startswith("resident-launch"):
            launch_after(comp, store, name)
    for comp in comps.values():
        generate(comp, 4)  # warm-up: kernels, buffers
    if timing:
        timing.take()
        if os.environ.get("NODES"):
            timing.take_nodes()
    ms = {name: [] for name in names}
    tokens, prof = {}, None
    for r in range(rounds):
        for name, comp in comps.items():
            profiled = os.environ.get("PROFILE") == name and r == rounds - 1
            if profiled:
                prof = cProfile.Profile()
                prof.enable()
            done, wall = generate(comp, n)
            if timing:
                t, calls = timing.take()
                print(f"  {name} host ms per token (the whole request / {n}): total {wall * 1e3 / n:.2f}, "
                      + ", ".join(f"{k} {v * 1e3 / n:.2f} ({calls[k] / n:.1f} calls)" for k, v in t.items())
                      + f", rest {(wall - sum(t.values())) * 1e3 / n:.2f}", flush=True)
            if os.environ.get("NODES"):
                nodes = timing.take_nodes()
                top = sorted(nodes.items(), key=lambda kv: -kv[1])[:25]
                print(f"  {name} nodes per token {sum(nodes.values()) / n:.1f}: "
                      + ", ".join(f"{k} {v / n:.1f}" for k, v in top), flush=True)
            if profiled:
                prof.disable()
            st = done.stats
            per = 1e3 / st["decode_tok_s"] if st.get("decode_tok_s") else float("nan")
            ms[name].append(per)
            tokens.setdefault(name, done.token_ids)
            if done.token_ids != tokens[name]:
                print(f"  {name}: round {r} tokens differ from its first round")
            print(f"round {r} {name:13s} {per:7.2f} ms/token  split {dict((k, round(v, 4)) for k, v in st.items() if k.endswith('_s') and isinstance(v, float))}", flush=True)
    first = tokens[names[0]]
    for name in names:
        same = next((i for i, (a, b) in enumerate(zip(first, tokens[name])) if a != b), None)
        print(f"{name:13s} median {statistics.median(ms[name]):7.2f} ms/token  "
              f"tokens {'= ' + names[0] if same is None else f'leave {names[0]} at {same}'}")
    if prof is not None:
        out = io.StringIO()
        stats = pstats.Stats(prof, stream=out)
        stats.sort_stats("tottime").print_stats(35)
        stats.sort_stats("cumulative").print_stats(60)
        print(out.getvalue())


if __name__ == "__main__":
    main()
