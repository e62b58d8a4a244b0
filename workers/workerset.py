"""The supervisor's worker processes: one generation of router, loader and compute, started
together, stopped together, and watched by one thread each (`Workers`); a death is a
`WorkerDied` naming the role, its pid and how it ended."""
from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from deltafin.runtime.forkserver import ForkServer, ForkServerError
from deltafin.runtime.procs import WakePipe, stop_processes

ROLES = ("router", "loader", "compute")
# What each role's process runs: Class(run_dir).serve(), as `python -m deltafin.workers.ROLE` does
ENTRIES = {"router": "deltafin.workers.router_process:RouterProcess",
           "loader": "deltafin.workers.loader:LoaderProcess",
           "compute": "deltafin.workers.compute:ComputeProcess"}
# What the fork server imports before forking them: everything but compute's MLX side
PRELOAD = ("numpy", "zmq", "msgpack", "psutil", "deltafin.workers.router_process",
           "deltafin.workers.loader", "deltafin.workers.sources")


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

    def __init__(self, run_dir: Path, forkserver: ForkServer | None = None):
        self.run_dir = run_dir
        self.forkserver = forkserver  # None: each worker a fresh interpreter
        self.procs: dict = {}  # role -> subprocess.Popen, or forkserver.Forked
        self.deaths: list[WorkerDied] = []
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self.wake = WakePipe()
        self.wake_fd = self.wake.fd

    def start(self) -> None:
        """Router first: it binds the data endpoint the others connect to."""
        deaths: list[WorkerDied] = []
        self.procs, self.deaths, self._threads = {}, deaths, []
        for role in ROLES:
            p = self._spawn(role)
            self.procs[role] = p
            t = threading.Thread(target=self._watch, args=(role, p, deaths), name=f"watch-{role}", daemon=True)
            t.start()
            self._threads.append(t)

    def _spawn(self, role: str):
        """Forked from the fork server where there is one (shared pages: runtime/forkserver.py;
        named dfn-ROLE, its command line the supervisor's), else a fresh interpreter running
        `python -m deltafin.workers.ROLE`."""
        if self.forkserver is not None:
            try:
                return self.forkserver.spawn(ENTRIES[role], str(self.run_dir), f"dfn-{role}")
            except ForkServerError as e:
                print(f"deltafin-supervisor: {e}; workers start as fresh interpreters", file=sys.stderr)
                self.forkserver.close(timeout_s=1.0)  # reaped
                self.forkserver = None
        return subprocess.Popen([sys.executable, "-m", f"deltafin.workers.{role}", str(self.run_dir)],
                                stdin=subprocess.DEVNULL, stdout=sys.stderr)

    def _watch(self, role: str, p, deaths: list) -> None:
        code = p.wait()
        with self._lock:
            deaths.append(WorkerDied(role, p.pid, code, time.monotonic()))
        self.wake.wake()

    def drain_wake(self) -> None:
        self.wake.drain()

    def first_death(self) -> WorkerDied | None:
        with self._lock:
            return min(self.deaths, key=lambda d: d.at) if self.deaths else None

    def alive(self, role: str) -> bool:
        p = self.procs.get(role)
        return p is not None and p.returncode is None and p.poll() is None

    def pids(self) -> dict[str, int]:
        """The workers' pids by role, and the fork server's while they are forked from it."""
        pids = {r: p.pid for r, p in self.procs.items()}
        if self.forkserver is not None:
            pids["forkserver"] = self.forkserver.pid
        return pids

    def stop(self, grace_s: float) -> bool:
        """Waits up to grace_s for the workers to exit by themselves (after a polite message
        from the caller), then SIGKILL (workers ignore SIGTERM: workers/common.py): one shared
        deadline per step (runtime/procs.py). Each exit is recorded by its watcher before this
        returns. True when every worker exited within grace_s."""
        clean = stop_processes(self.procs.values(), grace_s)
        for t in self._threads:
            t.join(timeout=1.0)
        return clean

    def close(self) -> None:
        self.wake.close()
