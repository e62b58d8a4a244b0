#!/usr/bin/env bash
# Issue 28's open measurements on the lent H200, one device call per part (each well inside 10 min).
# After docs/probes/h200_setup.sh (MLX CUDA in /tmp/site, the deltafin namespace mapped in /tmp/ns,
# the checkpoint as a store in /tmp/store: deltafin-synth tiny qwen3_moe ... --init hf,
# then deltafin-convert; docs/BENCHMARKS.md "Running ahead"):
#   bash docs/probes/h200_partial.sh split    # launch_first, ahead_reads, leases, spin_ms: real supervisors, 25%
#   bash docs/probes/h200_partial.sh split50  # launch_first and ahead_reads at 50%
#   bash docs/probes/h200_partial.sh bench    # the same switches as bench contenders beside mlx-lm
#   bash docs/probes/h200_partial.sh exact    # the GPU exactness tests (streaming, run ahead, every mode)
# Everything goes to files under $OUT (the device's output tail is too short for -v).
set -uo pipefail
export PYTHONPATH=/tmp/site:/tmp/ns PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}
mkdir -p "$out"
case "${1:-split}" in
  split)
    python3 docs/probes/real_split.py /tmp/store 3 \
      "base:launch_first = false:0.25,lf:launch_first = true:0.25,one:ahead_reads = 1:0.25,lfone:launch_first = true;ahead_reads = 1:0.25,nolease:leases = false:0.25,spin:spin_ms = 2.0:0.25" -v \
      > "$out/split-0.25.txt" 2>&1
    grep "^r\|all same" "$out/split-0.25.txt" | cut -c1-260 ;;
  split50)
    python3 docs/probes/real_split.py /tmp/store 3 \
      "base:launch_first = false:0.5,lf:launch_first = true:0.5,one:ahead_reads = 1:0.5" -v \
      > "$out/split-0.5.txt" 2>&1
    grep "^r\|all same" "$out/split-0.5.txt" | cut -c1-260 ;;
  bench)
    python3 -m deltafin.tools.bench --store /tmp/store --trace none --regimes real --memory-budget 4GiB \
      --cache-frac 0.25 --dtype auto --contenders deltafin,deltafin-launch-first,deltafin-one-ahead,mlx-lm \
      --rounds 3 --prompt-tokens 9 --max-tokens 64 > "$out/bench.txt" 2>&1
    tail -40 "$out/bench.txt" ;;
  exact)
    python3 -m pytest -q -p no:cacheprovider -k "stream or gpu or run_ahead or rewind or kept" \
      tests/test_greedy_exact.py tests/test_run_ahead.py > "$out/exact.txt" 2>&1
    tail -15 "$out/exact.txt" ;;
esac
