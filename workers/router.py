"""The router: owns the slot table, the cache policy and the read orders. It decides; the loader reads.

The slot bookkeeping and the policies live in runtime/cache.py; this is the message-facing side.

`Router` is plain logic with no sockets, so tests drive it in-process; `run_router_process`
wraps it with the data-plane socket that compute and the loader connect to.
"""
from __future__ import annotations

import time
from collections import Counter as Tally
from collections import deque

from deltafin.protocol import messages as M
from deltafin.runtime.cache import CacheError, Policy, SlotTable, make_policy
from deltafin.runtime.metrics import Counter, Latency
from deltafin.runtime.predictor import Prefetcher, RoutingPredictor


class RouterError(RuntimeError):
    pass


class Router:
    """Answers `need` from the slot table (runtime/cache.py), whose policy chooses the victims.

    `need` pins the slots of one layer's experts until the next `need` or `release`; pinned and
    loading slots are never chosen as victims. `policy` is a registered name (cache.policy) or a
    Policy instance (replay gives Belady its future that way).

    A routing predictor (runtime/predictor.py: the policy's own, or `predictor`) is told every
    `need`; with a `prefetcher`, `prefetch()` returns read orders for the keys it predicts.
    """

    def __init__(self, n_slots: int, policy: str | Policy = "lru", history: int = 4096,
                 predictor: RoutingPredictor | None = None, prefetcher: Prefetcher | None = None):
        if n_slots < 1:
            raise RouterError("the slot pool has no slots")
        try:
            policy = make_policy(policy) if isinstance(policy, str) else policy
        except CacheError as e:
            raise RouterError(str(e)) from None
        self.n_slots = n_slots
        self.policy = policy
        self.table = SlotTable(n_slots, policy)
        self.prefetcher = prefetcher
        # one predictor, fed here, serves the policy and the prefetcher alike
        found = {id(p): p for p in (predictor, getattr(policy, "predictor", None),
                                    prefetcher and prefetcher.predictor) if p is not None}
        if len(found) > 1:
            raise RouterError("the policy, the prefetcher and `predictor` must share one routing predictor")
        self.predictor = next(iter(found.values()), None)
        self.pending: dict | None = None
        self.counters = Counter()
        self.stall = Latency()  # per `need` that waited for reads: how long compute stalled
        # Routing history, the raw material of policies and predictors: how often each
        # (layer, expert) was needed, and the most recent requests in order.
        self.uses: Tally = Tally()
        self.recent: deque = deque(maxlen=history)

    # -- requests ---------------------------------------------------------------------------------
    def need(self, req: int, layer: int, experts: list[int]) -> tuple[list[M.Read], M.Slots | None]:
        """Pins the experts' slots; returns read orders and, if all are ready, the reply."""
        self.release()
        if self.predictor is not None:
            self.predictor.observe(layer, experts)
        self.recent.append((layer, tuple(experts)))
        self.uses.update([(layer, e) for e in experts])
        wanted = dict.fromkeys(experts)
        if len(wanted) > self.n_slots:
            raise RouterError(f"layer {layer} needs {len(wanted)} experts at once but the pool "
                              f"has {self.n_slots} slots")
        table = self.table
        reads, waiting, slots, hits = [], set(), [], 0
        for e in wanted:
            try:
                slot, new = table.acquire((layer, e))
            except CacheError as err:
                raise RouterError(str(err)) from None
            gen = table.generation[slot]
            if new:
                reads.append(M.Read(slot=slot, generation=gen, layer=layer, expert=e))
            if table.ready(slot):
                hits += 1
            else:
                waiting.add(slot)
            slots.append([e, slot, gen])
        self.counters.add("uses", len(slots))
        self.counters.add("hits", hits)
        self.counters.add("reads", len(reads))
        self.pending = {"req": req, "layer": layer, "slots": slots, "waiting": waiting,
                        "hits": hits, "t0": time.perf_counter()}
        return reads, (self._reply() if not waiting else None)

    def loaded(self, msg: M.Loaded) -> M.Slots | None:
        if not self.table.loaded(msg.slot, (msg.layer, msg.expert), msg.generation):
            return None  # a fill that was superseded; nothing waits for it
        self.counters.add("bytes_read", msg.nbytes)
        p = self.pending
        if p and msg.slot in p["waiting"]:
            p["waiting"].discard(msg.slot)
            if not p["waiting"]:
                return self._reply()
        return None

    def load_failed(self, msg: M.LoadFailed) -> M.Error | None:
        """Frees the slot; the waiting request fails with the loader's message."""
        self.table.failed(msg.slot, (msg.layer, msg.expert), msg.generation)
        p = self.pending
        if p and msg.slot in p["waiting"]:
            self.release()
            return M.Error(id=p["req"], code="expert_read_failed", message=msg.error)
        return None

    def release(self) -> None:
        self.table.release()
        self.pending = None

    def end_pass(self) -> None:
        """The forward pass is over (compute's `release`): unpins, and closes the predictor's pass."""
        self.release()
        if self.predictor is not None:
            self.predictor.end_pass()

    def prefetch(self) -> list[M.Read]:
        """Read orders for the keys the prefetcher predicts (after a `need`; none without one).
        Their slots stay unpinned; their `loaded` makes them evictable like any other."""
        if self.prefetcher is None:
            return []
        table, reads = self.table, []
        keys = self.prefetcher.plan(lambda key: key in table.where)
        for i, (layer, e) in enumerate(keys):
            slot = table.prefetch((layer, e))
            if slot is None:  # every slot is pinned or loading
                self.prefetcher.unissued(keys[i:])
                break
            reads.append(M.Read(slot=slot, generation=table.generation[slot], layer=layer, expert=e))
        return reads

    def hint(self, keys) -> None:
        """(layer, expert) keys predicted to be needed soon (gate lookahead from compute): to the
        policy, and to the routing predictor, which keeps them until their layer comes."""
        keys = list(keys)
        self.table.hint(keys)
        if self.predictor is not None:
            by_layer: dict[int, list[int]] = {}
            for layer, e in keys:
                by_layer.setdefault(layer, []).append(e)
            for layer, experts in by_layer.items():
                self.predictor.hint(layer, experts)

    # -- internals --------------------------------------------------------------------------------
    def _reply(self) -> M.Slots:
        p = self.pending
        wait_us = 0
        if p["hits"] < len(p["slots"]):
            wait = time.perf_counter() - p["t0"]
            self.stall.add(wait)
            wait_us = int(wait * 1e6)
        return M.Slots(req=p["req"], layer=p["layer"], slots=p["slots"], hits=p["hits"], wait_us=wait_us)

    def stats(self) -> dict:
        c = self.counters.snapshot()
        if self.table.evictions:
            c["evictions"] = self.table.evictions
        if self.table.prefetches:
            c.update(prefetch_reads=self.table.prefetches, prefetch_used=self.table.prefetch_used,
                     prefetch_wasted=self.table.prefetch_wasted)
        uses = c.get("uses", 0)
        return {**c, "n_slots": self.n_slots, "policy": self.policy.name, "resident": len(self.table.where),
                "hit_rate": (c.get("hits", 0) / uses) if uses else None,
                "distinct_experts_used": len(self.uses),
                "most_used": [[layer, e, n] for (layer, e), n in self.uses.most_common(8)],
                "stall": self.stall.summary(), "resident_experts": self.residency()}

    def residency(self) -> list:
        """[[layer, [expert, ...]], ...]: the experts holding a slot (ready or loading), by layer."""
        by_layer: dict[int, list[int]] = {}
        for layer, e in self.table.where:
            by_layer.setdefault(layer, []).append(e)
        return [[layer, sorted(es)] for layer, es in sorted(by_layer.items())]


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
                self.router.end_pass()
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
