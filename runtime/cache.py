"""The expert cache: slot bookkeeping (`SlotTable`) apart from the replacement decision (`Policy`).

One global budget: every slot can hold any (layer, expert), so layers compete for the whole pool
(a fixed per-layer split measured ~30% worse elsewhere, docs/ARCHITECTURE.md).

A slot is free, loading or ready. The slots of the experts being used now, and the fills a
lease asked for until it is released, are pinned (counted per holder). A policy
sees only the events of the table and chooses victims among the *evictable* slots: ready and
unpinned. `SlotTable` is the only caller of a policy, so what a policy believes evictable is
exactly what the table says it is.

Policies are registered by name in `POLICIES`. Online policies may run in the router
(`cache.policy`); offline ones (`belady`) need the future and exist for replay only.
`predictive` reads the router's routing predictor (runtime/predictor.py).

The table can also fill a slot ahead of need (`SlotTable.prefetch`): unpinned, evictable once
loaded, and counted (used before its eviction, found ready when used, or evicted unused).
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

    def unvictim(self, slot: int, key: Key) -> None:
        """The slot `victim` just returned is kept after all (a prefetch found it worth more than
        what it would read): evictable again. By default as if just released; policies whose
        order matters override it to put the slot back where it was."""
        self.on_release(slot, key)


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

    def unvictim(self, slot, key):
        self.order[slot] = None
        self.order.move_to_end(slot, last=False)  # first in line again, as it was


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
        self.aged: tuple = (0.0, None)  # (age before, slot) of the last victim, for unvictim

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
        slot, age = got
        self.aged = (self.age, slot)  # what unvictim undoes
        self.age = age
        return slot

    def unvictim(self, slot, key):
        if self.aged[1] == slot:
            self.age = self.aged[0]
        self.heap.push(slot, self.priority[slot])


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


class Predictive(Policy):
    """Keeps what the routing predictor (runtime/predictor.py) says the next layers will use.

    rank="probability" (the default): the victim is the evictable key least likely to be used at
    its layer's next occurrence (`RoutingPredictor.q`: neighbours' votes for the layers ahead in
    this pass, age and distance for all), weighted by what its miss would cost
    (`RoutingPredictor.miss_weights`: more where no gate lookahead foresees the layer; off with
    weigh_misses=False), ties to the slot released first. A prefetched key that
    was not used when its layer came keeps its old age and has no votes left, so it goes early.
    rank="recency": least recently *used* first (a prefetched key never used is the oldest), but
    keys given at least `keep` within the next `keep_depth` layers go last. Measured with prefetch
    on the DeepSeek-V2-Lite traces: probability is better at 25% and 50% of the experts, recency at
    10%, where a cache holds about one pass (docs/TRACES.md).

    Keys are (layer, expert) with the router's layer ids; `layer_index` maps a layer id to the
    predictor's row (MoE layers numbered from 0; None: the same). The router owns and feeds the
    predictor (workers/router.py); this class only reads it.
    """

    name = "predictive"
    RANKS = ("probability", "recency")

    def __init__(self, predictor=None, layer_index=None, rank: str = "probability", keep: float = 0.4,
                 keep_depth: int = 2, weigh_misses: bool = True):
        if predictor is None:
            raise CacheError("the predictive policy reads a routing predictor: the router makes one "
                             "from the store's shape (Router(..., moe_layers=..., n_experts=...))")
        if rank not in self.RANKS:
            raise CacheError(f"predictive rank {rank!r} is not one of: {', '.join(self.RANKS)}")
        self.predictor = predictor
        self.rank, self.keep, self.keep_depth = rank, keep, keep_depth
        self.weigh_misses = weigh_misses
        self.n_experts = predictor.n_experts
        rows = np.arange(predictor.n_layers) if layer_index is None else None
        if layer_index is not None:
            rows = np.full(max(layer_index) + 1, -1, dtype=np.int64)
            for layer, row in layer_index.items():
                rows[layer] = row
        self.row_of = rows
        # per slot, grown on demand: its key's code (row * n_experts + expert), whether it is
        # evictable, and when it was last released (ties go to the slot released first)
        self.code = np.zeros(0, dtype=np.int64)
        self.evictable = np.zeros(0, dtype=bool)
        self.released = np.zeros(0, dtype=np.int64)
        self.n_evictable = 0
        self.seq = 0
        self.ranked: list[int] = []   # evictable slots in eviction order, for one predictor state
        self.next = 0
        self.version = -1

    def _grow(self, slot: int) -> None:
        n = max(2 * len(self.code), slot + 1, 64)
        for name in ("code", "evictable", "released"):
            old = getattr(self, name)
            new = np.zeros(n, dtype=old.dtype)
            new[:len(old)] = old
            setattr(self, name, new)

    def _drop(self, slot: int) -> None:
        if slot < len(self.evictable) and self.evictable[slot]:
            self.evictable[slot] = False
            self.n_evictable -= 1

    def on_hit(self, slot, key):
        self._drop(slot)

    def on_release(self, slot, key):
        if slot >= len(self.code):
            self._grow(slot)
        if not self.evictable[slot]:
            self.evictable[slot] = True
            self.n_evictable += 1
        self.code[slot] = self.row_of[key[0]] * self.n_experts + key[1]
        self.seq += 1
        self.released[slot] = self.seq
        self.version = -1  # a new candidate: rank again

    def on_evict(self, slot, key):
        self._drop(slot)

    def unvictim(self, slot, key):
        self.evictable[slot] = True  # its code and release stamp are still there
        self.n_evictable += 1
        self.version = -1

    def _order(self, slots: np.ndarray) -> np.ndarray:
        """The eviction order of `slots`, first victim first."""
        p = self.predictor
        codes = self.code[slots]
        q = p.q.reshape(-1)[codes]
        row = codes // self.n_experts
        if self.rank == "probability":
            weights = p.miss_weights() if self.weigh_misses else None
            if weights is not None:  # expected cost of a miss: probability x what it costs
                q = q * weights[row]
            return slots[np.lexsort((self.released[slots], q))]
        used_at = p.last_use.reshape(-1)[codes] * p.n_layers + row  # in steps of the need stream
        kept = (q >= self.keep) & (p.distances()[row] <= self.keep_depth)
        return slots[np.lexsort((self.released[slots], used_at, kept))]

    def victim(self):
        if self.n_evictable == 0:
            return None
        if self.version != self.predictor.version:
            # one ranking per predictor state: the victims of one need come from one sort
            self.ranked = self._order(np.flatnonzero(self.evictable)).tolist()
            self.next = 0
            self.version = self.predictor.version
        evictable = self.evictable
        while self.next < len(self.ranked):
            slot = self.ranked[self.next]
            self.next += 1
            if evictable[slot]:  # slots hit or evicted since the ranking are skipped
                evictable[slot] = False
                self.n_evictable -= 1
                return slot
        self.version = -1  # every ranked slot is gone: rank what is evictable now
        return self.victim()


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (LRU, LFUDA, Belady, Predictive)}


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
        # slot -> how many holders pin it (a need, leases); insertion-ordered: released in the
        # order used
        self.pinned: dict[int, int] = {}
        self.evictions = 0
        # slots filled by `prefetch` and not used yet; how prefetched fills ended: used before
        # their eviction (of which ready when used: a miss avoided), or evicted unused
        self.prefetched: set[int] = set()
        self.prefetches = self.prefetch_used = self.prefetch_hits = self.prefetch_wasted = 0
        # the same for fills a lease asked for (`prefetch(..., lease=True)`)
        self.leased: set[int] = set()
        self.leases = self.lease_used = self.lease_hits = self.lease_wasted = 0

    def ready(self, slot: int) -> bool:
        return self.state[slot] is SlotState.READY

    def acquire(self, key: Key) -> tuple[int, bool]:
        """Pins key's slot, choosing and filling a new one on a miss. Returns (slot, new)."""
        slot = self.where.get(key)
        if slot is not None:
            self._prefetch_used(slot)
            self.policy.on_hit(slot, key)
            self._pin(slot)
            return slot, False
        if self.free:
            slot = self.free.pop()
        else:
            slot = self.policy.victim()
            if slot is None:
                # a prefetch (or a released lease) still being read gives its slot up to a need,
                # so reading ahead never leaves a need short of slots; its late `loaded` is then a
                # superseded fill
                slot = next((s for s in (*self.prefetched, *self.leased)
                             if not self.ready(s) and s not in self.pinned), None)
                if slot is None:
                    raise CacheError("every slot is pinned or loading; the pool is too small for one layer")
            self.evictions += 1
            self._forget(slot)
        self._fill(slot, key)
        self._pin(slot)
        return slot, True

    def hold(self, key: Key) -> int | None:
        """Pins key's slot (ready or loading) without a use: a lease holds it. None if key
        holds no slot."""
        slot = self.where.get(key)
        if slot is not None:
            self.policy.on_hit(slot, key)  # out of the evictable order while pinned
            self._pin(slot)
        return slot

    def _pin(self, slot: int) -> None:
        self.pinned[slot] = self.pinned.get(slot, 0) + 1

    def unpin(self, slots: Iterable[tuple[int, int]]) -> None:
        """Drops one holder's pins, (slot, generation) as it took them: a slot no one pins any
        more becomes evictable (when ready). A pin of an earlier fill (the read failed and the
        slot was filled again since) is not this holder's: left alone."""
        for slot, gen in slots:
            n = self.pinned.get(slot)
            if n is None or self.generation[slot] != gen:
                continue
            if n > 1:
                self.pinned[slot] = n - 1
                continue
            del self.pinned[slot]
            if self.state[slot] is SlotState.READY:
                self.policy.on_release(slot, self.key[slot])

    def prefetch(self, key: Key, keep=None, lease: bool = False) -> int | None:
        """Starts filling a slot with key ahead of need, unpinned (evictable once loaded): a free
        slot, else the policy's victim unless `keep(victim's key)` says it is worth more than key
        (then it stays and nothing is filled). None when key holds a slot already or no slot is
        taken. A later use of key counts the prefetch as used; its eviction before that, wasted.
        lease: asked for by compute ahead of its layer (`Router.lease`): pinned until the lease
        is released (`unpin`), and counted apart from the router's own prefetch."""
        if key in self.where:
            return None
        if self.free:
            slot = self.free.pop()
        else:
            slot = self.policy.victim()
            if slot is None:
                return None
            if keep is not None and keep(self.key[slot]):
                self.policy.unvictim(slot, self.key[slot])
                return None
            self.evictions += 1
            self._forget(slot)
        self._fill(slot, key)
        if lease:
            self._pin(slot)
            self.leased.add(slot)
            self.leases += 1
        else:
            self.prefetched.add(slot)
            self.prefetches += 1
        return slot

    def _fill(self, slot: int, key: Key) -> None:
        self.key[slot] = key
        self.where[key] = slot
        self.generation[slot] += 1
        self.state[slot] = SlotState.LOADING
        self.policy.on_insert(slot, key)

    def _prefetch_used(self, slot: int) -> None:
        if slot in self.prefetched:
            self.prefetched.discard(slot)
            self.prefetch_used += 1
            self.prefetch_hits += self.ready(slot)
        elif slot in self.leased:
            self.leased.discard(slot)
            self.lease_used += 1
            self.lease_hits += self.ready(slot)

    def use(self, key: Key) -> bool:
        """A use of a ready key that needed no acquire (compute found it resident and reported it
        afterwards): the policy sees a hit; an unpinned slot stays evictable. False if key is not
        ready here (nothing is recorded)."""
        slot = self.where.get(key)
        if slot is None or not self.ready(slot):
            return False
        self._prefetch_used(slot)
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

    def failed(self, slot: int, key: Key, generation: int) -> bool:
        """The read of key into slot failed: the slot goes back to the free list. False for a
        fill that was superseded (the slot holds another fill now; nothing changes)."""
        if self.key[slot] == key and self.generation[slot] == generation and not self.ready(slot):
            self.pinned.pop(slot, None)
            self._forget(slot)
            self.free.append(slot)
            return True
        return False

    def release(self) -> None:
        """Unpins every slot; ready ones become evictable (loading ones when they are loaded)."""
        for slot in self.pinned:
            if self.state[slot] is SlotState.READY:
                self.policy.on_release(slot, self.key[slot])
        self.pinned.clear()

    def hint(self, keys: Iterable[Key]) -> None:
        self.policy.on_hint(keys)

    def _forget(self, slot: int) -> None:
        if slot in self.prefetched:
            self.prefetched.discard(slot)
            self.prefetch_wasted += 1
        elif slot in self.leased:
            self.leased.discard(slot)
            self.lease_wasted += 1
        key = self.key[slot]
        self.policy.on_evict(slot, key)
        del self.where[key]
        self.key[slot] = None
        self.state[slot] = SlotState.FREE
