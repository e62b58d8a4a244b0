"""Prediction in the router: the predictive policy and prefetched slots (runtime/cache.py), the
router's prefetch protocol (workers/router.py: demand first, staging share, slots a need takes
over, self-gating), its replay (tools/replay.py), its config keys, and exactness in real runs."""
from __future__ import annotations

import json
import random
from collections import deque
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from deltafin.protocol import messages as M
from deltafin.runtime.cache import CacheError, Predictive, SlotTable, make_policy
from deltafin.runtime.config import CacheConfig, Config, ConfigError
from deltafin.runtime.predictor import RoutingPredictor
from deltafin.runtime.traces import load_trace
from deltafin.tools import replay as R
from deltafin.workers.router import Router, RouterError
from deltafin.workers.router_process import prefetch_setting
from deltafin.workers.sources import drive_need

SHARED_TRACES = Path(__file__).parents[2] / "shared" / "traces"
ALWAYS = {"threshold": 0.0, "min_precision": 0.0}  # prefetch every non-resident key of the next layer


def _random_ids(n_tokens: int, n_layers: int, n_experts: int, k: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.argsort(rng.random((n_tokens, n_layers, n_experts)), axis=2)[:, :, :k].astype(np.uint8)


def _chain_ids(n_tokens: int, n_layers: int, n_experts: int, seed: int = 0) -> np.ndarray:
    """Top-1 routing where a token's expert at layer l is (e0 + l) mod n_experts, e0 random."""
    e0 = np.random.default_rng(seed).integers(0, n_experts, n_tokens)
    return ((e0[:, None] + np.arange(n_layers)[None, :]) % n_experts).astype(np.uint8)[:, :, None]


def _loaded(r: M.Read) -> M.Loaded:
    return M.Loaded(slot=r.slot, generation=r.generation, layer=r.layer, expert=r.expert, read_us=1, nbytes=10)


# -- the policy and prefetched slots ----------------------------------------------------------------
def test_predictive_policy_evicts_the_least_likely_key_first():
    pred = RoutingPredictor(2, 4, history=8, neighbours=1, candidates=2)
    table = SlotTable(3, Predictive(pred))
    for key in [(0, 0), (0, 1), (1, 2)]:
        table.release()
        slot, _ = table.acquire(key)
        table.loaded(slot, key, table.generation[slot])
    table.release()
    pred.q = np.zeros((2, 4))
    pred.q[0, 0] = pred.q[1, 2] = 0.1   # equal: the one released first goes first
    pred.q[0, 1] = 0.9                  # predicted: kept although it is not the most recent
    pred.version += 1
    table.acquire((1, 3))
    assert (0, 0) not in table.where and (0, 1) in table.where
    table.release()
    table.acquire((1, 0))
    assert (1, 2) not in table.where and (0, 1) in table.where
    with pytest.raises(CacheError, match="reads a routing predictor"):
        make_policy("predictive")
    with pytest.raises(RouterError, match="need the model's shape"):
        Router(4, "predictive")
    # store layer ids map to the predictor's rows: layer 5 is row 1
    router = Router(4, "predictive", moe_layers=[3, 5], n_experts=4)
    assert router.policy.row_of[5] == 1 and router.policy.predictor is router.predictor


def test_predictive_policy_weighs_a_miss_no_lookahead_foresees():
    """Once the gate lookahead names a row, a key of a row it never names (the pass's first MoE
    layer: its miss waits for the whole read) weighs 1 + the hints' precision: kept over a key of
    a foreseen row a little more likely to be used. Before any hint, probability alone."""
    def table_with(q00, q12, hinted):
        pred = RoutingPredictor(2, 4, history=8, neighbours=1, candidates=2)
        table = SlotTable(2, Predictive(pred))
        for key in [(0, 0), (1, 2)]:
            table.release()
            slot, _ = table.acquire(key)
            table.loaded(slot, key, table.generation[slot])
        table.release()
        if hinted:
            pred.hint(1, [3])  # row 1 is foreseen; row 0 never is
        pred.q = np.zeros((2, 4))
        pred.q[0, 0], pred.q[1, 2] = q00, q12
        pred.version += 1
        return pred, table
    pred, table = table_with(0.4, 0.5, hinted=False)
    assert pred.miss_weights() is None
    table.acquire((1, 0))
    assert (0, 0) not in table.where and (1, 2) in table.where  # the less likely goes
    pred, table = table_with(0.4, 0.5, hinted=True)
    assert pred.miss_weights().tolist() == [1.0 + pred.hint_precision(), 1.0]
    table.acquire((1, 0))
    assert (1, 2) not in table.where and (0, 0) in table.where  # 0.4 x 1.5 > 0.5: the first layer's stays
    pred, table = table_with(0.3, 0.5, hinted=True)
    table.acquire((1, 0))
    assert (0, 0) not in table.where  # 0.3 x 1.5 < 0.5: probability still rules


def test_prefetched_slots_are_counted_and_a_need_takes_over_a_loading_one():
    table = SlotTable(3, make_policy("lru"))

    def fill(key):
        slot, _ = table.acquire(key)
        table.loaded(slot, key, table.generation[slot])
        table.release()
    s_a = table.prefetch("a")
    assert s_a is not None and table.prefetch("a") is None   # holds a slot already
    assert table.loaded(s_a, "a", table.generation[s_a])     # unpinned: evictable once loaded
    s_b = table.prefetch("b")
    table.loaded(s_b, "b", table.generation[s_b])
    fill("a")                                                # used, and ready: a miss avoided
    fill("c")                                                # the free slot
    fill("d")                                                # evicts b (LRU), never used
    assert (table.prefetches, table.prefetch_used, table.prefetch_hits, table.prefetch_wasted) == (2, 1, 1, 1)
    s_e = table.prefetch("e")                                # evicts a; still being read: not evictable...
    assert "a" not in table.where
    table.acquire("c")
    table.acquire("d")
    slot, new = table.acquire("f")                           # ...but a need takes its slot over
    assert new and slot == s_e and "e" not in table.where and table.prefetch_wasted == 2
    assert not table.loaded(s_e, "e", table.generation[s_e] - 1)   # its late read is superseded
    assert not table.failed(s_e, "e", table.generation[s_e] - 1)   # and so is a late failure
    with pytest.raises(CacheError, match="every slot is pinned"):
        table.acquire("g")


@pytest.mark.parametrize("policy", ["lru", "lfuda"])
def test_a_prefetch_keeps_a_victim_worth_more_and_the_order_stays(policy):
    """The policy's victim is refused by `keep`: it stays, first in line, as if never asked for
    (LFUDA's age too)."""
    table = SlotTable(2, make_policy(policy))
    for key in ("a", "b", "b"):  # b used twice: a is first in line for LRU and LFUDA alike
        slot, _ = table.acquire(key)
        table.loaded(slot, key, table.generation[slot])
        table.release()
    age = getattr(table.policy, "age", None)
    assert table.prefetch("p", keep=lambda key: key == "a") is None   # a is worth more: kept
    assert table.where.keys() == {"a", "b"} and table.prefetches == 0
    assert getattr(table.policy, "age", None) == age
    table.acquire("c")                                                # a is still first in line
    assert "a" not in table.where and "b" in table.where
    table.release()
    assert table.prefetch("p", keep=lambda key: False) is not None and "b" not in table.where


# -- the router's protocol ----------------------------------------------------------------------------
def test_demand_reads_go_before_prefetch_reads():
    """Prefetch reads are ordered only once the need's own reads are in (after its `slots`), into
    at most half of the staging ring, so the next need's demand reads find staging slots at once
    while prefetch reads are still in flight."""
    router = Router(8, "predictive", n_staging=6, moe_layers=[0, 1], n_experts=8, prefetch=ALWAYS)
    out = router.need(1, 0, [0, 1])
    assert [type(m) for _, m in out] == [M.Read, M.Read]                  # demand only, for now
    first = router.loaded(_loaded(out[0][1]))
    assert [type(m) for _, m in first] == [M.Fill]                        # still waiting: no prefetch
    last = router.loaded(_loaded(out[1][1]))
    assert [type(m) for _, m in last] == [M.Fill, M.Slots, M.Read, M.Read, M.Read]  # half of 6
    pf = [m for _, m in last[2:]]
    assert all(m.layer == 1 for m in pf) and router.prefetching == {m.slot for m in pf}
    assert router.stats()["prefetch_reads"] == 3
    for _, fill in first + last[:1]:                                      # compute copies the need's
        router.filled(M.Filled(staging=fill.staging, generation=fill.generation))
    # the prefetch reads are still in flight; the next need misses 3 times and all 3 reads go at once
    missed = [e for e in range(8) if e not in {m.expert for m in pf}][:3]
    out = router.need(2, 1, missed)
    assert [m.expert for _, m in out if isinstance(m, M.Read)] == missed and not router.queued
    assert all(m.slot not in router.prefetching for _, m in out)


def test_the_process_sends_an_answer_before_planning_the_prefetch_after_it():
    """defer_prefetch (the router process): the need's answer comes back without the prefetch
    reads it starts, `deferred` then plans exactly those (in-process they come together), and a
    message after which nothing is due defers nothing."""
    outs = []
    for defer in (False, True):
        router = Router(8, "predictive", n_staging=6, moe_layers=[0, 1], n_experts=8, prefetch=ALWAYS)
        router.defer_prefetch = defer
        out = router.need(1, 0, [0, 1])
        assert router.deferred() == []
        router.loaded(_loaded(out[0][1]))
        last = router.loaded(_loaded(out[1][1]))
        outs.append((last, router.deferred()))
    (together, none), (answer, later) = outs
    assert none == [] and [type(m) for _, m in answer] == [M.Fill, M.Slots]
    same = lambda out: [replace(m, wait_us=0) if isinstance(m, M.Slots) else m for _, m in out]  # timing aside
    assert same(answer + later) == same(together) and [type(m) for _, m in later] == [M.Read] * 3


def _serve(router: Router, out: list) -> None:
    """The loader reads and compute applies at once, what `out` orders and what follows."""
    todo = deque(out)
    while todo:
        _, m = todo.popleft()
        if isinstance(m, M.Read):
            todo += router.loaded(_loaded(m))
        elif isinstance(m, M.Fill):
            todo += router.filled(M.Filled(staging=m.staging, generation=m.generation))


def test_lazy_history_sends_a_need_s_reads_first_and_learns_the_same():
    """lazy_history (the router process): a need's reads go out before the predictor observes the
    uses, hints and the need before it; anything else that reads the predictor catches up first,
    so the predictor sees what an eager router's sees, message for message."""
    rng = random.Random(3)
    lazy, eager = (Router(6, "predictive", n_staging=4, moe_layers=[0, 1, 2], n_experts=8, prefetch=ALWAYS)
                   for _ in range(2))
    lazy.lazy_history = True
    behind_after_miss = 0
    for t in range(40):
        for layer in range(3):
            ex = sorted(rng.sample(range(8), 2))
            for r in (lazy, eager):
                if layer < 2:
                    r.hint([(layer + 1, e) for e in ex])
                    assert r.behind() == (r is lazy)  # a hint waits its turn too: no catch-up now
                if t % 3:
                    r.used([[layer, ex]])
                    continue
                out = r.need(t * 3 + layer, layer, ex)
                if r is lazy and any(isinstance(m, M.Read) for _, m in out):
                    assert r.behind()  # the reads are out, the need not observed yet
                    behind_after_miss += 1
                _serve(r, out + r.deferred())
        if t % 2:  # else the next pass's first layer ends this one
            for r in (lazy, eager):
                r.end_pass()
            assert not lazy.behind()
        lazy.catch_up()
        a, b = lazy.predictor, eager.predictor
        assert np.array_equal(a.q, b.q) and (a.hint_seen, a.hint_hit) == (b.hint_seen, b.hint_hit), t
        assert {k: v.tolist() for k, v in a.hinted.items()} == {k: v.tolist() for k, v in b.hinted.items()}, t
    assert behind_after_miss > 0


def test_the_process_catches_up_one_observation_per_turn():
    """idle() observes one use at a time (a need arriving waits for one at most) and the process
    stays busy until none is left."""
    r = Router(6, "predictive", moe_layers=[0, 1, 2], n_experts=8)
    r.lazy_history = True
    r.used([[0, [1, 2]], [1, [3]], [2, [4, 5]]])
    left = []
    while r.behind():
        r.catch_up(1)
        left.append(len(r._unobserved))
    assert left == [2, 1, 0]
    eager = Router(6, "predictive", moe_layers=[0, 1, 2], n_experts=8)
    eager.used([[0, [1, 2]], [1, [3]], [2, [4, 5]]])
    assert np.array_equal(r.predictor.q, eager.predictor.q)


def test_a_need_carries_hints_and_uses_the_router_takes_first():
    """Need.hints / Need.uses: one message where compute sent three; the router process takes
    them in that order, and refuses a malformed list whole."""
    from deltafin.workers.router_process import layer_lists
    msg = M.Need(req=4, layer=2, experts=[1, 5], hints=[[3, [0, 7]]], uses=[[0, [2, 3]], [1, [4]]])
    assert M.decode(M.encode(msg)) == msg
    assert M.decode(M.encode(M.Need(req=1, layer=0, experts=[1]))).hints is None
    assert layer_lists([[3, [0, 7]]], "hints") == [[3, [0, 7]]]
    for bad in ([[3]], [["x", [1]]], [[1, [None]]], 5):
        with pytest.raises(M.ProtocolError):
            layer_lists(bad, "hints")


def test_the_router_counts_each_message_type_and_the_time_until_its_answers_left():
    """`handled`: per type, the handler's whole time and its part until the answers and read
    orders were sent (mean and median); a message that sent nothing counts its whole time there."""
    from deltafin.workers.router_process import Handled
    h = Handled()
    h.add("need", 0.004, 0.001)
    h.add("need", 0.002, 0.001)
    h.add("need", 0.093, 0.090)  # one slow need (a first call's import) carries the mean, not the median
    h.add("hint", 0.0003)
    s = h.summary()
    assert s["need"] == {"count": 3, "total_s": 0.099, "mean_us": 33000.0, "sent_mean_us": 30666.7,
                         "sent_p50_us": 1000.0}
    assert s["hint"]["sent_mean_us"] == s["hint"]["mean_us"] == s["hint"]["sent_p50_us"] == 300.0


@pytest.mark.parametrize("gap_s, issued", [(None, 3), (1.0, 3), (0.0045, 1)])
def test_the_bandwidth_gate_issues_only_prefetch_reads_that_pay(gap_s, issued):
    """The router's bandwidth gate measures its reads and needs; here its figures are set: 5 ms
    a read, every need missing, and compute's time between needs (one layer) `gap_s`. Unmeasured (None) or
    with a long gap all three prefetch reads go (half the staging ring); with 4.5 ms only the
    first: a second would end after its need came and still hold the disk then."""
    router = Router(8, "predictive", n_staging=6, moe_layers=[0, 1], n_experts=8,
                    prefetch={**ALWAYS, "bandwidth": True})
    gate = router.read_gate
    if gap_s is not None:
        gate.busy_s, gate.reads, gate.miss_share = 0.05, 10.0, 1.0
        gate.next_s = gate.layer_s = gap_s
    out = router.need(1, 0, [0, 1])
    assert gate.in_flight == 2 and gate.miss_share > 0.5
    router.loaded(_loaded(out[0][1]))
    last = router.loaded(_loaded(out[1][1]))
    pf = [m for _, m in last if isinstance(m, M.Read)]
    assert len(pf) == issued and all(m.prefetch for m in pf) and gate.in_flight == issued
    assert router.stats()["prefetch_gate"]["reads"]["refused"] == {None: 0, 1.0: 0, 0.0045: 7}[gap_s]  # all 8 asked
    assert router.prefetcher.outstanding[1] == [(m.expert, 1) for m in pf]  # refused keys are not counted
    assert gate.answered_at[1] == 0                                         # the need of row 0 answered


@pytest.mark.parametrize("late", ["loaded", "load_failed"])
def test_a_need_takes_over_a_slot_a_prefetch_is_still_reading(late):
    """A pool of 3 slots: one need of 2 experts leaves room for one prefetch, still being read
    when a need of 3 experts comes. The need takes its slot; the prefetch's late `loaded` (or
    `load_failed`) frees its staging slot and sends compute nothing (a `fill_failed` would make
    compute drop the need's expert from the slot)."""
    router = Router(3, "lru", n_staging=8, moe_layers=[0, 1], n_experts=6, prefetch=ALWAYS)
    out = router.need(1, 0, [0, 1])
    reads = [m for _, m in out]
    router.loaded(_loaded(reads[0]))
    pf = [m for _, m in router.loaded(_loaded(reads[1])) if isinstance(m, M.Read)]
    assert len(pf) == 1 and pf[0].layer == 1  # the pool's third slot; the other two are pinned
    wanted = [e for e in range(6) if e != pf[0].expert][:3]
    out = router.need(2, 1, wanted)
    assert len([m for _, m in out if isinstance(m, M.Read)]) == 3
    assert (1, pf[0].expert) not in router.table.where and all((1, e) in router.table.where for e in wanted)
    r = pf[0]
    if late == "loaded":
        assert router.loaded(_loaded(r)) == []
    else:
        assert router.load_failed(M.LoadFailed(slot=r.slot, generation=r.generation, layer=r.layer,
                                               expert=r.expert, error="loader: checksum mismatch")) == []
    assert r.slot in router.staging_free
    assert router.stats()["prefetch_wasted"] == 1


class Wire:
    """The router between a loader that finishes reads in a random order and a compute that, as
    workers/slot_experts.py does, uses what its own residency map holds without asking (reporting the
    uses later with `used`), asks with `need` otherwise, and applies fills only while it waits on
    a need. Checks on every message: a prefetch read goes out only while no demand read waits,
    within the staging share; compute's map agrees with every `slots` answer."""

    def __init__(self, router: Router, seed: int):
        self.router, self.rng = router, random.Random(seed)
        self.flight: list[M.Read] = []
        self.inbox: deque = deque()
        self.view: dict[tuple, int] = {}   # compute's map: (layer, expert) -> slot
        self.unreported: list = []
        self.req = 0
        self.prefetch_reads = 0
        self.leases = 0

    def send(self, out) -> None:
        for to, msg in out:
            if to == "compute":
                self.inbox.append(msg)
                continue
            if msg.slot in self.router.prefetching:  # a prefetch read, or a lease's
                g, slot = self.router.staging_use[msg.slot][:2]
                self.prefetch_reads += slot in self.router.tables[g].prefetched
                assert not self.router.queued, "a read ahead went out while a demand read waits"
                assert len(self.router.prefetching) <= self.router.ahead_cap
            self.flight.append(msg)

    def loader_step(self) -> None:
        if self.flight:
            self.send(self.router.loaded(_loaded(self.flight.pop(self.rng.randrange(len(self.flight))))))

    def apply(self, msg) -> None:
        for key, slot in list(self.view.items()):
            if slot == msg.slot:
                del self.view[key]
        if isinstance(msg, M.Fill):
            self.view[(msg.layer, msg.expert)] = msg.slot
            self.send(self.router.filled(M.Filled(staging=msg.staging, generation=msg.generation)))

    def layer(self, layer: int, experts: list[int], lease: tuple | None = None) -> None:
        """One layer's experts; `lease`: (a later layer, experts) asked right behind its need."""
        def ask_lease():
            if lease is not None:
                self.req += 1
                self.leases += 1
                self.send(self.router.need(self.req, *lease, lease=True))
        if all((layer, e) in self.view for e in experts):
            self.unreported.append((layer, experts))  # served alone, reported later
            ask_lease()
            return
        if self.unreported:
            self.router.used(self.unreported)
            self.unreported = []
        self.req += 1
        req = self.req
        self.send(self.router.need(req, layer, experts))
        ask_lease()
        while True:
            while self.inbox:
                msg = self.inbox.popleft()
                if isinstance(msg, M.Slots) and msg.req == req:
                    for e, slot, _ in msg.slots:
                        assert self.view.get((layer, e)) == slot, "compute's map and the router disagree"
                    return
                if isinstance(msg, (M.Fill, M.FillFailed)):
                    self.apply(msg)
            assert self.flight, f"deadlock: need {self.req} waits and nothing is in flight"
            self.loader_step()


@pytest.mark.parametrize("leases", [False, True])
@pytest.mark.parametrize("n_staging, n_slots, policy", [(2, 5, "predictive"), (3, 5, "lru"),
                                                        (4, 5, "predictive"), (1, 5, "predictive")])
def test_no_deadlock_with_tiny_staging_and_pool(n_staging, n_slots, policy, leases):
    """Chunks of 1-4 tokens (2 to 5 distinct experts a need) over a pool of 5 slots, staging
    rings of 1-4 slots, every key of the next layer prefetched, and (leases) the next layer's
    experts asked as a lease behind each need where they fit in half the pool, as compute does:
    every need is answered, consistently, whatever order the reads finish in (a large need
    takes over the slots of prefetches still being read)."""
    rng = np.random.default_rng(n_staging)
    ids = _chain_ids(400, 4, 8)[:, :, 0]
    router = Router(n_slots, policy, n_staging=n_staging, moe_layers=range(4), n_experts=8, prefetch=ALWAYS)
    wire = Wire(router, seed=n_staging)
    t = 0
    while t < len(ids):
        chunk = ids[t:t + int(rng.integers(1, 5))]
        t += len(chunk)
        for layer in range(4):
            ahead = sorted({int(e) for e in chunk[:, layer + 1]} | {int(chunk[0, layer + 1]) ^ 2}) if layer < 3 else []
            wire.layer(layer, sorted({int(e) for e in chunk[:, layer]} | {int(chunk[0, layer]) ^ 1}),
                       (layer + 1, ahead) if leases and 0 < len(ahead) <= n_slots // 2 else None)
            for _ in range(int(rng.integers(0, 3))):  # reads finish while compute computes
                wire.loader_step()
        router.end_pass()
    stats = router.stats()
    assert stats["uses"] > 0
    assert (stats.get("lease_reads", 0) > 50) == leases and wire.leases == stats.get("leases", 0)
    if n_staging >= 2:  # one staging slot: none of it is prefetch's share
        assert wire.prefetch_reads > 100 and stats["prefetch_reads"] == wire.prefetch_reads
        assert stats["prefetch_used"] > 0
    else:
        assert wire.prefetch_reads == 0


# -- leases: several requests in flight ----------------------------------------------------------------
def _sent(out, kind):
    return [m for to, m in out if isinstance(m, kind)]


def test_a_lease_is_held_while_an_earlier_need_waits_and_released_at_its_layer():
    """compute asks for layer 1's experts (lease) while layer 0's need still waits: both are
    read, the lease behind the need's demand reads (loader priority of a prefetch); only the need
    is answered (`slots`: nobody waits for a lease, whose fills compute takes as they come); the
    lease's slots are pinned until layer 1's need, so another layer's
    need cannot take them; the need of layer 1 finds them resident (lease used, a miss avoided)
    and releases the rest, which the policy may then evict (lease wasted)."""
    r = Router(4, "lru", n_staging=8, moe_layers=[0, 1, 2], n_experts=8)
    need = r.need(1, 0, [0, 1])
    lease = r.need(2, 1, [2, 3], lease=True)
    assert not _sent(need + lease, M.Slots)                      # two requests in flight
    # the lease's reads wait until the need has its reads in, then go as prefetch reads
    assert not _sent(lease, M.Read)
    first = _sent(need, M.Read)
    assert [(m.layer, m.expert, m.prefetch) for m in first] == [(0, 0, False), (0, 1, False)]
    assert not _sent(r.loaded(_loaded(first[0])), M.Read)
    out = r.loaded(_loaded(first[1]))
    then = _sent(out, M.Read)
    assert [(m.layer, m.expert, m.prefetch) for m in then] == [(1, 2, True), (1, 3, True)]
    lease_fills = [r.loaded(_loaded(read)) for read in then]
    assert [(m.req, m.layer, m.hits) for m in _sent(out, M.Slots)] == [(1, 0, 0)]
    assert [[(m.layer, m.expert) for m in _sent(o, M.Fill)] for o in lease_fills] == [[(1, 2)], [(1, 3)]]
    assert not [m for o in lease_fills for m in _sent(o, M.Slots)]  # a lease is never answered
    assert r.stats()["uses"] == 2                                # a lease is not a use
    # another pass's layer 0 needs three slots: only its own two are free of pins, the lease
    # of layer 1 (not reached yet) holds the others
    with pytest.raises(RouterError, match="pinned"):
        r.need(3, 0, [4, 5, 6])
    for m in _sent(r.need(4, 0, [0, 1]), M.Read):              # (the failed need released all)
        r.loaded(_loaded(m))
    r.need(5, 1, [2, 3], lease=True)                             # held again, both resident
    out = r.need(6, 0, [4, 5])                                   # victims: layer 0's, not the lease's
    for m in _sent(out, M.Read):
        r.loaded(_loaded(m))
    assert set(r.table.where) == {(0, 4), (0, 5), (1, 2), (1, 3)}
    answer = _sent(r.need(7, 1, [2]), M.Slots)[0]                # layer 1: the lease is released
    assert answer.hits == 1
    s = r.stats()
    assert (s["lease_reads"], s["lease_used"], s["lease_hits"], s["lease_wasted"]) == (2, 1, 1, 0)
    r.need(8, 2, [6, 7, 0])                                      # (1, 3), held no more, can go now
    s = r.stats()
    assert (1, 3) not in r.table.where and s["lease_wasted"] == 1 and s["lease_precision"] == 0.5


def test_a_need_counts_the_experts_it_finds_read_ahead_but_not_in_yet():
    """`misses_in_flight`: the experts a need waits for whose read a lease (or prefetch) had
    started; a miss read on demand and a hit are not counted."""
    r = Router(4, "lru", n_staging=8, moe_layers=[0, 1], n_experts=8)
    reads = _sent(r.need(1, 1, [2, 3], lease=True), M.Read)     # no need waits: read at once
    assert [(m.expert, m.prefetch) for m in reads] == [(2, True), (3, True)]
    r.loaded(_loaded(reads[0]))                                  # 2 is in, 3 still loading
    out = r.need(2, 1, [2, 3, 4])
    assert [m.expert for m in _sent(out, M.Read)] == [4]         # 4 read on demand
    s = r.stats()
    assert s["misses_in_flight"] == 1 and (s["uses"], s["hits"]) == (3, 1)


@pytest.mark.parametrize("cap", [None, 1])
def test_reads_ahead_hold_at_most_their_cap_of_staging_slots(cap):
    """A lease's reads take at most `ahead_cap` staging slots at once (half the ring unless
    bench.ahead_reads lowers it), each until compute applied its fill (`filled`); the rest wait
    in order, and a demand read never waits for them."""
    r = Router(8, "lru", n_staging=8, moe_layers=[0, 1], n_experts=8)
    if cap is not None:
        r.ahead_cap = cap
    limit = cap or 4
    assert r.stats()["ahead_cap"] == limit
    first = _sent(r.need(1, 1, [0, 1, 2, 3, 4], lease=True), M.Read)
    assert [m.expert for m in first] == list(range(limit)) and all(m.prefetch for m in first)
    demand = _sent(r.need(2, 0, [5]), M.Read)                     # a need: read at once, whatever waits
    assert [(m.layer, m.expert, m.prefetch) for m in demand] == [(0, 5, False)]

    def land(read):  # the loader read it, compute applied its fill: the reads it let go
        out = r.loaded(_loaded(read))
        fill = _sent(out, M.Fill)[0]
        return _sent(out, M.Read) + _sent(r.filled(M.Filled(staging=fill.staging, generation=fill.generation)), M.Read)
    assert not land(demand[0])                                   # the lease's reads still hold the cap
    assert [m.expert for m in land(first[0])] == [limit]         # one landed: the next one goes


def test_a_lease_is_best_effort():
    """A lease never fails the run: what finds no slot is left out (counted), a lease read that
    fails drops the lease (the `fill_failed` names it, no error), and the next need reads again."""
    r = Router(2, "lru", n_staging=4, moe_layers=[0, 1], n_experts=4)
    for m in _sent(r.need(1, 0, [0, 1]), M.Read):
        r.loaded(_loaded(m))
    out = r.need(2, 1, [2], lease=True)                          # both slots pinned by layer 0
    assert not _sent(out, M.Read) and r.stats()["lease_refused"] == 1
    assert not _sent(out, M.Slots)                               # nothing to answer, nothing sent
    r.used([(0, [0])])                                           # layer 0 done: its pins go
    read = _sent(r.need(3, 1, [2], lease=True), M.Read)[0]
    failed = r.load_failed(M.LoadFailed(slot=read.slot, generation=read.generation, layer=1,
                                        expert=2, error="bad record"))
    assert [(m.req, m.expert) for m in _sent(failed, M.FillFailed)] == [(3, 2)]
    assert not _sent(failed, M.Error) and not r.leases
    again = _sent(r.need(4, 1, [2]), M.Read)                     # read again, on demand
    assert [(m.layer, m.expert, m.prefetch) for m in again] == [(1, 2, False)]


@pytest.mark.parametrize("case", ["guesses well", "guesses wrong", "reads are wasted"])
def test_a_lease_reads_only_what_pays(case):
    """A lease reads a missing expert only where a prefetch would: its probability (at least the
    lookahead's measured precision) reaches the threshold, and the lease reads' own measured
    precision stays at the prefetcher's min_precision. A lookahead naming experts the next layer
    does not use reads nothing; one whose lease reads are wasted (here: it also names two the
    layer never uses, and the lease asks for those) soon reads only every probe_every-th key;
    one that names them right reads every one ahead."""
    r = Router(4, "predictive", n_staging=4, moe_layers=[0, 1], n_experts=16,
               prefetch={"threshold": 0.4, "depth": 1})
    asked = 0
    for p in range(24):
        used = [(2 * p) % 16, (2 * p + 1) % 16]
        other = [(e + 8) % 16 for e in used]
        hinted = {"guesses well": used, "guesses wrong": other, "reads are wasted": used + other}[case]
        leased = other if case == "reads are wasted" else hinted
        drive_need(r, 4 * p, 0, [p % 2], _loaded, lambda fill: None)
        r.hint([(1, e) for e in hinted])
        drive_need(r, 4 * p + 1, 1, leased, _loaded, lambda fill: None, lease=True)
        asked += len(leased)
        drive_need(r, 4 * p + 2, 1, used, _loaded, lambda fill: None)
        r.end_pass()
    s = r.stats()
    if case == "guesses well":
        # every key leased was read by the lease, or was already read ahead by the prefetch
        assert "lease_unlikely" not in s and s["lease_precision"] == 1.0
        assert s["lease_reads"] + s["prefetch_used"] == asked
    elif case == "guesses wrong":
        assert r.predictor.hint_precision() < 0.1 and s["lease_reads"] <= 4
    else:
        assert r.predictor.hint_precision() >= 0.4 and s["lease_precision"] == 0.0
        assert s["lease_reads"] <= asked // 3 and s["lease_unlikely"] >= asked // 2


def test_a_foreseen_lease_reads_what_the_predictor_doubts():
    """Need.sure: compute foresaw the experts (a layer that ran ahead on a wrong input chose them),
    so a lease reads its missing ones whatever the predictor expects of them; the same lease
    without it reads none of the keys the predictor rates under the threshold. The reads queue
    behind the need that waits, as any lease's."""
    def fresh():
        r = Router(8, "predictive", n_staging=4, moe_layers=[0, 1], n_experts=16,
                   prefetch={"threshold": 0.4, "depth": 1})
        assert r.predictor.q[1, [5, 6]].max() < 0.4  # nothing learnt: the prior
        return r
    doubted = fresh()
    assert not _sent(doubted.need(1, 1, [5, 6], lease=True), M.Read)
    assert doubted.stats()["lease_unlikely"] == 2
    r = fresh()
    demand = _sent(r.need(1, 0, [1]), M.Read)                    # a need waiting for its read
    assert [(m.layer, m.expert) for m in demand] == [(0, 1)]
    assert not _sent(r.need(2, 1, [5, 6], lease=True, sure=True), M.Read)  # queued behind it
    after = r.loaded(M.Loaded(slot=demand[0].slot, generation=demand[0].generation, layer=0,
                              expert=1, read_us=0, nbytes=1))
    assert sorted((m.layer, m.expert, m.prefetch) for m in _sent(after, M.Read)) == [(1, 5, True), (1, 6, True)]
    s = r.stats()
    assert s["foreseen_reads"] == 2 and "lease_unlikely" not in s


def test_foreseen_leases_together_pin_at_most_half_the_group():
    """Several foreseen leases may be held at once (one per forgotten layer): the router pins at
    most half the group's slots for them, so the next need always finds victims."""
    r = Router(4, "predictive", n_staging=8, moe_layers=[0, 1, 2, 3], n_experts=16,
               prefetch={"threshold": 0.4, "depth": 1})
    for req, layer in enumerate((1, 2, 3)):
        r.need(10 + req, layer, [2 * layer, 2 * layer + 1], lease=True, sure=True)
        assert len(r.table.pinned) <= 2
    assert r.stats()["lease_refused"] >= 4
    reads = _sent(r.need(20, 0, [8, 9]), M.Read)                 # two misses: victims found
    assert sorted(m.expert for m in reads) == [8, 9]


def test_used_trains_the_predictor_and_release_ends_the_pass():
    router = Router(8, "predictive", moe_layers=[1, 2], n_experts=4)
    router.used([(1, [3]), (2, [0])])  # hits compute served alone (not in the table: stray)
    p = router.predictor
    assert p.cur_used[0, 3] and p.cur_used[1, 0] and p.passes == 0
    router.end_pass()
    assert p.passes == 1 and p.stored == 1


# -- replay -----------------------------------------------------------------------------------------------
def test_prefetch_replay_arithmetic_by_hand():
    """2 layers x 3 experts, top-1, 6 slots (everything fits); threshold 0 prefetches every
    non-resident expert of the next layer, at most 3 at a time (half the staging ring).
    Tokens (layer0, layer1): (0, 1), (1, 0), (0, 0).
    token 1: layer 0 misses (demand read); then 3 prefetch reads of layer 1; layer 1 hits.
    token 2: layer 0 misses; layer 1 all resident, nothing to prefetch; layer 1 hits.
    token 3: both hit. Without prefetch: 4 misses (tokens 1 and 2), then 2 hits."""
    ids = np.array([[[0], [1]], [[1], [0]], [[0], [0]]], dtype=np.uint8)
    r = R.replay(ids, 6, "predictive", record_bytes=10, prefetch={**ALWAYS, "depth": 1}, n_experts=3)
    assert (r["uses"], r["hits"], r["demand_reads"], r["prefetch_reads"], r["prefetch_used"]) == (6, 4, 2, 3, 2)
    assert r["reads"] == 5 and r["hit_rate"] == pytest.approx(4 / 6)
    assert r["reads_per_token"] == pytest.approx(5 / 3) and r["bytes_read_per_token"] == pytest.approx(50 / 3)
    assert r["prefetch_precision"] == pytest.approx(2 / 3)
    assert r["prefetch_coverage"] == pytest.approx(2 / (2 + 2))
    base = R.replay(ids, 6, "predictive", record_bytes=10, n_experts=3)
    assert (base["hits"], base["reads"]) == (2, 4) and "prefetch_reads" not in base
    R.add_recall(r, base)
    assert r["prefetch_recall"] == pytest.approx((4 - 2) / 4)
    steps = R.replay(ids, 6, "predictive", prefetch=ALWAYS, n_experts=3, per_step=True)["reads_per_step"]
    assert steps.tolist() == [[1, 0], [1, 0], [0, 0]]  # misses only, not the prefetch reads


def test_predictive_prefetch_follows_a_chain():
    """A deterministic chain: after the first layer of a token every later one is predicted."""
    ids = _chain_ids(1500, 6, 32)
    lru = R.replay(ids, 48, "lru", n_experts=32)
    pf = R.replay(ids, 48, "predictive", prefetch=True, n_experts=32)
    assert lru["hit_rate"] < 0.3
    assert pf["hit_rate"] > 0.75 and pf["prefetch_precision"] > 0.9
    assert pf["reads_per_token"] < 1.05 * lru["reads_per_token"]  # misses turned into hits, not extra reads


def test_prefetch_gates_itself_off_on_a_random_trace():
    """No structure to learn: with no probability threshold, the measured precision (about
    6/64) turns prefetch off in the router, so the bytes read stay near those without prefetch."""
    ids = _random_ids(1500, 4, 64, 6)
    base = R.replay(ids, 64, "predictive", n_experts=64)
    gated = R.replay(ids, 64, "predictive", n_experts=64,
                     prefetch={"threshold": 0.0, "min_precision": 0.4, "depth": 1, "probe_every": 16})
    assert gated["prefetch_precision"] < 0.2
    assert gated["prefetch_gate"]["gated_share_d1"] > 0.95
    assert gated["reads_per_token"] < 1.1 * base["reads_per_token"]


@pytest.mark.skipif(not (SHARED_TRACES / "dsv2lite-dev.npz").exists(), reason="shared traces absent")
def test_dev_trace_prefix_reaches_the_goal():
    """The first 2,000 tokens of the dev split at 25% of the experts, through the router: the goal
    of the prefetch work (hit rate >= 0.58 at <= 1.2x LRU's bytes), with the figures measured (the whole
    splits: docs/TRACES.md)."""
    ids = load_trace(SHARED_TRACES / "dsv2lite-dev.npz").ids[:2000]
    n_slots = R.n_slots_for(0.25, 26, 64)
    lru = R.replay(ids, n_slots, "lru")
    best = R.replay(ids, n_slots, "predictive", prefetch=True)
    assert lru["hit_rate"] == pytest.approx(0.4461, abs=5e-4)
    assert best["hit_rate"] == pytest.approx(0.6393, abs=0.003)
    assert best["bytes_read_per_token"] <= 1.2 * lru["bytes_read_per_token"]
    assert best["prefetch_precision"] == pytest.approx(0.7214, abs=0.005)


# -- config -----------------------------------------------------------------------------------------------
def test_prefetch_config_keys():
    assert Config.from_dict({}).cache.prefetch == "auto"
    for value in (True, False, "auto"):
        assert Config.from_dict({"cache": {"prefetch": value}}).cache.prefetch == value
    with pytest.raises(ConfigError, match="cache.prefetch 'always'"):
        Config.from_dict({"cache": {"prefetch": "always"}})
    with pytest.raises(ConfigError, match="cache.prefetch must be bool or str"):
        Config.from_dict({"cache": {"prefetch": 1}})
    with pytest.raises(ConfigError, match="prefetch_threshold"):
        Config.from_dict({"cache": {"prefetch_threshold": 1.5}})
    lru, pred = CacheConfig(policy="lru", prefetch="auto"), CacheConfig(policy="predictive", prefetch="auto")
    assert prefetch_setting(lru, 10, 100) is False                      # auto: the predictive policy only
    assert prefetch_setting(pred, 100, 100) is False                    # ... and only when not all fit
    assert prefetch_setting(replace(pred, prefetch_threshold=0.3, prefetch_depth=2), 10, 100) == {
        "threshold": 0.3, "depth": 2, "gate": True, "bandwidth": True}
    assert prefetch_setting(CacheConfig(policy="lru", prefetch=True), 100, 100) == {
        "threshold": 0.4, "depth": 3, "gate": True, "bandwidth": True}
    # the prefetcher's fixed (ungated) setting stays for replays and tests, not the configuration
    off = {**prefetch_setting(CacheConfig(prefetch=True), 10, 100), "gate": False}
    fixed = Router(4, "predictive", moe_layers=[0, 1], n_experts=4, prefetch=off)
    assert fixed.prefetcher.gate is False and fixed.read_gate is None
    gated = Router(4, "predictive", moe_layers=[0, 1], n_experts=4, prefetch={**off, "gate": True})
    assert gated.prefetcher.gate is True and gated.read_gate is not None
    # in-process (replay, tests) the router has no bandwidth gate unless asked: no clock to trust
    assert Router(4, "predictive", moe_layers=[0, 1], n_experts=4, prefetch=True).read_gate is None


def test_weigh_misses_reaches_the_router_s_policy(tiny_stores):
    """cache.weigh_misses (default true) is the predictive policy's weigh_misses, as the router
    process builds it (router_for); LRU takes no such option."""
    from deltafin.runtime.store import Store
    from deltafin.workers.router_process import router_for
    assert Config.from_dict({}).cache.weigh_misses is True
    store = Store(tiny_stores("mixtral"))
    few = {g: 2 for g in store.layouts}
    for weigh in (True, False):
        router = router_for(store, CacheConfig(weigh_misses=weigh), few, 4)
        assert {t.policy.weigh_misses for t in router.tables.values()} == {weigh}
    assert router_for(store, CacheConfig(policy="lru"), few, 4).policy_name == "lru"


# -- exactness in real runs ---------------------------------------------------------------------------------
def test_greedy_tokens_and_logits_identical_with_prefetch_and_any_policy(tmp_path):
    """Real supervisor, router, loader and compute on a small pool (2 of 6 layers' worth of
    slots, 6 staging slots): LRU and the predictive policy without prefetch, and both with every
    key of the next layer prefetched (threshold 0), with the prefetch fills that landed taken
    before a layer asks (bench.early_fills) or only at its need, and with the gate lookahead
    asked as a lease (bench.leases, the default) or only hinted, and with the first layer kept
    whole in a slot group of its own (cache.whole_layers), give the same greedy tokens and
    logits."""
    from deltafin.client import Client
    from deltafin.tools import convert
    from deltafin.tools.run import running_supervisor
    from deltafin.tools.synth import tiny
    src = tiny("qwen3_moe", tmp_path / "hf", layers=6, experts=16, top_k=4, seed=3)
    out = tmp_path / "store"
    assert convert.main([str(src), str(out), "--no-progress"]) == 0
    prompt = [5, 9, 200, 31, 77]
    runs = {}
    for name, cache in (("lru", {"policy": "lru", "prefetch": False}),
                        ("predictive", {"policy": "predictive", "prefetch": False}),
                        ("predictive+prefetch", {"policy": "predictive", "prefetch": True, "prefetch_threshold": 0.0}),
                        ("lru+prefetch", {"policy": "lru", "prefetch": True, "prefetch_threshold": 0.0}),
                        ("late+prefetch", {"policy": "predictive", "prefetch": True, "prefetch_threshold": 0.0}),
                        ("nolease+prefetch", {"policy": "predictive", "prefetch": True, "prefetch_threshold": 0.0}),
                        ("one+prefetch", {"policy": "predictive", "prefetch": True, "prefetch_threshold": 0.0}),
                        ("whole+prefetch", {"policy": "predictive", "prefetch": True, "prefetch_threshold": 0.0,
                                            "whole_layers": True})):
        path = tmp_path / f"{name}.toml"
        path.write_text("[cache]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in
                                              {"max_slots": 32, "staging_slots": 6, **cache}.items())
                        + f"[bench]\nearly_fills = {json.dumps(not name.startswith('late'))}\n"  # on the CPU "auto" is off
                        + f"leases = {json.dumps(not name.startswith('nolease'))}\n"
                        + f"ahead_reads = {1 if name.startswith('one') else 0}\n"
                        # each layer reads its routing back (on a GPU it runs ahead by default, and
                        # a miss's foreseen leases land early without any prefetch)
                        + "run_ahead = false\n")
        with running_supervisor(out, "4GiB", ["--config", str(path)]) as (ep, _):
            with Client(ep, timeout=120) as c:
                toks = c.generate(prompt, max_tokens=24).token_ids
                full = c.stats()
                stats = full["workers"]
                # whole layers: the first layer's 16 experts in a group of their own (32 slots)
                groups = full["memory"]["resident_groups"]
                assert (sorted(groups.values()) == [16, 16]) == name.startswith("whole"), (name, groups)
                runs[name] = (toks, c.logits(prompt + toks), stats["router"])
                # gate lookahead: compute hints the next layer where the router prefetches
                sent = stats["compute"]["messages"]  # alone, or riding a need or lease
                hints = sent.get("hint", 0) + sent.get("folded_hint", 0)
                assert (hints > 0) == name.endswith("prefetch"), (name, hints)
                assert (stats["router"].get("hinted", 0) > 0) == name.endswith("prefetch")
                # prefetch fills that landed while compute was busy are taken before a layer asks
                early = stats["compute"]["pipeline"]["early_fills"]
                assert (early > 0) == (name.endswith("prefetch") and not name.startswith("late")), (name, early)
                # the lookahead asked as a lease, read behind the layer's need
                leases = stats["compute"]["pipeline"]["leases"]
                assert (leases > 0) == (name.endswith("prefetch") and not name.startswith("nolease")), (name, leases)
                assert (stats["router"].get("leases", 0) > 0) == (leases > 0)
                assert (stats["router"].get("lease_reads", 0) > 0) == (leases > 0), stats["router"]
                # what each message cost the router, and of it what a need's reads waited for
                handled = stats["router"]["handled"]
                assert handled["need"]["count"] > 0
                for kind, h in handled.items():
                    assert 0 < h["sent_mean_us"] <= h["mean_us"], (kind, h)
                # reads ahead hold at most half the staging ring, or bench.ahead_reads of it
                assert stats["router"]["ahead_cap"] == (1 if name.startswith("one") else 3), name
    for name, (_, _, s) in runs.items():
        print(name, {k: s.get(k) for k in ("hits", "uses", "reads", "prefetch_reads", "prefetch_used", "stray_uses", "evictions")})
    ref_toks, ref_logits, ref_stats = runs["lru"]
    assert "prefetch_reads" not in ref_stats and ref_stats.get("evictions", 0) > 0
    for name in ("predictive", "predictive+prefetch", "lru+prefetch", "late+prefetch", "nolease+prefetch",
                 "one+prefetch", "whole+prefetch"):
        toks, logits, stats = runs[name]
        assert stats["policy"] == name.split("+")[0].replace("late", "predictive").replace(
            "nolease", "predictive").replace("whole", "predictive").replace("one", "predictive")
        assert ("prefetch_reads" in stats) == name.endswith("prefetch")
        if name.startswith("one"):  # one staging slot for reads ahead: leases may take every turn
            assert stats["prefetch_reads"] + stats.get("lease_reads", 0) > 0
        else:
            assert stats.get("prefetch_reads", 1) > 0
        if name.endswith("prefetch"):
            assert 0 < stats["hint_precision"] <= 1
        assert toks == ref_toks
        np.testing.assert_array_equal(logits, ref_logits)


def test_routing_history_warms_the_predictor_before_the_first_token(tmp_path):
    """A router that learnt a chain from a routing history predicts the next layer at its very
    first need; a cold one has nothing above the threshold yet. A history that does not fit the
    store is refused before any worker starts."""
    import subprocess
    import sys

    from deltafin.runtime.traces import save_trace
    ids = _chain_ids(400, 6, 32)
    save_trace(tmp_path / "h.npz", ids, np.array([len(ids)]), np.array(["chain"]))

    def first_plan(learn: bool):
        router = Router(64, "predictive", n_staging=8, moe_layers=range(6), n_experts=32, prefetch=True)
        if learn:
            assert router.learn_history(str(tmp_path / "h.npz"), 300) == 300
        router.predictor.observe(0, [5])
        return router.prefetcher.plan(lambda key: False)
    assert first_plan(learn=False) == []
    assert (1, 6) in first_plan(learn=True)  # row 1 (layer 1): expert 5 + 1

    from deltafin.tools.synth import tiny
    from deltafin.tools import convert
    src = tiny("mixtral", tmp_path / "hf", layers=2, experts=8, top_k=2, seed=1)
    assert convert.main([str(src), str(tmp_path / "store"), "--no-progress"]) == 0
    r = subprocess.run([sys.executable, "-m", "deltafin.workers.supervisor", "--model", str(tmp_path / "store"),
                        "--routing-history", str(tmp_path / "h.npz")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "routing_history" in r.stderr and "6 MoE layers" in r.stderr, r.stderr[-500:]


def test_a_layer_served_by_early_fills_still_starts_the_next_prefetch():
    """A layer compute completed from fills it took early sends no need; its `used` marked
    ahead makes the router plan the prefetch a need's answer would have (Router.prefetch_ahead),
    where a plain `used` plans none."""
    ids = _chain_ids(1500, 6, 32)
    router = Router(16, "predictive", moe_layers=range(6), n_experts=32, prefetch=True, n_staging=16)
    req = 0
    for row in ids[:-1]:  # served as the runtime serves them: the predictor and its gate learn
        for layer, experts in enumerate(row.tolist()):
            drive_need(router, req, layer, experts, _loaded, lambda fill: None)
            req += 1
        router.end_pass()
    first = ids[-1, 0].tolist()
    router.used([[0, first]])  # layer 0 served without a need (all resident, as after early fills)
    plain = [m for _, m in router._prefetch() if isinstance(m, M.Read)]
    assert plain == []  # no need answered: the old trigger plans nothing
    reads = [m for _, m in router.prefetch_ahead() if isinstance(m, M.Read)]
    assert reads and all(r.prefetch for r in reads)
    assert (1, (first[0] + 1) % 32) in {(r.layer, r.expert) for r in reads}  # the chain's next expert


def test_an_early_need_is_answered_at_once_unless_a_read_waits_for_staging():
    """Need.early (bench.defer_needs): where reads are needed and each holds a staging slot, the
    router answers at once with the slots marked pending, then the fills, then the final answer;
    a need with nothing to read is answered as before; one whose read is queued for a staging
    slot gets no early answer (compute could hold back the `filled` that read waits for)."""
    r = Router(4, "lru", n_staging=1, moe_layers=[0, 1], n_experts=8)
    out = r.need(1, 0, [0, 1], early=True)
    assert not _sent(out, M.Slots)  # two reads, one staging slot: the second is queued
    reads = _sent(out, M.Read)
    assert len(reads) == 1
    out = r.loaded(_loaded(reads[0]))
    fill = _sent(out, M.Fill)[0]
    out = r.filled(M.Filled(staging=fill.staging, generation=fill.generation))
    out = r.loaded(_loaded(_sent(out, M.Read)[0]))
    assert [m.pending for m in _sent(out, M.Slots)] == [False]
    r.release()

    r = Router(4, "lru", n_staging=4, moe_layers=[0, 1], n_experts=8)
    out = r.need(1, 0, [2, 3], early=True)
    early = _sent(out, M.Slots)
    assert [(m.req, m.pending, m.hits) for m in early] == [(1, True, 0)]
    reads = _sent(out, M.Read)
    assert sorted(m.expert for m in reads) == [2, 3]
    assert {e: s for e, s, _ in early[0].slots} == {m.expert: r.table.where[(0, m.expert)] for m in reads}
    answers = [m for read in reads for m in _sent(r.loaded(_loaded(read)), M.Slots)]
    assert [(m.pending, m.hits) for m in answers] == [(False, 0)]
    assert answers[0].slots == early[0].slots
    # every expert resident: answered once, as always
    assert [m.pending for m in _sent(r.need(2, 0, [2, 3], early=True), M.Slots)] == [False]
    assert r.stats()["early_answers"] == 1
