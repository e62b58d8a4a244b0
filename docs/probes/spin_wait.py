"""Can the device wait for the host in the middle of a pass? (issue 28: what a run-ahead miss costs)

  python docs/probes/spin_wait.py [TOKENS [TRIALS]]     # MLX CUDA only

Today a pass that runs its partially resident layers ahead and meets an expert no one had in
flight finds it at the pass's end: the need goes out then, and the layers after it, computed in
vain, are built and computed again (stop 71 on H100s: about 6.5 ms per such pass, 30 of 64
passes at 25%). If instead the device mapped a layer's expert ids to slots itself through a table
in pinned host memory, posted a request there for a missing expert and waited (spinning, with a
timeout) until the host wrote its slot, the read would start as soon as the routing is known and
nothing would be computed twice. This probe measures whether that is sound and cheap, with
issue 28's shapes (8 MoE layers x 32 experts, top-4, hidden 1024, expert width 768, 4-bit group
64, bfloat16) and synthetic weights, in one process:

  1. overhead, every expert resident: a token's pass with the slots gathered on the device
     (today's `table[ids]`) against the same pass with the waiting kernel, one drain per token;
     the outputs equal bit for bit;
  2. a miss: one chosen expert of a later layer missing (its slot's rows zeroed, its table entry
     -1); the host polls the request, copies the expert's rows into the slot with the driver
     (cuMemcpyHtoDAsync on a stream of its own, as `DriverCopies` fills) while the kernel spins,
     writes the slot, and the pass finishes: times from launch to the request seen, from the slot
     written to the pass done, and the output against the all-resident one, bit for bit;
  3. the timeout: a request never answered ends the kernel after its limit (no hang), flagged.
"""
from __future__ import annotations

import ctypes
import mmap
import statistics
import sys
import time

import mlx.core as mx
import numpy as np

from deltafin.runtime.models.switch import switch_glu, uniform_quant
from deltafin.workers import resident as R

LAYERS, E, K, D, F = 8, 32, 4, 1024, 768
REQ, ERR, DONE, TABLE = 0, 8, 16, 64  # int32 words of the pinned page: request, error, done, tables
LIMIT_NS = 2_000_000_000

SOURCE = """
    if (threadIdx.x == 0) {
        volatile int* h = reinterpret_cast<volatile int*>(addr[0]);
        const int layer = meta[0], seq = meta[1];
        const int base = TABLE + layer * NE;
        unsigned long long t0, t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
        int asked = 0;
        for (int i = 0; i < NK; ++i) {
            int s = h[base + ids[i]];
            while (s < 0) {
                if (!asked) {  // every missing expert of the layer in one request
                    int n = 0;
                    for (int j = 0; j < NK; ++j) if (h[base + ids[j]] < 0) h[REQ + 2 + n++] = ids[j];
                    h[REQ + 1] = layer * 64 + n;
                    __threadfence_system();
                    h[REQ] = seq;
                    __threadfence_system();
                    asked = 1;
                }
                asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
                if (t - t0 > LIMIT) { h[ERR] = seq; __threadfence_system(); s = 0; break; }
                __nanosleep(200);
                s = h[base + ids[i]];
            }
            slots[i] = s;
        }
    }
"""
DONE_SOURCE = """
    if (threadIdx.x == 0) {
        volatile int* h = reinterpret_cast<volatile int*>(addr[0]);
        out[0] = y[0];
        __threadfence_system();
        h[DONE] = meta[1];
        __threadfence_system();
    }
"""


def pinned_page(cu):
    """A page-aligned host buffer, registered and mapped for the device: (numpy int32 view, device address)."""
    buf = mmap.mmap(-1, 1 << 16)
    view = np.frombuffer(buf, dtype=np.int32)
    cu.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    r = cu.cuMemHostRegister_v2(view.ctypes.data, view.nbytes, 0x1 | 0x2)  # portable | devicemap
    if r != 0:
        raise OSError(f"cuMemHostRegister refused (CUresult {r})")
    dptr = ctypes.c_uint64()
    cu.cuMemHostGetDevicePointer_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
    r = cu.cuMemHostGetDevicePointer_v2(ctypes.byref(dptr), view.ctypes.data, 0)
    if r != 0:
        raise OSError(f"cuMemHostGetDevicePointer refused (CUresult {r})")
    return buf, view, dptr.value


def main() -> None:
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    trials = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    if mx.default_device() != mx.gpu or R.is_metal():
        sys.exit("MLX CUDA only (a custom CUDA kernel)")
    drv = R._cuda_driver()
    copies = R.DriverCopies.open()
    buf, h, dptr = pinned_page(drv[0])
    addr = mx.array(np.array([dptr], dtype=np.uint64))
    defines = f"#define NE {E}\n#define NK {K}\n#define REQ {REQ}\n#define ERR {ERR}\n#define DONE {DONE}\n#define TABLE {TABLE}\n"
    wait_k = mx.fast.cuda_kernel(name="df_slots_wait", input_names=["ids", "addr", "meta"], output_names=["slots"],
                                 source=SOURCE, header=defines + f"#define LIMIT {LIMIT_NS}ULL\n")
    done_k = mx.fast.cuda_kernel(name="df_pass_done", input_names=["y", "addr", "meta"], output_names=["out"],
                                 source=DONE_SOURCE, header=defines)

    mx.random.seed(0)
    w = {}
    for p, (o, i) in {"gate_proj": (F, D), "up_proj": (F, D), "down_proj": (D, F)}.items():
        wq, s, b = mx.quantize((mx.random.normal((E * LAYERS, o, i)) * 0.02).astype(mx.bfloat16), group_size=64, bits=4)
        w[f"{p}.weight"], w[f"{p}.scales"], w[f"{p}.biases"] = wq, s, b
    quant = uniform_quant(w, 4, 64)
    gates = [(mx.random.normal((D, E)) * 0.05).astype(mx.bfloat16) for _ in range(LAYERS)]
    mx.eval(w, gates)
    if copies is not None:
        copies.place(list(w.values()))
    # every expert resident: layer l's expert e in slot l * E + e, the table in pinned memory
    table_np = (np.arange(LAYERS)[:, None] * E + np.arange(E)[None, :]).astype(np.int32)
    h[TABLE:TABLE + LAYERS * E] = table_np.reshape(-1)
    dev_tables = [mx.array(table_np[l].astype(np.uint32)) for l in range(LAYERS)]

    def moe(l, x, slots):
        y = switch_glu(x, slots, w, quant)  # [1, K, D]
        return x + y.sum(axis=-2) * 0.5

    def route(l, x):
        logits = x @ gates[l]
        return mx.argpartition(-logits.astype(mx.float32), kth=K - 1, axis=-1)[..., :K].astype(mx.int32)

    def pass_gather(x):
        ids_all = []
        for l in range(LAYERS):
            ids = route(l, x)
            ids_all.append(ids)
            x = moe(l, x, dev_tables[l][ids])
        return x, ids_all

    def pass_wait(x, seq):
        for l in range(LAYERS):
            ids = route(l, x)
            meta = mx.array(np.array([l, seq], dtype=np.int32))
            slots = wait_k(inputs=[ids.reshape(-1), addr, meta], output_shapes=[(K,)], output_dtypes=[mx.int32],
                           grid=(32, 1, 1), threadgroup=(32, 1, 1))[0]
            x = moe(l, x, slots.reshape(ids.shape).astype(mx.uint32))
        meta = mx.array(np.array([0, seq], dtype=np.int32))
        done = done_k(inputs=[x.reshape(-1), addr, meta], output_shapes=[(1,)], output_dtypes=[x.dtype],
                      grid=(32, 1, 1), threadgroup=(32, 1, 1))[0]
        return x, done

    xs = [(mx.random.normal((1, D)) * 0.5).astype(mx.bfloat16) for _ in range(tokens)]
    mx.eval(xs)
    # 1. overhead, all resident, alternating blocks
    ref, ref_ids = [], []
    for x in xs[:4]:  # warm-up (compiles the kernels)
        mx.eval(pass_gather(x)[0], pass_wait(x, 1)[0])
    t_g, t_w, seq, same = [], [], 1, True
    for rnd in range(3):
        for x in xs:
            t0 = time.perf_counter()
            y, ids = pass_gather(x)
            mx.eval(y, *ids)
            t_g.append(time.perf_counter() - t0)
            if rnd == 0:
                ref.append(y)
                ref_ids.append([np.array(i).reshape(-1) for i in ids])
        for i, x in enumerate(xs):
            seq += 1
            t0 = time.perf_counter()
            y, done = pass_wait(x, seq)
            mx.eval(y, done)
            t_w.append(time.perf_counter() - t0)
            same &= bool(mx.array_equal(y, ref[i]).item())
    ms = lambda v: f"{statistics.median(v) * 1e3:.3f} ms (p90 {sorted(v)[int(0.9 * len(v))] * 1e3:.3f})"
    print(f"1. all resident, {tokens} tokens x 3: device gather {ms(t_g)}; waiting kernel {ms(t_w)}; "
          f"outputs equal: {same}")

    # 2. a miss: one chosen expert of layer l >= 1 missing; the host answers the request
    rng = np.random.default_rng(0)
    seen, resumed, whole, base_t, ok, errs = [], [], [], [], 0, 0
    names = list(w)
    row_bytes = {n: w[n].nbytes // (E * LAYERS) for n in names}
    total = sum(row_bytes.values())
    staging, blank = mmap.mmap(-1, total), mmap.mmap(-1, total)
    st, zero = np.frombuffer(staging, dtype=np.uint8), np.frombuffer(blank, dtype=np.uint8)
    for a in (st, zero):
        drv[0].cuMemHostRegister_v2(a.ctypes.data, a.nbytes, 0)

    def write_slot(slot, src):  # the driver's copies into the slot's rows, waited for
        off = 0
        for n in names:
            copies.copy(R._address(w[n]) + slot * row_bytes[n], src.ctypes.data + off, row_bytes[n])
            off += row_bytes[n]
        copies.wait()

    for t in range(trials):
        i = int(rng.integers(tokens))
        layer = int(rng.integers(1, LAYERS))
        e = int(ref_ids[i][layer][int(rng.integers(K))])
        slot = layer * E + e
        off = 0
        for n in names:  # the expert's rows into the staging, then its slot zeroed
            st[off:off + row_bytes[n]] = np.array(w[n][slot].view(mx.uint8)).reshape(-1)
            off += row_bytes[n]
        write_slot(slot, zero)
        h[TABLE + layer * E + e] = -1
        seq += 1
        t0 = time.perf_counter()
        y, done = pass_wait(xs[i], seq)
        mx.async_eval(y, done)
        while h[REQ] != seq and h[DONE] != seq and time.perf_counter() - t0 < 5:
            pass
        t_seen = time.perf_counter()
        asked = int(h[REQ + 1]) if h[REQ] == seq else -1
        write_slot(slot, st)
        h[TABLE + layer * E + e] = slot
        t_write = time.perf_counter()
        while h[DONE] != seq and time.perf_counter() - t0 < 5:
            pass
        t_done = time.perf_counter()
        mx.eval(y, done)
        equal = bool(mx.array_equal(y, ref[i]).item())
        ok += equal and asked == layer * 64 + 1
        errs += int(h[ERR] == seq)
        seen.append(t_seen - t0)
        resumed.append(t_done - t_write)
        whole.append(t_done - t0)
        t1 = time.perf_counter()
        mx.eval(pass_gather(xs[i])[0])
        base_t.append(time.perf_counter() - t1)
    print(f"2. a miss at a layer 1-7, {trials} trials: request seen {ms(seen)} after launch; pass done "
          f"{ms(resumed)} after the slot written; whole pass {ms(whole)} (all resident {ms(base_t)}); "
          f"equal to all resident with the request right: {ok} of {trials}; timeouts {errs}")

    # 3. the timeout: never answered
    h[TABLE + 3 * E + int(ref_ids[0][3][0])] = -1
    seq += 1
    t0 = time.perf_counter()
    y, done = pass_wait(xs[0], seq)
    mx.eval(y, done)
    print(f"3. never answered: the pass ended after {time.perf_counter() - t0:.2f} s, "
          f"error flag {'set' if h[ERR] == seq else 'NOT set'} (limit {LIMIT_NS / 1e9:.1f} s)")
    h[TABLE + 3 * E + int(ref_ids[0][3][0])] = 3 * E + int(ref_ids[0][3][0])


if __name__ == "__main__":
    main()
