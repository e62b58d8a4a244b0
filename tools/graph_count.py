"""One decode token's graph in deltafin and in mlx-lm, counted primitive by primitive.

    python -m deltafin.tools.graph_count --store STORE --mlx-model CKPT \\
        [--prompt-ids 1,2,3] [--token 4] [--json OUT]
    python -m deltafin.tools.graph_count --store STORE --batch 1,4 [--json OUT]

On a GPU a decode token's time is mostly launching and queuing its kernels, one or more per
primitive, so the graph each side hands to the device per token says where deltafin does more
than mlx-lm. Both run their own decode loop (deltafin: `Compute` with every expert resident,
router and loader in-process, as tools/resident_compare.py; mlx-lm: its generate_step) on the same
weights; `mx.async_eval` is wrapped for the run, and the arrays of its `--token`-th call (one per
token on both sides) are exported with `mx.export_to_dot` before they are evaluated. The calls
before it are waited for, so that graph holds one token only. Each primitive node of the DOT file
counts once (a compiled function, e.g. the fused SwiGLU, is one `Compiled` node); `leaves` are the
evaluated arrays the graph reads (weights, caches, the input token).

`--batch 1,4` counts instead one decode step of B sequences decoded together (the compute
process's `Scheduler`, every expert resident), for each B: where a step of B rows does B times the
work of one row, its count says which primitives grow with the rows.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from collections import Counter
from contextlib import contextmanager

import mlx.core as mx

from deltafin.runtime.cli import Help

PRIMITIVE = re.compile(r'\[label ="([^"]+)", shape=rectangle\]')
LEAF = re.compile(r'\{ rank=source; "([^"]+)"; \}')


def primitives(*outputs) -> tuple[Counter, int]:
    """(primitive name -> nodes, leaves) of the unevaluated graph behind `outputs`."""
    fd, path = tempfile.mkstemp(suffix=".dot", prefix="deltafin-graph-")
    os.close(fd)
    try:
        mx.export_to_dot(path, *outputs)
        with open(path) as f:
            text = f.read()
    finally:
        os.unlink(path)
    return Counter(PRIMITIVE.findall(text)), len(set(LEAF.findall(text)))


@contextmanager
def capture_launch(token: int):
    """Wraps mx.async_eval: its `token`-th call's arrays are counted (into the yielded dict) before
    being launched; earlier calls are waited for, so that graph starts from evaluated arrays."""
    launch, got, calls = mx.async_eval, {}, [0]

    def counted(*arrays):
        calls[0] += 1
        if calls[0] == token:
            got["primitives"], got["leaves"] = primitives(*arrays)
        launch(*arrays)
        if calls[0] < token:
            mx.eval(*arrays)

    mx.async_eval = counted
    try:
        yield got
    finally:
        mx.async_eval = launch


def mlx_lm_graph(mlx_model: str, prompt: list[int], token: int) -> dict:
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load

    model, _ = load(mlx_model)
    with capture_launch(token) as got:
        for _, n in zip(generate_step(mx.array(prompt), model, max_tokens=token + 1), range(token + 1)):
            pass
    return got


@contextmanager
def resident_compute(store_path: str, max_batch: int = 0):
    """An in-process compute with every expert of the store resident (preloaded)."""
    from deltafin.runtime.config import load_config
    from deltafin.runtime.store import Store
    from deltafin.tools.inprocess import local_router
    from deltafin.workers.engine import Compute

    config = load_config().to_dict()
    if max_batch:
        config["compute"]["max_batch"] = max(max_batch, int(config["compute"].get("max_batch", 1)))
    store = Store(store_path)
    source, staging, loader = local_router(store, config, len(store.records))
    try:
        compute = Compute(store, config, source, staging, store.max_record_bytes)
        compute.preload()
        if not compute.experts.tier.all_full():
            raise RuntimeError("not every expert is resident: the count would include misses")
        yield compute
    finally:
        loader.close()


def deltafin_graph(store_path: str, prompt: list[int], token: int) -> dict:
    from deltafin.protocol import messages as M
    with resident_compute(store_path) as compute, capture_launch(token) as got:
        compute.generate(M.Generate(id=1, token_ids=prompt, max_tokens=token + 1, stream=False))
    return got


def batch_graph(store_path: str, prompts: list[list[int]], token: int = 2) -> dict:
    """One decode step of len(prompts) sequences decoded together, counted as `deltafin_graph`
    counts a token: every prompt is prefilled and every sequence has decoded once, then the
    scheduler's `token`-th launch (a step of all rows) is counted."""
    from deltafin.protocol import messages as M
    with resident_compute(store_path, max_batch=len(prompts)) as compute:
        compute.eos_ids = set()  # every row decodes on whatever it samples: the count needs B rows
        sched = compute.scheduler
        seqs = [compute.start(M.Generate(id=i + 1, token_ids=p, max_tokens=token + 8, stream=False))
                for i, p in enumerate(prompts)]
        for seq in seqs:
            sched.add(seq)
        while sched.filling or any(not s.out_ids for s in seqs):  # all prefilled, all decoding
            sched.step()
        with capture_launch(token) as got:
            for _ in range(token):
                sched.step()
        for seq in seqs:
            sched.leave(seq, "cancelled")
        if "primitives" not in got:
            raise RuntimeError("fewer launches than --token")
        return {"rows": len(prompts), "total": sum(got["primitives"].values()), **got}


def batch_counts(store_path: str, prompt: list[int], sizes: list[int], token: int = 2) -> dict:
    """{B: batch_graph} for each B in sizes; row i's prompt is `prompt` without its first i
    tokens, so the rows' caches differ in length (as concurrent requests' do)."""
    return {b: batch_graph(store_path, [prompt[min(i, len(prompt) - 1):] for i in range(b)], token) for b in sizes}


def batch_table(counts: dict) -> str:
    sizes = sorted(counts)
    names = sorted({k for c in counts.values() for k in c["primitives"]},
                   key=lambda k: (-counts[sizes[-1]]["primitives"][k], k))
    rows = [("primitive", *(f"B={b}" for b in sizes))]
    rows += [(k, *(str(counts[b]["primitives"][k]) for b in sizes)) for k in names]
    rows += [("total", *(str(counts[b]["total"]) for b in sizes)),
             ("per row", *(f"{counts[b]['total'] / b:.1f}" for b in sizes)),
             ("leaves", *(str(counts[b]["leaves"]) for b in sizes))]
    w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(f"{c:<{w[0]}}" if i == 0 else f"{c:>{w[i]}}" for i, c in enumerate(r)) for r in rows)


def compare(store_path: str, mlx_model: str, prompt: list[int], token: int = 4) -> dict:
    d = deltafin_graph(store_path, prompt, token)
    m = mlx_lm_graph(mlx_model, prompt, token)
    if "primitives" not in d or "primitives" not in m:
        raise RuntimeError("a side launched fewer tokens than --token")
    names = sorted(set(d["primitives"]) | set(m["primitives"]),
                   key=lambda k: (-(d["primitives"][k] - m["primitives"][k]), k))
    return {"store": str(store_path), "mlx_model": mlx_model, "token": token, "device": str(mx.default_device()),
            "primitives": {k: {"deltafin": d["primitives"][k], "mlx_lm": m["primitives"][k]} for k in names},
            "total": {"deltafin": sum(d["primitives"].values()), "mlx_lm": sum(m["primitives"].values())},
            "leaves": {"deltafin": d["leaves"], "mlx_lm": m["leaves"]}}


def table(out: dict) -> str:
    rows = [("primitive", "deltafin", "mlx-lm", "extra")]
    for k, v in out["primitives"].items():
        rows.append((k, str(v["deltafin"]), str(v["mlx_lm"]), f"{v['deltafin'] - v['mlx_lm']:+d}"))
    for k in ("total", "leaves"):
        v = out[k]
        rows.append((k, str(v["deltafin"]), str(v["mlx_lm"]), f"{v['deltafin'] - v['mlx_lm']:+d}"))
    w = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join(f"{r[0]:<{w[0]}}  {r[1]:>{w[1]}}  {r[2]:>{w[2]}}  {r[3]:>{w[3]}}" for r in rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(formatter_class=Help, prog="deltafin-graph-count", description=__doc__.split("\n\n")[0])
    p.add_argument("--store", required=True)
    p.add_argument("--mlx-model", help="the mlx-lm checkpoint of the same weights (not with --batch)")
    p.add_argument("--batch", metavar="B,B", help="count a step of B sequences decoded together, per B")
    p.add_argument("--prompt-ids", default="1,17,42,99,3,250,7,301,64,12,5,400")
    p.add_argument("--token", type=int, default=4, help="which launched token's graph (>= 2: a decode step)")
    p.add_argument("--json", metavar="OUT")
    a = p.parse_args(argv)
    if a.token < 2:
        p.error("--token >= 2 (the first launch follows the prefill)")
    prompt = [int(t) for t in a.prompt_ids.split(",") if t.strip()]
    if a.batch:
        counts = batch_counts(a.store, prompt, [int(b) for b in a.batch.split(",")], a.token)
        if a.json:
            with open(a.json, "w") as f:
                f.write(json.dumps({"store": str(a.store), "device": str(mx.default_device()),
                                    "steps": counts}, indent=1) + "\n")
        print(f"one decode step's graph (launch {a.token} after all rows decode), {mx.default_device()}")
        print(batch_table(counts))
        return 0
    if not a.mlx_model:
        p.error("--mlx-model is required (or --batch)")
    out = compare(a.store, a.mlx_model, prompt, a.token)
    if a.json:
        with open(a.json, "w") as f:
            f.write(json.dumps(out, indent=1) + "\n")
    print(f"one decode token's graph (launch {a.token}), {out['device']}")
    print(table(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
