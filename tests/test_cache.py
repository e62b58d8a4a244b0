"""Slot table and replacement policies (runtime/cache.py) on hand-made access sequences."""
from __future__ import annotations

import functools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deltafin.runtime.cache import (LFUDA, LRU, Belady, CacheError, SlotTable, make_policy,
                                    policy_names)
from deltafin.runtime.config import Config, ConfigError
from deltafin.tools.replay import replay
from deltafin.workers.router import Router, RouterError


def _use(table: SlotTable, *keys, load=True) -> list[int]:
    """One `need`: releases the previous pins, pins keys, loads the misses at once."""
    table.release()
    slots = []
    for key in keys:
        slot, new = table.acquire(key)
        if new and load:
            assert table.loaded(slot, key, table.generation[slot])
        slots.append(slot)
    return slots


def _victims(table: SlotTable, keys) -> list:
    """The keys each new key pushes out, in order."""
    out = []
    for key in keys:
        before = dict(table.where)
        _use(table, key)
        out += [k for k in before if k not in table.where]
    return out


def test_lru_evicts_the_least_recently_used():
    table = SlotTable(3, LRU())
    _use(table, "a")
    _use(table, "b")
    _use(table, "c")
    _use(table, "a")  # a is the most recent now
    assert _victims(table, ["d", "e", "a", "f"]) == ["b", "c", "d"]


def test_lfuda_ages_old_popularity_away():
    policy = LFUDA()
    table = SlotTable(2, policy)
    for _ in range(3):
        _use(table, "A")  # count 3, priority 3
    _use(table, "B")      # priority 1
    # C pushes out B (1) and the age becomes 1; C gets 1 + 1 = 2; D pushes out C (2) with
    # priority 2 + 1 = 3, as high as A: a plain LFU would keep A forever, aging evicts it
    # (ties go to the slot released first)
    assert _victims(table, ["C", "D", "E"]) == ["B", "C", "A"]
    assert policy.age == 3
    _use(table, "A")  # counts survive eviction: 3 + 1 uses, on top of the age
    assert policy.priority[table.where["A"]] == 3 + 4


def test_lfuda_can_forget_counts():
    policy = LFUDA(keep_counts=False)
    table = SlotTable(1, policy)
    _use(table, "A")
    _use(table, "A")
    _use(table, "B")
    _use(table, "A")
    assert policy.count["A"] == 1 and policy.priority[table.where["A"]] == policy.age + 1


# The textbook reference string (Silberschatz, 3 frames): OPT 9 faults, LRU 12.
TEXTBOOK = [7, 0, 1, 2, 0, 3, 0, 4, 2, 3, 0, 3, 2, 1, 2, 0, 1, 7, 0, 1]


def test_belady_and_lru_on_the_textbook_string():
    ids = np.array(TEXTBOOK, dtype=np.uint8).reshape(-1, 1, 1)
    assert replay(ids, 3, "belady", record_bytes=1)["reads"] == 9
    assert replay(ids, 3, "lru", record_bytes=1)["reads"] == 12


def _optimal_misses(seq: list[int], n_slots: int) -> int:
    """Fewest misses over every possible eviction choice (exhaustive, tiny inputs only)."""
    @functools.lru_cache(maxsize=None)
    def best(i: int, cache: frozenset) -> int:
        if i == len(seq):
            return 0
        x = seq[i]
        if x in cache:
            return best(i + 1, cache)
        if len(cache) < n_slots:
            return 1 + best(i + 1, cache | {x})
        return 1 + min(best(i + 1, (cache - {v}) | {x}) for v in cache)
    return best(0, frozenset())


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=14), st.integers(1, 4))
def test_belady_is_optimal(seq, n_slots):
    ids = np.array(seq, dtype=np.uint8).reshape(-1, 1, 1)
    assert replay(ids, n_slots, "belady", record_bytes=1)["reads"] == _optimal_misses(seq, n_slots)


def test_belady_refuses_a_different_future():
    table = SlotTable(2, Belady(np.array([[0, 1], [0, 2]])))
    _use(table, (0, 1))
    with pytest.raises(CacheError, match="not the next access"):
        _use(table, (0, 3))


@pytest.mark.parametrize("name", ["lru", "lfuda"])
def test_pinned_and_loading_slots_are_never_evicted(name):
    table = SlotTable(2, make_policy(name))
    a, = _use(table, "a", load=False)   # still loading after its need is released
    _use(table, "b")
    c, = _use(table, "c")               # the only evictable slot is b's
    assert c != a and "a" in table.where and "b" not in table.where
    table.release()
    table.acquire("a")
    table.acquire("c")                  # both pinned (a also loading): nothing evictable
    with pytest.raises(CacheError, match="every slot is pinned or loading"):
        table.acquire("d")
    # a becomes evictable once it is loaded and released
    assert table.loaded(a, "a", table.generation[a])
    assert _victims(table, ["d"]) == ["a"]


def test_generations_name_each_fill():
    table = SlotTable(1, LRU())
    slot, = _use(table, "a", load=False)
    first = table.generation[slot]
    _use(table, "a", load=False)                   # still loading: pinned again, no new fill
    assert table.generation[slot] == first
    assert table.loaded(slot, "a", first)
    _use(table, "b", load=False)                   # evicts a: a new fill of the same slot
    assert table.generation[slot] == first + 1
    assert not table.loaded(slot, "a", first)      # the late message of the old fill
    assert not table.ready(slot)
    table.failed(slot, "b", first + 1)             # the read failed: the slot is free again
    assert table.key[slot] is None and table.free == [slot] and "b" not in table.where
    assert not table.loaded(slot, "b", first + 1)  # nor does a late success revive it
    _use(table, "a", load=False)                   # a again, in the same slot: generation + 2
    table.failed(slot, "a", first)                 # late messages about the first fill of a
    assert not table.loaded(slot, "a", first)
    assert table.where == {"a": slot} and not table.ready(slot)
    assert table.loaded(slot, "a", first + 2)


def test_registry_and_router_take_policy_names():
    assert policy_names() == ["lru", "lfuda", "belady", "predictive"]
    assert policy_names(online_only=True) == ["lru", "lfuda", "predictive"]
    with pytest.raises(CacheError, match="choices: lru, lfuda, belady, predictive"):
        make_policy("mru")
    with pytest.raises(RouterError, match="unknown cache policy 'mru'"):
        Router(4, "mru")
    router = Router(4, "lfuda")
    assert isinstance(router.policy, LFUDA) and router.stats()["policy"] == "lfuda"


@pytest.mark.parametrize("name", ["mru", "belady"])
def test_config_takes_only_online_policies(name):
    with pytest.raises(ConfigError, match=f"cache.policy '{name}' is not one of: lru, lfuda, predictive"):
        Config.from_dict({"cache": {"policy": name}})
    assert Config.from_dict({"cache": {"policy": "lfuda"}}).cache.policy == "lfuda"
    assert Config.from_dict({"cache": {"policy": "predictive"}}).cache.policy == "predictive"
