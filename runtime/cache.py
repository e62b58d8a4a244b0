"""The expert cache: slot bookkeeping (`SlotTable`) apart from the replacement decision (`Policy`).

One global budget: every slot can hold any (layer, expert), so layers compete for the whole pool
(a fixed per-layer split measured ~30% worse elsewhere, docs/ARCHITECTURE.md).

A slot is free, loading or ready. The slots of the experts being used now are pinned. A policy
sees only the events of the table and chooses victims among the *evictable* slots: ready and
unpinned. `SlotTable` is the only caller of a policy, so what a policy believes evictable is
exactly what the table says it is.

Policies are registered by name in `POLICIES`. Online policies may run in the router
(`cache.policy`); offline ones (`belady`) need the future and exist for replay only.
"""
from __future__ import annotations

import heapq
from array import array
from collections import OrderedDict
from enum import Enum
from typing import Hashable, Iterable

import numpy as np

Key = Hashable  # (layer, expert) in the router


class CacheError(RuntimeError):
    pass


class SlotState(Enum):
    FREE = 0
    LOADING = 1
    READY = 2


# -- policies -------------------------------------------------------------------------------------
class Policy:
    """Replacement decision. Told of every access and of every slot that becomes evictable or
    loses its key; asked for a victim among the evictable slots.

    Event order for one slot: on_insert, then on_release each time it becomes ready and unpinned,
    on_hit each time it is used again (pinned, so no longer evictable), and finally on_evict
    (after `victim` chose it, or when its read failed).
    """

    name = ""
    online = True  # False: needs the future; replay only, refused by the configuration

    def on_insert(self, slot: int, key: Key) -> None:
        """A miss: key is being loaded into slot (pinned until released)."""

    def on_hit(self, slot: int, key: Key) -> None:
        """key, resident in slot, is used again; the slot is pinned, so not evictable now."""

    def on_release(self, slot: int, key: Key) -> None:
        """The slot became evictable: ready and unpinned."""

    def on_evict(self, slot: int, key: Key) -> None:
        """key leaves slot (chosen by `victim`, or its read failed)."""

    def on_hint(self, keys: Iterable[Key]) -> None:
        """Keys predicted to be needed soon (lookahead, routing history). Room for a
        prediction-aware policy; the policies here ignore hints."""

    def victim(self) -> int | None:
        """Removes and returns the evictable slot to reuse, or None when no slot is evictable."""
        raise NotImplementedError


class LRU(Policy):
    """Least recently used: the slot released longest ago goes first."""

    name = "lru"

    def __init__(self):
        self.order: OrderedDict[int, None] = OrderedDict()  # evictable slots, oldest first

    def on_hit(self, slot, key):
        self.order.pop(slot, None)

    def on_release(self, slot, key):
        self.order[slot] = None
        self.order.move_to_end(slot)

    def on_evict(self, slot, key):
        self.order.pop(slot, None)

    def victim(self):
        if not self.order:
            return None
        return self.order.popitem(last=False)[0]


class _MinHeap:
    """Evictable slots by priority, smallest first; entries of slots that left are skipped lazily
    (a stamp per slot), so every operation is O(log n)."""

    def __init__(self):
        self.heap: list[tuple] = []
        self.stamp: dict[int, int] = {}  # slot -> stamp of its live entry
        self.seq = 0

    def push(self, slot: int, priority) -> None:
        self.seq += 1
        self.stamp[slot] = self.seq
        heapq.heappush(self.heap, (priority, self.seq, slot))

    def discard(self, slot: int) -> None:
        self.stamp.pop(slot, None)

    def pop(self) -> tuple[int, object] | None:
        while self.heap:
            priority, seq, slot = heapq.heappop(self.heap)
            if self.stamp.get(slot) == seq:
                del self.stamp[slot]
                return slot, priority
        return None

    def __len__(self):
        return len(self.stamp)


class LFUDA(Policy):
    """LFU with dynamic aging (Arlitt et al.): priority = L + uses of the key, where L is the
    priority of the last victim, so old popularity fades instead of pinning the cache forever.

    Use counts are kept when a key is evicted (keep_counts=True): on the DeepSeek-V2-Lite dev trace
    at 25% of the experts this gave 0.456 hit rate against 0.310 when counts were forgotten
    (LRU: 0.446). Ties go to the slot released first (LRU order).
    """

    name = "lfuda"

    def __init__(self, keep_counts: bool = True):
        self.keep_counts = keep_counts
        self.age = 0.0
        self.count: dict[Key, int] = {}
        self.priority: dict[int, float] = {}  # slot -> priority at its last access
        self.heap = _MinHeap()

    def _access(self, slot, key):
        n = self.count.get(key, 0) + 1
        self.count[key] = n
        self.priority[slot] = self.age + n
        self.heap.discard(slot)

    on_insert = _access
    on_hit = _access

    def on_release(self, slot, key):
        self.heap.push(slot, self.priority[slot])

    def on_evict(self, slot, key):
        self.heap.discard(slot)
        self.priority.pop(slot, None)
        if not self.keep_counts:
            self.count.pop(key, None)

    def victim(self):
        got = self.heap.pop()
        if got is None:
            return None
        slot, self.age = got
        return slot


class Belady(Policy):
    """Belady's MIN, the offline optimum: evict the key whose next use is farthest away.

    Given the whole future access sequence (`future`: int array [uses, 2] of (layer, expert), in
    the order the table will see them), it checks every access against it. No bypass: a missed key
    is always inserted, as the runtime must load it to compute. The keys of the current `need` stay
    pinned, so this is the optimum under the runtime's constraint (a hair below unconstrained
    per-use Belady: 0.487 against 0.490 on the dev trace at 10%). Replay only.
    """

    name = "belady"
    online = False

    def __init__(self, future):
        future = np.asarray(future)
        if future.ndim != 2 or future.shape[1] != 2:
            raise CacheError("belady needs the future as an int array [uses, 2] of (layer, expert)")
        if len(future) >= 2**31:
            raise CacheError("belady: more than 2**31 accesses")
        self.stride = int(future[:, 1].max()) + 1 if len(future) else 1
        codes = future[:, 0].astype(np.int32) * self.stride + future[:, 1].astype(np.int32)
        n = len(codes)
        # next_use[i]: the next position of the key used at i (n when never again)
        order = np.argsort(codes, kind="stable")
        nxt = np.full(n, n, dtype=np.int32)
        same = codes[order[1:]] == codes[order[:-1]]
        nxt[order[:-1][same]] = order[1:][same]
        del order, same
        # array.array: 4 bytes an entry (a list of ints costs ~10x more), and indexing it is
        # much faster than indexing numpy one element at a time
        self.codes = array("i", codes.tobytes())
        self.next_use = array("i", nxt.tobytes())
        self.pos = 0
        self.slot_next: dict[int, int] = {}
        self.heap = _MinHeap()

    def _access(self, slot, key):
        i = self.pos
        if i >= len(self.codes) or key[0] * self.stride + key[1] != self.codes[i]:
            raise CacheError(f"belady: access {i} is {key}, not the next access of the given future")
        self.pos = i + 1
        self.slot_next[slot] = self.next_use[i]
        self.heap.discard(slot)

    on_insert = _access
    on_hit = _access

    def on_release(self, slot, key):
        self.heap.push(slot, -self.slot_next[slot])  # farthest next use on top

    def on_evict(self, slot, key):
        self.heap.discard(slot)
        self.slot_next.pop(slot, None)

    def victim(self):
        got = self.heap.pop()
        return None if got is None else got[0]


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (LRU, LFUDA, Belady)}


def policy_names(online_only: bool = False) -> list[str]:
    return [name for name, cls in POLICIES.items() if cls.online or not online_only]


def make_policy(name: str, **kw) -> Policy:
    cls = POLICIES.get(name)
    if cls is None:
        raise CacheError(f"unknown cache policy {name!r}; choices: {', '.join(policy_names())}")
    return cls(**kw)


# -- slot table -----------------------------------------------------------------------------------
class SlotTable:
    """Which key each slot holds, its generation, its state and its pins; the single writer.

    A generation names one fill of a slot: it grows each time the slot gets a new key, so a late
    `loaded` for an earlier fill is recognized and ignored.
    """

    def __init__(self, n_slots: int, policy: Policy):
        if n_slots < 1:
            raise CacheError("the slot pool has no slots")
        self.n_slots = n_slots
        self.policy = policy
        self.where: dict[Key, int] = {}
        self.key: list[Key | None] = [None] * n_slots
        self.generation = [0] * n_slots
        self.state = [SlotState.FREE] * n_slots
        self.free = list(range(n_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self.pinned: dict[int, None] = {}  # insertion-ordered: released in the order used
        self.evictions = 0

    def ready(self, slot: int) -> bool:
        return self.state[slot] is SlotState.READY

    def acquire(self, key: Key) -> tuple[int, bool]:
        """Pins key's slot, choosing and filling a new one on a miss. Returns (slot, new)."""
        slot = self.where.get(key)
        if slot is not None:
            self.policy.on_hit(slot, key)
            self.pinned[slot] = None
            return slot, False
        if self.free:
            slot = self.free.pop()
        else:
            slot = self.policy.victim()
            if slot is None:
                raise CacheError("every slot is pinned or loading; the pool is too small for one layer")
            self.evictions += 1
            self._forget(slot)
        self.key[slot] = key
        self.where[key] = slot
        self.generation[slot] += 1
        self.state[slot] = SlotState.LOADING
        self.policy.on_insert(slot, key)
        self.pinned[slot] = None
        return slot, True

    def use(self, key: Key) -> bool:
        """A use of a ready key that needed no acquire (compute found it resident and reported it
        afterwards): the policy sees a hit; an unpinned slot stays evictable. False if key is not
        ready here (nothing is recorded)."""
        slot = self.where.get(key)
        if slot is None or not self.ready(slot):
            return False
        self.policy.on_hit(slot, key)
        if slot not in self.pinned:
            self.policy.on_release(slot, key)
        return True

    def loaded(self, slot: int, key: Key, generation: int) -> bool:
        """Marks the fill ready; False for a fill that was superseded."""
        if self.key[slot] != key or self.generation[slot] != generation or self.ready(slot):
            return False
        self.state[slot] = SlotState.READY
        if slot not in self.pinned:
            self.policy.on_release(slot, key)
        return True

    def failed(self, slot: int, key: Key, generation: int) -> None:
        """The read of key into slot failed: the slot goes back to the free list."""
        if self.key[slot] == key and self.generation[slot] == generation and not self.ready(slot):
            self.pinned.pop(slot, None)
            self._forget(slot)
            self.free.append(slot)

    def release(self) -> None:
        """Unpins every slot; ready ones become evictable (loading ones when they are loaded)."""
        for slot in self.pinned:
            if self.state[slot] is SlotState.READY:
                self.policy.on_release(slot, self.key[slot])
        self.pinned.clear()

    def hint(self, keys: Iterable[Key]) -> None:
        self.policy.on_hint(keys)

    def _forget(self, slot: int) -> None:
        key = self.key[slot]
        self.policy.on_evict(slot, key)
        del self.where[key]
        self.key[slot] = None
        self.state[slot] = SlotState.FREE
