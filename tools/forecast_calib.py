"""deltafin-forecast's calibrations: the constants of the forecast measured on this machine.

- `calibrate_runs` (--calibrate run, a store): two short runs of the real runtime on the store
  (compute stand-in, 5% and 30% of the experts) give the fill, message and wait costs per layer
  with misses and per miss or round of reads, as the runtime's own processes see them.
- `measure_disk`, `measure_hop`, `measure_prepare` (--calibrate micro): a direct-read probe at the
  record size and queue depths 1..threads, a Need -> Slots round trip between two processes over
  the runtime's sockets (`python -m deltafin.tools.forecast_calib ENDPOINT` is the far end), and
  the prepare code alone.
"""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from deltafin.runtime.procs import stop_process


def measure_prepare(store, dtype: str = "float32", repeats: int = 15) -> dict:
    """Seconds to prepare one expert (record bytes -> stacked MLX arrays), with compute's own code
    (SlotExperts.chunks) over page-cache-resident record bytes, top-k experts at a time."""
    import mlx.core as mx

    from deltafin.runtime.models.base import resolve_dtype
    from deltafin.tools.mmap_baseline import MmapExperts, MmapSource
    src = MmapSource(store)
    try:
        experts = MmapExperts(store, None, 0, src, resolve_dtype(dtype, {}), max_chunk=store.top_k)
        layer = store.moe_layers[0]
        ids = list(range(store.top_k))
        for _ in experts.chunks(layer, ids):  # warm: the records into the page cache, kernels set up
            pass
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in experts.chunks(layer, ids):
                pass
            times.append((time.perf_counter() - t0) / len(ids))
        mx.clear_cache()
    finally:
        src.close()
    return {"s_per_expert": float(np.median(times)), "how": f"SlotExperts.chunks, {store.top_k} experts, "
            f"median of {repeats}"}


def _echo(endpoint: str) -> None:
    """The far end of the hop measurement: answers every Need with a Slots, like the router on a hit."""
    import zmq

    from deltafin.protocol import messages as M
    from deltafin.runtime.sockets import make_socket, recv, send
    ctx = zmq.Context()
    sock = make_socket(ctx, zmq.ROUTER)
    sock.bind(endpoint)
    print("ready", flush=True)
    while sock.poll(10_000):
        sender, msg = recv(sock, routed=True)
        if not isinstance(msg, M.Need):
            break
        send(sock, M.Slots(req=msg.req, layer=msg.layer, slots=[[e, e, 1] for e in msg.experts], hits=len(msg.experts),
                           wait_us=0), to=sender)
    ctx.destroy(linger=0)


def measure_hop(top_k: int, n: int = 400) -> dict:
    """Seconds of one Need -> Slots round trip between two processes over the runtime's sockets."""
    import tempfile

    import zmq

    from deltafin.protocol import messages as M
    from deltafin.runtime.sockets import make_socket, recv, send
    with tempfile.TemporaryDirectory() as td:
        endpoint = f"ipc://{td}/hop.ipc"
        child = subprocess.Popen([sys.executable, "-m", "deltafin.tools.forecast_calib", endpoint],
                                 stdout=subprocess.PIPE, text=True)
        ctx = zmq.Context()
        try:
            if child.stdout.readline().strip() != "ready":
                raise RuntimeError("the echo process did not start")
            sock = make_socket(ctx, zmq.DEALER, identity="compute")
            sock.connect(endpoint)
            times = []
            for i in range(n):
                t0 = time.perf_counter()
                send(sock, M.Need(req=i, layer=0, experts=list(range(top_k))))
                if not sock.poll(5000):
                    raise RuntimeError("no answer from the echo process within 5 s")
                recv(sock)
                times.append(time.perf_counter() - t0)
            send(sock, M.Release(req=n))  # tells the echo process to stop
        finally:
            ctx.destroy(linger=0)
            stop_process(child, 10, None)
    return {"s": float(np.median(times[n // 10:])), "how": f"median Need->Slots round trip over ipc, {n} trips"}


def measure_disk(store, threads: int, seconds: float) -> dict:
    """Direct-read bandwidth at the record size for queue depths 1..threads."""
    from deltafin.runtime.diskprobe import probe_disk
    out = {}
    for q in range(1, threads + 1):
        r = probe_disk(store.path, store.max_record_bytes, q, seconds=seconds, drop_cache=(q == 1))
        out[q] = r["gbps"]
    return {"gbps_by_queue_depth": out, "record_bytes": store.max_record_bytes}


def calibrate_run(store, trace_ids: np.ndarray, threads: int, policy: str, frac: float = 0.05,
                  offset: int = 500, prompt: int = 4, tokens: int = 24) -> dict:
    """Machine constants from a short run of the real runtime on `store` (see the module doc)."""
    import tempfile

    from deltafin.client import Client
    from deltafin.runtime.traces import save_trace
    from deltafin.tools.bench import plan_budget_for_slots
    from deltafin.tools.forecast import Shape, routing_steps
    from deltafin.tools.run import running_supervisor
    shape = Shape.of_store(store)
    n_slots = shape.slots_at(frac)
    n = prompt + tokens - 1
    rows = np.take(trace_ids, (np.arange(n) + offset) % len(trace_ids), axis=0)[:, :shape.n_moe, :]
    moe_ms, dense_ms = 1.0, 0.5
    budget = plan_budget_for_slots(store, n_slots, 64, "float32")
    with tempfile.TemporaryDirectory() as td:
        tpath = save_trace(Path(td) / "calib.npz", rows, [n], ["calibration"])
        extra = ["--max-slots", str(n_slots), "--max-context", "64", "--dtype", "float32", "--policy", policy,
                 "--routing-trace", str(tpath), "--standin", "--standin-moe-ms", str(moe_ms),
                 "--standin-dense-ms", str(dense_ms)]
        with running_supervisor(store.path, str(budget), extra, stderr=subprocess.DEVNULL) as (endpoint, _):
            with Client(endpoint, timeout=600) as c:
                gen = c.generate(list(range(1, prompt + 1)), max_tokens=tokens)
    d = gen.stats["decode"]
    steps = routing_steps(shape, rows, n_slots, policy, slice(prompt, n))
    rounds = float(np.ceil(steps / threads).sum())
    missing_layers = float((steps > 0).sum())
    misses = max(1.0, float(d["uses"] - d["hits"]))
    compute = (shape.n_moe * moe_ms + shape.n_dense * dense_ms) / 1e3
    t = d["tokens"]
    return {"how": f"in situ: {t} decode tokens of the runtime on {store.path.name}, stand-in "
                   f"{moe_ms}/{dense_ms} ms, {n_slots} slots ({frac:.0%}), trace rows from {offset}",
            "raw": {"tokens": t, "missing_layers": missing_layers, "misses": misses, "rounds": rounds,
                    "prepare_s": d["prepare_s"], "wait_s": d["wait_s"], "ipc_s": d["ipc_s"]},
            "prepare_s_per_miss": d["prepare_s"] / misses,
            "hop_s_per_missing_layer": d["ipc_s"] / max(1.0, missing_layers),
            "rest_s_per_token": max(0.0, (d["total_s"] - d["ipc_s"] - d["wait_s"] - d["prepare_s"]) / t - compute),
            "wait_s_per_round": d["wait_s"] / rounds if rounds else 0.0,
            "measured_hit_rate": d["hits"] / max(1, d["uses"]), "replayed_hit_rate":
                1 - float(steps.sum()) / (steps.size * shape.top_k)}


def calibrate_runs(store, trace_ids: np.ndarray, threads: int, policy: str, fracs=(0.05, 0.3)) -> dict:
    """Two short runs at different cache sizes separate what a layer with misses costs once (a
    message exchange, the first read's latency, the fill's fixed cost) from what each miss or
    round of reads adds: prepare = a x missing layers + b x misses, wait = c x missing layers +
    d x rounds, solved from the two runs' totals (least squares, never negative)."""
    runs = [calibrate_run(store, trace_ids, threads, policy, frac=f) for f in fracs]
    raw = [r["raw"] for r in runs]

    def fit(total, per_layer, per_unit):
        A = np.array([[r[per_layer], r[per_unit]] for r in raw], dtype=np.float64)
        y = np.array([r[total] for r in raw], dtype=np.float64)
        a, b = np.linalg.lstsq(A, y, rcond=None)[0]
        if a < 0 or b < 0:  # noise: fall back to one cost per unit
            return 0.0, float(y.sum() / A[:, 1].sum())
        return float(a), float(b)
    fill_layer, fill_miss = fit("prepare_s", "missing_layers", "misses")
    wait_layer, wait_round = fit("wait_s", "missing_layers", "rounds")
    layers = sum(r["missing_layers"] for r in raw)
    return {"how": "; ".join(r["how"] for r in runs), "runs": runs,
            "prepare_s_per_missing_layer": fill_layer, "prepare_s_per_miss": fill_miss,
            "wait_s_per_missing_layer": wait_layer, "wait_s_per_round": wait_round,
            "hop_s_per_missing_layer": sum(r["ipc_s"] for r in raw) / max(1.0, layers),
            "rest_s_per_token": float(np.mean([r["rest_s_per_token"] for r in runs]))}


if __name__ == "__main__":
    _echo(sys.argv[1])
