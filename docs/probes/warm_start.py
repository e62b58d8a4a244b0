"""A start from an empty kernel cache under a short runtime.startup_timeout_s: the supervisor must
wait out compute's warm-up on its progress reports (runtime.warmup_timeout_s), then serve.

  python docs/probes/warm_start.py STORE SHARE STARTUP_TIMEOUT_S

Prints the seconds to READY, compute's warm_up_s, the first 64-token request's seconds, and the
supervisor's warm-up lines.
"""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from deltafin.client import Client
from deltafin.runtime.store import Store
from deltafin.tools.run import running_supervisor

PROMPT = [1, 504, 3458, 314, 260, 6123, 4876, 47, 198]


def main() -> None:
    store, share, startup = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
    work = Path(tempfile.mkdtemp(prefix="warm_start-"))
    cfg = work / "c.toml"
    cfg.write_text(f"[runtime]\nstartup_timeout_s = {startup}\n")
    slots = int(len(Store(store).records) * share)
    t0 = time.monotonic()
    with open(work / "err.log", "w") as err, running_supervisor(
            store, "4GiB", ["--config", str(cfg), "--max-slots", str(slots)], stderr=err) as (ep, _):
        ready = time.monotonic() - t0
        with Client(ep, timeout=300) as c:
            t1 = time.monotonic()
            done = c.generate(PROMPT, max_tokens=64)
            first = time.monotonic() - t1
            warm = c.health()["workers"]["compute"].get("warm_up_s")
    log = (work / "err.log").read_text().splitlines()
    print(f"ready after {ready:.1f} s (startup_timeout_s {startup:g}); compute's warm_up_s {warm}; "
          f"first request {first:.2f} s, {len(done.token_ids)} tokens, "
          f"decode {done.stats.get('decode_tok_s', 0):.1f} tok/s", flush=True)
    for line in log:
        if "warm" in line or "timed out" in line:
            print("  " + line)


if __name__ == "__main__":
    main()
