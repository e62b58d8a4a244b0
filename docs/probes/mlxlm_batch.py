"""mlx-lm's own continuous batching on the same model: the ceiling MLX gives "decoding together".

python docs/probes/mlxlm_batch.py CHECKPOINT [DTYPE] [B,B,...]
CHECKPOINT: an mlx-lm directory (`deltafin-export-mlx STORE OUT` writes one from a store). Every
weight resident, mlx-lm's BatchGenerator (one KV array for the batch, masked attention), B prompts
of 16 tokens (the bench_concurrency prompts' shape), 48 greedy tokens each; prints mlx-lm's
own generation tokens per second for each B and its ratio to B = 1 (median of 3 runs, after one
warm-up run that also compiles kernels), and first mlx-lm's single-request path (stream_generate,
no batch cache) on the first prompt, the rate the batch is compared with."""
import statistics
import sys

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import batch_generate, stream_generate


def main():
    path = sys.argv[1]
    dtype = sys.argv[2] if len(sys.argv) > 2 else "float32"
    sizes = [int(b) for b in (sys.argv[3] if len(sys.argv) > 3 else "1,2,4,8").split(",")]
    model, tok = load(path)
    model.set_dtype(getattr(mx, dtype))
    prompts = [[(37 * i + 11 * j) % 3000 + 100 for j in range(16)] for i in range(max(sizes))]
    batch_generate(model, tok, prompts[:2], max_tokens=8)
    single = []
    for _ in range(3):
        for r in stream_generate(model, tok, prompts[0], max_tokens=48):
            pass
        single.append(r.generation_tps)
    print(f"single (stream_generate) tok/s {statistics.median(single):.2f} "
          f"(runs {', '.join(f'{t:.2f}' for t in single)})", flush=True)
    base = None
    for b in sizes:
        tps = []
        for _ in range(3):
            r = batch_generate(model, tok, prompts[:b], max_tokens=48)
            tps.append(r.stats.generation_tps)
        med = statistics.median(tps)
        base = base or med
        print(f"B={b} generation tok/s {med:.2f} (runs {', '.join(f'{t:.2f}' for t in tps)})"
              f"  x B=1 {med / base:.2f}", flush=True)


if __name__ == "__main__":
    main()
