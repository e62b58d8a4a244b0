#!/usr/bin/env bash
# A cold machine's first request on MLX CUDA, deltafin beside mlx-lm (run on the device after
# docs/probes/h200_setup.sh): each in fresh processes, first with an empty kernel cache
# (MLX_PTX_CACHE_DIR: MLX compiles its CUDA kernels with NVRTC at first use and keeps them there,
# by default under /tmp/mlx), then again with that cache filled.
set -uo pipefail
export PYTHONPATH=/tmp/site:/tmp/ns PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}; mkdir -p "$out"
[ -f /tmp/store.mlx-lm/config.json ] || python3 -m deltafin.tools.export_mlx /tmp/store /tmp/store.mlx-lm --no-progress > /dev/null
rm -rf /tmp/ptx-lm /tmp/ptx-df
for run in cold warm; do
  MLX_PTX_CACHE_DIR=/tmp/ptx-lm python3 - "$run" <<'PY'
import sys, time
t0 = time.perf_counter()
import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step
model, _ = load("/tmp/store.mlx-lm")
t1 = time.perf_counter()
steps = generate_step(mx.array([1, 504, 3458, 314, 260, 6123, 4876, 47, 198]), model, max_tokens=8)
tok, _ = next(steps)
t2 = time.perf_counter()
for _ in steps:
    pass
print(f"mlx-lm {sys.argv[1]}: load {t1 - t0:.2f} s, first token {t2 - t1:.2f} s, 8 tokens {time.perf_counter() - t1:.2f} s")
PY
done
for run in cold warm; do
  t0=$(date +%s.%N)
  MLX_PTX_CACHE_DIR=/tmp/ptx-df python3 docs/probes/real_split.py /tmp/store 1 "x:run_ahead = true:1.0" > "$out/cold-$run.txt" 2>&1
  t1=$(date +%s.%N)
  echo "deltafin $run: supervisor start + one 64-token request $(python3 -c "print(round($t1 - $t0, 2))") s; $(grep -o '"ttft_s": [0-9.]*' "$out/cold-$run.txt")"
done
du -sh /tmp/ptx-lm /tmp/ptx-df
