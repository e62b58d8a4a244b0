"""Probe (H200): a partially resident layer's cost, split per token, for several settings.

    python partial_layer.py STORE OUT.json "25;25-noleases;..."   (names: the keys of VARIANTS)

Each variant runs a fresh deltafin-supervisor (page cache dropped), generates 64 greedy tokens after
a 9-token prompt, and prints decode tok/s, hit rate, miss MB per token and the decode stats'
per-token split (sync, wait, ipc, prepare, compute), with the router and loader stats in OUT.json.
"""
import json, os, sys, tempfile, time
from deltafin.client import Client
from deltafin.tools.run import running_supervisor
store, out = sys.argv[1:3]
variants = sys.argv[3].split(";") if len(sys.argv) > 3 else None
prompt = [1, 17, 42, 99, 3, 250, 7, 301, 64]
N = int(os.environ.get("N", 64))
VARIANTS = {
  "100": (0, {}), "25": (64, {}),
  "25-noleases": (64, {"bench": {"leases": False}}),
  "25-noprefetch": (64, {"cache": {"prefetch": False}}),
  "25-noearly": (64, {"bench": {"early_fills": False}}),
  "25-noverify": (64, {"loader": {"verify_checksums": False}}),
  "25-threads8": (64, {"loader": {"threads": 8}}),
  "25-lru": (64, {"cache": {"policy": "lru", "prefetch": False}}),
  "25-sync": (64, {"bench": {"pipeline": "sync"}}),
  "25-noleases-noverify": (64, {"bench": {"leases": False}, "loader": {"verify_checksums": False}}),
  "50": (128, {}),
}
names = variants or list(VARIANTS)
res = {}
for name in names:
    slots, sec = VARIANTS[name]
    if os.environ.get("SLOTS_SCALE"): slots = int(slots * float(os.environ["SLOTS_SCALE"]))
    cfg = tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False)
    for s, kv in sec.items():
        cfg.write(f"[{s}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in kv.items()))
    cfg.close()
    extra = ["--config", cfg.name] + (["--max-slots", str(slots)] if slots else [])
    os.system("sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null")
    try:
        with running_supervisor(store, "24GiB", extra) as (ep, _):
            with Client(ep, timeout=300) as c:
                if not slots:
                    t0 = time.time()
                    while time.time() - t0 < 120:
                        if c.stats()["workers"]["compute"]["expert_tier"].get("fills", 0) >= 256:
                            break
                        time.sleep(0.2)
                d = c.generate(prompt, max_tokens=N)
                st = c.stats()
    except Exception as e:
        print(name, "FAILED", e, flush=True); continue
    dec = d.stats["decode"]; n = max(1, dec["tokens"])
    w = st["workers"]
    r = {"tok_s": (dec["tokens"] / dec["total_s"]) if dec.get("total_s") else None, "hit": st.get("hit_rate"), "tokens": list(d.token_ids),
         "per_token_ms": {k: round(v / n * 1e3, 3) for k, v in dec.items() if k.endswith("_s") and isinstance(v, (int, float))},
         "loop_ms": {k: round(v / n * 1e3, 3) for k, v in dec.get("loop", {}).items()},
         "miss_MB_per_token": dec.get("miss_bytes", 0) / n / 1e6,
         "compute": {k: w["compute"].get(k) for k in ("messages", "pipeline", "counters", "gate_syncs", "hints", "leases", "prepare")},
         "router": w.get("router"), "loader": w.get("loader")}
    res[name] = r
    print(f"{name:22s} {r['tok_s'] or 0:7.1f} tok/s hit {r['hit'] or 0:.3f} miss {r['miss_MB_per_token']:.2f} MB/tok "
          f"per-token ms {r['per_token_ms']} loop {r['loop_ms']}", flush=True)
json.dump(res, open(out, "w"), default=str)
