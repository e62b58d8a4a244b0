"""Requests and steps: the decode loop's scheduling, testable in-process without sockets.

Generation runs as steps (`Scheduler`): every running request is a `Sequence` with its own KV
cache, and each step is one forward pass over one row per sequence (`forward_batch`: the KV cache
update and attention per sequence, everything else on the rows stacked), so each MoE layer asks
for the union of the batch's experts once. The next pass is built and sampled on the device
(`mx.async_eval`) before the previous tokens are read back, the way mlx-lm's generate_step
overlaps them, whenever the pass cannot stop on a miss (every expert resident).

Requests (`RequestQueue`): up to compute.max_batch decode together, the others wait in arrival
order in a queue (bounded by the request manager) and join between steps when a place and their KV
cache fit (`admit`: the budget's KV reserve, compute.kv_tokens). What a finished sequence is
answered with is decided here (`finished`, `error_reply`); sending it is the process's.
"""
from __future__ import annotations

import itertools
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator

import mlx.core as mx

from deltafin.protocol import messages as M
from deltafin.runtime import metrics
from deltafin.runtime.metrics import Counter, Latency
from deltafin.workers import logprobs
from deltafin.workers.sources import ExpertUnavailable, RequestError

if TYPE_CHECKING:
    from deltafin.workers.engine import Compute


PENALTY_CONTEXT = 20  # the last tokens (prompt and answer) the penalties look at, as mlx-lm's default


def penalize(logits, req: M.Generate, history):
    """The repetition, presence and frequency penalties of req on logits [1, vocab], in their
    dtype, over `history` (the last PENALTY_CONTEXT token ids, on the device), in mlx-lm's order
    and arithmetic: a token that occurs there has its logit divided by repetition_penalty
    (multiplied where negative), then presence_penalty subtracted once, then frequency_penalty
    subtracted once per occurrence (one rounding each, as a scatter-subtract does)."""
    seen = mx.zeros((logits.shape[-1],), dtype=mx.bool_).at[history].add(True)
    if req.repetition_penalty != 1.0:
        p = req.repetition_penalty
        logits = mx.where(seen, mx.where(logits < 0, logits * p, logits / p), logits)
    if req.presence_penalty:
        logits = mx.where(seen, logits - req.presence_penalty, logits)
    if req.frequency_penalty:
        logits = logits.at[:, history].subtract(req.frequency_penalty)
    return logits


def penalized(req: M.Generate) -> bool:
    return req.repetition_penalty != 1.0 or bool(req.presence_penalty) or bool(req.frequency_penalty)


def sample_on_device(logits, req: M.Generate, key, dtype=None, history=None):
    """The next token of each row of logits [R, vocab] (R tokens, [R]), on the device (lazy: read
    back one step later), with req's settings. The penalties go first (`penalize`, where history
    is given). Greedy is the argmax of the log-probabilities computed in the model's dtype
    `dtype`, as mlx-lm's generate_step computes them: in bfloat16, subtracting the log-sum-exp
    can round two neighbouring logits to one value, and the lower token id then wins there too;
    a temperature below M.GREEDY_BELOW_TEMPERATURE is greedy as well, and top_k 1 (the most
    likely token whatever else is asked: greedy's, ties included). Otherwise
    softmax(logits / temperature) restricted to the smallest set of most likely tokens whose
    probability reaches top_p, then to those at least min_p times as likely as the most likely
    one, then to the top_k most likely, drawn with `key`."""
    if history is not None:
        logits = penalize(logits.astype(dtype or logits.dtype), req, history)
    if M.greedy(req.temperature) or req.top_k == 1:
        row = logits.astype(dtype or logits.dtype)  # exact: the model's own values (no op if already)
        return mx.argmax(row - mx.logsumexp(row, axis=-1, keepdims=True), axis=-1)
    z = logits.astype(mx.float32) / req.temperature
    if req.top_p < 1:
        probs = mx.softmax(z, axis=-1)
        order = mx.argsort(-probs, axis=-1)
        ranked = mx.take_along_axis(probs, order, axis=-1)
        before = mx.cumsum(ranked, axis=-1) - ranked  # probability of the tokens ranked above
        # back to vocabulary order
        drop = mx.take_along_axis(before >= req.top_p, mx.argsort(order, axis=-1), axis=-1)
        z = mx.where(drop, -mx.inf, z)
    if req.min_p > 0:
        logprobs = z - mx.logsumexp(z, axis=-1, keepdims=True)
        z = mx.where(logprobs < mx.max(logprobs, axis=-1, keepdims=True) + math.log(req.min_p), -mx.inf, z)
    if 0 < req.top_k < z.shape[-1]:
        beyond = mx.argpartition(-z, kth=req.top_k - 1, axis=-1)[..., req.top_k:]
        z = mx.put_along_axis(z, beyond, mx.array(-mx.inf, dtype=z.dtype), axis=-1)
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
    reused: int | None = None  # prompt tokens the prompt cache gave it (None: not looked up yet)
    pending: object = None     # the token its next decode pass takes (on the device, or an int)
    t_request: float = 0.0
    t_first: float | None = None  # its first token was read (the end of its prefill)
    t_end: float | None = None
    marks: dict = field(default_factory=dict)  # split/loop snapshots at its start and first token
    grammar: object = None     # its json_schema's place (workers/structured.Grammar), or None

    def next_key(self):
        """A fresh sampling key per token (none needed for greedy)."""
        if M.greedy(self.req.temperature):
            return None
        self.key, sub = mx.random.split(self.key)
        return sub

    def history(self, token, early: bool):
        """The last PENALTY_CONTEXT tokens before the one this pass samples, on the device (None
        where no penalty is asked); early: `token` (this pass's input, [1]) is not in out_ids yet."""
        if not penalized(self.req):
            return None
        known = (self.prompt + self.out_ids)[-(PENALTY_CONTEXT - early):]
        ids = mx.array(known, dtype=mx.uint32)
        return mx.concatenate([ids, token.astype(mx.uint32).reshape(-1)]) if early else ids

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
    tokens: object      # [B] on the device; None until sampled (`Scheduler.sample`)
    pass_no: int | None
    t0: float
    logprobs: list | None = None  # per row: workers/logprobs.on_device's arrays, or None
    rows: list | None = None      # per row: its logits [1, vocab], kept until sampled
    inputs: object = None         # the tokens the pass took [B]


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
        """One chunk of the sequence's prompt. Its first starts from the prompt cache's longest
        prefix of it, where one is kept (that chunk then computes the first block past it); each
        whole chunk prefilled goes into the cache. Chunks are the cache's blocks, so a sequence
        computes the same rows together whether it starts from a cached prefix or not."""
        c, pc = self.compute, self.compute.prompt_cache
        head = seq.head
        if seq.reused is None:
            seq.reused = pc.restore(pc.lookup(head, len(head)), seq.cache) if pc else 0
            seq.filled = seq.reused
        if seq.filled < len(head):
            chunk = head[seq.filled:seq.filled + c.prefill_chunk]
            c.forward(chunk, seq.cache)
            seq.filled += len(chunk)
            if pc and len(chunk) == pc.block:
                pc.insert(head, seq.filled, seq.cache)
            c.prefill_progress()
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
        elif step.tokens is None:  # launched early over a constrained row: its grammar is current now
            self.sample(step, early=False)
        # Early only where every row is still wanted: a row whose sequence left has no cache.
        if (not hold and c.experts.can_overlap() and step.seqs == self.active
                and all(len(s.out_ids) + 1 < s.req.max_tokens for s in step.seqs)):
            self.ahead = self.launch(step.seqs, step.tokens, early=True)
        toks = self.read(step)
        t0, produced = time.perf_counter(), 0
        for seq, tok, lp in zip(step.seqs, toks, step.logprobs):
            if seq.finish is not None:
                continue  # left while this pass ran ahead: its row is not wanted
            produced += 1
            if seq.t_first is None:
                seq.t_first = t0
                seq.ttft_s = t0 - seq.t_request
                seq.marks["first"] = (c._split(), dict(self.loop))
            self.accept(seq, tok, logprobs.to_host(tok, lp) if lp else None)
            seq.pending = tok
            if seq.finish is not None or len(seq.out_ids) >= seq.req.max_tokens:
                self.leave(seq, "length")
                done.append(seq)
        # Expert bytes copied in during decode steps, and the tokens those steps produced
        # (expert_bytes_per_token: what one read serves falls as the batch grows).
        self.counters.add("decode_tokens", produced)
        self.counters.add("decode_bytes", c.experts.counters.get("bytes") - bytes0)
        self.loop["accept"] += time.perf_counter() - t0

    def launch(self, seqs: list, tokens, early: bool = False) -> Step:
        """A pass over seqs taking `tokens`; early: they are the last pass's sampled tokens, not
        read yet (not in the sequences' out_ids)."""
        c = self.compute
        t0 = time.perf_counter()
        if not isinstance(tokens, mx.array):
            tokens = mx.stack([t if isinstance(t, mx.array) else mx.array(t, dtype=mx.uint32)
                               for t in tokens]).reshape(-1)
        p = c.experts.begin_pass(len(seqs), rows=c.recorder is not None)
        # In the model's dtype (sample_on_device casts where it needs float32), each row sampled
        # on its own [1, vocab] slice: one sequence's tokens are its sampler's output as it is.
        logits = c.model.forward_batch(tokens, [s.cache for s in seqs], c.experts, float32=False)
        step = Step(list(seqs), None, p, t0, rows=[logits if len(seqs) == 1 else logits[b:b + 1]
                                                   for b in range(len(seqs))], inputs=tokens)
        ids = c.experts.seal_pass()
        ids = [] if ids is None else [ids]
        if early and any(s.grammar is not None for s in seqs):
            # A grammar's mask needs the token this pass takes, read later: the pass computes
            # now and is sampled once its turn comes (`decode`).
            mx.async_eval(logits, *ids)
        else:
            self.sample(step, early, ids)
        self.loop["launch"] += time.perf_counter() - t0
        self.counters.add("steps")
        if early:
            self.counters.add("early_steps")
        self.counters.add("rows", len(seqs))
        self.max_rows = max(self.max_rows, len(seqs))
        return step

    def sample(self, step: Step, early: bool, extra: list = ()) -> None:
        """Each row of the step sampled with its sequence's settings (a constrained one among the
        tokens its grammar allows: workers/structured.py), on the device; logprobs are the
        model's own, before any mask. early: the pass's input tokens are not read yet. extra:
        more arrays to evaluate with them."""
        c = self.compute
        toks = [sample_on_device(self.constrained(s, row), s.req, s.next_key(), c.dtype,
                                 s.history(step.inputs[b:b + 1], early))
                for b, (s, row) in enumerate(zip(step.seqs, step.rows))]
        step.logprobs = [logprobs.on_device(row, t, s.req.logprobs, c.dtype) if s.req.logprobs is not None
                         else [] for s, row, t in zip(step.seqs, step.rows, toks)]
        step.tokens = toks[0] if len(toks) == 1 else mx.concatenate(toks)
        step.rows = None
        mx.async_eval(step.tokens, *(a for row in step.logprobs for a in row), *extra)

    @staticmethod
    def constrained(seq: Sequence, row):
        """row [1, vocab] with the tokens seq's grammar does not allow next at -inf (as it is
        where seq has no grammar, or has finished)."""
        if seq.grammar is None or seq.finish is not None:
            return row
        allowed = mx.array(seq.grammar.allowed()).reshape(1, -1)
        return mx.where(allowed, row, mx.array(-mx.inf, dtype=row.dtype))

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

    def accept(self, seq: Sequence, tok: int, lp: dict | None = None) -> None:
        c, req = self.compute, seq.req
        # The stand-in's zero logits say nothing: its length is max_tokens, whatever token 0 is.
        if tok in c.eos_ids and not c.standin:
            seq.finish = "stop"
            return
        seq.out_ids.append(tok)
        if seq.grammar is not None and seq.grammar.advance(tok):
            seq.finish = "stop"  # the JSON is complete
        if seq.emit:  # every token: the text side needs each id to detokenize and find stops
            seq.emit(M.Token(id=req.id, index=len(seq.out_ids) - 1, token_id=tok, text="",
                             logprobs=[lp] if lp else None))

    def stats(self) -> dict:
        steps, rows = self.counters.get("steps"), self.counters.get("rows")
        tokens, nbytes = self.counters.get("decode_tokens"), self.counters.get("decode_bytes")
        return {"max_batch": self.max_batch, "active": len(self.active), "prefilling": len(self.filling),
                "steps": int(steps), "early_steps": int(self.counters.get("early_steps")),
                "rows": int(rows), "max_rows": self.max_rows,
                "mean_size": rows / steps if steps else None,
                "decode_tokens": int(tokens), "decode_expert_bytes": int(nbytes),
                "expert_bytes_per_token": nbytes / tokens if tokens else None,
                "kv_used_bytes": self.kv_used, "kv_peak_bytes": self.kv_peak, "kv_pool_bytes": self.kv_pool,
                "prefill": [prefill_progress(seq) for seq in list(self.filling)]}


def prefill_progress(seq: Sequence) -> dict:
    """Where a sequence's prefill stands: prompt tokens done (the prompt cache's among them) of
    its total, and the rate of those it computed since it started."""
    t0 = seq.marks["start"][0]["t"] if "start" in seq.marks else None
    computed = seq.filled - (seq.reused or 0)
    return {"id": str(seq.req.id), "done": seq.filled, "total": len(seq.head), "cached": seq.reused or 0,
            "tok_s": metrics.tok_s(computed, time.perf_counter() - t0) if t0 is not None and computed else None}



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
    """compute's requests in arrival order: up to `max_batch` run (decoded together), the others
    wait behind them. How many are in flight is bounded once, by the request manager
    (workers/requests.py). A request is named by (client, id): ids are each client's own."""

    def __init__(self, max_batch: int = 1):
        self.max_batch = max_batch
        self.waiting: deque[Queued] = deque()
        self.running: list[Queued] = []
        self.counters = Counter()
        self.wait = Latency()
        # Starts and ends numbered in one sequence (Done.stats["order"]): with max_batch 1 a
        # request's [start, end] never encloses another's.
        self.events = itertools.count(1)

    def add(self, client: bytes, req) -> Queued:
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
        return {"waiting": len(self.waiting), "max_batch": self.max_batch,
                "running": len(self.running), **self.counters.snapshot(), "wait": self.wait.summary()}



def admit(queue: RequestQueue, compute, emit_to: Callable, go: Callable[[], bool]) -> Iterator[tuple]:
    """Waiting requests start in arrival order while the batch has room for them (a place and
    their KV cache) and `go()` holds; a generate request joins the scheduler. Yields what the
    caller must answer: (item, RequestError) for a request its check refused (it left the queue),
    (item, None) for a logits request, running now and alone (the batch has drained).
    emit_to(client): the callable a sequence's tokens go to."""
    sched = compute.scheduler
    while go() and queue.waiting:
        item = queue.waiting[0]
        req = item.req
        if isinstance(req, M.Generate) and item.seq is None:
            try:
                item.seq = compute.start(req, emit_to(item.client))
            except RequestError as e:
                queue.waiting.popleft()
                yield item, e
                continue
            item.seq.owner = item
        if item.seq is not None and not sched.fits(item.seq):
            return  # waits for a sequence to finish (FIFO: none overtakes it)
        if item.seq is None and sched.busy():
            return  # a logits request runs alone, once the batch has drained
        queue.next()
        if item.seq is not None:
            if not sched.busy():
                compute._begin_request()
            sched.add(item.seq)
        else:
            yield item, None


def error_reply(rid, e: Exception) -> M.Error:
    """A failed request's answer: the error's own code where it is one of ours, else internal."""
    if isinstance(e, (RequestError, ExpertUnavailable)) and getattr(e, "code", None):
        return M.Error(id=rid, code=e.code, message=str(e))
    return M.Error(id=rid, code=M.ErrorCode.INTERNAL, message=f"{type(e).__name__}: {e}")


def finished(queue: RequestQueue, compute, seq: Sequence) -> M.Done | M.Error:
    """A sequence that left the batch: its request leaves the queue; returns its answer (its
    Done, or its error). A cancelled one's router pins go."""
    item = seq.owner
    queue.finish(item)
    if seq.error is not None:
        return error_reply(item.req.id, seq.error)
    done = compute.done(seq)
    done.stats["queue_s"] = seq.marks["start"][0]["t"] - item.arrived  # its own times exclude its wait
    done.stats["order"] = [item.started, next(queue.events)]
    if done.finish_reason == "cancelled":
        compute.counters.add("cancelled")
        compute.abandon()  # the router's pins go; the KV cache went with the sequence
    return done


def cancelled_reply(item: Queued) -> M.Done | M.Error:
    """A request cancelled before it started (nothing to free): its answer."""
    req = item.req
    if isinstance(req, M.Generate):
        return M.Done(id=req.id, text="", token_ids=[], finish_reason="cancelled",
                      stats={"prompt_tokens": 0, "generated_tokens": 0,
                             "queue_s": time.perf_counter() - item.arrived})
    return M.Error(id=req.id, code=M.ErrorCode.CANCELLED, message="cancelled before it started")
