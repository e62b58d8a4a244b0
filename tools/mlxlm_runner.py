"""The mlx-lm contender of deltafin-bench: one process that loads a checkpoint with mlx-lm and
generates greedily from token ids, the way mlx-lm generates (its `generate_step`, so its own
`mx.async_eval` pipelining is what gets measured), and writes its figures as JSON.

    python -m deltafin.tools.mlxlm_runner --model CKPT --prompt-ids 1,2,3 --max-tokens N --json OUT

The bench starts it inside a memory cgroup. The JSON is rewritten at each stage (status
"loading", "generating", then "ok" or "error"), so after a kill (a cgroup OOM kill is SIGKILL,
which the bench sees as the exit signal) the file still says how far the run got.
Timing follows mlx-lm's stream_generate: prefill ends when the first token is available (so
ttft_s and prefill_s are the same instant here); decode runs from there to the last token, over
generated_tokens - 1 steps. load_s includes the --dtype cast. There is no EOS stop unless
--stop-ids names the ids: by default exactly --max-tokens tokens are generated.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
import traceback
from pathlib import Path

from deltafin.runtime.cli import Help
from deltafin.runtime.dtypes import FLOAT_DTYPES


def peak_rss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB


class Report:
    """The JSON result file, written atomically (write then rename) at every stage."""

    def __init__(self, path, **fields):
        self.path = Path(path)
        self.data = {"status": "starting", "error": None, **fields}

    def update(self, **fields) -> None:
        self.data.update(fields)
        tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(self.data, indent=1))
        os.replace(tmp, self.path)


def run_reported(report: Report, name: str, fn) -> int:
    """Runs fn() so that the JSON report says why whatever failed: 0 done, 2 an error (a load, a
    shape, an unknown model), 3 out of memory."""
    try:
        fn()
    except MemoryError:
        report.update(status="error", error="MemoryError", peak_rss_bytes=peak_rss_bytes())
        return 3
    except Exception as e:
        report.update(status="error", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc(limit=8),
                      peak_rss_bytes=peak_rss_bytes())
        print(f"{name}: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    return 0


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids: expected comma-separated integers, got {text[:80]!r}")
    if not ids:
        raise argparse.ArgumentTypeError("--prompt-ids: at least one token id is needed")
    return ids


def run(model_path: str, prompt_ids: list[int], max_tokens: int, report: Report, dtype: str | None = None,
        stop_ids: tuple[int, ...] = (), prefill_step_size: int = 2048) -> None:
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    report.update(status="loading")
    t0 = time.perf_counter()
    model, config = load_model(Path(model_path))  # evaluates every parameter (lazy=False)
    if dtype is not None:
        # Explicit only: on the MLX CPU backend 16-bit activations are many times slower, so the
        # bench may run mlx-lm in float32 beside deltafin's float32 compute (ARCHITECTURE.md).
        model.set_dtype(getattr(mx, dtype))
        mx.eval(model.parameters())
    report.update(status="generating", load_s=time.perf_counter() - t0, dtype=activation_dtype(model),
                  peak_rss_bytes=peak_rss_bytes(), mlx_peak_memory_bytes=int(mx.get_peak_memory()))
    vocab = int(config.get("vocab_size") or 0)
    if vocab and not all(0 <= i < vocab for i in prompt_ids):
        raise ValueError(f"prompt ids must lie in [0, {vocab})")

    tokens: list[int] = []
    finish = "length"
    t_start = time.perf_counter()
    t_first = None
    prompt = mx.array(prompt_ids)  # int32, as stream_generate makes it
    for token, _ in generate_step(prompt, model, max_tokens=max_tokens, prefill_step_size=prefill_step_size):
        if t_first is None:
            t_first = time.perf_counter()
        tokens.append(int(token))
        if int(token) in stop_ids:
            finish = "stop"
            break
    t_end = time.perf_counter()
    prefill_s = (t_first or t_end) - t_start
    decode_s = t_end - t_first if t_first is not None else 0.0
    n_decode = max(0, len(tokens) - 1)  # the first token comes with the prefill
    report.update(
        status="ok", prompt_tokens=len(prompt_ids), generated_tokens=len(tokens), token_ids=tokens,
        finish_reason=finish, ttft_s=prefill_s, prefill_s=prefill_s,
        prefill_tok_s=len(prompt_ids) / prefill_s if prefill_s else None,
        decode_s=decode_s, decode_tok_s=n_decode / decode_s if n_decode and decode_s else None,
        peak_rss_bytes=peak_rss_bytes(), mlx_peak_memory_bytes=int(mx.get_peak_memory()))


def activation_dtype(model) -> str | None:
    """The dtype the model computes in: that of its float parameters (the norms, scales...)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    floats = [v.dtype for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)]
    return str(max(set(floats), key=floats.count)).removeprefix("mlx.core.") if floats else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(formatter_class=Help, prog="python -m deltafin.tools.mlxlm_runner",
                                description="Greedy generation with mlx-lm from token ids; figures as JSON.")
    p.add_argument("--model", required=True, help="mlx-lm checkpoint directory (deltafin-export-mlx writes one)")
    p.add_argument("--prompt-ids", required=True, type=parse_ids, help="comma-separated token ids")
    p.add_argument("--max-tokens", required=True, type=int)
    p.add_argument("--json", required=True, help="where to write the result")
    p.add_argument("--dtype", choices=FLOAT_DTYPES, default=None,
                   help="cast the float parameters before generating (default: the checkpoint's dtype, as mlx-lm)")
    p.add_argument("--stop-ids", type=parse_ids, default=None,
                   help="stop after generating one of these ids (default: always max-tokens, no EOS stop)")
    p.add_argument("--prefill-step-size", type=int, default=2048, help="mlx-lm's prompt chunk (its default 2048)")
    a = p.parse_args(argv)
    if a.max_tokens < 1:
        p.error("--max-tokens must be at least 1")
    report = Report(a.json, runner="mlx-lm", model=str(a.model), requested_dtype=a.dtype,
                    max_tokens=a.max_tokens, prompt_tokens=len(a.prompt_ids), pid=os.getpid())
    def generate() -> None:
        import mlx_lm
        report.update(mlx_lm_version=getattr(mlx_lm, "__version__", None))
        run(a.model, a.prompt_ids, a.max_tokens, report, a.dtype, tuple(a.stop_ids or ()), a.prefill_step_size)
    code = run_reported(report, "mlxlm_runner", generate)
    if code:
        return code
    d = report.data
    print(f"mlx-lm: {d['prompt_tokens']} prompt tokens, {d['generated_tokens']} generated; prefill "
          f"{d['prefill_tok_s'] or 0:.2f} tok/s, decode {d['decode_tok_s'] or 0:.2f} tok/s, load {d['load_s']:.2f} s, "
          f"peak RSS {d['peak_rss_bytes'] / 2**20:.0f} MiB", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
