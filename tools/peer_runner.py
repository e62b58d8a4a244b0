"""The real peers of deltafin-bench: mlx-vlm's expert offload and rapid-mlx's disk streaming, each
in one process that loads its own layout of the store's exported mlx-lm checkpoint, generates
greedily from token ids and writes its figures as JSON (the same stages and timing as
tools/mlxlm_runner.py: prefill ends at the first token, decode runs over generated_tokens - 1
steps, exactly --max-tokens tokens).

    python -m deltafin.tools.peer_runner --peer mlx-vlm --model LAYOUT --expert-cache-gb G \\
        --prompt-ids 1,2,3 --max-tokens N --json OUT

Layouts, made once from the mlx-lm checkpoint CKPT by `build_layout`:
- mlx-vlm: `mlx_vlm.moe_offload.repack` (a resident part + one expert file per MoE layer); loaded
  by `mlx_vlm.utils.load_model(path, expert_cache_gb=G)`, which swaps the switch layers for
  offloaded ones (an LRU of whole experts under G x 1e9 bytes); generation by mlx-vlm's
  `generate_step`. Hits and misses come from the store's `stats()`.
- rapid-mlx: the checkpoint with each expert as its own tensors
  (model.layers.L.mlp.experts.E.PROJ.{weight,scales,biases}), the layout its qwen2_moe adapter
  reads by byte range; the model is loaded lazily by mlx-lm and `disk_stream_patch.install`
  streams the selected experts through an LRU of G x 1e9 bytes; generation by mlx-lm's
  `generate_step`, as rapid-mlx serves. Hits and misses come from its ExpertCache.
Hit rates are given over decode only (the counters are read at the first token and at the end),
and over the whole run.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

from deltafin.runtime.cli import Help
from deltafin.tools.mlxlm_runner import Report, parse_ids, peak_rss_bytes, run_reported

PEERS = {"mlx-vlm": "mlx_vlm", "rapid-mlx": "rapid_mlx"}  # contender -> the package it needs
STACKED = re.compile(r"^(?P<pre>.*\.layers\.\d+\.mlp)\.switch_mlp\.(?P<proj>gate_proj|up_proj|down_proj)"
                     r"\.(?P<kind>weight|scales|biases)$")


def missing_package(peer: str) -> str | None:
    """Why `peer` cannot run here (its package is not installed), or None."""
    import importlib.util
    pkg = PEERS[peer]
    if importlib.util.find_spec(pkg) is None:
        return f"{pkg} is not installed (pip install '{peer}'; see README's dependency table)"
    return None


def cannot_run(peer: str, model_type: str) -> str | None:
    """Why `peer` cannot run a `model_type` checkpoint here (its package missing, or an architecture
    it does not stream), or None."""
    missing = missing_package(peer)
    if missing:
        return missing
    if peer == "rapid-mlx":
        from rapid_mlx import registry
        if registry.get_adapter(model_type) is None:
            return f"not supported: rapid-mlx {package_version(peer)} has no disk-stream adapter for {model_type}"
    return None


def package_version(peer: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(peer)
    except PackageNotFoundError:
        return None


def layout_path(ckpt: Path, peer: str) -> Path:
    """Where a peer's layout of an mlx-lm checkpoint lives: beside it, STORE.<peer>."""
    return Path(str(ckpt).removesuffix(".mlx-lm").rstrip("/") + f".{peer}")


def build_layout(ckpt: Path, peer: str) -> Path:
    """The peer's layout of the checkpoint, written once beside it (built in a .partial directory
    and renamed, so an interrupted build is never taken for a finished one)."""
    out = layout_path(ckpt, peer)
    if (out / "config.json").exists():
        return out
    tmp = out.with_name(out.name + f".partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if peer == "mlx-vlm":
        from mlx_vlm.moe_offload import repack
        repack(str(ckpt), str(tmp))
    else:
        _per_expert_checkpoint(ckpt, tmp)
    os.replace(tmp, out)
    return out


def _per_expert_checkpoint(ckpt: Path, out: Path) -> None:
    """The checkpoint with every stacked switch_mlp tensor [E, ...] split into one tensor per
    expert (the layout published qwen2_moe checkpoints have and rapid-mlx streams from); the
    other tensors and files copied as they are."""
    import mlx.core as mx
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    weight_map: dict[str, str] = {}
    total = 0
    for shard in sorted(set(index["weight_map"].values())):
        tensors = {}
        for name, arr in mx.load(str(ckpt / shard)).items():
            m = STACKED.match(name)
            if m is None:
                tensors[name] = arr
                continue
            for e in range(arr.shape[0]):
                tensors[f"{m['pre']}.experts.{e}.{m['proj']}.{m['kind']}"] = arr[e]
        mx.save_safetensors(str(out / shard), tensors, metadata={"format": "mlx"})
        weight_map.update({k: shard for k in tensors})
        total += sum(v.nbytes for v in tensors.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=1))
    for f in ckpt.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy2(f, out / f.name)


# ------------------------------------------------------------------------------------ the runs

def _load_mlx_vlm(path: Path, cache_gb: float):
    """(step generator factory, counters) for mlx-vlm's offloaded model."""
    import mlx.core as mx
    from mlx_vlm.generate.ar import generate_step
    from mlx_vlm.utils import load_model
    model = load_model(path, expert_cache_gb=cache_gb)
    store = model.moe_offload_store

    def steps(prompt_ids, max_tokens, prefill_step_size):
        return generate_step(mx.array([prompt_ids]), model, None, None, max_tokens=max_tokens, temperature=0.0,
                             prefill_step_size=prefill_step_size)

    def counters():
        st = store.stats()
        return {"hits": st["hits"], "misses": st["misses"], "evictions": st["evictions"],
                "resident_experts": st["resident_experts"], "budget_bytes": st["budget_bytes"]}
    return steps, counters


def _load_rapid_mlx(path: Path, cache_gb: float):
    """(step generator factory, counters) for rapid-mlx's disk-streamed model."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model
    from rapid_mlx import disk_stream_patch
    config = json.loads((path / "config.json").read_text())
    why = cannot_run("rapid-mlx", config.get("model_type", ""))
    if why:
        raise ValueError(why)
    model, config = load_model(path, lazy=True)  # as rapid-mlx loads: the experts never materialized
    result = disk_stream_patch.install(model, config.get("model_type", ""), path, cache_budget_gb=cache_gb)
    mx.eval([v for k, v in _flat(model.parameters()) if ".switch_mlp." not in f".{k}."])
    cache = result.cache

    def steps(prompt_ids, max_tokens, prefill_step_size):
        return generate_step(mx.array(prompt_ids), model, max_tokens=max_tokens, prefill_step_size=prefill_step_size)

    def counters():
        return {"hits": cache.hits, "misses": cache.misses, "resident_bytes": cache.total_bytes,
                "budget_bytes": int(cache_gb * 1e9), "layers_patched": result.num_moe_layers_patched}
    return steps, counters


def _flat(params):
    from mlx.utils import tree_flatten
    return tree_flatten(params)


def _hit_rate(hits: int, misses: int) -> float | None:
    return hits / (hits + misses) if hits + misses else None


def run(peer: str, path: Path, cache_gb: float, prompt_ids: list[int], max_tokens: int, report: Report,
        prefill_step_size: int = 2048) -> None:
    import mlx.core as mx
    report.update(status="loading")
    t0 = time.perf_counter()
    steps, counters = (_load_mlx_vlm if peer == "mlx-vlm" else _load_rapid_mlx)(path, cache_gb)
    report.update(status="generating", load_s=time.perf_counter() - t0, peak_rss_bytes=peak_rss_bytes())
    tokens: list[int] = []
    t_start = time.perf_counter()
    t_first, at_first = None, None
    for token, _ in steps(prompt_ids, max_tokens, prefill_step_size):
        tokens.append(int(token.item() if hasattr(token, "item") else token))
        if t_first is None:
            t_first, at_first = time.perf_counter(), counters()
    t_end = time.perf_counter()
    at_end = counters()
    prefill_s = (t_first or t_end) - t_start
    decode_s = t_end - t_first if t_first is not None else 0.0
    n_decode = max(0, len(tokens) - 1)
    dh = at_end["hits"] - (at_first or {}).get("hits", 0)
    dm = at_end["misses"] - (at_first or {}).get("misses", 0)
    report.update(
        status="ok", prompt_tokens=len(prompt_ids), generated_tokens=len(tokens), token_ids=tokens,
        finish_reason="length", ttft_s=prefill_s, prefill_s=prefill_s,
        prefill_tok_s=len(prompt_ids) / prefill_s if prefill_s else None,
        decode_s=decode_s, decode_tok_s=n_decode / decode_s if n_decode and decode_s else None,
        hit_rate=_hit_rate(dh, dm), hit_rate_all_tokens=_hit_rate(at_end["hits"], at_end["misses"]),
        decode_misses=dm, expert_cache=at_end,
        peak_rss_bytes=peak_rss_bytes(), mlx_peak_memory_bytes=int(mx.get_peak_memory()))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(formatter_class=Help, prog="python -m deltafin.tools.peer_runner",
                                description="Greedy generation by a real peer (mlx-vlm, rapid-mlx); figures as JSON.")
    p.add_argument("--peer", required=True, choices=tuple(PEERS))
    p.add_argument("--model", required=True, help="the peer's layout (build_layout makes it from an mlx-lm checkpoint)")
    p.add_argument("--expert-cache-gb", required=True, type=float, help="the peer's expert budget, GB (1e9 bytes)")
    p.add_argument("--prompt-ids", required=True, type=parse_ids, help="comma-separated token ids")
    p.add_argument("--max-tokens", required=True, type=int)
    p.add_argument("--json", required=True, help="where to write the result")
    p.add_argument("--prefill-step-size", type=int, default=2048, help="prompt chunk (mlx-lm's default 2048)")
    a = p.parse_args(argv)
    if a.max_tokens < 1 or a.expert_cache_gb <= 0:
        p.error("--max-tokens must be at least 1 and --expert-cache-gb positive")
    report = Report(a.json, runner=a.peer, model=str(a.model), expert_cache_gb=a.expert_cache_gb,
                    max_tokens=a.max_tokens, prompt_tokens=len(a.prompt_ids), pid=os.getpid(),
                    version=package_version(a.peer))
    code = run_reported(report, "peer_runner", lambda: run(a.peer, Path(a.model), a.expert_cache_gb, a.prompt_ids,
                                                           a.max_tokens, report, a.prefill_step_size))
    if code:
        return code
    d = report.data
    print(f"{a.peer}: {d['generated_tokens']} generated; decode {d['decode_tok_s'] or 0:.2f} tok/s, hit rate "
          f"{d['hit_rate'] if d['hit_rate'] is not None else '-'}, peak RSS {d['peak_rss_bytes'] / 2**20:.0f} MiB",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
