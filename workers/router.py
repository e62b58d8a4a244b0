"""The router: owns the slot tables, the cache policy and the read orders. It decides; the loader
reads; compute copies.

Two tiers (runtime/tiers.py): resident slots, one table per record-layout group, whose bytes live
in compute's MLX memory, and a small ring of staging slots in shared memory that the loader reads
into. A miss takes a resident victim (the policy's choice, never a slot pinned by the current need)
and a free staging slot; once read, compute is told to copy staging into the resident slot
(`fill`) and acknowledges (`filled`), which frees the staging slot for the next queued read.
Compute uses resident experts without asking and reports those uses afterwards (`used`), so the
policy still sees every hit, in order. The slot bookkeeping and policies live in runtime/cache.py.

Prediction (runtime/predictor.py): given the model's shape, the router feeds a routing predictor
everything it sees, in order (`need`, and the hits of `used`), for the `predictive` policy and
for prefetch. With prefetch on, each time a demand need is answered the router orders reads of
the experts the self-gating `Prefetcher` predicts for the next layer(s) into free or evictable
resident slots whose own keys are less likely to be used. Demand first: a prefetch read is never
queued (only issued into a free staging slot, and only while no demand read waits for one), at
most half of the staging ring holds prefetch reads, and none is ordered before the need's own
reads are in. A prefetched expert's `fill` reaches compute like any other; compute applies it the
next time it waits on a need, which also frees its staging slot, so prefetch cannot starve a need.
Self-gating has two halves, both in the prefetcher: per layer
distance on measured precision, and per read on bandwidth (`ReadGate`, fed here with every read
sent and done and every demand need asked and answered): a prefetch read goes only while it can
finish before its layer comes and pays for the disk time it takes from the next need's reads.

`Router` is plain logic with no sockets: its methods return the messages to send as
[(destination, message)], destination "loader" or "compute". Tests and tools drive it in-process
(workers/sources.py `drive_need`); `RouterProcess` (workers/router_process.py) wraps it with the data-plane socket.
"""
from __future__ import annotations

import time
from collections import Counter as Tally
from collections import deque

from deltafin.protocol import messages as M
from deltafin.runtime.cache import CacheError, Policy, SlotTable, make_policy
from deltafin.runtime import metrics
from deltafin.runtime.metrics import Counter, Latency
from deltafin.runtime.predictor import LeaseGate, PredictorError, Prefetcher, RoutingPredictor

# Prefetcher settings unless told otherwise: tuned on the train split, chosen on dev
# (docs/TRACES.md). threshold: a key's predicted probability of use to read it ahead; depth: layers
# ahead; min_precision: a layer distance whose measured precision falls under it only probes;
# gate: False reads every prediction over the threshold (a fixed setting). The config's routers
# (workers/router_process.py, prefetch_setting) add bandwidth=True, the per-read half of the gate, which needs a real clock;
# in-process routers (replay, tests) go without it unless told.
PREFETCH_DEFAULTS = {"threshold": 0.4, "depth": 1, "min_precision": 0.5, "gate": True}


class RouterError(RuntimeError):
    def __init__(self, message: str, code: M.ErrorCode = M.ErrorCode.BUDGET_TOO_SMALL):
        super().__init__(message)
        self.code = code  # what the client's error says


class Router:
    """Answers `need` from the slot tables, whose policy chooses the victims.

    `need` pins the slots of one layer's experts until the next `need`, `used` or `release`; a
    lease (`need` with lease) holds a later layer's experts meanwhile, so several requests can be
    in flight (compute's gate lookahead asks for layer L+1 while layer L's need waits). Pinned
    and loading slots are never chosen as victims. `n_slots`: resident slots, an int (one group for
    every layer) or {group: n} with `groups` {layer: group}. `policy` is a registered name
    (cache.policy) or, with one group only, a Policy instance (replay gives Belady its future that
    way). `n_staging`: staging slots, reads in flight at most (None: one per resident slot).

    `moe_layers` (the MoE layer ids in order) and `n_experts` give the model's shape, which the
    routing predictor needs: with the `predictive` policy or `prefetch` (True, or a dict of
    `Prefetcher` options over PREFETCH_DEFAULTS). `policy_options` go to the policy,
    `predictor_options` to the `RoutingPredictor`.
    """

    def __init__(self, n_slots: int | dict, policy: str | Policy = "lru", history: int = 4096,
                 n_staging: int | None = None, groups: dict | None = None,
                 moe_layers=None, n_experts: int | None = None, prefetch: bool | dict = False,
                 policy_options: dict | None = None, predictor_options: dict | None = None):
        sizes = n_slots if isinstance(n_slots, dict) else {0: n_slots}
        if groups is None and len(sizes) != 1:
            raise RouterError("several slot groups need the layer -> group map")
        if not isinstance(policy, str) and len(sizes) != 1:
            raise RouterError("a Policy instance serves one slot group only")
        if any(n < 1 for n in sizes.values()):
            raise RouterError("the slot pool has no slots")
        self.predictor: RoutingPredictor | None = None
        self.prefetcher: Prefetcher | None = None
        self.layer_row: dict[int, int] = {}
        predictive = policy == "predictive" or getattr(policy, "name", "") == "predictive"
        if predictive or prefetch:
            if moe_layers is None or n_experts is None:
                raise RouterError("the predictive policy and prefetch need the model's shape "
                                  "(moe_layers, n_experts)")
            self.row_layer = [int(x) for x in moe_layers]
            self.layer_row = {layer: i for i, layer in enumerate(self.row_layer)}
            try:
                self.predictor = getattr(policy, "predictor", None) or RoutingPredictor(
                    len(self.row_layer), n_experts, **(predictor_options or {}))
                if prefetch:
                    options = {**PREFETCH_DEFAULTS, **(prefetch if isinstance(prefetch, dict) else {})}
                    self.prefetcher = Prefetcher(self.predictor, **options)
                    self.lease_gate = LeaseGate(self.prefetcher.min_precision, self.prefetcher.probe_every)
            except (PredictorError, TypeError) as e:
                raise RouterError(f"prefetch/predictor settings: {e}") from None

        def build(name):
            if name == "predictive":
                return make_policy(name, predictor=self.predictor, layer_index=self.layer_row,
                                   **(policy_options or {}))
            return make_policy(name, **(policy_options or {}))
        try:
            self.tables = {g: SlotTable(n, build(policy) if isinstance(policy, str) else policy)
                           for g, n in sizes.items()}
        except (CacheError, TypeError) as e:
            raise RouterError(str(e)) from None
        self.groups = groups
        self.only = next(iter(sizes)) if len(sizes) == 1 else None
        self.n_slots = sum(sizes.values())
        self.policy_name = next(iter(self.tables.values())).policy.name
        self.staging_free = list(range((n_staging or self.n_slots) - 1, -1, -1))  # slot 0 first
        self.staging_use: dict[int, tuple] = {}   # staging slot -> (group, slot, generation, layer, expert)
        self.queued: deque = deque()              # demand reads waiting for a staging slot
        self.queued_ahead: deque = deque()        # lease reads waiting (behind every demand read)
        # The router process sends an answer before it plans the prefetch that follows it
        # (`deferred`); called in-process, the plan's reads come back with the answer.
        self.defer_prefetch = False
        self._prefetch_due = False
        # The router process lets a need's reads go out before the predictor learns from the uses
        # and needs before it (`lazy_history`; `catch_up` runs the observations, in order, before
        # anything that decides reads, or when no message waits; its stats may lag by what is
        # still due); in-process, at once.
        self.lazy_history = False
        self._unobserved: deque = deque()  # (predictor row, experts) not observed yet; (None, hints)
        self.prefetching: set[int] = set()        # staging slots held by prefetch and lease reads
        # the prefetcher's bandwidth gate, fed with this router's reads and needs as they happen
        self.read_gate = self.prefetcher.reads if self.prefetcher is not None else None
        # prefetch and lease reads hold at most half the staging ring (read, or read and not yet
        # applied by compute): the other half is always there for demand reads (`ahead_cap` in the
        # stats; the router process may lower it: bench.ahead_reads)
        self.ahead_cap = len(self.staging_free) // 2
        self.pending: dict | None = None  # the need compute waits for (and pins)
        self.leases: dict[int, dict] = {}  # req -> a lease: experts of a later layer, held

        self.counters = Counter()
        self.stall = Latency()  # per `need` that waited for reads: how long compute stalled
        # Routing history, the raw material of policies and predictors: how often each
        # (layer, expert) was used, and the most recent layers' uses in order.
        self.uses: Tally = Tally()
        self.recent: deque = deque(maxlen=history)

    def group(self, layer: int):
        return self.only if self.only is not None else self.groups[layer]

    @property
    def policy(self) -> Policy:
        return self.table.policy

    @property
    def table(self) -> SlotTable:
        """The slot table when there is one group (tests, replay)."""
        if self.only is None:
            raise RouterError("several slot groups: use tables[group]")
        return self.tables[self.only]

    # -- compute's messages -----------------------------------------------------------------------
    def used(self, uses) -> None:
        """Uses compute served from its resident tier, [(layer, experts)] in order: hits for the
        policy. Releases the pins of the last need, and the leases of the layers they reach."""
        self._release_to(max((layer for layer, _ in uses), default=-1))
        for layer, experts in uses:
            table = self.tables[self.group(layer)]
            self._history(layer, experts)
            for e in experts:
                if table.use((layer, e)):
                    self.counters.add("uses")
                    self.counters.add("hits")
                else:  # compute thought it resident: its map and this table disagree
                    self.counters.add("stray_uses")

    def need(self, req: int, layer: int, experts: list[int], prefetch: bool = False,
             lease: bool = False, sure: bool = False, early: bool = False) -> list[tuple[str, object]]:
        """Pins the experts' slots; misses get a victim slot and a read. Returns what to send:
        read orders, and `slots` at once if nothing had to be read. prefetch: not a use (no
        history, no use or hit counted). lease, sure: see `lease`. early: where reads are needed
        and none waits for a staging slot, `slots` marked pending goes at once too (Need.early).
        Releases the last need's pins and the leases of layers up to this one."""
        if lease:
            return self.lease(req, layer, experts, sure)
        self._release_to(layer)
        now = time.perf_counter()
        if not prefetch:
            self._history(layer, experts)
        wanted = list(dict.fromkeys(experts))
        g = self.group(layer)
        table = self.tables[g]
        if len(wanted) > table.n_slots:
            raise RouterError(f"layer {layer} needs {len(wanted)} experts at once but its resident "
                              f"pool has {table.n_slots} slots")
        out, waiting, slots, hits, fresh = [], set(), [], 0, []
        for e in wanted:
            try:
                slot, new = table.acquire((layer, e))
            except CacheError as err:
                for f_slot, f_gen, f_e in fresh:  # nothing half-done stays behind: slots free again
                    table.failed(f_slot, (layer, f_e), f_gen)
                self.release()
                raise RouterError(str(err)) from None
            gen = table.generation[slot]
            if new:
                fresh.append((slot, gen, e))
            if table.ready(slot):
                hits += 1
            else:
                waiting.add(slot)
                if not new and not prefetch:  # read ahead (a prefetch or lease), not in yet
                    self.counters.add("misses_in_flight")
            slots.append([e, slot, gen])
        for slot, gen, e in fresh:  # the reads go out once every expert has its slot
            out += self._read(g, slot, gen, layer, e)
        if self.queued_ahead and waiting:  # a lease's read still queued is wanted now: on demand
            for item in [q for q in self.queued_ahead if q[0] == g and q[1] in waiting]:
                self.queued_ahead.remove(item)
                out += self._read(*item)
        if prefetch:
            self.counters.add("prefetched", len(slots) - hits)
        else:
            self.counters.add("uses", len(slots))
            self.counters.add("hits", hits)
            if self.read_gate is not None and layer in self.layer_row:
                self.read_gate.need(now, self.layer_row[layer], bool(waiting))
        self.pending = {"req": req, "layer": layer, "group": g, "slots": slots, "waiting": waiting,
                        "hits": hits, "t0": time.perf_counter(), "demand": not prefetch}
        if not waiting:
            out.append(("compute", self._reply()))
            out += self._prefetch_after_reply()
        elif early and not prefetch and not any(q[0] == g and q[1] in waiting for q in self.queued):
            # every read it waits for holds a staging slot (a queued one would wait for a `filled`
            # compute may hold back until this need is answered): compute may build on the slots
            self.counters.add("early_answers")
            out.append(("compute", self._reply(pending=True)))
        return out

    def filled(self, msg: M.Filled) -> list[tuple[str, object]]:
        """compute applied a fill: its staging slot takes the next queued read."""
        use = self.staging_use.get(msg.staging)
        if use is None or use[2] != msg.generation:
            return []
        return self._free_staging(msg.staging)

    def lease(self, req: int, layer: int, experts: list[int], sure: bool = False) -> list[tuple[str, object]]:
        """compute's gate lookahead for a later layer, sent while an earlier layer's need may still
        wait (several requests in flight): the experts are held (pinned) as they are, the
        missing ones read into slots the policy gives up (never a pinned one, nor one more likely
        to be used than the key) behind the demand reads asked before, then held too; answered
        by nothing: compute waits for no lease (it takes the fills as they come, and the need
        of that layer answers for every expert it uses). Not a use. Released by the need or
        `used` of its layer (or a later one), or the pass's end. Best effort: what finds no slot
        is left out (counted), never an error. sure: compute foresaw the experts (Need.sure), so
        a missing one is read whatever the predictor says, into the policy's victim (counted
        as `foreseen_reads`)."""
        self.catch_up()
        g = self.group(layer)
        table = self.tables[g]
        self.counters.add("leases")
        out, pins, waiting = [], [], set()
        for e in dict.fromkeys(experts):
            if sure and len(table.pinned) >= table.n_slots // 2:
                # several foreseen leases may be held at once: together they never pin more than
                # half the group, so a need always finds its victims
                self.counters.add("lease_refused")
                continue
            slot = table.hold((layer, e))
            if slot is None:
                if not sure and not self._lease_pays((layer, e)):
                    self.counters.add("lease_unlikely")
                    continue
                # as for a prefetch, the victim must be less likely to be used than the key (whose
                # probability the lookahead's hint has just set); a foreseen key is likelier
                # than any
                slot = table.prefetch((layer, e), lease=True, keep=None if sure else self._worth_more((layer, e)))
                if slot is None:
                    self.counters.add("lease_refused")
                    continue
                if sure:
                    self.counters.add("foreseen_reads")
                out += self._read(g, slot, table.generation[slot], layer, e, ahead=True)
            pins.append((slot, table.generation[slot]))
            if not table.ready(slot):
                waiting.add(slot)
        if pins:  # held until released; `waiting`: its reads not in yet (a failed one drops it)
            self.leases[req] = {"layer": layer, "group": g, "pins": pins, "waiting": waiting}
        return out

    def release(self) -> None:
        for table in self.tables.values():
            table.release()
        self.pending = None
        self.leases.clear()

    def _release_to(self, layer: int) -> None:
        """Unpins the last need's slots and the leases of layers up to `layer`; leases of later
        layers stay held. Without leases, every pin goes (`release`)."""
        if not self.leases:
            return self.release()
        p, self.pending = self.pending, None
        if p is not None:
            self.tables[p["group"]].unpin((slot, gen) for _, slot, gen in p["slots"])
        for req in [r for r, held in self.leases.items() if held["layer"] <= layer]:
            held = self.leases.pop(req)
            self.tables[held["group"]].unpin(held["pins"])

    def learn_history(self, path: str, max_tokens: int) -> int:
        """Trains the predictor on a routing trace's last max_tokens tokens, one pass per token,
        before serving: prediction (and so prefetch) works from the first token. The slot tables
        and policies are untouched. Returns the tokens learnt."""
        from deltafin.runtime.traces import load_trace
        ids = load_trace(path).ids
        if ids.shape[1] != len(self.row_layer) or ids.max(initial=0) >= self.predictor.n_experts:
            raise RouterError(f"routing history {path}: {ids.shape[1]} layers x top-{ids.shape[2]} "
                              f"does not fit this model ({len(self.row_layer)} MoE layers)", code=M.ErrorCode.BAD_CONFIG)
        ids = ids[-max_tokens:] if max_tokens else ids[:0]
        for row in ids:
            for j, experts in enumerate(row):
                self.predictor.observe(j, experts)
            self.predictor.end_pass()
        self.counters.add("history_tokens", len(ids))
        return len(ids)

    def end_pass(self) -> None:
        """A forward pass is over (compute's `release`): unpins, and closes the predictor's pass
        (a lower layer than the last one closes it too; this also serves a one-layer model)."""
        self.release()
        if self.predictor is not None:
            self.catch_up()
            self.predictor.end_pass()

    def hint(self, keys) -> None:
        """(layer, expert) keys predicted to be needed soon (gate lookahead): to the policy, and to
        the routing predictor, which keeps them until their layer comes. With `lazy_history` the
        predictor takes them in turn with the uses and needs before them (`catch_up`), so a need
        that carries hints sends its reads without waiting for the predictor to catch up."""
        keys = list(keys)
        self.counters.add("hinted", len(keys))
        by_row: dict[int, list[int]] = {}
        for layer, e in keys:
            self.tables[self.group(layer)].hint([(layer, e)])
            if layer in self.layer_row:
                by_row.setdefault(self.layer_row[layer], []).append(e)
        if by_row:
            self._unobserved.append((None, by_row))
            if not self.lazy_history:
                self.catch_up()

    def notes(self, hints: list | None, uses: list | None) -> None:
        """What a need or lease carries (Need.hints, Need.uses), taken before it, in that order:
        [[layer, [expert, ...]], ...] each."""
        if hints:
            self.hint((layer, e) for layer, experts in hints for e in experts)
        if uses:
            self.used(uses)

    # -- the loader's messages --------------------------------------------------------------------
    def loaded(self, msg: M.Loaded) -> list[tuple[str, object]]:
        use = self.staging_use.get(msg.slot)
        if use is None or use[2:] != (msg.generation, msg.layer, msg.expert):
            return []  # not a read this router has in flight
        if self.read_gate is not None:
            self.read_gate.done(time.perf_counter(), msg.nbytes)
        g, slot = use[0], use[1]
        if not self.tables[g].loaded(slot, (msg.layer, msg.expert), msg.generation):
            return self._free_staging(msg.slot)  # a fill that was superseded; nothing waits for it
        self.counters.add("bytes_read", msg.nbytes)
        out = [("compute", M.Fill(req=self.pending["req"] if self.pending else -1, slot=slot,
                                  staging=msg.slot, layer=msg.layer, expert=msg.expert,
                                  generation=msg.generation))]
        for held in self.leases.values():
            if held["group"] == g:
                held["waiting"].discard(slot)
        p = self.pending
        if p and p["group"] == g and slot in p["waiting"]:
            p["waiting"].discard(slot)
            if not p["waiting"]:
                out.append(("compute", self._reply()))
                while self.queued_ahead and (more := self._next_queued()):  # leases' reads now
                    out += more
                out += self._prefetch_after_reply()  # the need's own reads are in: now the next layer's
        return out

    def load_failed(self, msg: M.LoadFailed) -> list[tuple[str, object]]:
        """Frees the resident slot (its previous expert is already gone) and the staging slot;
        compute hears of it (`fill_failed`), and the need waiting for it fails."""
        use = self.staging_use.get(msg.slot)
        if use is None or use[2:] != (msg.generation, msg.layer, msg.expert):
            return []
        if self.read_gate is not None:
            self.read_gate.done(time.perf_counter(), 0)
        g, slot = use[0], use[1]
        if not self.tables[g].failed(slot, (msg.layer, msg.expert), msg.generation):
            # superseded (a need took over a prefetch's slot): the slot holds another fill now,
            # which compute must keep
            return self._free_staging(msg.slot)
        p = self.pending
        req = p["req"] if p and p["group"] == g and slot in p["waiting"] else -1
        if req != -1:
            self.release()
        for r, held in list(self.leases.items()):  # a lease waiting for it is dropped (no error)
            if held["group"] == g and slot in held["waiting"]:
                self.tables[g].unpin(self.leases.pop(r)["pins"])
                req = r if req == -1 else req
        out = [("compute", M.FillFailed(req=req, slot=slot, layer=msg.layer, expert=msg.expert,
                                        error=msg.error))]
        return out + self._free_staging(msg.slot)

    # -- internals --------------------------------------------------------------------------------
    def _history(self, layer, experts) -> None:
        self.recent.append((layer, tuple(experts)))
        self.uses.update([(layer, e) for e in experts])
        row = self.layer_row.get(layer)
        if row is not None:
            self._unobserved.append((row, experts))
            if not self.lazy_history:
                self.catch_up()

    def behind(self) -> bool:
        """Whether the predictor has uses or needs still to observe (`catch_up`)."""
        return bool(self._unobserved)

    def catch_up(self, most: int | None = None) -> None:
        """The predictor observes the uses and needs it has not seen yet, in their order (at most
        `most` of them). With `lazy_history` a need's victims are picked on the predictor as it
        stood before (its reads go out first); everything else that reads the predictor catches
        up first, so it sees the same sequence either way."""
        n = len(self._unobserved) if most is None else min(most, len(self._unobserved))
        for _ in range(n):
            row, what = self._unobserved.popleft()
            if row is None:  # a lookahead's hints: {row: experts}
                for r, experts in what.items():
                    self.predictor.hint(r, experts)
            else:
                self.predictor.observe(row, what)

    def _probability(self, key) -> float:
        row = self.layer_row.get(key[0])
        return 0.0 if row is None else float(self.predictor.q[row, key[1]])

    def _worth_more(self, key):
        """The `keep` test of a read ahead of need for key: a victim more likely to be used than
        key stays. None (no test) without a predictor."""
        if self.predictor is None:
            return None
        q = self._probability(key)
        return lambda victim: self._probability(victim) >= q

    def _lease_pays(self, key) -> bool:
        """Whether a lease reads a key it finds missing: as a prefetch would, where its probability
        (at least the lookahead's measured precision, which the hint just gave it) reaches the
        prefetch threshold, and while lease reads pay (`LeaseGate`). Every key without a prefetcher."""
        f = self.prefetcher
        if f is None:
            return True
        if self._probability(key) < f.threshold:
            return False
        tables = self.tables.values()
        return self.lease_gate.pays(sum(t.lease_used for t in tables), sum(t.lease_wasted for t in tables))

    def _prefetch_after_reply(self) -> list[tuple[str, object]]:
        """The prefetch a need's answer starts: planned now, or, with defer_prefetch, once the
        answer has gone out (`deferred`), so that compute does not wait for the planning."""
        if self.defer_prefetch:
            self._prefetch_due = True
            return []
        return self._prefetch()

    def deferred(self) -> list[tuple[str, object]]:
        """The prefetch put off by the last message's answer (defer_prefetch), planned now; the
        process calls it right after sending that answer, before the next message."""
        if not self._prefetch_due:
            return []
        self._prefetch_due = False
        return self._prefetch()

    def prefetch_ahead(self) -> list[tuple[str, object]]:
        """compute completed a layer from fills it took early, without a need (`used` with
        ahead): the prefetch a need's answer would have started, planned now. Without it a run
        of layers served by prefetch stopped prefetching (the demo's hit rate 58% -> 46%)."""
        return self._prefetch(unasked=True)

    def _prefetch(self, unasked: bool = False) -> list[tuple[str, object]]:
        """Read orders for what the prefetcher predicts, after a demand need is answered (or,
        unasked, after a layer compute completed without a need: `prefetch_ahead`). Only
        into free staging slots, never queued, never while a demand read waits (implied: reads
        queue only while no staging slot is free; checked anyway), and within the prefetch share
        of the staging ring; the victim of a prefetch must be less likely to be
        used than the key read into its slot (`SlotTable.prefetch`'s keep)."""
        f = self.prefetcher
        if f is None or self.queued or not (unasked or (self.pending and self.pending["demand"])):
            return []
        self.catch_up()
        room = min(self.ahead_cap - len(self.prefetching), len(self.staging_free))
        if room <= 0:
            return []
        rows = self.row_layer

        def resident(key):
            layer = rows[key[0]]
            return (layer, key[1]) in self.tables[self.group(layer)].where
        keys = f.plan(resident)
        out = []
        ahead = self.read_gate.in_flight if self.read_gate is not None else 0
        for i, (row, e) in enumerate(keys):
            layer = rows[row]
            g = self.group(layer)
            table = self.tables[g]
            q = float(self.predictor.q[row, e])
            if room <= 0:  # the prefetch share of the staging ring is full: the rest wait too
                f.unissued(keys[i:])
                break
            if not f.pays(q, self.predictor.distance(row), ahead):
                # would not pay for its disk time behind the reads ahead of it: the next key
                # (less likely, but maybe further ahead, so with more time) is asked in turn
                f.unissued([(row, e)])
                continue
            slot = table.prefetch((layer, e), keep=self._worth_more((layer, e)))
            if slot is None:  # the best victim is worth more: the rest, less likely, too
                f.unissued(keys[i:])
                break
            t = self.staging_free.pop()
            gen = table.generation[slot]
            self.staging_use[t] = (g, slot, gen, layer, e)
            self.prefetching.add(t)
            self.counters.add("reads")
            self.counters.add("prefetch_reads")
            out.append(("loader", M.Read(slot=t, generation=gen, layer=layer, expert=e, prefetch=True)))
            if self.read_gate is not None:
                self.read_gate.sent(time.perf_counter())
            ahead += 1
            room -= 1
        return out

    def _read(self, g, slot, gen, layer, expert, ahead: bool = False) -> list[tuple[str, object]]:
        """A read into a staging slot, or queued (in order) until one is free. ahead (a lease's
        read): it waits until the need compute waits for has all its reads in (so it never
        shares the disk with them), behind every demand read, here and in the loader (as a
        prefetch read), and holds at most the prefetch share of the staging ring, with the
        prefetch reads."""
        if ahead and (self.queued or len(self.prefetching) >= self.ahead_cap or
                      (self.pending is not None and self.pending["waiting"])):
            self.queued_ahead.append((g, slot, gen, layer, expert))
            return []
        if not self.staging_free:
            (self.queued_ahead if ahead else self.queued).append((g, slot, gen, layer, expert))
            return []
        t = self.staging_free.pop()
        self.staging_use[t] = (g, slot, gen, layer, expert)
        if ahead:
            self.prefetching.add(t)
        self.counters.add("reads")
        if self.read_gate is not None:
            self.read_gate.sent(time.perf_counter())
        return [("loader", M.Read(slot=t, generation=gen, layer=layer, expert=expert, prefetch=ahead))]

    def _free_staging(self, t: int) -> list[tuple[str, object]]:
        self.staging_use.pop(t, None)
        self.prefetching.discard(t)
        self.staging_free.append(t)
        return self._next_queued()

    def _next_queued(self) -> list[tuple[str, object]]:
        """The next queued read into a free staging slot: demand reads first, then a lease's
        while no need waits for reads (`_read`)."""
        for queue in (self.queued, self.queued_ahead):
            if queue is self.queued_ahead and self.pending is not None and self.pending["waiting"]:
                break
            while queue and self.staging_free and (queue is self.queued or len(self.prefetching) < self.ahead_cap):
                g, slot, gen, layer, expert = queue.popleft()
                table = self.tables[g]
                # a queued read whose fill was superseded or failed meanwhile is dropped
                if table.key[slot] == (layer, expert) and table.generation[slot] == gen and not table.ready(slot):
                    return self._read(g, slot, gen, layer, expert, queue is self.queued_ahead)
        return []

    def _reply(self, pending: bool = False) -> M.Slots:
        """The `slots` answer of the need waiting (a lease gets none); pending: the early one."""
        p, wait_us = self.pending, 0
        if not pending:  # the need is answered (its timing, its stall)
            if p["demand"] and self.read_gate is not None and p["layer"] in self.layer_row:
                self.read_gate.answered(time.perf_counter(), self.layer_row[p["layer"]])
            if p["hits"] < len(p["slots"]):
                wait = time.perf_counter() - p["t0"]
                self.stall.add(wait)
                wait_us = int(wait * 1e6)
        return M.Slots(req=p["req"], layer=p["layer"], slots=p["slots"], hits=p["hits"], wait_us=wait_us,
                       pending=pending)

    def stats(self) -> dict:
        c = self.counters.snapshot()
        evictions = sum(t.evictions for t in self.tables.values())
        if evictions:
            c["evictions"] = evictions
        uses = c.get("uses", 0)
        if self.prefetcher is not None:
            c.update(self.prefetch_stats())
        if c.get("leases"):
            c.update(self.lease_stats())
        return {**c, "n_slots": self.n_slots, "staging_slots": len(self.staging_free) + len(self.staging_use),
                "ahead_cap": self.ahead_cap,
                "policy": self.policy_name, "resident": sum(len(t.where) for t in self.tables.values()),
                "hit_rate": metrics.hit_rate(c.get("hits", 0), uses),
                "distinct_experts_used": len(self.uses),
                "most_used": [[layer, e, n] for (layer, e), n in self.uses.most_common(8)],
                "stall": self.stall.summary(), "resident_experts": self.residency()}

    def prefetch_stats(self) -> dict:
        """Prefetch counters (DESIGN-NOTES names). prefetch_precision: prefetched and used before
        eviction / prefetched. prefetch_recall, as one run can count it: misses avoided (uses
        found ready because a prefetch read them) / (those + the misses left), the misses there
        would have been without prefetch if the cache were otherwise the same; deltafin-replay
        also measures it against a second replay without prefetch."""
        tables = self.tables.values()
        issued = sum(t.prefetches for t in tables)
        used = sum(t.prefetch_used for t in tables)
        avoided = sum(t.prefetch_hits for t in tables)
        misses = self.counters.get("uses") - self.counters.get("hits")
        return {"prefetch_reads": issued, "prefetch_used": used, "prefetch_hits": avoided,
                "prefetch_wasted": sum(t.prefetch_wasted for t in tables),
                "prefetch_precision": metrics.prefetch_precision(used, issued),
                "prefetch_recall": metrics.prefetch_recall(avoided, misses),
                "prefetch_gate": self.prefetcher.stats(),
                "hint_precision": self.predictor.hint_precision() if self.counters.get("hinted") else None}

    def lease_stats(self) -> dict:
        """Leases (compute's gate lookahead held ahead of its layer): reads they made, of those
        used before their eviction (and found ready when used: a miss avoided) or evicted
        unused; lease_precision = used / read."""
        tables = self.tables.values()
        read = sum(t.leases for t in tables)
        used = sum(t.lease_used for t in tables)
        return {"lease_reads": read, "lease_used": used, "lease_hits": sum(t.lease_hits for t in tables),
                "lease_wasted": sum(t.lease_wasted for t in tables),
                "lease_precision": used / read if read else None}

    def residency(self) -> list:
        """[[layer, [expert, ...]], ...]: the experts holding a slot (ready or loading), by layer."""
        by_layer: dict[int, list[int]] = {}
        for layer, e in (key for t in self.tables.values() for key in t.where):
            by_layer.setdefault(layer, []).append(e)
        return [[layer, sorted(es)] for layer, es in sorted(by_layer.items())]


if __name__ == "__main__":
    import sys

    from deltafin.workers.router_process import RouterProcess
    RouterProcess(sys.argv[1]).serve()
