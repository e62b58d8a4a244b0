"""deltafin against mlx-lm with every expert resident, in one process, alternating rounds.

    python -m deltafin.tools.resident_compare --store STORE --mlx-model CKPT \\
        [--prompt-ids 1,2,3] [--tokens 32] [--rounds 10] [--sync-every-layer] [--json OUT]

On a shared machine two runs side by side see different loads; here mlx-lm (its generate_step)
and deltafin (`Compute` with router and loader in-process, the resident tier preloaded, so no
read, fill or message happens while generating) take turns in the same process, and the report
is the median of the per-round ratios of decode tok/s, plus the ratio of CPU time per token
(all threads of the process), which the other processes' load disturbs less. CKPT is the mlx-lm
checkpoint the store was converted from (or deltafin-export-mlx of it), same dtype.
--sync-every-layer reads the gate's choice back at every MoE layer even where all are resident, to price
that sync.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from deltafin.runtime.cli import Help


def run(store_path: str, mlx_model: str, prompt: list[int], tokens: int, rounds: int,
        sync_every_layer: bool = False, log=print) -> dict:
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load

    from deltafin.protocol import messages as M
    from deltafin.runtime.config import load_config
    from deltafin.runtime.store import Store
    from deltafin.tools.inprocess import local_router
    from deltafin.workers.engine import Compute

    model, _ = load(mlx_model)
    config = load_config().to_dict()
    store = Store(store_path)
    source, staging, loader = local_router(store, config, len(store.records))
    compute = Compute(store, config, source, staging, store.max_record_bytes)
    preloaded = compute.preload()
    compute.experts.force_sync = sync_every_layer

    def mlx_lm() -> tuple[float, list, float]:
        out, t1, c1 = [], 0.0, 0.0
        for (tok, _), n in zip(generate_step(mx.array(prompt), model, max_tokens=tokens), range(tokens)):
            if n == 0:  # decode starts at the first token, as in mlx-lm's stream_generate
                t1, c1 = time.perf_counter(), time.process_time()
            out.append(int(tok))
        return (tokens - 1) / (time.perf_counter() - t1), out, (time.process_time() - c1) / (tokens - 1)

    loops = []  # per round: deltafin's decode loop, seconds per token in each part

    def deltafin() -> tuple[float, list, float]:
        cpu, read = [], compute.scheduler.read

        def timed_read(step):
            tok = read(step)
            cpu.append(time.process_time())
            return tok
        compute.scheduler.read = timed_read
        try:
            done = compute.generate(M.Generate(id=1, token_ids=prompt, max_tokens=tokens, stream=False))
        finally:
            compute.scheduler.read = read
        loops.append({k: v / max(1, done.stats["decode"]["tokens"]) for k, v in done.stats["decode"]["loop"].items()})
        return done.stats["decode_tok_s"], done.token_ids, (cpu[-1] - cpu[0]) / (len(cpu) - 1)

    try:
        mlx_lm(), deltafin()  # warm both: kernels, allocator
        fills, needs = compute.experts.tier.fills, source.messages.get("need")
        syncs = compute.experts.counters.get("gate_syncs")
        rows = []
        for r in range(rounds):
            order = (("mlx-lm", mlx_lm), ("deltafin", deltafin))
            got = dict((name, f()) for name, f in (order if r % 2 == 0 else order[::-1]))
            row = {"mlx_lm_tok_s": got["mlx-lm"][0], "deltafin_tok_s": got["deltafin"][0],
                   "ratio": got["deltafin"][0] / got["mlx-lm"][0],
                   "cpu_ratio": got["mlx-lm"][2] / got["deltafin"][2],
                   "same_tokens": got["mlx-lm"][1] == got["deltafin"][1]}
            rows.append(row)
            log(f"round {r}: mlx-lm {row['mlx_lm_tok_s']:.2f} tok/s, deltafin {row['deltafin_tok_s']:.2f} "
                f"tok/s, ratio {row['ratio']:.3f}, CPU-time ratio {row['cpu_ratio']:.3f}, "
                f"same tokens {row['same_tokens']}")
        return {"store": str(store_path), "mlx_model": mlx_model, "tokens": tokens, "rounds": rows,
                "median_ratio": float(np.median([r["ratio"] for r in rows])),
                "median_cpu_ratio": float(np.median([r["cpu_ratio"] for r in rows])),
                "all_same_tokens": all(r["same_tokens"] for r in rows),
                "deltafin_loop_ms_per_token": {k.removesuffix("_s"): 1e3 * float(np.median([lp[k] for lp in loops[1:]]))
                                               for k in loops[-1]},
                "mlx_lm_ms_per_token": 1e3 / float(np.median([r["mlx_lm_tok_s"] for r in rows])),
                "sync_every_layer": sync_every_layer, "device": str(mx.default_device()),
                "preloaded_layers": preloaded,
                "fills_while_generating": compute.experts.tier.fills - fills,
                "needs_while_generating": source.messages.get("need") - needs,
                "gate_syncs_while_generating": compute.experts.counters.get("gate_syncs") - syncs}
    finally:
        loader.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(formatter_class=Help, prog="deltafin-resident-compare", description=__doc__.split("\n\n")[0])
    p.add_argument("--store", required=True)
    p.add_argument("--mlx-model", required=True, help="the mlx-lm checkpoint of the same weights")
    p.add_argument("--prompt-ids", default="1,17,42,99,3,250,7,301,64,12,5,400")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--sync-every-layer", action="store_true")
    p.add_argument("--json", metavar="OUT")
    a = p.parse_args(argv)
    if a.tokens < 3 or a.rounds < 1:
        p.error("--tokens >= 3 and --rounds >= 1")
    prompt = [int(t) for t in a.prompt_ids.split(",") if t.strip()]
    out = run(a.store, a.mlx_model, prompt, a.tokens, a.rounds, a.sync_every_layer,
              log=lambda m: print(m, file=sys.stderr, flush=True))
    text = json.dumps(out, indent=1)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")
    print(f"median deltafin/mlx-lm decode tok/s {out['median_ratio']:.3f}, CPU time {out['median_cpu_ratio']:.3f}, "
          f"same tokens {out['all_same_tokens']}, fills {out['fills_while_generating']}, needs "
          f"{out['needs_while_generating']} while generating")
    print(f"per token: mlx-lm {out['mlx_lm_ms_per_token']:.3f} ms; deltafin's loop (ms) " +
          ", ".join(f"{k} {v:.3f}" for k, v in out["deltafin_loop_ms_per_token"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
