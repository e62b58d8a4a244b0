"""Time to first token of a request sharing a 2,000-token prefix with the one before it, on the
demo store: python docs/probes/prompt_cache_ttft.py BUDGET PROMPT_CACHE MAX_CONTEXT [SUPERVISOR ARGS]
(docs/BENCHMARKS.md: 520MiB 100MiB 2048). The text: this repository's README and ARCHITECTURE."""
import json, sys, time
from pathlib import Path
from deltafin.client import Client
from deltafin.runtime.tokenizer import Tokenizer
from deltafin.tools.run import running_supervisor

store = Path.home() / ".cache/deltafin/demo-store"
budget, cache, ctx = sys.argv[1], sys.argv[2], sys.argv[3]
tok = Tokenizer(store / "tokenizer")
root = Path(__file__).resolve().parents[2]
text = (root / "README.md").read_text() + (root / "docs" / "ARCHITECTURE.md").read_text()
ids = tok.encode(text)
prefix = ids[:2000]
tails = [ids[3000:3024], ids[4000:4024]]
out = {"budget": budget, "prompt_cache": cache, "max_context": ctx, "prefix": len(prefix), "runs": []}
with running_supervisor(store, budget, ["--prompt-cache", cache, "--max-context", ctx] + sys.argv[4:], timeout=600) as (ep, _):
    with Client(ep, timeout=3600) as c:
        for i, tail in enumerate(tails):
            t0 = time.perf_counter(); first = None; toks = []
            for ev in c.stream(prefix + tail, max_tokens=4):
                if first is None:
                    first = time.perf_counter() - t0
                toks.append(ev)
            out["runs"].append({"ttft_s": first, "total_s": time.perf_counter() - t0})
            print(i, out["runs"][-1], flush=True)
        st = c.stats()
        out["stats_prompt_cache"] = st.get("prompt_cache") or {k: v for k, v in st.items() if "prompt" in k}
out["ratio"] = out["runs"][1]["ttft_s"] / out["runs"][0]["ttft_s"]
print(json.dumps(out, default=str))
