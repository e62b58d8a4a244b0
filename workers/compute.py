"""Compute: owns MLX, the dense weights, the KV cache and sampling; runs the forward pass.

At every MoE layer the model computes the real routing; `SlotExperts` then asks the expert
source (the router, over a socket, or in-process) for the chosen experts' slots, wraps the slot
bytes as MLX arrays (the prepare stage) and runs each expert with mx.quantized_matmul on the
tokens routed to it. Each expert's result depends only on its own tokens, so the output is the
same whatever the memory budget, the slot assignment or the order experts arrive in.

Benchmark modes (config [bench], reported as `bench_mode` in every stats dict): `Routing`
(runtime/benchmode.py) takes the expert ids from a trace, or seeded random ones, instead of the
gate; `StandInModel` replaces each layer's math by a wait while requests, reads and the prepare
stage stay real; `MmapSource` + `MmapExperts` are the memory-mapped baseline (the store read
through the page cache, no cache of our own), run in-process by `run_inprocess`.
`runtime.record_trace` records the ids every token used (`TraceRecorder`, saved per request).
"""
from __future__ import annotations

import mmap
import os
import time
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from deltafin.protocol import messages as M
from deltafin.runtime.metrics import Counter, Latency
from deltafin.runtime.models import build_model
from deltafin.runtime.models.base import _expert_matmul, swiglu
from deltafin.runtime.store import Store, views_from_buffer
from deltafin.runtime.tokenizer import StreamDecoder, Tokenizer
from deltafin.runtime.benchmode import Routing, bench_mode, precise_wait
from deltafin.runtime.traces import TraceRecorder


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


class LocalExpertSource:
    """Router and loader called directly: the in-process wiring used by tests and tools."""

    def __init__(self, router, loader):
        self.router, self.loader, self.req = router, loader, 0

    def need(self, layer: int, experts: list[int]) -> Granted:
        self.req += 1
        t0 = time.perf_counter()
        reads, reply = self.router.need(self.req, layer, experts)
        for order in reads:
            result = self.loader.read(order)
            if isinstance(result, M.LoadFailed):
                self.router.load_failed(result)
                raise ExpertUnavailable(result.error)
            reply = self.router.loaded(result) or reply
        wait = time.perf_counter() - t0 if reads else 0.0
        return Granted([(e, s) for e, s, _ in reply.slots], reply.hits, wait)

    def release(self) -> None:
        self.router.release()


class StandInModel:
    """The model's call signature with each layer's math replaced by a wait: the MoE layers still
    request their experts and run the prepare stage (`SlotExperts.fetch`), so reads, messages and
    copies stay real; the logits are zeros (greedy then picks token 0)."""

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


class SlotExperts:
    """The ExpertProvider the model calls: experts come from shared-memory slots."""

    def __init__(self, store: Store, pool_buf, slot_bytes: int, source, dtype, max_chunk: int,
                 routing: Routing | None = None):
        self.store, self.pool, self.slot_bytes = store, pool_buf, slot_bytes
        self.source, self.dtype, self.max_chunk = source, dtype, max_chunk
        self.routing = routing or Routing(store)
        self.prepare = Latency()
        self.counters = Counter()
        self.t_ipc = self.t_wait = self.t_prepare = 0.0

    def record_bytes(self, layer: int, expert: int, slot: int):
        """Where the bytes of (layer, expert) are: here its slot of the shared pool."""
        start = slot * self.slot_bytes
        return self.pool[start:start + self.store.layout(layer, expert)["nbytes"]]

    def weights(self, layer: int, expert: int, slot: int) -> dict:
        layout = self.store.layout(layer, expert)
        views = views_from_buffer(self.record_bytes(layer, expert, slot), layout)
        self.counters.add("bytes", layout["nbytes"])
        out = {}
        for t in layout["tensors"]:
            a = mx.array(views[t["name"]])  # copies out of shared memory (or the page cache)
            if t["dtype"] == "bfloat16":
                a = a.view(mx.bfloat16)
            if mx.issubdtype(a.dtype, mx.floating) and a.dtype != self.dtype:
                a = a.astype(self.dtype)
            out[t["name"]] = a
        return out

    @staticmethod
    def run_experts(w: dict, quant: dict, x, idx, sorted_rows: bool):
        """SwiGLU of stacked experts w [C, ...] on rows x with expert index idx, through
        mx.gather_qmm as mlx-lm runs it (same kernels, so the same rounding on every backend)."""
        def mm(name, inp):
            q = quant[name] or {"bits": 0, "group_size": 0}  # None: a float projection
            return _expert_matmul(inp, w, name, idx, q["bits"], q["group_size"], sorted_rows)
        up = mm("up_proj", x)
        return mm("down_proj", swiglu(mm("gate_proj", x), up))

    def chunks(self, layer: int, experts: list[int]):
        """Per chunk of at most max_chunk experts: ask the source for them, copy their bytes into
        MLX arrays stacked [C, ...] (the prepare stage); yields (expert ids in stack order, weights)."""
        for i in range(0, len(experts), self.max_chunk):
            chunk = experts[i:i + self.max_chunk]
            t0 = time.perf_counter()
            granted = self.source.need(layer, chunk)
            t1 = time.perf_counter()
            self.t_wait += granted.wait_s
            self.t_ipc += max(0.0, (t1 - t0) - granted.wait_s)
            self.counters.add("uses", len(chunk))
            self.counters.add("hits", granted.hits)
            self.counters.add("miss_bytes", (len(chunk) - granted.hits) * self.store.layout(layer)["nbytes"])
            tp = time.perf_counter()
            per = [self.weights(layer, e, slot) for e, slot in granted.slots]
            w = {name: mx.stack([p[name] for p in per]) for name in per[0]}
            mx.eval(w)  # the slot bytes now live in MLX memory; the next `need` unpins them
            dt = time.perf_counter() - tp
            for _ in per:
                self.prepare.add(dt / len(per))
            self.t_prepare += dt
            yield [e for e, _ in granted.slots], w

    def fetch(self, layer: int) -> None:
        """The stand-in's MoE layer: the same requests and prepare stage, no expert math."""
        for _ in self.chunks(layer, np.unique(self.routing.choose(layer, None)).tolist()):
            pass

    def __call__(self, layer: int, x, inds):
        lead, k, d = inds.shape[:-1], inds.shape[-1], x.shape[-1]
        x2 = x.reshape(-1, d)
        flat = self.routing.choose(layer, inds).reshape(-1)  # the gate's ids, or the trace's
        # mlx-lm sorts rows by expert once a layer has 64 (token, expert) pairs; do the same
        sorted_rows = flat.size >= 64
        quant = self.store.layout(layer)["quant"]
        pieces, order = [], []
        for stacked, w in self.chunks(layer, np.unique(flat).tolist()):
            local = np.full(int(flat.max()) + 1, -1, dtype=np.int64)
            local[stacked] = np.arange(len(stacked))
            pairs = np.nonzero(local[flat] >= 0)[0]
            pairs = pairs[np.argsort(local[flat[pairs]], kind="stable")]  # grouped by expert
            idx = mx.array(local[flat[pairs]].astype(np.uint32))
            rows = x2[mx.array(pairs // k)]
            xs, ix = (rows[:, None, :], idx) if sorted_rows else (rows[:, None, None, :], idx[:, None])
            piece = self.run_experts(w, quant, xs, ix, sorted_rows).reshape(len(pairs), d)
            # Evaluated now, so this chunk's stacked weights are freed before the next chunk's are
            # made: a lazy graph would keep every chunk of the whole forward pass alive at once
            # (26 layers x top-k experts), far past the staging reserve of the memory budget.
            mx.eval(piece)
            pieces.append(piece)
            order.append(pairs)
        y = mx.concatenate(pieces, axis=0)
        inverse = np.empty(len(flat), dtype=np.int64)
        inverse[np.concatenate(order)] = np.arange(len(flat))
        return y[mx.array(inverse)].reshape(*lead, k, d)


class MmapSource:
    """The memory-mapped baseline's expert source (what llama.cpp mainline does): the store's layer
    files mapped read-only, no cache of our own, so every use is a "hit" with no wait and a page
    fault reads from disk through the OS page cache. No router, loader or shared memory."""

    def __init__(self, store: Store):
        self.store, self.maps, self.files = store, {}, {}

    def view(self, layer: int, expert: int):
        rec = self.store.record(layer, expert)
        m = self.maps.get(rec.file)
        if m is None:
            self.files[rec.file] = f = open(self.store.path / rec.file, "rb")
            m = self.maps[rec.file] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return memoryview(m)[rec.offset:rec.offset + rec.nbytes]

    def need(self, layer: int, experts: list[int]) -> Granted:
        return Granted([(e, e) for e in experts], len(experts), 0.0)

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


class MmapExperts(SlotExperts):
    """SlotExperts whose bytes come from the store's mmap instead of a slot; the prepare stage
    (mx.array copy, stack, gather_qmm) is the same code."""

    def record_bytes(self, layer: int, expert: int, slot: int):
        return self.source.view(layer, expert)


class Compute:
    def __init__(self, store: Store, config: dict, source, pool_buf, slot_bytes: int,
                 experts_cls=None):
        self.store, self.config = store, config
        dense = store.dense_weights()
        cc = config["compute"]
        # Built in the stand-in too (never called there): the dense weights then take the memory
        # they take in a real run, so the pool the supervisor sizes after "ready" is the same.
        self.model = build_model(store.config, dense, store.manifest.get("dense_quantization"),
                                 cc["dtype"])
        self.dtype = self.model.dtype
        self.tokenizer = Tokenizer(store.tokenizer_dir, store.config)
        self.max_context = int(cc["max_context"])
        self.prefill_chunk = int(cc["prefill_chunk"])
        self.vocab = int(store.config.get("vocab_size") or self.tokenizer.vocab_size)
        experts_cls = experts_cls or SlotExperts
        self.routing, self.standin, self.bench_mode = bench_mode(
            store, config, "mmap" if issubclass(experts_cls, MmapExperts) else "slots")
        if self.standin:
            self.model = StandInModel(self.model.n_layers, store.moe_layers, self.vocab,
                                      self.standin["moe_ms"], self.standin["dense_ms"])
        self.experts = experts_cls(store, pool_buf, slot_bytes, source, self.dtype,
                                   max_chunk=store.top_k, routing=self.routing)
        self.source = source
        self.counters = Counter()
        self.forward_latency = Latency()
        self.recorder = None
        self.request_rows: list[np.ndarray] = []
        self.trace_path = (config.get("runtime") or {}).get("record_trace") or None
        if self.trace_path:
            self.recorder = TraceRecorder(store.n_experts)

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
            y = self.experts.run_experts(zeros, layout["quant"], rows[:, None, :],
                                         mx.zeros(rows.shape[0], dtype=mx.uint32), True)
            return mx.broadcast_to(y.reshape(rows.shape[0], 1, -1), (*inds.shape, x.shape[-1])) * 0
        # One token: a prompt-sized pass would leave its buffers in the allocator and inflate the
        # measurement by about what the activation reserve already covers.
        mx.eval(self.model(mx.array([0], dtype=mx.int32), self.model.make_cache(), zero_experts))
        mx.clear_cache()

    # -- passes --------------------------------------------------------------------------------
    def forward(self, ids: list[int], cache, phase: str = "prefill"):
        t0 = time.perf_counter()
        self.routing.begin_pass(len(ids))
        logits = self.model(mx.array(ids, dtype=mx.int32), cache, self.experts)
        mx.eval(logits)
        self.source.release()
        rows = self.routing.end_pass()
        if self.recorder is not None:
            self.request_rows.append(rows.copy())
        self.forward_latency.add(time.perf_counter() - t0)
        self.counters.add(f"{phase}_forward_tokens", len(ids))  # live progress for the metrics stream
        return logits

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
        out = []
        for i in range(0, len(token_ids), self.prefill_chunk):
            out.append(np.array(self.forward(token_ids[i:i + self.prefill_chunk], cache).astype(mx.float32)))
        self._end_request(name)
        return np.concatenate(out, axis=0).reshape(len(token_ids), -1)

    def generate(self, req: M.Generate, emit=None, between_tokens=None) -> M.Done:
        t_request = time.perf_counter()
        if req.token_ids is not None:
            ids = list(req.token_ids)
        elif req.prompt is not None:
            ids = self.tokenizer.encode(req.prompt, chat=req.chat)
        else:
            raise RequestError("generate needs prompt or token_ids")
        if req.max_tokens < 0 or req.temperature < 0 or not 0 < req.top_p <= 1:
            raise RequestError("max_tokens >= 0, temperature >= 0 and 0 < top_p <= 1 required")
        self._check_ids(ids, req.max_tokens)
        rng = np.random.default_rng(req.seed)
        split0 = self._split()
        self._begin_request()
        cache = self.model.make_cache()
        t0 = time.perf_counter()
        ttft = None
        for i in range(0, len(ids), self.prefill_chunk):
            logits = self.forward(ids[i:i + self.prefill_chunk], cache)
        t_prefill = time.perf_counter() - t0
        decoder = StreamDecoder(self.tokenizer)
        out_ids: list[int] = []
        text, finish = "", "length"
        t1 = time.perf_counter()
        split1 = self._split()
        stops = [s for s in (req.stop or []) if s]
        while len(out_ids) < req.max_tokens:
            tok = self.sample(np.array(logits[-1].astype(mx.float32)), req.temperature, req.top_p, rng)
            if ttft is None:
                ttft = time.perf_counter() - t_request
            # The stand-in's zero logits say nothing: its length is max_tokens, whatever token 0 is.
            if tok in self.tokenizer.eos_ids and not self.standin:
                finish = "stop"
                break
            out_ids.append(tok)
            piece = decoder.add(tok)
            text += piece
            hit = next((s for s in stops if s in text), None)
            if hit:
                cut = text.index(hit)
                piece = piece[:max(0, len(piece) - (len(text) - cut))]
                text, finish = text[:cut], "stop"
            if emit and piece:
                emit(M.Token(id=req.id, index=len(out_ids) - 1, token_id=tok, text=piece))
            if finish == "stop":
                break
            if between_tokens:
                between_tokens()
            if len(out_ids) < req.max_tokens:
                logits = self.forward([tok], cache, phase="decode")
        t_decode = time.perf_counter() - t1
        n_decode = max(0, len(out_ids) - 1)  # the first token comes from the prefill pass
        stats = {"prompt_tokens": len(ids), "generated_tokens": len(out_ids),
                 "prefill_s": t_prefill, "decode_s": t_decode,
                 "prefill_tok_s": len(ids) / t_prefill if t_prefill else None,
                 "decode_tok_s": n_decode / t_decode if n_decode and t_decode else None,
                 "ttft_s": ttft,
                 **{f"{k}_s": v - split0[k] for k, v in self._split().items() if k in ("ipc", "wait", "prepare")},
                 "bench_mode": self.bench_mode}
        stats["total_s"] = t_prefill + t_decode
        stats["compute_s"] = max(0.0, stats["total_s"] - stats["ipc_s"] - stats["wait_s"] - stats["prepare_s"])
        # The decode phase alone (the benchmark's time per token): its stage split, expert uses,
        # hits, bytes the misses read, and what this process itself read from disk (the mmap
        # baseline's page faults; the loader reads in its own process).
        split2 = self._split()
        decode = {k: split2[k] - split1[k] for k in split2}
        decode = {"tokens": n_decode, "total_s": t_decode, **{f"{k}_s": decode.pop(k) for k in ("ipc", "wait", "prepare")},
                  **decode}
        decode["compute_s"] = max(0.0, t_decode - decode["ipc_s"] - decode["wait_s"] - decode["prepare_s"])
        stats["decode"] = decode
        self.counters.add("requests")
        self.counters.add("prompt_tokens", len(ids))
        self.counters.add("generated_tokens", len(out_ids))
        self.counters.add("prefill_s", t_prefill)
        self.counters.add("decode_s", t_decode)
        self.counters.add("decode_tokens", n_decode)
        self._end_request(str(req.id))
        return M.Done(id=req.id, text=text, token_ids=out_ids, finish_reason=finish, stats=stats)

    def _split(self) -> dict:
        e = self.experts
        disk = _disk_read_bytes()
        return {"ipc": e.t_ipc, "wait": e.t_wait, "prepare": e.t_prepare,
                "uses": e.counters.get("uses"), "hits": e.counters.get("hits"),
                "miss_bytes": e.counters.get("miss_bytes"), "disk_read_bytes": disk or 0}

    @staticmethod
    def sample(logits: np.ndarray, temperature: float, top_p: float, rng) -> int:
        if temperature == 0:
            return int(np.argmax(logits))
        z = logits.astype(np.float64) / temperature
        p = np.exp(z - z.max())
        p /= p.sum()
        if top_p < 1:
            order = np.argsort(-p)
            keep = order[:int(np.searchsorted(np.cumsum(p[order]), top_p) + 1)]
            q = np.zeros_like(p)
            q[keep] = p[keep]
            p = q / q.sum()
        return int(rng.choice(len(p), p=p))

    def stats(self) -> dict:
        c = self.counters.snapshot()
        e = self.experts
        uses = e.counters.get("uses")
        busy = c.get("prefill_s", 0) + c.get("decode_s", 0)
        return {**c, "forward": self.forward_latency.summary(), "prepare": e.prepare.summary(),
                "hit_rate": e.counters.get("hits") / uses if uses else None,
                "ipc_s": e.t_ipc, "wait_s": e.t_wait, "prepare_s": e.t_prepare,
                "stall_share": e.t_wait / busy if busy else None,
                "decode_tok_s": c.get("decode_tokens", 0) / c["decode_s"] if c.get("decode_s") else None,
                "prefill_tok_s": c.get("prompt_tokens", 0) / c["prefill_s"] if c.get("prefill_s") else None,
                "prepare_bytes": int(e.counters.get("bytes")),
                "mlx_active_bytes": mx.get_active_memory(), "mlx_peak_bytes": mx.get_peak_memory(),
                "bench_mode": self.bench_mode}


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


def run_inprocess(store_path, config: dict, prompt_ids: list[int], max_tokens: int,
                  source: str = "mmap", cold: bool = False) -> dict:
    """One greedy generation by `Compute` in this process, no supervisor or workers. source:
    "mmap" (the memory-mapped baseline: experts read through the page cache, no cache of our own)
    or "slots" (router + loader wired in-process over an anonymous pool of cache.max_slots slots,
    0 = every expert). config: the plain dict tree (Config.to_dict()); [bench] is honoured.
    cold: drop the expert files from the page cache first. Returns the request's stats (as
    Done.stats) plus stage latencies, bytes touched and bytes the process read from disk."""
    from deltafin.workers.loader import Loader
    from deltafin.workers.router import Router
    store = Store(store_path)
    loader = pool = None
    if source == "mmap":
        src = MmapSource(store)
        compute = Compute(store, config, src, None, 0, experts_cls=MmapExperts)
    elif source == "slots":
        n_slots = int((config.get("cache") or {}).get("max_slots") or 0) or len(store.records)
        pool = mmap.mmap(-1, n_slots * store.max_record_bytes)
        loader = Loader(store, memoryview(pool), store.max_record_bytes)
        src = LocalExpertSource(Router(n_slots, (config.get("cache") or {}).get("policy", "lru")), loader)
        compute = Compute(store, config, src, memoryview(pool), store.max_record_bytes)
    else:
        raise ValueError(f"source {source!r}: use mmap or slots")
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
                "page_cache_dropped": page_cache_dropped}
    finally:
        if loader is not None:
            loader.close()
        if source == "mmap":
            src.close()


class RouterClient:
    """compute's side of the data plane: one `need` out, its `slots` back, with a deadline."""

    def __init__(self, sock, timeout_s: float, alive):
        self.sock, self.timeout_s, self.alive, self.req = sock, timeout_s, alive, 0

    def need(self, layer: int, experts: list[int]) -> Granted:
        from deltafin.runtime.sockets import recv, send, wait_readable
        self.req += 1
        send(self.sock, M.Need(req=self.req, layer=layer, experts=experts))
        while True:
            try:
                wait_readable(self.sock, self.timeout_s, self.alive, what=f"experts of layer {layer}")
            except (TimeoutError, ConnectionError) as e:
                raise ExpertUnavailable(str(e)) from None
            msg = recv(self.sock)
            if isinstance(msg, M.Error):  # the router's own code (budget_too_small, expert_read_failed)
                raise ExpertUnavailable(msg.message, code=msg.code)
            if isinstance(msg, M.Slots) and msg.req == self.req:
                return Granted([(e, s) for e, s, _ in msg.slots], msg.hits, msg.wait_us / 1e6)

    def release(self) -> None:
        from deltafin.runtime.sockets import send
        send(self.sock, M.Release(req=self.req))


def run_compute_process(run_dir: str) -> None:
    from deltafin.runtime.sockets import send
    from deltafin.workers.common import WorkerProcess

    class ComputeProcess(WorkerProcess):
        role = "compute"

        def setup(self):
            mx.set_cache_limit(int(self.run["budget"]["mlx_cache_bytes"]))
            self.store = Store(self.run["store"])
            self.data = self.connect_data_plane()
            self.source = RouterClient(self.data, self.config["compute"]["expert_timeout_s"],
                                       self.parent_alive)
            # Dense weights load before "ready", so the supervisor's measurement includes them.
            self.compute = Compute(self.store, self.config, self.source, None, 0)
            if mx.default_device().type == mx.DeviceType.gpu:
                # GPU backends set up kernels and host buffers on first use; on the CPU backend
                # the first pass's buffers are what the KV and activation reserves already cover.
                self.compute.warm_up()

        def ready_info(self):
            return {"dtype": str(self.compute.dtype), "vocab_size": self.compute.vocab,
                    "bench_mode": self.compute.bench_mode}

        def on_pool(self, msg):
            self.compute.experts.pool = self.pool.buf
            self.compute.experts.slot_bytes = msg.slot_bytes

        def on_forward(self, fwd: M.Forward):
            def reply(m):
                send(self.control, M.Forward(client=fwd.client, payload=M.encode(m)))
            try:
                req = M.decode(fwd.payload)
            except M.ProtocolError as e:
                return reply(M.Error(id=None, code="bad_message", message=str(e)))
            try:
                if isinstance(req, M.Generate):
                    reply(self.compute.generate(req, emit=reply if req.stream else None,
                                                between_tokens=self.poll_control))
                elif isinstance(req, M.Logits):
                    arr = self.compute.logits(list(req.token_ids), name=str(req.id))
                    reply(M.LogitsResult(id=req.id, shape=list(arr.shape), dtype="float32",
                                         data=arr.astype(np.float32).tobytes()))
                else:
                    reply(M.Error(id=getattr(req, "id", None), code="bad_message",
                                  message=f"compute does not take {req.TYPE}"))
            except (RequestError, ExpertUnavailable) as e:
                self.source.release()
                reply(M.Error(id=req.id, code=e.code, message=str(e)))
            except Exception as e:  # the model raised: report it and keep serving
                self.source.release()
                reply(M.Error(id=req.id, code="internal", message=f"{type(e).__name__}: {e}"))

        def stats(self):
            return self.compute.stats()

    ComputeProcess(run_dir).serve()


if __name__ == "__main__":
    import sys
    run_compute_process(sys.argv[1])
