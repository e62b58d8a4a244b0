"""The prompt cache (workers/prompt_cache.py): a request whose prompt starts with a prefix an
earlier one prefilled starts from that prefix's keys and values, and its logits and greedy tokens
are bitwise those of a cold prefill; concurrent requests share a prefix; a small cache evicts its
least recently used blocks; linear-attention hybrids resume from the recurrent state kept at
a block boundary; a sliding-window family runs without it, saying why; with real processes the second request reuses the first's prefix, counted in
compute's stats, the monitor's snapshot and the /metrics exposition."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from deltafin.client import Client
from deltafin.protocol import messages as M
from deltafin.runtime.prometheus import prometheus_text
from deltafin.tools.monitor import format_text
from deltafin.tools.run import running_supervisor
from conftest import config_flags  # noqa: E402

CHUNK = 16
SHARED = [(13 * i + 5) % 400 + 3 for i in range(3 * CHUNK + 7)]   # 3 whole blocks and a bit
TAIL_A, TAIL_B = [11, 12, 13, 14, 15], [21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34]


def _compute(request, arch: str, prompt_cache: str = "64MiB"):
    from deltafin.runtime.config import Config
    from deltafin.runtime.store import Store
    from deltafin.tools.inprocess import local_router
    from deltafin.workers.engine import Compute
    store = Store(request.getfixturevalue("tiny_stores")(arch))
    cfg = Config().to_dict()
    cfg["compute"].update(prefill_chunk=CHUNK, prompt_cache=prompt_cache)
    src, staging, loader = local_router(store, cfg)
    request.addfinalizer(loader.close)
    c = Compute(store, cfg, src, staging, store.max_record_bytes)
    c.preload()
    return c


def _prefilled(c, prompt: list) -> tuple[np.ndarray, int]:
    """The prompt's head prefilled through the scheduler (from the prompt cache where it holds a
    prefix), then one pass over its last token: that pass's logits, and the tokens reused."""
    seq = c.start(M.Generate(id=1, token_ids=prompt, max_tokens=4, stream=False))
    sched = c.scheduler
    sched.add(seq)
    while seq in sched.filling:
        sched.prefill_chunk(seq, [])
    p = c.experts.begin_pass(1)
    logits = c.model(mx.array([prompt[-1]], dtype=mx.int32), seq.cache, c.experts)
    mx.eval(logits)
    c.experts.commit(p, rows=False)
    sched.leave(seq)
    return np.array(logits), seq.reused


def _greedy(c, prompt: list, n: int = 6) -> M.Done:
    return c.generate(M.Generate(id=2, token_ids=prompt, max_tokens=n, stream=False))


@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3", "qwen3_next", "kimi_linear", "qwen3_5_moe", "kimi_k3"])
def test_a_cached_prefix_gives_the_cold_prefills_logits_bitwise(request, arch):
    """B after A (sharing 3 blocks): B's logits and greedy tokens equal, bitwise, B's cold ones
    (the cache off), on grouped-query attention, on MLA's latent cache and on the hybrids'
    linear-attention layers (gated delta: qwen3_next, qwen3_5_moe; KDA: kimi_linear, kimi_k3),
    which resume from the state at the boundary."""
    c = _compute(request, arch)
    pc, c.prompt_cache = c.prompt_cache, None
    cold_logits, reused = _prefilled(c, SHARED + TAIL_B)
    cold_tokens = _greedy(c, SHARED + TAIL_B).token_ids
    assert reused == 0
    c.prompt_cache = pc
    _prefilled(c, SHARED + TAIL_A)
    warm_logits, reused = _prefilled(c, SHARED + TAIL_B)
    assert reused == 3 * CHUNK
    assert np.array_equal(warm_logits, cold_logits), np.abs(warm_logits - cold_logits).max()
    done = _greedy(c, SHARED + TAIL_B)
    assert done.token_ids == cold_tokens and done.stats["cached_tokens"] == 4 * CHUNK
    s = c.stats()["prompt_cache"]
    assert s["hits"] == 2 and s["lookups"] == 3 and s["reused_tokens"] == 7 * CHUNK
    assert s["blocks"] == 4 and s["bytes"] > 0 and s["evicted_blocks"] == 0


def test_concurrent_requests_share_a_prefix(request):
    """Two requests admitted together: the second prefills after the first (one chunk a step,
    oldest first), starts from its blocks, and both give their tokens alone."""
    c = _compute(request, "mixtral")
    pc, c.prompt_cache = c.prompt_cache, None
    alone = [_greedy(c, SHARED + t).token_ids for t in (TAIL_A, TAIL_B)]
    c.prompt_cache = pc
    sched = c.scheduler
    seqs = [c.start(M.Generate(id=i, token_ids=SHARED + t, max_tokens=6, stream=False))
            for i, t in enumerate((TAIL_A, TAIL_B))]
    c._begin_request()
    for s in seqs:
        assert sched.fits(s)
        sched.add(s)
    for _ in range(100):
        if not sched.busy():
            break
        sched.step()
    assert [s.out_ids for s in seqs] == alone
    assert [s.reused for s in seqs] == [0, 3 * CHUNK]
    assert sched.max_rows == 2  # they decoded together


def test_a_small_cache_evicts_least_recently_used_blocks(request):
    """A cache of two blocks keeps the latest prompt's last two blocks' worth at most (evicting
    the rest), and what it reuses afterwards is still exact."""
    c = _compute(request, "mixtral", prompt_cache="1MiB")
    pc = c.prompt_cache
    _prefilled(c, SHARED + TAIL_A)
    block = pc.nbytes // pc.stats()["blocks"]
    pc.capacity = 2 * block
    pc._evict(pc.capacity)
    assert pc.stats()["blocks"] == 2 and pc.stats()["evicted_blocks"] == 1
    long = SHARED + TAIL_B + list(range(40, 40 + 2 * CHUNK))
    _, reused = _prefilled(c, long)
    s = pc.stats()
    assert reused == 2 * CHUNK   # the first two blocks were the most recently used
    assert s["bytes"] <= pc.capacity and s["blocks"] == 2 and s["evicted_blocks"] > 1
    c.prompt_cache = None
    cold, _ = _prefilled(c, long)
    c.prompt_cache = pc
    warm, reused = _prefilled(c, long)
    assert reused > 0 and np.array_equal(warm, cold)


def test_a_sliding_window_family_runs_without_the_cache(request):
    """gpt-oss's sliding window drops positions a later block still sees: the cache is off for
    it (no budget reserve), the stats say why, and requests run as before."""
    from deltafin.runtime.budget import plan_budget
    from deltafin.runtime.config import Config
    c = _compute(request, "gpt_oss")
    assert c.prompt_cache is None
    assert "sliding-window" in c.stats()["prompt_cache"]["reason"]
    cfg = Config.from_dict({"compute": {"prompt_cache": "64MiB"}})
    assert plan_budget(c.store, cfg).prompt_cache == 0
    assert len(_greedy(c, SHARED + TAIL_A, 3).token_ids) > 0


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_next"])
def test_a_supervisor_reuses_a_prefix_across_requests(tiny_stores, tmp_path, arch):
    """Real processes: the second request sharing a prefix reuses it (its stats and compute's
    counters say so) and gives the tokens the first request with that prompt got cold; the
    budget reserves the cache's share (a hybrid's too)."""
    flags = config_flags(tmp_path, compute={"prefill_chunk": CHUNK, "prompt_cache": "8MiB"})
    with running_supervisor(tiny_stores(arch), "4GiB", flags) as (ep, _):
        with Client(ep, timeout=120) as cl:
            cold = cl.generate(SHARED + TAIL_B, max_tokens=8)
            cl.generate(SHARED + TAIL_A, max_tokens=8)
            warm = cl.generate(SHARED + TAIL_B, max_tokens=8)
            stats = cl.stats()
    assert cold.stats["cached_tokens"] == 0 and warm.stats["cached_tokens"] == 4 * CHUNK
    assert warm.token_ids == cold.token_ids
    pc = stats["workers"]["compute"]["prompt_cache"]
    assert pc["hits"] == 2 and pc["reused_tokens"] == 7 * CHUNK and pc["capacity_bytes"] == 8 << 20
    assert stats["memory"]["prompt_cache_bytes"] == 8 << 20
    assert stats["totals"]["prompt_cache_reused_tokens"] == 7 * CHUNK
    text = prometheus_text(stats, {"requests": {}, "cancelled": 0, "started": 0.0})
    assert f"deltafin_prompt_cache_reused_tokens_total {7.0 * CHUNK!r}" in text
    assert "deltafin_prompt_cache_hits_total 2.0" in text and "deltafin_prompt_cache_bytes " in text
    assert "2/3 hits" in format_text(stats)
