"""Issue 11 probe: a decode step of B rows with every expert resident, split into the host's graph
building (forward_batch + argmax + seal) and the wait for its evaluation; ms, median of 10."""
import time
import mlx.core as mx, numpy as np
from resident_step import prefilled_rows, resident_compute

c, loader, cfg = resident_compute()
try:
    m, e = c.model, c.experts
    for B in (1, 2, 4, 8):
        caches, toks = prefilled_rows(c, B)
        build, wait, total = [], [], []
        for s in range(14):
            mx.synchronize()
            t0 = time.perf_counter()
            pno = e.begin_pass(B, rows=False)
            lg = m.forward_batch(toks, caches, e, float32=False)
            toks = mx.argmax(lg, axis=-1).astype(mx.int32)
            ids = e.seal_pass()
            t1 = time.perf_counter()
            mx.eval(toks) if ids is None else mx.eval(toks, ids)
            t2 = time.perf_counter()
            e.commit(pno, rows=False)
            t3 = time.perf_counter()
            build.append(t1 - t0); wait.append(t2 - t1); total.append(t3 - t0)
        med = lambda v: 1e3 * float(np.median(v[4:]))
        print(f"{mx.default_device()} {cfg['compute']['dtype']} B={B}: total {med(total):.2f} ms = build {med(build):.2f} + eval {med(wait):.2f} (+commit)", flush=True)
finally:
    loader.close()
