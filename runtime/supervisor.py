"""deltafin-supervisor: launches router, loader and compute, owns endpoints and shared memory.

Start-up: sweep stale runs, check the store's files and the budget estimate, start the three
workers as separate OS processes, wait for each one's ready message while watching that none
died, measure the tree, size and create the slot pool, hand it to the workers, bind the client
endpoint, print `READY <endpoint>`. Serving: check each client request against the limits and
answer what is wrong at once (a full queue too: at most 1 + compute.max_queue in flight), relay
the rest to compute, which runs them in arrival order, and its replies back; relay a client's
`cancel`, and send one for a client whose connection closed mid-stream; answer hello/health/stats
itself, and merge the workers' metrics snapshots into one that it republishes
on the run's metrics endpoint (runtime/telemetry.py, docs/PROTOCOL.md).

Text stays here, out of the MLX process (runtime/textside.py): a prompt text is tokenized on a
thread of its own (requests still reach compute in arrival order), compute gets token ids, and
each of compute's tokens (an id) becomes the client's text piece here; a stop string ends the
request for the client at once and cancels it in compute, whose later messages for it are dropped.

Worker deaths: one thread per worker waits for its exit, so a death wakes the serving loop at
once and the first role to die is the one named. Every request in flight then fails with
`worker_died`, the other workers are killed, the pool segment is unlinked, and all three start
again on a fresh segment while the client endpoint stays bound (requests meanwhile get
`restarting`), up to `runtime.restart_max` times in `runtime.restart_window_s`; beyond that the
supervisor exits 1 naming the role. SIGINT/SIGTERM end it with 0. One idempotent shutdown serves
every path.
"""
from __future__ import annotations

import argparse
import atexit
import dataclasses
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import zmq
from deltafin.protocol import messages as M
from deltafin.runtime import archinfo, tiers
from deltafin.runtime.benchmode import check_bench_config
from deltafin.runtime.budget import BudgetError, BudgetPlan, plan_budget, tree_memory
from deltafin.runtime.config import ConfigError, format_size, load_config
from deltafin.runtime.security import (CurveServer, KeyDir, SecurityError, check_endpoint,
                                       default_keys_dir, file_identity, ipc_path, remove_socket_file)
from deltafin.runtime.ranks import RANK_LOST_EXIT, launch_rank, peer_note
from deltafin.runtime.shm import RunDir, Segment, sweep_stale_runs
from deltafin.runtime.sockets import make_socket, recv, send
from deltafin.runtime.store import Store, StoreError
from deltafin.runtime.telemetry import PUBLISH_INTERVAL_S, MetricsHub, ProcessSampler, merge
from deltafin.runtime.textside import TextSide, as_token_ids, prompt_ids
from deltafin.runtime.tokenizer import PromptTooLong, Tokenizer, TokenizerError

ROLES = ("router", "loader", "compute")
STOP_GRACE_S = 2.0   # a clean stop: workers finish what they are doing, then SIGTERM, then SIGKILL
STATS_SYNC_S = 5.0  # longest a stats reply waits for the snapshots that include the last request
LOGITS_COPIES = 8  # copies of a logits reply alive at once across the tree (see Supervisor.limits)


class SupervisorError(RuntimeError):
    pass


class WorkerDied(SupervisorError):
    def __init__(self, role: str, pid: int, code: int | None, at: float = 0.0):
        self.role, self.pid, self.code, self.at = role, pid, code, at
        if code is None:
            how = "is unreachable on the control channel"
        elif code < 0:
            try:
                how = f"was killed by {signal.Signals(-code).name} (exit code {code})"
            except ValueError:
                how = f"was killed by signal {-code} (exit code {code})"
        else:
            how = f"exited with code {code}"
        super().__init__(f"worker {role} (pid {pid}) {how}")


class Workers:
    """One generation of the three worker processes: started together, stopped together, and
    watched by one thread each, which records each exit the moment the OS reports it (so the
    first role to die is the one named, not one that died of its loss) and wakes the serving
    loop through a pipe (its read end is polled with the sockets)."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.procs: dict[str, subprocess.Popen] = {}
        self.deaths: list[WorkerDied] = []
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self.wake_fd, self._wake_w = os.pipe()
        os.set_blocking(self.wake_fd, False)
        os.set_blocking(self._wake_w, False)

    def start(self) -> None:
        """Router first: it binds the data endpoint the others connect to."""
        deaths: list[WorkerDied] = []
        self.procs, self.deaths, self._threads = {}, deaths, []
        for role in ROLES:
            p = subprocess.Popen([sys.executable, "-m", f"deltafin.workers.{role}", str(self.run_dir)],
                                 stdin=subprocess.DEVNULL, stdout=sys.stderr)
            self.procs[role] = p
            t = threading.Thread(target=self._watch, args=(role, p, deaths), name=f"watch-{role}", daemon=True)
            t.start()
            self._threads.append(t)

    def _watch(self, role: str, p: subprocess.Popen, deaths: list) -> None:
        code = p.wait()
        with self._lock:
            deaths.append(WorkerDied(role, p.pid, code, time.monotonic()))
        try:
            os.write(self._wake_w, b"x")
        except OSError:  # closed at shutdown, or full: the loop is awake anyway
            pass

    def drain_wake(self) -> None:
        _drain(self.wake_fd)

    def first_death(self) -> WorkerDied | None:
        with self._lock:
            return min(self.deaths, key=lambda d: d.at) if self.deaths else None

    def alive(self, role: str) -> bool:
        p = self.procs.get(role)
        return p is not None and p.returncode is None and p.poll() is None

    def pids(self) -> dict[str, int]:
        return {r: p.pid for r, p in self.procs.items()}

    def stop(self, grace_s: float) -> None:
        """Waits up to grace_s for the workers to exit by themselves (after a polite message
        from the caller), then SIGTERM, then SIGKILL: one shared, short deadline."""
        deadline = time.monotonic() + grace_s
        for t in self._threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        for sig, wait_s in ([(signal.SIGTERM, 1.0)] if grace_s else []) + [(signal.SIGKILL, 5.0)]:
            left = [p for p in self.procs.values() if p.returncode is None and p.poll() is None]
            if not left:
                break
            for p in left:
                try:
                    p.send_signal(sig)
                except OSError:
                    pass
            deadline = time.monotonic() + wait_s
            for t in self._threads:
                t.join(timeout=max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        for fd in (self.wake_fd, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass


class ClientEndpoint:
    """The client-facing ROUTER socket. A request is one frame; a DEALER sends it alone, a REQ
    after an empty delimiter frame, and each gets its replies in the same envelope (a REQ peer
    takes exactly one reply per request, so it gets no `token` messages). Frames over
    runtime.max_request_bytes are refused by ZeroMQ itself (the peer is disconnected)."""

    REQ_PEERS_KEPT = 4096

    def __init__(self, ctx: zmq.Context, endpoint: str, max_bytes: int, curve: CurveServer | None):
        self.sock = make_socket(ctx, zmq.ROUTER, max_bytes=max_bytes)
        self.max_bytes = max_bytes
        self.req_peers: OrderedDict[bytes, None] = OrderedDict()
        self.socket_file: Path | None = None
        self._identity = None
        if curve is not None:
            curve.apply(self.sock)
        try:
            self.sock.bind(endpoint)
        except zmq.ZMQError as e:
            self.sock.close(0)
            raise SupervisorError(f"cannot bind {endpoint}: {e}") from None
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        if endpoint.startswith("ipc://"):
            self.socket_file = ipc_path(endpoint)
            self._identity = file_identity(self.socket_file)

    def receive(self) -> tuple[bytes, bytes | None, str | None]:
        """(peer, request frame or None, why it cannot be read)."""
        frames = self.sock.recv_multipart()
        ident, body = frames[0], frames[1:]
        if len(body) > 1 and body[0] == b"":  # a REQ envelope (a lone empty frame is a message)
            self.req_peers[ident] = None
            self.req_peers.move_to_end(ident)
            while len(self.req_peers) > self.REQ_PEERS_KEPT:
                self.req_peers.popitem(last=False)
            body = body[1:]
        else:
            self.req_peers.pop(ident, None)
        if len(body) != 1:
            return ident, None, (f"a request is one frame (after an empty delimiter frame for REQ "
                                 f"sockets); got {len(body)}")
        return ident, body[0], None

    def reply(self, ident: bytes, msg) -> bool:
        """False when the peer is gone: ROUTER_MANDATORY makes a send to an identity whose
        connection closed fail at once (EHOSTUNREACH). A peer that has left the socket's high-water
        mark of replies unread (10,000) counts as gone too (EAGAIN): never sending blocking keeps
        one client from stalling the others."""
        req = ident in self.req_peers
        if req and isinstance(msg, M.Token):
            return True
        frames = [ident, b"", M.encode(msg)] if req else [ident, M.encode(msg)]
        try:
            self.sock.send_multipart(frames, flags=zmq.NOBLOCK)
            return True
        except zmq.ZMQError:
            return False

    def close(self) -> None:
        self.sock.close(0)
        if self.socket_file is not None:  # ZeroMQ leaves the ipc socket file behind
            remove_socket_file(self.socket_file, self._identity)


class Supervisor:
    def __init__(self, store_path: str, config, endpoint: str | None = None, log=None):
        self.config = config
        rc = config.runtime
        self.log = log or (lambda m: print(f"deltafin-supervisor: {m}", file=sys.stderr, flush=True))
        self.store = Store(store_path)
        self.store.check_files()  # a missing, truncated or foreign file is refused now, not at use
        archinfo.arch_for(self.store.config)  # an unknown architecture is refused before any worker starts
        self.plan: BudgetPlan = plan_budget(self.store, config)
        self.resident: dict = {}  # slots per group handed to the workers (whole layers split off)
        self.plan.check_before_start()
        self.endpoint_arg = endpoint or rc.endpoint
        # Runs killed earlier go first: their segments, and a socket file at our endpoint's path.
        swept = sweep_stale_runs()
        if swept:
            self.log(f"removed {len(swept)} shared-memory segment(s) left by dead runs")
        if self.endpoint_arg:
            check_endpoint(self.endpoint_arg, rc.allow_remote)
        # The text side (runtime/textside.py) runs here: compute never loads a tokenizer.
        self.tokenizer = Tokenizer(self.store.tokenizer_dir, self.store.config)
        # max_result_bytes is admitted against the budget once the pool is sized (_size_pool)
        self.limits = M.RequestLimits(vocab_size=int(self.store.config["vocab_size"]),
                                      max_context=config.compute.max_context,
                                      max_prompt_bytes=self.tokenizer.prompt_bytes_bound(config.compute.max_context))
        # Prompt texts are tokenized on one thread (tokenizers releases the GIL), so a long one
        # never stalls the tokens of others; its end wakes the serving loop through a pipe.
        self.tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        self.tokenized_fd, self._tokenized_w = os.pipe()
        os.set_blocking(self.tokenized_fd, False)
        os.set_blocking(self._tokenized_w, False)
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
        self.inflight: dict[tuple, float] = {}   # (client identity, request id) -> start time
        self.cancelling: set[tuple] = set()       # in flight, cancel sent to compute (or due once forwarded)
        # Requests taken, in arrival order, not yet forwarded to compute: (key, request, its
        # frame, the tokenization of its prompt text or None). The head goes once it is ready.
        self.admitting: deque[tuple] = deque()
        self.sides: dict[tuple, TextSide] = {}    # generate requests forwarded: their text
        # Ended for the client by a stop string, still in compute until its final message:
        # they hold their place in the in-flight bound, and their ids stay taken.
        self.stopping: dict[tuple, float] = {}
        # cancels sent: asked by the client, its peer vanished, or a stop string ended the request
        self.cancels = {"client": 0, "client_gone": 0, "stop": 0}
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
        self.rundir = RunDir()
        self.control = make_socket(self.ctx, zmq.ROUTER)
        # A restarted worker connects with the identity of the dead one: it takes the route over.
        self.control.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.control.bind(self.rundir.endpoint("control"))
        # Workers publish to metrics-in; subscribers (deltafin-monitor) find `metrics` here.
        self.hub = MetricsHub(self.ctx, self.rundir.endpoint("metrics-in"), self.rundir.endpoint("metrics"))
        run = {"store": str(self.store.path), "config": self.config.to_dict(),
               "supervisor_pid": os.getpid(),
               "eos_ids": sorted(self.tokenizer.eos_ids),  # compute stops at EOS without a tokenizer
               "endpoints": {"control": self.rundir.endpoint("control"),
                             "data": self.rundir.endpoint("data"),
                             "metrics_in": self.rundir.endpoint("metrics-in"),
                             "metrics": self.rundir.endpoint("metrics")},
               "budget": {**self.plan.to_dict(), "mlx_cache_bytes": self.plan.mlx_cache}}
        (self.rundir.path / "run-config.json").write_text(json.dumps(run))
        self.workers = Workers(self.rundir.path)
        self.poller = zmq.Poller()
        for sock in (self.control, self.hub.sub, self.workers.wake_fd, self.tokenized_fd):
            self.poller.register(sock, zmq.POLLIN)
        self._start_workers()
        self._bind_client()
        self.state = "serving"
        self._sample_processes()
        self._synchronize()  # the first stats answer already sees the workers with their pool
        n_slots = self.plan.n_slots
        per = ", ".join(format_size(b) for b in self.plan.resident_bytes.values())
        self.log(f"{n_slots} expert slots of {per} in the resident tier "
                 f"({n_slots / max(1, len(self.store.records)):.0%} of {len(self.store.records)} experts) "
                 f"+ {self.plan.staging_slots} staging slots of {format_size(self.plan.slot_bytes)} "
                 f"in a {format_size(self.plan.budget)} budget; tree measured {format_size(self.startup_tree_bytes)}")
        return self.client.endpoint

    def _start_workers(self) -> None:
        """Starts a generation of workers and hands them a new pool. The first generation's
        measurement sizes the pool; a restart keeps that size (the output never depends on it)."""
        self.generation += 1
        self.ready_info = {}
        self.workers.start()
        self._await(lambda m: isinstance(m, M.WorkerReady), "ready", self.config.runtime.startup_timeout_s)
        if not self.plan.n_slots:
            self._size_pool()
        self.segment = self.rundir.create_segment(f"staging{self.generation}", self.plan.staging)
        # The budget counts slots per record layout; the workers get them with whole layers kept
        # apart where cache.whole_layers asks (runtime/tiers.py), the same split every generation.
        # Not with distributed ranks: a rank holds only its share of each layer's experts.
        whole = self.config.cache.whole_layers if not self.config.distributed.enabled else False
        self.resident = tiers.whole_layers(self.store, self.plan.resident, whole,
                                           gpu=bool(self.ready_info.get("compute", {}).get("gpu")))
        attach = M.AttachPool(segment=self.segment.name, n_slots=self.plan.staging_slots,
                              slot_bytes=self.plan.slot_bytes, resident=self.resident)
        for role in ROLES:
            self._to_worker(role, attach)
        self._await(lambda m: isinstance(m, M.PoolAttached), "pool attached", self.config.runtime.control_timeout_s)

    def _size_pool(self) -> None:
        """The two expert tiers from the measured tree (runtime/budget.py): the staging ring,
        then the resident tier at the bytes compute's dtype gives a resident expert."""
        measured = self.startup_tree_bytes = tree_memory([os.getpid(), *self.workers.pids().values()])
        self.plan.set_dtype(self.ready_info.get("compute", {}).get("dtype", ""))
        try:
            n_slots = self.plan.size_pool(measured, cap=self.config.cache.max_slots)
        except BudgetError as e:
            raise BudgetError(f"{e}; measured processes with dense weights loaded: "
                              f"{format_size(measured)}") from None
        # A logits reply is admitted against the budget: it exists about LOGITS_COPIES times at
        # once (compute's array and encodings, the socket queues, the supervisor's decode and
        # re-encode), all after the forward pass, in the memory reserved for its activations
        # plus what the plan leaves unused.
        self.limits = dataclasses.replace(self.limits, max_result_bytes=min(
            M.MAX_RESULT_BYTES, (self.plan.activations + self.plan.unplanned()) // LOGITS_COPIES))
        if min(self.plan.resident.values()) < self.plan.min_slots:
            raise BudgetError(f"{min(self.plan.resident.values())} resident expert slots cannot hold one "
                              f"token's {self.plan.min_slots} experts of a layer; raise cache.max_slots "
                              f"or the memory budget")

    def _bind_client(self) -> None:
        rc = self.config.runtime
        endpoint = self.endpoint_arg or self.rundir.endpoint("client")
        if rc.allow_remote and endpoint.startswith("tcp://"):
            keys = KeyDir(Path(rc.keys_dir).expanduser() if rc.keys_dir else default_keys_dir())
            self.curve = CurveServer(self.ctx, keys)
            self.log(f"CURVE on: server public key {keys.path / 'server.key'}, clients allowed in "
                     f"{keys.clients} (docs/SECURITY.md)")
        if self.endpoint_arg and endpoint.startswith("ipc://"):
            check_endpoint(endpoint, rc.allow_remote)  # again: the path may have appeared since
            self.rundir.record_file(ipc_path(endpoint))
        self.client = ClientEndpoint(self.ctx, endpoint, rc.request_bytes, self.curve)
        self.poller.register(self.client.sock, zmq.POLLIN)

    def _await(self, match, what: str, timeout_s: float) -> None:
        """Waits for every worker's `what`, failing at once when one dies. Clients keep being
        answered meanwhile (during a restart: `restarting` for work, the rest as usual)."""
        waiting = set(ROLES)
        deadline = time.monotonic() + timeout_s
        while waiting:
            self._check_workers()
            if time.monotonic() > deadline:
                raise SupervisorError(f"timed out after {timeout_s:.0f} s waiting for {what} from "
                                      f"{', '.join(sorted(waiting))}")
            events = dict(self.poller.poll(100))
            if self.workers.wake_fd in events:
                self.workers.drain_wake()
            if self.hub.sub in events:
                self.hub.drain()
            if self.client is not None and self.client.sock in events:
                self._on_client()
            self._answer_stats()
            if self.control in events:
                try:
                    sender, msg = recv(self.control, routed=True)
                except M.ProtocolError as e:
                    self.log(f"dropped a bad control message: {e}")
                    continue
                role = sender.decode(errors="replace")
                if match(msg):
                    waiting.discard(role)
                    if isinstance(msg, M.WorkerReady):
                        self.ready_info[role] = {"pid": msg.pid, **msg.info}
                elif isinstance(msg, M.Metrics):
                    self.hub.offer(msg)

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
                if self.tokenized_fd in events:
                    _drain(self.tokenized_fd)
                    self._admit()
                if self.control in events:
                    self._on_control()
                self._answer_stats()
                self._check_workers()
            except WorkerDied as death:
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
            code, why = "worker_died", str(death)
            if death.role == "compute" and death.code == RANK_LOST_EXIT:  # [distributed]: a peer rank
                code, why = "rank_lost", f"{peer_note(*(launch_rank() or (None, 0)))} ({death})"
            for (ident, rid) in list(self.inflight):
                self._reply(ident, M.Error(id=rid, code=code, message=f"{why}; {then}"))
            self.inflight.clear()
            self.cancelling.clear()
            self.admitting.clear()  # a tokenization still running ends unseen
            self.sides.clear()
            self.stopping.clear()
            for ident, rid, *_ in self.pending_stats:
                self._finish_stats(ident, rid)
            self.pending_stats = []
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
            self._synchronize()
            self.log(f"workers restarted in {time.monotonic() - t0:.2f} s (restart "
                     f"{len(self.restart_times)} of {self.config.runtime.restart_max} in {window:.0f} s)")
            return

    def _sample_processes(self) -> None:
        """Memory and CPU per process, once a second (reading PSS walks the page tables)."""
        self.processes = self.sampler.sample({"supervisor": os.getpid(), **self.workers.pids()})
        tree = sum((p["pss"] or p["rss"] or 0) for p in self.processes.values())
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
            return self._reply(ident, M.Error(id=None, code="bad_message", message=problem))
        try:
            msg = M.decode(raw, limit=self.client.max_bytes)
        except M.ProtocolError as e:
            return self._reply(ident, M.Error(id=None, code="bad_message", message=str(e)))
        try:
            self._on_request(ident, raw, msg)
        except WorkerDied:
            raise
        except Exception as e:  # a bug answering one request must not stop the runtime
            self.log(f"error answering a {msg.TYPE}: {type(e).__name__}: {e}")
            self._reply(ident, M.Error(id=getattr(msg, "id", None), code="internal",
                                       message=f"{type(e).__name__}: {e}"))

    def _on_request(self, ident: bytes, raw: bytes, msg) -> None:
        if isinstance(msg, M.Hello):
            if msg.version != M.PROTOCOL_VERSION:
                return self._reply(ident, M.Error(id=msg.id, code="version_mismatch",
                                                  message=f"runtime speaks protocol {M.PROTOCOL_VERSION}, "
                                                          f"client {msg.version}"))
            return self._reply(ident, M.Welcome(id=msg.id, version=M.PROTOCOL_VERSION,
                                                model=str(self.store.path), architecture=self.store.manifest["architecture"],
                                                vocab_size=self.limits.vocab_size,
                                                max_context=self.limits.max_context,
                                                max_request_bytes=self.client.max_bytes,
                                                max_prompt_bytes=self.limits.max_prompt_bytes))
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
            self.pending_stats.append((ident, msg.id, self.sync, time.monotonic() + wait,
                                       frozenset(self.stopping)))
            return self._answer_stats()
        if isinstance(msg, (M.Generate, M.Logits)):
            # Everything refused here is answered at once, whatever compute is busy with.
            if self.state != "serving":
                why = f" after {self.last_death}" if self.last_death else ""
                return self._reply(ident, M.Error(id=msg.id, code="restarting",
                                                  message=f"the runtime is restarting its workers{why}; "
                                                          f"retry in a few seconds"))
            try:
                M.check_request(msg, self.limits)
            except M.BadRequest as e:
                return self._reply(ident, M.Error(id=msg.id, code="bad_request", message=str(e)))
            key = (ident, msg.id)
            if key in self.inflight or key in self.stopping:
                return self._reply(ident, M.Error(id=msg.id, code="bad_request",
                                                  message=f"request id {msg.id} is already in flight"))
            cc = self.config.compute
            n = len(self.inflight) + len(self.stopping)
            if n >= cc.max_inflight:  # max_batch running + compute's queue, all full
                running = "one" if cc.max_batch == 1 else f"compute.max_batch={cc.max_batch}"
                return self._reply(ident, M.Error(id=msg.id, code="queue_full",
                                                  message=f"{n} requests are in flight: {running} "
                                                          f"running and compute.max_queue={cc.max_queue} "
                                                          f"waiting; retry later"))
            self.inflight[key] = time.monotonic()
            tokenized = None
            if isinstance(msg, M.Generate) and msg.prompt is not None:
                tokenized = self.tokenize_pool.submit(prompt_ids, self.tokenizer, msg, cc.max_context)
                tokenized.add_done_callback(self._wake_tokenized)
            self.admitting.append((key, msg, raw, tokenized))
            return self._admit()
        if isinstance(msg, M.Cancel):
            if (ident, msg.id) not in self.inflight:
                return self._reply(ident, M.Error(id=msg.id, code="unknown_request",
                                                  message=f"no request {msg.id} of this client is in flight"))
            return self._cancel(ident, msg.id, "client")
        self._reply(ident, M.Error(id=getattr(msg, "id", None), code="bad_message",
                                   message=f"{msg.TYPE} is not a request"))

    def _cancel(self, ident: bytes, rid: int, why: str) -> None:
        """Asks compute to stop request (ident, rid), once: it answers with the request's final
        message (done "cancelled", or error "cancelled" for logits), which ends it here. A
        request still being tokenized gets its cancel right after it is forwarded (`_admit`)."""
        if (ident, rid) in self.cancelling:
            return
        self.cancelling.add((ident, rid))
        self.cancels[why] += 1
        if why == "client_gone":
            self.log(f"a client vanished with request {rid} in flight: cancelled")
        if not any(key == (ident, rid) for key, *_ in self.admitting):
            self._to_worker("compute", M.Forward(client=ident, payload=M.encode(M.Cancel(id=rid))))

    def _wake_tokenized(self, _future: Future) -> None:
        """On the tokenize thread: a prompt is ready (or refused); the serving loop forwards it."""
        try:
            os.write(self._tokenized_w, b"t")
        except OSError:  # closed at shutdown, or full: the loop is awake anyway
            pass

    def _admit(self) -> None:
        """Forwards the requests taken to compute in arrival order, each once its prompt text
        is tokenized; a prompt that cannot be tokenized is answered here, as compute used to."""
        while self.admitting:
            key, msg, raw, tokenized = self.admitting[0]
            if tokenized is not None and not tokenized.done():
                return  # the next ones wait behind it: compute serves in arrival order
            self.admitting.popleft()
            ident = key[0]
            if isinstance(msg, M.Generate):
                try:
                    ids = tokenized.result() if tokenized is not None else list(msg.token_ids)
                except Exception as e:
                    self.inflight.pop(key, None)
                    self.cancelling.discard(key)
                    self._reply(ident, _tokenize_error(msg.id, e))
                    continue
                self.sides[key] = TextSide(self.tokenizer, msg, len(ids))
                if tokenized is not None:
                    raw = M.encode(as_token_ids(msg, ids))
            self._to_worker("compute", M.Forward(client=ident, payload=raw))
            if key in self.cancelling:  # cancelled while it waited here
                self._to_worker("compute", M.Forward(client=ident, payload=M.encode(M.Cancel(id=msg.id))))

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
            key = (msg.client, getattr(reply, "id", None))
            final = isinstance(reply, (M.Done, M.LogitsResult, M.Error))
            if final:
                self.cancelling.discard(key)
            if key in self.stopping:  # answered already at its stop string: the rest is dropped
                if final:
                    self._stopped(key)
                return
            side = self.sides.get(key)
            if side is not None and isinstance(reply, M.Token):
                reply = side.accept(reply)
                if side.stopped:
                    return self._end_at_stop(key, side, reply)
                if reply is None:
                    return
            elif side is not None and final:
                del self.sides[key]
                if isinstance(reply, M.Done):
                    reply = side.done(reply)
            if final and self.inflight.pop(key, None) is not None:
                self._synchronize()
            if not self._reply(msg.client, reply) and key in self.inflight:
                # The client vanished mid-stream (or stopped reading): its request goes, and the
                # next one in the queue starts within a token.
                self._cancel(*key, "client_gone")
        elif isinstance(msg, M.Metrics):
            self.hub.offer(msg)

    def _end_at_stop(self, key: tuple, side: TextSide, last: M.Token | None) -> None:
        """A stop string completed: the client gets the text up to it and its `done` now, and
        compute a cancel; the request keeps its place until compute's final message for it."""
        ident, rid = key
        del self.sides[key]
        self.inflight.pop(key, None)
        self.stopping[key] = time.monotonic()
        if last is not None:
            self._reply(ident, last)
        self._reply(ident, side.done())
        self._cancel(ident, rid, "stop")

    def _stopped(self, key: tuple) -> None:
        """Compute ended a request a stop string had ended: a stats request made since then now
        waits for the snapshots that include it."""
        del self.stopping[key]
        self._synchronize()
        self.pending_stats = [(i, r, self.sync if key in w else s, d, w)
                              for i, r, s, d, w in self.pending_stats]

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
        for ident, rid, sync, deadline, stops in self.pending_stats:
            if (self.hub.synced_all(sync) and not stops & self.stopping.keys()) or now > deadline:
                self._finish_stats(ident, rid)
            else:
                waiting.append((ident, rid, sync, deadline, stops))
        self.pending_stats = waiting

    def _snapshot(self) -> dict:
        """The merged snapshot: what the metrics endpoint publishes and `stats` answers."""
        parts, missing, ages = self.hub.parts()
        procs = self.processes
        memory = {"budget": self.plan.budget,
                  "tree_bytes": sum((p["pss"] or p["rss"] or 0) for p in procs.values()),
                  "peak_tree_bytes": self.peak_tree_bytes,
                  "n_slots": self.plan.n_slots, "resident": self.plan.resident,
                  "resident_groups": self.resident or self.plan.resident,
                  "resident_bytes": self.plan.resident_bytes,
                  "staging_slots": self.plan.staging_slots, "slot_bytes": self.plan.slot_bytes,
                  "staging_bytes": self.plan.staging,
                  "startup_tree_bytes": self.startup_tree_bytes, "reserves_bytes": self.plan.reserves}
        model = {"store": str(self.store.path), "architecture": self.store.manifest["architecture"],
                 "moe_layers": self.store.moe_layers, "n_experts": self.store.n_experts,
                 "top_k": self.store.top_k}
        snap = merge(parts, missing, {
            "memory": memory, "processes": procs, "active_requests": len(self.inflight),
            "model": model, "run_id": self.rundir.run_id, "ages": ages})
        snap.update(state=self.state, restarts=self.restart_count, cancels=dict(self.cancels))
        return self.hub.stamp(snap)

    def _finish_stats(self, ident: bytes, rid: int) -> None:
        self._reply(ident, M.StatsResult(id=rid, stats=self._snapshot()))

    # -- shutdown -----------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Polite message, then SIGTERM, then SIGKILL, under one short deadline; after a worker
        death the others are killed at once. Idempotent."""
        if self.closed:
            return
        self.closed = True
        if self.workers is not None:
            if self.clean_stop and hasattr(self, "control"):
                for role in ROLES:
                    if self.workers.alive(role):
                        try:
                            send(self.control, M.Shutdown(reason="supervisor stopping"), to=role.encode())
                        except zmq.ZMQError:
                            pass
            self.workers.stop(grace_s=STOP_GRACE_S if self.clean_stop else 0)
            self.workers.close()
        if self.client is not None:
            self.client.close()
        # a tokenization still running finishes on its own (bounded by max_prompt_bytes)
        self.tokenize_pool.shutdown(wait=False, cancel_futures=True)
        for fd in (self.tokenized_fd, self._tokenized_w):
            try:
                os.close(fd)
            except OSError:
                pass
        if self.curve is not None:
            self.curve.stop()
        self.ctx.destroy(linger=0)
        if self.segment is not None:
            self.segment.close()
        if self.rundir is not None:
            self.rundir.cleanup()


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except (BlockingIOError, OSError):
        pass


def _tokenize_error(rid: int, e: Exception) -> M.Error:
    """The answer to a prompt text that cannot be tokenized: too long, no chat template, a
    template that refused the messages (`bad_request`); anything else is a bug (`internal`)."""
    from jinja2.exceptions import TemplateError
    if isinstance(e, (PromptTooLong, TokenizerError, TemplateError)):
        return M.Error(id=rid, code="bad_request", message=str(e))
    return M.Error(id=rid, code="internal", message=f"{type(e).__name__}: {e}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="deltafin-supervisor",
                                description="Run a deltafin model: router, loader and compute workers "
                                            "over shared memory, serving clients on a ZeroMQ endpoint.")
    p.add_argument("--model", required=True, help="expert store directory (deltafin-convert output)")
    p.add_argument("--memory-budget", help="bound for the whole process tree, e.g. 6GiB (default: config)")
    p.add_argument("--endpoint", help="client endpoint, ipc://PATH (in a directory only you can open; "
                                      "the path must not exist) or tcp://127.0.0.1:PORT "
                                      "(default: ipc socket in a private run directory)")
    p.add_argument("--allow-remote", action="store_true",
                   help="allow tcp:// on non-loopback addresses; turns CURVE authentication on "
                        "(keys in runtime.keys_dir, docs/SECURITY.md)")
    p.add_argument("--config", help="TOML file overriding configs/default.toml")
    p.add_argument("--http", metavar="HOST:PORT",
                   help="also serve the OpenAI-compatible HTTP API (deltafin-http, docs/HTTP.md) "
                        "as a child process, restarted if it dies; loopback unless --allow-remote")
    p.add_argument("--max-context", type=int, help="longest prompt + answer in tokens")
    p.add_argument("--dtype", choices=("auto", "float32", "float16", "bfloat16"))
    p.add_argument("--max-slots", type=int, help="upper bound on expert slots (cache.max_slots)")
    p.add_argument("--distributed", action="store_true",
                   help="join an mx.distributed group as one rank (run under mlx.launch, or with "
                        "MLX_RANK and MLX_HOSTFILE set): this tree reads, caches and computes only its "
                        "share of the experts; rank 0 serves clients (docs/DISTRIBUTED.md)")
    p.add_argument("--balance-trace", metavar="TRACE.npz",
                   help="with --distributed: share the experts among ranks by their use in this trace")
    p.add_argument("--policy", help="slot replacement policy (cache.policy)")
    p.add_argument("--prefetch", choices=("on", "off", "auto"), help="prefetch reads from routing prediction (cache.prefetch)")
    p.add_argument("--routing-history", metavar="TRACE.npz",
                   help="routing trace the router's predictor learns from at start (cache.routing_history)")
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
    sup = http = None
    try:
        if a.http:  # a bad --http is refused before anything starts
            from deltafin.workers.frontend import parse_listen
            try:
                parse_listen(a.http, a.allow_remote)
            except ValueError as e:
                raise SecurityError(str(e)) from None
        config = load_config(a.config, {"runtime.memory_budget": a.memory_budget,
                                        "runtime.allow_remote": True if a.allow_remote else None,
                                        "compute.max_context": a.max_context, "compute.dtype": a.dtype,
                                        "cache.max_slots": a.max_slots, "cache.policy": a.policy,
                                        "cache.prefetch": {"on": True, "off": False}.get(a.prefetch, a.prefetch),
                                        "cache.routing_history": absolute(a.routing_history),
                                        "distributed.enabled": True if a.distributed else None,
                                        "distributed.balance_trace": absolute(a.balance_trace),
                                        "runtime.record_trace": absolute(a.record_trace),
                                        "bench.routing_trace": absolute(a.routing_trace),
                                        "bench.standin": True if a.standin else None,
                                        "bench.standin_moe_ms": a.standin_moe_ms,
                                        "bench.standin_dense_ms": a.standin_dense_ms})
        rank = launch_rank() if config.distributed.enabled else None
        if rank is not None and rank[0] != 0 and a.endpoint:
            # one command line for every rank (mlx.launch): rank 0 serves it, the followers take
            # no client requests and keep the private default endpoint
            log(f"rank {rank[0]} of {rank[1]} follows rank 0: --endpoint {a.endpoint} is rank 0's")
            a.endpoint = None
        store = Store(a.model)
        store.check_files()
        check_bench_config(store, config.to_dict())  # a trace that does not fit: refused now
        sup = Supervisor(a.model, config, a.endpoint, log=log)
        endpoint = sup.start()
        if stop["flag"]:
            return 0
        print(f"READY {endpoint}", flush=True)
        if a.http:  # its own process, a client of the endpoint; it prints `HTTP <url>` once it serves
            from deltafin.workers.frontend import FrontendProcess
            keys = (str(Path(config.runtime.keys_dir).expanduser() if config.runtime.keys_dir
                        else default_keys_dir()) if sup.curve is not None else None)
            http = FrontendProcess(endpoint, a.http, a.allow_remote, keys)
            http.start()
        sup.serve_forever(lambda: stop["flag"])
        log("shutting down")
        return 0
    except WorkerDied as e:
        log(str(e))
        return 1
    except (ConfigError, StoreError, BudgetError, SupervisorError, SecurityError, PermissionError,
            archinfo.UnsupportedArchitecture, TokenizerError) as e:
        log(f"error: {e}")
        return 2
    finally:
        if http is not None:
            http.stop()
        if sup is not None:
            sup.shutdown()


if __name__ == "__main__":
    sys.exit(main())
