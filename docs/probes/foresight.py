"""Issue 28, stop 49: what a 25% token's misses are, in one process with the GPU's pipeline (on the
CPU too: `engine.on_gpu` is forced where no GPU is), greedy decode from partial_layer.py's prompt.

  python docs/probes/foresight.py STORE SLOTS [TOKENS]     # FORESIGHT=0: bench.foresight off

Prints, per decode token: the needs that waited for a read and the experts they waited for (by
layer, the prompt's pass left out); the pipeline's run-ahead counters; how well the layers a
run-ahead miss forgets named the experts they used when computed again (all of them, and the
missing ones: what `bench.foresight` relies on); and the decode routing replayed through the
router at the same slots from a cold cache (tools/replay.py) under LRU, predictive and Belady (the
offline optimum): how far the runtime's misses are from what any policy could do.

Stop 49 (this CPU, 2026-12-05), FORESIGHT=0: hidden-128 store of issue 28's shape at 64 of 256
slots, 128 tokens: 0.66 waits per decode token, forgotten layers' precision 0.964 (45 of the 53
missing ones), replay LRU 1.039 / predictive 1.086 / Belady 0.828 missing experts per token;
issue 28's store (hidden 1024), 64 tokens: 1.14 waits, precision 0.961 (17 of 21), replay 1.72 /
1.70 / 1.47 (cold; the runtime's cache is warm from the prompt). With foresight (hidden 128):
run-ahead misses 52 -> 35, layers forgotten 186 -> 126."""
from __future__ import annotations

import collections
import dataclasses
import os
import sys

import numpy as np

import deltafin.workers.engine as engine

engine.on_gpu = lambda: True  # the GPU's pipeline: run ahead, whole passes, early fills
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import partial_layer as pl  # noqa: E402

from deltafin.runtime.config import load_config  # noqa: E402
from deltafin.runtime.store import Store  # noqa: E402
from deltafin.tools.replay import replay  # noqa: E402
from deltafin.workers import router as R  # noqa: E402
from deltafin.workers import slot_experts as S  # noqa: E402


def main() -> None:
    store = Store(sys.argv[1])
    slots, n = int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 64
    where = {"pass": 0, "last": -1}
    used = collections.defaultdict(set)   # (pass, layer) -> experts used
    waits = []                            # (pass, layer, experts waited for)
    foretold = []                         # (pass, layer, experts chosen, missing ones)

    observe = R.Router._history

    def history(self, layer, experts):
        if layer < where["last"]:
            where["pass"] += 1
        where["last"] = layer
        used[(where["pass"], layer)].update(experts)
        return observe(self, layer, experts)
    R.Router._history = history

    need = R.Router.need

    def needed(self, req, layer, experts, prefetch=False, lease=False, sure=False):
        out = need(self, req, layer, experts, prefetch, lease, sure)
        if not (lease or prefetch) and self.pending and self.pending["waiting"]:
            waits.append((where["pass"], layer, len(self.pending["waiting"])))
        return out
    R.Router.need = needed

    check = S.SlotExperts._check_ahead

    def checked(self, rec):
        rest = list(self._ahead)
        try:
            return check(self, rec)
        except S.RunAheadMiss:
            p = where["pass"] + (1 if rec["layer"] < where["last"] else 0)
            for r in rest:
                if isinstance(r["ids"], np.ndarray):
                    chose = {int(e) for e in r["ids"].reshape(-1)}
                    foretold.append((p, r["layer"], chose, {e for e in chose if r["where"][e] < 0}))
            raise
    S.SlotExperts._check_ahead = checked

    foresight = os.environ.get("FORESIGHT", "1") != "0"

    def config(*a, **k):
        c = load_config(*a, **k)
        return dataclasses.replace(c, bench=dataclasses.replace(c.bench, foresight=foresight))
    pl.load_config = config
    comp = pl.make(store, slots, "auto", False)
    done, wall = pl.generate(comp, n)
    decode = [w for w in waits if w[0] >= 1]  # pass 0: the prompt
    print(f"{n} tokens, {wall * 1e3 / n:.1f} ms per token here; foresight {foresight}")
    print(f"waits per decode token {len(decode) / (n - 1):.3f}, experts waited for "
          f"{sum(w[2] for w in decode) / (n - 1):.3f}; by layer "
          f"{dict(sorted(collections.Counter(w[1] for w in decode).items()))}")
    per_pass = collections.Counter(w[0] for w in decode)
    print(f"passes by waits: {dict(sorted(collections.Counter(per_pass.values()).items()))}")
    print("pipeline", {k: v for k, v in comp.stats()["pipeline"].items() if k != "resolved"})
    hit = tot = mhit = mtot = 0
    for p, layer, chose, missing in foretold:
        real = used.get((p, layer), set())
        hit, tot = hit + len(chose & real), tot + len(chose)
        mhit, mtot = mhit + len(missing & real), mtot + len(missing)
    if tot:
        print(f"forgotten layers: {len(foretold)} rows, {hit / tot:.3f} of their experts used when "
              f"computed again, {mhit}/{mtot} of the missing ones")
    k = store.top_k
    rows = [[sorted(used[(p, layer)]) for layer in store.moe_layers]
            for p in range(1, where["pass"] + 1)]
    rows = [r for r in rows if all(len(x) == k for x in r)]
    ids = np.array(rows, dtype=np.uint16)
    for policy in ("lru", "predictive", "belady"):
        r = replay(ids, slots, policy, n_experts=store.n_experts)
        print(f"replay {policy:10s} {(r['uses'] - r['hits']) / r['tokens']:.3f} missing experts per token "
              f"({r['tokens']} tokens, cold)")


if __name__ == "__main__":
    main()
