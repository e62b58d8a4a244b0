"""The compute engine: the model, its expert provider, the passes and the requests' answers.

`Compute` owns MLX, the dense weights, the expert provider (`SlotExperts` over an
`ExpertSource`, or a provider class the caller names), the KV caches and sampling. It answers
logits (`logits`), runs a request alone (`generate`) or hands one to its scheduler as a sequence
(`start`, then `done`), and reports its counters (`stats`). No sockets: the process
(workers/compute.py) and in-process callers (tests, tools) drive it alike. Requests carry token
ids and every token goes back as an id: prompt text, detokenizing and stop strings are the
request manager's (workers/requests.py); it stops at EOS itself.

Benchmark modes (config [bench], reported as `bench_mode` in every stats dict): `Routing`
(runtime/benchmode.py) takes the expert ids from a trace, or seeded random ones, instead of the
gate; `StandInModel` replaces each layer's math by a wait while requests, reads and fills stay
real. `runtime.record_trace` records the ids every token used (`TraceRecorder`, saved per request).
"""
from __future__ import annotations

import os
import time
from typing import Callable

import mlx.core as mx
import numpy as np

from deltafin.protocol import messages as M
from deltafin.runtime import archinfo, dtypes, lossy, metrics
from deltafin.runtime.benchmode import StandInModel, bench_mode
from deltafin.runtime.budget import kv_reserve_bytes, prompt_cache_bytes, sequence_cache_bytes
from deltafin.runtime.config import Config, LossyConfig, as_config
from deltafin.runtime.layerkinds import prefix_unsupported
from deltafin.runtime.metrics import Counter, Latency
from deltafin.runtime.models import build_model
from deltafin.runtime.models.switch import pool_dtype, switch_glu
from deltafin.runtime.store import Store
from deltafin.runtime.tokenizer import eos_ids
from deltafin.runtime.traces import TraceRecorder
from deltafin.workers.pipeline import Pipeline, on_gpu
from deltafin.workers.prompt_cache import PromptCache
from deltafin.workers.scheduler import Scheduler, Sequence, sample_on_device
from deltafin.workers.slot_experts import SlotExperts
from deltafin.workers.sources import RequestError
from deltafin.workers.structured import SchemaError, TokenTable


# The warm-up's prefill chunks (tokens): a short prompt's, under the 64 (token, expert) pairs at
# which a layer sorts its rows for a top-k under 8, then a long prompt's, sorted at any top-k.
WARM_PROMPTS = (9, 64)


class Compute:
    def __init__(self, store: Store, config: Config | dict, source, pool_buf, slot_bytes: int,
                 experts_cls=None, eos: list[int] | None = None):
        """source: the ExpertSource (or the mmap baseline's source, with its experts_cls);
        pool_buf, slot_bytes: the staging slots; experts_cls: the provider class (SlotExperts);
        eos: the EOS ids (None: read from the store's tokenizer files)."""
        config = as_config(config)
        self.store, self.config, self.source = store, config, source
        cc = config.compute
        # Built in the stand-in too (never called there): the dense weights then take the memory
        # they take in a real run, so the pool the supervisor sizes after "ready" is the same.
        self.model = archinfo.read_config(
            lambda c: build_model(c, store.dense_weights(), store.manifest.get("dense_quantization"), cc.dtype),
            store.config)
        self.dtype = self.model.dtype
        # Token ids only: the supervisor tokenizes and detokenizes (runtime/textside.py) and
        # passes the EOS ids (eos); in-process they are read from the tokenizer files as JSON
        # (no tokenizer library, but a parse that leaves ~13 MiB of heap on the demo store).
        self.eos_ids = set(eos) if eos is not None else eos_ids(store.tokenizer_dir, store.config)
        self.max_context, self.prefill_chunk = int(cc.max_context), int(cc.prefill_chunk)
        self.on_prefill_chunk: Callable[[], None] | None = None  # the process publishes progress then
        self.vocab = int(store.config["vocab_size"])
        experts_cls = experts_cls or SlotExperts
        self.routing, self.standin, self.bench_mode = bench_mode(
            store, config.bench, experts_cls.expert_source)
        if self.standin:
            self.model = StandInModel(self.model.n_layers, store.moe_layers, self.vocab,
                                      self.standin["moe_ms"], self.standin["dense_ms"])
        self.pipeline = Pipeline.resolve(config.bench, gpu=on_gpu(), standin=bool(self.standin))
        extra = ({"pipeline": self.pipeline, "cache": config.cache, "lossy_cfg": config.lossy}
                 if issubclass(experts_cls, SlotExperts) else {})
        self.experts = experts_cls(store, pool_buf, slot_bytes, source, self.dtype, routing=self.routing, **extra)
        if isinstance(self.experts, SlotExperts):
            resident = source.resident_slots(store)
            if resident is not None:  # the process: told at attach_pool
                self.experts.attach(pool_buf, slot_bytes, resident)
        self.counters = Counter()
        self.forward_latency = Latency()
        self.request_rows: list[np.ndarray] = []
        self.trace_path = config.runtime.record_trace or None
        self.recorder = TraceRecorder(store.n_experts) if self.trace_path else None
        # The KV reserve (runtime/budget.py) in the itemsize the budget assumed for it.
        self.kv_itemsize = dtypes.itemsize(cc.dtype) or 4  # the itemsize the budget assumed
        max_batch = self._max_batch(int(cc.max_batch))
        kv_pool = kv_reserve_bytes(store.config, self.kv_itemsize, self.max_context, cc.kv_tokens, max_batch)
        self.scheduler = Scheduler(self, max_batch, kv_pool)
        self.prompt_cache, self.prompt_cache_off = self._prompt_cache(prompt_cache_bytes(store.config, config))
        self.tokens = TokenTable(store.tokenizer_dir, self.eos_ids, self.vocab)  # json_schema masks

    def _prompt_cache(self, nbytes: int) -> tuple[PromptCache | None, str | None]:
        """The prompt cache (workers/prompt_cache.py) in blocks of one prefill chunk, or None and
        why not: off (compute.prompt_cache 0), a family whose caches cannot start from a prefix,
        or a run whose passes must each be computed (a recorded or replayed trace, the stand-in, the
        distributed ranks, which run their passes in step)."""
        why = prefix_unsupported(archinfo.layer_caches(self.store.config))
        if why is None and (self.recorder is not None or self.standin or self.routing.mode != "gate"
                            or self.config.distributed.enabled):
            why = ("every prompt token's pass is computed: a trace is recorded or replayed, the stand-in "
                   "runs, or ranks must run the same passes")
        if why is None and nbytes <= 0:
            why = "compute.prompt_cache is 0"
        return (None, why) if why else (PromptCache(self.prefill_chunk, nbytes), None)

    def _max_batch(self, configured: int) -> int:
        """Decoding together needs the gate's own routing per row: a recorded trace is kept per
        request, a replayed one and the stand-in route by pass, so those run one at a time."""
        if self.recorder is not None or self.standin or self.routing.mode != "gate":
            return 1
        return configured

    def warm_up(self, progress: Callable[[int, int, str], None] | None = None) -> float:
        """Passes with zero-filled expert weights before "ready": a GPU backend sets up its kernels
        and host buffers now (CUDA: hundreds of MiB), so the supervisor's measurement of the tree,
        which sizes the slot pool, already includes them. On a machine whose kernel cache is empty,
        MLX CUDA compiles each kernel the first time a pass needs it, and the compiler's heap peaks
        at a few GB (docs/BENCHMARKS.md, stop 67): so these passes meet what a first request meets
        (a short prompt's prefill with the model's real top-k, a decode step, the greedy and the
        sampling paths of the sampler) while no slot pool exists yet, and the first request finds
        most of its kernels compiled (the streaming path's own, slot tables and device copies, it
        still meets first). The stand-in runs no kernels.

        Each step is evaluated on its own, `progress(index, steps, name)` called before it: that
        compile takes minutes on a fresh machine (stop 69: past the supervisor's 180 s), so the
        supervisor hears of each step (M.WorkerProgress) and waits runtime.warmup_timeout_s for
        them. Returns the seconds it took."""
        if self.standin:
            return 0.0
        t0 = time.perf_counter()
        layout = self.store.layout(self.store.moe_layers[0])
        zeros = {t["name"]: mx.zeros([1, *t["shape"]], dtype=pool_dtype(t["dtype"], self.dtype))
                 for t in layout["tensors"]}

        def zero_experts(layer, x, inds):
            # every (token, k) pair on the one zero expert: the layer's own row count and sorting
            rows = x.reshape(-1, x.shape[-1])
            y = switch_glu(rows, mx.zeros((rows.shape[0], inds.shape[-1]), dtype=mx.uint32), zeros, layout["quant"])
            return y.reshape(*inds.shape, x.shape[-1]) * 0
        cache = self.model.make_cache()
        key = mx.random.key(0)
        logits = None

        def prefill(n):  # prefill chunks: rows unsorted, then sorted by expert (`sorts_pairs`)
            nonlocal logits
            logits = self.model(mx.zeros((n,), dtype=mx.int32), cache, zero_experts, float32=False)
            mx.eval(logits)

        def decode():  # the greedy sampler, then a decode step on its token
            nonlocal logits
            tok = sample_on_device(logits[-1:], M.Generate(id=0, token_ids=[0]), key, self.dtype)
            logits = self.model(tok.astype(mx.int32), cache, zero_experts, float32=False)
            mx.eval(logits)

        def sample():  # temperature, top-p and top-k
            mx.eval(sample_on_device(logits, M.Generate(id=0, token_ids=[0], temperature=0.7, top_p=0.9,
                                                        top_k=40), key, self.dtype))
        steps = [*((f"prefill of {n} tokens", lambda n=n: prefill(n)) for n in WARM_PROMPTS),
                 ("decode step", decode), ("sampling", sample)]
        for i, (name, step) in enumerate(steps):
            if progress is not None:
                progress(i, len(steps), name)
            step()
        del logits, cache
        mx.clear_cache()
        return time.perf_counter() - t0

    def prefill_progress(self) -> None:
        """A prefill chunk ended: the metrics stream says so now, not at its next tick."""
        if self.on_prefill_chunk is not None:
            self.on_prefill_chunk()

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
        while self.experts.preload_step():
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
        if req.tool_choice is not None:
            raise RequestError("compute takes a grammar; tool_choice is written as one by the supervisor")
        constrained = req.json_schema is not None or req.grammar is not None
        if constrained and not self.config.compute.constrained:
            raise RequestError("constrained decoding is off in this runtime ([compute] constrained = false): "
                               "no json_schema, response_format or tool_choice that forces a call")
        try:
            grammar = self.tokens.grammar(req.json_schema, req.grammar) if constrained else None
        except SchemaError as e:
            raise RequestError(str(e)) from None
        return Sequence(req=req, prompt=ids, cache=self.model.make_cache(), key=mx.random.key(seed),
                        emit=emit, t_request=t_request, grammar=grammar,
                        kv_bytes=sequence_cache_bytes(self.store.config, len(ids) + req.max_tokens, self.kv_itemsize))

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
        stats = {"prompt_tokens": len(ids), "generated_tokens": len(out_ids), "cached_tokens": seq.reused or 0,
                 "prefill_s": t_prefill, "decode_s": t_decode,
                 "prefill_tok_s": metrics.tok_s(len(ids), t_prefill),
                 "decode_tok_s": metrics.tok_s(n_decode, t_decode) if n_decode else None,
                 "ttft_s": seq.ttft_s,
                 **{f"{k}_s": v - split0[k] for k, v in split2.items() if k in ("ipc", "wait", "prepare")},
                 "bench_mode": self.bench_mode, "lossy": self.lossy()}
        stats["total_s"] = t_prefill + t_decode
        stats["compute_s"] = max(0.0, stats["total_s"] - stats["ipc_s"] - stats["wait_s"] - stats["prepare_s"])
        # The decode phase alone (the benchmark's time per token): its stage split, expert uses,
        # hits, bytes the misses read, and what this process itself read from disk (the mmap
        # baseline's page faults; the loader reads in its own process).
        decode = {k: split2[k] - split1[k] for k in split2 if k != "t"}
        decode = {"tokens": n_decode, "total_s": t_decode, **{f"{k}_s": decode.pop(k) for k in ("ipc", "wait", "prepare", "sync", "host")},
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

    def lossy(self) -> dict:
        """The lossy setting in effect (runtime/lossy.py) and what it did; a provider without
        one (the mmap baseline, the distributed ranks') runs exact."""
        if isinstance(self.experts, SlotExperts):
            return self.experts.lossy_report()
        return lossy.setting(LossyConfig())

    def _split(self) -> dict:
        e = self.experts
        disk = disk_read_bytes()
        return {"t": time.perf_counter(), "host": time.thread_time(), **e.waits(),
                "uses": e.counters.get("uses"), "hits": e.counters.get("hits"),
                "miss_bytes": e.counters.get("miss_bytes"), "disk_read_bytes": disk or 0}

    def stats(self) -> dict:
        c = self.counters.snapshot()
        e = self.experts
        tier = e.tier
        forward = self.forward_latency.summary()
        return {**c, "forward": forward, "prepare": e.prepare.summary(),
                "ipc_s": e.t_ipc, "wait_s": e.t_wait, "prepare_s": e.t_prepare, "sync_s": e.t_sync,
                "stall_share": metrics.stall_share(e.t_wait, forward.get("total_s")),
                "decode_tok_s": metrics.tok_s(c.get("decode_tokens", 0), c.get("decode_s")),
                "prefill_tok_s": metrics.tok_s(c.get("prompt_tokens", 0), c.get("prefill_s")),
                "prepare_bytes": int(e.counters.get("bytes")),
                # layers computed in pieces (hits first, misses as they land), prefetch fills taken
                # before a layer asked, leases asked; and the settings resolved at start
                "pipeline": {**{k: int(e.counters.get(k)) for k in ("hits_first", "streamed_misses", "early_fills", "leases",
                                                                "gate_syncs", "ran_ahead", "ahead_missed", "ahead_forgotten", "foreseen",
                                                                "settles", "fills_unsettled", "next_leases", "next_used",
                                                                "deferred_needs", "missed_passes", "device_waits",
                                                                "device_waits_stale")},
                             # the time passes spent after their first run-ahead miss (SlotExperts.end_ahead),
                             # and of it the time in each kind of wait
                             "miss_ms": round(e.counters.get("miss_s") * 1e3, 3),
                             # bench.device_waits: the time the host spent answering the device's requests
                             "device_wait_ms": round(e.counters.get("device_wait_s") * 1e3, 3),
                             "miss_split_ms": {k: round(e.counters.get(f"miss_{k}_s") * 1e3, 3) for k in e.WAITS},
                             "resolved": self.pipeline.report()},
                "messages": e.source.messages.snapshot(),
                "expert_tier": ({"resident_slots": tier.n_slots, "resident_bytes": tier.nbytes,
                                 "fills": tier.fills, "placement": tier.placement} if tier else {}),
                "mlx_active_bytes": mx.get_active_memory(), "mlx_peak_bytes": mx.get_peak_memory(),
                "batch": self.scheduler.stats(), "bench_mode": self.bench_mode, "lossy": self.lossy(),
                "prompt_cache": (self.prompt_cache.stats() if self.prompt_cache
                                 else {"enabled": False, "reason": self.prompt_cache_off})}



def disk_read_bytes() -> int | None:
    """Bytes this process made the kernel read from storage (Linux /proc/self/io), so a page-cache
    run shows how much of what it touched came from the disk."""
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))
    except (OSError, StopIteration, ValueError):
        return None

