"""The compute process: the engine (workers/engine.py) behind the supervisor's control channel and
the router's data plane.

`ComputeProcess` builds a `Compute` over a `RouterClient` (workers/sources.py), attaches the
resident tier when the supervisor hands it the pool, preloads it one layer per idle turn, and
serves the clients' messages the supervisor forwards (`Generate`, `Logits`, `Cancel`: one handler
per message type). Requests wait in a `RequestQueue` and decode together in the engine's
scheduler (workers/scheduler.py); between steps the process answers its control channel, so a
request that arrives then only joins the queue (requests never nest), and a cancel removes a
waiting one or stops a running one at the next step. With [distributed] every rank runs one
request at a time in step with rank 0 (workers/distributed.py).

    python -m deltafin.workers.compute RUN_DIR
"""
from __future__ import annotations

import os
import sys
import time

import mlx.core as mx
import numpy as np

from deltafin.protocol import messages as M
from deltafin.runtime.config import as_config
from deltafin.runtime.heap import HeapTrim
from deltafin.runtime.kernelcache import ENV as KERNEL_CACHE_ENV
from deltafin.runtime.sockets import send
from deltafin.runtime.store import Store
from deltafin.workers.common import WorkerProcess
from deltafin.workers.engine import Compute
from deltafin.workers.pipeline import on_gpu, use_cuda_graphs
from deltafin.workers.scheduler import (Queued, RequestQueue, admit, cancelled_reply, error_reply,
                                        finished)
from deltafin.workers.sources import ExpertUnavailable, RouterClient


class ComputeProcess(WorkerProcess):
    role = "compute"

    def setup(self):
        self.heap = HeapTrim()  # grown from here on (loading, kernels compiled): see below
        self.cfg = as_config(self.config)
        # before MLX's first kernel, so before the pool is sized: the plan's estimate says whether it streams
        use_cuda_graphs(self.cfg.bench, gpu=on_gpu(), streams=self.run["streams"])
        mx.set_cache_limit(int(self.run["budget"]["mlx_cache_bytes"]))
        self.store = Store(self.run["store"])
        self.data = self.connect_data_plane()
        self.source = RouterClient(self.data, self.cfg.compute.expert_timeout_s, self.parent_alive,
                                   fold=self.cfg.bench.fold_sends)
        # [distributed]: join the group first; the provider then computes this rank's share
        from deltafin.workers.distributed import Lockstep
        self.dist = Lockstep.from_config(self.config, self.store)
        # Dense weights load before "ready", so the supervisor's measurement includes them.
        self.compute = Compute(self.store, self.cfg, self.source, None, 0,
                               experts_cls=self.dist.experts_cls if self.dist else None,
                               eos=self.run["eos_ids"])
        if self.dist is not None:  # ranks run one request at a time, in step (serve_in_step)
            self.compute.scheduler.max_batch = 1
        self.queue = RequestQueue(self.compute.scheduler.max_batch)
        self.compute.on_prefill_chunk = self.publish_now
        self.in_request = False
        self.preloading = False
        self.handlers = {M.Generate: self.on_request, M.Logits: self.on_request, M.Cancel: self.on_cancel}
        # GPU backends set up kernels and host buffers on first use ("auto": warm up there); on the
        # CPU backend the first pass's buffers are what the KV and activation reserves already cover.
        self.warm_up_s = 0.0
        warm = self.cfg.compute.warm_up
        if warm is True or (warm == "auto" and on_gpu()):
            self.warm_up_s = self.compute.warm_up(self.report_progress)
        # A first run compiles MLX CUDA's kernels here and in its first requests: the compiler's
        # freed heap goes back to the system where the process grew (runtime/heap.py), before the
        # supervisor measures the tree and after each step.
        self.heap.maybe()

    def report_progress(self, index: int, steps: int, step: str) -> None:
        """A warm-up step begins: the supervisor waits runtime.warmup_timeout_s from the first."""
        send(self.control, M.WorkerProgress(role=self.role, step=step, index=index, steps=steps))

    def ready_info(self):
        return {"dtype": str(self.compute.dtype), "vocab_size": self.compute.vocab,
                "warm_up_s": round(self.warm_up_s, 3),
                "gpu": on_gpu(),
                "bench_mode": self.compute.bench_mode, "pipeline": self.compute.pipeline.report()}

    def on_pool(self, msg):
        # the resident tier is allocated now, inside the budget the supervisor just split
        self.compute.experts.attach(self.pool.buf, msg.slot_bytes, msg.resident)
        self.source.spin_s = self.spin_s  # a need's wait spins as the worker's poll does
        self.preloading = bool(self.cfg.cache.preload)

    def busy(self):
        return self.preloading

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

    # -- the clients' messages ------------------------------------------------------------------
    def on_forward(self, fwd: M.Forward):
        """A client's message relayed by the supervisor, handed to its type's handler. Between
        the tokens of a running request this runs again (poll_control), and then only queues:
        requests never nest."""
        try:
            req = M.decode(fwd.payload)
        except M.ProtocolError as e:
            return self.reply(fwd.client, M.Error(id=None, code=M.ErrorCode.BAD_MESSAGE, message=str(e)))
        handler = self.handlers.get(type(req))
        if handler is None:
            return self.reply(fwd.client, M.Error(id=getattr(req, "id", None), code=M.ErrorCode.BAD_MESSAGE,
                                                  message=f"compute does not take {req.TYPE}"))
        handler(fwd.client, req)

    def on_cancel(self, client: bytes, req: M.Cancel) -> None:
        """A waiting request leaves the queue (answered now); a running one is marked."""
        item = self.queue.cancel(client, req.id)
        if item is not None:
            self.answer_cancelled(item)

    def on_request(self, client: bytes, req: M.Generate | M.Logits) -> None:
        """A request joins the queue; served at once unless a request is running."""
        self.queue.add(client, req)
        if not self.in_request:
            self.serve_queue()

    def reply(self, client: bytes, msg) -> None:
        send(self.control, M.Forward(client=client, payload=M.encode(msg)))

    # -- serving --------------------------------------------------------------------------------
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
                    self.reply(seq.owner.client, finished(self.queue, self.compute, seq))
                self.heap.maybe()
                self.poll_control()
                for seq in list(sched.filling) + list(sched.active):
                    if seq.owner.cancelled or not self.running:
                        sched.leave(seq, "cancelled")
                        self.reply(seq.owner.client, finished(self.queue, self.compute, seq))
        finally:
            self.in_request = False
            self.heap.maybe()  # a logits request alone takes no step

    def admit(self) -> None:
        """Waiting requests start while the batch has room (workers/scheduler.py `admit`); this
        answers the ones refused and runs a logits request."""
        for item, error in admit(self.queue, self.compute, self.emitter, lambda: self.running):
            if error is not None:
                self.reply(item.client, error_reply(item.req.id, error))
            else:
                self.answer_logits(item)

    def emitter(self, client: bytes):
        """Where a sequence's tokens go: every token, streamed or not (the text side needs each id)."""
        return lambda m: self.reply(client, m)

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
                self.heap.maybe()
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
        except Exception as e:  # ours (RequestError, ExpertUnavailable) or the model's: keep serving
            self.compute.abandon()
            self.reply(client, error_reply(req.id, e))
            self.dist.after_error(e)
        finally:
            self.queue.finish(item)

    def answer_cancelled(self, item: Queued) -> None:
        """A request cancelled before it started: nothing to free."""
        self.compute.counters.add("cancelled")
        self.reply(item.client, cancelled_reply(item))

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
        except Exception as e:  # ours (RequestError, ExpertUnavailable) or the model's: keep serving
            self.compute.abandon()
            self.reply(client, error_reply(req.id, e))
            if self.dist is not None:
                self.dist.after_error(e)
        finally:
            self.queue.finish(item)

    def stats(self):
        # where MLX CUDA keeps the kernels it compiles (runtime/kernelcache.py); None: MLX's default
        out = {**self.compute.stats(), "queue": self.queue.stats(), "kernel_cache": os.environ.get(KERNEL_CACHE_ENV),
               "heap": self.heap.stats()}
        if self.dist is not None:
            e = self.compute.experts
            out["distributed"] = {**self.dist.info(), "exchanges": e.exchanges,
                                  "exchange_bytes": e.exchange_bytes}
        return out

    def teardown(self):
        if getattr(self, "dist", None) is not None:
            self.dist.stop()
        if getattr(self, "compute", None) is not None:
            self.compute.experts.detach()  # before the staging segment is unmapped


def run_compute_process(run_dir: str) -> None:
    ComputeProcess(run_dir).serve()


if __name__ == "__main__":
    run_compute_process(sys.argv[1])
