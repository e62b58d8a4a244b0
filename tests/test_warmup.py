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


def test_warm_up_reports_each_step_before_running_it(tiny_stores):
    """progress(index, steps, name) comes before each step's model call, so the supervisor hears
    of a step while MLX compiles its kernels (minutes on a fresh GPU machine)."""
    store = Store(tiny_stores("qwen3_moe"))
    cfg = Config().to_dict()
    src, staging, loader = local_router(store, cfg)
    try:
        c = Compute(store, cfg, src, staging, store.max_record_bytes)
        c.model = Counting(c.model)
        seen = []
        took = c.warm_up(lambda i, n, name: seen.append((i, n, name, len(c.model.calls))))
    finally:
        loader.close()
    assert [s[:3] for s in seen] == [(0, 4, "prefill of 9 tokens"), (1, 4, "prefill of 64 tokens"),
                                     (2, 4, "decode step"), (3, 4, "sampling")]
    assert [s[3] for s in seen] == [0, 1, 2, 3]  # the model calls made before each report
    assert took > 0


def test_start_wait_extends_from_a_workers_first_progress_report():
    from deltafin.protocol import messages as M
    from deltafin.workers.supervisor import StartWait
    now = [100.0]
    wait = StartWait(180, 600, clock=lambda: now[0])
    now[0] = 250.0
    assert not wait.expired() and wait.where({"compute"}) == ""
    step = M.WorkerProgress(role="compute", step="prefill of 9 tokens", index=0, steps=4)
    assert wait.progress("compute", step)  # the first report: 600 s from now
    now[0] = 840.0
    assert not wait.expired()
    later = M.WorkerProgress(role="compute", step="decode step", index=2, steps=4)
    assert not wait.progress("compute", later)  # later steps keep that deadline
    now[0] = 851.0
    assert wait.expired() and wait.elapsed() == 751.0
    assert wait.where({"compute", "router"}) == " (compute in its warm-up's decode step, step 3 of 4)"
    assert wait.where({"router"}) == ""
    short = StartWait(180, 5, clock=lambda: now[0])  # a short warm-up wait never cuts startup's
    short.progress("compute", step)
    now[0] += 179
    assert not short.expired()


def test_the_supervisor_hears_the_warm_up_and_serves_the_same_tokens(tiny_stores, tmp_path):
    """[compute] warm_up = true runs the warm-up on the CPU too: compute reports its steps to the
    supervisor (which says so), counts its seconds in its ready info, and the greedy tokens are
    those of a runtime started without it."""
    from deltafin.client import Client
    from deltafin.tools.run import running_supervisor
    store = tiny_stores("qwen3_moe")
    got = {}
    for warm in ("true", "false"):
        cfg, log = tmp_path / f"{warm}.toml", tmp_path / f"{warm}.log"
        cfg.write_text(f"[compute]\nwarm_up = {warm}\n")
        with open(log, "w") as err, running_supervisor(store, "4GiB", ["--config", str(cfg)], stderr=err) as (ep, _):
            with Client(ep, timeout=120) as c:
                tokens = c.generate(PROMPT, max_tokens=8).token_ids
                got[warm] = (tokens, c.health()["workers"]["compute"]["warm_up_s"], log.read_text())
    (warm_tokens, warm_s, warm_log), (cold_tokens, cold_s, cold_log) = got["true"], got["false"]
    assert warm_tokens == cold_tokens and len(warm_tokens) == 8
    assert warm_s > 0 and cold_s == 0
    assert "compute: warming up (4 steps" in warm_log and "warming up" not in cold_log
