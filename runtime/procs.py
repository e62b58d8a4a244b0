"""Stopping child processes: one escalation for every parent in the project.

`stop_processes` waits for processes asked to stop some other way (a message, a signal, or a
task that ends by itself), then sends SIGKILL, waiting a bounded time after each step; several
processes go through each step together, under one deadline per step."""
from __future__ import annotations

import os
import signal
import subprocess
import time

KILL_WAIT_S = 5.0  # how long a SIGKILLed process is waited for


def stop_processes(procs, grace_s: float, first: int | None = None, kill_s: float = KILL_WAIT_S) -> bool:
    """Ends procs (subprocess.Popen): sends `first` (None: nothing) and waits up to grace_s for
    them to exit; then SIGKILL and waits up to kill_s. True when all exited within grace_s."""
    procs = list(procs)
    for i, (sig, wait_s) in enumerate([(first, grace_s), (signal.SIGKILL, kill_s)]):
        left = [p for p in procs if p.poll() is None]
        if not left:
            return i <= 1
        for p in left if sig is not None else ():
            try:
                p.send_signal(sig)
            except OSError:  # exited meanwhile
                pass
        deadline = time.monotonic() + wait_s
        for p in left:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    return False


def stop_process(proc: subprocess.Popen, grace_s: float, first: int | None = signal.SIGTERM,
                 kill_s: float = KILL_WAIT_S) -> bool:
    """One process: sends `first` (default SIGTERM; None: nothing), waits up to grace_s, then
    SIGKILL and waits up to kill_s. True when it exited within grace_s."""
    return stop_processes([proc], grace_s, first, kill_s=kill_s)


class WakePipe:
    """A non-blocking pipe that wakes a poll loop from another thread: `fd` is polled with the
    sockets, `wake` writes a byte (never blocks; a full pipe is awake anyway), `drain` empties it."""

    def __init__(self):
        self.fd, self._w = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._w, False)

    def wake(self) -> None:
        try:
            os.write(self._w, b"x")
        except OSError:  # closed at shutdown, or full: the loop is awake anyway
            pass

    def drain(self) -> None:
        try:
            while os.read(self.fd, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        for fd in (self.fd, self._w):
            try:
                os.close(fd)
            except OSError:
                pass
