"""The supervisor's side of the HTTP frontend (`deltafin-supervisor --http HOST:PORT`):
`FrontendProcess` starts `deltafin-http` (workers/frontend.py) as a child once the runtime
serves, prints `HTTP http://HOST:PORT`, restarts the child when it dies and stops it with the
supervisor; `parse_listen` checks a HOST:PORT for both."""
from __future__ import annotations

import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

from deltafin.runtime.procs import stop_process
from deltafin.workers.http_auth import API_KEY_ENV
from deltafin.runtime.security import LOOPBACK_HOSTS, default_keys_dir

LISTENING = "LISTENING"        # the child's one stdout line once it serves: `LISTENING http://...`
CHILD_STOP_GRACE_S = 3.0       # SIGTERM, then SIGKILL
RESTART_BACKOFF_S = (0.5, 10.0)  # first and longest wait before restarting a child that died


# Copies of a body the frontend may hold at once (bytes, text, parsed objects, the request
# message): the budget's reserve for it is this many times http.max_body_bytes.
BODY_COPIES = 4


def limit_flags(http) -> dict:
    """deltafin-http's limit flags from the configuration's [http] section."""
    return {"header-timeout": http.header_timeout_s, "body-timeout": http.body_timeout_s,
            "idle-timeout": http.idle_timeout_s, "max-body-bytes": http.body_bytes}


def parse_listen(listen: str, allow_remote: bool) -> tuple[str, int]:
    """HOST:PORT ([::1]:PORT for IPv6); loopback only unless allow_remote."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"--listen {listen!r}: expected HOST:PORT, e.g. 127.0.0.1:8000")
    if host not in LOOPBACK_HOSTS and not allow_remote:
        raise ValueError(f"{host} is not a loopback address; pass --allow-remote to serve HTTP to "
                         f"other machines (anyone who reaches the port can use the model)")
    return host.strip("[]"), int(port)


class FrontendProcess:
    """deltafin-http as a child of the supervisor: started once the runtime serves, restarted
    when it dies (after a pause that grows while it keeps dying at once), stopped with the
    supervisor. One thread does all of it: the child's parent-death signal follows the thread
    that started it, so that thread lives as long as any child it started."""

    def __init__(self, endpoint: str, listen: str, allow_remote: bool = False, keys: str | None = None,
                 log=None, announce=None, limits: dict | None = None, api_key: str | None = None):
        self.endpoint, self.allow_remote, self.keys = endpoint, allow_remote, keys
        self.api_key = api_key  # handed to the child in its environment, never on its command line
        self.limits = limits or {}  # deltafin-http's limit flags: {"header-timeout": 10.0, ...}
        self.host, self.port = parse_listen(listen, allow_remote)
        self.log = log or (lambda m: print(f"deltafin-http: {m}", file=sys.stderr, flush=True))
        self.announce = announce or (lambda url: print(f"HTTP {url}", flush=True))
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None
        self.starts = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="http-frontend", daemon=True)

    @classmethod
    def for_runtime(cls, endpoint: str, listen: str, config, curve: bool,
                    api_key: str | None = None) -> "FrontendProcess":
        """The supervisor's frontend: CURVE keys where the endpoint has them, the [http] limits;
        the supervisor announces its URL itself."""
        rc = config.runtime
        keys = str(Path(rc.keys_dir).expanduser() if rc.keys_dir else default_keys_dir()) if curve else None
        return cls(endpoint, listen, rc.allow_remote, keys, announce=lambda url: None,
                   limits=limit_flags(config.http), api_key=api_key)

    def start(self) -> None:
        self._thread.start()

    def start_answered(self, pump, timeout: float) -> None:
        """Starts it and calls pump() (the supervisor's loop, which answers its hello) until it
        serves, gives up (its stderr says why) or timeout seconds pass."""
        self.start()
        deadline = time.monotonic() + timeout
        while self.url is None and self.running and time.monotonic() < deadline:
            pump()

    def _spawn(self) -> subprocess.Popen:
        host = f"[{self.host}]" if ":" in self.host else self.host
        cmd = [sys.executable, "-m", "deltafin.workers.frontend", "--endpoint", self.endpoint,
               "--listen", f"{host}:{self.port}", "--parent-pid", str(os.getpid())]
        cmd += ["--allow-remote"] if self.allow_remote else []
        cmd += ["--keys", self.keys] if self.keys else []
        for flag, value in self.limits.items():
            cmd += [f"--{flag}", str(value)]
        # Its own session: a terminal's Ctrl-C reaches the supervisor, which stops the frontend
        # itself, rather than both at once (which would look like a death to restart from).
        env = {**os.environ, API_KEY_ENV: self.api_key} if self.api_key else None
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                start_new_session=True, env=env)

    def _await_listening(self, p: subprocess.Popen, timeout: float) -> str | None:
        deadline, buf = time.monotonic() + timeout, b""
        while b"\n" not in buf and time.monotonic() < deadline and not self._stop.is_set():
            ready, _, _ = select.select([p.stdout], [], [], 0.2)
            if ready:
                chunk = os.read(p.stdout.fileno(), 4096)
                if not chunk:
                    break
                buf += chunk
        p.stdout.close()  # the child prints one line, then writes only to stderr
        line = buf.split(b"\n", 1)[0].decode(errors="replace")
        return line.split(None, 1)[1] if line.startswith(LISTENING + " ") else None

    def _run(self) -> None:
        pause = RESTART_BACKOFF_S[0]
        while not self._stop.is_set():
            t0 = time.monotonic()
            with self._lock:
                if self._stop.is_set():
                    return
                p = self.proc = self._spawn()
                self.starts += 1
            url = self._await_listening(p, timeout=120)
            if url is None and self.url is None and not self._stop.is_set():
                # Never served (port taken, runtime unreachable): its own stderr said why, and
                # starting it again would fail the same way. The ZeroMQ endpoint serves on.
                p.wait()
                self.log(f"the HTTP frontend could not start on {self.host}:{self.port} (exit code "
                         f"{p.returncode}); the runtime serves without it")
                return
            if url:
                if self.url is None:
                    self.url = url
                    self.announce(url)
                else:
                    self.log(f"restarted (pid {p.pid}), serving {url} again")
                if self.port == 0:  # keep the port the first child got across restarts
                    self.port = int(url.rsplit(":", 1)[1].rstrip("/"))
            code = p.wait()
            if self._stop.is_set():
                return
            pause = RESTART_BACKOFF_S[0] if time.monotonic() - t0 > 30 else min(pause * 2, RESTART_BACKOFF_S[1])
            self.log(f"the HTTP frontend (pid {p.pid}) exited with code {code}; restarting it in {pause:.1f} s")
            self._stop.wait(pause)

    @property
    def running(self) -> bool:
        """Whether it serves or is still trying to (False once it gave up or was stopped)."""
        return self._thread.is_alive()

    @property
    def pid(self) -> int | None:
        """The child serving now (None: none runs)."""
        p = self.proc
        return p.pid if p is not None and p.poll() is None else None

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            p = self.proc
        if p is not None:
            stop_process(p, CHILD_STOP_GRACE_S)
        self._thread.join(timeout=5)
