"""The expert provider's bookkeeping of forward passes: what the model calls at each MoE layer
shares this base (`SlotExperts`, the mmap baseline's provider, the distributed ranks').

A pass is begun (`begin_pass`), built by the model, optionally sealed (`seal_pass`: its gate ids
stacked for one read-back), then committed once its output was read (`commit`: its uses go to the
source, its routing is returned for a trace) or dropped (`discard`: a pass launched ahead of need).
"""
from __future__ import annotations

import time

import mlx.core as mx
import numpy as np

from deltafin.runtime.benchmode import Routing
from deltafin.runtime.metrics import Counter, Latency
from deltafin.runtime.store import Store


class ExpertProvider:
    """Shared by the providers: the routing, the passes' uses, counters and the time split.

    A forward pass is begun (`begin_pass`), built by the model, then either committed once its
    output was read (`commit`: its uses are reported, its routing recorded) or dropped
    (`discard`: a pass launched ahead of need)."""

    # The model may hand x [..., D] and the gate's ids [..., k] in the gate's own shape (as mlx-lm
    # hands its SwitchGLU) and take [..., k, D] back: no reshape per layer and token.
    keeps_shape = True
    expert_source = "slots"  # where expert bytes come from, as the bench_mode report names it
    tier = None  # the resident tier, where the provider keeps one
    # the kinds of time compute waits, as the decode split names them: for reads, in read-backs
    # and drains, on messages, in fills (`waits`)
    WAITS = ("wait", "sync", "ipc", "prepare")

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

    def waits(self) -> dict[str, float]:
        """The time compute has waited so far, by kind (WAITS), in seconds."""
        return {kind: getattr(self, f"t_{kind}") for kind in self.WAITS}

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
        uses = self.unreported_uses(upto)
        if uses:
            t0 = time.perf_counter()
            self.source.used(uses, ahead=ahead)
            self.t_ipc += time.perf_counter() - t0

    def unreported_uses(self, upto: int | None = None) -> list:
        """The uses served without asking up to pass `upto` (all), [[layer, experts], ...] in
        order, taken off the list to report (what `flush` sends, or a need carries)."""
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
        return uses

    def _host(self, ids) -> np.ndarray:
        """ids on the CPU; reading gate ids back waits for the graph up to them (a sync)."""
        if isinstance(ids, mx.array):
            t0 = time.perf_counter()
            ids = np.array(ids)
            self.t_sync += time.perf_counter() - t0
        return ids

    def detach(self) -> None:
        """Lets go of what holds the staging segment, before the process unmaps it (none here)."""

    def can_overlap(self) -> bool:
        """A pass can be launched before the previous token is read: it will never stop to wait."""
        return False

    def preload_step(self) -> bool:
        """Reads the next layer a full resident tier lacks; False: nothing (more) to load."""
        return False

    def fetch(self, layer: int) -> None:
        raise NotImplementedError
