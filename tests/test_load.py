"""Load: eight clients at once, greedy, on a pool small enough to churn. Every answer equals the
same request run alone, the requests in flight never exceed the clients, the tree's peak PSS
(sampled from outside every few milliseconds) stays within the budget, and nothing is left
in flight or behind afterwards (conftest checks processes and segments)."""
from __future__ import annotations

import threading

import pytest

from deltafin.client import Client, RuntimeBusy
from deltafin.tools.treesampler import TreeSampler
from deltafin.tools.run import running_supervisor

CLIENTS = 8
BUDGET = 600 * 2**20


def _request(i: int) -> dict:
    """Different prompts and lengths; half streamed, half not; one logits request."""
    return {"prompt": [(37 * i + 11 * j) % 500 + 1 for j in range(5 + 9 * i)], "max_tokens": 12 + 3 * i,
            "stream": i % 2 == 0}


def _run(c: Client, req: dict):
    if req["stream"]:
        pieces = list(c.stream(req["prompt"], max_tokens=req["max_tokens"]))
        assert "".join(pieces) == c.last.text
        return c.last.token_ids
    return c.generate(req["prompt"], max_tokens=req["max_tokens"]).token_ids


def test_eight_clients_at_once_get_the_answers_they_get_alone(tiny_stores):
    requests = [_request(i) for i in range(CLIENTS)]
    with running_supervisor(tiny_stores("deepseek_v2"), str(BUDGET), ["--max-slots", "6"]) as (ep, proc):
        with Client(ep, timeout=120) as c:
            alone = [_run(c, r) for r in requests]
            ref_logits = c.logits(requests[3]["prompt"])
        sampler = TreeSampler(proc.pid, interval=0.005).start()
        results: list = [None] * CLIENTS
        errors: list = []
        start = threading.Barrier(CLIENTS + 1)
        in_flight: list[int] = []

        def client(i: int) -> None:
            try:
                with Client(ep, timeout=120) as own:
                    start.wait(timeout=60)
                    results[i] = _run(own, requests[i])
                    if i == 3:
                        results[i] = (results[i], own.logits(requests[3]["prompt"]))
            except BaseException as e:  # reported by the main thread
                errors.append((i, e))
        threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
        for t in threads:
            t.start()
        with Client(ep, timeout=120) as watcher:
            start.wait(timeout=60)
            while any(t.is_alive() for t in threads):
                in_flight.append(watcher.stats()["active_requests"])
            for t in threads:
                t.join(timeout=300)
            after = watcher.stats()
        seen = sampler.stop()
    assert not errors, errors
    results[3], logits = results[3]
    assert results == alone
    assert (logits == ref_logits).all()
    assert max(in_flight) <= CLIENTS and after["active_requests"] == 0
    assert after["workers"]["router"].get("evictions", 0) > 0  # the pool churned under the load
    print(f"peak tree PSS {seen['peak_tree_pss_bytes'] / 2**20:.1f} MiB of {BUDGET / 2**20:.0f} MiB "
          f"({seen['samples']} samples); most in flight {max(in_flight)}")
    assert 0 < seen["peak_tree_pss_bytes"] <= BUDGET


def test_requests_beyond_max_inflight_are_refused_at_once(tiny_stores, tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[compute]\nmax_queue = 0\nmax_batch = 1\n")  # one running, none waiting
    with running_supervisor(tiny_stores("deepseek_v2"), "4GiB", ["--config", str(cfg)]) as (ep, _):
        with Client(ep, timeout=60) as busy, Client(ep, timeout=60) as other:
            stream = busy.stream([100, 200, 300, 400], max_tokens=300)
            next(stream)
            with pytest.raises(RuntimeBusy, match="max_queue"):
                other.generate([1, 2, 3], max_tokens=2)
            assert len(list(stream)) > 0
            assert len(other.generate([1, 2, 3], max_tokens=2).token_ids) == 2  # free again
