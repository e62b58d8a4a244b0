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
64, bfloat16) and synthetic weights, in one process, through workers/device_waits.py (the
kernels and the host's handshake the runtime would use):

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
from deltafin.workers.device_waits import DeviceWaits, DeviceWaitTimeout

LAYERS, E, K, D, F = 8, 32, 4, 1024, 768


def main() -> None:
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    trials = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    if mx.default_device() != mx.gpu or R.is_metal():
        sys.exit("MLX CUDA only (a custom CUDA kernel)")
    drv = R._cuda_driver()
    copies = R.DriverCopies.open()
    dw = DeviceWaits.open(list(range(LAYERS)), E)
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
    dw.table[:] = table_np
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

    def pass_wait(x):
        dw.begin()
        for l in range(LAYERS):
            x = moe(l, x, dw.slots(l, route(l, x)))
        return x, dw.marker(x)

    xs = [(mx.random.normal((1, D)) * 0.5).astype(mx.bfloat16) for _ in range(tokens)]
    mx.eval(xs)
    # 1. overhead, all resident, alternating blocks
    ref, ref_ids = [], []
    for x in xs[:4]:  # warm-up (compiles the kernels)
        mx.eval(pass_gather(x)[0], *pass_wait(x))
    t_g, t_w, same = [], [], True
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
            t0 = time.perf_counter()
            y, done = pass_wait(x)
            mx.eval(y, done)
            t_w.append(time.perf_counter() - t0)
            same &= bool(mx.array_equal(y, ref[i]).item())
    def ms(v):
        return f"{statistics.median(v) * 1e3:.3f} ms (p90 {sorted(v)[int(0.9 * len(v))] * 1e3:.3f})" if v else "n/a"

    print(f"1. all resident, {tokens} tokens x 3: device gather {ms(t_g)}; waiting kernel {ms(t_w)}; "
          f"outputs equal: {same}")

    # 2. a miss: one chosen expert of layer l >= 1 missing; the host answers the request
    rng = np.random.default_rng(0)
    seen, resumed, whole, base_t, ok, errs = [], [], [], [], 0, 0
    names = list(w)
    row_bytes = {n: w[n].nbytes // (E * LAYERS) for n in names}
    total = sum(row_bytes.values())
    pages = -(-total // mmap.PAGESIZE) * mmap.PAGESIZE
    staging, blank = mmap.mmap(-1, pages), mmap.mmap(-1, pages)
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
        dw.drop(layer, e)
        write_slot(slot, zero)
        got = {}

        def serve(at, experts):
            got.update(seen=time.perf_counter(), right=at == layer and e in experts and len(experts) == K)
            write_slot(slot, st)
            dw.table[layer, e] = slot
            got["write"] = time.perf_counter()

        t0 = time.perf_counter()
        y, done = pass_wait(xs[i])
        mx.async_eval(y, done)
        try:
            dw.wait(serve, 5.0)
        except DeviceWaitTimeout:
            errs += 1
        t_done = time.perf_counter()
        mx.eval(y, done)
        ok += bool(mx.array_equal(y, ref[i]).item()) and got.get("right", False)
        if "seen" in got:
            seen.append(got["seen"] - t0)
            resumed.append(t_done - got["write"])
        whole.append(t_done - t0)
        t1 = time.perf_counter()
        mx.eval(pass_gather(xs[i])[0])
        base_t.append(time.perf_counter() - t1)
    print(f"2. a miss at a layer 1-7, {trials} trials: request seen {ms(seen)} after launch; pass done "
          f"{ms(resumed)} after the slot written; whole pass {ms(whole)} (all resident {ms(base_t)}); "
          f"equal to all resident with the request right: {ok} of {trials}; timeouts {errs}")

    # 3. the timeout: never answered
    e = int(ref_ids[0][3][0])
    dw.limit_s = 0.25
    dw.drop(3, e)
    t0 = time.perf_counter()
    y, done = pass_wait(xs[0])
    mx.async_eval(y, done)
    try:
        dw.wait(lambda at, experts: None, 5.0)
        told = "no error"
    except DeviceWaitTimeout as err:
        told = f"DeviceWaitTimeout: {err}"
    mx.eval(y, done)
    print(f"3. never answered: the pass ended after {time.perf_counter() - t0:.2f} s ({told}; kernel limit {dw.limit_s} s)")
    dw.table[3, e] = 3 * E + e
    dw.close()


if __name__ == "__main__":
    main()
