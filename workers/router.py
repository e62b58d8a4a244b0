"""The router: owns the slot table, the cache policy and the read orders. It decides; the loader reads.

`Router` is plain logic with no sockets, so tests drive it in-process; `run_router_process`
wraps it with the data-plane socket that compute and the loader connect to.
"""
from __future__ import annotations

import time
from collections import Counter as Tally
from collections import OrderedDict, deque

from deltafin.protocol import messages as M
from deltafin.runtime.metrics import Counter


class RouterError(RuntimeError):
    pass


class Router:
    """Slot table (single writer) with LRU replacement.

    A slot is free, loading or ready. `need` pins the slots of one layer's experts until the
    next `need` or `release`; pinned and loading slots are never chosen as victims.
    """

    def __init__(self, n_slots: int, policy: str = "lru", history: int = 4096):
        if n_slots < 1:
            raise RouterError("the slot pool has no slots")
        self.n_slots = n_slots
        self.where: dict[tuple, int] = {}             # (layer, expert) -> slot
        self.key: list[tuple | None] = [None] * n_slots
        self.generation = [0] * n_slots
        self.ready = [False] * n_slots
        self.lru: OrderedDict[int, None] = OrderedDict()  # ready, evictable slots, oldest first
        self.free = list(range(n_slots - 1, -1, -1))
        self.pinned: set[int] = set()
        self.pending: dict | None = None
        self.counters = Counter()
        # Routing history, the raw material of policies and predictors: how often each
        # (layer, expert) was needed, and the most recent requests in order.
        self.uses: Tally = Tally()
        self.recent: deque = deque(maxlen=history)

    # -- requests ---------------------------------------------------------------------------------
    def need(self, req: int, layer: int, experts: list[int]) -> tuple[list[M.Read], M.Slots | None]:
        """Pins the experts' slots; returns read orders and, if all are ready, the reply."""
        self.release()
        self.recent.append((layer, tuple(experts)))
        self.uses.update((layer, e) for e in experts)
        if len(set(experts)) > self.n_slots:
            raise RouterError(f"layer {layer} needs {len(set(experts))} experts at once but the pool "
                              f"has {self.n_slots} slots")
        reads, waiting, slots, hits = [], set(), [], 0
        for e in dict.fromkeys(experts):
            key = (layer, e)
            slot = self.where.get(key)
            if slot is None:
                slot = self._victim()
                self._assign(slot, key)
                reads.append(M.Read(slot=slot, generation=self.generation[slot], layer=layer, expert=e))
            if self.ready[slot]:
                hits += 1
                self.lru.pop(slot, None)
            else:
                waiting.add(slot)
            self.pinned.add(slot)
            slots.append([e, slot, self.generation[slot]])
        self.counters.add("uses", len(slots))
        self.counters.add("hits", hits)
        self.counters.add("reads", len(reads))
        self.pending = {"req": req, "layer": layer, "slots": slots, "waiting": waiting,
                        "hits": hits, "t0": time.perf_counter()}
        return reads, (self._reply() if not waiting else None)

    def loaded(self, msg: M.Loaded) -> M.Slots | None:
        if self.key[msg.slot] != (msg.layer, msg.expert) or self.generation[msg.slot] != msg.generation:
            return None  # a fill that was superseded; nothing waits for it
        self.ready[msg.slot] = True
        self.counters.add("bytes_read", msg.nbytes)
        if msg.slot not in self.pinned:
            self.lru[msg.slot] = None
        p = self.pending
        if p and msg.slot in p["waiting"]:
            p["waiting"].discard(msg.slot)
            if not p["waiting"]:
                return self._reply()
        return None

    def load_failed(self, msg: M.LoadFailed) -> M.Error | None:
        """Frees the slot; the waiting request fails with the loader's message."""
        if self.key[msg.slot] == (msg.layer, msg.expert):
            self._forget(msg.slot)
            self.free.append(msg.slot)
        p = self.pending
        if p and msg.slot in p["waiting"]:
            self.pending = None
            self.pinned.clear()
            return M.Error(id=p["req"], code="expert_read_failed", message=msg.error)
        return None

    def release(self) -> None:
        for slot in self.pinned:
            if self.ready[slot]:
                self.lru[slot] = None
        self.pinned.clear()
        self.pending = None

    # -- internals --------------------------------------------------------------------------------
    def _reply(self) -> M.Slots:
        p = self.pending
        wait_us = int((time.perf_counter() - p["t0"]) * 1e6) if p["hits"] < len(p["slots"]) else 0
        return M.Slots(req=p["req"], layer=p["layer"], slots=p["slots"], hits=p["hits"], wait_us=wait_us)

    def _victim(self) -> int:
        if self.free:
            return self.free.pop()
        if not self.lru:
            raise RouterError("every slot is pinned or loading; the pool is too small for one layer")
        slot, _ = self.lru.popitem(last=False)
        self.counters.add("evictions", 1)
        self._forget(slot)
        return slot

    def _forget(self, slot: int) -> None:
        key = self.key[slot]
        if key is not None and self.where.get(key) == slot:
            del self.where[key]
        self.key[slot] = None
        self.ready[slot] = False
        self.lru.pop(slot, None)

    def _assign(self, slot: int, key: tuple) -> None:
        self.key[slot] = key
        self.where[key] = slot
        self.generation[slot] += 1
        self.ready[slot] = False

    def stats(self) -> dict:
        c = self.counters.snapshot()
        uses = c.get("uses", 0)
        return {**c, "n_slots": self.n_slots, "resident": len(self.where),
                "hit_rate": (c.get("hits", 0) / uses) if uses else None,
                "distinct_experts_used": len(self.uses),
                "most_used": [[layer, e, n] for (layer, e), n in self.uses.most_common(8)]}


def run_router_process(run_dir: str) -> None:
    import zmq

    from deltafin.runtime.sockets import make_socket, recv, send
    from deltafin.workers.common import WorkerProcess

    class RouterProcess(WorkerProcess):
        role = "router"

        def setup(self):
            self.data = make_socket(self.ctx, zmq.ROUTER)
            self.data.bind(self.run["endpoints"]["data"])
            self.poller.register(self.data, zmq.POLLIN)
            self.router: Router | None = None

        def on_pool(self, msg: M.AttachPool):
            self.router = Router(msg.n_slots, self.config["cache"]["policy"])

        def on_socket(self, sock):
            sender, msg = recv(self.data, routed=True)
            out: list[tuple[bytes, object]] = []
            if isinstance(msg, M.PeerHello):
                out.append((sender, M.PeerHello(role="router")))
            elif isinstance(msg, M.Need):
                try:
                    reads, reply = self.router.need(msg.req, msg.layer, msg.experts)
                except RouterError as e:
                    out.append((sender, M.Error(id=msg.req, code="budget_too_small", message=str(e))))
                else:
                    out += [(b"loader", r) for r in reads]
                    if reply:
                        out.append((b"compute", reply))
            elif isinstance(msg, M.Loaded):
                reply = self.router.loaded(msg)
                if reply:
                    out.append((b"compute", reply))
            elif isinstance(msg, M.LoadFailed):
                err = self.router.load_failed(msg)
                if err:
                    out.append((b"compute", err))
            elif isinstance(msg, M.Release):
                self.router.release()
            else:
                out.append((sender, M.Error(id=None, code="bad_message",
                                            message=f"router does not take {msg.TYPE}")))
            for to, m in out:
                send(self.data, m, to=to)

        def stats(self):
            return self.router.stats() if self.router else {}

    RouterProcess(run_dir).serve()


if __name__ == "__main__":
    import sys
    run_router_process(sys.argv[1])
