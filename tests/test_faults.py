"""Fault injection against the real process tree: SIGKILL of a worker while idle, in a prefill
and in a decode, and of the supervisor. Each killed worker fails every request in flight and
queued at once with `worker_died` naming that role (the client's 2-second deadline would turn a
late answer into RuntimeUnavailable), the supervisor restarts all three workers on a fresh pool
segment, and the next request's tokens equal the ones from before the crash. Past
runtime.restart_max the supervisor exits 1 naming the role. conftest asserts that no process and
no segment is left after each test."""
from __future__ import annotations

import random
import re
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import msgpack
import psutil
import pytest
import zmq

from conftest import deltafin_processes, deltafin_segments, worker_process
from deltafin.client import Client, RuntimeDeadError, RuntimeRestarting, RuntimeUnavailable
from deltafin.tools.run import StartError, running_supervisor

BIG = "4GiB"
DEADLINE_S = 2.0           # every request in flight fails within this after a kill
DECODE_PROMPT = [100, 200, 300, 400]
LONG_PROMPT = [(7 * i + 3) % 500 + 1 for i in range(1900)]  # a prefill of several forward passes


@contextmanager
def _supervisor(store, extra: list[str], log_path):
    """running_supervisor with its stderr in a file: the log is read after the exit, and shown
    when start-up fails."""
    with open(log_path, "w+") as log:
        try:
            with running_supervisor(store, BIG, extra, stderr=log) as (ep, proc):
                yield ep, proc, log_path
        except StartError as e:
            raise StartError(f"{e}: {Path(log_path).read_text()}") from None


def _exited(procs, timeout_s: float) -> list:
    """The processes still running after timeout_s. An exited process whose new parent (after
    its own parent was killed) has not reaped it yet is a zombie: it has exited."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = []
        for p in procs:
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.02)


def _worker(proc, role: str) -> psutil.Process:
    return worker_process(proc.pid, role)


class RawPeer:
    """A second client as a bare DEALER: its request waits behind the first one's in compute."""

    def __init__(self, endpoint: str):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def send(self, **msg) -> None:
        self.sock.send(msgpack.packb(msg))

    def final(self, timeout_s: float) -> dict:
        """The request's final reply (done, logits_result or error), skipping token messages."""
        while self.sock.poll(int(timeout_s * 1000)):
            m = msgpack.unpackb(self.sock.recv())
            if m["type"] != "token":
                return m
        raise TimeoutError(f"no final reply within {timeout_s} s")

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def _expect_death(consume, role: str, c: Client) -> float:
    """Runs consume() (which must end in the typed error), with the client's deadline at 2 s
    from the kill on; returns the seconds from kill to error."""
    c.timeout = DEADLINE_S
    t0 = time.monotonic()
    with pytest.raises(RuntimeDeadError, match=f"worker {role} .*killed by SIGKILL"):
        consume()
    return time.monotonic() - t0


@pytest.mark.parametrize("role", ["loader", "router", "compute"])
def test_worker_killed_anywhere_restarts_with_the_same_answers(tiny_stores, role, tmp_path):
    rng = random.Random(f"faults-{role}")
    store = tiny_stores("deepseek_v2")
    with _supervisor(store, ["--max-slots", "6"], tmp_path / "log") as (ep, proc, log):
        with Client(ep, timeout=60) as c:
            ref_decode = c.generate(DECODE_PROMPT, max_tokens=40).token_ids
            ref_long = c.generate(LONG_PROMPT, max_tokens=4).token_ids
            assert len(ref_decode) == 40
            figures = {}

            # 1. idle: the supervisor notices by itself; a request right after is refused at once
            # (`restarting`) or, sent before the death was seen, fails with `worker_died`.
            _worker(proc, role).send_signal(signal.SIGKILL)
            c.timeout = DEADLINE_S
            with pytest.raises((RuntimeDeadError, RuntimeRestarting), match=f"worker {role}"):
                c.generate(DECODE_PROMPT, max_tokens=40)
            c.wait_until_serving(60)
            c.timeout = 60
            assert c.generate(DECODE_PROMPT, max_tokens=40).token_ids == ref_decode

            # 2. in a prefill, with a second client's request queued behind it
            first, queued = RawPeer(ep), RawPeer(ep)
            try:
                first.send(type="generate", id=1, token_ids=LONG_PROMPT, max_tokens=4)
                queued.send(type="generate", id=1, token_ids=DECODE_PROMPT, max_tokens=40)
                time.sleep(rng.uniform(0.05, 0.25))
                _worker(proc, role).send_signal(signal.SIGKILL)
                t0 = time.monotonic()
                for peer in (first, queued):
                    err = peer.final(DEADLINE_S)
                    assert err["type"] == "error", "the kill came after the prefill"
                    assert err["code"] == "worker_died" and f"worker {role}" in err["message"]
                figures["prefill_error_s"] = time.monotonic() - t0
            finally:
                first.close()
                queued.close()
            c.wait_until_serving(60)
            c.timeout = 60
            assert c.generate(LONG_PROMPT, max_tokens=4).token_ids == ref_long

            # 3. in a decode, after a random number of tokens
            stream = c.stream(DECODE_PROMPT, max_tokens=40)
            got = [next(stream) for _ in range(rng.randint(1, 20))]
            _worker(proc, role).send_signal(signal.SIGKILL)
            figures["decode_error_s"] = _expect_death(lambda: list(stream), role, c)
            assert got
            c.wait_until_serving(60)
            c.timeout = 60
            assert c.generate(DECODE_PROMPT, max_tokens=40).token_ids == ref_decode
            h = c.health()
            assert h["ok"] and h["restarts"] == 3 and h["state"] == "serving"
            assert len(deltafin_segments()) == 1  # each restart unlinked the pool it replaced
            print(f"{role}: " + ", ".join(f"{k} {v:.3f}" for k, v in figures.items()))

            # 4. one death more than runtime.restart_max (3) in the window: the runtime stops
            _worker(proc, role).send_signal(signal.SIGKILL)
            with pytest.raises((RuntimeDeadError, RuntimeRestarting, RuntimeUnavailable)):
                c.generate(DECODE_PROMPT, max_tokens=40)
        assert proc.wait(timeout=30) == 1
    err = log.read_text()
    assert f"worker {role}" in err and "runtime.restart_max = 3" in err
    restarts = re.findall(r"workers restarted in ([0-9.]+) s", err)
    assert len(restarts) == 3
    print(f"{role}: restarts took {', '.join(restarts)} s")


def test_workers_fork_from_the_fork_server_and_start_fresh_without_it(tiny_stores, tmp_path):
    """The workers are forked from the supervisor's fork server (runtime/forkserver.py) and
    adopted by the supervisor; with the fork server gone, a restart starts them as fresh
    interpreters and answers the same."""
    with _supervisor(tiny_stores("mixtral"), ["--max-slots", "4"], tmp_path / "log") as (ep, proc, log):
        kids = {k.name(): k for k in psutil.Process(proc.pid).children()}
        assert {"dfn-forkserver", "dfn-router", "dfn-loader", "dfn-compute"} <= set(kids), kids
        assert all(kids[f"dfn-{r}"].ppid() == proc.pid for r in ("router", "loader", "compute"))
        with Client(ep, timeout=60) as c:
            ref = c.generate(DECODE_PROMPT, max_tokens=12).token_ids
            kids["dfn-forkserver"].send_signal(signal.SIGKILL)
            kids["dfn-compute"].send_signal(signal.SIGKILL)
            deadline = time.monotonic() + 60
            while c.health()["restarts"] < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            c.wait_until_serving(60)
            assert c.generate(DECODE_PROMPT, max_tokens=12).token_ids == ref
            fresh = worker_process(proc.pid, "compute")
            assert "deltafin.workers.compute" in " ".join(fresh.cmdline())
    assert "workers start as fresh interpreters" in Path(log).read_text()


def test_fork_server_off_starts_fresh_interpreters(tiny_stores, tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[runtime]\nfork_server = false\n")
    with _supervisor(tiny_stores("mixtral"), ["--config", str(cfg)], tmp_path / "log") as (ep, proc, _):
        cmds = sorted(" ".join(k.cmdline()) for k in psutil.Process(proc.pid).children())
        assert len(cmds) == 3 and all("deltafin.workers." in c for c in cmds), cmds
        with Client(ep, timeout=60) as c:
            assert len(c.generate(DECODE_PROMPT, max_tokens=4).token_ids) == 4


def test_loader_death_is_named_even_when_the_router_loses_it(tiny_stores, tmp_path):
    """The loader killed while the router has reads to send it: the router must not take the
    blame (a dying peer can also see "Host unreachable" first)."""
    cfg = tmp_path / "c.toml"
    cfg.write_text("[runtime]\nrestart_max = 0\n")
    with _supervisor(tiny_stores("mixtral"), ["--max-slots", "2", "--config", str(cfg)],
                     tmp_path / "log") as (ep, proc, log):
        with Client(ep, timeout=60) as c:
            stream = c.stream(DECODE_PROMPT, max_tokens=200)
            next(stream)
            _worker(proc, "loader").send_signal(signal.SIGKILL)
            _expect_death(lambda: list(stream), "loader", c)
        assert proc.wait(timeout=30) == 1
    err = log.read_text()
    assert "worker loader" in err and "worker router" not in err


def test_sigkill_of_the_supervisor_mid_prefill_takes_every_worker(tiny_stores):
    """compute is inside a long prefill when the supervisor dies: it exits anyway (Linux: the
    kernel's parent-death signal; everywhere: the parent watch thread), and the next start
    sweeps the segment."""
    with running_supervisor(tiny_stores("deepseek_v2"), BIG) as (ep, proc):
        kids = psutil.Process(proc.pid).children()
        peer = RawPeer(ep)
        try:
            peer.send(type="generate", id=1, token_ids=LONG_PROMPT, max_tokens=40)
            time.sleep(0.3)
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
            alive = _exited(kids, DEADLINE_S)
            assert not alive, [k.cmdline() for k in alive]
            with pytest.raises(TimeoutError):  # nobody answers any more, and nothing hangs
                peer.final(0.5)
        finally:
            peer.close()
    leftover = deltafin_segments()
    assert leftover
    with running_supervisor(tiny_stores("deepseek_v2"), BIG) as (ep, proc):
        assert not set(leftover) & set(deltafin_segments())
    assert not deltafin_processes()


CHILD = """
import sys, mlx.core as mx
from deltafin.workers.common import watch_parent
watch_parent(int(sys.argv[1]))
a = mx.random.normal((600, 600))
print("computing", flush=True)
while True:  # one long MLX evaluation after another: the main thread never returns to Python for long
    b = a
    for _ in range(200):
        b = b @ a
    mx.eval(b)
"""
PARENT = """
import subprocess, sys, os, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], str(os.getpid())])
print(child.pid, flush=True)
time.sleep(120)
"""


def test_parent_watch_ends_a_worker_busy_in_mlx():
    """The watch thread alone (what macOS has): a process deep in MLX computations exits once
    its parent is killed."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD], stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = psutil.Process(int(parent.stdout.readline()))
        assert parent.stdout.readline().strip() == "computing"
        time.sleep(0.5)
        assert child.is_running() and child.status() != psutil.STATUS_ZOMBIE
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        assert not _exited([child], DEADLINE_S)
    finally:
        if child is not None and child.is_running():
            child.kill()
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def test_sweep_spares_a_run_directory_still_being_made(tmp_path):
    """Two supervisors starting together (the ranks of one mlx.launch): one's sweep must not
    take the directory the other made an instant ago, before its run.json exists; an old
    directory without run.json, or one whose owner is gone, is swept."""
    import os
    import time

    from deltafin.runtime.shm import FRESH_RUN_S, sweep_stale_runs
    fresh, old, dead = tmp_path / "fresh", tmp_path / "old", tmp_path / "dead"
    for d in (fresh, old, dead):
        d.mkdir()
    (dead / "run.json").write_text('{"pid": 999999999, "segments": [], "files": []}')
    past = time.time() - FRESH_RUN_S - 5
    os.utime(old, (past, past))
    sweep_stale_runs(tmp_path)
    assert fresh.exists() and not old.exists() and not dead.exists()
