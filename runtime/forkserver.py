"""Starting the worker processes from one preloaded interpreter (Linux).

Each worker started as `python -m ...` is a fresh interpreter that imports numpy, pyzmq, msgpack
and the project again: about 25-35 MiB of private memory per process, three times over, which
an expert budget then lacks. The fork server is a child the supervisor forks at start, before
it has a thread or a socket: it imports the workers' modules once (never MLX: compute imports it
after the fork, so MLX's threads and device state are its own) and then forks each worker on
request, so the interpreters share those pages copy-on-write with it and with the supervisor.

A worker must stay the supervisor's child (the supervisor waits on it, and the worker watches its
parent: workers/common.py): the server forks an intermediate process that forks the worker and
exits, and the supervisor, a child subreaper (PR_SET_CHILD_SUBREAPER), adopts the worker. The
server answers with the worker's pid only after the intermediate has exited, so the adoption has
happened by then; `Forked` is the supervisor's handle on it, with what `Workers` and
runtime/procs.py use of `subprocess.Popen`.

Where it cannot work (not Linux, a supervisor with threads already, prctl refused) `ForkServer.
start` returns None and the workers start as fresh interpreters; so does a request that fails.
The server exits when its request pipe closes (the supervisor closed it or died).
"""
from __future__ import annotations

import gc
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback

PR_SET_PDEATHSIG, PR_SET_NAME, PR_SET_CHILD_SUBREAPER = 1, 15, 36
ADOPT_WAIT_S = 5.0   # a worker waits at most this for the supervisor to adopt it
REPLY_WAIT_S = 30.0  # the supervisor waits at most this for a spawn's pid


class ForkServerError(RuntimeError):
    pass


def _prctl(option: int, value) -> bool:
    import ctypes
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl(option, value) == 0
    except OSError:
        return False


def _name(name: str) -> None:
    """The process's name (what `ps -e`, `top` and psutil's name() show; 15 bytes at most): a
    forked worker's command line is the supervisor's."""
    _prctl(PR_SET_NAME, name.encode()[:15])


class ForkServer:
    """The supervisor's end: `spawn(entry, run_dir, name)` forks a worker named `name` that runs
    `entry` ("module:Class", called as Class(run_dir).serve()) and returns its `Forked` handle."""

    def __init__(self, pid: int, requests: int, replies: int):
        self.pid, self._req, self._rep = pid, requests, replies
        self._lock = threading.Lock()
        self.closed = False

    @classmethod
    def start(cls, preload: tuple[str, ...]) -> ForkServer | None:
        """Forks the server now, which imports `preload`; None where workers must start fresh."""
        if not sys.platform.startswith("linux") or threading.active_count() > 1:
            return None  # a Python thread would not survive the fork (numpy's OpenBLAS pool does:
            # it stops and restarts itself around a fork, pthread_atfork)
        if not _prctl(PR_SET_CHILD_SUBREAPER, 1):
            return None
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.close(req_w)
            os.close(rep_r)
            code = 1
            try:
                code = _serve(req_r, rep_w, preload, os.getppid())
            finally:
                os._exit(code)
        os.close(req_r)
        os.close(rep_w)
        return cls(pid, req_w, rep_r)

    def spawn(self, entry: str, run_dir: str, name: str) -> Forked:
        line = json.dumps({"entry": entry, "run_dir": run_dir, "name": name}).encode() + b"\n"
        with self._lock:
            if self.closed:
                raise ForkServerError("the fork server is closed")
            try:
                os.write(self._req, line)
                pid = int(_read_line(self._rep, REPLY_WAIT_S))
            except (OSError, ValueError, ForkServerError) as e:
                raise ForkServerError(f"the fork server did not start {entry}: {e}") from None
        if pid <= 0:  # its fork failed (a signal to pid -1 or 0 would reach many processes)
            raise ForkServerError(f"the fork server could not fork {entry}")
        return Forked(pid)

    def close(self, timeout_s: float = 5.0) -> None:
        """Closes the pipe (the server exits on it) and reaps the server; once."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            for fd in (self._req, self._rep):
                os.close(fd)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                done, _ = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                return
            if done:
                return
            time.sleep(0.01)
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


def _read_line(fd: int, timeout_s: float | None) -> bytes:
    """One line from a pipe, within timeout_s (None: as long as it takes)."""
    buf = b""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not buf.endswith(b"\n"):
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and (left <= 0 or not select.select([fd], [], [], left)[0]):
            raise ForkServerError(f"no answer within {timeout_s:.0f} s")
        chunk = os.read(fd, 64)
        if not chunk:
            raise ForkServerError("the fork server is gone")
        buf += chunk
    return buf


class Forked:
    """A worker the supervisor adopted: pid, returncode, poll(), wait(timeout), send_signal(),
    kill(), as `subprocess.Popen` has them. One thread at a time reaps it."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None
        self._lock = threading.Lock()

    def _reap(self, flags: int) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, flags)
            except ChildProcessError:  # reaped elsewhere: its code is lost
                self.returncode = 255
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def poll(self) -> int | None:
        if not self._lock.acquire(blocking=False):
            return self.returncode  # another thread is in wait()
        try:
            return self._reap(os.WNOHANG)
        finally:
            self._lock.release()

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._lock.acquire(timeout=0.01):
                try:
                    if self._reap(os.WNOHANG if deadline is not None else 0) is not None:
                        return self.returncode
                finally:
                    self._lock.release()
            elif self.returncode is not None:
                return self.returncode
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.005)

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


# -- the server's side ---------------------------------------------------------------------------
def _serve(req: int, rep: int, preload: tuple[str, ...], supervisor: int) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor ends it by closing the pipe
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    _name("dfn-forkserver")
    if os.getppid() != supervisor:
        return 0
    for name in preload:
        try:
            importlib.import_module(name)
        except Exception:  # the worker's own import reports it
            pass
    gc.collect()
    gc.freeze()  # the shared objects stay out of collections, so the children leave their pages
    while True:
        try:
            line = _read_line(req, None)
        except ForkServerError:
            return 0
        try:
            pid = _fork_worker(json.loads(line), (req, rep), supervisor)
        except OSError:  # out of processes or memory: the supervisor starts this one fresh
            pid = -1
        os.write(rep, f"{pid}\n".encode())


def _fork_worker(job: dict, fds: tuple[int, int], supervisor: int) -> int:
    """Forks an intermediate that forks the worker and exits; returns the worker's pid (or -1)
    once the intermediate is gone, so the supervisor has adopted it."""
    r, w = os.pipe()
    mid = os.fork()
    if mid == 0:  # the intermediate: never returns into the server's loop
        try:
            os.close(r)
            pid = os.fork()
            if pid == 0:
                os.close(w)
                _run_worker(job, fds, supervisor)
            os.write(w, f"{pid}\n".encode())
        finally:
            os._exit(0)
    os.close(w)
    try:
        pid = int(_read_line(r, REPLY_WAIT_S))
    except (ForkServerError, ValueError):
        pid = -1
    finally:
        os.close(r)
        os.waitpid(mid, 0)
    return pid


def _run_worker(job: dict, fds: tuple[int, int], supervisor: int) -> None:
    code = 1
    try:
        for fd in fds:
            os.close(fd)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.dup2(2, 1)  # as the fresh workers have it: their stdout is the supervisor's stderr
        _name(job["name"])
        deadline = time.monotonic() + ADOPT_WAIT_S
        while os.getppid() != supervisor and time.monotonic() < deadline:
            time.sleep(0.001)
        module, cls = job["entry"].split(":")
        sys.argv = [module, job["run_dir"]]
        getattr(importlib.import_module(module), cls)(job["run_dir"]).serve()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except Exception:
                pass
        os._exit(code)
