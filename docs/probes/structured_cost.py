"""Decode tok/s of constrained (json_schema; a tool_choice "required" grammar, Hermes
`<tool_call>` JSON, sent as the protocol's `grammar`) against unconstrained requests on the demo
store: same chat prompt, greedy, alternating rounds in one supervisor (all experts resident).
python docs/probes/structured_cost.py [ROUNDS] [TOKENS]   (docs: 7 32)"""
import json
import statistics
import sys
from pathlib import Path

from deltafin.client import Client
from deltafin.runtime.tokenizer import Tokenizer
from deltafin.tools.run import running_supervisor
from deltafin.workers.toolcalls import tool_grammar

STORE = Path.home() / ".cache/deltafin/demo-store"
ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 5
N = int(sys.argv[2]) if len(sys.argv) > 2 else 48
MSG = [{"role": "user", "content": "List many facts about the sky as a JSON object with a 'facts' array of strings."}]
SCHEMA = json.dumps({"type": "object", "properties": {"facts": {"type": "array", "items": {"type": "string"},
                     "minItems": 80}}, "required": ["facts"]})
TOOL = {"type": "function", "function": {"name": "facts", "parameters": json.loads(SCHEMA)}}
TOOL_GRAMMAR = tool_grammar("<tool_call>", Tokenizer(STORE / "tokenizer").added, [TOOL], parallel=False)
kinds = {"plain": {}, "json_schema": {"json_schema": SCHEMA}, "tool grammar": {"grammar": TOOL_GRAMMAR}}
res = {k: [] for k in kinds}
with running_supervisor(str(STORE), "4GiB") as (ep, _):
    with Client(ep, timeout=600) as c:
        c.generate(MSG, chat=True, max_tokens=8)  # warm
        for r in range(ROUNDS):
            for k, kw in kinds.items():
                d = c.generate(MSG, chat=True, max_tokens=N, **kw)
                res[k].append((d.stats["decode_tok_s"], len(d.token_ids), d.finish_reason))
            print(r, {k: f"{v[-1][0]:.1f} tok/s ({v[-1][1]} tok, {v[-1][2]})" for k, v in res.items()}, flush=True)
        print(d.text[:300])
for k in kinds:
    ratios = [p[0] / u[0] for p, u in zip(res[k], res["plain"])]
    print(f"{k:12s} median {statistics.median(x[0] for x in res[k]):7.1f} tok/s  "
          f"ratio to plain per round {[round(x, 3) for x in ratios]} median {statistics.median(ratios):.3f}")
