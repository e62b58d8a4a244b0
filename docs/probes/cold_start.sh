#!/usr/bin/env bash
# A cold machine's first request on MLX CUDA, deltafin beside mlx-lm (run on the device after
# docs/probes/h200_setup.sh): each in fresh processes, first with an empty kernel cache
# (MLX_PTX_CACHE_DIR: MLX compiles its CUDA kernels with NVRTC at first use and keeps them there,
# by default under /tmp/mlx), then again with that cache filled.
#   bash docs/probes/cold_start.sh          mlx-lm and deltafin, cold then warm
#   bash docs/probes/cold_start.sh reboot   deltafin alone, MLX_PTX_CACHE_DIR unset as users run it:
#     cold (every cache empty), after a reboot (/tmp/mlx emptied: the kernels kept in deltafin's cache,
#     runtime.kernel_cache), and after a reboot with kernel_cache = "mlx" (MLX's /tmp default)
set -uo pipefail
export PYTHONPATH=/tmp/site:/tmp/ns PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}; mkdir -p "$out"
if [ "${1:-}" = reboot ]; then
  unset MLX_PTX_CACHE_DIR
  export DELTAFIN_CACHE=$HOME/.cache/deltafin-probe  # outside /tmp: outlives the "reboot" below
  rm -rf "$DELTAFIN_CACHE"
  for run in cold after-reboot after-reboot-mlx-default; do
    rm -rf /tmp/mlx  # what a boot does to /tmp on many systems
    mode="x:run_ahead = true:1.0"
    [ "$run" = after-reboot-mlx-default ] && mode='x:run_ahead = true;[runtime];kernel_cache = "mlx":1.0'
    t0=$(date +%s.%N)
    python3 docs/probes/real_split.py /tmp/store 1 "$mode" > "$out/reboot-$run.txt" 2>&1
    t1=$(date +%s.%N)
    echo "deltafin $run: supervisor start + one 64-token request $(python3 -c "print(round($t1 - $t0, 2))") s; $(grep -o '"ttft_s": [0-9.]*' "$out/reboot-$run.txt"); kept: $(du -sh "$DELTAFIN_CACHE/kernels" 2>/dev/null | cut -f1) in deltafin's cache, $(du -sh /tmp/mlx 2>/dev/null | cut -f1) in /tmp/mlx"
  done
  exit 0
fi
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
