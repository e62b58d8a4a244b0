"""The router role as a process: the `Router` of a store built from the typed configuration
(`prefetch_setting`, `router_for`, also what in-process tools build) and `RouterProcess`, which
serves it on the data-plane ROUTER socket, one handler per message type (`HANDLERS`).
"""
from __future__ import annotations

import time

import zmq

from deltafin.protocol import messages as M
from deltafin.runtime.config import CacheConfig
from deltafin.runtime.metrics import Latency
from deltafin.runtime.sockets import make_socket, recv, send
from deltafin.workers.common import WorkerProcess
from deltafin.workers.router import Router, RouterError


def prefetch_setting(cache: CacheConfig, n_slots: int, n_keys: int) -> bool | dict:
    """The router's `prefetch` from the config's cache section: cache.prefetch true, false or
    "auto" (on with the predictive policy when the resident slots cannot hold every expert: with
    room for all, preload reads them and there is nothing to predict), cache.prefetch_threshold,
    prefetch_depth. The prefetcher always gates itself (docs/BENCHMARKS.md, settled questions)."""
    on = cache.prefetch
    if on == "auto":
        on = cache.policy == "predictive" and n_slots < n_keys
    if not on:
        return False
    return {"threshold": cache.prefetch_threshold, "depth": int(cache.prefetch_depth),
            "gate": True,
            "bandwidth": True}  # the runtime's router has a clock (in-process replay has none)


def router_for(store, cache: CacheConfig, resident: dict, n_staging: int) -> Router:
    """The router of a store from the config's [cache] section, resident slots per record-layout
    group and staging slots: what the router process and in-process tools both build."""
    from deltafin.runtime.tiers import layer_groups
    policy = cache.policy
    n_keys = len(store.moe_layers) * store.n_experts
    if sum(resident.values()) >= n_keys:
        # Every expert fits: nothing is ever evicted or prefetched, so no policy needs the
        # predictor's bookkeeping on every use; LRU's is the cheapest.
        policy = "lru"
    router = Router(resident, policy, n_staging=n_staging, groups=layer_groups(store, resident),
                    moe_layers=store.moe_layers, n_experts=store.n_experts,
                    prefetch=prefetch_setting(cache, sum(resident.values()), n_keys),
                    policy_options={"weigh_misses": cache.weigh_misses} if policy == "predictive" else None)
    if cache.routing_history and router.predictor is not None:
        router.learn_history(cache.routing_history, int(cache.history_tokens))
    return router


class RouterProcess(WorkerProcess):
    """The router's worker: answers compute's and the loader's messages on the data plane. Each
    handler returns what to send, [(destination, message)]."""

    role = "router"

    def setup(self):
        self.data = make_socket(self.ctx, zmq.ROUTER)
        self.data.bind(self.run["endpoints"]["data"])
        self.poller.register(self.data, zmq.POLLIN)
        self.router: Router | None = None
        self.handled = Handled()

    def on_pool(self, msg: M.AttachPool):
        from deltafin.runtime.store import Store
        self.router = router_for(Store(self.run["store"]), self.config.cache, msg.resident, msg.n_slots)
        self.router.defer_prefetch = self.config.bench.defer_prefetch
        self.router.lazy_history = self.config.bench.fold_notes
        if self.config.bench.ahead_reads:
            self.router.ahead_cap = min(self.router.ahead_cap, self.config.bench.ahead_reads)

    def idle(self):
        """With nothing waiting, the predictor catches up with the uses and needs it was spared
        while a need's reads went out (`Router.lazy_history`): one observation per loop turn
        (busy meanwhile), so a need that arrives waits for one at most, not for the backlog."""
        if self.router is not None and self.router.behind() and not self.data.poll(0):
            self.router.catch_up(1)

    def busy(self) -> bool:
        return self.router is not None and self.router.behind()

    def on_socket(self, sock):
        sender, msg = recv(self.data, routed=True)
        handler = self.HANDLERS.get(type(msg))
        if handler is None:
            send(self.data, M.Error(id=None, code=M.ErrorCode.BAD_MESSAGE,
                                    message=f"router does not take {msg.TYPE}"), to=sender)
            return
        for part in M.unfold(msg):  # a need and its leases, or fills acknowledged together
            self.handle(handler, sender, part)

    def handle(self, handler, sender: bytes, msg) -> None:
        """One message: its handler's answers and read orders sent, then the prefetch planned
        after them; its time counted (`Handled`)."""
        t0 = time.perf_counter()
        try:
            out = handler(self, sender, msg)
        except RouterError as e:
            out = [("compute", M.Error(id=getattr(msg, "req", None), code=e.code, message=str(e)))]
        for to, m in out:
            send(self.data, m, to=to.encode())
        t_out = time.perf_counter()
        if self.router is not None:  # the prefetch planned after an answer, once it is sent
            for to, m in self.router.deferred():
                send(self.data, m, to=to.encode())
        self.handled.add("lease" if getattr(msg, "lease", False) else msg.TYPE, time.perf_counter() - t0,
                         t_out - t0)

    def on_hello(self, sender: bytes, msg: M.PeerHello) -> list:
        send(self.data, M.PeerHello(role="router"), to=sender)
        return []

    def on_need(self, sender: bytes, msg: M.Need) -> list:
        self.router.notes(layer_lists(msg.hints or [], "hints"), layer_lists(msg.uses or [], "uses"))
        return self.router.need(msg.req, msg.layer, msg.experts, msg.prefetch, msg.lease, msg.sure,
                                msg.early)

    def on_used(self, sender: bytes, msg: M.Used) -> list:
        self.router.used(layer_lists(msg.uses, "uses"))
        return self.router.prefetch_ahead() if msg.ahead else []

    def on_hint(self, sender: bytes, msg: M.Hint) -> list:
        self.router.notes(layer_lists(msg.hints, "hints"), None)
        return []

    def on_release(self, sender: bytes, msg: M.Release) -> list:
        self.router.end_pass()
        return []

    def on_filled(self, sender: bytes, msg: M.Filled) -> list:
        return self.router.filled(msg)

    def on_loaded(self, sender: bytes, msg: M.Loaded) -> list:
        return self.router.loaded(msg)

    def on_load_failed(self, sender: bytes, msg: M.LoadFailed) -> list:
        return self.router.load_failed(msg)

    HANDLERS = {M.PeerHello: on_hello, M.Need: on_need, M.Used: on_used, M.Hint: on_hint,
                M.Release: on_release, M.Filled: on_filled, M.Loaded: on_loaded,
                M.LoadFailed: on_load_failed}

    def stats(self):
        return {**(self.router.stats() if self.router else {}), "handled": self.handled.summary()}


def layer_lists(value, name: str) -> list:
    """[[layer, [expert, ...]], ...] of ints, checked before the router acts on any of it (a
    malformed one is dropped whole, as a bad message)."""
    try:
        out = [[int(layer), [int(e) for e in experts]] for layer, experts in value]
    except (TypeError, ValueError):
        raise M.ProtocolError(f"{name} must be [[layer, [expert, ...]], ...]") from None
    return out


class Handled:
    """Messages the router handled, per type: how many, the time its handlers took, answers
    sent included (`handled` in its stats: what a need may queue behind), and of it the time
    until the handler's own answers and read orders were sent (`sent_mean_us`: what a need's
    reads wait for; the prefetch planned after them is the rest)."""

    def __init__(self, keep: int = 512):  # small: the stats thread summarizes them every 250 ms
        self.whole: dict[str, Latency] = {}  # per type: the handler's whole time
        self.sent: dict[str, Latency] = {}   # per type: its part until its answers and reads left
        self.keep = keep

    def add(self, kind: str, seconds: float, sent: float | None = None) -> None:
        if kind not in self.whole:
            self.whole[kind], self.sent[kind] = Latency(self.keep), Latency(self.keep)
        self.whole[kind].add(seconds)
        self.sent[kind].add(seconds if sent is None else sent)

    def summary(self) -> dict:
        """Per type; `sent_p50_us` beside the means, which one slow message (a first call's
        import, a prefill's need of many reads) can carry."""
        out = {}
        for k, whole in self.whole.items():
            sent = self.sent[k].summary()
            out[k] = {"count": whole.count, "total_s": round(whole.total, 6),
                      "mean_us": round(whole.total / whole.count * 1e6, 1),
                      "sent_mean_us": round(sent["total_s"] / whole.count * 1e6, 1),
                      "sent_p50_us": round(sent["p50_ms"] * 1e3, 1)}
        return out
