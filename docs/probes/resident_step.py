"""Shared by the step probes: compute in this process with every expert of the store resident,
and B sequences of different lengths prefilled for a decode step."""
import sys

import mlx.core as mx

from deltafin.runtime.config import Config
from deltafin.runtime.store import Store
from deltafin.tools.inprocess import local_router
from deltafin.workers.engine import Compute


def resident_compute(argv=None):
    """(compute, its in-process loader, the config) for STORE [DTYPE] (default float32); the
    caller closes the loader."""
    argv = sys.argv if argv is None else argv
    store = Store(argv[1])
    cfg = Config().to_dict()
    cfg["compute"]["dtype"] = argv[2] if len(argv) > 2 else "float32"
    src, staging, loader = local_router(store, cfg, n_slots=0)
    c = Compute(store, cfg, src, staging, store.max_record_bytes)
    c.preload()
    return c, loader, cfg


def prefilled_rows(c, B: int):
    """B prompts of 16, 15, ... tokens prefilled, one KV cache each; (caches, their last tokens)."""
    prompts = [[(37 * i + 11 * j) % 3000 + 100 for j in range(16 - i)] for i in range(B)]
    caches = [c.model.make_cache() for _ in prompts]
    for p, cache in zip(prompts, caches):
        c.forward(p[:-1], cache)
    return caches, mx.array([p[-1] for p in prompts], dtype=mx.int32)
