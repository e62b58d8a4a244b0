"""Requests decoded together: one forward pass per step over every running
sequence, so each MoE layer asks for the union of their experts once. Stacking rows changes no
row's result (checked bitwise in-process on several architectures); with real processes, requests
run together give exactly the tokens each gives alone, a request joins while others decode, a
cancelled one leaves the others exact, the KV reserve bounds how many run at once, and the stats
show the batch sizes and the expert bytes read per generated token."""
from __future__ import annotations

import json
import threading

import pytest

from deltafin.client import Client
from deltafin.protocol import messages as M
from deltafin.tools.run import running_supervisor
from conftest import batched_equals_alone, config_flags  # noqa: E402

BIG = "4GiB"
PROMPTS = [[1, 2, 3], [7, 8, 9, 10, 11], [100, 200, 300, 400], [5, 6]]


def _compute(stats: dict) -> dict:
    return stats["workers"]["compute"]


def _together(ep: str, prompts: list, max_tokens: int) -> list:
    """Each prompt from its own client, all sent at once; their Done messages in prompt order."""
    out: list = [None] * len(prompts)
    clients = [Client(ep, timeout=120) for _ in prompts]
    try:
        msgs = [M.Generate(id=c._next(), token_ids=p, max_tokens=max_tokens, stream=False)
                for c, p in zip(clients, prompts)]
        for c, m in zip(clients, msgs):
            c._send(m)

        def wait(i: int) -> None:
            out[i] = clients[i]._recv(msgs[i].id)
        threads = [threading.Thread(target=wait, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=180)
    finally:
        for c in clients:
            c.close()
    assert all(d is not None for d in out), "a request was never answered"
    return out


# -- in-process: stacking rows changes no row -----------------------------------------------------------
@pytest.mark.parametrize("arch,rows,slots,quantized", [
    ("mixtral", 4, 0, False), ("qwen2_moe", 4, 0, False), ("qwen3_moe", 4, 0, False), ("olmoe", 4, 0, False),
    ("deepseek_v2", 4, 0, False), ("deepseek_v3", 4, 0, False), ("mixtral", 40, 0, False), ("mixtral", 6, 4, False),
    ("qwen3_moe", 5, 0, True), ("deepseek_v3", 5, 0, True),
    ("glm4_moe", 4, 0, True), ("gpt_oss", 5, 0, True), ("gpt_oss", 6, 4, True), ("minimax_m2", 4, 0, True)])
def test_a_batched_step_gives_each_row_what_its_sequence_gives_alone(request, arch, rows, slots, quantized):
    """Logits of forward_batch over `rows` sequences of different lengths equal, bitwise, those of
    each sequence's own single-row passes, step after step, on every architecture's attention
    (GQA with q/k norms per head and over the projection, MLA expanded and absorbed: their
    projections, norms and rope run on the stacked rows, rope at each row's own offset), float
    and mlx-lm-quantized (40 rows: mlx-lm's sorted expert path, SORT_PAIRS, which one row never
    takes; 4 slots: fewer than the batch's union of experts, so layers run in chunks of what fits,
    filled by real reads)."""
    from deltafin.runtime.config import Config
    from deltafin.runtime.store import Store
    from deltafin.tools.inprocess import local_router
    from deltafin.workers.engine import Compute
    store = Store(request.getfixturevalue("mlx_lm_stores")(arch)[1] if quantized
                  else request.getfixturevalue("tiny_stores")(arch))
    cfg = Config().to_dict()
    if quantized:
        cfg["compute"]["dtype"] = "auto"  # the checkpoint's bfloat16, as mlx-lm runs it
    src, staging, loader = local_router(store, cfg, n_slots=slots)
    try:
        c = Compute(store, cfg, src, staging, store.max_record_bytes)
        if not slots:
            c.preload()
        prompts = [[(7 * i + j) % 50 + 1 for j in range(1 + i % 6)] for i in range(rows)]
        batched_equals_alone(c, prompts, 5)
        if slots:
            assert c.experts.counters.get("miss_bytes") > 0 and c.experts.counters.get("gate_syncs") > 0
    finally:
        loader.close()


# -- real processes ------------------------------------------------------------------------------------
def test_four_concurrent_greedy_requests_give_what_each_gives_alone(tiny_stores):
    """Four clients at once are decoded together (the batch stats say so) and each gets the
    tokens it gets alone; the stats report the expert bytes read per generated token."""
    with running_supervisor(tiny_stores("mixtral"), BIG) as (ep, _):
        with Client(ep, timeout=120) as c:
            alone = [c.generate(p, max_tokens=24).token_ids for p in PROMPTS]
            before = _compute(c.stats())["batch"]
        together = _together(ep, PROMPTS, 24)
        with Client(ep, timeout=120) as c:
            after = _compute(c.stats())["batch"]
    assert [d.token_ids for d in together] == alone
    assert before["max_batch"] == 8 and before["max_rows"] == 1   # alone: one row a step
    assert after["max_rows"] >= 2, after                          # together: several rows a step
    steps, rows = after["steps"] - before["steps"], after["rows"] - before["rows"]
    assert rows > steps, (rows, steps)
    assert after["decode_tokens"] > 0 and after["expert_bytes_per_token"] is not None
    assert after["active"] == 0 and after["kv_used_bytes"] == 0   # every KV cache went back
    print(f"4 together: {rows} rows in {steps} steps (mean {rows / steps:.2f}); "
          f"expert bytes per token {after['expert_bytes_per_token']:.0f}")


def test_a_request_joins_while_others_decode(tiny_stores):
    """A request sent while a long one streams starts before it ends (their [start, end] event
    numbers overlap), runs in the same steps, and both give their tokens alone."""
    long_prompt = [100, 200, 300, 400]
    with running_supervisor(tiny_stores("mixtral"), BIG) as (ep, _):
        with Client(ep, timeout=120) as a, Client(ep, timeout=120) as b:
            ref_a = a.generate(long_prompt, max_tokens=150).token_ids
            ref_b = b.generate([1, 2, 3, 4, 5, 6, 7, 8, 9], max_tokens=12).token_ids
            rows0 = _compute(a.stats())["batch"]["max_rows"]
            stream = a.stream(long_prompt, max_tokens=150)
            for _ in range(3):
                next(stream)
            done_b = b.generate([1, 2, 3, 4, 5, 6, 7, 8, 9], max_tokens=12)
            list(stream)
            done_a = stream.result
            batch = _compute(a.stats())["batch"]
    assert rows0 == 1 and batch["max_rows"] == 2
    assert done_b.token_ids == ref_b and done_a.token_ids == ref_a
    a0, a1 = done_a.stats["order"]
    b0, b1 = done_b.stats["order"]
    assert a0 < b0 < b1 < a1, (done_a.stats["order"], done_b.stats["order"])


def test_cancelling_one_batched_request_leaves_the_others_exact(tiny_stores):
    """x (a prompt the tiny store does not stop early on) is cancelled two tokens in, while a and
    b decode with it: x stops there, a and b give their tokens alone, its KV cache is free."""
    with running_supervisor(tiny_stores("mixtral"), BIG) as (ep, _):
        with Client(ep, timeout=120) as a, Client(ep, timeout=120) as b, Client(ep, timeout=120) as x:
            ref_a = a.generate(PROMPTS[2], max_tokens=60).token_ids
            ref_b = b.generate(PROMPTS[1], max_tokens=60).token_ids
            sa, sx = a.stream(PROMPTS[2], max_tokens=60), x.stream(PROMPTS[0], max_tokens=1500)
            sb = b.stream(PROMPTS[1], max_tokens=60)
            next(sa), next(sb), next(sx)
            next(sx)
            sx.cancel()
            list(sx), list(sa), list(sb)
            stats = a.stats()
    assert sx.result.finish_reason == "cancelled" and 2 <= len(sx.result.token_ids) < 1500
    assert sa.result.token_ids == ref_a and sb.result.token_ids == ref_b
    compute = _compute(stats)
    assert compute["cancelled"] == 1 and compute["batch"]["max_rows"] == 3
    assert compute["batch"]["kv_used_bytes"] == 0


def test_the_kv_reserve_bounds_the_requests_decoded_together(tiny_stores, tmp_path):
    """max_context 512 reserves 512 KV positions; each request here is charged 256 (prompt +
    max_tokens rounded up to the cache's step): two run at once, the others wait their turn,
    and every one still gives its tokens alone."""
    cfg = config_flags(tmp_path, compute={"max_context": 512})
    prompts = PROMPTS + [[9, 9, 9]]
    with running_supervisor(tiny_stores("mixtral"), BIG, cfg) as (ep, _):
        with Client(ep, timeout=120) as c:
            alone = [c.generate(p, max_tokens=20).token_ids for p in prompts]
        together = _together(ep, prompts, 20)
        with Client(ep, timeout=120) as c:
            batch = _compute(c.stats())["batch"]
    assert [d.token_ids for d in together] == alone
    assert batch["kv_peak_bytes"] <= batch["kv_pool_bytes"]
    assert batch["max_rows"] == 2 and batch["kv_peak_bytes"] == batch["kv_pool_bytes"], batch
    assert max(d.stats["queue_s"] for d in together) > 0


def test_the_queue_runs_max_batch_and_cancels_the_named_one():
    """max_batch run and the rest wait; several run at once and a cancel marks the running one
    it names."""
    from deltafin.workers.scheduler import RequestQueue
    q = RequestQueue(max_batch=3)
    items = [q.add(b"c", M.Generate(id=i, token_ids=[1])) for i in range(4)]
    running = [q.next() for _ in range(3)]
    assert running == items[:3] and q.stats()["running"] == 3 and q.stats()["waiting"] == 1
    assert q.cancel(b"c", 1) is None and items[1].cancelled and not items[0].cancelled
    q.finish(items[1])
    assert q.stats()["running"] == 2
    q.add(b"c", M.Generate(id=10, token_ids=[1]))  # the place it left is room again


def test_config_bounds_max_batch():
    from deltafin.runtime.config import Config, ConfigError
    assert Config().compute.max_batch == 8 and Config().compute.max_inflight == 8 + 16
    for bad in ({"max_batch": 0}, {"kv_tokens": -1}):
        with pytest.raises(ConfigError):
            Config.from_dict({"compute": bad}).validate()


def test_the_concurrency_benchmark_reports_each_level(tiny_stores, tmp_path):
    """tools/bench_concurrency on a tiny store: a row per concurrency and the two TTFT rows."""
    from deltafin.tools import bench_concurrency
    out = tmp_path / "r.json"
    assert bench_concurrency.main(["--store", str(tiny_stores("mixtral")), "--concurrency", "1,2",
                                   "--max-tokens", "6", "--ttft-rounds", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["concurrency"] for r in report["levels"]] == [1, 2]
    assert all(r["answered"] == r["concurrency"] and r["generated_tokens"] > 0 for r in report["levels"])
    assert [t["busy"] for t in report["ttft"]] == [0, 3] and report["n_slots"] < report["experts"]
    split = report["levels"][0]["step_split"]   # where a decode step's time went, in ms
    assert split["total_ms"] > 0 and split["compute_ms"] <= split["total_ms"]
