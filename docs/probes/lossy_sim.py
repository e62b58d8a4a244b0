"""How much quality cache-aware rerouting costs on the MoEfied demo, measured without the runtime's
timing noise: the numpy MoE of tools/moefy.py on the held-out text, each layer behind an LRU
cache of SLOTS experts, every (token, layer) decided the way runtime/lossy.py decides it.

  OPENBLAS_NUM_THREADS=2 python docs/probes/lossy_sim.py [SEQS] [SLOTS]   (default 8 sequences, 4 slots)

Through the runtime (`deltafin-bench --quality`) a lossy setting's perplexity moves with which
experts happen to be resident when a token comes (reads land at different times run to run), so on
a few hundred positions the same setting measured 0.92x and 1.06x of exact. Here residency is a
pure function of the routing: a per-layer LRU of SLOTS experts (4 = a quarter of 16, what
`deltafin-demo --moe`'s 120 slots give each of the 30 layers on average), fed with the experts the
policy actually used, each sequence starting empty. Policies: exact; `sub M:S` = cache_aware
(margin M, max_share S; `lossy.reroute` itself, the replacement taking the missing expert's
weight, as the runtime's model does); `skip S` = drop up to S x top_k missing experts (weight 0),
the lowest-scored first, for comparison. Prints ppl, ppl / exact and misses (reads) per token.
"""
from __future__ import annotations

import sys
from collections import OrderedDict

import numpy as np

from deltafin.runtime import lossy
from deltafin.tools import moefy

POLICIES = [("exact", None, 0.0, 0.0), ("sub 0.05:0.5", "sub", 0.05, 0.5), ("sub 0.1:0.5", "sub", 0.1, 0.5),
            ("sub 0.2:0.5", "sub", 0.2, 0.5), ("sub 0.3:0.5", "sub", 0.3, 0.5), ("sub 0.3:0.75", "sub", 0.3, 0.75),
            ("sub 0.5:0.75", "sub", 0.5, 0.75), ("sub 1:1", "sub", 1.0, 1.0),
            ("skip 0.25", "skip", 0.0, 0.25), ("skip 0.5", "skip", 0.0, 0.5)]


def layer_choice(kind, margin, share, inds, wts, logits, slots, seq_len):
    """The layer's ids and weights after the policy, token by token against each sequence's LRU;
    returns them with the misses (experts read) counted."""
    n_e, k = logits.shape[1], inds.shape[1]
    inds, wts, misses = inds.copy(), wts.copy(), 0
    cap = lossy.max_swaps(share, k)
    for start in range(0, len(inds), seq_len):
        lru = OrderedDict()
        for t in range(start, start + seq_len):
            resident = np.zeros(n_e, bool)
            resident[list(lru)] = True
            if kind == "sub":
                inds[t] = lossy.reroute(inds[t][None], logits[t][None], resident, margin, share)[0][0]
            elif kind == "skip":
                for j in sorted(np.flatnonzero(~resident[inds[t]]), key=lambda j: logits[t, inds[t, j]])[:cap]:
                    wts[t, j] = 0.0
            for e, w in zip(inds[t].tolist(), wts[t]):
                if w == 0:
                    continue
                if e in lru:
                    lru.move_to_end(e)
                    continue
                misses += 1
                lru[e] = True
                if len(lru) > slots:
                    lru.popitem(last=False)
    return inds, wts, misses


def run(dense, moe, seqs, kind, margin, share, slots):
    k = int(moe["top_k"])
    x, misses = dense.embed(seqs), 0
    for i in range(dense.n_layers):
        x = dense.attention(i, x)
        h = dense.ffn_input(i, x)
        logits = h.reshape(-1, h.shape[-1]) @ moe["gates"][i].astype(np.float32).T
        inds, wts = moefy.routed_weights(logits, k, "shared" in moe)
        inds, wts, m = layer_choice(kind, margin, share, inds, wts, logits, slots, seqs.shape[1])
        misses += m
        x = x + moefy.weighted_ffn(dense, i, h, moe["experts"][i], inds, wts)
    return float(np.exp(dense.nll(x, seqs).mean())), misses / seqs.size


def main() -> None:
    n_seqs = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    slots = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    dense, tok = moefy._setup()
    seqs = moefy.token_sequences(tok, moefy.stdlib_docstrings(True, n_seqs * moefy.SEQ * 6), n_seqs)
    moe = moefy.load_moe()
    print(f"{seqs.size} held-out tokens, {slots} slots a layer (LRU), top-{int(moe['top_k'])} of {moe['gates'].shape[1]}")
    exact = None
    for name, kind, margin, share in POLICIES:
        ppl, misses = run(dense, moe, seqs, kind, margin, share, slots)
        exact = exact or (ppl, misses)
        print(f"{name:14s} ppl {ppl:8.3f}  x{ppl / exact[0]:.4f}  misses/token {misses:6.1f}  "
              f"({misses / exact[1]:.2f} of exact)", flush=True)


if __name__ == "__main__":
    main()
