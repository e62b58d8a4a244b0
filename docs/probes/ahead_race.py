"""Issue 28: tests/test_run_ahead.py's store (4 layers x 8 experts, top-2, one slot group shared by
the 4 layers) in one process: 12 greedy passes' logits at 4 and 8 slots against all resident, per
setting (streaming pools filled by the driver's copies or written with numpy; run ahead per layer
or per pass), with the pipeline's counters.

  python docs/probes/ahead_race.py          # SYNC=1: each driver copy waits for MLX's queue first

Found on an H100 (2026-12-05, stop 47): with `bench.device_copies` on, 8 slots gave other logits
from the first pass (max |diff| 4.48-5.24) in some settings and runs, also with SYNC=1 (so not a
copy overtaking a queued kernel); host pools exact in every setting. Why (stop 48): each decode
here makes a tier over a new anonymous staging pool and lets the last go without unpinning it, so
a pool was unmapped while registered with the driver, and the next one, mapped at the same
address, was refused registration and copied from the driver's stale pages. Since DriverCopies
holds what it pins and unregisters when let go, every setting gives 0.0 (an H100, 2026-12-05)."""
import sys, tempfile
from pathlib import Path
import numpy as np
sys.path.insert(0, "tests")
from conftest import greedy_alone
from deltafin.runtime.config import Config
from deltafin.runtime.store import Store
from deltafin.tools import convert
from deltafin.tools.synth import tiny
from deltafin.tools.inprocess import local_router
from deltafin.workers.engine import Compute

import os
import mlx.core as mx
from deltafin.workers import resident
if os.environ.get("SYNC"):  # every driver copy waits for MLX's queued work first: a race, or not
    _write = resident.DriverCopies.write
    def write(self, *a):
        mx.synchronize()
        return _write(self, *a)
    resident.DriverCopies.write = write
root = Path(tempfile.mkdtemp())
src = tiny("qwen3_moe", root / "hf", layers=4, experts=8, top_k=2, seed=5)
assert convert.main([str(src), str(root / "store"), "--no-progress"]) == 0
store = Store(root / "store")
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79]

def decode(n_slots, **bench):
    cfg = Config().to_dict()
    cfg["bench"].update(bench)
    s, staging, loader = local_router(store, cfg, n_slots=n_slots)
    try:
        c = Compute(store, cfg, s, staging, store.max_record_bytes)
        c.preload()
        return greedy_alone(c, PROMPT, 12), c.experts.counters, c.experts.tier.placement
    finally:
        loader.close()

ref, _, _ = decode(len(store.records), run_ahead=True)
for bench in [dict(run_ahead=False, device_copies=True), dict(run_ahead=True, ahead_launch="pass", device_copies=True),
              dict(run_ahead=False, device_copies=False), dict(run_ahead=True, ahead_launch="pass", device_copies=False)]:
    for n_slots in (4, 8):
        got, cnt, place = decode(n_slots, **bench)
        bad = [s for s, (a, b) in enumerate(zip(ref, got)) if not np.array_equal(a, b)]
        print(bench, n_slots, place.get("where"), "first bad step", bad[:3], "max", max(float(np.abs(a - b).max()) for a, b in zip(ref, got)),
              {k: cnt.get(k) for k in ("ran_ahead", "ahead_missed", "ahead_forgotten", "settles", "fills_unsettled")}, flush=True)
