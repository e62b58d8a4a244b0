"""Compute.warm_up (workers/engine.py): the passes a GPU backend runs before "ready" so a fresh
machine's kernels are compiled while no slot pool exists, for every family, changing nothing a
request then computes."""
from __future__ import annotations

import numpy as np
import pytest

from deltafin.runtime import archinfo
from deltafin.runtime.config import Config
from deltafin.runtime.store import Store
from deltafin.tools.inprocess import local_router
from deltafin.workers import engine
from deltafin.workers.engine import Compute

PROMPT = [1, 5, 9, 2, 7, 3]


class Counting:
    """The model, its calls' token counts noted."""

    def __init__(self, model):
        self.model, self.calls = model, []

    def __call__(self, tokens, *args, **kwargs):
        self.calls.append(int(tokens.size))
        return self.model(tokens, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


def _logits(store: Store, calls: list | None = None) -> np.ndarray:
    """The prompt's logits from a fresh Compute, warmed up first where `calls` is given (the
    token counts of the model's calls in the warm-up go there)."""
    cfg = Config().to_dict()
    src, staging, loader = local_router(store, cfg, n_slots=len(store.records) // 2)
    try:
        c = Compute(store, cfg, src, staging, store.max_record_bytes)
        if calls is not None:
            c.model = Counting(c.model)
            c.warm_up()
            calls.extend(c.model.calls)
            c.model = c.model.model
        return c.logits(PROMPT)
    finally:
        loader.close()


@pytest.mark.parametrize("arch", list(archinfo.ARCHS))
def test_warm_up_runs_on_every_family_and_changes_no_logits(tiny_stores, arch):
    store = Store(tiny_stores(arch))
    calls: list[int] = []
    warm = _logits(store, calls)
    # the prefill chunks, then one decode step, with the expert weights at zero
    assert calls == [*engine.WARM_PROMPTS, 1]
    np.testing.assert_array_equal(warm, _logits(store))
    assert np.isfinite(warm).all() and warm.std() > 0


def test_warm_up_meets_both_row_orders_and_both_samplers(tiny_stores, monkeypatch):
    """Its prefill chunks give a layer's experts rows unsorted and sorted (MLX picks other kernels
    for each), and the sampler runs greedy and with temperature, top-p and top-k."""
    from deltafin.runtime.models import switch
    from deltafin.workers import scheduler
    store = Store(tiny_stores("qwen3_moe"))
    sorted_seen, samplers = set(), []
    real_glu, real_sample = switch.switch_glu, scheduler.sample_on_device

    def glu(x, inds, w, quant):
        sorted_seen.add(switch.sorts_pairs(inds.size))
        return real_glu(x, inds, w, quant)

    def sample(logits, req, key, dtype=None, history=None):
        samplers.append((req.temperature, req.top_p, req.top_k))
        return real_sample(logits, req, key, dtype, history)
    monkeypatch.setattr(engine, "switch_glu", glu)
    monkeypatch.setattr(engine, "sample_on_device", sample)
    cfg = Config().to_dict()
    src, staging, loader = local_router(store, cfg)
    try:
        Compute(store, cfg, src, staging, store.max_record_bytes).warm_up()
    finally:
        loader.close()
    assert sorted_seen == {False, True}
    assert samplers[0][0] == 0 and samplers[1] == (0.7, 0.9, 40)
