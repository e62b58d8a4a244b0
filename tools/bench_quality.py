"""deltafin-bench's quality axis (--quality): perplexity and next-token agreement beside speed.

Each deltafin contender, after its generation, is asked for teacher-forced logits on held-out
text by the same running supervisor (deltafin-eval's windows, requests and scores: tools/eval.py),
one position per forward pass (compute.prefill_chunk = 1, as a generation runs them). Its
perplexity, its ratio to the exact run's (the `deltafin` contender of the same round) and the
share of positions whose most likely next token is the exact run's go into its report beside
decode tok/s, bytes read per token and hit rate; `--plot OUT.svg` draws decode tok/s against
perplexity, one point per setting, as a standalone SVG.
"""
from __future__ import annotations

from pathlib import Path
from xml.sax.saxutils import escape

import numpy as np

from deltafin.client import DeltafinError
from deltafin.runtime.store import Store
from deltafin.tools import eval as ev

EXACT = "deltafin"  # the contender whose run is every other's reference


def add_arguments(p) -> None:
    q = p.add_argument_group("quality (--quality, the real regime, routing by the gate: --trace none)")
    q.add_argument("--quality", action="store_true", help="also perplexity and top-1 agreement with the exact "
                   f"run ({EXACT}, among the contenders) on held-out text, through each deltafin contender's runtime")
    q.add_argument("--quality-text", help="UTF-8 text file (default: deltafin-eval's, configs/heldout.txt)")
    q.add_argument("--quality-tokens", type=int, default=128, help="the text's first N tokens are evaluated")
    q.add_argument("--quality-window", type=int, default=32, help="tokens per logits request (a "
                   "window's logits must fit the runtime's reply limit: the MoEfied demo at 400 MiB takes at most 50)")
    q.add_argument("--plot", metavar="OUT.svg", help="with --quality: decode tok/s against perplexity, an SVG")


def problem(a, regimes: list[str], contenders: list[str]) -> str | None:
    """Why the quality flags cannot run as given, or None."""
    if a.plot and not a.quality:
        return "--plot needs --quality"
    if not a.quality:
        return None
    if regimes != ["real"]:
        return "--quality needs --regimes real (the stand-in computes no logits)"
    if a.trace != "none":
        return "--quality needs --trace none (a routing trace replaces the gate: its logits are not the model's)"
    if EXACT not in contenders:
        return f"--quality needs the exact contender {EXACT} (the reference)"
    if a.quality_tokens < 2 or a.quality_window < 2:
        return "--quality-tokens and --quality-window must be >= 2"
    return None


def prepare(a, store: Store) -> tuple[list[list[int]] | None, dict | None]:
    """(the windows of token ids every deltafin contender is asked for, the report's description)."""
    if not a.quality:
        return None, None
    text, source = ev.load_text(a.quality_text)
    wins = ev.windows(ev.token_ids(store, text, a.quality_tokens), a.quality_window)
    return wins, {"text": source, "tokens": sum(len(w) for w in wins), "windows": len(wins),
                  "window": a.quality_window, "reference": EXACT}


def sections(mode_sections: dict | None, wins: list[list[int]] | None) -> dict | None:
    """A deltafin contender's configuration sections, with compute.prefill_chunk = 1 under --quality."""
    if not wins:
        return mode_sections
    out = dict(mode_sections or {})
    out["compute"] = {**out.get("compute", {}), "prefill_chunk": 1}
    return out


def measure(endpoint: str, wins: list[list[int]]) -> dict:
    """The running runtime's scores on the windows (deltafin-eval's runtime pass): its setting,
    what it read and rerouted meanwhile, and per position the next token's negative
    log-likelihood and the most likely next token (under "scores", taken out by `score_round`);
    {"error": why} where the runtime refused (e.g. a window's logits over its reply limit): the
    contender's speed figures stand without a quality figure."""
    try:
        run = ev.runtime_pass(endpoint, wins, generate=0)
    except DeltafinError as e:
        return {"error": f"{type(e).__name__}: {e}"}
    scores = [ev.next_token_scores(lg, w) for lg, w in zip(run.pop("logits"), wins)]
    positions = sum(len(w) for w in wins)
    return {"setting": run["setting"], "rerouted": (run["lossy"] or {}).get("rerouted", 0),
            "bytes_read_per_position": run["bytes_read"] / positions, "positions_per_s": positions / run["seconds"],
            "scores": scores}


def score_round(runs: dict[str, list[dict]]) -> None:
    """The latest round: each deltafin run's scores against the exact run's (deltafin-eval's
    comparison), as "quality" in place of its scores."""
    ref = runs.get(EXACT, [])[-1:]
    ref_scores = (ref[0].get("quality") or {}).get("scores") if ref else None
    for rs in runs.values():
        q = rs[-1].get("quality") if rs else None
        if not q or "scores" not in q:
            continue
        scores = q.pop("scores")
        cmp = ev.compare_scores(scores, ref_scores)
        q.update(ppl=cmp["runtime"]["ppl"], nll=cmp["runtime"]["nll"], positions=cmp["runtime"]["positions"],
                 ppl_vs_exact=cmp["runtime"]["ppl"] / cmp["reference"]["ppl"] if ref_scores else None,
                 top1_agreement=cmp.get("top1_agreement"))


def rows(rr: dict) -> list[dict]:
    """One row per contender with a quality figure: speed and quality side by side."""
    out = []
    for name, r in rr["contenders"].items():
        q = r.get("quality")
        if r.get("ok") and q and "ppl" in q:
            out.append({"contender": name, "setting": q["setting"], "decode_tok_s": r.get("decode_tok_s"),
                        "bytes_read_per_token": r.get("bytes_read_per_token"), "hit_rate": r.get("hit_rate"),
                        "ppl": q["ppl"], "ppl_vs_exact": q["ppl_vs_exact"], "top1_agreement": q["top1_agreement"],
                        "rerouted_per_position": q["rerouted"] / q["positions"]})
    return out


def table(report: dict) -> str:
    """The quality rows of each regime that has them, as text."""
    lines = []
    fmt = lambda v, f: "-" if v is None else format(v, f)
    for regime, rr in report["regimes"].items():
        if rr.get("quality") is None:
            continue
        d = report["setup"]["quality"]
        lines += [f"\n[{regime}] quality: {d['tokens']} tokens of {d['text']} in windows of {d['window']}, "
                  f"against {d['reference']}",
                  f"{'contender':<24}{'decode tok/s':>13}{'MB/tok':>8}{'hit':>6}{'ppl':>10}{'ppl/exact':>10}"
                  f"{'top-1 agree':>12}{'rerouted/pos':>13}  setting"]
        for q in rr["quality"]:
            mb = q["bytes_read_per_token"] / 1e6 if q["bytes_read_per_token"] is not None else None
            lines.append(f"{q['contender']:<24}{fmt(q['decode_tok_s'], '.2f'):>13}{fmt(mb, '.1f'):>8}"
                         f"{fmt(q['hit_rate'], '.2f'):>6}{q['ppl']:>10.3f}{fmt(q['ppl_vs_exact'], '.4f'):>10}"
                         f"{fmt(q['top1_agreement'], '.1%'):>12}{q['rerouted_per_position']:>13.2f}  {q['setting']}")
        for name, r in rr["contenders"].items():
            if (r.get("quality") or {}).get("error"):
                lines.append(f"{name:<24}no quality figure: {r['quality']['error']}")
    return "\n".join(lines)


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About n round values spanning lo..hi."""
    step = 10 ** np.floor(np.log10((hi - lo) / n))
    step *= min((m for m in (1, 2, 5, 10) if (hi - lo) / (step * m) <= n), default=10)
    return [float(v) for v in np.arange(np.ceil(lo / step) * step, hi, step)]


def _span(vals: list[float]) -> tuple[float, float]:
    lo, hi = min(vals), max(vals)
    pad = (hi - lo) * 0.1 or abs(hi) * 0.05 or 1.0
    return lo - pad, hi + pad


def svg(points: list[dict], title: str) -> str:
    """Decode tok/s (y) against perplexity (x), one labelled circle per row of `rows`, as SVG."""
    w, h, left, right, top, bottom = 640, 420, 70, 190, 40, 50
    xs, ys = [p["ppl"] for p in points], [p["decode_tok_s"] or 0.0 for p in points]
    (x0, x1), (y0, y1) = _span(xs), _span(ys)
    px = lambda x: left + (x - x0) / (x1 - x0) * (w - left - right)
    py = lambda y: h - bottom - (y - y0) / (y1 - y0) * (h - top - bottom)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" '
           'font-family="sans-serif" font-size="11">', f'<rect width="{w}" height="{h}" fill="white"/>',
           f'<text x="{w / 2 - right / 2 + left / 2:.0f}" y="20" text-anchor="middle" font-size="13">{escape(title)}</text>',
           f'<line x1="{left}" y1="{h - bottom}" x2="{w - right}" y2="{h - bottom}" stroke="black"/>',
           f'<line x1="{left}" y1="{top}" x2="{left}" y2="{h - bottom}" stroke="black"/>']
    for t in _ticks(x0, x1):
        out.append(f'<text x="{px(t):.1f}" y="{h - bottom + 15}" text-anchor="middle">{t:g}</text>')
    for t in _ticks(y0, y1):
        out.append(f'<text x="{left - 6}" y="{py(t) + 4:.1f}" text-anchor="end">{t:g}</text>')
    out += [f'<text x="{left + (w - left - right) / 2:.0f}" y="{h - 12}" text-anchor="middle">perplexity (held-out text)</text>',
            f'<text transform="translate(18 {top + (h - top - bottom) / 2:.0f}) rotate(-90)" text-anchor="middle">'
            'decode tok/s</text>']
    for p, x, y in zip(points, xs, ys):
        color = "#2a6f3f" if p["ppl_vs_exact"] == 1.0 else "#c44e52"
        label = f"{p['contender']} (ppl x{p['ppl_vs_exact']:.3f})" if p["ppl_vs_exact"] is not None else p["contender"]
        out += [f'<circle class="point" cx="{px(x):.1f}" cy="{py(y):.1f}" r="5" fill="{color}">'
                f'<title>{escape(p["setting"])}: ppl {x:.3f}, {y:.2f} tok/s</title></circle>',
                f'<text x="{px(x) + 8:.1f}" y="{py(y) + 4:.1f}">{escape(label)}</text>']
    out.append("</svg>")
    return "\n".join(out) + "\n"


def plot(report: dict, path: str) -> str | None:
    """The real regime's quality rows as an SVG at path; why not, where no row has a figure."""
    if not report["regimes"]["real"].get("quality"):
        return "no contender has a quality figure: no plot"
    s = report["setup"]
    title = (f"{s['store_name']}: decode tok/s against perplexity, {s['n_slots']} of {s['n_experts_total']} "
             f"expert slots")
    Path(path).write_text(svg(report["regimes"]["real"]["quality"], title))
    return None
