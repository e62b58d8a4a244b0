"""deltafin-bench's report (tools/bench.py): a contender's summary over its rounds, the prefetch
sweep, the machine's description, and the report's chart (chart.png) and terminal table."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import psutil

from deltafin.runtime.config import format_size
from deltafin.tools.bench import REGIMES
from deltafin.tools.bench_modes import PF_PREFIX


# ------------------------------------------------------------------------------------ rounds

# Figures a contender's summary over rounds gives as the median of its rounds.
ROUND_KEYS = ("decode_tok_s", "prefill_tok_s", "ttft_s", "hit_rate", "bytes_read_per_token",
              "bytes_read_per_token_all", "stall_share", "prefetch_precision", "prefetch_recall",
              "ssd_gbps", "host_s_per_token", "missed_passes", "miss_s_per_token")


def summarize_rounds(runs: list[dict]) -> dict:
    """One contender over its rounds (run alternating with the others, so that a slow spell of
    the shared machine falls on every contender): the round nearest the median decode rate, with
    ROUND_KEYS replaced by their medians over the rounds that ran, the disk's busy share by its
    median too, the peak tree PSS by the highest round's (a peak is a maximum: on fresh H100s
    the first round peaked near 4 GB, the others near 1.1 GB; docs/BENCHMARKS.md, stop 66),
    each round's figures under "rounds" and the decode rate's spread (max / min). A single
    round is returned as it is."""
    if len(runs) == 1:
        return runs[0]
    ok = [r for r in runs if r.get("ok") and r.get("decode_tok_s")]
    per_round = [{"ok": bool(r.get("ok")), "cause": r.get("cause"), "load_average": r.get("load_average"),
                  "disk_busy_share": (r.get("loader") or {}).get("disk_busy_share"),
                  "peak_tree_pss_bytes": r.get("peak_tree_pss_bytes"),
                  **{k: r.get(k) for k in ROUND_KEYS}} for r in runs]
    if not ok:
        return {**runs[0], "rounds": per_round, "rounds_ok": 0}
    rates = [r["decode_tok_s"] for r in ok]
    mid = float(np.median(rates))
    out = dict(min(ok, key=lambda r: abs(r["decode_tok_s"] - mid)))
    for k in ROUND_KEYS:
        vals = [r[k] for r in ok if r.get(k) is not None]
        out[k] = float(np.median(vals)) if vals else None
    busy = [b for b in ((r.get("loader") or {}).get("disk_busy_share") for r in ok) if b is not None]
    if busy:
        out["loader"] = {**(out.get("loader") or {}), "disk_busy_share": float(np.median(busy))}
    peaks = [r["peak_tree_pss_bytes"] for r in ok if r.get("peak_tree_pss_bytes") is not None]
    if peaks:
        out["peak_tree_pss_bytes"] = max(peaks)
    out["time_per_token_s"] = 1.0 / out["decode_tok_s"]
    out.update(rounds=per_round, rounds_ok=len(ok), decode_tok_s_spread=max(rates) / min(rates),
               decode_tok_s_range=[min(rates), max(rates)])
    return out


def token_agreement(tokens: list[int], ref: list[int]) -> dict:
    """Whether `tokens` equal the reference's, and where they first differ (an index, or the
    shorter length when one is a prefix of the other; None when equal)."""
    first = next((i for i, (a, b) in enumerate(zip(tokens, ref)) if a != b), None)
    if first is None and len(tokens) != len(ref):
        first = min(len(tokens), len(ref))
    return {"exact": first is None, "first_divergence": first}


def agreement_over_rounds(runs: list[dict], ref_runs: list[dict]) -> dict | None:
    """A contender's tokens against mlx-lm's, round by round (each round's pair that both ran):
    exact when every compared round gave mlx-lm's tokens; the earliest divergence seen; None when
    no round had both."""
    pairs = [(r["token_ids"], ref["token_ids"]) for r, ref in zip(runs, ref_runs)
             if r.get("ok") and ref.get("ok") and r.get("token_ids") is not None and ref.get("token_ids") is not None]
    if not pairs:
        return None
    each = [token_agreement(t, ref) for t, ref in pairs]
    firsts = [a["first_divergence"] for a in each if a["first_divergence"] is not None]
    return {"exact": all(a["exact"] for a in each), "first_divergence": min(firsts) if firsts else None,
            "rounds_compared": len(each), "rounds_exact": sum(a["exact"] for a in each)}


def prefetch_sweep(contenders: dict) -> dict | None:
    """Over the deltafin-pf contenders: the slowest prefetch setting against prefetch off
    (deltafin-no-prefetch), by decode tok/s."""
    gated, fixed = {}, {}
    for name, r in contenders.items():
        if not (r.get("ok") and r.get("decode_tok_s")):
            continue
        if name.startswith(PF_PREFIX):
            gated[name] = r["decode_tok_s"]
        elif name == "deltafin-no-prefetch":
            fixed[name] = r["decode_tok_s"]
    if not gated or not fixed:
        return None
    worst, best = min(gated, key=gated.get), max(fixed, key=fixed.get)
    return {"min_gated": worst, "min_gated_tok_s": gated[worst], "max_fixed": best,
            "max_fixed_tok_s": fixed[best], "ratio": gated[worst] / fixed[best], "goal": 0.97}


# ------------------------------------------------------------------------------------ machine

def machine_info() -> dict:
    import platform

    import mlx.core as mx
    return {"platform": platform.platform(), "machine": platform.machine(), "cpus": os.cpu_count(),
            "memory_bytes": psutil.virtual_memory().total, "python": platform.python_version(),
            "mlx": mx.__version__, "mlx_device": str(mx.default_device())}


# ------------------------------------------------------------------------------------ output

def chart(report: dict, path: Path) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'deltafin[bench]'): no chart"
    regimes = [r for r in REGIMES if r in report["regimes"]]
    fig, axes = plt.subplots(2, len(regimes), figsize=(6.5 * len(regimes), 8), squeeze=False)
    colors = {"compute": "#4c72b0", "wait": "#dd8452", "prepare": "#55a868", "ipc": "#c44e52", "other": "#8c8c8c"}
    for col, regime in enumerate(regimes):
        rr = report["regimes"][regime]
        names = [n for n, r in rr["contenders"].items() if r.get("ok")]
        ax = axes[0][col]
        for i, n in enumerate(names):
            r = rr["contenders"][n]
            total = (r.get("time_per_token_s") or 0) * 1e3
            bottom = 0.0
            parts = list((r.get("split_per_token_s") or {}).items())
            parts.append(("other", max(0.0, total / 1e3 - sum(v for _, v in parts))))
            for k, v in parts:
                ax.bar(i, v * 1e3, bottom=bottom, color=colors.get(k, "#999"), label=k)
                bottom += v * 1e3
        ax.axhline(rr["bound"]["s_per_token"] * 1e3, color="k", ls="--", lw=1, label="bound")
        ax.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=8)
        ax.set_ylabel("ms per decode token")
        ax.set_title(f"{regime}: time per token by stage")
        handles, labels = ax.get_legend_handles_labels()
        uniq = dict(zip(labels, handles))
        ax.legend(uniq.values(), uniq.keys(), fontsize=7)
        ax = axes[1][col]
        all_names = list(rr["contenders"])
        vals = [rr["contenders"][n].get("decode_tok_s") or 0 for n in all_names]
        ax.bar(range(len(all_names)), vals, color="#4c72b0")
        ax.axhline(1.0 / rr["bound"]["s_per_token"], color="k", ls="--", lw=1, label="1 / bound")
        for i, n in enumerate(all_names):
            r = rr["contenders"][n]
            txt = f"{r['share_of_bound']:.0%}" if r.get("share_of_bound") is not None else (
                "skipped" if r.get("skipped") else "failed")
            ax.text(i, vals[i], txt, ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(all_names)), all_names, rotation=20, ha="right", fontsize=8)
        ax.set_ylabel("decode tok/s")
        ax.set_title(f"{regime}: decode tok/s against the bound")
        ax.legend(fontsize=7)
    s = report["setup"]
    fig.suptitle(f"{s['store_name']}: {s['n_slots']} of {s['n_experts_total']} expert slots "
                 f"({s['cache_frac']:.0%}), budget {format_size(s['budget_bytes'])}, routing {s['routing']}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def _agreement_cell(vs: dict | None) -> str:
    """The table's "=mlx-lm" cell: yes, no@<first differing token>, or - (not compared)."""
    if not vs:
        return "-"
    return "yes" if vs["exact"] else f"no@{vs['first_divergence']}"


def table(report: dict) -> str:
    lines = []
    for regime, rr in report["regimes"].items():
        b = rr["bound"]
        lines.append(f"\n[{regime}] {rr['description']}")
        lines.append(f"bound {b['s_per_token'] * 1e3:.1f} ms/token ({b['limited_by']}): compute "
                     f"{b['compute_s_per_token'] * 1e3:.1f} ms" + (
                         f" (median of {' / '.join(f'{x * 1e3:.1f}' for x in b['compute_rounds_s'])}, one per round)"
                         if b.get("compute_rounds_s") else "") +
                     f", Belady reads {b['read_s_per_token'] * 1e3:.1f} ms")
        w = max(20, *(len(n) + 1 for n in rr["contenders"]))
        lines.append(f"{'contender':<{w}}{'decode':>9}{'spread':>7}{'of bound':>9}{'/own':>6}{'prefill':>9}{'TTFT s':>8}{'hit':>6}"
                     f"{'MB/tok':>8}{'disk MB/tok':>12}{'stall':>7}{'read p50/p99 ms':>17}{'need wait p50':>14}{'disk busy':>10}"
                     f"{'pf prec':>8}{'pf rec':>7}{'host ms':>8}{'peak MiB':>9}{'load':>10}{'=mlx-lm':>9}")
        for name, r in rr["contenders"].items():
            if not r.get("ok"):
                lines.append(f"{name:<{w}}  {'skipped: ' if r.get('skipped') else ''}{r.get('cause', 'failed')}")
                continue
            rd = (r.get("stage_latency") or {}).get("read")
            fmt = lambda v, f: (f.format(v) if v is not None else "-")
            lines.append(
                f"{name:<{w}}{fmt(r.get('decode_tok_s'), '{:.2f}'):>9}{fmt(r.get('decode_tok_s_spread'), '{:.2f}x'):>7}{fmt(r.get('share_of_bound'), '{:.0%}'):>9}"
                f"{fmt(r.get('time_over_own_bound'), '{:.1f}x'):>6}{fmt(r.get('prefill_tok_s'), '{:.2f}'):>9}{fmt(r.get('ttft_s'), '{:.2f}'):>8}"
                f"{fmt(r.get('hit_rate'), '{:.2f}'):>6}{fmt((r.get('bytes_read_per_token') or 0) / 1e6 if r.get('bytes_read_per_token') is not None else None, '{:.1f}'):>8}"
                f"{fmt((r['bytes_read_per_token_all'] / 1e6) if r.get('bytes_read_per_token_all') else None, '{:.1f}'):>12}"
                f"{fmt(r.get('stall_share'), '{:.0%}'):>7}"
                f"{(('%.1f/%.1f' % (rd['p50_ms'], rd['p99_ms'])) if rd else '-'):>17}"
                f"{fmt(((r.get('loader') or {}).get('need_stall') or {}).get('p50_ms'), '{:.1f}'):>14}"
                f"{fmt((r.get('loader') or {}).get('disk_busy_share'), '{:.0%}'):>10}"
                f"{fmt(r.get('prefetch_precision'), '{:.2f}'):>8}{fmt(r.get('prefetch_recall'), '{:.2f}'):>7}"
                f"{fmt((r['host_s_per_token'] * 1e3) if r.get('host_s_per_token') is not None else None, '{:.1f}'):>8}"
                f"{r.get('peak_tree_pss_bytes', 0) / 2**20:>9.0f}"
                f"{('%.1f-%.1f' % tuple(r['load_average'])) if r.get('load_average') else '-':>10}"
                f"{_agreement_cell(r.get('vs_mlx_lm')):>9}")
        lines.append("/own: time per token over the contender's own bound, max(compute, its bytes read per "
                     "token at the probed disk rate); host ms: CPU time of compute's own thread per token; "
                     "peak MiB: the process tree's PSS, the highest round's")
        if rr.get("rounds", 1) > 1:
            lines.append(f"{rr['rounds']} rounds, contenders alternating: medians per contender; spread = "
                         f"fastest / slowest round's decode tok/s")
        sw = rr.get("prefetch_sweep")
        if sw:
            lines.append(f"prefetch sweep: slowest self-gated {sw['min_gated']} {sw['min_gated_tok_s']:.2f} tok/s / "
                         f"fastest fixed {sw['max_fixed']} {sw['max_fixed_tok_s']:.2f} tok/s = {sw['ratio']:.2f}x "
                         f"(goal >= {sw['goal']})")
        for name, r in rr["contenders"].items():
            if r.get("slots_short"):
                lines.append(f"note: {name} ran with {r['n_slots']} expert slots, {r['slots_short']} fewer than "
                             f"the bound assumes (the budget held no more)")
    return "\n".join(lines)
