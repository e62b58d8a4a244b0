"""deltafin-supervisor: launches router, loader and compute, owns endpoints and shared memory.

Start-up: sweep stale runs, check the budget estimate, start the three workers as separate OS
processes, wait for each one's ready message while watching that none died, measure the tree,
size and create the slot pool, hand it to the workers, bind the client endpoint, print
`READY <endpoint>`. Serving: relay client requests to compute and its replies back, answer
hello/health/stats itself, watch the workers, and merge the workers' metrics snapshots into one
that it republishes on the run's metrics endpoint (runtime/telemetry.py, docs/PROTOCOL.md). Any worker death ends the run non-zero with the
role and exit code; SIGINT/SIGTERM end it with 0. One idempotent shutdown serves every path.
"""
from __future__ import annotations

import argparse
import atexit
import itertools
import json
import os
import signal
import subprocess
import sys
import time

import zmq
from deltafin.protocol import messages as M
from deltafin.runtime import archinfo
from deltafin.runtime.benchmode import check_bench_config
from deltafin.runtime.budget import BudgetError, BudgetPlan, plan_budget, tree_memory
from deltafin.runtime.config import ConfigError, format_size, load_config
from deltafin.runtime.shm import RunDir, Segment, sweep_stale_runs
from deltafin.runtime.sockets import make_socket, recv, send
from deltafin.runtime.store import Store, StoreError
from deltafin.runtime.telemetry import PUBLISH_INTERVAL_S, MetricsHub, ProcessSampler, merge

ROLES = ("router", "loader", "compute")


class SupervisorError(RuntimeError):
    pass


class WorkerDied(SupervisorError):
    def __init__(self, role: str, pid: int, code: int):
        super().__init__(f"worker {role} (pid {pid}) exited with code {code}")
        self.role, self.code = role, code


def check_endpoint(endpoint: str, allow_remote: bool) -> None:
    if endpoint.startswith("tcp://"):
        host = endpoint[6:].rsplit(":", 1)[0]
        if host not in ("127.0.0.1", "localhost", "[::1]", "::1") and not allow_remote:
            raise SupervisorError(f"{endpoint} is not a loopback address; pass --allow-remote to "
                                  f"expose the runtime to other machines")
    elif not endpoint.startswith("ipc://"):
        raise SupervisorError(f"endpoint {endpoint!r} must start with ipc:// or tcp://")


class Supervisor:
    def __init__(self, store_path: str, config, endpoint: str | None = None, log=None):
        self.config = config
        self.log = log or (lambda m: print(f"deltafin-supervisor: {m}", file=sys.stderr, flush=True))
        self.store = Store(store_path)
        archinfo.arch_for(self.store.config)  # an unknown architecture is refused before any worker starts
        self.plan: BudgetPlan = plan_budget(self.store, config)
        self.plan.check()
        self.endpoint_arg = endpoint or config.runtime.endpoint
        if self.endpoint_arg:
            check_endpoint(self.endpoint_arg, config.runtime.allow_remote)
        self.procs: dict[str, subprocess.Popen] = {}
        self.segment: Segment | None = None
        self.ctx = zmq.Context()
        self.rundir: RunDir | None = None
        self.closed = False
        self.inflight: dict[tuple, float] = {}   # (client identity, request id) -> start time
        # Stats answers wait (briefly) until every worker's snapshot is newer than the last
        # finished request: [(client identity, request id, sync id needed, deadline)]
        self.pending_stats: list[tuple] = []
        self.sync_ids = itertools.count(1)
        self.sync = 0
        self.hub: MetricsHub | None = None
        self.sampler = ProcessSampler()
        self.processes: dict[str, dict] = {}
        self.peak_tree_bytes = 0
        self.startup_tree_bytes = 0
        self.ready_info: dict[str, dict] = {}
        atexit.register(self.shutdown)  # error paths and normal exit share one shutdown

    # -- start-up -----------------------------------------------------------------------------------
    def start(self) -> str:
        swept = sweep_stale_runs()
        if swept:
            self.log(f"removed {len(swept)} shared-memory segment(s) left by dead runs")
        self.rundir = RunDir()
        self.control = make_socket(self.ctx, zmq.ROUTER)
        self.control.bind(self.rundir.endpoint("control"))
        # Workers publish to metrics-in; subscribers (deltafin-monitor) find `metrics` here.
        self.hub = MetricsHub(self.ctx, self.rundir.endpoint("metrics-in"), self.rundir.endpoint("metrics"))
        run = {"store": str(self.store.path), "config": self.config.to_dict(),
               "supervisor_pid": os.getpid(),
               "endpoints": {"control": self.rundir.endpoint("control"),
                             "data": self.rundir.endpoint("data"),
                             "metrics_in": self.rundir.endpoint("metrics-in"),
                             "metrics": self.rundir.endpoint("metrics")},
               "budget": {**self.plan.to_dict(), "mlx_cache_bytes": self.plan.mlx_cache}}
        (self.rundir.path / "run-config.json").write_text(json.dumps(run))
        # router first: it binds the data endpoint the others connect to
        for role in ROLES:
            self.procs[role] = subprocess.Popen(
                [sys.executable, "-m", f"deltafin.workers.{role}", str(self.rundir.path)],
                stdin=subprocess.DEVNULL, stdout=sys.stderr, start_new_session=False)
        self._await(lambda m: isinstance(m, M.WorkerReady), "ready", self.config.runtime.startup_timeout_s)
        measured = self.startup_tree_bytes = tree_memory([os.getpid()] + [p.pid for p in self.procs.values()])
        self.plan.set_dtype(self.ready_info.get("compute", {}).get("dtype", ""))
        try:
            n_slots = self.plan.size_pool(measured, cap=self.config.cache.max_slots)
        except BudgetError as e:
            raise BudgetError(f"{e}; measured processes with dense weights loaded: "
                              f"{format_size(measured)}") from None
        if min(self.plan.resident.values()) < self.plan.min_slots:
            raise BudgetError(f"{min(self.plan.resident.values())} resident expert slots cannot hold one "
                              f"token's {self.plan.min_slots} experts of a layer; raise cache.max_slots "
                              f"or the memory budget")
        self.segment = self.rundir.create_segment("staging", self.plan.staging)
        attach = M.AttachPool(segment=self.segment.name, n_slots=self.plan.staging_slots,
                              slot_bytes=self.plan.slot_bytes, resident=self.plan.resident)
        for role in ROLES:
            send(self.control, attach, to=role.encode())
        self._await(lambda m: isinstance(m, M.PoolAttached), "pool attached", self.config.runtime.control_timeout_s)
        self.client = make_socket(self.ctx, zmq.ROUTER)
        endpoint = self.endpoint_arg or self.rundir.endpoint("client")
        try:
            self.client.bind(endpoint)
        except zmq.ZMQError as e:
            raise SupervisorError(f"cannot bind {endpoint}: {e}") from None
        self.endpoint = self.client.getsockopt_string(zmq.LAST_ENDPOINT)
        self._sample_processes()
        self._synchronize()  # the first stats answer already sees the workers with their pool
        per = ", ".join(format_size(b) for b in self.plan.resident_bytes.values())
        self.log(f"{n_slots} resident expert slots of {per} "
                 f"({n_slots / max(1, len(self.store.records)):.0%} of {len(self.store.records)} experts) "
                 f"+ {self.plan.staging_slots} staging slots of {format_size(self.plan.slot_bytes)} "
                 f"in a {format_size(self.plan.budget)} budget; tree measured {format_size(measured)}")
        return self.endpoint

    def _await(self, match, what: str, timeout_s: float) -> None:
        waiting = set(ROLES)
        deadline = time.monotonic() + timeout_s
        while waiting:
            self._check_workers()
            if time.monotonic() > deadline:
                raise SupervisorError(f"timed out after {timeout_s:.0f} s waiting for {what} from "
                                      f"{', '.join(sorted(waiting))}")
            if self.control.poll(100):
                sender, msg = recv(self.control, routed=True)
                role = sender.decode()
                if match(msg):
                    waiting.discard(role)
                    if isinstance(msg, M.WorkerReady):
                        self.ready_info[role] = {"pid": msg.pid, **msg.info}

    def _check_workers(self) -> None:
        for role, p in self.procs.items():
            code = p.poll()
            if code is not None:
                raise WorkerDied(role, p.pid, code)

    # -- serving ------------------------------------------------------------------------------------
    def serve_forever(self, stop_flag) -> None:
        poller = zmq.Poller()
        poller.register(self.client, zmq.POLLIN)
        poller.register(self.control, zmq.POLLIN)
        poller.register(self.hub.sub, zmq.POLLIN)
        last_mem = last_publish = time.monotonic()
        while not stop_flag():
            try:
                wait_ms = max(1, int((last_publish + PUBLISH_INTERVAL_S - time.monotonic()) * 1000))
                events = dict(poller.poll(min(100, wait_ms)))
                if self.hub.sub in events:
                    self.hub.drain()
                if self.client in events:
                    self._on_client()
                if self.control in events:
                    self._on_control()
                self._answer_stats()
                self._check_workers()
            except WorkerDied as e:
                for (ident, rid) in list(self.inflight):
                    self._reply(ident, M.Error(id=rid, code="worker_died", message=str(e)))
                raise
            if time.monotonic() - last_mem > 1.0:
                last_mem = time.monotonic()
                self._sample_processes()
            if time.monotonic() - last_publish >= PUBLISH_INTERVAL_S:
                last_publish = time.monotonic()
                self.hub.publish(self._snapshot())

    def _sample_processes(self) -> None:
        """Memory and CPU per process, once a second (reading PSS walks the page tables)."""
        self.processes = self.sampler.sample({"supervisor": os.getpid(),
                                              **{r: p.pid for r, p in self.procs.items()}})
        tree = sum((p["pss"] or p["rss"] or 0) for p in self.processes.values())
        self.peak_tree_bytes = max(self.peak_tree_bytes, tree)

    def _to_worker(self, role: str, msg) -> None:
        """ROUTER_MANDATORY makes a send to a dead worker fail at once; name the death."""
        try:
            send(self.control, msg, to=role.encode())
        except zmq.ZMQError:
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline:
                self._check_workers()
                time.sleep(0.05)
            raise SupervisorError(f"worker {role} is unreachable") from None

    def _reply(self, ident: bytes, msg) -> None:
        try:
            send(self.client, msg, to=ident)
        except zmq.ZMQError:  # the client went away; nothing to deliver to
            pass

    def _on_client(self) -> None:
        frames = self.client.recv_multipart()
        ident, raw = frames[0], frames[-1]
        try:
            msg = M.decode(raw)
        except M.ProtocolError as e:
            return self._reply(ident, M.Error(id=None, code="bad_message", message=str(e)))
        if isinstance(msg, M.Hello):
            if msg.version != M.PROTOCOL_VERSION:
                return self._reply(ident, M.Error(id=msg.id, code="version_mismatch",
                                                  message=f"runtime speaks protocol {M.PROTOCOL_VERSION}, "
                                                          f"client {msg.version}"))
            cfg = self.store.config
            return self._reply(ident, M.Welcome(id=msg.id, version=M.PROTOCOL_VERSION,
                                                model=str(self.store.path), architecture=self.store.manifest["architecture"],
                                                vocab_size=int(cfg["vocab_size"]),
                                                max_context=self.config.compute.max_context))
        if isinstance(msg, M.Health):
            workers = {r: {**self.ready_info.get(r, {}), "pid": p.pid, "alive": p.poll() is None}
                       for r, p in self.procs.items()}
            return self._reply(ident, M.HealthResult(id=msg.id, ok=all(w["alive"] for w in workers.values()),
                                                     workers=workers))
        if isinstance(msg, M.Stats):
            # Answered from the latest snapshots, at once, even mid-prompt; only right after a
            # request finished does it wait for the snapshots that include that request.
            self.pending_stats.append((ident, msg.id, self.sync, time.monotonic() + 1.0))
            return self._answer_stats()
        if isinstance(msg, (M.Generate, M.Logits)):
            self.inflight[(ident, msg.id)] = time.monotonic()
            return self._to_worker("compute", M.Forward(client=ident, payload=raw))
        self._reply(ident, M.Error(id=getattr(msg, "id", None), code="bad_message",
                                   message=f"{msg.TYPE} is not a request"))

    def _on_control(self) -> None:
        sender, msg = recv(self.control, routed=True)
        if isinstance(msg, M.Forward):
            reply = M.decode(msg.payload)
            if isinstance(reply, (M.Done, M.LogitsResult, M.Error)):
                if self.inflight.pop((msg.client, reply.id), None) is not None:
                    self._synchronize()
            self._reply(msg.client, reply)
        elif isinstance(msg, M.Metrics):
            self.hub.offer(msg)

    def _synchronize(self) -> None:
        """A request finished: each worker answers with a snapshot on the control channel, queued
        behind all it did for the request, so a stats request from now on includes the request."""
        self.sync = next(self.sync_ids)
        for role in ROLES:
            self._to_worker(role, M.WorkerStats(id=self.sync))

    def _answer_stats(self) -> None:
        if not self.pending_stats:
            return
        self.hub.drain()
        now = time.monotonic()
        waiting = []
        for ident, rid, sync, deadline in self.pending_stats:
            if self.hub.synced_all(sync) or now > deadline:
                self._finish_stats(ident, rid)
            else:
                waiting.append((ident, rid, sync, deadline))
        self.pending_stats = waiting

    def _snapshot(self) -> dict:
        """The merged snapshot: what the metrics endpoint publishes and `stats` answers."""
        parts, missing, ages = self.hub.parts()
        procs = self.processes
        memory = {"budget": self.plan.budget,
                  "tree_bytes": sum((p["pss"] or p["rss"] or 0) for p in procs.values()),
                  "peak_tree_bytes": self.peak_tree_bytes,
                  "n_slots": self.plan.n_slots, "resident": self.plan.resident,
                  "resident_bytes": self.plan.resident_bytes,
                  "staging_slots": self.plan.staging_slots, "slot_bytes": self.plan.slot_bytes,
                  "staging_bytes": self.plan.staging,
                  "startup_tree_bytes": self.startup_tree_bytes, "reserves_bytes": self.plan.reserves}
        model = {"store": str(self.store.path), "architecture": self.store.manifest["architecture"],
                 "moe_layers": self.store.moe_layers, "n_experts": self.store.n_experts,
                 "top_k": self.store.top_k}
        return self.hub.stamp(merge(parts, missing, {
            "memory": memory, "processes": procs, "active_requests": len(self.inflight),
            "model": model, "run_id": self.rundir.run_id, "ages": ages}))

    def _finish_stats(self, ident: bytes, rid: int) -> None:
        self._reply(ident, M.StatsResult(id=rid, stats=self._snapshot()))

    # -- shutdown -----------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Polite message, then SIGTERM, then SIGKILL, under one shared deadline; idempotent."""
        if self.closed:
            return
        self.closed = True
        for role, p in self.procs.items():
            if p.poll() is None and hasattr(self, "control"):
                try:
                    send(self.control, M.Shutdown(reason="supervisor stopping"), to=role.encode())
                except zmq.ZMQError:
                    pass
        deadline = time.monotonic() + 5.0
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.05, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5.0)
        self.ctx.destroy(linger=0)
        if self.segment is not None:
            self.segment.close()
        if self.rundir is not None:
            self.rundir.cleanup()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="deltafin-supervisor",
                                description="Run a deltafin model: router, loader and compute workers "
                                            "over shared memory, serving clients on a ZeroMQ endpoint.")
    p.add_argument("--model", required=True, help="expert store directory (deltafin-convert output)")
    p.add_argument("--memory-budget", help="bound for the whole process tree, e.g. 6GiB (default: config)")
    p.add_argument("--endpoint", help="client endpoint, ipc://PATH or tcp://127.0.0.1:PORT "
                                      "(default: ipc socket in a private run directory)")
    p.add_argument("--allow-remote", action="store_true", help="allow tcp:// on non-loopback addresses")
    p.add_argument("--config", help="TOML file overriding configs/default.toml")
    p.add_argument("--max-context", type=int, help="longest prompt + answer in tokens")
    p.add_argument("--dtype", choices=("auto", "float32", "float16", "bfloat16"))
    p.add_argument("--max-slots", type=int, help="upper bound on expert slots (cache.max_slots)")
    p.add_argument("--policy", help="slot replacement policy (cache.policy)")
    bench = p.add_argument_group("benchmark modes (every stats report says which is on)")
    bench.add_argument("--record-trace", metavar="OUT.npz",
                       help="record the routing of every token processed (saved after each request)")
    bench.add_argument("--routing-trace", metavar="TRACE.npz",
                       help="route every MoE layer from this trace instead of the gate")
    bench.add_argument("--standin", action="store_true",
                       help="replace each layer's math by a wait; reads and messages stay real")
    bench.add_argument("--standin-moe-ms", type=float, metavar="MS", help="stand-in wait per MoE layer")
    bench.add_argument("--standin-dense-ms", type=float, metavar="MS", help="stand-in wait per dense layer")
    a = p.parse_args(argv)
    # The run record gets absolute paths: they mean the same to every process that reads it.
    absolute = lambda path: os.path.abspath(path) if path else None
    log = lambda m: print(f"deltafin-supervisor: {m}", file=sys.stderr, flush=True)
    stop = {"flag": False}

    def on_signal(signum, _frame):
        stop["flag"] = True
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    sup = None
    try:
        config = load_config(a.config, {"runtime.memory_budget": a.memory_budget,
                                        "runtime.allow_remote": True if a.allow_remote else None,
                                        "compute.max_context": a.max_context, "compute.dtype": a.dtype,
                                        "cache.max_slots": a.max_slots, "cache.policy": a.policy,
                                        "runtime.record_trace": absolute(a.record_trace),
                                        "bench.routing_trace": absolute(a.routing_trace),
                                        "bench.standin": True if a.standin else None,
                                        "bench.standin_moe_ms": a.standin_moe_ms,
                                        "bench.standin_dense_ms": a.standin_dense_ms})
        check_bench_config(Store(a.model), config.to_dict())  # a trace that does not fit: refused now
        sup = Supervisor(a.model, config, a.endpoint, log=log)
        endpoint = sup.start()
        if stop["flag"]:
            return 0
        print(f"READY {endpoint}", flush=True)
        sup.serve_forever(lambda: stop["flag"])
        log("shutting down")
        return 0
    except WorkerDied as e:
        log(str(e))
        return 1
    except (ConfigError, StoreError, BudgetError, SupervisorError, archinfo.UnsupportedArchitecture) as e:
        log(f"error: {e}")
        return 2
    finally:
        if sup is not None:
            sup.shutdown()


if __name__ == "__main__":
    sys.exit(main())
