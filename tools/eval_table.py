"""The lossy trade as a table: deltafin-eval on one store for the exact mode and cache_aware at
several margins, each a fresh runtime at the same share of the experts, in alternating rounds
(exact, m1, m2, ..., exact, m1, ...), so a loaded machine's drift falls on every setting alike.

    python -m deltafin.tools.eval_table --model STORE --cache-frac 0.25 --margins 0.1,0.3,0.5 \\
        --rounds 2 --tokens 128 --generate 32 --json OUT.json

Per setting: perplexity and its change against the exact reference, top-1 agreement, bytes the
loader read per evaluated position (demand and prefetch), bytes of the misses compute waited for
per decoded token, and decode tok/s of a greedy generation (medians over the rounds; the ratio to
exact is taken within each round first). The
Markdown table goes to stdout (docs/BENCHMARKS.md, "Lossy routing").
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from deltafin.runtime.cli import Help
from deltafin.tools import eval as ev
from deltafin.tools.bench_modes import lossy_flags


def settings(margins: list[float], max_share: float) -> list[tuple[str, list[str]]]:
    """(label, deltafin-eval flags) for exact and each margin."""
    return [("exact", []), *((f"cache_aware m={m:g}", lossy_flags(m, max_share)) for m in margins)]


def eval_args(a, flags: list[str]):
    return ev.parser().parse_args(["--model", a.model, "--cache-frac", str(a.cache_frac), "--tokens",
                                   str(a.tokens), "--window", str(a.window), "--generate", str(a.generate),
                                   *(["--config", a.config] if a.config else []), *flags])


def rows(runs: dict[str, list[dict]]) -> list[dict]:
    """Per setting: medians over rounds, decode tok/s also as a ratio to exact's in each round."""
    out = []
    exact = runs["exact"]
    for label, rs in runs.items():
        med = lambda f: statistics.median([f(r) for r in rs])
        ratio = statistics.median([r["decode"]["tok_s"] / e["decode"]["tok_s"] for r, e in zip(rs, exact)])
        out.append({"setting": label, "ppl": med(lambda r: r["runtime"]["ppl"]),
                    "ppl_change_pct": med(lambda r: r["ppl_change_pct"]),
                    "top1_agreement": med(lambda r: r["top1_agreement"]),
                    "bytes_per_position": med(lambda r: r["bytes_read_per_token"]),
                    "bytes_per_decode_token": med(lambda r: r["decode"]["miss_bytes_per_token"]),
                    "decode_tok_s": med(lambda r: r["decode"]["tok_s"]), "decode_vs_exact": ratio,
                    "rerouted_per_position": med(lambda r: (r["lossy"] or {}).get("rerouted", 0) / r["tokens"])})
    return out


def markdown(table: list[dict]) -> str:
    lines = ["| setting | ppl | ppl change | top-1 agreement | MB read / position | MB demand-read / decode token "
             "| decode tok/s | vs exact | rerouted / position |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        lines.append(f"| {r['setting']} | {r['ppl']:.3f} | {r['ppl_change_pct']:+.2f}% | {r['top1_agreement']:.1%} "
                     f"| {r['bytes_per_position'] / 1e6:.1f} | {r['bytes_per_decode_token'] / 1e6:.1f} "
                     f"| {r['decode_tok_s']:.2f} | {r['decode_vs_exact']:.2f}x | {r['rerouted_per_position']:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(formatter_class=Help, prog="python -m deltafin.tools.eval_table",
                                description="deltafin-eval for exact and cache_aware margins, alternating rounds; "
                                            "a Markdown table of the trade.")
    p.add_argument("--model", required=True, help="expert store")
    p.add_argument("--cache-frac", type=float, default=0.25, help="share of the experts with a slot")
    p.add_argument("--margins", default="0.1,0.3,0.5", help="cache_aware margins, comma-separated")
    p.add_argument("--max-share", type=float, default=0.5, help="lossy.max_share for every margin")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds over the settings")
    p.add_argument("--tokens", type=int, default=128, help="held-out tokens evaluated per run")
    p.add_argument("--window", type=int, default=64, help="tokens per logits request")
    p.add_argument("--generate", type=int, default=32, help="greedy tokens generated per run (decode tok/s)")
    p.add_argument("--config", help="TOML file for every runtime and the reference (e.g. compute.dtype)")
    p.add_argument("--json", metavar="OUT", help="every run and the table as JSON")
    a = p.parse_args(argv)
    todo = settings([float(m) for m in a.margins.split(",")], a.max_share)
    runs: dict[str, list[dict]] = {label: [] for label, _ in todo}
    base = eval_args(a, [])
    store_path, _, wins = ev.prepare(base)
    ref = ev.reference_logits(base, store_path, wins)  # the exact store, all resident: once
    for _ in range(a.rounds):
        for label, flags in todo:
            result = ev.evaluate(eval_args(a, flags), ref)
            print(ev.table(result), file=sys.stderr, flush=True)
            runs[label].append(result)
    table = rows(runs)
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "runs": runs, "table": table}, indent=1))
    print(markdown(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
