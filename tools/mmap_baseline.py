"""The memory-mapped baseline (the benchmark's "what llama.cpp mainline does" contender): one greedy
generation in this process with the store's expert files mmapped, read through the OS page cache,
no cache of deltafin's own and no workers. The same prepare code and kernels as the runtime.

    python -m deltafin.tools.mmap_baseline STORE --prompt-ids 1,2,3 --max-tokens 32 \\
        [--config-json '{"bench": {"routing_trace": "t.npz"}}'] [--cold] [--json OUT.json]
"""
from __future__ import annotations

import argparse
import json
import sys

from deltafin.runtime.config import ConfigError, load_config
from deltafin.runtime.store import StoreError


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="deltafin-mmap-baseline", description=__doc__.split("\n\n")[0])
    p.add_argument("store", nargs="?", help="expert store directory")
    p.add_argument("--store", dest="store_opt", metavar="STORE", help="the same, as an option")
    p.add_argument("--prompt-ids", required=True, help="comma-separated token ids")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--config-json", default="{}",
                   help='overrides of the config tree as JSON, e.g. {"compute": {"dtype": "float32"}}')
    p.add_argument("--source", choices=("mmap", "slots"), default="mmap",
                   help="mmap: the baseline; slots: router + loader in-process, for comparison")
    p.add_argument("--cold", action="store_true", help="drop the expert files from the page cache first")
    p.add_argument("--json", metavar="OUT", help="write the stats here (default: stdout)")
    a = p.parse_args(argv)
    store = a.store or a.store_opt
    if not store:
        p.error("give the store directory")
    from deltafin.workers.compute import run_inprocess
    try:
        overrides = json.loads(a.config_json)
        if not isinstance(overrides, dict) or not all(isinstance(v, dict) for v in overrides.values()):
            raise ConfigError('--config-json must be {"section": {"key": value}, ...}')
        flat = {f"{section}.{key}": v for section, kv in overrides.items() for key, v in kv.items()}
        config = load_config(None, flat).to_dict()
        prompt = [int(t) for t in a.prompt_ids.split(",") if t.strip()]
        stats = run_inprocess(store, config, prompt, a.max_tokens, source=a.source, cold=a.cold)
    except (ConfigError, StoreError, ValueError) as e:  # ValueError: bad JSON, ids or prompt
        print(f"deltafin-mmap-baseline: error: {e}", file=sys.stderr)
        return 2
    text = json.dumps(stats, indent=1)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
