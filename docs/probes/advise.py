"""Probe (H200): resident pools in MLX CUDA managed memory, fills written from the host, against
the same pools advised to live in host memory with the GPU mapping them (cuMemAdvise preferred
location CPU + accessed by the GPU), or read-mostly. ms per 100 fills and per token of gather_qmm
(26 layers x 6 experts) over the pool, alternating."""
import ctypes, time, sys
import numpy as np, mlx.core as mx

print(mx.default_device(), mx.__version__, flush=True)
cu = ctypes.CDLL("libcuda.so.1")
def ck(r, what):
    if r != 0:
        raise RuntimeError(f"{what}: CUresult {r}")
ck(cu.cuInit(0), "cuInit")
dev = ctypes.c_int()
ck(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
ctx = ctypes.c_void_p()
ck(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "retain")
ck(cu.cuCtxSetCurrent(ctx), "setcurrent")
cu.cuMemAdvise.argtypes = [ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
attr = ctypes.c_int()
cu.cuDeviceGetAttribute(ctypes.byref(attr), 89, dev)  # CONCURRENT_MANAGED_ACCESS
print("concurrent managed access", attr.value, flush=True)
cu.cuDeviceGetAttribute(ctypes.byref(attr), 100, dev)  # PAGEABLE_MEMORY_ACCESS_USES_HOST_PAGE_TABLES
print("pageable uses host page tables", attr.value, flush=True)

S, D, I = int(sys.argv[1]) if len(sys.argv) > 1 else 416, 2048, 1408
shapes = {"gate": (I, D // 8), "up": (I, D // 8), "down": (D, I // 8)}
def make_pool():
    p = {}
    for n, (o, i) in shapes.items():
        p[n] = mx.zeros((S, o, i), dtype=mx.uint32)
        p[n + ".s"] = mx.ones((S, o, i * 8 // 64), dtype=mx.float32) * 0.01
        p[n + ".b"] = mx.zeros((S, o, i * 8 // 64), dtype=mx.float32)
    mx.eval(list(p.values()))
    return p
def views(p):
    return {k: np.frombuffer(memoryview(v), dtype=np.uint32 if v.dtype == mx.uint32 else np.float32).reshape(v.shape) for k, v in p.items()}
def advise(p, mode):
    for v in p.values():
        ptr = np.frombuffer(memoryview(v), dtype=np.uint8).ctypes.data
        n = v.nbytes
        if mode == "host":
            ck(cu.cuMemAdvise(ptr, n, 3, -1), "preferred cpu")
            ck(cu.cuMemAdvise(ptr, n, 5, dev.value), "accessed by gpu")
        elif mode == "readmostly":
            ck(cu.cuMemAdvise(ptr, n, 1, dev.value), "read mostly")
rng = np.random.default_rng(0)
rec = {}
for n, (o, i) in shapes.items():
    rec[n] = rng.integers(0, 2**31, size=(o, i), dtype=np.uint32)
    rec[n + ".s"] = rng.random((o, i * 8 // 64), dtype=np.float32) * 0.01
    rec[n + ".b"] = rng.random((o, i * 8 // 64), dtype=np.float32) * 0.01
x = mx.array(rng.standard_normal((1, 1, 1, D)).astype(np.float32))
def token(p):
    outs = []
    for layer in range(26):
        idx = mx.array(rng.choice(S, 6, replace=False).astype(np.uint32)).reshape(1, 6)
        g = mx.gather_qmm(x, p["gate"], p["gate.s"], p["gate.b"], rhs_indices=idx, transpose=True, group_size=64, bits=4)
        u = mx.gather_qmm(x, p["up"], p["up.s"], p["up.b"], rhs_indices=idx, transpose=True, group_size=64, bits=4)
        h = (g * u).reshape(1, 6, 1, 1, I)
        y = mx.gather_qmm(h, p["down"], p["down.s"], p["down.b"], rhs_indices=idx.reshape(1, 6, 1), transpose=True, group_size=64, bits=4)
        outs.append(y.sum())
        mx.eval(outs[-1])  # a gate read-back per layer, as a real pass
    return outs
pools = {}
for mode in ("none", "host", "readmostly"):
    p = make_pool()
    try:
        advise(p, mode)
    except RuntimeError as e:
        print(mode, "advice refused:", e, flush=True)
        continue
    pools[mode] = (p, views(p))
res = {m: {"fill": [], "token": []} for m in pools}
for rnd in range(6):
    for mode, (p, v) in pools.items():
        mx.synchronize()
        t0 = time.perf_counter()
        token(p)
        mx.synchronize()
        t1 = time.perf_counter()
        for j in range(100):
            s = int(rng.integers(S))
            for k in rec:
                v[k][s] = rec[k]
        t2 = time.perf_counter()
        if rnd:
            res[mode]["token"].append(t1 - t0)
            res[mode]["fill"].append(t2 - t1)
for m, r in res.items():
    print(f"{m:<11} token (26 layers x 6 experts, read-back per layer) {1e3*np.median(r['token']):7.2f} ms   100 fills {1e3*np.median(r['fill']):7.2f} ms", flush=True)
# correctness: a host write is seen by the device in each mode
for mode, (p, v) in pools.items():
    v["gate"][3] = 5
    print(mode, "device sees the host write:", int(mx.sum(p["gate"][3] == 5).item()) == p["gate"][3].size, flush=True)
