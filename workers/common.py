"""The process shell every worker shares: control channel, ready handshake, liveness, signals.

A role's wrapper subclasses WorkerProcess and adds its own sockets; the role's logic stays in
its plain class (Router, Loader, Compute).

Metrics: once ready, a publisher thread (runtime/telemetry.py) sends a full snapshot of the
role's `stats()` to the supervisor every 250 ms, also while compute's main thread is inside a
long forward pass. `stats()` therefore runs on that thread: the shell holds `state_lock` around
every handler except `on_forward` (compute's whole request), and the metrics classes
(runtime/metrics.py) lock themselves, so what compute's stats() reads is safe mid-request.

Profiling: with DELTAFIN_PROFILE_DIR set, each worker's main thread runs under cProfile and
writes DIR/ROLE-PID.prof when it ends (read with `python -m pstats`); DELTAFIN_PROFILE_CLOCK=cpu
times it by the thread's CPU time, so a wait (for the device, a socket) counts nothing and what
is left is the host's own work. MLX's `eval` and `async_eval` are then listed as functions of
their own (`mlx_eval`, `mlx_async_eval`).
"""
from __future__ import annotations

import itertools
import json
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

import numpy.ma  # noqa: F401  numpy imports it on the first np.unique (50-90 ms): here, not in a message's time
import zmq

from deltafin.protocol import messages as M
from deltafin.runtime import archinfo
from deltafin.runtime.config import as_config
from deltafin.runtime.shm import Segment
from deltafin.runtime.sockets import make_socket, recv, send
from deltafin.runtime.telemetry import SnapshotPublisher

RUN_CONFIG = "run-config.json"


def _profiler():
    """A running cProfile where DELTAFIN_PROFILE_DIR asks for one (created if missing), else None."""
    where = os.environ.get("DELTAFIN_PROFILE_DIR")
    if not where:
        return None
    import cProfile
    Path(where).mkdir(parents=True, exist_ok=True)
    clock = os.environ.get("DELTAFIN_PROFILE_CLOCK", "wall")
    if clock not in ("wall", "cpu"):
        raise ValueError(f"DELTAFIN_PROFILE_CLOCK={clock!r}: wall or cpu")
    profile = cProfile.Profile(time.thread_time) if clock == "cpu" else cProfile.Profile()
    _named_evaluations()
    profile.enable()
    return profile


def _named_evaluations() -> None:
    """MLX's evaluations wrapped in Python functions of their own, so that a profile lists them
    (`mlx_eval`, `mlx_async_eval`: building and launching kernels, and the waits for them) instead
    of counting them inside their callers (cProfile does not see nanobind's calls)."""
    import mlx.core as mx
    if getattr(mx.eval, "__name__", "") == "mlx_eval":
        return
    ev, aev = mx.eval, mx.async_eval

    def mlx_eval(*args, **kw):
        return ev(*args, **kw)

    def mlx_async_eval(*args, **kw):
        return aev(*args, **kw)
    mx.eval, mx.async_eval = mlx_eval, mlx_async_eval


PARENT_CHECK_S = 0.2  # a worker outlives its supervisor by at most this (plus scheduling)


def die_with_parent(supervisor_pid: int) -> None:
    """A worker must not outlive its supervisor, even one killed by SIGKILL, and even while its
    main thread is inside a long MLX computation that no Python signal handler interrupts.
    Linux: the kernel sends SIGKILL when the supervisor dies (PR_SET_PDEATHSIG). Everywhere
    (macOS has no such call): a watchdog thread polls the parent pid and ends the process with
    os._exit. Workers own no segment and no file the supervisor does not clean, so nothing is
    lost by exiting without cleanup."""
    if sys.platform.startswith("linux"):
        import ctypes
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass

    # Also covers a supervisor that died before prctl took effect: getppid has changed already.
    watch_parent(supervisor_pid)


def watch_parent(parent_pid: int) -> threading.Thread:
    """A daemon thread that ends the process once its parent is gone. MLX releases the GIL while
    it computes, so the thread runs even while the main thread is inside a long evaluation."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_CHECK_S)
        os._exit(0)
    t = threading.Thread(target=watch, name="parent-watch", daemon=True)
    t.start()
    return t


class WorkerProcess:
    role = "worker"

    def __init__(self, run_dir: str):
        self.run_dir = Path(run_dir)
        self.run = json.loads((self.run_dir / RUN_CONFIG).read_text())
        self.config = as_config(self.run["config"])
        self.supervisor_pid = int(self.run["supervisor_pid"])
        die_with_parent(self.supervisor_pid)
        # Ctrl-C and a SIGTERM to the process group go to the supervisor too, which stops us
        # (a message, then SIGKILL): a worker that exited on its own would look like a crash.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        self.ctx = zmq.Context()
        self.control = make_socket(self.ctx, zmq.DEALER, identity=self.role)
        self.control.connect(self.run["endpoints"]["control"])
        self.poller = zmq.Poller()
        self.poller.register(self.control, zmq.POLLIN)
        self.pool: Segment | None = None
        self.spin_s = 0.0  # bench.spin_ms as the supervisor resolved it (AttachPool)
        self.running = True
        self.state_lock = threading.RLock()
        self._seq = itertools.count(1)
        self.synced = 0  # the last worker_stats request answered
        self.publisher: SnapshotPublisher | None = None

    # -- hooks ----------------------------------------------------------------------------------
    def setup(self) -> None: ...
    def ready_info(self) -> dict: return {}
    def on_pool(self, msg: M.AttachPool) -> None: ...
    def on_socket(self, sock) -> None: ...
    def on_forward(self, msg: M.Forward) -> None: ...
    def idle(self) -> None: ...
    def busy(self) -> bool: return False  # True: idle() has work left, so do not sleep in poll
    def stats(self) -> dict: return {}
    def teardown(self) -> None: ...

    # -- loop -------------------------------------------------------------------------------------
    def parent_alive(self) -> bool:
        return os.getppid() == self.supervisor_pid

    def serve(self) -> None:
        code = 0
        profile = _profiler()
        try:
            self.setup()
            send(self.control, M.WorkerReady(role=self.role, pid=os.getpid(), info=self.ready_info()))
            endpoint = self.run["endpoints"].get("metrics_in")
            if endpoint:
                self.publisher = SnapshotPublisher(self.ctx, endpoint, self.snapshot)
                self.publisher.start()
            last = 0.0
            while self.running:
                spin_s = self.spin_s  # bench.spin_ms, resolved at attach
                hot = spin_s > 0 and time.perf_counter() - last < spin_s
                events = dict(self.poller.poll(0 if self.busy() or hot else 200))
                if events and spin_s > 0:
                    last = time.perf_counter()
                if not self.parent_alive():
                    break
                for sock in events:
                    try:
                        if sock is self.control:
                            self.handle_control()
                        else:
                            with self.state_lock:
                                self.on_socket(sock)
                    except M.ProtocolError as e:
                        print(f"deltafin {self.role}: dropped a bad message: {e}", file=sys.stderr)
                    except zmq.ZMQError as e:
                        # A data-plane peer that died (EHOSTUNREACH under ROUTER_MANDATORY): the
                        # supervisor sees that death and restarts the workers; dying here too
                        # would only blur which role failed first.
                        if e.errno != zmq.EHOSTUNREACH:
                            raise
                        print(f"deltafin {self.role}: a peer is gone: {e}", file=sys.stderr)
                with self.state_lock:
                    self.idle()
        except SystemExit:
            pass
        except archinfo.ConfigMismatch as e:  # a store whose config is not its family's: no traceback
            print(f"deltafin {self.role}: error: {e}", file=sys.stderr, flush=True)
            code = 2
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            if profile is not None:
                profile.disable()
                profile.dump_stats(Path(os.environ["DELTAFIN_PROFILE_DIR"]) / f"{self.role}-{os.getpid()}.prof")
            if self.publisher is not None:
                self.publisher.stop()  # its socket closes before the context goes
            self.teardown()
            if self.pool is not None:
                self.pool.close()
            self.ctx.destroy(linger=0)
        sys.exit(code)

    def handle_control(self) -> None:
        msg = recv(self.control)
        if isinstance(msg, M.Shutdown):
            self.running = False
        elif isinstance(msg, M.AttachPool):
            with self.state_lock:
                self.pool = Segment.attach(msg.segment, msg.n_slots * msg.slot_bytes)
                self.spin_s = msg.spin_ms / 1e3
                self.on_pool(msg)
            send(self.control, M.PoolAttached(role=self.role))
        elif isinstance(msg, M.WorkerStats):
            # After each finished request: the snapshot goes on the control channel, behind
            # everything this worker did for the request, so the next stats answer includes it.
            send(self.control, self.snapshot(sync=msg.id))
        elif isinstance(msg, M.Forward):
            self.on_forward(msg)  # not under state_lock: compute's stats() must stay readable

    def snapshot(self, sync: int | None = None) -> M.Metrics:
        """The role's stats() as one numbered full snapshot (from any thread)."""
        with self.state_lock:
            if sync is not None:
                self.synced = max(self.synced, sync)
            stats = self.stats()
            seq = next(self._seq)
            synced = self.synced
        p = self.publisher
        if p is not None and p.failures:
            stats = {**stats, "metrics_failures": p.failures, "metrics_last_error": p.last_error}
        return M.Metrics(source=self.role, pid=os.getpid(), seq=seq, time=time.time(), stats=stats,
                         sync=synced)

    def publish_now(self) -> None:
        """A snapshot on the metrics stream at once (progress the next tick would show late)."""
        if self.publisher is not None:
            self.publisher.now()

    def connect_data_plane(self) -> zmq.Socket:
        """DEALER to the router; returns once the router has answered our hello, so the
        router can address us by identity from then on (ROUTER_MANDATORY would fail before)."""
        from deltafin.runtime.sockets import wait_readable
        sock = make_socket(self.ctx, zmq.DEALER, identity=self.role)
        sock.connect(self.run["endpoints"]["data"])
        send(sock, M.PeerHello(role=self.role))
        wait_readable(sock, self.config.runtime.startup_timeout_s, self.parent_alive,
                      what="the router's hello")
        if not isinstance(recv(sock), M.PeerHello):
            raise RuntimeError("the router answered the hello with something else")
        return sock

    def poll_control(self) -> None:
        """For long work (a generation): answers the supervisor between steps."""
        while self.running and self.control.poll(0):
            self.handle_control()
        if not self.parent_alive():
            raise SystemExit(0)
