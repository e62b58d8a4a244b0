"""deltafin-eval: perplexity and next-token agreement of a running runtime against a reference.

The text's token ids go to the runtime in windows as teacher-forced `logits` requests (the
client's `logits`, docs/PROTOCOL.md), so every figure comes through the runtime as it serves: its
budget, its cache, its lossy setting. The reference computes the same windows exactly: the same
store with every expert resident and no lossy mode, in this process (`--reference store`, the
default), or mlx-lm on a checkpoint (`--reference mlx-lm --mlx-model CKPT`, e.g.
deltafin-export-mlx's output). Reported: perplexity of each (the exponential of the mean
negative log-likelihood of every window's next tokens), its change in percent, top-1 agreement
(the share of positions whose most likely next token is the reference's), bytes the loader read
per evaluated token and the positions per second; with --generate N also one greedy generation's
decode tok/s and bytes read per decoded token.

The runtime is one the command starts (`--model STORE`, with the supervisor's budget, slots and
lossy flags; each window's positions then run one per forward pass, `--chunk`, as a generation
runs them) or one already running (`--endpoint EP`; its compute.prefill_chunk decides the passes,
and a lossy mode reroutes little in a pass of many rows, which read most experts anyway: start it
with prefill_chunk = 1 to measure what a generation sees).

The default text, configs/heldout.txt, ships with deltafin: the "Execution model", "Exceptions"
and "The import system" topics of Python 3.11.7's documentation as the standard library carries
them (pydoc_data.topics; Python Software Foundation License), about 4,600 tokens of English
prose with a little code. A store without a tokenizer reads the text's UTF-8 bytes as token ids.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import tomllib
from importlib import resources
from pathlib import Path

import numpy as np

from deltafin.client import Client, DeltafinError
from deltafin.runtime.cli import Help
from deltafin.runtime.lossy import MODES as LOSSY_MODES
from deltafin.runtime.store import Store
from deltafin.runtime.tokenizer import Tokenizer, TokenizerError
from deltafin.tools.run import StartError, running_supervisor

GENERATE_PROMPT = "Explain how a Python program is executed, step by step."


def load_text(path: str | None) -> tuple[str, str]:
    """(text, where it came from): the file named, or the held-out text that ships."""
    if path:
        return Path(path).read_text(encoding="utf-8"), str(path)
    return resources.files("deltafin.configs").joinpath("heldout.txt").read_text(encoding="utf-8"), \
        "configs/heldout.txt (Python 3.11.7 docs: execmodel, exceptions, import)"


def token_ids(store: Store, text: str, limit: int) -> list[int]:
    """The text's first `limit` token ids (a store without a tokenizer: its UTF-8 bytes)."""
    try:
        ids = Tokenizer(store.tokenizer_dir, store.config).encode(text)
    except TokenizerError:
        vocab = int(store.config["vocab_size"])
        ids = [b % vocab for b in text.encode("utf-8")]
    return ids[:limit]


def windows(ids: list[int], size: int) -> list[list[int]]:
    """Consecutive windows of `size` tokens (the last may be shorter; one of a single token
    predicts nothing and is left out)."""
    return [ids[i:i + size] for i in range(0, len(ids), size) if len(ids[i:i + size]) > 1]


def next_token_scores(logits: np.ndarray, window: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(negative log-likelihood of each next token, most likely next token) for positions 0..T-2
    of a window's float logits [T, vocab], in float64."""
    x = np.asarray(logits[:-1], dtype=np.float64)
    top = x.max(axis=-1, keepdims=True)
    logz = top[:, 0] + np.log(np.exp(x - top).sum(axis=-1))
    targets = np.asarray(window[1:])
    return logz - x[np.arange(len(targets)), targets], np.asarray(logits[:-1]).argmax(axis=-1)


def summarize(per_window: list[tuple[np.ndarray, np.ndarray]]) -> dict:
    nll = np.concatenate([w[0] for w in per_window])
    return {"positions": int(nll.size), "nll": float(nll.mean()), "ppl": float(np.exp(nll.mean()))}


def runtime_pass(endpoint: str, wins: list[list[int]], generate: int) -> dict:
    """The runtime's logits for every window, with what its stats say it read meanwhile, and
    one greedy generation's decode figures where `generate` > 0."""
    with Client(endpoint, timeout=3600) as c:
        setting = c.info.lossy or "not said"
        before = c.stats()["totals"]
        t0 = time.perf_counter()
        logits = [c.logits(w) for w in wins]
        seconds = time.perf_counter() - t0
        after = c.stats()
        out = {"setting": setting, "lossy": after.get("lossy"), "logits": logits, "seconds": seconds,
               "bytes_read": after["totals"]["bytes_read"] - before["bytes_read"]}
        if generate:
            d = c.generate(GENERATE_PROMPT, max_tokens=generate).stats["decode"]
            out["decode"] = {"tokens": d["tokens"], "tok_s": d["tokens"] / d["total_s"] if d["total_s"] else None,
                             "miss_bytes_per_token": d["miss_bytes"] / d["tokens"] if d["tokens"] else None}
    return out


def store_reference(store_path: str, wins: list[list[int]], config: str | None = None) -> list[np.ndarray]:
    """The exact logits: the store with every expert resident, lossy off, in this process; the
    configuration file's other settings (compute.dtype) as the runtime has them."""
    from deltafin.runtime.config import load_config
    from deltafin.tools.inprocess import local_router
    from deltafin.workers.engine import Compute
    store = Store(store_path)
    cfg = load_config(config, {"lossy.mode": "off", "cache.max_slots": 0}).to_dict()
    source, staging, loader = local_router(store, cfg, n_slots=len(store.records))
    try:
        compute = Compute(store, cfg, source, staging, store.max_record_bytes)
        compute.preload()
        return [compute.logits(w) for w in wins]
    finally:
        loader.close()


def mlx_lm_reference(ckpt: str, wins: list[list[int]]) -> list[np.ndarray]:
    """mlx-lm's logits for each window, on its checkpoint (float32)."""
    import mlx.core as mx
    from mlx_lm.utils import load_model
    model, _ = load_model(Path(ckpt))
    return [np.array(model(mx.array([w]))[0].astype(mx.float32)) for w in wins]


def compare(test: list[np.ndarray], ref: list[np.ndarray] | None, wins: list[list[int]]) -> dict:
    """Perplexity of the runtime's logits, and against the reference's where there is one."""
    return compare_scores([next_token_scores(lg, w) for lg, w in zip(test, wins)],
                          None if ref is None else [next_token_scores(lg, w) for lg, w in zip(ref, wins)])


def compare_scores(ours: list[tuple[np.ndarray, np.ndarray]],
                   theirs: list[tuple[np.ndarray, np.ndarray]] | None) -> dict:
    """Perplexity from each window's next_token_scores, and against the reference's where there
    is one: its perplexity, the change in percent and the top-1 agreement."""
    out = {"runtime": summarize(ours)}
    if theirs is not None:
        out["reference"] = summarize(theirs)
        agree = np.concatenate([a[1] == b[1] for a, b in zip(ours, theirs)])
        out["top1_agreement"] = float(agree.mean())
        out["ppl_change_pct"] = 100.0 * (out["runtime"]["ppl"] / out["reference"]["ppl"] - 1.0)
    return out


def supervisor_flags(a, tmp: Path) -> list[str]:
    """The supervisor's flags for a run this command starts: its config with compute.prefill_chunk
    = --chunk (each window's positions in passes of that many, one: as a generation runs them)."""
    data = tomllib.loads(Path(a.config).read_text()) if a.config else {}
    data.setdefault("compute", {})["prefill_chunk"] = a.chunk
    path = tmp / "eval.toml"
    path.write_text("".join(f"[{s}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in kv.items())
                            for s, kv in data.items()))
    flags = ["--config", str(path)]
    slots = a.max_slots
    if a.cache_frac is not None:
        slots = max(1, round(a.cache_frac * len(Store(a.model).records)))
    for flag, value in (("--max-slots", slots), ("--lossy", a.lossy), ("--lossy-margin", a.lossy_margin),
                        ("--lossy-max-share", a.lossy_max_share), ("--policy", a.policy)):
        if value is not None:
            flags += [flag, str(value)]
    return flags


def prepare(a) -> tuple[str, str, list[list[int]]]:
    """(the store, where the text came from, the windows of token ids to evaluate)."""
    store_path = a.model
    text, source = load_text(a.text)
    if store_path is None:  # a running runtime: its store, as its welcome names it
        with Client(a.endpoint, timeout=60) as c:
            store_path = c.info.model
    return store_path, source, windows(token_ids(Store(store_path), text, a.tokens), a.window)


def reference_logits(a, store_path: str, wins: list[list[int]]) -> list[np.ndarray] | None:
    if a.reference == "store":
        return store_reference(store_path, wins, a.config)
    if a.reference == "mlx-lm":
        return mlx_lm_reference(a.mlx_model, wins)
    return None


def evaluate(a, ref: list[np.ndarray] | None = None) -> dict:
    """One evaluation as deltafin-eval's flags `a` ask; ref: the reference's logits where the
    caller computed them already (the same windows)."""
    store_path, source, wins = prepare(a)
    if a.endpoint:
        run = runtime_pass(a.endpoint, wins, a.generate)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            with running_supervisor(store_path, a.memory_budget, supervisor_flags(a, Path(tmp))) as (ep, _):
                run = runtime_pass(ep, wins, a.generate)
    if ref is None:
        ref = reference_logits(a, store_path, wins)
    result = compare(run.pop("logits"), ref, wins)
    positions = sum(len(w) for w in wins)
    return {"store": str(store_path), "text": source, "tokens": positions, "windows": len(wins),
            "window": a.window, "reference_kind": a.reference, "setting": run["setting"], "lossy": run["lossy"],
            "bytes_read_per_token": run["bytes_read"] / positions, "tok_s": positions / run["seconds"],
            **({"decode": run["decode"]} if "decode" in run else {}), **result}


def table(r: dict) -> str:
    """The result as a few readable lines."""
    f = lambda v, spec: "-" if v is None else format(v, spec)
    lines = [f"store {r['store']}  setting {r['setting']}",
             f"text {r['text']}: {r['tokens']} tokens in {r['windows']} windows of {r['window']}",
             f"{'':12s} {'ppl':>10s} {'nll':>8s}",
             f"{'runtime':12s} {r['runtime']['ppl']:10.4f} {r['runtime']['nll']:8.4f}"]
    if "reference" in r:
        lines += [f"{'reference':12s} {r['reference']['ppl']:10.4f} {r['reference']['nll']:8.4f}  ({r['reference_kind']})",
                  f"ppl change {r['ppl_change_pct']:+.3f}%   top-1 agreement {r['top1_agreement']:.2%}"]
    lossy = r.get("lossy") or {}
    lines.append(f"{f(r['tok_s'], '.2f')} positions/s, {f(r['bytes_read_per_token'], ',.0f')} B read per position"
                 + (f", {lossy.get('rerouted', 0)} experts rerouted" if lossy and not lossy.get("exact") else ""))
    if "decode" in r:
        d = r["decode"]
        lines.append(f"generate: {d['tokens']} decode tokens at {f(d['tok_s'], '.2f')} tok/s, "
                     f"{f(d['miss_bytes_per_token'], ',.0f')} B read per token")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(formatter_class=Help, prog="deltafin-eval",
                                description="Perplexity and top-1 agreement with an exact reference, computed "
                                            "through the runtime on held-out text (teacher-forced logits).")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--model", help="expert store: the command starts a runtime on it")
    where.add_argument("--endpoint", help="a running runtime's client endpoint instead (its own "
                       "compute.prefill_chunk: 1 to measure a lossy mode as a generation runs)")
    p.add_argument("--text", help="UTF-8 text file (default: configs/heldout.txt, Python 3.11 docs)")
    p.add_argument("--tokens", type=int, default=1024, help="the text's first N tokens are evaluated")
    p.add_argument("--window", type=int, default=256, help="tokens per logits request (one sequence each)")
    p.add_argument("--reference", choices=("store", "mlx-lm", "none"), default="store",
                   help="store: the same store, every expert resident, exact, in this process; "
                        "mlx-lm: mlx-lm on --mlx-model")
    p.add_argument("--mlx-model", help="with --reference mlx-lm: the checkpoint (deltafin-export-mlx STORE OUT)")
    p.add_argument("--generate", type=int, default=0, metavar="N",
                   help="also one greedy generation of N tokens: decode tok/s, bytes read per token")
    p.add_argument("--json", metavar="OUT", help="write the result as JSON")
    run = p.add_argument_group("the runtime this command starts (--model)")
    run.add_argument("--memory-budget", help="as deltafin-supervisor's (default: config)")
    run.add_argument("--max-slots", type=int, help="upper bound on expert slots (cache.max_slots)")
    run.add_argument("--cache-frac", type=float, help="slots for this share of the store's experts")
    run.add_argument("--chunk", type=int, default=1, help="positions per forward pass (compute.prefill_chunk)")
    run.add_argument("--config", help="TOML file overriding configs/default.toml")
    run.add_argument("--policy", help="slot replacement policy (cache.policy)")
    run.add_argument("--lossy", choices=LOSSY_MODES, help="lossy.mode (default: config, off)")
    run.add_argument("--lossy-margin", type=float, help="lossy.margin")
    run.add_argument("--lossy-max-share", type=float, help="lossy.max_share")
    return p


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    if a.reference == "mlx-lm" and not a.mlx_model:
        parser().error("--reference mlx-lm needs --mlx-model CKPT")
    if a.tokens < 2 or a.window < 2 or a.chunk < 1:
        parser().error("--tokens and --window must be >= 2, --chunk >= 1")
    try:
        result = evaluate(a)
    except (StartError, DeltafinError, OSError, ValueError) as e:
        print(f"deltafin-eval: error: {e}", file=sys.stderr)
        return 1
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
