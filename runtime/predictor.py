"""Which experts the next layers will need: a predictor trained online from the router's own
`need(layer, experts)` stream, and the self-gating prefetcher that turns its predictions into reads.

`RoutingPredictor` keeps, for every (layer, expert) key, the probability that the key is used at
the next occurrence of its layer (later in this forward pass for the layers ahead, in the next pass
for the others). Three pieces of routing history feed it:

- the routing of the current pass so far, matched against the passes of the recent history (the
  `neighbours` past passes whose experts overlap most with this one, layer by layer): their experts
  at the layers ahead are the votes. A pass's routing is close to a fingerprint of its token, so
  this generalizes layer-to-layer co-occurrence (which conditions on one layer only); on the
  DeepSeek-V2-Lite traces it names 61% of the next layer's experts in its top 6, pairwise
  co-occurrence 47%;
- token-to-token reuse: how many passes ago the key was last used (its age);
- the layer distance to the key's next occurrence.

The probability is not a formula of these: it is the measured share of keys with the same
(distance, votes, age) that were used, counted online over every prediction ever made. So it is
calibrated by construction (a key given 0.6 is used about 60% of the time), it starts from a low
prior on a cold router, and on a trace with no structure it stays at the base rate, which keeps
the prefetcher silent. Gate lookahead from compute (`hint`) overrides the history for the layer it
names, with its own measured precision.

`Prefetcher` picks, after each `need`, the keys of the next `depth` layers whose probability
clears `threshold`, and gates itself per layer distance on the precision it measures (prefetches
whose key was used at the occurrence they were fetched for / prefetches): a distance whose
precision falls under `min_precision` issues only every `probe_every`-th time, to keep measuring.

The router runs both (runtime/cache.py `Predictive` reads the probabilities to choose victims);
deltafin-replay drives the same classes over a routing trace (docs/TRACES.md).
"""
from __future__ import annotations

from typing import Callable, Iterable

import numpy as np

# Age buckets in passes between a key's last use and the occurrence predicted (1 = used in the
# previous pass): bucket i holds ages >= AGE_EDGES[i]. Never used falls in the last bucket.
AGE_EDGES = (1, 2, 3, 4, 5, 7, 11, 19, 35, 67)
_AGE_CAP = AGE_EDGES[-1]
_AGE_LUT = np.searchsorted(np.array(AGE_EDGES), np.arange(_AGE_CAP + 1), side="right") - 1
_AGE_LUT[0] = 0
_NEVER = -(1 << 40)


class PredictorError(ValueError):
    pass


class RoutingPredictor:
    """Online probabilities that each (layer, expert) is used at its layer's next occurrence.

    `observe(layer, experts)` is told every `need` in order; a layer lower than the current one
    starts a new forward pass (a need of the same layer again adds experts to it: the chunks of
    one layer). `end_pass()` closes a pass explicitly (the end of a forward pass), which a
    one-layer model needs. Layers are indices in [0, n_layers); layers that never appear (dense
    ones) cost nothing.

    Calibration counts one prediction in `sample_every` (chosen by distance, rotating with the
    pass), which keeps the bookkeeping a quarter of the cost and still gives every cell thousands
    of samples per hundred passes.
    """

    def __init__(self, n_layers: int, n_experts: int, history: int = 8192, neighbours: int = 16,
                 candidates: int = 512, reselect: Iterable[int] = (1, 2, 4, 8),
                 refine_layers: int | None = None, sample_every: int = 4,
                 prior: tuple[float, float] = (0.2, 2.0)):
        if n_layers < 1 or n_experts < 1:
            raise PredictorError("the predictor needs at least one layer and one expert")
        if not 1 <= neighbours <= candidates <= history:
            raise PredictorError("need 1 <= neighbours <= candidates <= history")
        self.n_layers, self.n_experts = n_layers, n_experts
        self.history, self.k, self.n_cand = history, neighbours, candidates
        self.reselect = frozenset(reselect)  # the i-th layer of a pass (1-based) re-picks candidates
        # neighbours are refined by the first `refine_layers` layers of a pass, then kept
        self.refine_layers = refine_layers or n_layers
        self.sample_every = max(1, sample_every)
        L, E = n_layers, n_experts
        self.words = (E + 63) // 64
        # history of passes: the experts of each layer as bit masks, a ring of `history` passes
        self.sig = np.zeros((L, history, self.words), dtype=np.uint64)
        self.stored = 0                   # passes in the ring (<= history)
        self.head = 0                     # ring index the next pass goes to
        self.cur_sig = np.zeros((L, self.words), dtype=np.uint64)
        self.cur_used = np.zeros((L, E), dtype=bool)
        self.score = np.zeros(history, dtype=np.int32)  # overlap of each past pass with this one
        self.cand: np.ndarray | None = None
        self.layers_seen = 0              # layers observed in this pass
        self.passes = 0                   # passes completed
        self.layer = -1                   # layer of the last observe in this pass (-1: none yet)
        self.last_use = np.full((L, E), _NEVER, dtype=np.int64)  # pass index of the last use
        # calibration cells: (distance 1..L, votes 0..k or "none" = k+1, age bucket)
        self.n_age = len(AGE_EDGES)
        self.n_votes = self.k + 2
        cells = (L + 1) * self.n_votes * self.n_age
        self.seen = np.full(cells, prior[1], dtype=np.float64)
        self.hit = np.full(cells, prior[0] * prior[1], dtype=np.float64)
        self.p_cell = self.hit / self.seen
        # per position (the layer just observed): each row's distance to its next occurrence and
        # the base of its cell (rows behind the position belong to the next pass: votes "none")
        rows = np.arange(L)
        self._dist = np.where(rows[None, :] > rows[:, None], rows[None, :] - rows[:, None],
                              rows[None, :] - rows[:, None] + L)
        no_votes = np.where(rows[None, :] > rows[:, None], 0, self.k + 1)
        self._row_base = ((self._dist * self.n_votes + no_votes) * self.n_age).astype(np.int32)
        # the age bucket of each key at its next occurrence, for rows ahead (this pass) and behind
        # (next pass) of the position
        self.age_cell = np.full((L, E), self.n_age - 1, dtype=np.int32)
        # the cell each sampled key was predicted from, per target occurrence, until it resolves
        self.pend_this = np.full((L, L + 1, E), -1, dtype=np.int32)
        self.pend_next = np.full((L, L + 1, E), -1, dtype=np.int32)
        # per (pass phase, position): the sampled rows ahead and behind, with their distances
        self._sampled = [[self._sample_rows(phase, pos) for pos in range(L)]
                         for phase in range(self.sample_every)]
        self.votes = np.zeros((L, E), dtype=np.int32)   # neighbours' votes, rows ahead only
        self.q = np.full((L, E), prior[0])               # the probabilities, refreshed by observe
        self.version = 0                  # bumped whenever q changes (policies cache on it)
        # gate lookahead: hinted experts per layer for the current pass, and their measured precision
        self.hinted: dict[int, np.ndarray] = {}
        self.hint_seen, self.hint_hit = 2.0, 1.0
        self.foreseen = np.zeros(L, dtype=bool)  # rows a hint has ever named (`miss_weights`)
        self.listeners: list[Callable[[int, np.ndarray], None]] = []
        self._bit = np.left_shift(np.uint64(1), np.arange(64, dtype=np.uint64))

    # -- input --------------------------------------------------------------------------------------
    def observe(self, layer: int, experts) -> None:
        """One `need`: `experts` of `layer` are used now (by the current pass)."""
        if not 0 <= layer < self.n_layers:
            raise PredictorError(f"layer {layer} outside [0, {self.n_layers})")
        ex = np.asarray(experts, dtype=np.intp).reshape(-1)
        if ex.size and (ex.min() < 0 or ex.max() >= self.n_experts):
            raise PredictorError(f"expert ids must lie in [0, {self.n_experts})")
        if layer < self.layer:
            self.end_pass()
        changed = layer != self.layer
        if changed:
            if self.layer >= 0:
                self._layer_done(self.layer)
            self.layer = layer
            self.layers_seen += 1
            self.votes[layer] = 0  # the row falls behind the position: next pass, no votes
        new = ex[~self.cur_used[layer, ex]]
        if new.size == 0 and not changed:
            return  # a chunk of this layer with nothing new
        self.cur_used[layer, new] = True
        self.last_use[layer, new] = self.passes
        if self.words == 1:
            mask = np.bitwise_or.reduce(self._bit[new], keepdims=True)
        else:
            mask = np.zeros(self.words, dtype=np.uint64)
            np.bitwise_or.at(mask, new // 64, self._bit[new % 64])
        self.cur_sig[layer] |= mask
        # the row now predicts the next pass: age from the next pass's point of view
        self.age_cell[layer] = _AGE_LUT[np.minimum(self.passes + 1 - self.last_use[layer], _AGE_CAP)]
        self._match(layer, mask)
        self._refresh(layer)

    def end_pass(self) -> None:
        """Closes the current forward pass: resolves its predictions and stores its routing."""
        if self.layer < 0:
            return
        self._layer_done(self.layer)
        pend = self.pend_this
        ok = pend >= 0
        if ok.any():
            cells = pend[ok]
            hit = np.broadcast_to(self.cur_used[:, None, :], pend.shape)[ok]
            self.seen += np.bincount(cells, minlength=self.seen.size)
            self.hit += np.bincount(cells, weights=hit, minlength=self.hit.size)
            self.p_cell = self.hit / self.seen
        self.pend_this, self.pend_next = self.pend_next, pend
        self.pend_next.fill(-1)
        if self.history:
            self.sig[:, self.head] = self.cur_sig
            self.head = (self.head + 1) % self.history
            self.stored = min(self.stored + 1, self.history)
        self.cur_sig.fill(0)
        self.cur_used.fill(False)
        self.score.fill(0)
        self.votes.fill(0)
        self.cand = None
        self.layers_seen = 0
        self.layer = -1
        self.passes += 1
        self.hinted.clear()
        # every row is ahead again (this pass); the age of its key at this pass
        self.age_cell = _AGE_LUT[np.minimum(self.passes - self.last_use, _AGE_CAP)].astype(np.int32)

    def hint(self, layer: int, experts, weights=None) -> None:
        """Gate lookahead: compute applied `layer`'s gate to the current hidden state and expects
        `experts` (optionally with their gate weights, unused for now). Until `layer` is observed
        in this pass its hinted experts get the hints' measured precision, if that is higher than
        what the history says; the precision is counted when the layer arrives."""
        if not 0 <= layer < self.n_layers:
            raise PredictorError(f"layer {layer} outside [0, {self.n_layers})")
        ex = np.unique(np.asarray(experts, dtype=np.intp).reshape(-1))
        if ex.size and (ex.min() < 0 or ex.max() >= self.n_experts):
            raise PredictorError(f"expert ids must lie in [0, {self.n_experts})")
        self.hinted[layer] = ex
        self.q[layer, ex] = np.maximum(self.q[layer, ex], self.hint_precision())
        self.foreseen[layer] = True
        self.version += 1

    # -- output -------------------------------------------------------------------------------------
    def probabilities(self) -> np.ndarray:
        """q[layer, expert]: probability of use at the layer's next occurrence (do not modify)."""
        return self.q

    def distance(self, layer: int) -> int:
        """Layers from the current position to `layer`'s next occurrence (1..n_layers)."""
        return int(self.distances()[layer])

    def distances(self) -> np.ndarray:
        """Per layer, the layers from the current position to its next occurrence (1..n_layers)."""
        return self._dist[self.layer] if self.layer >= 0 else self._dist[-1]

    def predict(self, layer: int, k: int | None = None, min_p: float = 0.0) -> list[tuple[int, float]]:
        """The `k` most likely experts of `layer`'s next occurrence, [(expert, probability)], most
        likely first, those under `min_p` left out."""
        q = self.q[layer]
        order = np.argsort(-q, kind="stable")
        if k is not None:
            order = order[:k]
        return [(int(e), float(q[e])) for e in order if q[e] >= min_p]

    def hint_precision(self) -> float:
        return self.hint_hit / self.hint_seen

    def miss_weights(self) -> np.ndarray | None:
        """Per row, what a miss of its key costs relative to the others, for choosing victims; None
        while no hint has come (every row alike). A row the gate lookahead foresees has a missing
        expert's read started a layer early (the lease), so part of its miss is hidden; a row it
        never names (the pass's first MoE layer) waits for the whole read: its keys weigh
        1 + the hints' measured precision. On the issue's 8 x 32 store at 25% (real supervisors,
        docs/BENCHMARKS.md) misses fell 143 -> 131-135 per 64 tokens, the first layer's 44 -> 30."""
        if not self.foreseen.any():
            return None
        return np.where(self.foreseen, 1.0, 1.0 + self.hint_precision())

    def stats(self) -> dict:
        return {"passes": self.passes, "history": self.stored,
                "hint_precision": round(self.hint_precision(), 4)}

    # -- internals ----------------------------------------------------------------------------------
    def _layer_done(self, layer: int) -> None:
        """`layer`'s occurrence in this pass is complete: score the hints, tell the listeners."""
        used = self.cur_used[layer]
        hinted = self.hinted.pop(layer, None)
        if hinted is not None and hinted.size:
            self.hint_seen += hinted.size
            self.hint_hit += int(used[hinted].sum())
        for fn in self.listeners:
            fn(layer, used)

    def _match(self, layer: int, mask: np.ndarray) -> None:
        """Adds the overlap with `mask` at `layer` to each past pass's score and takes the votes
        of the best `neighbours` for every layer ahead."""
        n = self.stored
        if n == 0 or layer == self.n_layers - 1 or self.layers_seen > self.refine_layers:
            return
        sig = self.sig[layer]
        repick = self.cand is None or self.layers_seen in self.reselect
        if repick or n <= self.n_cand:  # every past pass: the candidates are re-picked
            overlap = np.bitwise_count(sig[:n] & mask)
            self.score[:n] += overlap[:, 0] if self.words == 1 else overlap.sum(axis=1, dtype=np.int32)
            if n <= self.n_cand:
                self.cand = np.arange(n)
            elif repick:
                self.cand = self._top(np.arange(n), self.n_cand)
            self.cand_recency = (self.cand - self.head) % self.history  # larger = more recent
        else:  # past the last re-pick only the candidates' scores matter
            c = self.cand
            overlap = np.bitwise_count(sig[c] & mask)
            self.score[c] += overlap[:, 0] if self.words == 1 else overlap.sum(axis=1, dtype=np.int32)
        nn = self._top(self.cand, min(self.k, len(self.cand)), self.cand_recency)
        # votes: how many neighbours used each expert at each layer ahead
        ahead = slice(layer + 1, self.n_layers)
        bits = np.unpackbits(self.sig[ahead][:, nn].view(np.uint8), axis=-1, bitorder="little")
        votes = bits.sum(axis=1, dtype=np.int32)[:, :self.n_experts]
        if len(nn) < self.k:  # a short history: scale the votes to k neighbours
            votes = (votes * self.k) // len(nn)
        self.votes[ahead] = votes

    def _top(self, idx: np.ndarray, m: int, recency: np.ndarray | None = None) -> np.ndarray:
        """The m of `idx` with the highest score, ties to the most recent pass (a distinct key per
        pass also keeps argpartition fast: many equal keys slow it down tenfold)."""
        if m >= len(idx):
            return idx
        if recency is None:
            recency = (idx - self.head) % self.history  # larger = more recent
        key = self.score[idx].astype(np.int64) * self.history + recency
        return idx[np.argpartition(key, len(idx) - m)[len(idx) - m:]]

    def _sample_rows(self, phase: int, pos: int) -> tuple:
        dist = self._dist[pos]
        rows = np.flatnonzero(dist % self.sample_every == phase)
        ahead, behind = rows[rows > pos], rows[rows <= pos]
        return ahead, dist[ahead], behind, dist[behind]

    def _refresh(self, layer: int) -> None:
        """Recomputes q for every key as seen from `layer`, and records the cells of this pass's
        sampled distances so that their outcomes are counted when the occurrences resolve."""
        cell = self._row_base[layer][:, None] + self.votes * self.n_age + self.age_cell
        self.q = self.p_cell[cell]
        ahead, d_ahead, behind, d_behind = self._sampled[self.passes % self.sample_every][layer]
        self.pend_this[ahead, d_ahead] = cell[ahead]
        self.pend_next[behind, d_behind] = cell[behind]
        if self.hinted:
            p = self.hint_precision()
            for hl, ex in self.hinted.items():
                if hl > layer:
                    self.q[hl, ex] = np.maximum(self.q[hl, ex], p)
        self.version += 1


class LeaseGate:
    """Whether lease reads pay: the lookahead can name the resident experts well and the missing
    ones poorly (a model whose next gate differs much from this layer's: 0.58 against 0.27 on a
    random-init qwen3_moe on the H200), so lease reads keep their own precision (used / used or
    wasted, decayed by `decay` per key asked, so it follows the workload). Under `min_precision`
    a lease reads only every `probe_every`-th missing key, so the precision keeps being measured."""

    def __init__(self, min_precision: float, probe_every: int, decay: float = 0.98):
        self.min_precision, self.probe_every, self.decay = min_precision, probe_every, decay
        self.used = self.resolved = 0.0    # decayed outcomes
        self.seen = (0, 0)                 # the (used, wasted) totals last seen
        self.probes = 0

    def pays(self, used: int, wasted: int) -> bool:
        """used, wasted: the slot tables' lease totals so far."""
        du, dw = used - self.seen[0], wasted - self.seen[1]
        self.seen = (used, wasted)
        self.used = self.used * self.decay + du
        self.resolved = self.resolved * self.decay + du + dw
        if (self.used + 1) / (self.resolved + 2) >= self.min_precision:
            return True
        self.probes += 1
        return self.probes % self.probe_every == 0


class ReadGate:
    """Whether one more prefetch read pays for the disk time it takes, from what the router
    measures as it runs (no settings): a record's read time (busy time of the read pipeline per
    read), the time from answering a need to the next need (compute's time, the disk's only idle
    time: during a need's stall its own demand reads hold the disk), compute's time per layer
    (that time over the layers between the two needs: compute asks only for layers that miss),
    and the share of needs that wait for reads. On a disk busy most of a run (the dsv2-lite
    stand-in: 75-92%) a prefetch read still in flight when the next need comes shares the disk
    with that need's demand reads and delays them; one that completes in compute's time is free.

    `pays(q, distance, ahead)`: with `ahead` reads in flight before it, a read issued now ends
    after (ahead + 1) x read time; its layer comes after distance x the time per layer. If used
    (probability q) it saves its demand read's stall, less what it is late by; it costs the part
    of it that overlaps the next need times the share of needs that wait (unless it is a read of
    the very next layer and used). It pays when q x saved >= cost. Until reads and gaps are
    measured it says yes (the precision gate alone rules). The router feeds it: `sent`/`done`
    per read, `answered` per demand need answered, `need` per demand need; positions are the
    predictor's rows (MoE layers in order) of `n_layers`.
    """

    def __init__(self, n_layers: int, decay: float = 0.98, follow: float = 0.05):
        self.n_layers = n_layers
        self.decay = decay    # per read done, of the busy time and the reads counted
        self.follow = follow  # weight of a new gap or need in their running means
        self.in_flight = 0
        self.last = None             # time of the last sent/done (busy time runs while in_flight)
        self.busy_s = 0.0            # decayed seconds with a read in flight
        self.bytes = 0.0             # decayed bytes read (reported)
        self.reads = 0.0             # decayed reads done
        self.next_s: float | None = None   # running mean time from an answer to the next need
        self.layer_s: float | None = None  # ... over the layers between them
        self.miss_share = 0.5        # running share of demand needs that wait for reads
        self.answered_at: tuple[float, int] | None = None
        self.asked = self.refused = 0

    def sent(self, now: float) -> None:
        self._tick(now)
        self.in_flight += 1

    def done(self, now: float, nbytes: int) -> None:
        self._tick(now)
        self.in_flight = max(0, self.in_flight - 1)
        self.busy_s *= self.decay
        self.bytes = self.bytes * self.decay + nbytes
        self.reads = self.reads * self.decay + 1.0

    def answered(self, now: float, position: int) -> None:
        self.answered_at = (now, position)

    def need(self, now: float, position: int, missed: bool) -> None:
        """A demand need of the layer at `position` arrived; `missed`: it waits for reads."""
        a = self.follow
        if self.answered_at is not None:
            t, p = self.answered_at
            gap, layers = now - t, (position - p) % self.n_layers or self.n_layers
            self.next_s = gap if self.next_s is None else self.next_s + a * (gap - self.next_s)
            per = gap / layers
            self.layer_s = per if self.layer_s is None else self.layer_s + a * (per - self.layer_s)
            self.answered_at = None
        self.miss_share += a * (float(missed) - self.miss_share)

    def read_s(self) -> float | None:
        """Seconds one record takes the read pipeline: busy time per read."""
        if self.reads < 4 or self.busy_s <= 0:
            return None
        return self.busy_s / self.reads

    def pays(self, q: float, distance: int, ahead: int) -> bool:
        t = self.read_s()
        if t is None or self.next_s is None:
            return True
        self.asked += 1
        finish = (ahead + 1) * t
        saved = min(t, max(0.0, t - max(0.0, finish - distance * self.layer_s)))
        overlap = min(t, max(0.0, finish - self.next_s))
        cost = self.miss_share * overlap * ((1.0 - q) if distance == 1 else 1.0)
        ok = saved > 0 and q * saved >= cost
        self.refused += not ok
        return ok

    def stats(self) -> dict:
        t = self.read_s()
        ms = lambda v: round(v * 1e3, 3) if v is not None else None
        return {"mb_per_s": round(self.bytes / self.busy_s / 1e6, 1) if self.busy_s > 0 else None,
                "read_ms": ms(t), "next_need_ms": ms(self.next_s), "layer_ms": ms(self.layer_s),
                "miss_share": round(self.miss_share, 4), "asked": self.asked, "refused": self.refused}

    def _tick(self, now: float) -> None:
        if self.last is not None and self.in_flight > 0:
            self.busy_s += max(0.0, now - self.last)
        self.last = now


class Prefetcher:
    """Self-gating prefetch: after each `need`, the keys of the next `depth` layers (from
    `min_distance` on) whose probability is at least `threshold` and that are not resident, at
    most `max_per_step`, most likely first.

    Each distance keeps a running precision (prefetches whose key was used at the occurrence they
    were fetched for / prefetches, decayed so it follows the workload); a distance under
    `min_precision` issues only every `probe_every`-th step, so it keeps measuring and turns back
    on when prediction improves. The table's own counters give the reported precision (used before
    eviction); this one only gates. With `bandwidth` (the router's, which has a clock) a read
    must also pay for its disk time (`ReadGate`, asked per key through `pays`). `gate=False` turns
    both off: a fixed setting that reads every prediction over the threshold (what
    deltafin-bench's sweep compares the gate with).
    """

    def __init__(self, predictor: RoutingPredictor, depth: int = 1, threshold: float = 0.4,
                 min_precision: float = 0.5, max_per_step: int | None = None, min_distance: int = 1,
                 probe_every: int = 16, decay: float = 0.999, gate: bool = True, bandwidth: bool = False):
        if depth < min_distance or min_distance < 1:
            raise PredictorError("need 1 <= min_distance <= depth")
        self.predictor = predictor
        self.depth, self.min_distance = depth, min_distance
        self.threshold, self.min_precision = threshold, min_precision
        self.max_per_step = max_per_step
        self.probe_every, self.decay = probe_every, decay
        self.gate = gate  # False: a fixed setting, every prediction over the threshold is read
        # the bandwidth half of the gate, fed by the router's clock (replay has none: off there)
        self.reads = ReadGate(predictor.n_layers) if gate and bandwidth else None
        self.issued = np.full(depth + 1, 4.0)           # decayed counts per distance, with a prior
        self.used = np.full(depth + 1, 4.0 * min_precision + 1.0)  # that starts it on
        self.outstanding: dict[int, list[tuple[int, int]]] = {}  # layer -> [(expert, distance)]
        self.steps = 0
        self.tried = np.zeros(depth + 1, dtype=np.int64)        # steps with a layer at distance d
        self.gated_steps = np.zeros(depth + 1, dtype=np.int64)  # of those, steps it was gated off
        predictor.listeners.append(self._resolve)

    def precision(self, distance: int) -> float:
        return float(self.used[distance] / self.issued[distance])

    def enabled(self, distance: int) -> bool:
        return not self.gate or self.precision(distance) >= self.min_precision

    def pays(self, q: float, distance: int, ahead: int) -> bool:
        """Whether a read of a key of probability `q`, `distance` layers ahead, with `ahead` reads
        in flight before it, pays for its disk time (ReadGate); always, without that gate."""
        return self.reads is None or self.reads.pays(q, distance, ahead)

    def plan(self, resident: Callable[[tuple[int, int]], bool]) -> list[tuple[int, int]]:
        """(layer, expert) keys to read now, most likely first; `resident(key)` says whether a key
        already holds a slot (ready or loading)."""
        p = self.predictor
        if p.layer < 0:
            return []
        self.steps += 1
        picks: list[tuple[float, int, int, int]] = []
        for d in range(self.min_distance, self.depth + 1):
            layer = p.layer + d
            if layer >= p.n_layers:
                break
            self.tried[d] += 1
            q = p.q[layer]
            cand = [(float(q[e]), layer, int(e), d) for e in np.flatnonzero(q >= self.threshold)
                    if not resident((layer, int(e)))]
            if not self.enabled(d):
                # gated off: a probe of the single most likely key every probe_every steps keeps
                # the precision measured, so the distance turns back on when it pays again
                self.gated_steps[d] += 1
                if self.steps % self.probe_every or not cand:
                    continue
                cand = [max(cand)]
            picks += cand
        picks.sort(key=lambda x: -x[0])
        if self.max_per_step is not None:
            picks = picks[:self.max_per_step]
        for _, layer, e, d in picks:
            self.outstanding.setdefault(layer, []).append((e, d))
        return [(layer, e) for _, layer, e, _ in picks]

    def unissued(self, keys: Iterable[tuple[int, int]]) -> None:
        """Keys of the last plan that were not read after all (no slot could be freed)."""
        for layer, e in keys:
            got = self.outstanding.get(layer)
            if got:
                self.outstanding[layer] = [x for x in got if x[0] != e]

    def _resolve(self, layer: int, used: np.ndarray) -> None:
        """`layer`'s occurrence is complete: count which of its prefetches were used."""
        got = self.outstanding.pop(layer, None)
        if not got:
            return
        for e, d in got:
            self.issued[d] = self.issued[d] * self.decay + 1.0
            self.used[d] = self.used[d] * self.decay + float(used[e])

    def stats(self) -> dict:
        """Per layer distance: the gating precision and the share of steps it was gated off."""
        ds = range(self.min_distance, self.depth + 1)
        out = {"gate": self.gate}
        if self.reads is not None:
            out["reads"] = self.reads.stats()
        for d in ds:
            out[f"precision_d{d}"] = round(self.precision(d), 4)
        for d in ds:
            out[f"gated_share_d{d}"] = round(int(self.gated_steps[d]) / max(1, int(self.tried[d])), 4)
        return out
