"""deltafin-supervisor: launches router, loader and compute, owns endpoints and shared memory.

Start-up: sweep stale runs, check the store's files and the budget estimate, bind the client
endpoint (workers/endpoint.py; work is answered `restarting` until the pool is ready), start the
three workers as separate OS processes (workers/workerset.py), wait for each one's ready message
while watching that none died, with --http start the HTTP frontend (workers/frontend_process.py),
measure the tree (the frontend included), size and create the slot pool, hand it to the workers,
print `READY <endpoint>` (and `HTTP <url>`). Serving: generate and
logits requests go to the request manager (workers/requests.py: the in-flight bound, all text,
stop strings and cancels), which relays them to compute and compute's replies back; hello,
health and stats are answered here, and the workers' metrics snapshots are merged into one that
is republished on the run's metrics endpoint (runtime/telemetry.py, docs/PROTOCOL.md).

Worker deaths: one thread per worker waits for its exit, so a death wakes the serving loop at
once and the first role to die is the one named. Every request in flight then fails with
`worker_died`, the other workers are killed, the pool segment is unlinked, and all three start
again on a fresh segment while the client endpoint stays bound (requests meanwhile get
`restarting`), up to `runtime.restart_max` times in `runtime.restart_window_s`; beyond that the
supervisor exits 1 naming the role. SIGINT/SIGTERM (also to the whole process group: workers
ignore it) end it with 0, after every request in flight is answered `shutting_down`. One
idempotent shutdown serves every path.
"""
from __future__ import annotations

import atexit
import dataclasses
import json
import os
import signal
import sys
import time
from collections import deque
from pathlib import Path

import zmq
from deltafin.protocol import messages as M
from deltafin.runtime import archinfo, lossy, tiers
from deltafin.runtime.benchmode import check_bench_config
from deltafin.runtime.budget import BudgetError, BudgetPlan, fit_context, plan_budget
from deltafin.runtime.config import ConfigError, format_size
from deltafin.runtime.forkserver import ForkServer
from deltafin.runtime.kernelcache import use_kernel_cache
from deltafin.runtime.procmem import COW_RESERVE_SHARE, cow_shared, tree_memory, tree_total
from deltafin.runtime.security import (CurveServer, KeyDir, SecurityError, check_endpoint,
                                       default_keys_dir, ipc_path, is_abstract, needs_curve)
from deltafin.runtime.ranks import RANK_LOST_EXIT, launch_rank, peer_note
from deltafin.runtime.shm import RunDir, Segment, SharedMemoryFull, sweep_stale_runs
from deltafin.runtime.sockets import make_socket, recv, send
from deltafin.runtime.store import Store, StoreError
from deltafin.runtime.telemetry import PUBLISH_INTERVAL_S, MetricsHub, ProcessSampler, merge
from deltafin.runtime.tokenizer import Tokenizer, TokenizerError
from deltafin.workers.endpoint import ClientEndpoint
from deltafin.workers.frontend_process import BODY_COPIES, FrontendProcess
from deltafin.workers.http_auth import API_KEY_ENV
from deltafin.workers.pipeline import resolved_spin_ms
from deltafin.workers.requests import RequestManager
from deltafin.workers.stats_waits import STATS_SYNC_S, StatsWaits
from deltafin.workers.router_process import prefetch_setting
from deltafin.workers.supervisor_args import check_http, parser, resolved_model, run_config
from deltafin.workers.workerset import PRELOAD, ROLES, SupervisorError, WorkerDied, Workers

STOP_GRACE_S = 2.0   # a clean stop: workers finish what they are doing, then SIGKILL
LOGITS_COPIES = 8  # copies of a logits reply alive at once across the tree (see Supervisor._size_pool)
REPLY_COPIES_QUEUED = 2  # of them, in the client socket's queues (workers/endpoint.py)


class StartWait:
    """The start-up's deadline: `startup_s` from its beginning, and at least `warmup_s` from a
    worker's first progress report (each report's step is kept, to name in a timeout's error)."""

    def __init__(self, startup_s: float, warmup_s: float, clock=time.monotonic):
        self.clock, self.warmup_s = clock, warmup_s
        self.start = clock()
        self.deadline = self.start + startup_s
        self.steps: dict[str, M.WorkerProgress] = {}

    def progress(self, role: str, msg: "M.WorkerProgress") -> bool:
        """Notes a step; True for the role's first report (its wait extended from now)."""
        first = role not in self.steps
        if first:
            self.deadline = max(self.deadline, self.clock() + self.warmup_s)
        self.steps[role] = msg
        return first

    def expired(self) -> bool:
        return self.clock() > self.deadline

    def elapsed(self) -> float:
        return self.clock() - self.start

    def where(self, roles) -> str:
        """The steps the given roles were last in, for a timeout's error."""
        return "".join(f" ({role} in its warm-up's {m.step}, step {m.index + 1} of {m.steps})"
                       for role, m in sorted(self.steps.items()) if role in roles)


class Supervisor:
    def __init__(self, store_path: str, config, endpoint: str | None = None, log=None,
                 http: str | None = None, api_key: str | None = None, forkserver: ForkServer | None = None):
        self.config = config
        self.forkserver = forkserver  # workers forked from it (runtime/forkserver.py); None: fresh
        rc = config.runtime
        self.log = log or (lambda m: print(f"deltafin-supervisor: {m}", file=sys.stderr, flush=True))
        self.store = Store(store_path)
        self.store.check_files()  # a missing, truncated or foreign file is refused now, not at use
        archinfo.arch_for(self.store.config)  # an unknown architecture is refused before any worker starts
        self.http = http  # --http HOST:PORT: the frontend runs (and is measured) in the budget
        self.api_key = api_key  # --api-key: the frontend's bearer token
        frontend = BODY_COPIES * config.http.body_bytes if http else 0
        self.context_note = fit_context(self.store, config, frontend)
        self.plan: BudgetPlan = plan_budget(self.store, config)
        self.plan.frontend = frontend
        self.frontend: FrontendProcess | None = None
        self.resident: dict = {}  # slots per group handed to the workers (whole layers split off)
        self.plan.check_before_start()
        self.endpoint_arg = endpoint or rc.endpoint
        # Runs killed earlier go first: their segments, and a socket file at our endpoint's path.
        swept = sweep_stale_runs()
        if swept:
            self.log(f"removed {len(swept)} shared-memory segment(s) left by dead runs")
        if self.endpoint_arg:
            check_endpoint(self.endpoint_arg, rc.allow_remote)
        # The text side runs here (workers/requests.py): compute never loads a tokenizer.
        tokenizer = Tokenizer(self.store.tokenizer_dir, self.store.config)
        # max_result_bytes is admitted against the budget once the pool is sized (_size_pool)
        limits = M.RequestLimits(vocab_size=int(self.store.config["vocab_size"]),
                                 max_context=config.compute.max_context,
                                 max_prompt_bytes=tokenizer.prompt_bytes_bound(config.compute.max_context))
        # Stats answers wait (briefly) for snapshots newer than the last finished request
        self.stats = StatsWaits(self._ask_snapshots)
        self.requests = RequestManager(tokenizer, config.compute, limits, self._reply, self._forward,
                                       self.stats.finished, self.log, config.http.default_max_tokens)
        self.workers: Workers | None = None
        self.segment: Segment | None = None
        self.ctx = zmq.Context()
        self.rundir: RunDir | None = None
        self.client: ClientEndpoint | None = None
        self.curve: CurveServer | None = None
        self.closed = False
        self.clean_stop = True   # False after a death: survivors are killed, not waited for
        self.state = "starting"  # -> serving <-> restarting
        self.generation = 0
        self.restart_times: deque = deque()
        self.last_death: WorkerDied | None = None
        self.hub: MetricsHub | None = None
        self.sampler = ProcessSampler()
        self.processes: dict[str, dict] = {}
        self.peak_tree_bytes = 0
        self.startup_tree_bytes = 0
        self.cow_reserve = 0  # room kept for pages the workers still share copy-on-write
        self.ready_info: dict[str, dict] = {}
        self.resolved: dict = {}  # each "auto" of the configuration as resolved at start
        atexit.register(self.shutdown)  # error paths and normal exit share one shutdown

    # -- start-up -----------------------------------------------------------------------------------
    def start(self) -> str:
        self.rundir = RunDir()
        self.control = make_socket(self.ctx, zmq.ROUTER)
        # A restarted worker connects with the identity of the dead one: it takes the route over.
        self.control.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.control.bind(self.rundir.endpoint("control"))
        # Workers publish to metrics-in; subscribers (deltafin-monitor) find `metrics` here.
        self.hub = MetricsHub(self.ctx, self.rundir.endpoint("metrics-in"), self.rundir.endpoint("metrics"))
        run = {"store": str(self.store.path), "config": self.config.to_dict(),
               "supervisor_pid": os.getpid(),
               "eos_ids": sorted(self.requests.tokenizer.eos_ids),  # compute stops at EOS without a tokenizer
               "endpoints": {"client": self.endpoint_arg or self.rundir.endpoint("client"),
                             "control": self.rundir.endpoint("control"),
                             "data": self.rundir.endpoint("data"),
                             "metrics_in": self.rundir.endpoint("metrics-in"),
                             "metrics": self.rundir.endpoint("metrics")},
               "budget": {**self.plan.to_dict(), "mlx_cache_bytes": self.plan.mlx_cache},
               "streams": self.plan.streams(self.config.cache.max_slots)}
        (self.rundir.path / "run-config.json").write_text(json.dumps(run))
        self.workers = Workers(self.rundir.path, self.forkserver)
        self.poller = zmq.Poller()
        for sock in (self.control, self.hub.sub, self.workers.wake_fd, self.requests.tokenized_fd):
            self.poller.register(sock, zmq.POLLIN)
        self._bind_client()  # first: the HTTP frontend connects to it before the pool is sized
        self._start_workers()
        self.state = "serving"
        self._sample_processes()
        self.stats.synchronize()  # the first stats answer already sees the workers with their pool
        cc = self.config.compute
        for line in self.plan.explain(cc.max_context, cc.max_batch, cc.prefill_chunk, self.context_note):
            self.log(line)
        cow = f" (+{format_size(self.cow_reserve)} kept for copy-on-write pages)" if self.cow_reserve else ""
        self.log(f"{self.plan.n_slots} expert slots in the resident tier; tree measured "
                 f"{format_size(self.startup_tree_bytes)}{cow}")
        if self.config.lossy.mode != "off":
            self.log(f"lossy mode {lossy.name(self.config.lossy)}: answers are NOT the exact model's")
        return self.client.endpoint

    def _start_workers(self) -> None:
        """Starts a generation of workers and hands them a new pool. The first generation's
        measurement sizes the pool; a restart keeps that size (the output never depends on it)."""
        self.generation += 1
        self.ready_info = {}
        self.workers.start()
        self._await(lambda m: isinstance(m, M.WorkerReady), "ready", self.config.runtime.startup_timeout_s)
        if not self.plan.n_slots:
            if self.http:  # measured with the tree; a frontend that cannot start is left out
                self.frontend = FrontendProcess.for_runtime(self.client.endpoint, self.http, self.config,
                                                            curve=self.curve is not None,
                                                            api_key=self.api_key)
                self.frontend.start_answered(self._pump, self.config.runtime.startup_timeout_s)
            self._size_pool()
        self.segment = self.rundir.create_segment(f"staging{self.generation}", self.plan.staging)
        # The budget counts slots per record layout; the workers get them with whole layers kept
        # apart where cache.whole_layers asks (runtime/tiers.py), the same split every generation.
        # Not with distributed ranks: a rank holds only its share of each layer's experts.
        whole = self.config.cache.whole_layers if not self.config.distributed.enabled else False
        self.resident = tiers.whole_layers(self.store, self.plan.resident, whole,
                                           gpu=bool(self.ready_info.get("compute", {}).get("gpu")))
        self.resolved = self._resolve_auto()
        attach = M.AttachPool(segment=self.segment.name, n_slots=self.plan.staging_slots,
                              slot_bytes=self.plan.slot_bytes, resident=self.resident,
                              spin_ms=self.resolved["spin_ms"])
        for role in ROLES:
            self._to_worker(role, attach)
        self._await(lambda m: isinstance(m, M.PoolAttached), "pool attached", self.config.runtime.control_timeout_s)

    def _resolve_auto(self) -> dict:
        """What each "auto" of the configuration became on this backend at this budget, once per
        start: reported in stats as `resolved`."""
        compute = self.ready_info.get("compute", {})
        n_keys = self.store.n_experts * len(self.store.moe_layers)
        prefetch = prefetch_setting(self.config.cache, sum(self.resident.values()), n_keys)
        return {"backend": "gpu" if compute.get("gpu") else "cpu", "dtype": compute.get("dtype"),
                "whole_layers": any(g.endswith(tiers.WHOLE) for g in self.resident),
                "prefetch": prefetch is not False, "pipeline": compute.get("pipeline"),
                "spin_ms": resolved_spin_ms(self.config.bench, bool(compute.get("gpu")))}

    def _size_pool(self) -> None:
        """The two expert tiers from the measured tree (runtime/budget.py): the staging ring,
        then the resident tier at the bytes compute's dtype gives a resident expert."""
        pids = list(self._pids().values())
        measured = self.startup_tree_bytes = tree_memory(pids)
        # pages the workers share with the fork server may still be copied: room for a share of them
        self.cow_reserve = int(COW_RESERVE_SHARE * cow_shared(pids))
        measured += self.cow_reserve
        self.plan.set_dtype(self.ready_info.get("compute", {}).get("dtype", ""))
        try:
            self.plan.size_pool(measured, cap=self.config.cache.max_slots)
        except BudgetError as e:
            raise BudgetError(f"{e}; measured processes with dense weights loaded: "
                              f"{format_size(measured)}") from None
        # A logits reply is admitted against the budget: it exists about LOGITS_COPIES times at
        # once (compute's array and encodings, the socket queues, the supervisor's decode and
        # re-encode), all after the forward pass, in the memory reserved for its activations
        # plus what the plan leaves unused.
        self.requests.limits = dataclasses.replace(self.requests.limits, max_result_bytes=min(
            M.MAX_RESULT_BYTES, (self.plan.activations + self.plan.unplanned()) // LOGITS_COPIES))
        # Large replies unsent over all connections: the socket queues' share of those copies.
        self.client.reply_bytes = REPLY_COPIES_QUEUED * self.requests.limits.max_result_bytes
        if min(self.plan.resident.values()) < self.plan.min_slots:
            raise BudgetError(f"{min(self.plan.resident.values())} resident expert slots cannot hold one "
                              f"token's {self.plan.min_slots} experts of a layer; raise cache.max_slots "
                              f"or the memory budget")

    def _bind_client(self) -> None:
        rc = self.config.runtime
        endpoint = self.endpoint_arg or self.rundir.endpoint("client")  # run-config.json names it too
        if needs_curve(endpoint, rc.allow_remote):
            keys = KeyDir(Path(rc.keys_dir).expanduser() if rc.keys_dir else default_keys_dir())
            self.curve = CurveServer(self.ctx, keys)
            self.log(f"CURVE on: server public key {keys.path / 'server.key'}, clients allowed in "
                     f"{keys.clients} (docs/SECURITY.md)")
        if self.endpoint_arg and endpoint.startswith("ipc://") and not is_abstract(endpoint):
            check_endpoint(endpoint, rc.allow_remote)  # again: the path may have appeared since
            self.rundir.record_file(ipc_path(endpoint))
        # large replies are bounded once the pool is sized (_size_pool); none is made before
        self.client = ClientEndpoint(self.ctx, endpoint, rc.request_bytes, self.curve, reply_bytes=0)
        self.poller.register(self.client.sock, zmq.POLLIN)

    def _shared_bytes(self) -> int:
        """The run's shared-memory segment, added once to a tree measured without it (procmem)."""
        return self.segment.size if self.segment is not None else 0

    def _pids(self) -> dict[str, int]:
        """The tree's processes by name: the supervisor, the workers, their fork server, the HTTP
        frontend."""
        pids = {"supervisor": os.getpid(), **self.workers.pids()}
        if self.frontend is not None and self.frontend.pid:
            pids["frontend"] = self.frontend.pid
        return pids

    def _await(self, match, what: str, timeout_s: float) -> None:
        """Waits for every worker's `what`, failing at once when one dies. Clients keep being
        answered meanwhile (starting or restarting: `restarting` for work, the rest as usual). A
        worker's start-up progress (M.WorkerProgress) gives it runtime.warmup_timeout_s more."""
        waiting = set(ROLES)
        wait = StartWait(timeout_s, self.config.runtime.warmup_timeout_s)
        while waiting:
            if wait.expired():
                raise SupervisorError(f"timed out after {wait.elapsed():.0f} s waiting for {what} from "
                                      f"{', '.join(sorted(waiting))}{wait.where(waiting)}")
            got = self._pump()
            if got is None:
                continue
            role, msg = got
            if isinstance(msg, M.WorkerProgress):
                if role in waiting and wait.progress(role, msg):
                    self.log(f"{role}: warming up ({msg.steps} steps; on a machine whose kernel cache "
                             f"is empty MLX compiles its kernels now, which can take minutes)")
            elif match(msg):
                waiting.discard(role)
                if isinstance(msg, M.WorkerReady):
                    self.ready_info[role] = {"pid": msg.pid, **msg.info}
                    warmed = msg.info.get("warm_up_s") or 0
                    if warmed >= 10:
                        self.log(f"{role}: warmed up in {warmed:.0f} s")

    def _pump(self) -> tuple[str, object] | None:
        """One turn of the start-up loop: clients answered, metrics taken, a worker's death
        raised; returns a control message other than metrics as (role, message)."""
        self._check_workers()
        events = dict(self.poller.poll(100))
        if self.workers.wake_fd in events:
            self.workers.drain_wake()
        if self.hub.sub in events:
            self.hub.drain()
        if self.client is not None and self.client.sock in events:
            self._on_client()
        self._answer_stats()
        if self.control not in events:
            return None
        try:
            sender, msg = recv(self.control, routed=True)
        except M.ProtocolError as e:
            self.log(f"dropped a bad control message: {e}")
            return None
        if isinstance(msg, M.Metrics):
            self.hub.offer(msg)
            return None
        return sender.decode(errors="replace"), msg

    def _check_workers(self) -> None:
        death = self.workers.first_death()
        if death is not None:
            self.clean_stop = False  # until a restart succeeds: the survivors are not waited for
            raise death

    # -- serving ------------------------------------------------------------------------------------
    def serve_forever(self, stop_flag) -> None:
        last_mem = last_publish = time.monotonic()
        while not stop_flag():
            try:
                wait_ms = max(1, int((last_publish + PUBLISH_INTERVAL_S - time.monotonic()) * 1000))
                events = dict(self.poller.poll(min(100, wait_ms)))
                if self.workers.wake_fd in events:
                    self.workers.drain_wake()
                self._check_workers()
                if self.hub.sub in events:
                    self.hub.drain()
                if self.client.sock in events:
                    self._on_client()
                if self.requests.tokenized_fd in events:
                    self.requests.on_tokenized()
                if self.control in events:
                    self._on_control()
                self._answer_stats()
                self._check_workers()
            except WorkerDied as death:
                if stop_flag():  # a signal to the whole process group reached a worker too
                    return
                self._restart(death)
            if time.monotonic() - last_mem > 1.0:
                last_mem = time.monotonic()
                self._sample_processes()
            if time.monotonic() - last_publish >= PUBLISH_INTERVAL_S:
                last_publish = time.monotonic()
                self.hub.publish(self._snapshot())

    def _restart(self, death: WorkerDied) -> None:
        """Fails what was in flight, replaces all three workers and the pool, and returns once
        they serve again; raises WorkerDied when the restart budget is spent (exit 1)."""
        while True:
            self.last_death = death
            self.state = "restarting"
            t0 = time.monotonic()
            window = self.config.runtime.restart_window_s
            while self.restart_times and t0 - self.restart_times[0] > window:
                self.restart_times.popleft()
            may_restart = len(self.restart_times) < self.config.runtime.restart_max
            then = ("the runtime is restarting its workers" if may_restart else
                    f"the runtime stops: {len(self.restart_times)} restart(s) in the last {window:.0f} s "
                    f"(runtime.restart_max = {self.config.runtime.restart_max})")
            self.log(f"{death}; {then}")
            code, why = M.ErrorCode.WORKER_DIED, str(death)
            if death.role == "compute" and death.code == RANK_LOST_EXIT:  # [distributed]: a peer rank
                code, why = M.ErrorCode.RANK_LOST, f"{peer_note(*(launch_rank() or (None, 0)))} ({death})"
            self.requests.fail_all(code, f"{why}; {then}")
            for ident, rid in self.stats.take_all():
                self._finish_stats(ident, rid)
            # The others hold nothing a restart keeps (the supervisor owns the segment), so they
            # are killed at once rather than waited for (compute may be deep in a computation).
            self.workers.stop(grace_s=0)
            if self.segment is not None:
                self.rundir.drop_segment(self.segment)
                self.segment = None
            if not may_restart:
                self.clean_stop = False
                raise death
            self.restart_times.append(t0)
            self.hub.history.clear()  # the new workers count from zero: no window across the restart
            try:
                self._start_workers()
            except WorkerDied as again:
                death = again
                continue
            self.state = "serving"
            self.clean_stop = True
            self.stats.synchronize()
            self.log(f"workers restarted in {time.monotonic() - t0:.2f} s (restart "
                     f"{len(self.restart_times)} of {self.config.runtime.restart_max} in {window:.0f} s)")
            return

    def _sample_processes(self) -> None:
        """Memory and CPU per process, once a second (reading PSS walks the page tables)."""
        self.processes = self.sampler.sample(self._pids())
        tree = tree_total(self.processes.values(), self._shared_bytes())
        self.peak_tree_bytes = max(self.peak_tree_bytes, tree)

    def _to_worker(self, role: str, msg) -> None:
        """ROUTER_MANDATORY makes a send to a dead worker fail at once; name the death."""
        try:
            send(self.control, msg, to=role.encode())
        except zmq.ZMQError:
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline:  # the watcher reports a death within moments
                self._check_workers()
                time.sleep(0.02)
            p = self.workers.procs.get(role)
            raise WorkerDied(role, p.pid if p else 0, None, time.monotonic()) from None

    def _reply(self, ident: bytes, msg) -> bool:
        return self.client.reply(ident, msg) if self.client is not None else False

    def _on_client(self) -> None:
        ident, raw, problem = self.client.receive()
        if problem:
            return self._reply(ident, M.Error(id=None, code=M.ErrorCode.BAD_MESSAGE, message=problem))
        try:
            msg = M.decode_request(raw, self.client.max_bytes, self.requests.limits.max_context)
        except M.ProtocolError as e:
            return self._reply(ident, M.Error(id=e.id, code=M.ErrorCode.BAD_MESSAGE, message=str(e)))
        try:
            self._on_request(ident, raw, msg)
        except WorkerDied:
            raise
        except Exception as e:  # a bug answering one request must not stop the runtime
            self.log(f"error answering a {msg.TYPE}: {type(e).__name__}: {e}")
            self._reply(ident, M.Error(id=getattr(msg, "id", None), code=M.ErrorCode.INTERNAL,
                                       message=f"{type(e).__name__}: {e}"))

    def _on_request(self, ident: bytes, raw: bytes, msg) -> None:
        if isinstance(msg, M.Hello):
            if msg.version != M.PROTOCOL_VERSION:
                return self._reply(ident, M.Error(id=msg.id, code=M.ErrorCode.VERSION_MISMATCH,
                                                  message=f"runtime speaks protocol {M.PROTOCOL_VERSION}, "
                                                          f"client {msg.version}"))
            return self._reply(ident, M.Welcome(id=msg.id, version=M.PROTOCOL_VERSION,
                                                model=str(self.store.path), architecture=self.store.manifest["architecture"],
                                                vocab_size=self.requests.limits.vocab_size,
                                                max_context=self.requests.limits.max_context,
                                                max_request_bytes=self.client.max_bytes,
                                                max_prompt_bytes=self.requests.limits.max_prompt_bytes,
                                                lossy=lossy.name(self.config.lossy)))
        if isinstance(msg, M.Health):
            workers = {r: {**self.ready_info.get(r, {}), "pid": p.pid, "alive": self.workers.alive(r)}
                       for r, p in self.workers.procs.items()}
            ok = self.state == "serving" and all(w["alive"] for w in workers.values())
            return self._reply(ident, M.HealthResult(id=msg.id, ok=ok, workers=workers, state=self.state,
                                                     restarts=self.restart_count))
        if isinstance(msg, M.Stats):
            # Answered from the latest snapshots, at once, even mid-prompt; only right after a
            # request finished does it wait for the snapshots that include that request.
            wait = STATS_SYNC_S if self.state == "serving" else 0.0
            # requests a stop string ended count as finished: the answer waits for their end in compute
            self.stats.add(ident, msg.id, wait, frozenset(self.requests.stopping))
            return self._answer_stats()
        if isinstance(msg, (M.Generate, M.Logits)):
            # Everything refused here is answered at once, whatever compute is busy with.
            if self.state != "serving":
                why = f" after {self.last_death}" if self.last_death else ""
                doing = "starting" if self.state == "starting" else f"restarting its workers{why}"
                return self._reply(ident, M.Error(id=msg.id, code=M.ErrorCode.RESTARTING,
                                                  message=f"the runtime is {doing}; retry in a few seconds"))
            return self.requests.submit(ident, raw, msg)
        if isinstance(msg, M.Cancel):
            return self.requests.cancel(ident, msg.id)
        self._reply(ident, M.Error(id=getattr(msg, "id", None), code=M.ErrorCode.BAD_MESSAGE,
                                   message=f"{msg.TYPE} is not a request"))

    @property
    def restart_count(self) -> int:
        return max(0, self.generation - 1)

    def _on_control(self) -> None:
        try:
            sender, msg = recv(self.control, routed=True)
            reply = M.decode(msg.payload) if isinstance(msg, M.Forward) else None
        except M.ProtocolError as e:  # a worker's bug: logged, and the runtime keeps serving
            self.log(f"dropped a bad message from a worker: {e}")
            return
        if reply is not None:
            self.requests.on_reply(msg.client, reply)
        elif isinstance(msg, M.Metrics):
            self.hub.offer(msg)

    def _forward(self, ident: bytes, raw: bytes) -> None:
        """A client's message to compute (the request manager's `forward`)."""
        self._to_worker("compute", M.Forward(client=ident, payload=raw))

    def _ask_snapshots(self, sync: int) -> None:
        """Each worker answers with a snapshot tagged `sync` on the control channel, queued
        behind all it did so far."""
        for role in ROLES:
            self._to_worker(role, M.WorkerStats(id=sync))

    def _answer_stats(self) -> None:
        if self.stats.pending:
            self.hub.drain()
            for ident, rid in self.stats.due(self.hub.synced_all, self.requests.stopping.keys()):
                self._finish_stats(ident, rid)

    def _snapshot(self) -> dict:
        """The merged snapshot: what the metrics endpoint publishes and `stats` answers."""
        parts, missing, ages = self.hub.parts()
        procs = self.processes
        memory = {"budget": self.plan.budget,
                  "tree_bytes": tree_total(procs.values(), self._shared_bytes()),
                  "peak_tree_bytes": self.peak_tree_bytes,
                  "n_slots": self.plan.n_slots, "resident": self.plan.resident,
                  "resident_groups": self.resident or self.plan.resident,
                  "resident_bytes": self.plan.resident_bytes,
                  "staging_slots": self.plan.staging_slots, "slot_bytes": self.plan.slot_bytes,
                  "staging_bytes": self.plan.staging,
                  "startup_tree_bytes": self.startup_tree_bytes, "cow_reserve_bytes": self.cow_reserve,
                  "reserves_bytes": self.plan.reserves,
                  "prompt_cache_bytes": self.plan.prompt_cache}
        model = {"store": str(self.store.path), "architecture": self.store.manifest["architecture"],
                 "moe_layers": self.store.moe_layers, "n_experts": self.store.n_experts,
                 "top_k": self.store.top_k}
        snap = merge(parts, missing, {
            "memory": memory, "processes": procs, "active_requests": len(self.requests.inflight),
            "model": model, "run_id": self.rundir.run_id, "ages": ages})
        snap.update(state=self.state, restarts=self.restart_count, cancels=dict(self.requests.cancels),
                    replies_dropped=dict(self.client.dropped) if self.client else {}, resolved=self.resolved)
        return self.hub.stamp(snap)

    def _finish_stats(self, ident: bytes, rid: int) -> None:
        self._reply(ident, M.StatsResult(id=rid, stats=self._snapshot()))

    # -- shutdown -----------------------------------------------------------------------------------
    def refuse_all(self) -> None:
        """Stopping: every request in flight or queued, and every stats request still waiting,
        is answered `shutting_down` now (the client endpoint delivers them before it closes)."""
        why = "the runtime is stopping; the request did not finish"
        self.requests.fail_all(M.ErrorCode.SHUTTING_DOWN, why)
        for ident, rid in self.stats.take_all():
            self._reply(ident, M.Error(id=rid, code=M.ErrorCode.SHUTTING_DOWN, message=why))

    def shutdown(self) -> None:
        """In-flight requests answered `shutting_down`, then a polite message to the workers, then
        SIGKILL, under one short deadline; after a worker death the others are killed at once.
        Idempotent."""
        if self.closed:
            return
        self.closed = True
        self.refuse_all()
        if self.frontend is not None:
            self.frontend.stop()
        if self.workers is not None:
            deadline = time.monotonic() + (STOP_GRACE_S if self.clean_stop else 0)
            if self.clean_stop and hasattr(self, "control"):
                # compute first: it takes its `shutdown` between requests and needs, and may be
                # waiting for experts (a preload step, a need) that only router and loader,
                # still running, can bring
                for group in (("compute",), tuple(r for r in ROLES if r != "compute")):
                    for role in group:
                        if self.workers.alive(role):
                            try:
                                send(self.control, M.Shutdown(reason="supervisor stopping"), to=role.encode())
                            except zmq.ZMQError:
                                pass
                    while any(self.workers.alive(r) for r in group) and time.monotonic() < deadline:
                        time.sleep(0.01)
            if not self.workers.stop(grace_s=max(0.0, deadline - time.monotonic())) and self.clean_stop:
                print(f"deltafin-supervisor: a worker did not stop within {STOP_GRACE_S:.0f} s and was "
                      f"killed", file=sys.stderr, flush=True)
            self.workers.close()
        if self.client is not None:
            self.client.close()
        self.requests.close()
        if self.curve is not None:
            self.curve.stop()
        self.ctx.destroy(linger=0)
        if self.segment is not None:
            self.segment.close()
        if self.rundir is not None:
            self.rundir.cleanup()


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    log = lambda m: print(f"deltafin-supervisor: {m}", file=sys.stderr, flush=True)
    stop = {"flag": False}
    forkserver = None

    def on_signal(signum, _frame):
        stop["flag"] = True
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    sup = None
    try:
        check_http(a)
        config = run_config(a)
        _, warning = use_kernel_cache(config.runtime.kernel_cache)  # before any worker is started
        if warning:
            log(warning)
        if config.runtime.fork_server:  # now, while this process has no thread and no socket
            forkserver = ForkServer.start(PRELOAD)
        rank = launch_rank() if config.distributed.enabled else None
        if rank is not None and rank[0] != 0 and a.endpoint:
            # one command line for every rank (mlx.launch): rank 0 serves it, the followers take
            # no client requests and keep the private default endpoint
            log(f"rank {rank[0]} of {rank[1]} follows rank 0: --endpoint {a.endpoint} is rank 0's")
            a.endpoint = None
        a.model = str(resolved_model(a.model, a.download))
        store = Store(a.model)
        store.check_files()
        check_bench_config(store, config)  # a trace that does not fit: refused now
        sup = Supervisor(a.model, config, a.endpoint, log=log, http=a.http,
                         api_key=a.api_key or os.environ.get(API_KEY_ENV), forkserver=forkserver)
        endpoint = sup.start()
        if stop["flag"]:
            return 0
        print(f"READY {endpoint}", flush=True)
        if sup.frontend is not None and sup.frontend.url:
            print(f"HTTP {sup.frontend.url}", flush=True)
        sup.serve_forever(lambda: stop["flag"])
        log("shutting down")
        return 0
    except WorkerDied as e:
        if stop["flag"]:  # a signal to the process group that reached a worker first
            log("shutting down")
            return 0
        log(str(e))
        return 1
    except (ConfigError, StoreError, BudgetError, SupervisorError, SecurityError, PermissionError,
            SharedMemoryFull, archinfo.UnsupportedArchitecture, TokenizerError) as e:
        log(f"error: {e}")
        return 2
    finally:
        if sup is not None:
            sup.shutdown()
        if forkserver is not None:
            forkserver.close()


if __name__ == "__main__":
    sys.exit(main())
