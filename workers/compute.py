"""Compute: owns MLX, the dense weights, the resident experts, the KV cache and sampling.

At every MoE layer the model computes the real routing and calls the expert provider.
`SlotExperts` keeps the experts it uses in its resident tier (workers/resident.py: MLX pools
filled once per load) and knows what the tier holds without asking anyone: when every expert of
the layer is resident, the gate's ids index a device-side expert->slot table and `gather_qmm`
runs on the pools inside the lazy graph, with no read-back, no message and no copy. Otherwise the
ids come back to the CPU (one sync); experts already resident cost nothing more, and the missing
ones are asked of the router (`need`), which has them read into staging slots and tells compute
to copy each into a resident slot (`fill`). The uses compute served alone are reported to the
router without waiting (`used`), so the cache policy still sees every hit. Where the router
prefetches, a layer that reads its gate back also applies the next layer's gate to its input and
asks for those experts ahead (`need` with lease, sent behind its own need), so two requests are
in flight while it waits and computes. Each expert's result
depends only on its own tokens and weights, so the output is the same whatever the memory budget,
the slot assignment or the order experts arrive in.

Generation runs as steps (`Scheduler`): every running request is a `Sequence` with its own KV
cache, and each step is one forward pass over one row per sequence (`forward_batch`: the KV cache
update and attention per sequence, everything else on the rows stacked), so each MoE layer asks for the union of the
batch's experts once. The next pass is built and sampled on the device (`mx.async_eval`) before
the previous tokens are read back, the way mlx-lm's generate_step overlaps them, whenever the
pass cannot stop on a miss (every expert resident).

Requests (`RequestQueue`): up to compute.max_batch decode together, the others wait in arrival
order in a bounded queue (compute.max_queue) and join between steps when a place and their KV
cache fit (the budget's KV reserve, compute.kv_tokens). Between steps the process answers its
control channel; a request that arrives then only joins the queue (requests never nest), and a
`cancel` removes a waiting one or stops a running one at the next step. Requests carry token
ids and every token goes back as an id: prompt text, detokenizing and stop strings are the
supervisor's (runtime/textside.py), so this process loads no tokenizer; it stops at EOS itself.

Benchmark modes (config [bench], reported as `bench_mode` in every stats dict): `Routing`
(runtime/benchmode.py) takes the expert ids from a trace, or seeded random ones, instead of the
gate; `StandInModel` replaces each layer's math by a wait while requests, reads and fills stay
real; `MmapSource` + `MmapExperts` are the memory-mapped baseline (the store read through the page
cache, no cache of our own: every use copies), run in-process by `run_inprocess`.
`runtime.record_trace` records the ids every token used (`TraceRecorder`, saved per request).
"""
from __future__ import annotations

import itertools
import mmap
import os
import time
from collections import deque
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from deltafin.protocol import messages as M
from deltafin.runtime.benchmode import Routing, bench_mode, precise_wait
from deltafin.runtime.budget import ITEMSIZE, kv_bytes_per_token, kv_reserve_tokens, sequence_kv_tokens
from deltafin.runtime.config import CacheConfig
from deltafin.runtime.metrics import Counter, Latency
from deltafin.runtime.models import build_model
from deltafin.runtime.models.base import SORT_PAIRS, gather_glu, switch_glu
from deltafin.runtime.store import Store, views_from_buffer
from deltafin.runtime.tiers import layer_groups
from deltafin.runtime.tokenizer import eos_ids
from deltafin.runtime.traces import TraceRecorder
from deltafin.workers.resident import ResidentTier, probe_zero_copy
from deltafin.workers.router_process import prefetch_setting


class RequestError(ValueError):
    """The request itself is wrong (empty prompt, too long, bad token id)."""

    code = "bad_request"


class ExpertUnavailable(RuntimeError):
    def __init__(self, message: str, code: str = "expert_unavailable"):
        super().__init__(message)
        self.code = code


@dataclass
class Granted:
    slots: list          # [(expert, slot)]
    hits: int
    wait_s: float


# -- expert sources: compute's side of the data plane ------------------------------------------------
class LocalExpertSource:
    """Router and loader called directly: the in-process wiring used by tests and tools. Counts
    the messages compute would send (`messages`), as `RouterClient` does over the socket."""

    def __init__(self, router, loader):
        self.router, self.loader, self.req = router, loader, 0
        self.messages = Counter()

    def resident_slots(self, store: Store) -> dict:
        """{group: resident slots} of the router's tables, named by the store's record layouts."""
        groups = set(layer_groups(store).values())
        if self.router.only is not None:
            if len(groups) != 1:
                raise ValueError("the store has several record layouts: give the router one slot "
                                 "group per layout (Router(groups=...))")
            return {groups.pop(): self.router.table.n_slots}
        return {g: t.n_slots for g, t in self.router.tables.items()}

    def need(self, layer: int, experts: list[int], apply, prefetch: bool = False, lease=None) -> Granted:
        from deltafin.workers.router import RouterError, drive_need
        self.req += 1
        self.messages.add("need")
        t0 = time.perf_counter()

        def fill(msg):
            apply(msg)
            if isinstance(msg, M.Fill):
                self.messages.add("filled")
        try:
            reply = drive_need(self.router, self.req, layer, experts, self.loader.read, fill, prefetch)
        except RouterError as e:
            raise ExpertUnavailable(str(e), code=e.code) from None
        wait = time.perf_counter() - t0 if reply.hits < len(reply.slots) else 0.0
        return Granted([(e, s) for e, s, _ in reply.slots], reply.hits, wait)

    # No `lease` in-process (so `need` never gets one): its fills would land at once, while the
    # layer that asked has not run (a victim could be one of its experts, used without a need);
    # over the socket they are applied only at a later wait, after what the pass built is evaluated.

    def poll(self, apply) -> int:
        """In-process every fill is applied inside its need: nothing ever waits."""
        return 0

    def used(self, uses: list, ahead: bool = False) -> None:
        self.messages.add("used")
        self.router.used(uses)

    def hint(self, hints: list) -> None:
        self.messages.add("hint")
        self.router.hint((layer, e) for layer, experts in hints for e in experts)

    def release(self) -> None:
        self.router.release()


class RouterClient:
    """compute's side of the data plane over the socket: `need` waits (applying the fills that
    arrive meanwhile), `used` does not."""

    def __init__(self, sock, timeout_s: float, alive):
        self.sock, self.timeout_s, self.alive, self.req = sock, timeout_s, alive, 0
        self.messages = Counter()
        self.stash: deque = deque()  # messages `poll` read that only a need handles

    def _fill(self, msg, apply) -> None:
        from deltafin.runtime.sockets import send
        apply(msg)
        send(self.sock, M.Filled(staging=msg.staging, generation=msg.generation))
        self.messages.add("filled")

    def poll(self, apply) -> int:
        """Applies, without waiting, the fills that arrived since the last need (prefetch reads
        that landed while compute was busy), so a layer counts them resident before it decides
        what to ask; returns how many. Anything else is kept for the next need."""
        from deltafin.runtime.sockets import recv
        n = 0
        while self.sock.poll(0):
            msg = recv(self.sock)
            if isinstance(msg, M.Fill):
                self._fill(msg, apply)
                n += 1
            elif isinstance(msg, M.FillFailed):
                apply(msg)  # a read no need waits for failed: its slot is empty
            else:
                self.stash.append(msg)
        return n

    def need(self, layer: int, experts: list[int], apply, prefetch: bool = False,
             lease: tuple | None = None) -> Granted:
        """Sends the need, then `lease` ((layer, experts) of a later layer) if given, so the
        router reads the lease behind this need's reads; waits for this need's `slots`."""
        from deltafin.runtime.sockets import recv, send, wait_readable
        self.req += 1
        req = self.req
        send(self.sock, M.Need(req=req, layer=layer, experts=experts, prefetch=prefetch))
        self.messages.add("need")
        if lease is not None:
            self.lease(*lease)
        while True:
            if self.stash:
                msg = self.stash.popleft()
            else:
                try:
                    wait_readable(self.sock, self.timeout_s, self.alive, what=f"experts of layer {layer}")
                except (TimeoutError, ConnectionError) as e:
                    raise ExpertUnavailable(str(e)) from None
                msg = recv(self.sock)
            if isinstance(msg, M.Fill):
                self._fill(msg, apply)
            elif isinstance(msg, M.FillFailed):
                apply(msg)
                if msg.req == req:
                    raise ExpertUnavailable(msg.error, code="expert_read_failed")
            elif isinstance(msg, M.Error):  # the router's own code (budget_too_small)
                raise ExpertUnavailable(msg.message, code=msg.code)
            elif isinstance(msg, M.Slots) and msg.req == req:
                return Granted([(e, s) for e, s, _ in msg.slots], msg.hits, msg.wait_us / 1e6)
            # else a lease's answer: its fills were applied as they came

    def lease(self, layer: int, experts: list[int]) -> None:
        """Asks ahead for a later layer's experts (no wait): `need` with lease. Its fills are
        applied as they arrive, by a need's wait or `poll`."""
        from deltafin.runtime.sockets import send
        self.req += 1
        send(self.sock, M.Need(req=self.req, layer=layer, experts=experts, lease=True))
        self.messages.add("lease")

    def used(self, uses: list, ahead: bool = False) -> None:
        from deltafin.runtime.sockets import send
        send(self.sock, M.Used(uses=uses, ahead=ahead))
        self.messages.add("used")

    def hint(self, hints: list) -> None:
        from deltafin.runtime.sockets import send
        send(self.sock, M.Hint(hints=hints))
        self.messages.add("hint")

    def release(self) -> None:
        from deltafin.runtime.sockets import send
        send(self.sock, M.Release(req=self.req))


# -- expert providers: what the model calls at each MoE layer --------------------------------------------
class ExpertProvider:
    """Shared by the providers: the routing, the passes' uses, counters and the time split.

    A forward pass is begun (`begin_pass`), built by the model, then either committed once its
    output was read (`commit`: its uses are reported, its routing recorded) or dropped
    (`discard`: a pass launched ahead of need)."""

    # The model may hand x [..., D] and the gate's ids [..., k] in the gate's own shape (as mlx-lm
    # hands its SwitchGLU) and take [..., k, D] back: no reshape per layer and token.
    keeps_shape = True

    def __init__(self, store: Store, source, dtype, routing: Routing | None = None):
        self.store, self.source, self.dtype = store, source, dtype
        self.routing = routing or Routing(store)
        self.prepare = Latency()
        self.counters = Counter()
        self.t_ipc = self.t_wait = self.t_prepare = self.t_sync = 0.0
        self.passes: dict[int, dict] = {}
        self.pass_no = 0
        self.current: dict | None = None
        self.unreported: list = []  # (pass, layer, ids) used without a need, not yet told the router

    # -- passes -----------------------------------------------------------------------------------
    def begin_pass(self, n_tokens: int, rows: bool = True) -> int:
        """rows: the pass's routing may be asked for at commit (a trace is recorded)."""
        self.pass_no += 1
        self.current = self.passes[self.pass_no] = {"n": n_tokens, "used": [], "rows": rows,
                                                    "undo": self.routing.begin_pass(n_tokens)}
        return self.pass_no

    def seal_pass(self):
        """The current pass's gate ids (those still on the device), stacked into one device array
        for the caller to evaluate with the pass's output: commit then reads them back in one
        copy, not one per layer. None where there is nothing to stack."""
        rec = self.current
        where = [i for i, (_, ids) in enumerate(rec["used"]) if isinstance(ids, mx.array)]
        if len(where) < 2 or len({rec["used"][i][1].shape for i in where}) != 1:
            return None
        rec["sealed"] = (where, mx.stack([rec["used"][i][1] for i in where]))
        return rec["sealed"][1]

    def _read_back(self, p: int) -> None:
        """A sealed pass's ids, read back at once, replace its device ids everywhere they wait."""
        rec = self.passes[p]
        where, stacked = rec.pop("sealed", (None, None))
        if stacked is None:
            return
        host = self._host(stacked)
        swap = {id(rec["used"][i][1]): host[j] for j, i in enumerate(where)}
        rec["used"] = [(layer, swap.get(id(ids), ids)) for layer, ids in rec["used"]]
        self.unreported = [(q, layer, swap.get(id(ids), ids) if q == p else ids, count)
                           for q, layer, ids, count in self.unreported]

    def commit(self, p: int, rows: bool = True) -> np.ndarray | None:
        """The pass's output was read: report its uses; returns its routing [n, moe_layers, k]
        (rows=False: nothing, where no one records it)."""
        self._read_back(p)
        self.flush(upto=p)
        rec = self.passes.pop(p)
        if rec.get("uses"):  # resident uses counted from shapes (SlotExperts._count_or_note)
            self.counters.add("uses", rec["uses"])
            self.counters.add("hits", rec["uses"])
        if not rows:
            return None
        return self.routing.rows(rec["n"], [(layer, self._host(ids)) for layer, ids in rec["used"]])

    def discard(self, p: int) -> None:
        """A pass begun ahead of need and not wanted: forgotten as if it never ran."""
        rec = self.passes.pop(p)
        self.routing.undo_pass(rec["undo"])
        self.unreported = [u for u in self.unreported if u[0] != p]

    def _note(self, layer: int, ids, report: bool, count: bool) -> None:
        """Records a layer's ids in the current pass; report: still to tell the router (`used`);
        count: uses and hits still to count (ids not read back yet)."""
        self.current["used"].append((layer, ids))
        if report:
            self.unreported.append((self.pass_no, layer, ids, count))

    def flush(self, upto: int | None = None, ahead: bool = False) -> None:
        """Tells the router the uses served without asking, in order, up to pass `upto` (all);
        ahead: the last of them completed a layer from early fills (the router prefetches)."""
        keep, uses, counted = [], [], 0
        for entry in self.unreported:
            p, layer, ids, count = entry
            if upto is not None and p > upto:
                keep.append(entry)
                continue
            flat = self._host(ids).reshape(-1)
            # np.unique's answer; on a decode pass's few ids plain Python is many times faster
            experts = sorted(set(flat.tolist())) if flat.size <= 256 else np.unique(flat).tolist()
            if count:
                counted += len(experts)
            uses.append([layer, experts])
        self.unreported = keep
        if counted:
            self.counters.add("uses", counted)
            self.counters.add("hits", counted)
        if uses:
            t0 = time.perf_counter()
            self.source.used(uses, ahead=ahead)
            self.t_ipc += time.perf_counter() - t0

    def _host(self, ids) -> np.ndarray:
        """ids on the CPU; reading gate ids back waits for the graph up to them (a sync)."""
        if isinstance(ids, mx.array):
            t0 = time.perf_counter()
            ids = np.array(ids)
            self.t_sync += time.perf_counter() - t0
        return ids

    def can_overlap(self) -> bool:
        """A pass can be launched before the previous token is read: it will never stop to wait."""
        return False

    def fetch(self, layer: int) -> None:
        raise NotImplementedError


class SlotExperts(ExpertProvider):
    """The ExpertProvider of the runtime: experts from compute's resident tier, filled from the
    shared-memory staging slots the router has the loader read into."""

    def __init__(self, store: Store, staging_buf, slot_bytes: int, source, dtype,
                 routing: Routing | None = None):
        super().__init__(store, source, dtype, routing)
        self.staging, self.slot_bytes = staging_buf, slot_bytes
        self.tier: ResidentTier | None = None
        self.force_sync = False  # measurement only: read every layer's ids back, as before
        self.cache_config: dict = {}  # the config's [cache], set by Compute before attach
        self.hints = False  # gate lookahead for the router's prefetch (on where it prefetches)
        self.host_fills = True  # compute.host_fills, set by Compute before attach
        self.hits_first = True  # compute.hits_first, set by Compute
        self.stream_misses = True  # compute.stream_misses, set by Compute
        self.pool_placement = "auto"  # compute.pool_placement, set by Compute before attach
        self.take_early_fills = True  # compute.early_fills, set by Compute
        self.leases = True  # compute.leases, set by Compute: the lookahead also asked as a lease
        self.eager_layers = False  # compute.eager_layers, set by Compute
        self._lease = None  # (next layer, its lookahead's experts), sent with this layer's need
        self._inflight = None  # the layer in pieces while its need waits (_in_pieces)
        self._look = None  # (next layer, its gate's ids on this layer's input), until sent

    def attach(self, staging_buf, slot_bytes: int, resident: dict) -> None:
        """The staging segment and the resident slots per group (the process: at attach_pool)."""
        self.staging, self.slot_bytes = staging_buf, slot_bytes
        n_keys = self.store.n_experts * len(self.store.moe_layers)
        # Pools in host memory where experts stream (a group with fewer slots than experts) and
        # unless told otherwise: a group holding every expert of its layers (the whole tier, or
        # whole layers) is read faster from device memory.
        on_host = {"host": True, "device": False}.get(self.pool_placement, "streaming")
        self.tier = ResidentTier(self.store, self.dtype, resident,
                                 host_writes=None if self.host_fills else False, on_host=on_host)
        self.hints = (self.routing.mode == "gate" and
                      prefetch_setting(CacheConfig(**self.cache_config), sum(self.tier.n_slots.values()), n_keys) is not False)

    def wants_lookahead(self, layer: int) -> bool:
        """Whether the model should apply the next MoE layer's gate to this layer's input: only
        where the router prefetches and this layer reads its gate back anyway (not all resident)."""
        return self.hints and not self.tier.full(layer) and not self.force_sync

    def lookahead(self, layer: int, inds) -> None:
        self._look = (layer, inds)

    def _send_hint(self, ids) -> None:
        """Evaluates the lookahead with this layer's ids (one sync for both) and sends it."""
        look, self._look = self._look, None
        if look is None or not isinstance(ids, mx.array):
            return
        mx.eval(ids, look[1])
        self.counters.add("hints")
        experts = sorted(set(np.array(look[1]).reshape(-1).tolist()))
        self.source.hint([[look[0], experts]])
        # The same experts asked as a lease, sent right behind this layer's need (or alone where
        # it has none): the router reads them while this layer waits and computes. At most half
        # of the layer's pool, so a lease never leaves the next need short of slots.
        if self.leases and hasattr(self.source, "lease") and \
                len(experts) <= self.tier.n_slots[self.tier.group_of[look[0]]] // 2:
            self._lease = (look[0], experts)

    def _in_pieces(self, layer: int, x, inds, flat: np.ndarray, experts: list[int]):
        """A layer with misses, computed in pieces so that compute does not sit idle while they
        are read: with `hits_first` its resident experts' (token, expert) pairs are launched
        (mx.async_eval) before the need is sent; with `stream_misses`, where fills write the pools
        in place, each missing expert's pairs are launched as its fill lands (`apply`), so its
        compute overlaps the reads of the others; the misses not launched so far run after the
        need. The pieces are joined in (token, k) order. Each pair's result depends only on its
        row and expert (as in the chunked path below), so the output is the one-call output, bit
        for bit. A fill that would overwrite a slot a piece in flight reads waits for them."""
        tier = self.tier
        lead, k, d = inds.shape[:-1], flat.shape[-1], x.shape[-1]
        x2, ids1 = x.reshape(-1, d), flat.reshape(-1)
        sorted_rows = ids1.size >= SORT_PAIRS  # decided for the whole layer, as mlx-lm does
        hit = tier.slot_of[layer][ids1] >= 0
        g = tier.group_of[layer]
        fly = self._inflight = {"layer": layer, "group": g, "slots": set(), "pieces": [], "orders": [],
                                "waiting": set(tier.missing(layer, experts)), "x2": x2, "k": k,
                                "ids1": ids1, "sorted": sorted_rows,
                                "stream": self.stream_misses and bool(tier.host[g])}
        hits_run = self.hits_first and hit.any()
        if hits_run:
            self._launch(fly, pairs_of(ids1, hit))
            self.counters.add("hits_first")
        try:
            reported = self.ensure(layer, experts)
        finally:
            self._inflight = None
        late = np.isin(ids1, list(fly["waiting"]))  # misses no landing fill launched
        if not hits_run:
            late |= hit
        if late.any():
            self._launch(fly, pairs_of(ids1, late), run=False)
        self._note(layer, flat, report=not reported, count=False)
        return self._reads_pools(in_token_order(fly["pieces"], fly["orders"], lead, k, d))

    def _launch(self, fly: dict, pairs: np.ndarray, run: bool = True) -> None:
        """One piece of a layer in pieces: the pairs' SwiGLU on their slots, launched at once
        (run) or left in the layer's graph."""
        tier, layer = self.tier, fly["layer"]
        slots = tier.slots(layer, fly["ids1"][pairs])
        piece = run_pairs(fly["x2"], fly["k"], pairs, slots, tier.weights(layer), tier.quant(layer),
                          fly["sorted"], evaluate=False)
        if run:
            mx.async_eval(piece)
            fly["slots"].update(slots.tolist())
        fly["pieces"].append(piece)
        fly["orders"].append(pairs)

    def _landed(self, layer: int, expert: int) -> None:
        """A fill landed: if it is a miss of the layer in pieces, its pairs start computing."""
        fly = self._inflight
        if fly is None or layer != fly["layer"] or expert not in fly["waiting"] or not fly["stream"]:
            return
        fly["waiting"].discard(expert)
        self._launch(fly, pairs_of(fly["ids1"], fly["ids1"] == expert))
        self.counters.add("streamed_misses")

    def _reads_pools(self, y):
        """y reads the pools lazily: kept as its pass's latest such output (it depends on every
        earlier one of the pass), so a fill writing the pools' memory in place can evaluate it
        first."""
        self.current["reads"] = y
        return y

    def _settle(self) -> None:
        """Evaluates what the open passes have built on the pools, before a fill writes them in
        place (ResidentTier.host): an unevaluated graph would read the new expert. Where a gate
        was read back this is already done, and costs nothing."""
        pending = [rec.pop("reads") for rec in self.passes.values() if "reads" in rec]
        if pending:
            mx.eval(pending)

    def apply(self, msg) -> None:
        """A router's `fill` (copy staging into a resident slot) or `fill_failed` (the slot is
        empty now). Only ever called in compute's thread: while it waits for a need, or where a
        layer takes the fills that landed meanwhile (`take_fills`)."""
        if isinstance(msg, M.FillFailed):
            self.tier.drop(msg.layer, msg.slot)
            return
        nbytes = self.store.layout(msg.layer, msg.expert)["nbytes"]
        start = msg.staging * self.slot_bytes
        t0 = time.perf_counter()
        g = self.tier.group_of[msg.layer]
        in_place = bool(self.tier.host[g])
        fly = self._inflight
        if fly is not None and fly["group"] == g and fly["slots"]:
            # Pieces in flight read this slot (a write in place), or hold this group's pools (a
            # write through MLX would then copy a whole pool): they finish first.
            if msg.slot in fly["slots"] or not in_place:
                mx.eval(fly["pieces"])
                fly["slots"].clear()
        if in_place:
            self._settle()
        self.tier.fill(msg.layer, msg.expert, msg.slot, self.staging[start:start + nbytes])
        self._landed(msg.layer, msg.expert)
        dt = time.perf_counter() - t0
        self.prepare.add(dt)
        self.t_prepare += dt
        self.counters.add("bytes", nbytes)

    def take_fills(self, layer: int, experts: list[int]) -> bool:
        """Applies the prefetch fills that landed while compute was busy (`poll`), before a
        layer decides what is resident: experts read ahead then count as hits, join the hits
        computed first, and a layer they complete sends no need at all (then its uses go to the
        router at once, marked `ahead`, so that it prefetches as a need's answer would have made
        it). Without this they waited in the socket for the layer's need. Called where the
        layer's input is evaluated (after its gate read-back), so writing the pools in place
        costs no extra sync. True where a fill taken was one of the layer's experts."""
        if not (self.take_early_fills and hasattr(self.source, "poll")):
            return False
        t0, prep0 = time.perf_counter(), self.t_prepare
        mine = []

        def apply(msg) -> None:
            self.apply(msg)
            if isinstance(msg, M.Fill) and msg.layer == layer and msg.expert in experts:
                mine.append(msg.expert)
        n = self.source.poll(apply)
        if n:
            self.counters.add("early_fills", n)
        self.t_ipc += time.perf_counter() - t0 - (self.t_prepare - prep0)
        return bool(mine)

    def ensure(self, layer: int, experts: list[int]) -> bool:
        """Makes the experts resident together; counts their uses. False when they all were (no
        message: their use is reported later); True when a need was sent (it reports them)."""
        missing = self.tier.missing(layer, experts)
        self.counters.add("uses", len(experts))
        self.counters.add("hits", len(experts) - len(missing))
        lease, self._lease = self._lease, None  # the next layer's, asked behind this need
        if lease is not None:
            self.counters.add("leases")
        if not missing:
            if lease is not None:
                self.source.lease(*lease)
            return False
        self.counters.add("miss_bytes", len(missing) * self.store.layout(layer)["nbytes"])
        self.flush()  # the router sees the earlier uses first, in order
        t0, prep0 = time.perf_counter(), self.t_prepare
        granted = self.source.need(layer, experts, self.apply, lease=lease)
        took = time.perf_counter() - t0 - (self.t_prepare - prep0)
        self.t_wait += min(granted.wait_s, took)
        self.t_ipc += max(0.0, took - granted.wait_s)
        for e, slot in granted.slots:
            if not self.tier.holds(layer, e, slot):
                raise ExpertUnavailable(f"compute's residency map disagrees with the router on layer "
                                        f"{layer} expert {e} (slot {slot})")
        return True

    def preload_step(self) -> bool:
        """Where the resident tier holds every expert of a group (the budget allows it), asks for
        the next layer of it that is not all resident: once all are, no layer ever syncs or asks
        again. One layer per call, so a caller can keep answering between layers. False when
        there is nothing (more) to load."""
        if self.tier is None:
            return False
        for layer in self.store.moe_layers:
            g = self.tier.group_of[layer]
            if self.tier.n_slots[g] < self.tier.group_experts[g] or self.tier.full(layer):
                continue
            experts = list(range(self.store.n_experts))
            self.counters.add("preloaded", len(self.tier.missing(layer, experts)))
            self.flush()
            self.source.need(layer, experts, self.apply, prefetch=True)
            self.tier.settle_writes()
            return True
        return False

    def fetch(self, layer: int) -> None:
        """The stand-in's MoE layer: the same requests, reads and fills, no expert math."""
        ids = self.routing.choose(layer, None)
        experts = np.unique(ids).tolist()
        early = self.take_fills(layer, experts)
        cap = self.tier.n_slots[self.tier.group_of[layer]]
        reported = False
        for i in range(0, len(experts), cap):
            reported = self.ensure(layer, experts[i:i + cap]) or reported
            self.tier.settle_writes()  # no graph reads the pools here
        self._note(layer, ids, report=not reported, count=False)
        if early and not reported:
            self.flush(ahead=True)

    def can_overlap(self) -> bool:
        return self.tier is not None and self.tier.all_full() and not self.force_sync

    def _count_or_note(self, layer: int, ids) -> None:
        """A resident layer's ids: where every expert is resident (nothing can be evicted, so the
        router needs no uses) and no one records this pass's routing, a single row's k ids are k
        distinct experts, all hits: counted from the shape, not read back (no stack of the
        pass's ids in its graph, no copy, no message per token). Otherwise noted, to be read back
        with the pass and reported."""
        rec = self.current
        if rec["rows"] or rec["n"] != 1 or not self.tier.all_full():
            self._note(layer, ids, report=True, count=True)
            return
        rec["uses"] = rec.get("uses", 0) + ids.shape[-1]  # counted once the pass is committed

    def __call__(self, layer: int, x, inds):
        ids = self.routing.choose(layer, inds)  # the gate's ids (on the device), or the trace's
        tier = self.tier
        w, quant = tier.weights(layer), tier.quant(layer)
        if tier.full(layer) and not self.force_sync:
            # No question to ask: the ids index the layer's experts inside the graph.
            self._count_or_note(layer, ids)
            ordered = tier.expert_weights(layer)  # None: index the expert->slot table
            if isinstance(ids, mx.array):
                slots = ids if ordered is not None else tier.device_table(layer)[ids]
            else:  # a trace's ids, in the gate's shape
                host = np.asarray(ids).reshape(inds.shape)
                slots = mx.array((host if ordered is not None else tier.slots(layer, host)).astype(np.uint32))
            y = switch_glu(x, slots, ordered or w, quant)
            if self.eager_layers and not tier.all_full():
                # A later layer of this pass reads its routing back, which waits for everything
                # before it: launched now, this layer computes while the next ones are built.
                mx.async_eval(y)
            return self._reads_pools(y)
        if not isinstance(ids, mx.array):
            # Routing from a trace reads no gate back, so nothing has evaluated this layer's input:
            # the pass's pending graph still holds the pools, and a fill would then copy a whole
            # pool instead of writing one slot (compute grew to 22 GB on the 26-layer store in the
            # real regime). Evaluated here, where a real run's gate read-back evaluates it.
            mx.eval(x)
        if isinstance(ids, mx.array):
            self.counters.add("gate_syncs")
        if self._look is not None:
            t0 = time.perf_counter()
            self._send_hint(ids)  # before the need: the router prefetches after answering it
            self.t_sync += time.perf_counter() - t0
        flat = self._host(ids).reshape(-1, ids.shape[-1])  # the sync: which experts, on the CPU
        experts = np.unique(flat).tolist()
        early = self.take_fills(layer, experts)
        cap = tier.n_slots[tier.group_of[layer]]
        if len(experts) <= cap:
            missing = len(tier.missing(layer, experts))
            if missing and ((self.hits_first and missing < len(experts)) or
                            (self.stream_misses and tier.host[tier.group_of[layer]])):
                return self._in_pieces(layer, x, inds, flat, experts)
            reported = self.ensure(layer, experts)
            self._note(layer, flat, report=not reported, count=False)
            if early and not missing:
                self.flush(ahead=True)  # no need will start the router's next prefetch: this does
            slots = tier.slots(layer, flat).astype(np.uint32).reshape(inds.shape)
            return self._reads_pools(switch_glu(x, mx.array(slots), w, quant))
        # More distinct experts than the layer's resident slots (a long prefill in a small budget):
        # in chunks, each evaluated before the next chunk's fills overwrite its slots. No lease
        # here: it would hold slots the chunks take in turn.
        self._lease = None
        reported = False
        lead, k, d = inds.shape[:-1], flat.shape[-1], x.shape[-1]
        x2, ids1 = x.reshape(-1, d), flat.reshape(-1)
        sorted_rows = ids1.size >= SORT_PAIRS  # decided for the whole layer, as mlx-lm does
        pieces, order = [], []
        for i in range(0, len(experts), cap):
            chunk = experts[i:i + cap]
            reported = self.ensure(layer, chunk) or reported
            pairs = pairs_of(ids1, np.isin(ids1, chunk))
            pieces.append(run_pairs(x2, k, pairs, tier.slots(layer, ids1[pairs]), w, quant, sorted_rows))
            order.append(pairs)
        self._note(layer, flat, report=not reported, count=False)
        return in_token_order(pieces, order, lead, k, d)


def run_pairs(x2, k: int, pairs: np.ndarray, slot_ids: np.ndarray, w: dict, quant: dict, sorted_rows: bool,
              evaluate: bool = True):
    """The SwiGLU of the (token, expert) pairs `pairs` (flat indices, grouped by expert) on the
    stacked weights `w` at `slot_ids`, evaluated at once (evaluate) so the stack can go before the
    next one."""
    idx = mx.array(slot_ids.astype(np.uint32))
    rows = x2[mx.array(pairs // k)]
    xs, ix = (rows[:, None, :], idx) if sorted_rows else (rows[:, None, None, :], idx[:, None])
    piece = gather_glu(xs, ix, w, quant, sorted_rows).reshape(len(pairs), x2.shape[-1])
    if evaluate:
        mx.eval(piece)
    return piece


def pairs_of(ids1: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Flat (token, k) indices where mask holds, grouped by expert (stable)."""
    pairs = np.nonzero(mask)[0]
    return pairs[np.argsort(ids1[pairs], kind="stable")]


def in_token_order(pieces: list, order: list, lead, k: int, d: int):
    """Concatenated chunk results back in (token, k) order."""
    y = mx.concatenate(pieces, axis=0)
    n = sum(len(o) for o in order)
    inverse = np.empty(n, dtype=np.int64)
    inverse[np.concatenate(order)] = np.arange(n)
    return y[mx.array(inverse)].reshape(*lead, k, d)


class MmapSource:
    """The memory-mapped baseline's expert source (what llama.cpp mainline does): the store's layer
    files mapped read-only, no cache of our own, so every use is a "hit" with no wait and a page
    fault reads from disk through the OS page cache. No router, loader or shared memory."""

    def __init__(self, store: Store):
        self.store, self.maps, self.files = store, {}, {}
        self.messages = Counter()

    def view(self, layer: int, expert: int):
        rec = self.store.record(layer, expert)
        m = self.maps.get(rec.file)
        if m is None:
            self.files[rec.file] = f = open(self.store.path / rec.file, "rb")
            m = self.maps[rec.file] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return memoryview(m)[rec.offset:rec.offset + rec.nbytes]

    def used(self, uses: list, ahead: bool = False) -> None:
        pass

    def hint(self, hints: list) -> None:
        pass

    def release(self) -> None:
        pass

    def close(self) -> None:
        for m in self.maps.values():
            try:
                m.close()
            except BufferError:  # a view is still alive somewhere; the mapping goes with it
                pass
        for f in self.files.values():
            f.close()


class MmapExperts(ExpertProvider):
    """The mmap baseline's provider: no cache of its own, so every use copies the chosen experts
    out of the page cache and stacks them (the per-use prepare stage the runtime no longer has),
    at most top_k experts at a time, then runs the same gather_qmm kernels."""

    def __init__(self, store: Store, pool_buf, slot_bytes: int, source: MmapSource, dtype,
                 routing: Routing | None = None, max_chunk: int | None = None):
        super().__init__(store, source, dtype, routing)
        self.max_chunk = max_chunk or store.top_k

    def weights(self, layer: int, expert: int) -> dict:
        layout = self.store.layout(layer, expert)
        views = views_from_buffer(self.source.view(layer, expert), layout)
        self.counters.add("bytes", layout["nbytes"])
        out = {}
        for t in layout["tensors"]:
            a = mx.array(views[t["name"]])  # copies out of the page cache
            if t["dtype"] == "bfloat16":
                a = a.view(mx.bfloat16)
            if mx.issubdtype(a.dtype, mx.floating) and a.dtype != self.dtype:
                a = a.astype(self.dtype)
            out[t["name"]] = a
        return out

    def chunks(self, layer: int, experts: list[int]):
        """Per chunk of at most top_k experts: their bytes copied into MLX arrays stacked [C, ...]
        (the prepare stage); yields (expert ids in stack order, weights)."""
        for i in range(0, len(experts), self.max_chunk):
            chunk = experts[i:i + self.max_chunk]
            self.counters.add("uses", len(chunk))
            self.counters.add("hits", len(chunk))
            tp = time.perf_counter()
            per = [self.weights(layer, e) for e in chunk]
            w = {name: mx.stack([p[name] for p in per]) for name in per[0]}
            mx.eval(w)
            dt = time.perf_counter() - tp
            for _ in per:
                self.prepare.add(dt / len(per))
            self.t_prepare += dt
            yield chunk, w

    def fetch(self, layer: int) -> None:
        ids = self.routing.choose(layer, None)
        for _ in self.chunks(layer, np.unique(ids).tolist()):
            pass
        self._note(layer, ids, report=False, count=False)

    def __call__(self, layer: int, x, inds):
        lead, k, d = inds.shape[:-1], inds.shape[-1], x.shape[-1]
        x2 = x.reshape(-1, d)
        flat = self._host(self.routing.choose(layer, inds)).reshape(-1)
        self._note(layer, flat, report=False, count=False)
        sorted_rows = flat.size >= SORT_PAIRS  # as mlx-lm decides
        quant = self.store.layout(layer)["quant"]
        pieces, order = [], []
        for stacked, w in self.chunks(layer, np.unique(flat).tolist()):
            local = np.full(int(flat.max()) + 1, -1, dtype=np.int64)
            local[stacked] = np.arange(len(stacked))
            pairs = np.nonzero(local[flat] >= 0)[0]
            pairs = pairs[np.argsort(local[flat[pairs]], kind="stable")]  # grouped by expert
            pieces.append(run_pairs(x2, k, pairs, local[flat[pairs]], w, quant, sorted_rows))
            order.append(pairs)
        return in_token_order(pieces, order, lead, k, d)


class StandInModel:
    """The model's call signature with each layer's math replaced by a wait: the MoE layers still
    request their experts and fill them (`fetch`), so reads, messages and copies stay real; the
    logits are zeros (greedy then picks token 0)."""

    def __init__(self, n_layers: int, moe_layers: list[int], vocab: int, moe_ms: float, dense_ms: float):
        self.n_layers, self.moe_layers, self.vocab = n_layers, set(moe_layers), vocab
        self.moe_s, self.dense_s = moe_ms / 1e3, dense_ms / 1e3

    def make_cache(self):
        return None  # no attention, so no KV cache

    def __call__(self, tokens, cache, experts):
        n = int(tokens.size) if isinstance(tokens, mx.array) else len(tokens)
        for i in range(self.n_layers):
            if i in self.moe_layers:
                precise_wait(self.moe_s)
                experts.fetch(i)
            else:
                precise_wait(self.dense_s)
        return mx.zeros((n, self.vocab), dtype=mx.float32)

    def forward_batch(self, tokens, caches, experts, float32=True):
        return self(tokens, None, experts)  # one sequence at a time (its scheduler's max_batch)


# -- the decode loop ----------------------------------------------------------------------------------
def sample_on_device(logits, temperature: float, top_p: float, key, dtype=None):
    """The next token of each row of logits [R, vocab] (R tokens, [R]), on the device (lazy: read
    back one step later). Greedy is the argmax of the log-probabilities computed in the model's
    dtype `dtype`, as mlx-lm's generate_step computes them: in bfloat16, subtracting the
    log-sum-exp can round two neighbouring logits to one value, and the lower token id then wins
    there too. Otherwise softmax(logits / temperature) restricted to the smallest set of most
    likely tokens whose probability reaches top_p, drawn with `key`."""
    if temperature == 0:
        row = logits.astype(dtype or logits.dtype)  # exact: the model's own values (no op if already)
        return mx.argmax(row - mx.logsumexp(row, axis=-1, keepdims=True), axis=-1)
    z = logits.astype(mx.float32) / temperature
    if top_p < 1:
        probs = mx.softmax(z, axis=-1)
        order = mx.argsort(-probs, axis=-1)
        ranked = mx.take_along_axis(probs, order, axis=-1)
        before = mx.cumsum(ranked, axis=-1) - ranked  # probability of the tokens ranked above
        # back to vocabulary order
        drop = mx.take_along_axis(before >= top_p, mx.argsort(order, axis=-1), axis=-1)
        z = mx.where(drop, -mx.inf, z)
    return mx.random.categorical(z, key=key)


@dataclass(eq=False)  # compared by identity: the batch finds and removes its own sequences
class Sequence:
    """One request in the decode loop: its KV cache, sampling key, where its prefill stands and
    what it has produced; the times its stats are made of."""
    req: M.Generate
    prompt: list
    cache: object
    key: object
    emit: object = None        # called with each M.Token (ids only: the text side fills the text), or None
    owner: object = None       # who asked (the process: its Queued)
    kv_bytes: int = 0          # what its KV cache may grow to (admission charges it)
    out_ids: list = field(default_factory=list)
    finish: str | None = None
    error: Exception | None = None  # the request failed (answered with an error, not Done)
    ttft_s: float | None = None
    filled: int = 0            # prompt tokens prefilled so far
    pending: object = None     # the token its next decode pass takes (on the device, or an int)
    t_request: float = 0.0
    t_first: float | None = None  # its first token was read (the end of its prefill)
    t_end: float | None = None
    marks: dict = field(default_factory=dict)  # split/loop snapshots at its start and first token

    def next_key(self):
        """A fresh sampling key per token (none needed for greedy)."""
        if self.req.temperature == 0:
            return None
        self.key, sub = mx.random.split(self.key)
        return sub

    @property
    def head(self) -> list:
        """The prompt tokens prefilled in passes of their own: all but the last, which is the
        first decode-shaped pass's input (as mlx-lm's generate_step); all where no token is asked."""
        return self.prompt[:-1] if self.req.max_tokens > 0 else self.prompt


@dataclass
class Step:
    """A forward pass launched for sequences decoded together: their sampled tokens, on the
    device until read."""
    seqs: list
    tokens: object      # [B] on the device
    pass_no: int | None
    t0: float


class Scheduler:
    """The sequences decoded together, stepped as one batch: each step launches one forward pass
    over every active sequence (`MoETransformer.forward_batch`: one row each, so each MoE layer
    asks for the union of their experts once), samples each row with its own settings on the
    device (`mx.async_eval`), then reads the tokens back. When the next pass cannot stop on a
    miss it is launched before the previous tokens are read, so building a pass overlaps
    computing the last one (mlx-lm's generate_step does the same).

    Sequences join between steps: admitted (`fits`, `add`), their prompt is prefilled one chunk
    (compute.prefill_chunk) per step, so a long prompt holds the others back by one chunk at a
    time; then they decode with the rest. A finished or cancelled sequence leaves at once
    (`leave`) and its KV cache goes with it. Admission charges each sequence the KV cache it may
    grow to; together they stay within the budget's KV reserve (compute.kv_tokens)."""

    def __init__(self, compute: "Compute", max_batch: int = 1, kv_pool_bytes: int = 0):
        self.compute = compute
        self.max_batch, self.kv_pool = max(1, max_batch), kv_pool_bytes
        self.kv_used = self.kv_peak = self.max_rows = 0
        self.filling: deque[Sequence] = deque()  # admitted, prompt being prefilled
        self.active: list[Sequence] = []         # decoding together
        self.ahead: Step | None = None           # the next step, launched before its turn
        self.counters = Counter()                # steps, rows (the batch sizes), decode tokens and bytes
        # Where the decode loop's time goes (seconds, summed): building and launching passes
        # (including any wait for a miss), waiting for the device's tokens, committing a pass
        # (reading its expert ids back, telling the router), and handling the tokens (EOS, emit;
        # detokenizing and stop strings happen outside this process, runtime/textside.py).
        self.loop = dict.fromkeys(("launch", "token_wait", "commit", "accept"), 0.0)

    # -- admission ------------------------------------------------------------------------------
    def busy(self) -> bool:
        return bool(self.filling or self.active)

    def fits(self, seq: Sequence) -> bool:
        """Room for one more sequence: a batch slot, and its KV cache within the reserve. Alone
        it always fits (the reserve holds one max_context sequence)."""
        n = len(self.filling) + len(self.active)
        return n == 0 or (n < self.max_batch and self.kv_used + seq.kv_bytes <= self.kv_pool)

    def add(self, seq: Sequence) -> None:
        self.kv_used += seq.kv_bytes
        self.kv_peak = max(self.kv_peak, self.kv_used)
        seq.marks["start"] = (self.compute._split(), dict(self.loop))
        self.filling.append(seq)

    def leave(self, seq: Sequence, finish: str | None = None) -> None:
        """The sequence is done (finish: why, where not set yet): it leaves the batch and its KV
        cache is freed. An early-launched pass holding only sequences that left is dropped."""
        if seq.finish is None:
            seq.finish = finish or "length"
        if seq in self.active:
            self.active.remove(seq)
        elif seq in self.filling:
            self.filling.remove(seq)
        else:
            return
        self.kv_used -= seq.kv_bytes
        seq.cache, seq.pending, seq.t_end = None, None, time.perf_counter()
        if self.ahead is not None and all(s.finish is not None for s in self.ahead.seqs):
            self.compute.experts.discard(self.ahead.pass_no)
            self.ahead = None

    def fail(self, error: Exception) -> list[Sequence]:
        """A pass raised: every sequence in the batch fails with it (their caches may be half
        advanced); the router's pins and the passes left half-built go."""
        out = list(self.filling) + list(self.active)
        for seq in out:
            seq.error = error
            self.leave(seq, "error")
        self.ahead = None
        self.compute.abandon()
        return out

    # -- steps ----------------------------------------------------------------------------------
    def step(self, joining: bool = False) -> list[Sequence]:
        """One prefill chunk of the oldest sequence still prefilling, then one decode step of
        the active ones. The chunk goes first so that a sequence whose prompt it completes
        decodes in this very step: a new request's first token costs its prefill plus one
        step, not two steps (time to first token while others decode: on the H200's demo
        store 565 ms with the chunk after the step against 276 ms idle). joining: a request
        waits to join, so no pass is launched early. Returns the sequences that finished in it
        (they left already), each with `finish` set, or `error` where a pass raised."""
        done: list[Sequence] = []
        try:
            if self.filling:
                self.prefill_chunk(self.filling[0], done)
            if self.active:
                self.decode(joining or bool(self.filling), done)
        except Exception as e:  # the model or a need raised: each request is answered, serving goes on
            return done + self.fail(e)
        return done

    def prefill_chunk(self, seq: Sequence, done: list) -> None:
        c = self.compute
        head = seq.head
        if seq.filled < len(head):
            chunk = head[seq.filled:seq.filled + c.prefill_chunk]
            c.forward(chunk, seq.cache)
            seq.filled += len(chunk)
        if seq.filled >= len(head):
            self.filling.remove(seq)
            if seq.req.max_tokens <= 0:
                self.active.append(seq)  # to leave through the same door
                seq.t_first = time.perf_counter()
                seq.marks["first"] = (c._split(), dict(self.loop))
                self.leave(seq, "length")
                done.append(seq)
                return
            seq.pending = seq.prompt[-1]
            self.active.append(seq)

    def decode(self, hold: bool, done: list) -> None:
        c = self.compute
        bytes0 = c.experts.counters.get("bytes")
        step, self.ahead = self.ahead, None
        if step is None:
            step = self.launch(self.active, [s.pending for s in self.active])
        # Early only where every row is still wanted: a row whose sequence left has no cache.
        if (not hold and c.experts.can_overlap() and step.seqs == self.active
                and all(len(s.out_ids) + 1 < s.req.max_tokens for s in step.seqs)):
            self.ahead = self.launch(step.seqs, step.tokens)
        toks = self.read(step)
        t0, produced = time.perf_counter(), 0
        for seq, tok in zip(step.seqs, toks):
            if seq.finish is not None:
                continue  # left while this pass ran ahead: its row is not wanted
            produced += 1
            if seq.t_first is None:
                seq.t_first = t0
                seq.ttft_s = t0 - seq.t_request
                seq.marks["first"] = (c._split(), dict(self.loop))
            self.accept(seq, tok)
            seq.pending = tok
            if seq.finish is not None or len(seq.out_ids) >= seq.req.max_tokens:
                self.leave(seq, "length")
                done.append(seq)
        # Expert bytes copied in during decode steps, and the tokens those steps produced
        # (expert_bytes_per_token: what one read serves falls as the batch grows).
        self.counters.add("decode_tokens", produced)
        self.counters.add("decode_bytes", c.experts.counters.get("bytes") - bytes0)
        self.loop["accept"] += time.perf_counter() - t0

    def launch(self, seqs: list, tokens) -> Step:
        c = self.compute
        t0 = time.perf_counter()
        if not isinstance(tokens, mx.array):
            tokens = mx.stack([t if isinstance(t, mx.array) else mx.array(t, dtype=mx.uint32)
                               for t in tokens]).reshape(-1)
        p = c.experts.begin_pass(len(seqs), rows=c.recorder is not None)
        # In the model's dtype (sample_on_device casts where it needs float32), each row sampled
        # on its own [1, vocab] slice: one sequence's tokens are its sampler's output as it is.
        logits = c.model.forward_batch(tokens, [s.cache for s in seqs], c.experts, float32=False)
        toks = [sample_on_device(logits if len(seqs) == 1 else logits[b:b + 1], s.req.temperature,
                                 s.req.top_p, s.next_key(), c.dtype) for b, s in enumerate(seqs)]
        toks = toks[0] if len(toks) == 1 else mx.concatenate(toks)
        ids = c.experts.seal_pass()
        mx.async_eval(toks) if ids is None else mx.async_eval(toks, ids)
        self.loop["launch"] += time.perf_counter() - t0
        self.counters.add("steps")
        self.counters.add("rows", len(seqs))
        self.max_rows = max(self.max_rows, len(seqs))
        return Step(list(seqs), toks, p, t0)

    def read(self, step: Step) -> list[int]:
        t0 = time.perf_counter()
        toks = [int(t) for t in step.tokens.tolist()]
        t1 = time.perf_counter()
        c = self.compute
        if step.pass_no is not None:
            rows = c.experts.commit(step.pass_no, rows=c.recorder is not None)
            if rows is not None:
                c.request_rows.append(rows)
            c.forward_latency.add(time.perf_counter() - step.t0)
            prefill = sum(s.t_first is None for s in step.seqs)  # first tokens come from "prefill"
            c.counters.add("prefill_forward_tokens", prefill)  # live progress for the metrics stream
            c.counters.add("decode_forward_tokens", len(step.seqs) - prefill)
        self.loop["token_wait"] += t1 - t0
        self.loop["commit"] += time.perf_counter() - t1
        return toks

    def accept(self, seq: Sequence, tok: int) -> None:
        c, req = self.compute, seq.req
        # The stand-in's zero logits say nothing: its length is max_tokens, whatever token 0 is.
        if tok in c.eos_ids and not c.standin:
            seq.finish = "stop"
            return
        seq.out_ids.append(tok)
        if seq.emit:  # every token: the text side needs each id to detokenize and find stops
            seq.emit(M.Token(id=req.id, index=len(seq.out_ids) - 1, token_id=tok, text=""))

    def stats(self) -> dict:
        steps, rows = self.counters.get("steps"), self.counters.get("rows")
        tokens, nbytes = self.counters.get("decode_tokens"), self.counters.get("decode_bytes")
        return {"max_batch": self.max_batch, "active": len(self.active), "prefilling": len(self.filling),
                "steps": int(steps), "rows": int(rows), "max_rows": self.max_rows,
                "mean_size": rows / steps if steps else None,
                "decode_tokens": int(tokens), "decode_expert_bytes": int(nbytes),
                "expert_bytes_per_token": nbytes / tokens if tokens else None,
                "kv_used_bytes": self.kv_used, "kv_peak_bytes": self.kv_peak, "kv_pool_bytes": self.kv_pool}


class Compute:
    def __init__(self, store: Store, config: dict, source, pool_buf, slot_bytes: int,
                 experts_cls=None, eos: list[int] | None = None):
        self.store, self.config = store, config
        dense = store.dense_weights()
        cc = config["compute"]
        # Built in the stand-in too (never called there): the dense weights then take the memory
        # they take in a real run, so the pool the supervisor sizes after "ready" is the same.
        self.model = build_model(store.config, dense, store.manifest.get("dense_quantization"),
                                 cc["dtype"])
        self.dtype = self.model.dtype
        # Token ids only: the supervisor tokenizes and detokenizes (runtime/textside.py) and
        # passes the EOS ids (eos); in-process they are read from the tokenizer files as JSON
        # (no tokenizer library, but a parse that leaves ~13 MiB of heap on the demo store).
        self.eos_ids = set(eos) if eos is not None else eos_ids(store.tokenizer_dir, store.config)
        self.max_context = int(cc["max_context"])
        self.prefill_chunk = int(cc["prefill_chunk"])
        self.vocab = int(store.config["vocab_size"])
        experts_cls = experts_cls or SlotExperts
        self.routing, self.standin, self.bench_mode = bench_mode(
            store, config, "mmap" if issubclass(experts_cls, MmapExperts) else "slots")
        if self.standin:
            self.model = StandInModel(self.model.n_layers, store.moe_layers, self.vocab,
                                      self.standin["moe_ms"], self.standin["dense_ms"])
        self.experts = experts_cls(store, pool_buf, slot_bytes, source, self.dtype, routing=self.routing)
        # Where MLX could use shared memory in place (Metal), the probe says so; the owned
        # resident tier is what runs everywhere (workers/resident.py).
        self.expert_tier = {"kind": "owned", **probe_zero_copy()}
        self.experts.cache_config = config.get("cache") or {}
        if isinstance(self.experts, SlotExperts):
            self.experts.host_fills = bool(cc.get("host_fills", True))
            self.experts.hits_first = bool(cc.get("hits_first", True))
            self.experts.stream_misses = bool(cc.get("stream_misses", True))
            early = cc.get("early_fills", "auto")
            if early not in (True, False, "auto"):
                raise ValueError(f"compute.early_fills = {early!r}: use true, false or \"auto\"")
            gpu = mx.default_device().type == mx.DeviceType.gpu
            self.experts.take_early_fills = (gpu or bool(self.standin)) if early == "auto" else early
            leases = cc.get("leases", True)
            if leases not in (True, False):
                raise ValueError(f"compute.leases = {leases!r}: use true or false")
            self.experts.leases = leases
            eager = cc.get("eager_layers", "auto")
            if eager not in (True, False, "auto"):
                raise ValueError(f"compute.eager_layers = {eager!r}: use true, false or \"auto\"")
            self.experts.eager_layers = gpu if eager == "auto" else eager
            self.experts.pool_placement = str(cc.get("pool_placement", "auto"))
            if self.experts.pool_placement not in ("auto", "host", "device"):
                raise ValueError(f"compute.pool_placement = {self.experts.pool_placement!r}: use auto, host or device")
        if isinstance(self.experts, SlotExperts) and hasattr(source, "resident_slots"):
            self.experts.attach(pool_buf, slot_bytes, source.resident_slots(store))
        self.source = source
        self.counters = Counter()
        self.forward_latency = Latency()
        self.recorder = None
        self.request_rows: list[np.ndarray] = []
        self.trace_path = (config.get("runtime") or {}).get("record_trace") or None
        if self.trace_path:
            self.recorder = TraceRecorder(store.n_experts)
        # Decoding together needs the gate's own routing per row: a recorded trace is kept per
        # request, a replayed one and the stand-in route by pass, so those run one at a time.
        max_batch = int(cc.get("max_batch", 1))
        if self.recorder is not None or self.standin or self.routing.mode != "gate":
            max_batch = 1
        # The KV reserve (runtime/budget.py) in the itemsize the budget assumed for it.
        itemsize = ITEMSIZE.get(str(cc["dtype"])) or 4
        self.kv_token_bytes = kv_bytes_per_token(store.config, itemsize)
        kv_pool = self.kv_token_bytes * kv_reserve_tokens(self.max_context, int(cc.get("kv_tokens", 0)))
        self.scheduler = Scheduler(self, max_batch, kv_pool)

    def warm_up(self) -> None:
        """One pass with zero-filled expert weights before "ready": a GPU backend sets up its
        kernels and host buffers now (CUDA: hundreds of MiB), so the supervisor's measurement of
        the tree, which sizes the slot pool, already includes them. The stand-in runs no kernels."""
        if self.standin:
            return
        layout = self.store.layout(self.store.moe_layers[0])
        zeros = {t["name"]: mx.zeros([1, *t["shape"]], dtype=mx.uint32 if t["dtype"] == "uint32" else self.dtype)
                 for t in layout["tensors"]}

        def zero_experts(layer, x, inds):
            rows = x.reshape(-1, x.shape[-1])
            y = switch_glu(rows, mx.zeros((rows.shape[0], 1), dtype=mx.uint32), zeros, layout["quant"])
            return mx.broadcast_to(y, (*inds.shape, x.shape[-1])) * 0
        # One token: a prompt-sized pass would leave its buffers in the allocator and inflate the
        # measurement by about what the activation reserve already covers.
        mx.eval(self.model(mx.array([0], dtype=mx.int32), self.model.make_cache(), zero_experts))
        mx.clear_cache()

    # -- passes --------------------------------------------------------------------------------
    def forward(self, ids: list[int], cache, phase: str = "prefill"):
        """One pass over ids, evaluated and committed before returning (prefill, logits)."""
        t0 = time.perf_counter()
        p = self.experts.begin_pass(len(ids))
        logits = self.model(mx.array(ids, dtype=mx.int32), cache, self.experts)
        mx.eval(logits)
        rows = self.experts.commit(p, rows=self.recorder is not None)
        if rows is not None:
            self.request_rows.append(rows)
        self.forward_latency.add(time.perf_counter() - t0)
        self.counters.add(f"{phase}_forward_tokens", len(ids))  # live progress for the metrics stream
        return logits

    def preload(self) -> int:
        """Reads every expert into the resident tier where it can hold them all (cache.preload):
        a start-up step, outside any request. Returns the layers asked for."""
        n = 0
        while getattr(self.experts, "preload_step", lambda: False)():
            n += 1
        return n

    def _begin_request(self) -> None:
        self.request_rows = []  # a failed request's passes are not recorded

    def _end_request(self, name: str) -> None:
        """Recording: the request's routing becomes one `lengths` entry, and the file is saved
        (atomically) now, so a crash later still leaves every finished request."""
        if self.recorder is None:
            return
        if self.request_rows:
            self.recorder.append(np.concatenate(self.request_rows))
        self.recorder.end_request(name)
        self.recorder.save(self.trace_path)
        self.request_rows = []

    def abandon(self) -> None:
        """After a failed or cancelled request: passes left half-built are dropped, the router's
        pins go. Not the pass launched early for sequences still decoding (it advanced their
        caches), and the pins only once none decodes."""
        ahead = self.scheduler.ahead
        for p in list(self.experts.passes):
            if ahead is None or p != ahead.pass_no:
                self.experts.discard(p)
        if not self.scheduler.busy():
            self.source.release()

    def _check_ids(self, ids, extra: int = 0) -> None:
        if not ids:
            raise RequestError("empty prompt")
        if any((not isinstance(i, int)) or i < 0 or i >= self.vocab for i in ids):
            raise RequestError(f"token ids must be integers in [0, {self.vocab})")
        if len(ids) + extra > self.max_context:
            raise RequestError(f"prompt ({len(ids)} tokens) + max_tokens ({extra}) exceeds "
                               f"compute.max_context={self.max_context}")

    def logits(self, token_ids: list[int], name: str = "logits") -> np.ndarray:
        self._check_ids(token_ids)
        self._begin_request()
        cache = self.model.make_cache()
        out = None  # one float32 array filled chunk by chunk: the reply's only copy in this process
        for i in range(0, len(token_ids), self.prefill_chunk):
            part = self.forward(token_ids[i:i + self.prefill_chunk], cache)
            if out is None:
                out = np.empty((len(token_ids), part.shape[-1]), dtype=np.float32)
            out[i:i + part.shape[0]] = np.array(part.astype(mx.float32))
            del part
        self._end_request(name)
        return out

    def start(self, req: M.Generate, emit=None) -> Sequence:
        """A checked request as a sequence ready for the scheduler (`Scheduler.fits`/`add`);
        RequestError where the request itself is wrong. Prompt text was tokenized before it
        came here (runtime/textside.py): compute takes token ids only."""
        t_request = time.perf_counter()
        if req.token_ids is None:
            raise RequestError("compute takes token_ids; prompt text is tokenized by the supervisor")
        ids = list(req.token_ids)
        if req.max_tokens < 0 or req.temperature < 0 or not 0 < req.top_p <= 1:
            raise RequestError("max_tokens >= 0, temperature >= 0 and 0 < top_p <= 1 required")
        self._check_ids(ids, req.max_tokens)
        seed = req.seed if req.seed is not None else int.from_bytes(os.urandom(4), "little")
        return Sequence(req=req, prompt=ids, cache=self.model.make_cache(), key=mx.random.key(seed),
                        emit=emit, t_request=t_request,
                        kv_bytes=self.kv_token_bytes * sequence_kv_tokens(len(ids) + req.max_tokens))

    def generate(self, req: M.Generate, emit=None, between_tokens=None) -> M.Done:
        """One request alone, to its end (in-process callers; the process decodes several
        together through the scheduler). between_tokens: called between steps; a true result
        stops the sequence with finish "cancelled"."""
        seq = self.start(req, emit)
        sched = self.scheduler
        if sched.busy():
            raise RuntimeError("generate runs one request alone; the scheduler is busy")
        self._begin_request()
        sched.add(seq)
        while seq.t_end is None:
            sched.step()
            if seq.error is not None:
                raise seq.error
            if seq.t_end is None and between_tokens and between_tokens():
                sched.leave(seq, "cancelled")  # a cancel arrived meanwhile
        return self.done(seq)

    def done(self, seq: Sequence) -> M.Done:
        """A finished sequence's answer and stats. Decoded together with others, the stage split
        (ipc/wait/prepare) covers the steps it was part of, shared with them."""
        split0, loop0 = seq.marks["start"]
        split1, loop1 = seq.marks.get("first", (self._split(), dict(self.scheduler.loop)))
        t_add = split0["t"]
        t_first = seq.t_first if seq.t_first is not None else seq.t_end
        t_prefill, t_decode = t_first - t_add, seq.t_end - t_first
        out_ids, ids = seq.out_ids, seq.prompt
        n_decode = max(0, len(out_ids) - 1)  # the first token comes from the prefill pass
        split2 = self._split()
        stats = {"prompt_tokens": len(ids), "generated_tokens": len(out_ids),
                 "prefill_s": t_prefill, "decode_s": t_decode,
                 "prefill_tok_s": len(ids) / t_prefill if t_prefill else None,
                 "decode_tok_s": n_decode / t_decode if n_decode and t_decode else None,
                 "ttft_s": seq.ttft_s,
                 **{f"{k}_s": v - split0[k] for k, v in split2.items() if k in ("ipc", "wait", "prepare")},
                 "bench_mode": self.bench_mode}
        stats["total_s"] = t_prefill + t_decode
        stats["compute_s"] = max(0.0, stats["total_s"] - stats["ipc_s"] - stats["wait_s"] - stats["prepare_s"])
        # The decode phase alone (the benchmark's time per token): its stage split, expert uses,
        # hits, bytes the misses read, and what this process itself read from disk (the mmap
        # baseline's page faults; the loader reads in its own process).
        decode = {k: split2[k] - split1[k] for k in split2 if k != "t"}
        decode = {"tokens": n_decode, "total_s": t_decode, **{f"{k}_s": decode.pop(k) for k in ("ipc", "wait", "prepare", "sync")},
                  **decode}
        decode["compute_s"] = max(0.0, t_decode - decode["ipc_s"] - decode["wait_s"] - decode["prepare_s"])
        decode["loop"] = {f"{k}_s": v - loop1[k] for k, v in self.scheduler.loop.items()}
        stats["decode"] = decode
        self.counters.add("requests")
        self.counters.add("prompt_tokens", len(ids))
        self.counters.add("generated_tokens", len(out_ids))
        self.counters.add("prefill_s", t_prefill)
        self.counters.add("decode_s", t_decode)
        self.counters.add("decode_tokens", n_decode)
        self._end_request(str(seq.req.id))
        return M.Done(id=seq.req.id, text="", token_ids=out_ids, finish_reason=seq.finish or "length",
                      stats=stats)

    def _split(self) -> dict:
        e = self.experts
        disk = _disk_read_bytes()
        return {"t": time.perf_counter(), "ipc": e.t_ipc, "wait": e.t_wait, "prepare": e.t_prepare, "sync": e.t_sync,
                "uses": e.counters.get("uses"), "hits": e.counters.get("hits"),
                "miss_bytes": e.counters.get("miss_bytes"), "disk_read_bytes": disk or 0}

    def stats(self) -> dict:
        c = self.counters.snapshot()
        e = self.experts
        uses = e.counters.get("uses")
        busy = c.get("prefill_s", 0) + c.get("decode_s", 0)
        tier = getattr(e, "tier", None)
        return {**c, "forward": self.forward_latency.summary(), "prepare": e.prepare.summary(),
                "hit_rate": e.counters.get("hits") / uses if uses else None,
                "ipc_s": e.t_ipc, "wait_s": e.t_wait, "prepare_s": e.t_prepare, "sync_s": e.t_sync,
                "stall_share": e.t_wait / busy if busy else None,
                "decode_tok_s": c.get("decode_tokens", 0) / c["decode_s"] if c.get("decode_s") else None,
                "prefill_tok_s": c.get("prompt_tokens", 0) / c["prefill_s"] if c.get("prefill_s") else None,
                "prepare_bytes": int(e.counters.get("bytes")),
                # layers computed in pieces (hits first, misses as they land) and prefetch fills
                # taken before a layer asked (take_fills)
                "pipeline": {k: int(e.counters.get(k)) for k in ("hits_first", "streamed_misses", "early_fills", "leases")},
                "messages": e.source.messages.snapshot(),
                "expert_tier": {**self.expert_tier,
                                **({"resident_slots": tier.n_slots, "resident_bytes": tier.nbytes,
                                    "fills": tier.fills, "placement": tier.placement} if tier else {})},
                "mlx_active_bytes": mx.get_active_memory(), "mlx_peak_bytes": mx.get_peak_memory(),
                "batch": self.scheduler.stats(), "bench_mode": self.bench_mode}


def _disk_read_bytes() -> int | None:
    """Bytes this process made the kernel read from storage (Linux /proc/self/io), so a page-cache
    run shows how much of what it touched came from the disk."""
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))
    except (OSError, StopIteration, ValueError):
        return None


def evict_page_cache(store: Store) -> bool:
    """Asks the kernel to drop the store's expert files from the page cache (clean pages need no
    privileges), so an mmap run starts cold. False where posix_fadvise does not exist (macOS)."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for name in sorted({r.file for r in store.records.values()}):
        fd = os.open(store.path / name, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def local_router(store: Store, config: dict, n_slots: int = 0):
    """Router + Loader wired in-process over an anonymous staging pool, for tools and tests:
    n_slots resident slots (0: cache.max_slots, else every expert), split among the record
    layouts in proportion to their experts. Returns (source, staging buffer, loader)."""
    from deltafin.runtime import tiers
    from deltafin.workers.loader import Loader
    from deltafin.workers.router_process import router_for
    cache = config.get("cache") or {}
    n_slots = n_slots or int(cache.get("max_slots") or 0) or len(store.records)
    sizes = tiers.group_sizes(store)
    resident = tiers.whole_layers(store, tiers.split_resident(sizes, dict.fromkeys(sizes, 1), n_slots),
                                  cache.get("whole_layers", "auto"), gpu=mx.default_device().type == mx.DeviceType.gpu)
    n_staging = tiers.staging_slots(store, int((config.get("loader") or {}).get("threads", 4)),
                                    int(cache.get("staging_slots") or 0))
    pool = mmap.mmap(-1, n_staging * store.max_record_bytes)
    loader = Loader(store, memoryview(pool), store.max_record_bytes)
    return LocalExpertSource(router_for(store, CacheConfig(**cache), resident, n_staging), loader), memoryview(pool), loader


def run_inprocess(store_path, config: dict, prompt_ids: list[int], max_tokens: int,
                  source: str = "mmap", cold: bool = False) -> dict:
    """One greedy generation by `Compute` in this process, no supervisor or workers. source:
    "mmap" (the memory-mapped baseline: experts read through the page cache, no cache of our own)
    or "slots" (router + loader wired in-process, cache.max_slots resident slots, 0 = every
    expert). config: the plain dict tree (Config.to_dict()); [bench] is honoured.
    cold: drop the expert files from the page cache first. Returns the request's stats (as
    Done.stats) plus stage latencies, bytes touched and bytes the process read from disk."""
    store = Store(store_path)
    loader = None
    if source == "mmap":
        src = MmapSource(store)
        compute = Compute(store, config, src, None, 0, experts_cls=MmapExperts)
    elif source == "slots":
        src, staging, loader = local_router(store, config)
        compute = Compute(store, config, src, staging, store.max_record_bytes)
    else:
        raise ValueError(f"source {source!r}: use mmap or slots")
    if source == "slots" and (config.get("cache") or {}).get("preload", True):
        compute.preload()
    try:
        page_cache_dropped = evict_page_cache(store) if cold else False
        disk0 = _disk_read_bytes()
        done = compute.generate(M.Generate(id=1, token_ids=list(prompt_ids), max_tokens=max_tokens,
                                           stream=False))
        disk1 = _disk_read_bytes()
        e = compute.experts
        tokens = done.stats["prompt_tokens"] + done.stats["generated_tokens"]
        return {**done.stats, "token_ids": done.token_ids,
                "stage_latency": {"read": loader.read_latency.summary() if loader else None,
                                  "prepare": e.prepare.summary(),
                                  "compute": compute.forward_latency.summary()},
                "expert_uses": int(e.counters.get("uses")),
                "bytes_touched": int(e.counters.get("bytes")),
                "bytes_touched_per_token": e.counters.get("bytes") / max(1, tokens),
                "disk_read_bytes": None if disk0 is None else disk1 - disk0,
                "page_cache_dropped": page_cache_dropped,
                "messages": src.messages.snapshot()}
    finally:
        if loader is not None:
            loader.close()
        if source == "mmap":
            src.close()


# -- requests: one runs, the others wait in arrival order ----------------------------------------------
class QueueFull(RuntimeError):
    code = "queue_full"


@dataclass
class Queued:
    """A request compute took: who asked (the client's identity at the supervisor), when it
    arrived, and whether a cancel came for it while it ran."""
    client: bytes
    req: object          # M.Generate or M.Logits
    arrived: float
    cancelled: bool = False
    started: int = 0     # the queue's event number when it started running
    seq: object = None   # its Sequence, once checked (kept while it waits for room)


class RequestQueue:
    """compute's requests in arrival order: up to `max_batch` run (decoded together), at most
    `max_waiting` more wait behind them, more are refused (QueueFull). The supervisor admits at
    most max_batch + compute.max_queue requests in flight, so this bound is its second line (and
    the one in-process callers meet). A request is named by (client, id): ids are each
    client's own."""

    def __init__(self, max_waiting: int, max_batch: int = 1):
        self.max_waiting, self.max_batch = max_waiting, max_batch
        self.waiting: deque[Queued] = deque()
        self.running: list[Queued] = []
        self.counters = Counter()
        self.wait = Latency()
        # Starts and ends numbered in one sequence (Done.stats["order"]): with max_batch 1 a
        # request's [start, end] never encloses another's.
        self.events = itertools.count(1)

    def add(self, client: bytes, req) -> Queued:
        # Free batch places count as room: a request added then starts at the next step.
        if len(self.waiting) + len(self.running) >= self.max_waiting + self.max_batch:
            self.counters.add("refused")
            raise QueueFull(f"{len(self.waiting)} requests wait behind {len(self.running)} running "
                            f"(compute.max_queue={self.max_waiting}, max_batch={self.max_batch}); retry later")
        item = Queued(client, req, time.perf_counter())
        self.waiting.append(item)
        self.counters.add("queued")
        return item

    def next(self) -> Queued | None:
        """The oldest waiting request, now a running one (until `finish`)."""
        if not self.waiting:
            return None
        item = self.waiting.popleft()
        self.running.append(item)
        item.started = next(self.events)
        self.wait.add(time.perf_counter() - item.arrived)
        return item

    def finish(self, item: Queued | None = None) -> None:
        """The request ended (None: every running one)."""
        if item is None:
            self.running.clear()
        elif item in self.running:
            self.running.remove(item)

    def cancel(self, client: bytes, rid: int) -> Queued | None:
        """A waiting request leaves the queue and is returned, for the caller to answer; a
        running one is marked (its loop stops it at the next step, and answers it); None either
        way when it is not waiting (finished already, or unknown)."""
        for item in self.waiting:
            if item.client == client and item.req.id == rid:
                self.waiting.remove(item)
                self.counters.add("cancelled_waiting")
                return item
        for r in self.running:
            if r.client == client and r.req.id == rid and not r.cancelled:
                r.cancelled = True
                self.counters.add("cancelled_running")
        return None

    def stats(self) -> dict:
        return {"waiting": len(self.waiting), "max_queue": self.max_waiting, "max_batch": self.max_batch,
                "running": len(self.running), **self.counters.snapshot(), "wait": self.wait.summary()}


def run_compute_process(run_dir: str) -> None:
    import sys

    from deltafin.runtime.sockets import send
    from deltafin.workers.common import WorkerProcess

    class ComputeProcess(WorkerProcess):
        role = "compute"

        def setup(self):
            mx.set_cache_limit(int(self.run["budget"]["mlx_cache_bytes"]))
            self.store = Store(self.run["store"])
            self.data = self.connect_data_plane()
            self.source = RouterClient(self.data, self.config.compute.expert_timeout_s,
                                       self.parent_alive)
            # [distributed]: join the group first; the provider then computes this rank's share
            from deltafin.workers.distributed import Lockstep
            self.dist = Lockstep.from_config(self.config, self.store)
            # Dense weights load before "ready", so the supervisor's measurement includes them.
            self.compute = Compute(self.store, self.config.to_dict(), self.source, None, 0,
                                   experts_cls=self.dist.experts_cls if self.dist else None,
                                   eos=self.run["eos_ids"])
            if self.dist is not None:  # ranks run one request at a time, in step (serve_in_step)
                self.compute.scheduler.max_batch = 1
            self.queue = RequestQueue(self.config.compute.max_queue,
                                      self.compute.scheduler.max_batch)
            self.in_request = False
            if mx.default_device().type == mx.DeviceType.gpu:
                # GPU backends set up kernels and host buffers on first use; on the CPU backend
                # the first pass's buffers are what the KV and activation reserves already cover.
                self.compute.warm_up()

        def ready_info(self):
            return {"dtype": str(self.compute.dtype), "vocab_size": self.compute.vocab,
                    "gpu": mx.default_device().type == mx.DeviceType.gpu,
                    "bench_mode": self.compute.bench_mode, "expert_tier": self.compute.expert_tier}

        def on_pool(self, msg):
            # the resident tier is allocated now, inside the budget the supervisor just split
            self.compute.experts.attach(self.pool.buf, msg.slot_bytes, msg.resident)
            self.preloading = self.config.cache.preload

        def busy(self):
            return getattr(self, "preloading", False)

        def idle(self):
            if self.dist is not None and not self.dist.idle(self.compute):
                self.running = False  # rank 0 stopped: this follower's group is gone
            # one layer per loop turn: requests and the supervisor are answered in between
            if self.busy():
                try:
                    self.preloading = self.compute.experts.preload_step()
                except ExpertUnavailable as e:
                    print(f"deltafin compute: preload stopped: {e}", file=sys.stderr, flush=True)
                    self.compute.abandon()
                    self.preloading = False

        def on_forward(self, fwd: M.Forward):
            """A client's message relayed by the supervisor: a request joins the queue, a cancel
            marks or removes one. Between the tokens of a running request this runs again
            (poll_control), and then only queues: requests never nest."""
            try:
                req = M.decode(fwd.payload)
            except M.ProtocolError as e:
                return self.reply(fwd.client, M.Error(id=None, code="bad_message", message=str(e)))
            if isinstance(req, M.Cancel):
                item = self.queue.cancel(fwd.client, req.id)
                if item is not None:
                    self.answer_cancelled(item)
                return
            if not isinstance(req, (M.Generate, M.Logits)):
                return self.reply(fwd.client, M.Error(id=getattr(req, "id", None), code="bad_message",
                                                      message=f"compute does not take {req.TYPE}"))
            try:
                self.queue.add(fwd.client, req)
            except QueueFull as e:
                return self.reply(fwd.client, M.Error(id=req.id, code=e.code, message=str(e)))
            if not self.in_request:
                self.serve_queue()

        def reply(self, client: bytes, msg) -> None:
            send(self.control, M.Forward(client=client, payload=M.encode(msg)))

        def serve_queue(self) -> None:
            """Until nothing runs or waits: admit what fits, one scheduler step (one decode pass
            over every running sequence, one prefill chunk), answer what finished, then the
            control channel (stats, new requests, cancels) before the next step."""
            if self.dist is not None:
                return self.serve_in_step()
            self.in_request = True
            sched = self.compute.scheduler
            try:
                while True:
                    self.admit()
                    if not sched.busy():
                        break
                    for seq in sched.step(joining=bool(self.queue.waiting)):
                        self.answer_seq(seq)
                    self.poll_control()
                    for seq in list(sched.filling) + list(sched.active):
                        if seq.owner.cancelled or not self.running:
                            sched.leave(seq, "cancelled")
                            self.answer_seq(seq)
            finally:
                self.in_request = False

        def serve_in_step(self) -> None:
            """[distributed]: one request at a time, every rank running it in step with rank 0
            (workers/distributed.py `Lockstep.lead`); no batch, no pass launched ahead."""
            self.in_request = True
            try:
                while self.running and (item := self.queue.next()) is not None:
                    if item.cancelled:  # cancelled between leaving the queue and starting
                        self.queue.finish(item)
                        self.answer_cancelled(item)
                    elif isinstance(item.req, M.Generate):
                        self.answer_in_step(item)
                    else:
                        self.answer_logits(item, in_step=True)
            finally:
                self.in_request = False

        def answer_in_step(self, item: Queued) -> None:
            req, client = item.req, item.client
            queue_s = time.perf_counter() - item.arrived
            emit = lambda m: self.reply(client, m)  # every token, streamed or not: the text side needs them

            def between_tokens() -> bool:
                # the supervisor's messages meanwhile: stats, new requests (queued), cancels
                self.poll_control()
                return item.cancelled or not self.running
            try:
                req, between_tokens = self.dist.lead(req, between_tokens)
                done = self.compute.generate(req, emit=emit, between_tokens=between_tokens)
                done.stats["queue_s"] = queue_s  # the request's own times exclude its wait
                done.stats["order"] = [item.started, next(self.queue.events)]
                if done.finish_reason == "cancelled":
                    self.compute.abandon()  # the router's pins go; the KV cache went with the sequence
                    self.compute.counters.add("cancelled")
                self.reply(client, done)
            except (RequestError, ExpertUnavailable) as e:
                self.compute.abandon()
                self.reply(client, M.Error(id=req.id, code=e.code, message=str(e)))
                self.dist.after_error(e)
            except Exception as e:  # the model raised: report it and keep serving
                self.compute.abandon()
                self.reply(client, M.Error(id=req.id, code="internal", message=f"{type(e).__name__}: {e}"))
                self.dist.after_error(e)
            finally:
                self.queue.finish(item)

        def admit(self) -> None:
            """Waiting requests start in arrival order while the batch has room for them (a
            place and their KV cache); a logits request runs at once, whole."""
            sched = self.compute.scheduler
            while self.running and self.queue.waiting:
                item = self.queue.waiting[0]
                req = item.req
                if isinstance(req, M.Generate) and item.seq is None:
                    # every token, streamed or not: the supervisor's text side needs each id
                    emit = lambda m, c=item.client: self.reply(c, m)
                    try:
                        item.seq = self.compute.start(req, emit)
                    except RequestError as e:
                        self.queue.waiting.popleft()
                        self.reply(item.client, M.Error(id=req.id, code=e.code, message=str(e)))
                        continue
                    item.seq.owner = item
                if item.seq is not None and not sched.fits(item.seq):
                    return  # waits for a sequence to finish (FIFO: none overtakes it)
                if item.seq is None and sched.busy():
                    return  # a logits request runs alone, once the batch has drained
                self.queue.next()
                if item.seq is not None:
                    if not sched.busy():
                        self.compute._begin_request()
                    sched.add(item.seq)
                else:
                    self.answer_logits(item)

        def answer_cancelled(self, item: Queued) -> None:
            """A request cancelled before it started: nothing to free."""
            self.compute.counters.add("cancelled")
            req = item.req
            if isinstance(req, M.Generate):
                self.reply(item.client, M.Done(id=req.id, text="", token_ids=[], finish_reason="cancelled",
                                               stats={"prompt_tokens": 0, "generated_tokens": 0,
                                                      "queue_s": time.perf_counter() - item.arrived}))
            else:
                self.reply(item.client, M.Error(id=req.id, code="cancelled",
                                                message="cancelled before it started"))

        def answer_seq(self, seq: Sequence) -> None:
            """A sequence that left the batch: its Done, or its error."""
            item = seq.owner
            self.queue.finish(item)
            req, client = item.req, item.client
            if seq.error is not None:
                e = seq.error
                code = getattr(e, "code", None) if isinstance(e, (RequestError, ExpertUnavailable)) else None
                msg = str(e) if code else f"{type(e).__name__}: {e}"
                return self.reply(client, M.Error(id=req.id, code=code or "internal", message=msg))
            done = self.compute.done(seq)
            done.stats["queue_s"] = seq.marks["start"][0]["t"] - item.arrived  # its own times exclude its wait
            done.stats["order"] = [item.started, next(self.queue.events)]
            if done.finish_reason == "cancelled":
                self.compute.counters.add("cancelled")
                self.compute.abandon()  # the router's pins go; the KV cache went with the sequence
            self.reply(client, done)

        def answer_logits(self, item: Queued, in_step: bool = False) -> None:
            req, client = item.req, item.client
            try:
                if item.cancelled:
                    return self.answer_cancelled(item)
                if in_step:  # the other ranks run it too
                    req, _ = self.dist.lead(req, lambda: False)
                arr = self.compute.logits(list(req.token_ids), name=str(req.id))
                # msgpack packs the array's memory as it is: no tobytes() copy
                self.reply(client, M.LogitsResult(id=req.id, shape=list(arr.shape), dtype="float32",
                                                  data=memoryview(np.ascontiguousarray(arr, np.float32)).cast("B")))
                del arr
            except (RequestError, ExpertUnavailable) as e:
                self.compute.abandon()
                self.reply(client, M.Error(id=req.id, code=e.code, message=str(e)))
                if self.dist is not None:
                    self.dist.after_error(e)
            except Exception as e:  # the model raised: report it and keep serving
                self.compute.abandon()
                self.reply(client, M.Error(id=req.id, code="internal", message=f"{type(e).__name__}: {e}"))
                if self.dist is not None:
                    self.dist.after_error(e)
            finally:
                self.queue.finish(item)

        def stats(self):
            out = {**self.compute.stats(), "queue": self.queue.stats()}
            if self.dist is not None:
                e = self.compute.experts
                out["distributed"] = {**self.dist.info(), "exchanges": e.exchanges,
                                      "exchange_bytes": e.exchange_bytes}
            return out

        def teardown(self):
            if getattr(self, "dist", None) is not None:
                self.dist.stop()

    ComputeProcess(run_dir).serve()


if __name__ == "__main__":
    import sys

    # through the package module, not __main__: the classes other modules raise and subclass
    # (workers/distributed.py) are then the ones this process catches
    from deltafin.workers.compute import run_compute_process as run
    run(sys.argv[1])
