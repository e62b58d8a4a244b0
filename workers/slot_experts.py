"""The expert provider of the runtime: a MoE layer's experts from compute's resident tier.

`SlotExperts` keeps the experts it uses in its resident tier (workers/resident.py: MLX pools
filled once per load) and knows what the tier holds without asking anyone: when every expert of
the layer is resident, the gate's ids index a device-side expert->slot table and `gather_qmm`
runs on the pools inside the lazy graph, with no read-back, no message and no copy. Otherwise the
ids come back to the CPU (one sync); experts already resident cost nothing more, and the missing
ones are asked of the source (`need`, workers/sources.py), which has them read into staging
slots and tells compute to copy each into a resident slot (`apply`). The uses compute served
alone are reported without waiting (`used`), so the cache policy still sees every hit. Where the
router prefetches, a layer that reads its gate back also applies the next layer's gate to its
input and asks for those experts ahead (`need` with lease, sent behind its own need), so two
requests are in flight while it waits and computes. Each expert's result depends only on its own
tokens and weights, so the output is the same whatever the memory budget, the slot assignment or
the order experts arrive in.

With the opt-in lossy mode (`[lossy] mode = "cache_aware"`, runtime/lossy.py) a layer whose ids
come back is rerouted first (`_reroute`): the model hands its gate logits over (`gate_logits`)
and missing experts may give way to resident ones; with it off nothing changes and the output
stays exact.

A layer not all resident runs one of three ways: its experts made resident by one need, then one
call (`_one_need`); in pieces while its misses are read (`_in_pieces`); or in chunks of the
layer's slots where it uses more experts than it has slots (`_in_chunks`).
"""
from __future__ import annotations

import time

import mlx.core as mx
import numpy as np

from deltafin.protocol import messages as M
from deltafin.runtime import lossy
from deltafin.runtime.benchmode import Routing
from deltafin.runtime.config import BenchConfig, CacheConfig, LossyConfig
from deltafin.runtime.models.decoder import RunAheadMiss
from deltafin.runtime.models.switch import in_token_order, pairs_of, run_pairs, switch_glu
from deltafin.runtime.store import Store
from deltafin.workers.passes import ExpertProvider
from deltafin.workers.device_waits import DeviceWaits
from deltafin.workers.pipeline import Pipeline, on_gpu
from deltafin.workers.resident import ResidentTier
from deltafin.workers.router_process import prefetch_setting
from deltafin.workers.sources import ExpertSource, ExpertUnavailable

# A layer runs ahead while the decayed share of its passes that found every chosen expert resident
# stays at this: a kept layer saves the device's wait for the host, a missed one computes again
# and learns its misses one layer later (about as much), so it pays above one in two.
AHEAD_ODDS, AHEAD_DECAY = 0.5, 0.9
# The next token's leases (bench.next_leases) go out while the decayed share of those read that one of
# the next NEXT_WINDOW passes used stays at NEXT_ODDS (every NEXT_PROBE-th pass anyway, to keep
# measuring it). A read used saves a need's wait; a wasted one costs disk time and a victim. On
# issue 28's store at 25%, this CPU, real supervisors: a quarter of them used within 4 passes, the
# misses 15% fewer for 30% more reads (docs/BENCHMARKS.md, stop 57).
NEXT_ODDS, NEXT_DECAY, NEXT_PROBE, NEXT_WINDOW = 0.2, 0.95, 8, 4


class SlotExperts(ExpertProvider):
    """The ExpertProvider of the runtime: experts from compute's resident tier, filled from the
    shared-memory staging slots the router has the loader read into."""

    def __init__(self, store: Store, staging_buf, slot_bytes: int, source: ExpertSource, dtype,
                 routing: Routing | None = None, pipeline: Pipeline | None = None,
                 cache: CacheConfig | None = None, lossy_cfg: LossyConfig | None = None):
        """pipeline: how reads overlap compute (workers/pipeline.py; None: the runtime's on this
        backend); cache: the [cache] section (whether the router prefetches); lossy_cfg: the
        [lossy] section (None: off, exact)."""
        super().__init__(store, source, dtype, routing)
        self.staging, self.slot_bytes = staging_buf, slot_bytes
        self.tier: ResidentTier | None = None
        self.force_sync = False  # measurement only: read every layer's ids back, resident or not
        self.cache_config = cache or CacheConfig()
        self.pipe = pipeline or Pipeline.resolve(BenchConfig(), gpu=on_gpu(), standin=False)
        self.hints = False  # gate lookahead for the router's prefetch (on where it prefetches)
        self._lease = None  # (next layer, its lookahead's experts, False), sent with this layer's need
        self._inflight = None  # the layer in pieces while its need waits (_in_pieces)
        self._look = None  # (next layer, its gate's ids on this layer's input), until sent
        self._hints: list = []  # lookahead hints to send with the layer's need or lease (fold_notes)
        self.lossy = lossy_cfg or LossyConfig()
        self._gate = None  # (layer, its gate's logits) where a lossy mode reroutes it
        self.rerouted_most = 0  # the most experts replaced in one token's row of a layer
        self._ahead_on = False  # this pass's partial layers run ahead (begin_ahead)
        self._ahead: list[dict] = []  # the layers that ran ahead, oldest first, their routing not read back yet
        self._redo = None  # (layer, its ids on the CPU): the layer to compute again, as told
        self._missed_from: dict | None = None  # at this pass's first run-ahead miss: the time ("t") and `waits()`
        self._odds: dict[int, float] = {}  # layer -> decayed share of its rows all resident (1 at first)
        self._foreseen: set[int] = set()  # after a miss: later layers that chose a missing expert on its wrong output
        self._foreseen_out: list = []  # (layer, experts, True): their leases (sure), sent behind the next need
        self._unforeseen: list[dict] = []  # check_each: layers a miss forgot, their routing not read back yet
        self._logits: dict[int, mx.array] = {}  # next_leases: this pass's gate logits per partial layer
        self._next_sent: list[list] = []  # next_leases: [passes left, layer, expert] leased, not yet used
        self._next_odds, self._next_probe = 1.0, 0  # next_leases: decayed share used, passes held back
        self._deferred: dict | None = None  # defer_needs: a need answered early, its fills still to land
        self._filling: tuple | None = None  # (layer, missing experts) while that need's own fills land
        self.lookups: DeviceWaits | None = None  # bench.device_waits: the device's lookups (attach)
        self._waiting_on = False  # this pass's streaming layers look their experts up on the device
        self._served: dict[int, int] = {}  # layer -> experts it was missing, read while the device waited
        self._last_y = None  # the latest output of a layer looked up on the device (the pass's end marker follows it)
        self._serving = False  # a need sent while the device waits: its fills write without settles

    def attach(self, staging_buf, slot_bytes: int, resident: dict) -> None:
        """The staging segment and the resident slots per group (the process: at attach_pool)."""
        self.detach()  # a tier attached before lets its staging go
        self.staging, self.slot_bytes = staging_buf, slot_bytes
        n_keys = self.store.n_experts * len(self.store.moe_layers)
        # Pools in host memory where experts stream (a group with fewer slots than experts) and
        # unless told otherwise: a group holding every expert of its layers (the whole tier, or
        # whole layers) is read faster from device memory.
        self.tier = ResidentTier(self.store, self.dtype, resident,
                                 host_writes=None if self.pipe.host_fills else False,
                                 on_host="streaming" if self.pipe.host_pools else False,
                                 copies=self.pipe.device_copies)
        if self.tier.copies is not None:  # the driver copies records straight out of staging
            self.tier.placement["pinned"] = self.tier.copies.pin(staging_buf)
            if self.tier.copies.pin_error is not None:
                self.tier.placement["pin_error"] = f"cuMemHostRegister refused (CUresult {self.tier.copies.pin_error})"
            # bench.batch_copies: the fills acknowledged together are waited for once, just before
            # their acknowledgement (which gives their staging slots back); compute builds no
            # graph between a fill and it (RouterClient._ack runs before any need or poll returns)
            if self.pipe.batch_copies and hasattr(self.source, "before_ack"):
                self.tier.defer_copies = True
                self.source.before_ack = self.tier.settle_copies
        self.hints = (self.routing.mode == "gate" and
                      prefetch_setting(self.cache_config, sum(self.tier.n_slots.values()), n_keys) is not False)
        if self.pipe.device_waits and self.lookups is None and \
                any(self.tier.streams(g) for g in self.tier.n_slots):
            limit = getattr(self.source, "timeout_s", 60.0) + 5.0  # the host's own need timeout comes first
            self.lookups = DeviceWaits.open(list(self.store.moe_layers), self.store.n_experts, self.store.top_k,
                                          limit_s=limit)
        if self.lookups is not None:  # a new tier: published whole before its first pass
            self.tier.on_drop = self.lookups.drop
            self.lookups.published = -1

    def detach(self) -> None:
        """Lets the staging segment go before it is unmapped (the driver's pinning of it)."""
        if self.tier is not None and self.tier.copies is not None:
            self.tier.copies.unpin()  # its copies done first
        if getattr(self.source, "before_ack", None) is not None:
            self.source.before_ack = None  # the tier it waited for is let go

    def wants_lookahead(self, layer: int) -> bool:
        """Whether the model should apply the next MoE layer's gate to this layer's input: only
        where the router prefetches and this layer reads its gate back anyway (not all resident)."""
        if self._waiting_on or (self._ahead_on and self.pipe.ahead_launch == "pass" and
                                (self._redo is not None or self._goes_ahead(layer))):
            return False  # read back at the pass's end, or its ids known: no lead to give
        return self.hints and not self.tier.full(layer) and not self.force_sync

    def lookahead(self, layer: int, inds) -> None:
        self._look = (layer, inds)

    def _send_hint(self, ids) -> None:
        """Evaluates the lookahead with this layer's ids (one sync for both) and sends it."""
        look, self._look = self._look, None
        if look is None:
            return
        self._complete_deferred()
        mx.eval(*((ids,) if isinstance(ids, mx.array) else ()), look[1])  # ids may be read back already
        self.counters.add("hints")
        experts = sorted(set(np.array(look[1]).reshape(-1).tolist()))
        if self.pipe.fold_notes:  # rides the layer's need or lease (`_notes_out`)
            self._hints.append([look[0], experts])
        else:
            self.source.hint([[look[0], experts]])
        # The same experts asked as a lease, sent right behind this layer's need (or alone where
        # it has none): the router reads them while this layer waits and computes. At most half
        # of the layer's pool, so a lease never leaves the next need short of slots.
        if self._leasable(look[0], experts):
            self._lease = (look[0], experts, False)

    def _leasable(self, layer: int, experts: list[int]) -> bool:
        """Whether a later layer's experts may be asked as a lease: leases on, a source that takes
        them, and at most half the layer's pool (a lease never leaves a need short of slots)."""
        return (self.pipe.leases and self.source.takes_leases
                and len(experts) <= self.tier.n_slots[self.tier.group_of[layer]] // 2)


    def _in_pieces(self, layer: int, x, inds, flat: np.ndarray, experts: list[int]):
        """A layer with misses, computed in pieces so that compute does not sit idle while they
        are read: with `hits_first` its resident experts' (token, expert) pairs are launched
        (mx.async_eval) before the need is sent; with `stream_misses`, where fills write the pools
        in place, each missing expert's pairs are launched as its fill lands (`apply`), so its
        compute overlaps the reads of the others; the misses not launched so far run after the
        need. The pieces are joined in (token, k) order. Each pair's result depends only on its
        row and expert (as in `_in_chunks`), so the output is the one-call output, bit for bit.
        A fill that would overwrite a slot a piece in flight reads waits for them."""
        fly = self._flight(layer, x, flat, experts)
        ids1 = fly["ids1"]
        hit = self.tier.slot_of[layer][ids1] >= 0
        hits_run = self.pipe.hits_first and hit.any()
        self._inflight = fly
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
        return self._reads_pools(in_token_order(fly["pieces"], fly["orders"], inds.shape[:-1],
                                                fly["k"], x.shape[-1]), layer)

    def _flight(self, layer: int, x, flat: np.ndarray, experts: list[int]) -> dict:
        """A layer in pieces: its rows and ids, its misses still waiting, the pieces launched and
        the slots they read (which a fill into the same group must wait for)."""
        tier, g = self.tier, self.tier.group_of[layer]
        ids1 = flat.reshape(-1)
        return {"layer": layer, "group": g, "slots": set(), "pieces": [], "orders": [],
                "waiting": set(tier.missing(layer, experts)), "x2": x.reshape(-1, x.shape[-1]),
                "k": flat.shape[-1], "ids1": ids1,
                "stream": self.pipe.stream_misses and bool(tier.host[g])}

    def _launch(self, fly: dict, pairs: np.ndarray, run: bool = True) -> None:
        """One piece of a layer in pieces: the pairs' SwiGLU on their slots, launched at once
        (run) or left in the layer's graph."""
        tier, layer = self.tier, fly["layer"]
        slots = tier.slots(layer, fly["ids1"][pairs])
        piece = run_pairs(fly["x2"], fly["k"], pairs, slots, tier.weights(layer), tier.quant(layer),
                          fly["ids1"].size, evaluate=False)
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

    def _reads_pools(self, y, layer: int):
        """y reads the pools lazily (layer's slots): kept as its pass's latest such output (it
        depends on every earlier one of the pass), so a fill writing the pools' memory in place
        can evaluate it first; the layer is noted as one whose slots a graph may still read
        (`_may_read`) until a read-back proves it done (`_done_below`) or the pass settles."""
        self.current["reads"] = y
        self.current.setdefault("open", set()).add(layer)
        return y

    def _done_below(self, layer: int) -> None:
        """This pass's routing of `layer` was read back: it depends on the output of every MoE
        layer before it in the pass, so their graphs, and the slots they read, are done."""
        rec = self.current
        if rec is not None and rec.get("open"):
            rec["open"] = {lay for lay in rec["open"] if lay >= layer}

    def _may_read(self, layer: int) -> bool:
        """Whether a graph of an open pass, not known to be done, reads `layer`'s slots."""
        return any(layer in rec.get("open", ()) for rec in self.passes.values())

    def _may_read_group(self, g: str) -> bool:
        """Whether a graph of an open pass, not known to be done, reads slots of group g."""
        return any(self.tier.group_of[layer] == g for rec in self.passes.values() for layer in rec.get("open", ()))

    def _settle(self, current: bool = True) -> None:
        """Evaluates what the open passes have built on the pools, before a fill writes them in
        place (ResidentTier.host): an unevaluated graph would read the new expert. Where a gate
        was read back this is already done, and costs nothing."""
        if current:
            self._complete_deferred()
        # current False (the fills of a need answered early): only the passes before this one,
        # launched; this one's graph waits for those very fills and reads none of the old experts
        # they replace (`_defer`)
        recs = [rec for rec in self.passes.values() if current or rec is not self.current]
        pending = [rec.pop("reads") for rec in recs if "reads" in rec]
        for rec in recs:
            rec.pop("open", None)
        if pending:
            mx.eval(pending)
            self.counters.add("settles")

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
        if in_place and self._serving:
            self.counters.add("fills_unsettled")  # the device waits: nothing launched reads the slot
        elif in_place:
            # A slot is read only by graphs of the layer whose expert it held, and slot 0 also by
            # a layer running ahead, for a missing expert's rows (never kept, but a read racing
            # the write is left to no cache): where no graph still open may read the slot, the
            # write waits for nothing.
            last = self.tier.last_layer[g][msg.slot]
            if (last is not None and self._may_read(last)) or (msg.slot == 0 and self._may_read_group(g)):
                own = self._filling is not None and msg.layer == self._filling[0] and msg.expert in self._filling[1]
                self._settle(current=not own)
            else:
                self.counters.add("fills_unsettled")
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
        if not self.pipe.early_fills or self._deferred is not None:
            return False  # a need answered early: every fill waits for its answer (`_complete_deferred`)
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

    def ensure(self, layer: int, experts: list[int], early: bool = False) -> bool:
        """Makes the experts resident together; counts their uses. False when they all were (no
        message: their use is reported later); True when a need was sent (it reports them).
        early: the need may be answered before its reads land (`_defer`)."""
        missing = self.tier.missing(layer, experts)
        self.counters.add("uses", len(experts))
        self.counters.add("hits", len(experts) - len(missing))
        leases = self._take_leases()  # the next layer's (and foreseen ones), asked behind this need
        if not missing:
            self._notes_out(leases + self._foresee_late())  # nothing more where no miss forgot layers
            return False
        self.counters.add("miss_bytes", len(missing) * self.store.layout(layer)["nbytes"])
        t0, prep0 = time.perf_counter(), self.t_prepare
        hints, self._hints = self._hints, []
        if self.pipe.fold_notes:  # the router takes the hints and earlier uses first, in order
            uses = self.unreported_uses()
        else:
            self.flush()
            uses = None
        if self._unforeseen:  # read back once the need is out: its read overlaps the device's wait
            leases = (lambda first=leases: first + self._foresee_late())
        granted = self.source.need(layer, experts, self.apply, leases=leases, hints=hints, uses=uses,
                                   early=early)
        if self._unforeseen:  # a source that takes no leases: foreseen all the same (`_goes_ahead`)
            self._foresee_late()
        if granted.pending:
            self._defer(layer, granted, t0, prep0)
        else:
            self._granted(layer, granted, t0, prep0)
        return True

    def _granted(self, layer: int, granted, t0: float, prep0: float, spent: float = 0.0) -> None:
        """A need's final answer: the time since t0 (fills' copies aside, and `spent` before it)
        counted as waiting for reads and as messaging, and compute's map checked against it."""
        took = time.perf_counter() - t0 - (self.t_prepare - prep0)
        self.t_wait += min(granted.wait_s, took)
        self.t_ipc += max(0.0, took - granted.wait_s) + spent
        for e, slot in granted.slots:
            if not self.tier.holds(layer, e, slot):
                raise ExpertUnavailable(f"compute's residency map disagrees with the router on layer "
                                        f"{layer} expert {e} (slot {slot})")

    def _can_defer(self, layer: int) -> bool:
        """Whether a need of this layer may be answered early (bench.defer_needs): in a pass run
        ahead at once, from the router's process, where fills write the pools in place (a graph
        built before a fill then reads what the fill wrote)."""
        return (self._ahead_on and self.pipe.defer_needs and self.pipe.ahead_launch == "pass"
                and self.source.takes_leases and bool(self.tier.host[self.tier.group_of[layer]]))

    def _defer(self, layer: int, granted, t0: float, prep0: float) -> None:
        """A need answered early: the slots its experts hold or will hold are known, their reads
        under way. An expert compute does not find in its slot (a miss, or one the router read
        again elsewhere, its fill still to come) is still to land; what that slot holds now is
        forgotten at once, so nothing built from here on reads it. Every fill sent before the
        answer has been applied (the socket keeps the router's order). The fills land, and the
        final answer comes, before anything is evaluated (`_complete_deferred`, called by every
        read-back and at the pass's end)."""
        tier = self.tier
        missing = [e for e, slot in granted.slots if not tier.holds(layer, e, slot)]
        for e, slot in granted.slots:
            if e in missing:
                tier.drop(layer, slot)  # its old expert: gone for what is built from now on
        self._deferred = {"req": granted.pending, "layer": layer, "missing": missing,
                          "slots": dict(granted.slots), "spent": time.perf_counter() - t0 - (self.t_prepare - prep0)}
        self.counters.add("deferred_needs")

    def _complete_deferred(self) -> None:
        """The need answered early, finished: its fills applied as they land (settling only the
        passes before this one, whose graphs are launched; this pass's graph reads none of the
        slots' old experts), then the fills held back meanwhile; the wait counted."""
        d, self._deferred = self._deferred, None
        if d is None:
            return
        t0, prep0 = time.perf_counter(), self.t_prepare
        self._filling = (d["layer"], set(d["missing"]))
        try:
            granted = self.source.finish(d["req"], d["layer"], d["missing"], self.apply)
        finally:
            self._filling = None
        self._granted(d["layer"], granted, t0, prep0, d["spent"])

    def _host(self, ids) -> np.ndarray:
        """As ExpertProvider's, a need answered early finished first."""
        if isinstance(ids, mx.array):
            self._complete_deferred()  # a read-back evaluates the graph: the fills first
        return super()._host(ids)

    def preload_step(self) -> bool:
        """Where the resident tier holds every expert of a group (the budget allows it), asks for
        the next layer of it that is not all resident: once all are, no layer ever syncs or asks
        again. One layer per call, so a caller can keep answering between layers. False when
        there is nothing (more) to load."""
        if self.tier is None:
            return False
        for layer in self.store.moe_layers:
            g = self.tier.group_of[layer]
            if self.tier.streams(g) or self.tier.full(layer):
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
        """Every expert resident: no pass ever stops to wait. Where experts stream, with
        `early_passes` and the pass run ahead at once, a pass is launched once the last one's
        routing is checked (at its end: nothing of it can miss any more), before its token is
        read; a fill for the new pass that writes a slot the last one's tail may still read
        settles that first (`apply`), as between the layers of one pass."""
        if self.tier is None or self.force_sync:
            return False
        return self.tier.all_full() or (self.pipe.early_passes and self.pipe.run_ahead
                                        and self.pipe.ahead_launch == "pass")

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
        """The layer's experts' output [..., k, D] for x [..., D] and the gate's ids [..., k]."""
        ids = self.routing.choose(layer, inds)  # the gate's ids (on the device), or the trace's
        tier = self.tier
        if self._waiting_on and tier.streams(tier.group_of[layer]):
            return self._run_waiting(layer, x, ids)
        if tier.full(layer) and not self.force_sync:
            return self._all_resident(layer, x, inds, ids)
        judged = False
        if self._redo is not None:  # the layer that ran ahead on a missing expert, again: its ids are known
            (at, flat), self._redo, self._look = self._redo, None, None
            assert at == layer, f"layer {layer} computed where layer {at} was to be computed again"
        else:
            if self._ahead_on:
                depth = self.pipe.ahead_depth
                if self._goes_ahead(layer):
                    if self.pipe.ahead_launch == "pass":  # checked at the pass's end
                        return self._run_ahead(layer, x, ids)
                    if self.pipe.launch_first:
                        # launched before the layers that ran ahead before it are checked: the
                        # device computes this one while the host waits for their routing
                        y = self._run_ahead(layer, x, ids)
                        self._check_pending(keep=depth)
                        return y
                    self._check_pending(keep=depth - 1)  # checked, then launched
                    return self._run_ahead(layer, x, ids)
                # one drain for the layers pending and this one's routing (and its lookahead)
                self._check_pending(also=(ids, *(() if self._look is None else (self._look[1],))))
                judged = True
            flat = self._read_ids(layer, x, ids)
        experts = np.unique(flat).tolist()
        early = self.take_fills(layer, experts)
        if judged:  # not run ahead: would it have been kept? (the odds keep being measured)
            self._judge(layer, not tier.missing(layer, experts))
        if self._gate is not None:
            flat = self._reroute(layer, flat)
            experts = np.unique(flat).tolist()
        g = tier.group_of[layer]
        if len(experts) > tier.n_slots[g]:
            return self._in_chunks(layer, x, inds, flat, experts)
        missing = len(tier.missing(layer, experts))
        if missing and ((self.pipe.hits_first and missing < len(experts)) or
                        (self.pipe.stream_misses and tier.host[g])):
            return self._in_pieces(layer, x, inds, flat, experts)
        return self._one_need(layer, x, inds, flat, experts, flush_ahead=early and not missing)

    # -- running ahead ------------------------------------------------------------------------------
    def begin_pass(self, n_tokens: int, rows: bool = True) -> int:
        """As ExpertProvider's; nothing runs ahead or waits on the device unless the model asks
        for it in this pass (`begin_ahead`), whatever a pass that failed left."""
        self._ahead_on = self._waiting_on = False
        return super().begin_pass(n_tokens, rows)

    def begin_ahead(self, rewinds: bool) -> bool:
        """Whether the model's pass should run its partially resident MoE layers ahead of their
        routing's read-back (the model's `_run_ahead`): where the pipeline does (`run_ahead`), the
        model can take its attention back (rewinds), the gate routes, nothing reroutes or
        forces syncs, and the pass is one token (a row of k experts, most often all resident)."""
        # left by a pass that failed before it evaluated (never otherwise): its fills come as any
        # others and are applied as they land (its final answer, if any, is dropped as stale)
        self._deferred = None
        self._ahead, self._redo, self._logits, self._missed_from = [], None, {}, None
        self._foreseen, self._foreseen_out, self._unforeseen = set(), [], []
        self._ahead_on = bool(rewinds and self.pipe.run_ahead and self.tier is not None
                              and not self.tier.all_full() and self.routing.mode == "gate"
                              and not self.force_sync and self.lossy.mode != "cache_aware"
                              and self.current is not None and self.current["n"] == 1)
        self._waiting_on = self._ahead_on and self.lookups is not None
        if self._waiting_on:
            self._served, self._last_y = {}, None
            self.tier.settle_copies()  # every fill applied so far is in its slot: published
            self.lookups.publish(self.tier)
            self.lookups.begin()
        return self._ahead_on

    def end_ahead(self) -> None:
        """The pass's layers that ran ahead and are not checked yet are checked (may raise
        RunAheadMiss); with next_leases, their gate logits read back in the same drain and the next
        token's leases sent (`_lease_next`)."""
        layers = sorted(self._logits)
        scores = mx.stack([self._logits[layer].reshape(-1) for layer in layers]).astype(mx.float32) if layers else None
        if self._waiting_on:
            self._end_waiting(scores)
        else:
            self._check_pending(also=() if scores is None else (scores,))
        self._ahead_on = self._waiting_on = False
        if self._missed_from is not None:
            # what this pass's misses cost: from the first found to the pass checked whole (its
            # needs, the layers computed again and their drains), the time a kept pass never spends,
            # and of it the time in each kind of wait (the rest: the host building the layers again,
            # and what it evaluates outside the split, such as a fill's settle)
            then, now = self._missed_from, {"t": time.perf_counter(), **self.waits()}
            self.counters.add("missed_passes")
            self.counters.add("miss_s", now["t"] - then["t"])
            for kind in self.WAITS:
                self.counters.add(f"miss_{kind}_s", now[kind] - then[kind])
            self._missed_from = None
        if scores is not None:
            self._lease_next(layers, self._host(scores))

    def _lease_next(self, layers: list[int], scores: np.ndarray) -> None:
        """bench.next_leases: consecutive tokens share most of a layer's experts, and of the experts
        a token takes up that the one before did not, the one before's runner-up (its gate's best
        expert outside its top-k) is often one (issue 28's store: 29% of them; LRU at 25% of the
        experts: a quarter fewer misses, docs/probes/next_token.py). So at a pass's end each partial
        layer's runner-up, where missing, is asked as a lease (sure: the router reads it into the
        policy's victim), read while the next pass is built; while the next NEXT_WINDOW passes use
        too few of them (NEXT_ODDS), only every NEXT_PROBE-th pass asks."""
        chosen: dict[int, set] = {}
        for layer, ids in self.current["used"]:
            if isinstance(ids, np.ndarray):
                chosen.setdefault(layer, set()).update(ids.reshape(-1).tolist())
        waiting = []  # the guesses of the last passes, judged by this pass's uses
        for guess in self._next_sent:
            used = guess[2] in chosen.get(guess[1], ())
            guess[0] -= 1
            if used or not guess[0]:
                self.counters.add("next_used", used)
                self._next_odds = NEXT_DECAY * self._next_odds + (1 - NEXT_DECAY) * used
            else:
                waiting.append(guess)
        self._next_sent = waiting
        if self._next_odds < NEXT_ODDS:
            self._next_probe += 1
            if self._next_probe % NEXT_PROBE:
                return
        leases = []
        for layer, row in zip(layers, scores):
            mine = chosen.get(layer)
            if not mine:
                continue
            runner_up = next((e for e in np.argsort(-row, kind="stable").tolist() if e not in mine), None)
            if runner_up is not None and self.tier.missing(layer, [runner_up]) and self._leasable(layer, [runner_up]):
                leases.append((layer, [runner_up], True))
                self._next_sent.append([NEXT_WINDOW, layer, runner_up])
        if leases:
            self.counters.add("next_leases", len(leases))
            self._notes_out(leases)

    # -- the device's lookups (bench.device_waits) -------------------------------------------------
    def _run_waiting(self, layer: int, x, ids):
        """A layer of a streaming group in a pass run ahead with the device's lookups: its chosen
        experts looked up on the device when it reaches the layer, which waits there for a missing
        one (`_serve`). The same call as `_one_need`'s once its experts are resident: the same
        slots, the same rows, the same kernel. Nothing of the pass is launched before its end
        (`_end_waiting`), so the fills taken while it is built write slots no launched graph reads
        (a dropped expert is marked missing in the table before its slot is written)."""
        self.take_fills(layer, [])
        tier, lookups = self.tier, self.lookups
        tier.settle_copies()
        lookups.publish(tier)
        y = switch_glu(x, lookups.slots(layer, ids), tier.weights(layer), tier.quant(layer))
        self._ahead.append({"layer": layer, "ids": ids})
        self.counters.add("ran_ahead")
        self._last_y = y
        return y

    def _end_waiting(self, scores) -> None:
        """The pass launched whole, with a marker behind its last looked-up layer; the host answers
        the device's requests until the marker has run (`DeviceWaits.wait`), then reads the
        pass's routing back (done by then) and notes its uses."""
        lookups, recs = self.lookups, self._ahead
        self._ahead = []
        if self._last_y is None:
            return
        t0 = time.perf_counter()
        mx.async_eval(lookups.marker(self._last_y), *[rec["ids"] for rec in recs], *(() if scores is None else (scores,)))
        sync0, served0 = self.t_sync, self.counters.get("device_wait_s")
        try:
            lookups.wait(self._serve, timeout_s=lookups.limit_s + 5.0)
        except BaseException:
            lookups.abandon()  # the device's waits end (what it computes is dropped with the pass)
            raise
        # the time not spent in a need: the device's compute, waited for
        self.t_sync = sync0 + (time.perf_counter() - t0) - (self.counters.get("device_wait_s") - served0)
        for rec in recs:
            self.counters.add("gate_syncs")
            self._note_checked(rec["layer"], self._host(rec["ids"]).reshape(-1, rec["ids"].shape[-1]),
                               self._served.get(rec["layer"]))
        self._notes_out(self._take_leases())

    def _note_checked(self, layer: int, flat: np.ndarray, missed: int | None = None) -> None:
        """A layer's routing read back once it computed: its uses counted, all hits but the
        `missed` experts read while the device waited (whose need reported the layer's uses),
        noted for the router where no need did."""
        n = len(set(flat.reshape(-1).tolist()))
        self.counters.add("uses", n)
        self.counters.add("hits", n - (missed or 0))
        self._note(layer, flat, report=missed is None, count=False)

    def _serve(self, layer: int, experts: list[int]) -> None:
        """The device waits at `layer` for experts it found missing: the layer's need (its resident
        experts pinned, the missing read), then the table published. Its fills write without
        settling: while the device waits, every graph before the layer has run and none after it
        has looked a slot up."""
        t0, prep0 = time.perf_counter(), self.t_prepare
        tier = self.tier
        experts = sorted(set(experts))
        missing = tier.missing(layer, experts)
        if missing:
            self.counters.add("device_waits")
            self.counters.add("miss_bytes", len(missing) * self.store.layout(layer)["nbytes"])
            self._serving = True
            try:
                granted = self.source.need(layer, experts, self.apply)
            finally:
                self._serving = False
            tier.settle_copies()
            self._granted(layer, granted, t0, prep0)
            self._served[layer] = self._served.get(layer, 0) + len(missing)
        else:  # made resident since the table was published
            self.counters.add("device_waits_stale")
        self.lookups.publish(tier)
        self.counters.add("device_wait_s", time.perf_counter() - t0)

    def _goes_ahead(self, layer: int) -> bool:
        """Whether a partially resident layer runs ahead now, by its odds (`_judge`); never one
        whose miss is foreseen (`_foresee`). Where a pass's layers are launched and checked
        together (ahead_launch "pass"), a miss found at the pass's end makes every MoE layer
        built after it computed in vain: the layer runs ahead while its decayed miss share times
        the layers after it stays under `bench.ahead_waste` (1: a read-back worth about one layer
        computed again, measured on an H100; the pass's first layer, whose experts no lookahead
        foretold, misses most and so reads back)."""
        if layer in self._foreseen:
            return False
        odds = self._odds.get(layer, 1.0)
        if self.pipe.ahead_launch == "pass":
            after = len(self.store.moe_layers) - 1 - self.store.moe_layers.index(layer)
            return (1.0 - odds) * after < self.pipe.ahead_waste
        return odds >= AHEAD_ODDS

    def _check_pending(self, keep: int = 0, also: tuple = ()) -> None:
        """The layers that ran ahead checked, oldest first, until at most `keep` are left
        (`_check_ahead`; a miss forgets the rest). Several to check: their routing is evaluated
        in one drain, with `also` (device arrays the caller reads next)."""
        self._complete_deferred()
        recs = [rec for rec in self._ahead[:max(0, len(self._ahead) - keep)] if isinstance(rec["ids"], mx.array)]
        if recs and (len(recs) > 1 or also):
            t0 = time.perf_counter()
            if self.pipe.check_each:
                # each launched apart, so each is read back as soon as the device has it: a miss
                # sends its need while the device still computes the layers after it
                for rec in recs:
                    mx.async_eval(rec["ids"])
                    rec["launched"] = True
                if also:
                    mx.async_eval(*also)
            else:
                mx.eval(*[rec["ids"] for rec in recs], *also)
                for rec in recs:
                    rec["ids"] = self._host(rec["ids"])
            self.t_sync += time.perf_counter() - t0
        while len(self._ahead) > keep:
            self._check_ahead(self._ahead.pop(0))

    def _run_ahead(self, layer: int, x, ids):
        """A partially resident layer computed on the experts resident now, without reading its
        routing back: the device table sends a missing expert's rows to slot 0 (`ahead_table`).
        Launched at once (its ids with it), so the device computes it while the host checks the
        one that ran ahead before it and builds the next layer; with `ahead_launch` "pass" left to
        the pass's end, launched and checked with the rest of the pass. Where every chosen
        expert was resident this is the call `_one_need` makes, bit for bit: the same slots, the
        same rows, the same kernel."""
        self.take_fills(layer, [])
        tier = self.tier
        table, where = tier.ahead_table(layer)
        y = switch_glu(x, table[ids], tier.weights(layer), tier.quant(layer))
        look, self._look = self._look, None
        if self.pipe.ahead_launch != "pass":  # else launched with the pass's end
            mx.async_eval(y, *(() if look is None else (look[1],)))
        self._ahead.append({"layer": layer, "ids": ids, "where": where, "look": look})
        self.counters.add("ran_ahead")
        return self._reads_pools(y, layer)

    def _check_ahead(self, rec: dict) -> None:
        """A layer that ran ahead, its routing read back now (long computed: no wait): kept where
        every expert it chose was resident when it was built (its uses noted as hits, its
        lookahead sent as a hint and lease); otherwise RunAheadMiss, the model computes it
        again, told its ids (`_redo`)."""
        layer = rec["layer"]
        self.counters.add("gate_syncs")
        if rec["look"] is not None:  # the layer now called may have a lookahead of its own: kept
            mine, self._look = self._look, rec["look"]
            self._hint_with(rec["ids"])
            self._look = mine
        flat = self._host(rec["ids"]).reshape(-1, rec["ids"].shape[-1])
        self._done_below(layer)
        kept = bool((rec["where"][flat] >= 0).all())
        self._judge(layer, kept)
        if kept:
            self._note_checked(layer, flat)
            self._notes_out(self._take_leases())
            return
        self.counters.add("ahead_missed")
        if self._missed_from is None:
            self._missed_from = {"t": time.perf_counter(), **self.waits()}
        self._redo = (layer, flat)
        # the layers launched after this one ran on its wrong output: forgotten (computed in vain)
        self.counters.add("ahead_forgotten", len(self._ahead))
        if self.pipe.foresight:
            self._foresee(self._ahead)
        self._ahead.clear()
        raise RunAheadMiss(layer)

    def _foresee(self, forgotten: list[dict]) -> None:
        """The layers forgotten after a miss chose their experts on a wrong input, but mostly the
        right ones (issue 28's store: 96% of them, 85% of the missing ones, were used when computed
        again). Where they chose a missing expert, the layer does not run ahead when computed
        again (`_goes_ahead`): it reads its routing back and waits for its experts instead of
        being found missing at the pass's end and computing the layers after it once more; and
        its experts go as a lease right behind the next need (`Need.sure`), so the missing ones
        are read behind the miss's own read."""
        tier = self.tier
        for rec in forgotten:
            if not isinstance(rec["ids"], np.ndarray):
                if rec.get("launched"):  # check_each: read back once the need is out (`_foresee_late`)
                    self._unforeseen.append(rec)
                continue  # else launched after the check, not read back
            layer = rec["layer"]
            experts = sorted(set(rec["ids"].reshape(-1).tolist()))
            missing = tier.missing(layer, experts)
            if not missing:
                continue
            self._foreseen.add(layer)
            self.counters.add("foreseen", len(missing))
            if self._leasable(layer, experts):
                self._foreseen_out.append((layer, experts, True))

    def _foresee_late(self) -> list:
        """check_each: the routing of the layers the last miss forgot, read back now (it waits for
        the device to compute them, which a need sent before this overlaps with its read), and
        foreseen; returns their leases."""
        recs, self._unforeseen = self._unforeseen, []
        for rec in recs:
            rec["ids"] = self._host(rec["ids"])
        self._foresee(recs)
        out, self._foreseen_out = self._foreseen_out, []
        return out

    def _notes_out(self, leases: list) -> None:
        """A layer that sends no need: its leases go in one message, which its lookahead's hints
        ride, or the hints go alone."""
        hints, self._hints = self._hints, []
        if leases:
            self.source.leases(leases, hints=hints)
        elif hints:
            self.source.hint(hints)

    def flush(self, upto: int | None = None, ahead: bool = False) -> None:
        """Hints still held go before the uses (as they were sent before them)."""
        if self._hints:
            hints, self._hints = self._hints, []
            self.source.hint(hints)
        super().flush(upto, ahead)

    def _take_leases(self) -> list:
        """The leases waiting to be asked: the lookahead's (counted), then the foreseen ones."""
        lease, self._lease = self._lease, None
        out, self._foreseen_out = self._foreseen_out, []
        if lease is not None:
            self.counters.add("leases")
            out.insert(0, lease)
        return out

    def _judge(self, layer: int, kept: bool) -> None:
        self._odds[layer] = AHEAD_DECAY * self._odds.get(layer, 1.0) + (1 - AHEAD_DECAY) * kept

    def wants_logits(self, layer: int) -> bool:
        """Whether the model should hand this layer's gate logits over (`gate_logits`): the gate
        routes, the layer's experts are not all resident, and a lossy mode reroutes it or, in a
        pass run ahead, its runner-up is leased for the next token (`_lease_next`)."""
        if not (self.lossy.mode == "cache_aware" or (self._ahead_on and self.pipe.next_leases)):
            return False  # asked of every MoE layer of every pass: the settings first
        return self.routing.mode == "gate" and not self.tier.full(layer)

    def gate_logits(self, layer: int, logits) -> None:
        if self._ahead_on:  # never with a lossy mode (`begin_ahead`)
            self._logits[layer] = logits
        else:
            self._gate = (layer, logits)

    def _reroute(self, layer: int, flat: np.ndarray) -> np.ndarray:
        """The layer's ids after the lossy mode's rerouting (runtime/lossy.py) against what is
        resident now; counts the replacements, and the most in one token."""
        (at, logits), self._gate = self._gate, None
        if at != layer:
            return flat
        scores = self._host(logits.astype(mx.float32)).reshape(flat.shape[0], -1)
        new, n = lossy.reroute(flat, scores, self.tier.slot_of[layer] >= 0, self.lossy.margin,
                               self.lossy.max_share)
        if n:
            per_token = (new != flat).sum(axis=1)
            self.counters.add("rerouted", n)
            self.counters.add("rerouted_tokens", int((per_token > 0).sum()))
            self.rerouted_most = max(self.rerouted_most, int(per_token.max()))
        return new

    def lossy_report(self) -> dict:
        """The [lossy] setting and what it did: experts replaced, token rows with a replacement
        (one per token and layer), the most replaced in one token's row."""
        return {**lossy.setting(self.lossy), "rerouted": int(self.counters.get("rerouted")),
                "rerouted_tokens": int(self.counters.get("rerouted_tokens")),
                "rerouted_most": self.rerouted_most,
                "max_per_token": lossy.max_swaps(self.lossy.max_share, self.store.top_k)}

    def _all_resident(self, layer: int, x, inds, ids):
        """Every expert of the layer resident: no question to ask, the ids index the layer's
        experts inside the graph."""
        tier = self.tier
        self._count_or_note(layer, ids)
        ordered = tier.expert_weights(layer)  # None: index the expert->slot table
        if isinstance(ids, mx.array):
            slots = ids if ordered is not None else tier.device_table(layer)[ids]
        else:  # a trace's ids, in the gate's shape
            host = np.asarray(ids).reshape(inds.shape)
            slots = mx.array((host if ordered is not None else tier.slots(layer, host)).astype(np.uint32))
        y = switch_glu(x, slots, ordered or tier.weights(layer), tier.quant(layer))
        if self.pipe.eager_layers and not tier.all_full() and self._deferred is None and not self._waiting_on:
            # A later layer of this pass reads its routing back, which waits for everything
            # before it: launched now, this layer computes while the next ones are built.
            mx.async_eval(y)
        return self._reads_pools(y, layer)

    def _read_ids(self, layer: int, x, ids) -> np.ndarray:
        """The layer's ids on the CPU [n, k] (the sync), the gate's lookahead sent with them."""
        if not isinstance(ids, mx.array):
            # Routing from a trace reads no gate back, so nothing has evaluated this layer's input:
            # the pass's pending graph still holds the pools, and a fill would then copy a whole
            # pool instead of writing one slot (compute grew to 22 GB on the 26-layer store in the
            # real regime). Evaluated here, where a real run's gate read-back evaluates it.
            mx.eval(x)
        if isinstance(ids, mx.array):
            self.counters.add("gate_syncs")
        self._hint_with(ids)  # before the need: the router prefetches after answering it
        flat = self._host(ids).reshape(-1, ids.shape[-1])
        self._done_below(layer)
        return flat

    def _hint_with(self, ids) -> None:
        """The pending lookahead, if any, evaluated with these ids and sent (`_send_hint`), its
        wait counted as sync."""
        if self._look is not None:
            t0 = time.perf_counter()
            self._send_hint(ids)
            self.t_sync += time.perf_counter() - t0

    def _one_need(self, layer: int, x, inds, flat: np.ndarray, experts: list[int], flush_ahead: bool):
        """The layer's experts made resident together (one need, or none), then one call.
        flush_ahead: early fills completed the layer, so no need starts the router's next
        prefetch: its uses, sent now, do."""
        tier = self.tier
        reported = self.ensure(layer, experts, early=self._can_defer(layer))
        self._note(layer, flat, report=not reported, count=False)
        if flush_ahead:
            self.flush(ahead=True)
        where = tier.slot_of[layer]
        if self._deferred is not None:  # answered early: the slots the misses will hold
            where = where.copy()
            for e, slot in self._deferred["slots"].items():
                where[e] = slot
        slots = where[flat].astype(np.uint32).reshape(inds.shape)
        return self._reads_pools(switch_glu(x, mx.array(slots), tier.weights(layer), tier.quant(layer)), layer)

    def _in_chunks(self, layer: int, x, inds, flat: np.ndarray, experts: list[int]):
        """More distinct experts than the layer's resident slots (a long prefill in a small
        budget): in chunks, each evaluated before the next chunk's fills overwrite its slots. No
        lease here: it would hold slots the chunks take in turn."""
        tier = self.tier
        self._lease = None
        w, quant, cap = tier.weights(layer), tier.quant(layer), tier.n_slots[tier.group_of[layer]]
        reported = False
        lead, k, d = inds.shape[:-1], flat.shape[-1], x.shape[-1]
        x2, ids1 = x.reshape(-1, d), flat.reshape(-1)
        pieces, order = [], []
        for i in range(0, len(experts), cap):
            chunk = experts[i:i + cap]
            reported = self.ensure(layer, chunk) or reported
            pairs = pairs_of(ids1, np.isin(ids1, chunk))
            pieces.append(run_pairs(x2, k, pairs, tier.slots(layer, ids1[pairs]), w, quant, ids1.size))
            order.append(pairs)
        self._note(layer, flat, report=not reported, count=False)
        return in_token_order(pieces, order, lead, k, d)
