"""Where streaming pools should live on MLX CUDA: the issue-28 question "what does a partial layer's
expert compute cost the device", with the runtime's ResidentTier and switch_glu, no processes.

  python docs/probes/pool_place.py STORE [SLOTS_PER_LAYER [TOKENS [ROUNDS]]]

Placements (one tier each, every slot filled from the store's records):
  host    the runtime's today: pools advised into host memory, mapped for the GPU (place_on_host),
          filled with numpy; the GPU reads the experts over the bus
  device  pools advised into device memory (cuMemAdvise preferred location the GPU, prefetched
          there), filled by the driver's copy (cuMemcpyHtoD) from the record's bytes, then a
          stream sync: the GPU reads them from its own memory
  managed MLX's placement (pages migrate to wherever touched last), filled with numpy
Prints per placement: a "token" of every MoE layer's switch_glu on 1 row, k experts among the
layer's slots, evaluated per layer (as a layer that reads its routing back) and once per token;
the time of one fill (median); and whether every placement's outputs equal the first's, bit for bit.
"""
from __future__ import annotations

import ctypes
import statistics
import sys
import time

import mlx.core as mx
import numpy as np

from deltafin.runtime.store import Store, views_from_buffer
from deltafin.runtime.tiers import layer_groups
from deltafin.runtime.models.switch import switch_glu
from deltafin.workers import resident as R

_ADVISE_PREFERRED, _ADVISE_ACCESSED_BY = 3, 5


def to_device(tier: R.ResidentTier) -> None:
    cu, dev = R._cuda_driver()
    cu.cuMemPrefetchAsync.argtypes = [ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    for pools in tier.pools.values():
        for a in pools.values():
            ptr = np.frombuffer(memoryview(a), dtype=np.uint8).ctypes.data
            assert cu.cuMemAdvise(ptr, a.nbytes, _ADVISE_PREFERRED, dev) == 0
            assert cu.cuMemPrefetchAsync(ptr, a.nbytes, dev, None) == 0
    assert cu.cuCtxSynchronize() == 0


class DeviceFill:
    """Fills a slot with cuMemcpyHtoD from the record's bytes (no host touch of the pool)."""

    def __init__(self, tier: R.ResidentTier):
        self.cu, _ = R._cuda_driver()
        self.cu.cuMemcpyHtoD_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t]
        self.cu.cuStreamSynchronize.argtypes = [ctypes.c_void_p]
        self.tier = tier
        self.base = {g: {k: (np.frombuffer(memoryview(a), dtype=np.uint8).ctypes.data, a.nbytes // a.shape[0])
                         for k, a in pools.items()} for g, pools in tier.pools.items()}

    def fill(self, layer: int, expert: int, slot: int, record) -> None:
        tier = self.tier
        g = tier.group_of[layer]
        views = views_from_buffer(record, tier.layouts[g])
        for t in tier.layouts[g]["tensors"]:
            ptr, row = self.base[g][t["name"]]
            src = np.ascontiguousarray(views[t["name"]]).view(np.uint8).reshape(-1)
            assert src.nbytes == row, (t["name"], src.nbytes, row)
            assert self.cu.cuMemcpyHtoD_v2(ptr + slot * row, src.ctypes.data, row) == 0
        assert self.cu.cuStreamSynchronize(None) == 0
        # the tier's map, as ResidentTier.fill keeps it
        tier.held[g][slot] = (layer, expert)
        tier.slot_of[layer][expert] = slot


def main() -> None:
    store = Store(sys.argv[1])
    per_layer = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 64
    rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 3
    groups = layer_groups(store)
    layers = list(store.moe_layers)
    slots = {g: per_layer * list(groups.values()).count(g) for g in set(groups.values())}
    k = store.top_k
    records = {}
    for i, layer in enumerate(layers):
        for j in range(per_layer):
            view = store.read_record(store.record(layer, j))
            records[(layer, j)] = np.frombuffer(bytes(view), dtype=np.uint8)
    gate = next(t for t in store.layout(layers[0])["tensors"] if t["name"].startswith("gate_proj.w"))
    d = gate["shape"][-1] * 32 // store.layout(layers[0])["quant"]["gate_proj"]["bits"]
    rng = np.random.default_rng(0)
    xs = [mx.array(rng.standard_normal((1, d)).astype(np.float32)).astype(mx.bfloat16) for _ in range(tokens)]
    picks = [[np.sort(rng.choice(per_layer, k, replace=False)) for _ in layers] for _ in range(tokens)]
    results, report = {}, {}
    cuda = R._cuda_driver() is not None and mx.default_device() == mx.gpu
    for place in ("host", "device", "managed") if cuda else ("host", "managed"):
        tier = R.ResidentTier(store, mx.bfloat16, slots, host_writes=True, on_host=(place == "host"))
        if place == "device":
            to_device(tier)
            filler = DeviceFill(tier).fill
        else:
            filler = tier.fill
        fill_ms = []
        for (layer, j), rec in records.items():
            g = tier.group_of[layer]
            slot = layers.index(layer) * per_layer + j if len(slots) == 1 else j
            t0 = time.perf_counter()
            filler(layer, j, slot, memoryview(rec))
            fill_ms.append((time.perf_counter() - t0) * 1e3)
        mx.synchronize()

        def token(t: int, per_layer_eval: bool):
            x = xs[t]
            for li, layer in enumerate(layers):
                slots_np = tier.slot_of[layer][picks[t][li]].astype(np.uint32).reshape(1, k)
                y = switch_glu(x, mx.array(slots_np), tier.weights(layer), tier.quant(layer))
                x = x + y.sum(axis=-2).astype(x.dtype) * 0.01
                if per_layer_eval:
                    mx.eval(x)
            mx.eval(x)
            return x

        outs = []
        for t in range(4):
            token(t, True)  # warm-up
        times = {"per_layer": [], "per_token": []}
        for r in range(rounds):
            for mode in times:
                t0 = time.perf_counter()
                for t in range(tokens):
                    o = token(t, mode == "per_layer")
                    if r == 0 and mode == "per_layer":
                        outs.append(np.array(o.astype(mx.float32)))
                times[mode].append((time.perf_counter() - t0) * 1e3 / tokens)
        results[place] = outs
        report[place] = {m: round(statistics.median(v), 3) for m, v in times.items()}
        report[place]["fill_ms_p50"] = round(statistics.median(fill_ms), 3)
        report[place]["placement"] = tier.placement.get("why") if place == "host" else place
        print(place, report[place], flush=True)
        del tier
    first = next(iter(results.values()))
    for place, outs in results.items():
        same = all(np.array_equal(a, b) for a, b in zip(first, outs))
        print(f"{place}: outputs equal host's bit for bit: {same}")


if __name__ == "__main__":
    main()
