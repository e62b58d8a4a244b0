"""Real supervisors, alternating settings: 64 greedy tokens each, page cache dropped before every
run (as root), the decode split and compute's pipeline counters per run, and whether every run
gave the same tokens.

  python docs/probes/real_split.py STORE ROUNDS "NAME:BENCH LINE:SHARE,..." [-v]

-v adds the router's stall, the loader's read and queue latencies and compute's messages per run.

e.g. "ahead:run_ahead = true:0.25,plain:run_ahead = false:0.25": each NAME runs with a config
holding `[bench]` and that line (";" between settings), and `--max-slots` at SHARE of the store's
experts.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from deltafin.client import Client
from deltafin.runtime.store import Store
from deltafin.tools.run import running_supervisor

PROMPT = [1, 504, 3458, 314, 260, 6123, 4876, 47, 198]


def main() -> None:
    store, rounds = sys.argv[1], int(sys.argv[2])
    verbose = "-v" in sys.argv[4:]
    modes = [m.split(":") for m in sys.argv[3].split(",")]
    n_keys = len(Store(store).records)
    first = {}
    for r in range(rounds):
        for name, line, share in modes:
            cfg = Path(f"/tmp/real_split-{name}.toml")
            cfg.write_text("[bench]\n" + line.replace(";", "\n") + "\n")
            subprocess.run("sync; echo 3 > /proc/sys/vm/drop_caches", shell=True, stderr=subprocess.DEVNULL)
            extra = ["--config", str(cfg), "--max-slots", str(int(n_keys * float(share)))]
            with running_supervisor(store, "4GiB", extra) as (ep, _):
                with Client(ep, timeout=120) as c:
                    done = c.generate(PROMPT, max_tokens=64)
                    workers = c.stats().get("workers", {})
                    comp = workers.get("compute", {})
            first.setdefault(name, done.token_ids)
            split = {k: round(v, 4) for k, v in done.stats.items() if k.endswith(("tok_s", "_s"))}
            pipe = {k: v for k, v in comp.get("pipeline", {}).items() if k != "resolved"}
            if "early_steps" in (comp.get("batch") or {}):
                pipe["early_steps"] = comp["batch"]["early_steps"]
            dec = done.stats.get("decode") or {}
            n = max(1, dec.get("tokens") or 1)  # the decode phase alone, ms per token
            per_tok = {k[:-2]: round(v * 1e3 / n, 3) for k, v in dec.items()
                       if k in ("total_s", "compute_s", "wait_s", "ipc_s", "prepare_s", "sync_s", "host_s")}
            print(f"r{r} {name} same={done.token_ids == first[name]} {json.dumps(split)} "
                  f"decode_ms_per_token={json.dumps(per_tok)} pipeline={pipe}", flush=True)
            if verbose:  # where a need's time goes outside compute: the router's stall, the loader's reads
                rt, ld = workers.get("router", {}), workers.get("loader", {})
                keep = ("hits", "uses", "misses_in_flight", "prefetch_reads", "lease_reads", "lease_used", "stall", "handled")
                print("   router", json.dumps({k: rt.get(k) for k in keep}), flush=True)
                lat = {k: {m: v for m, v in (ld.get(k) or {}).items() if m != "hist"}
                       for k in ("read", "demand_read", "queue_wait")}
                print("   loader", json.dumps({**lat, "reads": ld.get("reads"), "bytes": ld.get("bytes"),
                                             "mean_in_flight": ld.get("mean_in_flight")}), flush=True)
                prep = {m: v for m, v in (comp.get("prepare") or {}).items() if m != "hist"}
                print("   compute", json.dumps({"messages": comp.get("messages"), "prepare": prep}), flush=True)
    print("all same", len({tuple(t) for t in first.values()}) == 1)


if __name__ == "__main__":
    main()
