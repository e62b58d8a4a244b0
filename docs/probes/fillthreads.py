"""Probe (H200): 100 expert fills (dsv2-lite shapes, 4.6 MB) from host memory into MLX pools
advised to host memory (as compute.pool_placement auto), one thread against several threads
each copying a share of the tensors' rows; and into plain numpy memory as a reference."""
import ctypes, time, sys
from concurrent.futures import ThreadPoolExecutor
import numpy as np, mlx.core as mx
cu = ctypes.CDLL("libcuda.so.1")
cu.cuInit(0); dev = ctypes.c_int(); cu.cuDeviceGet(ctypes.byref(dev), 0)
ctx = ctypes.c_void_p(); cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev); cu.cuCtxSetCurrent(ctx)
cu.cuMemAdvise.argtypes = [ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
S, D, I = 200, 2048, 1408
shapes = {"gate": (I, D // 8), "up": (I, D // 8), "down": (D, I // 8)}
p = {}
for n, (o, i) in shapes.items():
    p[n] = mx.zeros((S, o, i), dtype=mx.uint32)
    p[n + ".s"] = mx.ones((S, o, i * 8 // 64), dtype=mx.float32)
    p[n + ".b"] = mx.zeros((S, o, i * 8 // 64), dtype=mx.float32)
mx.eval(list(p.values()))
for v in p.values():
    ptr = np.frombuffer(memoryview(v), dtype=np.uint8).ctypes.data
    cu.cuMemAdvise(ptr, v.nbytes, 3, -1); cu.cuMemAdvise(ptr, v.nbytes, 5, dev.value)
views = {k: np.frombuffer(memoryview(v), dtype=np.uint32 if v.dtype == mx.uint32 else np.float32).reshape(v.shape) for k, v in p.items()}
plain = {k: np.zeros(v.shape, v.dtype) for k, v in views.items()}
rng = np.random.default_rng(0)
rec = {k: rng.integers(0, 2**31, size=v.shape[1:], dtype=np.uint32) if v.dtype == np.uint32 else np.zeros(v.shape[1:], np.uint16) for k, v in views.items()}
def one(dst, s, k):
    if rec[k].dtype == np.uint16:
        np.left_shift(rec[k], 16, out=dst[k][s].view(np.uint32), dtype=np.uint32)
    else:
        np.copyto(dst[k][s], rec[k])
def parts(dst, s, n):
    out = []
    for k in rec:
        rows = dst[k].shape[1]
        step = -(-rows // n)
        for a in range(0, rows, step):
            out.append((k, a, min(rows, a + step)))
    return out
def piece(dst, s, k, a, b):
    if rec[k].dtype == np.uint16:
        np.left_shift(rec[k][a:b], 16, out=dst[k][s][a:b].view(np.uint32), dtype=np.uint32)
    else:
        np.copyto(dst[k][s][a:b], rec[k][a:b])
pools = {n: ThreadPoolExecutor(n) for n in (2, 4, 8)}
res = {}
for rnd in range(5):
    for name, dst in (("host-advised", views), ("plain numpy", plain)):
        for n in (1, 2, 4, 8):
            t0 = time.perf_counter()
            for j in range(100):
                s = int(rng.integers(S))
                if n == 1:
                    for k in rec: one(dst, s, k)
                else:
                    list(pools[n].map(lambda t: piece(dst, s, *t), parts(dst, s, n)))
            dt = time.perf_counter() - t0
            if rnd:
                res.setdefault((name, n), []).append(dt)
for (name, n), v in res.items():
    print(f"{name:<13} threads {n}: 100 fills {1e3*np.median(v):7.1f} ms", flush=True)
