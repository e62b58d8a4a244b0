"""Issue 28, stop 57: could the misses that nothing read ahead be foreseen from the token before, or
avoided by another replacement policy? Greedy decode in one process with every expert resident
(partial_layer.py's prompt), each MoE layer's full gate scores kept per decode token; then, offline:

  python docs/probes/next_token.py STORE SLOTS [TOKENS]

1. the experts a token uses at a layer that the token before did not ("new"), and how many of them
   were among that token's gate ranks k+1..k+m (what a lease of its runners-up would have read);
2. a global LRU of SLOTS slots over the decode routing, without and with such leases after each
   token (m = 1, 2; a leased key evicts the oldest key the token did not use), demand misses and
   reads per token;
3. the same routing under LRU, LFU over the last W tokens (ties by recency) and Belady.

Stop 57 (this CPU, issue 28's store, hidden 1024, 64 slots, 64 tokens): 6.95 new experts per
token, 29% of them the runner-up (rank 5), 45% ranks 5-6, 65% ranks 5-8; LRU 1.21 misses per
token (1.69 reads), with rank-5 leases 1.08 (3.12 reads), ranks 5-6 1.38 (6.20): a lease of the
runners-up nearly doubles the reads for a tenth fewer misses. Misses over the 64 tokens: LRU 210,
LFU over 2 / 4 / 8 / 16 / 32 tokens 210 / 210 / 212 / 246 / 301, Belady 151. So on this
random-weight checkpoint recency is all a policy has to go on; the gap to Belady is foresight,
and the token before does not give it.
"""
from __future__ import annotations

import os
import sys
from collections import OrderedDict

import mlx.core as mx
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import partial_layer as pl  # noqa: E402

from deltafin.runtime.store import Store  # noqa: E402


def gate_scores(store: Store, tokens: int) -> np.ndarray:
    """[decode tokens, moe layers, experts]: the gate's scores of each decode token's row."""
    seen = []

    def keep(moe, x):
        logits = moe.gate(x)
        seen.append(np.array(logits.astype(mx.float32)).reshape(-1, logits.shape[-1])[-1])
    pl.watch_moe(store, tokens, keep)
    n = len(store.moe_layers)
    return np.stack(seen).reshape(-1, n, seen[0].shape[-1])[1:]  # the prompt's pass left out


def lru_with_leases(order: np.ndarray, k: int, slots: int, m: int) -> tuple[float, float]:
    """Demand misses per token after the first, reads per token."""
    T, L, _ = order.shape
    cache, demand, reads = OrderedDict(), 0, 0
    for t in range(T):
        for layer in range(L):
            for e in order[t, layer, :k]:
                key = (layer, int(e))
                if key in cache:
                    cache.move_to_end(key)
                    continue
                demand += t > 0
                reads += 1
                if len(cache) >= slots:
                    cache.popitem(last=False)
                cache[key] = None
        used = {(layer, int(e)) for layer in range(L) for e in order[t, layer, :k]}
        for layer in range(L):
            for e in order[t, layer, k:k + m]:
                key = (layer, int(e))
                if key not in cache:
                    if len(cache) >= slots:
                        cache.pop(next(v for v in cache if v not in used))
                    cache[key] = None
                    reads += 1
    return demand / (T - 1), reads / T


def misses(top: np.ndarray, slots: int, pick) -> int:
    """Misses of the routing top [T, L, k] under a victim choice pick(cache, last, uses, i)."""
    seq = [(layer, tuple(int(e) for e in top[t, layer])) for t in range(len(top)) for layer in range(top.shape[1])]
    cache, uses, n, clock = {}, {}, 0, 0
    for i, (layer, experts) in enumerate(seq):
        pinned = {(layer, e) for e in experts}
        for e in experts:
            key, clock = (layer, e), clock + 1
            if key not in cache:
                n += 1
                if len(cache) >= slots:
                    del cache[pick([c for c in cache if c not in pinned], cache, uses, i, seq)]
            cache[key] = clock
            uses.setdefault(key, []).append(i)
    return n


def lfu(window: int, layers: int):
    def pick(cands, cache, uses, i, seq):
        return min(cands, key=lambda c: (sum(j > i - window * layers for j in uses[c]), cache[c]))
    return pick


def belady(cands, cache, uses, i, seq):
    def next_use(c):
        return next((j for j in range(i + 1, len(seq)) if seq[j][0] == c[0] and c[1] in seq[j][1]), len(seq))
    return max(cands, key=next_use)


def main() -> None:
    store = Store(sys.argv[1])
    slots, tokens = int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 64
    scores = gate_scores(store, tokens)
    k = store.top_k
    order = np.argsort(-scores, axis=-1)
    top = order[..., :k]
    T, L, _ = order.shape
    new = [set(top[t + 1, layer].tolist()) - set(top[t, layer].tolist()) for t in range(T - 1) for layer in range(L)]
    total = sum(len(s) for s in new)
    print(f"{T} decode tokens, {L} MoE layers, top-{k}: {total / (T - 1):.2f} new experts per token")
    for m in (1, 2, 4, 6):
        got = sum(len(s & set(order[t, layer, k:k + m].tolist()))
                  for (t, layer), s in zip(((t, layer) for t in range(T - 1) for layer in range(L)), new))
        print(f"  among the token before's ranks {k + 1}..{k + m}: {got / max(total, 1):.2f}")
    for m in (0, 1, 2):
        d, r = lru_with_leases(order, k, slots, m)
        what = f"leases of ranks {k + 1}..{k + m}" if m else "no leases"
        print(f"LRU {slots} slots, {what}: {d:.2f} demand misses, {r:.2f} reads per token")
    print(f"misses over the tokens: LRU {misses(top, slots, lfu(0, L))}", end="")
    for w in (2, 4, 8, 16, 32):
        print(f", LFU {w} {misses(top, slots, lfu(w, L))}", end="")
    print(f", Belady {misses(top, slots, belady)}")


if __name__ == "__main__":
    main()
