"""Probes of the HTTP frontend (docs/SECURITY.md, "Probes"): the frontend is measured in the
memory budget, bodies too large, too deep or with integers msgpack cannot carry get 4xx at once
(a large one parsed off the event loop), and slow, half-open and idle connections are closed
while /health keeps answering. Real processes: deltafin-supervisor --http on a tiny store."""
from __future__ import annotations

import contextlib
import http.client
import json
import resource
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil

from conftest import config_flags
from deltafin.client import Client
from deltafin.runtime.procs import stop_process
from deltafin.tools.monitor import memory_rows
from deltafin.tools.run import running_supervisor

BIG = "4GiB"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _runtime(store, tmp_path, budget=BIG, **http):
    """(ZeroMQ endpoint, port, supervisor process) of a supervisor with --http; `http`: the
    configuration's [http] section."""
    port = _free_port()
    extra = ["--http", f"127.0.0.1:{port}"] + (config_flags(tmp_path, http=http) if http else [])
    with running_supervisor(store, budget, extra) as (endpoint, proc):
        line = []  # printed right after READY, maybe already in the pipe's buffer
        reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout=30)
        assert line and line[0].strip() == f"HTTP http://127.0.0.1:{port}", line
        yield endpoint, port, proc


def _request(port: int, method: str, path: str, body: bytes | None = None, timeout: float = 30):
    """(status, parsed JSON body, seconds taken)."""
    t0 = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read() or b"null"), time.monotonic() - t0
    finally:
        conn.close()


def _tree_pss(pid: int) -> int:
    total = 0
    for p in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            total += p.memory_full_info().pss
    return total


# -- item 3: the frontend in the budget -------------------------------------------------------------
def test_the_frontend_is_measured_in_the_budget(tiny_stores, tmp_path):
    with _runtime(tiny_stores("mixtral"), tmp_path, max_body_bytes="256KiB") as (ep, port, proc):
        front = next(k for k in psutil.Process(proc.pid).children()
                     if "deltafin.workers.frontend" in " ".join(k.cmdline()))
        with Client(ep, timeout=60) as c:
            st = c.stats()
        procs, mem = st["processes"], st["memory"]
        assert procs["frontend"]["pid"] == front.pid, procs
        assert mem["tree_bytes"] == sum(p["pss"] for p in procs.values())
        # the tree the pool was sized from held the frontend; its bodies are reserved on top
        assert mem["startup_tree_bytes"] > procs["frontend"]["pss"] + procs["supervisor"]["pss"]
        assert mem["reserves_bytes"] >= 4 * (256 << 10)
        assert "frontend" in memory_rows(st)  # deltafin-monitor shows it
        peak, stop = [0], threading.Event()

        def sample():
            while not stop.is_set():
                peak[0] = max(peak[0], _tree_pss(proc.pid))
                time.sleep(0.02)
        t = threading.Thread(target=sample, daemon=True)
        t.start()
        try:
            body = json.dumps({"model": "x", "prompt": "a" * (200 << 10)}).encode()
            for _ in range(3):
                assert _request(port, "POST", "/v1/completions", body)[0] in (400, 404)
        finally:
            stop.set()
            t.join(timeout=5)
        assert 0 < peak[0] <= mem["budget"]


# -- items 5 and 9: bodies ----------------------------------------------------------------------------
def _nested(depth: int):
    out = 1
    for _ in range(depth):
        out = [out]
    return out


def test_bodies_too_large_deep_or_out_of_range_get_4xx_at_once(tiny_stores, tmp_path):
    with _runtime(tiny_stores("mixtral"), tmp_path, max_body_bytes="1MiB") as (ep, port, proc):
        model = _request(port, "GET", "/v1/models")[1]["data"][0]["id"]

        def body(**kw) -> bytes:
            return json.dumps({"model": model, "prompt": "hello", "max_tokens": 2, **kw}).encode()
        cases = [(413, "http.max_body_bytes", body(prompt="a" * (2 << 20))),
                 (400, "out of range [-2^63, 2^64)", body(seed=2**64)),
                 (400, "out of range [-2^63, 2^64)", body(prompt=[1, 2, 2**70])),
                 (400, "nests deeper", b"[" * 100_000 + b"]" * 100_000),
                 (400, "nests deeper", body(prompt=_nested(40))),
                 (400, "not valid JSON", b"{" * 10),
                 (404, "does not exist", json.dumps({"model": "m" * 500_000}).encode())]
        for status, why, raw in cases:
            got, answer, took = _request(port, "POST", "/v1/completions", raw)
            assert (got, took < 2.0) == (status, True), (why, got, answer, took)
            assert why in answer["error"]["message"] and len(json.dumps(answer)) < 2048, answer
        # a body just under the limit is parsed off the event loop: /health answers meanwhile
        near = body(prompt=list(range(1, 100_000)) + [1] * 100_000)  # ~1 MB of token ids
        assert len(near) < 1 << 20
        answers = []
        posts = [threading.Thread(target=lambda: answers.append(_request(port, "POST", "/v1/completions", near)))
                 for _ in range(4)]
        for t in posts:
            t.start()
        status, health, took = _request(port, "GET", "/health")
        for t in posts:
            t.join(timeout=60)
        assert status == 200 and took < 1.0, (status, took)
        assert [(a[0], a[1]["error"]["code"]) for a in answers] == [(400, "context_length_exceeded")] * 4


# -- item 6: slow, half-open and idle connections -------------------------------------------------------
def test_slow_half_open_and_idle_connections_are_closed_while_health_answers(tiny_stores, tmp_path):
    limits = {"header_timeout_s": 1.5, "body_timeout_s": 1.5, "idle_timeout_s": 1.0}
    with _runtime(tiny_stores("mixtral"), tmp_path, **limits) as (ep, port, proc):
        socks = []
        try:
            for i in range(300):  # idle: connected, nothing sent; slow: a head that never ends
                s = socket.create_connection(("127.0.0.1", port), timeout=10)
                if i % 3 == 0:
                    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
                socks.append(s)
            stalled = socket.create_connection(("127.0.0.1", port), timeout=10)
            stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                            b"Content-Length: 1000\r\n\r\n{\"model\":")
            status, health, took = _request(port, "GET", "/health")
            assert status == 200 and health["ok"] and took < 1.0, (status, took)
            t0 = time.monotonic()
            assert stalled.recv(4096).startswith(b"HTTP/1.1 408"), "no 408 for a body that stalled"
            assert 1.0 < time.monotonic() - t0 < 5.0
            for s in socks:  # each closed by the server (the head timeout), none answered
                assert s.recv(4096) == b""
            # a kept-alive connection that says nothing after its answer is closed too
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.request("GET", "/health")
            assert conn.getresponse().read()
            t0 = time.monotonic()
            assert conn.sock.recv(4096) == b"" and time.monotonic() - t0 < 3.0
            conn.close()
            stalled.close()
        finally:
            for s in socks:
                s.close()
        assert _request(port, "GET", "/health")[0] == 200


def test_idle_connections_beyond_the_file_limit_leave_health_answering(tiny_stores, tmp_path):
    """deltafin-http under a 1,024-file limit: 1,100 idle connections would take every file
    (accept failing, /health hanging); the oldest waiting ones are closed instead, at once."""
    with running_supervisor(tiny_stores("mixtral"), BIG) as (ep, _):
        port = _free_port()
        limit = lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))
        front = subprocess.Popen([sys.executable, "-m", "deltafin.workers.frontend", "--endpoint", ep,
                                  "--listen", f"127.0.0.1:{port}", "--header-timeout", "60"],
                                 stdout=subprocess.PIPE, stderr=open(tmp_path / "http.log", "w"),
                                 text=True, preexec_fn=limit)
        socks = []
        try:
            line = []
            reader = threading.Thread(target=lambda: line.append(front.stdout.readline()), daemon=True)
            reader.start()
            reader.join(timeout=60)
            assert line and line[0].startswith("LISTENING"), line
            for _ in range(1100):
                socks.append(socket.create_connection(("127.0.0.1", port), timeout=10))
            status, health, took = _request(port, "GET", "/health", timeout=10)
            assert status == 200 and health["ok"] and took < 2.0, (status, took)
            closed = 0
            for s in socks[:600]:  # the oldest: closed by the server long before the head timeout
                s.settimeout(5)
                closed += s.recv(16) == b""
            assert closed == 600, closed  # at most 1024 // 2 - 128 = 384 wait
        finally:
            for s in socks:
                s.close()
            stop_process(front, 10, signal.SIGTERM)
            front.stdout.close()
        # accept never failed (asyncio pauses accepting for a second each time it does)
        assert "Too many open files" not in (tmp_path / "http.log").read_text()
