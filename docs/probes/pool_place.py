"""Where streaming pools should live on MLX CUDA: the issue-28 question "what does a partial layer's
expert compute cost the device", with the runtime's ResidentTier and switch_glu, no processes.

  python docs/probes/pool_place.py STORE [SLOTS_PER_LAYER [TOKENS [ROUNDS]]]

Placements (one tier each, every slot filled from the store's records):
  host    the runtime's today: pools advised into host memory, mapped for the GPU (place_on_host),
          filled with numpy; the GPU reads the experts over the bus
  device  the runtime's on MLX CUDA now (workers/resident.py DriverCopies): pools advised into
          device memory, filled by the driver's copies out of the records' buffer, pinned
  device-pageable  the same from pageable memory (the buffer not registered)
  managed MLX's placement (pages migrate to wherever touched last), filled with numpy
Prints per placement: a "token" of every MoE layer's switch_glu on 1 row, k experts among the
layer's slots, evaluated per layer (as a layer that reads its routing back) and once per token;
the time of one fill (median); and whether every placement's outputs equal the first's, bit for bit.
"""
from __future__ import annotations

import statistics
import sys
import time

import mlx.core as mx
import numpy as np

from deltafin.runtime.store import Store, views_from_buffer
from deltafin.runtime.tiers import layer_groups
from deltafin.runtime.models.switch import switch_glu
from deltafin.workers import resident as R

def main() -> None:
    store = Store(sys.argv[1])
    per_layer = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 64
    rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 3
    groups = layer_groups(store)
    layers = list(store.moe_layers)
    slots = {g: per_layer * list(groups.values()).count(g) for g in set(groups.values())}
    k = store.top_k
    size = store.max_record_bytes
    buf = np.zeros(len(layers) * per_layer * size, dtype=np.uint8)  # as the staging segment
    records = {}
    for i, layer in enumerate(layers):
        for j in range(per_layer):
            view = store.read_record(store.record(layer, j))
            at = (i * per_layer + j) * size
            buf[at:at + len(view)] = np.frombuffer(view, dtype=np.uint8)
            records[(layer, j)] = memoryview(buf)[at:at + len(view)]
    gate = next(t for t in store.layout(layers[0])["tensors"] if t["name"].startswith("gate_proj.w"))
    d = gate["shape"][-1] * 32 // store.layout(layers[0])["quant"]["gate_proj"]["bits"]
    rng = np.random.default_rng(0)
    xs = [mx.array(rng.standard_normal((1, d)).astype(np.float32)).astype(mx.bfloat16) for _ in range(tokens)]
    picks = [[np.sort(rng.choice(per_layer, k, replace=False)) for _ in layers] for _ in range(tokens)]
    results, report = {}, {}
    cuda = R._cuda_driver() is not None and mx.default_device() == mx.gpu
    for place in ("host", "device", "device-pageable", "managed") if cuda else ("host", "managed"):
        tier = R.ResidentTier(store, mx.bfloat16, slots, host_writes=True, on_host=place != "managed",
                              copies=place.startswith("device"))
        if place == "device":
            assert tier.copies.pin(buf)
        filler = tier.fill
        fill_ms = []
        for (layer, j), rec in records.items():
            g = tier.group_of[layer]
            slot = layers.index(layer) * per_layer + j if len(slots) == 1 else j
            t0 = time.perf_counter()
            filler(layer, j, slot, rec)
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
        report[place]["placement"] = tier.placement.get("why")
        print(place, report[place], flush=True)
        if tier.copies is not None:
            tier.copies.unpin()
        del tier
    first = next(iter(results.values()))
    for place, outs in results.items():
        same = all(np.array_equal(a, b) for a, b in zip(first, outs))
        print(f"{place}: outputs equal host's bit for bit: {same}")


if __name__ == "__main__":
    main()
