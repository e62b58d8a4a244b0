"""The host's side of bench.device_waits (workers/device_waits.py `RequestPage`), on this CPU.

The device's side is a CUDA kernel (tests/test_run_ahead.py runs it where there is a GPU); here a
thread writes the page's words as that kernel does (the experts, their count, then the tag; the
table polled until the host publishes; the error word after its limit; the end marker), so what is
checked is the host's protocol: every request answered once and in order, one posted right after
the last was published included, a lookup's timeout and the host's own raised, an abandoned pass
ending."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from deltafin.workers import device_waits as D

LAYERS, EXPERTS = [1, 2, 4], 8


def device(page: D.RequestPage, seq: int, rows: dict[int, list[int]], limit_s: float = 2.0):
    """What the kernels do in one pass: each layer's lookup (a request where an expert is missing,
    then a spin until the host has written every slot, or the error word after limit_s), then the
    end marker. Returns the thread and the slots each layer read."""
    read: dict[int, list[int]] = {}

    def run():
        for layer, ids in rows.items():
            i = page.index[layer]
            t0 = time.perf_counter()
            if (page.table[i, ids] < 0).any():
                page.page[D.IDS:D.IDS + len(ids)] = ids
                page.page[D.COUNT] = len(ids)
                page.page[D.REQ] = seq * 256 + i
                while (page.table[i, ids] < 0).any():
                    if time.perf_counter() - t0 > limit_s:
                        page.page[D.ERR] = seq * 256 + i
                        return
                    time.sleep(0.0005)
            read[layer] = page.table[i, ids].tolist()
        page.page[D.DONE] = seq

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, read


def test_every_request_is_answered_once_in_order_and_the_pass_ends():
    page = D.RequestPage(LAYERS, EXPERTS)
    page.table[:] = np.arange(EXPERTS)  # every expert resident, slot = expert
    page.table[0, 3] = page.table[1, 5] = page.table[2, 6] = -1  # three missing, one per layer
    served = []

    def serve(layer, experts):  # the layer's need, then the table published
        served.append((layer, sorted(experts)))
        i = page.index[layer]
        for e in experts:
            if page.table[i, e] < 0:
                page.table[i, e] = 100 + e

    for _ in range(3):  # passes: the tags of the last ones are never taken for this one's
        page.begin()
        t, read = device(page, page.seq, {1: [3, 0], 2: [5, 1], 4: [6, 2]})
        page.wait(serve, timeout_s=5.0)
        t.join(5.0)
        page.table[0, 3] = page.table[1, 5] = page.table[2, 6] = -1
    assert served == [(1, [0, 3]), (2, [1, 5]), (4, [2, 6])] * 3
    assert read == {1: [103, 0], 2: [105, 1], 4: [106, 2]} and page.requests == 9


def test_a_pass_with_every_expert_resident_asks_nothing():
    page = D.RequestPage(LAYERS, EXPERTS)
    page.table[:] = np.arange(EXPERTS)
    page.begin()
    t, read = device(page, page.seq, {1: [0, 1], 4: [2, 3]})
    page.wait(lambda layer, experts: pytest.fail("nothing to serve"), timeout_s=5.0)
    t.join(5.0)
    assert read == {1: [0, 1], 4: [2, 3]} and page.requests == 0


def test_a_lookup_past_its_limit_raises_and_an_abandoned_pass_ends():
    page = D.RequestPage(LAYERS, EXPERTS, limit_s=0.2)
    page.table[:] = np.arange(EXPERTS)
    page.table[1, 4] = -1
    page.begin()
    t, _ = device(page, page.seq, {2: [4]}, limit_s=0.2)
    with pytest.raises(D.DeviceWaitTimeout, match="lookup"):
        page.wait(lambda layer, experts: None, timeout_s=5.0)  # a host that never writes the slot
    t.join(5.0)
    assert page.timeouts == 1
    # given up while a lookup waits: every missing entry points at slot 0 and the device goes on
    page.table[1, 4] = -1
    page.begin()
    t, read = device(page, page.seq, {2: [4]})
    time.sleep(0.05)
    page.abandon()
    t.join(5.0)
    assert read == {2: [0]} and int(page.page[D.DONE]) == page.seq and page.published == -1


def test_a_pass_that_never_ends_raises_after_the_hosts_own_limit():
    page = D.RequestPage(LAYERS, EXPERTS)
    page.begin()
    t0 = time.perf_counter()
    with pytest.raises(D.DeviceWaitTimeout, match="did not end"):
        page.wait(lambda layer, experts: None, timeout_s=0.2)
    assert 0.2 <= time.perf_counter() - t0 < 2.0


def test_the_table_is_published_where_the_map_changed_and_drops_at_once():
    page = D.RequestPage(LAYERS, EXPERTS)
    tier = SimpleNamespace(changes=1, slot_of={layer: np.full(EXPERTS, -1, dtype=np.int64) for layer in LAYERS})
    tier.slot_of[4][2] = 7
    page.publish(tier)
    assert page.table[2, 2] == 7 and (page.table[0] == -1).all()
    tier.slot_of[4][3] = 9  # changed without telling: not published again until `changes` moves
    page.publish(tier)
    assert page.table[2, 3] == -1
    tier.changes += 1
    page.publish(tier)
    assert page.table[2, 3] == 9
    page.drop(4, 2)  # marked missing at once, before its slot is written
    assert page.table[2, 2] == -1


def test_the_page_holds_each_layers_table_after_the_request_words():
    page = D.RequestPage(list(range(60)), 384)  # Kimi K3's shape: 60 MoE layers x 384 experts
    assert page.table.shape == (60, 384) and page.size % 4096 == 0
    assert page.size >= (D.TABLE + 60 * 384) * 4 and D.MAX_K >= 16
    with pytest.raises(ValueError, match="256"):
        D.RequestPage(list(range(257)), 8)
