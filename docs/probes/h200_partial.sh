#!/usr/bin/env bash
# Issue 28's open measurements on the lent H200, one device call per part (each well inside 10 min).
# After docs/probes/h200_setup.sh (MLX CUDA in /tmp/site, the deltafin namespace mapped in /tmp/ns,
# the issue's checkpoint as a store in /tmp/store: deltafin-synth tiny qwen3_moe ... --init hf,
# then deltafin-convert; docs/BENCHMARKS.md "Running ahead"):
#   bash docs/probes/h200_partial.sh split    # launch_first, ahead_reads, leases, spin_ms: real supervisors, 25%
#   bash docs/probes/h200_partial.sh next     # CUDA graphs off as the base, with launch_first, with depth 2; graphs on: 25%
#   bash docs/probes/h200_partial.sh depth    # launch_first at depth 1, 2, 4, 8 beside auto (graphs off): 25%
#   bash docs/probes/h200_partial.sh split50  # launch_first and ahead_reads at 50%
#   bash docs/probes/h200_partial.sh bench [SHARE [ROUNDS]]  # CUDA graphs (MLX's default) and without, beside mlx-lm (0.25, 2)
#   bash docs/probes/h200_partial.sh auto     # cuda_graphs "auto" at 25% (beside graphs, launch first) and all resident
#   bash docs/probes/h200_partial.sh stop45   # auto, unweighted, launch first, mlx-lm at 25% (3 rounds); all resident (1 round)
#   bash docs/probes/h200_partial.sh weigh    # cache.weigh_misses on and off at 25% (bench, 3 rounds), then depth
#   bash docs/probes/h200_partial.sh goal3    # bench at 25% and at 50%, 3 rounds each: the issue's goals on its checkpoint
#   bash docs/probes/h200_partial.sh exact    # the GPU exactness tests (streaming, run ahead, every mode)
#   bash docs/probes/h200_partial.sh goal     # issue 28 in one call: the streaming check (graphs off included), then bench
#   bash docs/probes/h200_partial.sh profile  # each worker under cProfile (wall clock), 25% and all resident
#   bash docs/probes/h200_partial.sh inproc   # docs/probes/partial_layer.py: resident, sync, partial in one process, partial profiled
#   bash docs/probes/h200_partial.sh timing   # partial_layer.py, TIMING=1: host time in async_eval / eval / read-backs per variant, graphs off
#   bash docs/probes/h200_partial.sh nodes    # partial_layer.py, NODES=1: primitives launched per token, all resident / 25% / launch first
#   bash docs/probes/h200_partial.sh place    # docs/probes/pool_place.py: expert compute and fills with pools in host / device / managed memory
#   bash docs/probes/h200_partial.sh copies   # pools filled by the driver (device_copies) against host pools: probe, bench 25% x3, streaming check
#   bash docs/probes/h200_partial.sh big      # dsv2-lite-sized experts (4 x 64, top-6, hidden 2048): pool_place, then bench device copies vs host pools
#   bash docs/probes/h200_partial.sh pass     # bench.ahead_launch "pass" (default) beside "layer": one process (TIMING), real supervisors (-v)
#   bash docs/probes/h200_partial.sh passbench [ROUNDS]  # the same as bench contenders (deltafin, deltafin-ahead-layer) beside mlx-lm at 25% (3)
#   bash docs/probes/h200_partial.sh final50  # the defaults at 50% (3 rounds) and all resident (1), beside mlx-lm
#   bash docs/probes/h200_partial.sh close28a # issue 28 in two calls: the GPU exactness tests (~250 s on an H100),
#   bash docs/probes/h200_partial.sh close28b # then the bench at 25% (+ early passes, no foresight), 50% and all resident
#   bash docs/probes/h200_partial.sh foresight # bench.foresight on/off at 25%, real supervisors, 3 rounds
#   bash docs/probes/h200_partial.sh missplit # 25%, real supervisors, after a warm-up: what a missed pass's time waits on (miss_split_ms)
#   bash docs/probes/h200_partial.sh waits [SECONDS] # bench.device_waits: spin_wait.py, its GPU tests, the 25% bench beside the defaults
#   bash docs/probes/h200_partial.sh spin     # docs/probes/spin_wait.py: a kernel waiting mid-pass for the host (a miss's read)
#   bash docs/probes/h200_partial.sh each72   # bench.check_each on/off at 25% after a warm-up, 3 pairs: does finding a miss sooner pay now
#   bash docs/probes/h200_partial.sh early    # bench.early_passes on/off at 25%, real supervisors, 3 rounds
#   bash docs/probes/h200_partial.sh one50    # the 25% bench (default, early passes, both) and 50%, in one call
#   bash docs/probes/h200_partial.sh stop51   # early passes (default) against the old order at 25%, then real supervisors' split
#   bash docs/probes/h200_partial.sh mini51   # its split per token alone, 25%, one round
#   bash docs/probes/h200_partial.sh stop52   # on an H200: close28a, then the 25% bench; elsewhere the open settings spin_ms and leases at 25%
#   bash docs/probes/h200_partial.sh stop53   # any GPU: close28a with the defaults (spin_ms "auto"), then 25% (3 rounds) and 50% (2) beside mlx-lm
#   bash docs/probes/h200_partial.sh stop54   # CUDA graphs on while streaming (deltafin-cuda-graphs) beside the defaults at 25% (3) and 50% (2)
#   bash docs/probes/h200_partial.sh nodisk   # the store on tmpfs beside it on disk at 25% (bench x2 alternating), then the split per token from tmpfs
#   bash docs/probes/h200_partial.sh misses   # 25%: the misses a need found read ahead but not in yet (the rest never read ahead), disk then tmpfs
#   bash docs/probes/h200_partial.sh waste [ROUNDS] # bench.ahead_waste 1, 0.5, 0.25, 0.1 alternating at 25% (real supervisors)
#   bash docs/probes/h200_partial.sh prof50   # compute under cProfile at 50% and all resident, after a warm-up supervisor
#   bash docs/probes/h200_partial.sh profile2 # a warm-up supervisor, then every worker under cProfile at 25% (the .prof files under $OUT)
#   bash docs/probes/h200_partial.sh launches # all resident: one launch per token against one per MoE layer (resident-launch1) and two (resident-launch2)
#   bash docs/probes/h200_partial.sh stop53b  # the same, then ahead reads yielding to demand reads (deltafin-yield) beside the defaults at 25%
#   bash docs/probes/h200_partial.sh defer [ROUNDS] # bench.defer_needs against without at 25% (bench beside mlx-lm), then real supervisors' split
#   bash docs/probes/h200_partial.sh fold [ROUNDS]  # bench.fold_sends against without at 25% (bench), then real supervisors' split and messages
#   bash docs/probes/h200_partial.sh batch [ROUNDS] # the default (bench.batch_copies on) against it off at 25% (bench beside mlx-lm), then the driver tests
#   bash docs/probes/h200_setup.sh > $OUT/setup.txt 2>&1; ISSUE28_S=$((585 - SECONDS)) bash docs/probes/h200_partial.sh issue28
#                                             # issue 28's two goals in one call of <= 600 s on a fresh machine
#   bash docs/probes/h200_partial.sh chunk [ROUNDS]  # whole reads / 324 KiB pieces / demand reads in quarters (the default) at 25%, real supervisors (-v)
#   bash docs/probes/h200_partial.sh stop64 [SECONDS] # an H200: issue28; another GPU: chunk, then the bench with deltafin-whole-reads
#   bash docs/probes/h200_setup.sh > $OUT/setup.txt 2>&1; bash docs/probes/h200_partial.sh stop65 $((585 - SECONDS))
#                                             # bench.demand_pieces on: the GPU list, then chunk and the 25% bench beside whole reads
#   bash docs/probes/h200_setup.sh > $OUT/setup.txt 2>&1; bash docs/probes/h200_partial.sh goal2 $((585 - SECONDS))
#                                             # issue 28's speed goal (25% and 50% beside mlx-lm); then close28a 560 in the next call
#   bash docs/probes/h200_partial.sh mini28 [SECONDS]  # the least of issue28: the 25% bench, then the greedy list in what is left
#   bash docs/probes/h200_partial.sh peak [SHARE]  # docs/probes/pss_timeline.py from an empty kernel cache: where a first run's ~4 GB peak is
#   bash docs/probes/h200_partial.sh h200all|h100all [SECONDS]  # one call after the setup: the 25% bench and the peak runs (see the cases)
#   bash docs/probes/h200_partial.sh peak3 [SHARE]  # a first run's peak, and with MALLOC_MMAP_THRESHOLD_=131072
#   bash docs/probes/h200_partial.sh trim [SHARE]  # docs/probes/jit_trim.py: that growth as glibc heap (in use / free), before and after malloc_trim
#   bash docs/probes/h200_partial.sh warmstart [SHARE [STARTUP_S]]  # docs/probes/warm_start.py: a start under a 30 s startup_timeout_s that the warm-up must outlast (first on a fresh machine)
#   bash docs/probes/h200_partial.sh peers    # mlx-vlm's expert offload (its wheel in .devwheels/c) beside deltafin and mlx-lm at 25%; peers50 at 50%
#   bash docs/probes/h200_partial.sh stop50   # early passes, layers checked one by one, both, beside the default at 25%
#   (docs/probes/ahead_race.py: test_run_ahead's store, first-pass logits per setting: device copies' inexactness)
#   bash docs/probes/h200_partial.sh graphs   # partial_layer.py under MLX CUDA's graph settings (MLX_USE_CUDA_GRAPHS, MLX_MAX_OPS_PER_BUFFER)
# Everything goes to files under $OUT (the device's output tail is too short for -v).
# On a fresh machine the first measurement spends a minute or more before any result (the mlx-lm
# checkpoint written, MLX CUDA's kernels compiled): do not cut a first call under ~400 s (stop 60).
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
  next)  # graphs off as the base: launch first and two layers unchecked beside it, and MLX's default
    python3 docs/probes/real_split.py /tmp/store 3 \
      "g0:cuda_graphs = false:0.25,g0lf:cuda_graphs = false;launch_first = true:0.25,g0lf2:cuda_graphs = false;launch_first = true;ahead_depth = 2:0.25,graphs:cuda_graphs = true:0.25" -v \
      > "$out/next-0.25.txt" 2>&1
    grep "^r\|all same" "$out/next-0.25.txt" | cut -c1-300 ;;
  depth)  # launching first with 1, 2, 4 and 8 layers left unchecked (8: one read-back per token), beside auto
    python3 docs/probes/real_split.py /tmp/store 3 \
      "auto:launch_first = false:0.25,lf1:launch_first = true:0.25,lf2:launch_first = true;ahead_depth = 2:0.25,lf4:launch_first = true;ahead_depth = 4:0.25,lf8:launch_first = true;ahead_depth = 8:0.25" -v \
      > "$out/depth-0.25.txt" 2>&1
    grep "^r\|all same" "$out/depth-0.25.txt" | cut -c1-300 ;;
  split50)
    python3 docs/probes/real_split.py /tmp/store 3 \
      "base:launch_first = false:0.5,lf:launch_first = true:0.5,one:ahead_reads = 1:0.5" -v \
      > "$out/split-0.5.txt" 2>&1
    grep "^r\|all same" "$out/split-0.5.txt" | cut -c1-260 ;;
  bench)  # [SHARE [ROUNDS [CONTENDERS]]]: 0.25, 2 and graphs on and off beside mlx-lm unless given; the table in $out/bench-SHARE.txt, the report (every round's figures) in bench-SHARE.json
    share=${2:-0.25}; rounds=${3:-2}; contenders=${4:-deltafin,deltafin-cuda-graphs,mlx-lm}
    python3 -m deltafin.tools.bench --store /tmp/store --trace none --regimes real --memory-budget 4GiB \
      --cache-frac "$share" --dtype auto --contenders "$contenders" \
      --rounds "$rounds" --prompt-tokens 9 --max-tokens 64 > "$out/bench-$share.txt" 2>&1
    # the report (each round's figures, the peak tree PSS among them) beside the table
    rep=$(grep -o 'report: .*report.json' "$out/bench-$share.txt" | tail -1 | cut -c9-)
    if [ -n "$rep" ] && [ -f "$rep" ]; then cp "$rep" "$out/bench-$share.json"; fi
    tail -30 "$out/bench-$share.txt" ;;
  auto)  # cuda_graphs "auto": at 25% against graphs and launch first, 3 rounds; all resident against graphs off
    timeout 270 bash "$0" bench 0.25 3 deltafin,deltafin-cuda-graphs,deltafin-launch-first,mlx-lm
    timeout 110 bash "$0" bench 1.0 2 deltafin,deltafin-no-cuda-graphs,mlx-lm ;;
  stop45)  # one call: auto (graphs off while streaming) beside probability-alone victims and launch first at 25%; all resident
    timeout 330 bash "$0" bench 0.25 3 deltafin,deltafin-unweighted,deltafin-launch-first,mlx-lm
    timeout 120 bash "$0" bench 1.0 1 deltafin,deltafin-no-cuda-graphs,mlx-lm ;;
  weigh)  # cache.weigh_misses against probability alone, 25%, 3 rounds; then launch first's depths
    timeout 200 bash "$0" bench 0.25 3 deltafin,deltafin-unweighted
    timeout 280 bash "$0" depth ;;
  goal3)  # issue 28's goals on its checkpoint: 3 rounds at 25% and at 50% beside mlx-lm (tokens and time)
    timeout 280 bash "$0" bench 0.25 3
    timeout 250 bash "$0" bench 0.5 3 ;;
  profile)
    for share in 0.25 1.0; do
      rm -rf "/tmp/prof-$share"
      DELTAFIN_PROFILE_DIR="/tmp/prof-$share" python3 docs/probes/real_split.py /tmp/store 1 "base:launch_first = false:$share" -v \
        > "$out/profile-split-$share.txt" 2>&1
      for f in /tmp/prof-$share/*.prof; do
        python3 -c "import pstats, sys; s = pstats.Stats(sys.argv[1]); s.sort_stats('tottime').print_stats(40); s.sort_stats('cumulative').print_stats(60)" \
          "$f" > "$out/profile-$share-$(basename "$f" .prof).txt" 2>&1
      done
    done
    grep -h "^r" "$out"/profile-split-*.txt | cut -c1-400 ;;
  peak)  # [SHARE]: a fresh machine's first-run peak: two runs from an empty MLX kernel cache, each process's PSS over time
    MLX_PTX_CACHE_DIR=$(mktemp -d) timeout 400 python3 docs/probes/pss_timeline.py /tmp/store "${2:-0.25}" 2 > "$out/peak.txt" 2>&1
    cat "$out/peak.txt" | cut -c1-300 ;;
  peak3)  # [SHARE]: a first run's memory from an empty kernel cache, then again with glibc's mmap threshold fixed at 128 KiB (MALLOC_MMAP_THRESHOLD_=131072); stop 68 also ran a heap trimmed from a thread every 50 ms (c36eaf4's code, removed: 3,620 against 3,821 MiB)
    MLX_PTX_CACHE_DIR=$(mktemp -d) timeout 170 python3 docs/probes/pss_timeline.py /tmp/store "${2:-0.25}" 1 > "$out/peak-plain.txt" 2>&1
    MALLOC_MMAP_THRESHOLD_=131072 MLX_PTX_CACHE_DIR=$(mktemp -d) timeout 170 python3 docs/probes/pss_timeline.py /tmp/store "${2:-0.25}" 1 > "$out/peak-mmap.txt" 2>&1
    cut -c1-300 "$out/peak-plain.txt" "$out/peak-mmap.txt" ;;
  trim)  # [SHARE]: docs/probes/jit_trim.py from an empty kernel cache, then with it filled: is the first run's growth free heap?
    d=$(mktemp -d)
    MLX_PTX_CACHE_DIR=$d timeout 250 python3 docs/probes/jit_trim.py /tmp/store "${2:-0.25}" > "$out/trim.txt" 2>&1
    MLX_PTX_CACHE_DIR=$d timeout 100 python3 docs/probes/jit_trim.py /tmp/store "${2:-0.25}" >> "$out/trim.txt" 2>&1
    cut -c1-300 "$out/trim.txt" ;;
  prof50)  # a warm-up supervisor, then compute under cProfile (wall clock) at 50% and all resident: what a streaming token adds where few miss (the .prof files and their tables under $OUT)
    python3 docs/probes/real_split.py /tmp/store 1 "warm:run_ahead = true:0.5" > "$out/prof50-warm.txt" 2>&1
    for share in 0.5 1.0; do
      rm -rf "/tmp/prof50-$share"
      DELTAFIN_PROFILE_DIR="/tmp/prof50-$share" python3 docs/probes/real_split.py /tmp/store 1 "x:run_ahead = true:$share" -v \
        > "$out/prof50-split-$share.txt" 2>&1
      for f in /tmp/prof50-$share/compute*.prof; do
        cp "$f" "$out/compute-$share.prof"
        python3 -c "import pstats, sys; s = pstats.Stats(sys.argv[1]); s.sort_stats('tottime').print_stats(45); s.sort_stats('cumulative').print_stats(70)" \
          "$f" > "$out/prof50-$share-compute.txt" 2>&1
      done
    done
    grep -h "^r" "$out"/prof50-warm.txt "$out"/prof50-split-*.txt | cut -c1-500 ;;
  profile2)  # one warm-up supervisor (compiles the kernels), then every worker under cProfile at 25%; the .prof files to $OUT
    python3 docs/probes/real_split.py /tmp/store 1 "warm:run_ahead = true:0.25" > "$out/profile2-warm.txt" 2>&1
    rm -rf /tmp/prof2
    DELTAFIN_PROFILE_DIR=/tmp/prof2 python3 docs/probes/real_split.py /tmp/store 1 "x:run_ahead = true:0.25" -v > "$out/profile2-split.txt" 2>&1
    cp /tmp/prof2/*.prof "$out/"
    grep "^r" "$out/profile2-warm.txt" "$out/profile2-split.txt" | cut -c1-400 ;;
  inproc)
    PROFILE=partial python3 docs/probes/partial_layer.py /tmp/store 64 64 3 > "$out/inproc.txt" 2>&1
    grep "median\|differ" "$out/inproc.txt" ;;
  timing)  # [ROUNDS]: graphs off (as the runtime runs while streaming), then MLX's default
    MLX_USE_CUDA_GRAPHS=0 TIMING=1 timeout 300 python3 docs/probes/partial_layer.py /tmp/store 64 64 "${2:-3}" \
      resident,sync,partial,partial-lf,partial-d8,partial-dev > "$out/timing-g0.txt" 2>&1
    grep "host ms\|median\|differ" "$out/timing-g0.txt" | cut -c1-300
    TIMING=1 timeout 200 python3 docs/probes/partial_layer.py /tmp/store 64 64 2 resident,sync,partial \
      > "$out/timing-g1.txt" 2>&1
    grep "median\|differ" "$out/timing-g1.txt" | cut -c1-300 ;;
  nodes)
    MLX_USE_CUDA_GRAPHS=0 NODES=1 timeout 200 python3 docs/probes/partial_layer.py /tmp/store 64 32 1 \
      resident,partial,partial-lf > "$out/nodes.txt" 2>&1
    grep "nodes per token\|median" "$out/nodes.txt" | cut -c1-600 ;;
  place)
    MLX_USE_CUDA_GRAPHS=0 timeout 250 python3 docs/probes/pool_place.py /tmp/store 8 64 3 > "$out/place-g0.txt" 2>&1
    cat "$out/place-g0.txt" | cut -c1-300
    [ "${2:-}" = "g0" ] && exit 0
    timeout 200 python3 docs/probes/pool_place.py /tmp/store 8 64 3 > "$out/place-g1.txt" 2>&1
    cat "$out/place-g1.txt" | cut -c1-300 ;;
  copies)  # device_copies (the default on a GPU) against host pools (deltafin-host-pools)
    timeout 90 bash "$0" place g0
    timeout 260 bash "$0" bench 0.25 3 deltafin,deltafin-host-pools,mlx-lm
    timeout 200 python3 -m pytest -q -p no:cacheprovider -k "streaming_gives or driver" tests/test_greedy_exact.py \
      tests/test_resident.py > "$out/copies-exact.txt" 2>&1
    tail -4 "$out/copies-exact.txt" ;;
  big)  # experts of DeepSeek-V2-Lite's size (hidden 2048, 1408 wide, 4.6 MB a record): where the bus reads weigh
    if [ ! -f /tmp/storebig/manifest.json ]; then
      python3 -m deltafin.tools.synth tiny qwen3_moe /tmp/hfbig --layers 4 --experts 64 --top-k 6 --hidden 2048 \
        --moe-intermediate 1408 --vocab 8192 --dtype bfloat16 --init hf > /tmp/synthbig.log 2>&1
      python3 -m deltafin.tools.convert /tmp/hfbig /tmp/storebig --no-progress > /tmp/convertbig.log 2>&1
    fi
    MLX_USE_CUDA_GRAPHS=0 timeout 120 python3 docs/probes/pool_place.py /tmp/storebig 16 32 2 > "$out/big-place.txt" 2>&1
    cut -c1-300 "$out/big-place.txt"
    timeout 300 python3 -m deltafin.tools.bench --store /tmp/storebig --trace none --regimes real --memory-budget 8GiB \
      --cache-frac 0.25 --dtype auto --contenders deltafin,deltafin-host-pools --rounds "${2:-2}" --prompt-tokens 9 \
      --max-tokens 64 > "$out/big-bench.txt" 2>&1
    tail -12 "$out/big-bench.txt" | cut -c1-330 ;;
  pass)  # layers run ahead launched and read back once per pass, against one layer at a time
    MLX_USE_CUDA_GRAPHS=0 TIMING=1 timeout 200 python3 docs/probes/partial_layer.py /tmp/store 64 64 3 \
      resident,partial-layer,partial > "$out/pass-timing.txt" 2>&1
    grep "host ms\|median\|differ" "$out/pass-timing.txt" | cut -c1-300
    timeout 300 python3 docs/probes/real_split.py /tmp/store 3 \
      "layer:ahead_launch = \"layer\":0.25,pass:ahead_launch = \"pass\":0.25" -v > "$out/pass-split.txt" 2>&1
    grep "^r\|all same" "$out/pass-split.txt" | cut -c1-420
    grep -o "pipeline={[^}]*}" "$out/pass-split.txt" ;;
  passbench)
    timeout 420 bash "$0" bench 0.25 "${2:-3}" deltafin,deltafin-ahead-layer,mlx-lm ;;
  close28a)  # [SECONDS]: issue 28's exactness on a GPU with the defaults: real-process streaming, driver copies, run ahead
    # (in that order: a slow host's limit cuts the run-ahead unit tests first; stop 62 ran 15 of 37)
    timeout "${2:-420}" python3 -m pytest -q -p no:cacheprovider -k "streaming_gives or run_ahead or kept or driver or pinned" \
      tests/test_greedy_exact.py tests/test_resident.py tests/test_run_ahead.py > "$out/close28a.txt" 2>&1
    tail -6 "$out/close28a.txt" ;;
  batch)  # [ROUNDS]: the default (bench.batch_copies: the driver's copies waited for once per acknowledgement) against it off, at 25% (bench beside mlx-lm, 3 rounds unless given), then the driver tests
    nvidia-smi --query-gpu=name --format=csv,noheader
    timeout 300 bash "$0" bench 0.25 "${2:-3}" deltafin-no-batch-copies,deltafin,mlx-lm | tail -12
    timeout 120 python3 -m pytest -q -p no:cacheprovider -k "driver or pinned or acknowledged" tests/test_resident.py > "$out/batch-tests.txt" 2>&1
    tail -3 "$out/batch-tests.txt" ;;
  issue28)  # issue 28's two goals in one device call (600 s at most, h200_setup.sh before it) on a fresh machine: the 25% bench beside mlx-lm first (goal 2, and its runs' tokens against mlx-lm's), then close28a (goal 1), then the 50% bench with what time is left
    start=$SECONDS
    nvidia-smi --query-gpu=name --format=csv,noheader
    timeout 150 bash "$0" bench 0.25 3 deltafin,mlx-lm | tail -8
    left=$((${ISSUE28_S:-555} - (SECONDS - start)))  # ISSUE28_S: the seconds the call has left after the setup
    bash "$0" close28a $((left < 390 ? left : 390))  # its pytest under what the call has left
    left=$((${ISSUE28_S:-555} - (SECONDS - start)))
    rounds=2; if [ "$left" -gt 100 ]; then rounds=3; fi  # goal 1 asks for 3 runs at 50% too
    if [ "$left" -gt 45 ]; then timeout "$left" bash "$0" bench 0.5 "$rounds" deltafin,mlx-lm | tail -8; fi ;;
  mini28)  # [SECONDS]: issue 28's goals in what little a call has left after the setup (400 unless given): the 25% bench beside mlx-lm (3 rounds), then the real-process greedy list (goal 1's check)
    start=$SECONDS; budget=${2:-400}
    nvidia-smi --query-gpu=name --format=csv,noheader
    timeout 200 bash "$0" bench 0.25 3 deltafin,mlx-lm | tail -8
    left=$((budget - (SECONDS - start)))
    if [ "$left" -gt 10 ]; then
      timeout "$left" python3 -m pytest -q -s -p no:cacheprovider -k streaming_gives \
        tests/test_greedy_exact.py > "$out/mini28-stream.txt" 2>&1
      grep -c "=mlx-lm" "$out/mini28-stream.txt"; tail -4 "$out/mini28-stream.txt"
    fi ;;
  chunk)  # [ROUNDS]: read pieces at 25%, real supervisors alternating (3 rounds): whole records (deltafin-whole-reads), quarters of the store's 1.27 MiB records (324 KiB) for every read, and quarters for demand reads alone, ahead reads whole and yielding (bench.demand_pieces 4, the default since 2026-12-07; on this store what deltafin-demand-324k does)
    python3 docs/probes/real_split.py /tmp/store "${2:-3}" \
      "whole:demand_pieces = 1:0.25,c324:chunk_bytes = 331776:0.25,d324:demand_pieces = 4:0.25" -v \
      > "$out/chunk-0.25.txt" 2>&1
    grep "^r\|all same" "$out/chunk-0.25.txt" | cut -c1-200
    grep -o '"demand_read": {"count": [0-9]*, "p50_ms": [0-9.]*\|"queue_wait": {"count": [0-9]*, "p50_ms": [0-9.]*' "$out/chunk-0.25.txt" | paste - - ;;
  stop64)  # [SECONDS]: on an H200 issue28 in SECONDS (the call's time after the setup), elsewhere chunk then the 25% bench
    gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$gpu"
    if [[ "$gpu" == *H200* ]]; then ISSUE28_S=${2:-555} bash "$0" issue28
    else timeout 250 bash "$0" chunk 3
      timeout 200 bash "$0" bench 0.25 3 deltafin-whole-reads,deltafin,mlx-lm | tail -8; fi ;;
  stop65)  # [SECONDS]: bench.demand_pieces (the default since stop 65) on any GPU in SECONDS after the setup (555 unless given): the GPU list with it on (close28a, at most 300 s), then chunk and the 25% bench beside whole reads and mlx-lm with what is left
    start=$SECONDS; budget=${2:-555}
    nvidia-smi --query-gpu=name --format=csv,noheader
    bash "$0" close28a $((budget < 300 ? budget : 300))
    left=$((budget - (SECONDS - start))); if [ "$left" -gt 60 ]; then timeout 60 bash "$0" chunk 2; fi
    left=$((budget - (SECONDS - start))); if [ "$left" -gt 60 ]; then timeout "$left" bash "$0" bench 0.25 3 deltafin-whole-reads,deltafin,mlx-lm | tail -8; fi ;;
  warmstart)  # [SHARE [STARTUP_S]]: the supervisor waits out compute's warm-up on its progress reports (stop 69)
    timeout 560 python3 docs/probes/warm_start.py /tmp/store "${2:-0.25}" "${3:-30}" > "$out/warmstart.txt" 2>&1
    tail -8 "$out/warmstart.txt" ;;
  goal2)  # [SECONDS]: issue 28's speed goal on a fresh machine in SECONDS after the setup (555 unless given): the 25% bench beside mlx-lm (3 rounds, at most 280 s: 247 s on a fresh H100 in stop 66; the first run compiles MLX CUDA's kernels and writes the mlx-lm checkpoint), then 50% with what is left; run close28a in a call of its own after it (stop 66: 147 s warm, 17 of 37 in 300 s on a fresh machine)
    start=$SECONDS; budget=${2:-555}
    nvidia-smi --query-gpu=name --format=csv,noheader
    timeout 280 bash "$0" bench 0.25 3 deltafin,mlx-lm | tail -7
    left=$((budget - (SECONDS - start))); if [ "$left" -gt 60 ]; then timeout "$left" bash "$0" bench 0.5 3 deltafin,mlx-lm | tail -6; fi ;;
  goal2each)  # [SECONDS]: goal2 with bench.check_each beside the defaults at 25% (3 rounds, at most 420 s; the bound measured before each round), then 50% (deltafin, mlx-lm) with what is left
    start=$SECONDS; budget=${2:-555}
    nvidia-smi --query-gpu=name --format=csv,noheader
    timeout 420 bash "$0" bench 0.25 3 deltafin,deltafin-check-each,mlx-lm | tail -8
    left=$((budget - (SECONDS - start))); if [ "$left" -gt 60 ]; then timeout "$left" bash "$0" bench 0.5 3 deltafin,mlx-lm | tail -6; fi ;;
  goal2g)  # [SECONDS]: goal2 with MLX CUDA's graphs beside (deltafin-cuda-graphs) at 25%, 3 rounds (at most 420 s), then 50% (deltafin, mlx-lm) with what is left
    start=$SECONDS; budget=${2:-555}
    nvidia-smi --query-gpu=name --format=csv,noheader
    timeout 420 bash "$0" bench 0.25 3 deltafin,deltafin-cuda-graphs,mlx-lm | tail -8
    left=$((budget - (SECONDS - start))); if [ "$left" -gt 60 ]; then timeout "$left" bash "$0" bench 0.5 3 deltafin,mlx-lm | tail -6; fi ;;
  h200all)  # [SECONDS]: one call on a fresh H200 after the setup: the 25% bench beside mlx-lm (3 rounds, at most 280 s), then a first run's memory from an empty kernel cache (pss_timeline.py) with what is left
    start=$SECONDS; budget=${2:-520}
    nvidia-smi --query-gpu=name --format=csv,noheader
    timeout 280 bash "$0" bench 0.25 3 deltafin,mlx-lm | tail -7
    left=$((budget - (SECONDS - start)))
    MLX_PTX_CACHE_DIR=$(mktemp -d) timeout "$left" python3 docs/probes/pss_timeline.py /tmp/store 0.25 1 > "$out/peak-plain.txt" 2>&1
    cut -c1-300 "$out/peak-plain.txt" ;;
  h100all)  # [SECONDS]: on any other GPU after the setup: a first run's memory (peak3), then the 25% bench beside mlx-lm (2 rounds) with what is left
    start=$SECONDS; budget=${2:-520}
    nvidia-smi --query-gpu=name --format=csv,noheader
    timeout 250 bash "$0" peak3
    left=$((budget - (SECONDS - start))); if [ "$left" -gt 90 ]; then timeout "$left" bash "$0" bench 0.25 2 deltafin,mlx-lm | tail -6; fi ;;
  close28b)  # issue 28's speed goals: 25% (defaults beside no foresight and host pools), 50%, all resident
    timeout 300 bash "$0" bench 0.25 3 deltafin,deltafin-host-pools,deltafin-no-foresight,mlx-lm
    timeout 220 bash "$0" final50 ;;
  foresight)  # bench.foresight on/off at 25%, real supervisors alternating: split, counters, messages (a warm-up run first, so the first pair compiles nothing)
    python3 docs/probes/real_split.py /tmp/store 1 "warm:foresight = true:0.25" > "$out/foresight-warm.txt" 2>&1
    python3 docs/probes/real_split.py /tmp/store 3 "fs:foresight = true:0.25,nofs:foresight = false:0.25" -v \
      > "$out/foresight-0.25.txt" 2>&1
    grep "^r\|all same" "$out/foresight-0.25.txt" | cut -c1-400 ;;
  missplit)  # what a missed pass's time goes to at 25%: a warm-up run (compiles), then 2 rounds; the split and miss_split_ms
    python3 docs/probes/real_split.py /tmp/store 1 "warm:foresight = true:0.25" > "$out/missplit-warm.txt" 2>&1
    python3 docs/probes/real_split.py /tmp/store 2 "x:foresight = true:0.25" -v > "$out/missplit-0.25.txt" 2>&1
    grep "^r\|all same" "$out/missplit-0.25.txt" | grep -o "decode_tok_s[^,]*\|decode_ms_per_token=[^}]*}\|'ahead_missed'[^,]*\|'missed_passes.*" ;;
  waits)  # [SECONDS]: bench.device_waits: the probe, its GPU tests, then the 25% bench beside the defaults in what is left
    start=$SECONDS; budget=${2:-560}
    timeout 150 python3 docs/probes/spin_wait.py 64 40 > "$out/spin.txt" 2>&1; tail -5 "$out/spin.txt"
    if ! grep -q "outputs equal: True" "$out/spin.txt" || ! grep -q "right: 40 of 40" "$out/spin.txt"; then
      echo "the probe failed: no tests, no bench"; exit 0; fi
    timeout 240 python3 -m pytest -q -p no:cacheprovider -x -k "device_wait" tests/test_run_ahead.py > "$out/waits-tests.txt" 2>&1
    grep -E "passed|failed|Error|assert" "$out/waits-tests.txt" | tail -12
    left=$((budget - (SECONDS - start)))
    rounds=3; if [ "$left" -lt 300 ]; then rounds=2; fi
    if [ "$left" -gt 150 ]; then timeout "$left" bash "$0" bench 0.25 "$rounds" deltafin,deltafin-device-waits,mlx-lm | tail -14; fi ;;
  spin)  # docs/probes/spin_wait.py: can a kernel wait mid-pass for the host to write a missing expert's slot
    timeout 200 python3 docs/probes/spin_wait.py 64 40 > "$out/spin.txt" 2>&1; cat "$out/spin.txt" | tail -20 ;;
  each72)  # bench.check_each against the defaults at 25% after a warm-up: 3 pairs of real supervisors, the miss split of each
    python3 docs/probes/real_split.py /tmp/store 1 "warm:foresight = true:0.25" > "$out/each72-warm.txt" 2>&1
    python3 docs/probes/real_split.py /tmp/store 3 "base:check_each = false:0.25,each:check_each = true:0.25" -v \
      > "$out/each72-0.25.txt" 2>&1
    grep "^r\|all same" "$out/each72-0.25.txt" | grep -o "^r[0-9] [a-z]*\|decode_tok_s[^,]*\|'ahead_missed'[^,]*\|'missed_passes.*" ;;
  mini50)  # one round of tiny50
    timeout 130 bash "$0" bench 0.25 1 deltafin,deltafin-early-each,mlx-lm ;;
  tiny50)  # the least: 25%, the default beside early passes with layers checked one by one, 2 rounds
    timeout 220 bash "$0" bench 0.25 2 deltafin,deltafin-early-each,mlx-lm ;;
  short50)  # what little device time allows: 25% (the default, early passes with layers checked one by one), 50%
    timeout 290 bash "$0" bench 0.25 3 deltafin,deltafin-early-each,mlx-lm
    timeout 150 bash "$0" bench 0.5 2 deltafin,mlx-lm ;;
  one50)  # one call: 25% (early passes, both, the default) and 50% beside mlx-lm, tokens checked each run
    timeout 330 bash "$0" bench 0.25 3 deltafin,deltafin-early-passes,deltafin-early-each,mlx-lm
    timeout 200 bash "$0" bench 0.5 2 deltafin,mlx-lm ;;
  stop51)  # early passes (the default now) against the old order at 25% (bench, 3 rounds), then the split per token
    timeout 200 bash "$0" bench 0.25 3 deltafin,deltafin-no-early-passes,mlx-lm
    timeout 150 python3 docs/probes/real_split.py /tmp/store 1 "ep:early_passes = true:0.25,noep:early_passes = false:0.25,layer:ahead_launch = \"layer\":0.25,ep50:early_passes = true:0.5,noep50:early_passes = false:0.5" -v \
      > "$out/split51.txt" 2>&1
    grep "^r\|all same" "$out/split51.txt" | cut -c1-420 ;;
  mini51)  # the least of stop51: the split per token at 25% (early passes, the old order, each layer launched as built)
    timeout 100 python3 docs/probes/real_split.py /tmp/store 1 "ep:early_passes = true:0.25,noep:early_passes = false:0.25,layer:ahead_launch = \"layer\":0.25" -v \
      > "$out/split51.txt" 2>&1
    grep "^r\|all same" "$out/split51.txt" | cut -c1-420 ;;
  stop52)  # issue 28 on an H200 (exactness, then 25% beside mlx-lm); on another GPU bench.spin_ms and compute.leases at 25%
    if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
      bash "$0" close28a
      timeout 200 bash "$0" bench 0.25 3 deltafin,mlx-lm
    else
      timeout 330 bash "$0" bench 0.25 3 deltafin,deltafin-spin,deltafin-no-leases,mlx-lm
    fi ;;
  stop53)  # issue 28 with the defaults as they stand (spin_ms "auto"): exactness, then 25% and 50% beside mlx-lm
    nvidia-smi --query-gpu=name --format=csv,noheader
    bash "$0" close28a
    timeout 200 bash "$0" bench 0.25 3 deltafin,mlx-lm
    timeout 150 bash "$0" bench 0.5 2 deltafin,mlx-lm ;;
  stop54)  # CUDA graphs while streaming, now that a pass is launched at once (untested since stop 47), at 25% and 50%
    nvidia-smi --query-gpu=name --format=csv,noheader
    timeout 260 bash "$0" bench 0.25 3 deltafin,deltafin-cuda-graphs,mlx-lm
    timeout 200 bash "$0" bench 0.5 2 deltafin,deltafin-cuda-graphs,mlx-lm ;;
  nextlease)  # [ROUNDS]: bench.next_leases (each partial layer's runner-up leased for the next token; the default since stop 58) against without, at 25%, 2 rounds unless given
    nvidia-smi --query-gpu=name --format=csv,noheader
    timeout 230 bash "$0" bench 0.25 "${2:-2}" deltafin-no-next-leases,deltafin
    timeout 100 python3 docs/probes/real_split.py /tmp/store 1 "base:run_ahead = true;next_leases = false:0.25,nl:run_ahead = true;next_leases = true:0.25" -v > "$out/nl-split.txt" 2>&1
    grep "^r0\|all same" "$out/nl-split.txt" | cut -c1-300; grep -o 'next_leases.: [0-9]*, .next_used.: [0-9]*\|"hits": [0-9]*, "uses": [0-9]*\|"lease_reads": [0-9]*, "lease_used": [0-9]*' "$out/nl-split.txt" ;;
  nlsplit)  # [ROUNDS]: the least of nextlease: real supervisors alternating without next leases ("base") and with them at 25% then 50%, 3 rounds unless given
    nvidia-smi --query-gpu=name --format=csv,noheader
    for share in 0.25 0.5; do
      timeout 140 python3 docs/probes/real_split.py /tmp/store "${2:-3}" "base:run_ahead = true;next_leases = false:$share,nl:run_ahead = true;next_leases = true:$share" -v > "$out/nlsplit-$share.txt" 2>&1
      grep "^r\|all same" "$out/nlsplit-$share.txt" | cut -c1-200
      grep -o "^r[0-9] [a-z]*\|'next_leases': [0-9]*, 'next_used': [0-9]*\|\"hits\": [0-9]*, \"uses\": [0-9]*\|\"lease_reads\": [0-9]*\|\"need\": {\"count\": [0-9]*" "$out/nlsplit-$share.txt" | paste -sd' ' | sed 's/ r\([0-9]\)/\nr\1/g'
    done ;;
  defer)  # [ROUNDS]: bench.defer_needs (a need's reads land while the rest of the pass is built; the default since stop 59) against without, at 25% (bench beside mlx-lm, 3 rounds unless given), then real supervisors' split at 25%, 2 rounds
    nvidia-smi --query-gpu=name --format=csv,noheader
    timeout 300 bash "$0" bench 0.25 "${2:-3}" deltafin,deltafin-no-defer-needs,mlx-lm
    timeout 150 python3 docs/probes/real_split.py /tmp/store 2 "base:run_ahead = true;defer_needs = false:0.25,dn:run_ahead = true;defer_needs = true:0.25" -v > "$out/defer-0.25.txt" 2>&1
    grep "^r\|all same" "$out/defer-0.25.txt" | cut -c1-200
    grep -o "^r[0-9] [a-z]*\|decode_ms_per_token={[^}]*}\|'deferred_needs': [0-9]*\|\"need\": {\"count\": [0-9]*" "$out/defer-0.25.txt" | paste -sd' ' | sed 's/ r\([0-9]\)/\nr\1/g' ;;
  fold)  # [ROUNDS]: bench.fold_sends (a pass's leases in one message, fills applied together acknowledged in one; the default since stop 60) against without, at 25% (bench, 4 rounds unless given), then real supervisors' split at 25%, 3 rounds
    nvidia-smi --query-gpu=name --format=csv,noheader
    timeout 300 bash "$0" bench 0.25 "${2:-4}" deltafin-no-fold-sends,deltafin
    timeout 200 python3 docs/probes/real_split.py /tmp/store 3 "base:run_ahead = true;fold_sends = false:0.25,fold:run_ahead = true;fold_sends = true:0.25" -v > "$out/fold-0.25.txt" 2>&1
    grep "^r\|all same" "$out/fold-0.25.txt" | cut -c1-200
    grep -o "^r[0-9] [a-z]*\|decode_ms_per_token={[^}]*}\|compute {\"messages\": {[^}]*}" "$out/fold-0.25.txt" | paste -sd' ' | sed 's/ r\([0-9]\)/\nr\1/g' ;;
  nodisk)  # the disk taken out: the store copied to tmpfs (its reads memory copies) beside it on disk, 25%, benches alternating; then the split per token from tmpfs
    nvidia-smi --query-gpu=name --format=csv,noheader
    rm -rf /dev/shm/store && cp -r /tmp/store /dev/shm/store
    for r in 1 2; do
      for s in /tmp/store /dev/shm/store; do
        f="$out/nodisk-$r-$([ "$s" = /tmp/store ] && echo disk || echo tmpfs).txt"
        timeout 150 python3 -m deltafin.tools.bench --store "$s" --trace none --regimes real --memory-budget 4GiB \
          --cache-frac 0.25 --dtype auto --contenders deltafin --rounds 2 --prompt-tokens 9 --max-tokens 64 > "$f" 2>&1
        echo "$s round $r"; grep "disk:\|tok/s$\|^bound\|^deltafin " "$f"
      done
    done
    timeout 120 python3 docs/probes/real_split.py /dev/shm/store 2 "mem:run_ahead = true:0.25" -v > "$out/nodisk-split.txt" 2>&1
    grep "^r\|all same" "$out/nodisk-split.txt" | cut -c1-400
    rm -rf /dev/shm/store ;;
  misses)  # where a 25% token's misses come from (the router's misses_in_flight: experts a need found read
           # ahead but not in yet; the rest of the misses were never read ahead), from disk, then from tmpfs
    nvidia-smi --query-gpu=name --format=csv,noheader
    rm -rf /dev/shm/store && cp -r /tmp/store /dev/shm/store
    for s in /tmp/store /dev/shm/store; do
      f="$out/misses-$([ "$s" = /tmp/store ] && echo disk || echo tmpfs).txt"
      timeout 150 python3 docs/probes/real_split.py "$s" 2 "x:run_ahead = true:0.25" -v > "$f" 2>&1
      echo "$s"; grep -o "^r[0-9] x same=[A-Za-z]*\|decode_tok_s\": [0-9.]*\|'ahead_missed': [0-9]*, 'ahead_forgotten': [0-9]*\|\"hits\": [0-9]*, \"uses\": [0-9]*, \"misses_in_flight\": [0-9]*\|\"lease_reads\": [0-9]*, \"lease_used\": [0-9]*" "$f" | paste -sd' '
    done
    rm -rf /dev/shm/store ;;
  waste)  # bench.ahead_waste swept at 25%, real supervisors alternating: a read-back mid-pass against the layers a miss forgets
    nvidia-smi --query-gpu=name --format=csv,noheader
    timeout 560 python3 docs/probes/real_split.py /tmp/store ${2:-3} \
      "w1:ahead_waste = 1.0:0.25,w05:ahead_waste = 0.5:0.25,w025:ahead_waste = 0.25:0.25,w01:ahead_waste = 0.1:0.25" -v > "$out/waste.txt" 2>&1
    grep "^r" "$out/waste.txt" | grep -o "^r[0-9] [a-z0-9]* same=[A-Za-z]*\|decode_tok_s\": [0-9.]*\|\"total\": [0-9.]*\|'gate_syncs': [0-9]*, 'ran_ahead': [0-9]*, 'ahead_missed': [0-9]*, 'ahead_forgotten': [0-9]*" | paste -d' ' - - - -
    grep "all same" "$out/waste.txt" ;;
  launches)  # what a launch of its own costs the host: all resident, one launch per token against one per MoE layer and two
    TIMING=1 python3 docs/probes/partial_layer.py /tmp/store 64 64 3 resident,resident-launch1,resident-launch2 \
      > "$out/launches.txt" 2>&1
    grep "host ms\|median" "$out/launches.txt" ;;
  stop53b)  # ahead reads yielding to demand reads (bench.ahead_piece_bytes, deltafin-yield) beside the defaults: exactness, 25%
    nvidia-smi --query-gpu=name --format=csv,noheader
    bash "$0" close28a
    timeout 200 bash "$0" bench 0.25 3 deltafin-yield,deltafin,mlx-lm ;;
  peers)  # mlx-vlm 0.7.10 beside deltafin and mlx-lm at 25%; then `peers50` in the next call. Prepared here:
    # pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform
    # manylinux_2_28_x86_64 -d .devwheels/c mlx-vlm==0.7.10 pillow  (carry .devwheels/b and .devwheels/c)
    [ -d /tmp/site/mlx_vlm ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devwheels/c/*.whl
    python3 -c "import mlx_vlm.utils, mlx_vlm.moe_offload, mlx_vlm.generate.ar; print('mlx-vlm imports')" 2>&1 | tail -3
    timeout 500 bash "$0" bench 0.25 2 deltafin,mlx-vlm,mlx-lm ;;  # the first run writes both checkpoints (260 s was short)
  peers50)  # the same at 50%, after peers on the same machine
    timeout 300 bash "$0" bench 0.5 2 deltafin,mlx-vlm,mlx-lm ;;
  stop50)  # bench.early_passes and bench.check_each, apart and together, at 25% beside mlx-lm (3 rounds)
    timeout 560 bash "$0" bench 0.25 3 deltafin,deltafin-early-passes,deltafin-check-each,deltafin-early-each,mlx-lm ;;
  early)  # bench.early_passes on/off at 25%, real supervisors alternating
    python3 docs/probes/real_split.py /tmp/store 3 "ep:early_passes = true:0.25,base:early_passes = false:0.25" -v \
      > "$out/early-0.25.txt" 2>&1
    grep "^r\|all same" "$out/early-0.25.txt" | cut -c1-400 ;;
  final50)  # the final defaults at 50% (3 rounds) and all resident (1 round) beside mlx-lm
    timeout 330 bash "$0" bench 0.5 3 deltafin,mlx-lm
    timeout 150 bash "$0" bench 1.0 1 deltafin,mlx-lm ;;
  graphs)
    for env in "X=0" "MLX_USE_CUDA_GRAPHS=0" "MLX_MAX_OPS_PER_BUFFER=4" "MLX_MAX_OPS_PER_BUFFER=80"; do
      f="$out/graphs-${env%%=*}-${env#*=}.txt"  # no "=" in names that come back
      env "$env" python3 docs/probes/partial_layer.py /tmp/store 64 64 2 resident,sync,partial > "$f" 2>&1
      echo "$env: $(grep median "$f" | tr -s ' ' | tr '\n' ' ')"
    done ;;
  goal)
    timeout 330 python3 -m pytest -q -p no:cacheprovider -k streaming_gives tests/test_greedy_exact.py > "$out/goal-exact.txt" 2>&1
    tail -5 "$out/goal-exact.txt"
    timeout 240 bash "$0" bench ;;
  exact)
    python3 -m pytest -q -p no:cacheprovider -k "stream or gpu or run_ahead or rewind or kept" \
      tests/test_greedy_exact.py tests/test_run_ahead.py > "$out/exact.txt" 2>&1
    tail -15 "$out/exact.txt" ;;
esac
