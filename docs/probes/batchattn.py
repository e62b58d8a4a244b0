"""Issue 11 probe: a decode step of B rows, every expert resident, attention per sequence (as now)
against one batch-owned KV array per layer (one scatter of the rows' k/v at their offsets, one
masked SDPA over the padded rows). ms per step, and the logits' difference on the first step.

batchattn.py STORE [DTYPE] [pipelined]: with `pipelined`, each step is launched before the
previous step's tokens are read, as the product's scheduler does with every expert resident
(median of 32 steps after 8)."""
import sys
import time
import mlx.core as mx, numpy as np
from deltafin.runtime.models.base import StagedAttention
from resident_step import prefilled_rows, resident_compute

per_seq_rows = StagedAttention.rows
CAP = 256

def batched_rows(self, x, caches, offsets):
    q, k, v = self.project(x, offsets)
    B = x.shape[0]
    st = getattr(self, "_bst", None)
    if st is None or st[0] != B:
        K = mx.zeros((B, k.shape[1], CAP, k.shape[3]), k.dtype)
        V = mx.zeros((B, v.shape[1], CAP, v.shape[3]), v.dtype)
        for b, c in enumerate(caches):
            K[b:b + 1, :, :c.offset, :] = c.keys[..., :c.offset, :]
            V[b:b + 1, :, :c.offset, :] = c.values[..., :c.offset, :]
        self._bst = st = [B, K, V, [c.offset for c in caches]]
    _, K, V, offs = st
    idx = mx.broadcast_to(offsets.reshape(B, 1, 1, 1), k.shape)
    K = mx.put_along_axis(K, idx, k, axis=2)
    V = mx.put_along_axis(V, idx, v, axis=2)
    st[1], st[2] = K, V
    L = max(offs) + 1
    mask = (mx.arange(L)[None] <= offsets[:, None]).reshape(B, 1, 1, L)
    out = mx.fast.scaled_dot_product_attention(q, K[:, :, :L], V[:, :, :L], scale=self.scale, mask=mask)
    st[3] = [o + 1 for o in offs]
    for c in caches:
        c.offset += 1
    return self.output(out)

def serial(c, m, e, B, caches, toks, mode, first):
    times = []
    for s in range(14):
        t0 = time.perf_counter()
        pno = e.begin_pass(B, rows=False)
        lg = m.forward_batch(toks, caches, e, float32=True)
        if s == 0:
            mx.eval(lg)
            first[(mode, B)] = np.array(lg)
        toks = mx.argmax(lg, axis=-1).astype(mx.int32)
        ids = e.seal_pass()
        mx.eval(toks) if ids is None else mx.eval(toks, ids)
        e.commit(pno, rows=False)
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times[4:]))


def pipelined(c, m, e, B, caches, toks):
    def launch(toks):
        pno = e.begin_pass(B, rows=False)
        lg = m.forward_batch(toks, caches, e, float32=False)
        t = mx.argmax(lg, axis=-1).astype(mx.int32)
        ids = e.seal_pass()
        mx.async_eval(t) if ids is None else mx.async_eval(t, ids)
        return pno, t
    prev, times = launch(toks), []
    for _ in range(40):
        t0 = time.perf_counter()
        nxt = launch(prev[1])
        prev[1].tolist()
        e.commit(prev[0], rows=False)
        prev = nxt
        times.append(time.perf_counter() - t0)
    mx.eval(prev[1])
    e.commit(prev[0], rows=False)
    return 1e3 * float(np.median(times[8:]))


piped = "pipelined" in sys.argv[3:]
c, loader, cfg = resident_compute(sys.argv[:3])
try:
    m, e = c.model, c.experts
    first = {}
    for mode in ("per_seq", "batched"):
        StagedAttention.rows = per_seq_rows if mode == "per_seq" else batched_rows
        for B in (1, 2, 4, 8):
            for _, a, _, _ in m.layers:
                a._bst = None
            caches, toks = prefilled_rows(c, B)
            extra = ""
            if piped:
                ms = pipelined(c, m, e, B, caches, toks)
                how = "pipelined, median of 32"
            else:
                ms = serial(c, m, e, B, caches, toks, mode, first)
                how = "median of 10"
                if mode == "batched":
                    d = np.abs(first[(mode, B)] - first[("per_seq", B)]).max()
                    same = (first[(mode, B)].argmax(-1) == first[("per_seq", B)].argmax(-1)).all()
                    extra = f"  max|dlogit| step0 {d:.3g} argmax equal {same}"
            print(f"{mx.default_device()} {mode} B={B}: {ms:.2f} ms/step ({how}){extra}", flush=True)
finally:
    loader.close()
