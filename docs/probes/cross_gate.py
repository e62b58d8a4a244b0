"""Issue 28, stop 72: could the pass's first MoE layer, whose routing is read back anyway, foretell
the later layers' experts, so their misses are read from the pass's start instead of its end?
Greedy decode in one process with every expert resident (partial_layer.py's prompt); at each MoE
layer L of each decode token, L's gate applied to the input of every earlier MoE layer j; then the
recall of L's true top-k among the top-m of gate_L(x_j), from the first MoE layer (j = first) and
from the one before (j = L-1: the gate lookahead the runtime has), and by distance L - j.

  python docs/probes/cross_gate.py STORE [TOKENS]

Stop 72 (this CPU, issue 28's store, 32 tokens; layers 2-7): from the first layer's input, recall
0.24 at m = k = 4, 0.32 at 6, 0.41 at 8 (chance: 0.125 at 4); from the layer before 0.65 / 0.79 /
0.89; by distance 1..7: 0.62, 0.54, 0.50, 0.44, 0.35, 0.27, 0.11. So a read-back at the pass's
first layer foretells a third of the later layers' experts at twice the reads; not built.
"""
from __future__ import annotations

import os
import sys

import mlx.core as mx
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import partial_layer as pl  # noqa: E402

from deltafin.runtime.store import Store  # noqa: E402


def record(store: Store, tokens: int) -> list:
    """Per MoE layer call of each decode token: (layer, its gate's logits, {j: gate on x_j})."""
    first = store.moe_layers[0]
    rec, xs = [], {}

    def row(a):
        return np.array(a.astype(mx.float32)).reshape(-1, a.shape[-1])[-1]

    def keep(moe, x):
        if moe.layer == first:
            xs.clear()
        rec.append((moe.layer, row(moe.gate(x)), {j: row(moe.gate(xj)) for j, xj in xs.items()}))
        xs[moe.layer] = x
    pl.watch_moe(store, tokens, keep)
    return rec[len(store.moe_layers):]  # the prompt's pass left out


def recall(rec: list, moe: list, k: int, m: int, source) -> float:
    """Share of the true top-k found in the top-m of gate_L(x_source(i)); source None: skipped."""
    hit = total = 0
    for layer, true, preds in rec:
        j = source(moe.index(layer))
        if j is None:
            continue
        t = set(np.argsort(-true)[:k].tolist())
        hit += len(t & set(np.argsort(-preds[moe[j]])[:m].tolist()))
        total += len(t)
    return hit / max(1, total)


def main() -> None:
    store = Store(sys.argv[1])
    tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 32
    moe = list(store.moe_layers)
    k = int(store.config.get("num_experts_per_tok") or 4)
    rec = record(store, tokens)
    for m in (k, k + 2, k + 4):
        print(f"top-{m}: from the first layer {recall(rec, moe, k, m, lambda i: 0 if i >= 2 else None):.2f}, "
              f"from the layer before {recall(rec, moe, k, m, lambda i: i - 1 if i >= 2 else None):.2f}")
    print("by distance:", ", ".join(f"{d}: {recall(rec, moe, k, k, lambda i, d=d: i - d if i >= d else None):.2f}"
                                    for d in range(1, len(moe))))


if __name__ == "__main__":
    main()
