"""Issue 11 probe: a decode step of B rows with every expert resident, split into the host's graph
building (forward_batch + argmax + seal) and the wait for its evaluation; ms, median of 10."""
import sys, time
import mlx.core as mx, numpy as np
from deltafin.runtime.config import Config
from deltafin.runtime.store import Store
from deltafin.workers.compute import Compute, local_router

store = Store(sys.argv[1])
cfg = Config().to_dict()
cfg["compute"]["dtype"] = sys.argv[2] if len(sys.argv) > 2 else "float32"
src, staging, loader = local_router(store, cfg, n_slots=0)
try:
    c = Compute(store, cfg, src, staging, store.max_record_bytes)
    c.preload()
    m, e = c.model, c.experts
    for B in (1, 2, 4, 8):
        prompts = [[(37 * i + 11 * j) % 3000 + 100 for j in range(16 - i)] for i in range(B)]
        caches = [m.make_cache() for _ in prompts]
        for p, cache in zip(prompts, caches):
            c.forward(p[:-1], cache)
        toks = mx.array([p[-1] for p in prompts], dtype=mx.int32)
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
