"""Probes of a hostile-but-fair user (docs/SECURITY.md, "Probes"): an abstract socket is refused
without CURVE, a stop answers every request in flight with `shutting_down` (SIGTERM to the whole
process group too, without a worker restart), a client that never reads cannot make the
supervisor hold its replies, a temperature below the floor is greedy, a bad configuration is a
ConfigError, a /dev/shm without room for the pool is refused at start, and a stop during the
preload ends every worker without a kill."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import psutil
import pytest
import zmq

from deltafin.client import Client, RequestError, RuntimeUnavailable
from deltafin.protocol import messages as M
from deltafin.runtime import shm
from deltafin.runtime.config import ConfigError, load_config
from deltafin.runtime.security import SecurityError, check_endpoint, check_ipc_length, ipc_path_max
from deltafin.tools.run import running_supervisor
from conftest import config_flags, worker_process

BIG = "4GiB"


def _start(store, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deltafin.workers.supervisor", "--model", str(store),
                           "--memory-budget", BIG, *args], capture_output=True, text=True, timeout=120)


def _dealer(endpoint: str, **opts) -> tuple[zmq.Context, zmq.Socket]:
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    for k, v in opts.items():
        s.setsockopt(getattr(zmq, k), v)
    s.connect(endpoint)
    return ctx, s


# -- endpoints ------------------------------------------------------------------------------------
def test_permissionless_ipc_endpoints_are_refused():
    name = f"ipc://@deltafin-test-{os.getpid()}"
    with pytest.raises(SecurityError, match="abstract socket"):
        check_endpoint(name, allow_remote=False)
    check_endpoint(name, allow_remote=True)  # served with CURVE
    for chosen_by_zmq in ("ipc://*", "ipc://"):
        with pytest.raises(SecurityError, match="name the socket path"):
            check_endpoint(chosen_by_zmq, allow_remote=True)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="abstract sockets are Linux's")
def test_an_abstract_socket_is_refused_and_served_only_with_curve(tiny_stores, tmp_path):
    endpoint = f"ipc://@deltafin-test-{os.getpid()}"
    r = _start(tiny_stores("mixtral"), "--endpoint", endpoint)
    assert r.returncode == 2 and "abstract socket" in r.stderr and "READY" not in r.stdout
    keys = tmp_path / "keys"
    cfg = tmp_path / "remote.toml"
    cfg.write_text(f'[runtime]\nkeys_dir = "{keys}"\n')
    extra = ["--endpoint", endpoint, "--allow-remote", "--config", str(cfg)]
    with running_supervisor(tiny_stores("mixtral"), BIG, extra) as (ep, _):
        with Client(ep, timeout=60, keys=keys) as c:
            assert len(c.generate([1, 2, 3], max_tokens=2).token_ids) == 2
        with pytest.raises(RuntimeUnavailable):  # no keys: no handshake, no answer
            Client(ep, timeout=2)


# -- stopping -------------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["SIGINT", "SIGTERM", "SIGTERM to the group"])
def test_a_stop_answers_every_request_in_flight_with_shutting_down(tiny_stores, tmp_path, how):
    log_path = tmp_path / "supervisor.log"
    with open(log_path, "w+") as log, running_supervisor(
            tiny_stores("mixtral"), BIG, stderr=log, preexec_fn=os.setsid) as (ep, proc):
        ctx, s = _dealer(ep)
        try:
            for rid in (1, 2):  # one running, one queued behind it in compute
                s.send(msgpack.packb({"type": "generate", "id": rid, "token_ids": [1, 2, 3],
                                      "max_tokens": 2000}))
            assert s.poll(60_000)  # the first token: the requests are in flight
            if how == "SIGTERM to the group":
                # where a worker gets it first, it must not exit (that would be a crash to restart)
                compute = worker_process(proc.pid, "compute")
                compute.send_signal(signal.SIGTERM)
                time.sleep(0.5)
                assert compute.is_running() and compute.status() != psutil.STATUS_ZOMBIE
            t0 = time.monotonic()
            if how == "SIGTERM to the group":
                os.killpg(proc.pid, signal.SIGTERM)
            else:
                proc.send_signal(getattr(signal, how))
            finals = {}
            while len(finals) < 2 and s.poll(2_000):
                m = msgpack.unpackb(s.recv())
                if m["type"] != "token":
                    finals[m["id"]] = m
            assert time.monotonic() - t0 < 2.0
            assert {i: (m["type"], m.get("code")) for i, m in finals.items()} == \
                {1: ("error", "shutting_down"), 2: ("error", "shutting_down")}
            assert proc.wait(timeout=30) == 0
        finally:
            s.close(0)
            ctx.term()
    text = log_path.read_text()
    assert "restarting" not in text and "died" not in text and "exited with code" not in text, text


@pytest.fixture(scope="module")
def preload_store(tmp_path_factory) -> Path:
    """8 layers x 32 experts: a preload of the whole model takes a good part of a second here."""
    from deltafin.tools import convert
    from deltafin.tools.synth import tiny
    root = tmp_path_factory.mktemp("preload")
    src = tiny("qwen3_moe", root / "hf", layers=8, experts=32, top_k=4, hidden=256, moe_intermediate=192)
    assert convert.main([str(src), str(root / "store"), "--no-progress"]) == 0
    return root / "store"


def test_a_stop_during_the_preload_ends_every_worker_cleanly(preload_store, tmp_path):
    """With the whole model in budget compute preloads experts once ready, a need at a time (and
    again between requests): a stop then finds it waiting for reads. Told first, while router
    and loader still serve it, it finishes that step and stops; none is killed at the grace's
    end (before, compute was, after 2 s)."""
    log_path = tmp_path / "supervisor.log"
    for _ in range(2):
        with open(log_path, "w+") as log, running_supervisor(str(preload_store), BIG, stderr=log) as (ep, proc):
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=30) == 0
        text = log_path.read_text()
        assert "did not stop" not in text and "killed" not in text, text


# -- unread replies -------------------------------------------------------------------------------
def _rss(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss


def test_a_client_that_never_reads_cannot_grow_the_supervisor(tiny_stores):
    """Each logits reply is 1,900 x 512 float32 (3.9 MB); 30 of them unread would be 117 MB in
    the supervisor's socket queue. Two may wait per connection, the rest are dropped and counted."""
    ids = [(7 * i + 3) % 500 + 1 for i in range(1900)]
    with running_supervisor(tiny_stores("mixtral"), BIG) as (ep, proc):
        with Client(ep, timeout=60) as c:
            assert c.logits(ids[:4]).shape[0] == 4  # warm: the supervisor has relayed one reply
            before = _rss(proc.pid)
            ctx, s = _dealer(ep, RCVHWM=1, RCVBUF=4096)  # its own queue holds almost nothing
            try:
                for rid in range(30):
                    while c.stats()["active_requests"] >= 4:  # never queue_full: each one is computed
                        time.sleep(0.05)
                    s.send(msgpack.packb({"type": "logits", "id": rid, "token_ids": ids}))
                deadline = time.monotonic() + 60
                while c.stats()["active_requests"] and time.monotonic() < deadline:
                    time.sleep(0.2)
                st = c.stats()
                grown = _rss(proc.pid) - before
                assert st["replies_dropped"]["unread"] >= 24, st["replies_dropped"]
                assert grown < 40 * 2**20, f"supervisor grew {grown >> 20} MiB"
                assert c.logits(ids[:4]).shape[0] == 4  # the reader is served meanwhile
            finally:
                s.close(0)
                ctx.term()


# -- sampling -------------------------------------------------------------------------------------
def test_a_temperature_below_the_floor_is_greedy():
    import mlx.core as mx
    import numpy as np

    from deltafin.workers.scheduler import sample_on_device
    # logits of a real model's size: divided by 1e-38 in float32, most of them overflow to inf
    logits = mx.array(np.linspace(0, 20, 512, dtype=np.float32)[None, :] + 25 * np.eye(1, 512, 7, dtype=np.float32))
    for t in (1e-38, 1e-20, 1e-6):
        drawn = {int(sample_on_device(logits, M.Generate(id=0, prompt="x", temperature=t), mx.random.key(s)).item()) for s in range(32)}
        assert drawn == {7}, (t, drawn)
    assert M.greedy(0.0) and M.greedy(M.GREEDY_BELOW_TEMPERATURE / 2)
    assert not M.greedy(M.GREEDY_BELOW_TEMPERATURE)


# -- configuration --------------------------------------------------------------------------------
@pytest.mark.parametrize("text,why", [
    ("[compute]\nmax_batch = true\n", "compute.max_batch must be int"),
    ("[compute]\nexpert_timeout_s = true\n", "compute.expert_timeout_s must be float"),
    ("[compute]\nexpert_timeout_s = -1.0\n", "compute.expert_timeout_s must be > 0"),
    ("[runtime]\nstartup_timeout_s = nan\n", "runtime.startup_timeout_s must be a finite number"),
    ("[runtime]\ncontrol_timeout_s = 0\n", "runtime.control_timeout_s must be > 0"),
    ("[runtime]\nrestart_window_s = nan\n", "runtime.restart_window_s must be a finite number"),
    ("[distributed]\ntimeout_s = inf\n", "distributed.timeout_s must be a finite number"),
    ("[bench]\nahead_depth = 0\n", "bench.ahead_depth must be >= 1"),
    ("[bench]\nahead_waste = 0\n", "bench.ahead_waste must be > 0"),
    ("[bench]\nspin_ms = -1.0\n", "bench.spin_ms must be >= 0"),
    ("[bench]\nspin_ms = \"fast\"\n", "bench.spin_ms must be >= 0"),
    ("[bench]\nahead_reads = -1\n", "bench.ahead_reads must be >= 0"),
    ("[bench]\nahead_piece_bytes = -1\n", "bench.ahead_piece_bytes must be >= 0"),
    ("[bench]\ndemand_pieces = 0\n", "bench.demand_pieces must be >= 1"),
])
def test_config_values_of_the_wrong_kind_are_refused(tmp_path, text, why):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=why.replace(".", r"\.")):
        load_config(path)


def test_a_config_file_that_is_not_utf8_is_a_config_error(tmp_path):
    path = tmp_path / "latin1.toml"
    path.write_bytes("[runtime]\nendpoint = \"caf\xe9\"\n".encode("latin-1"))
    with pytest.raises(ConfigError, match="latin1.toml"):
        load_config(path)


# -- shared memory --------------------------------------------------------------------------------
def test_a_shared_memory_filesystem_without_room_is_refused_naming_the_numbers(tmp_path, monkeypatch):
    tmpfs = os.statvfs_result((4096, 4096, 2560, 256, 256, 0, 0, 0, 0, 255))  # 10 MiB, 1 MiB free
    monkeypatch.setattr(os, "statvfs", lambda path: tmpfs)
    run = shm.RunDir(tmp_path / "runs")
    try:
        with pytest.raises(shm.SharedMemoryFull, match=r"needs 64\.00 MiB .* has 1\.00 MiB free of 10\.00 MiB"):
            run.create_segment("staging1", 64 << 20)
        seg = run.create_segment("staging2", 512 << 10)  # what fits is made
        seg.close()
    finally:
        run.cleanup()


# -- huge, deep and out-of-range messages ---------------------------------------------------------
def _nested(depth: int):
    out = 1
    for _ in range(depth):
        out = [out]
    return out


def test_huge_deep_and_unknown_messages_are_refused_at_once_echoing_nothing(tiny_stores):
    """Each is answered `bad_message` within 2 s in under 2 KiB, while another client's health
    is answered within 1 s (a 2^20-key map used to stall the loop 4-5 s and echo 11 MB)."""
    raws = {"2^20 keys": msgpack.packb({"type": "generate", "id": 1,
                                                **{f"k{i}": i for i in range(1 << 20)}}),
            "6 MB of unknown names": msgpack.packb({"type": "generate", "id": 1,
                                                    **{"x" * 100_000 + str(i): 0 for i in range(60)}}),
            "a 5 MB type name": msgpack.packb({"type": "y" * 5_000_000, "id": 1}),
            "100k-deep msgpack": b"\x91" * 100_000 + b"\x01",
            "a 20-deep request": msgpack.packb({"type": "generate", "id": 1, "max_tokens": 1,
                                                "messages": _nested(20)})}
    with running_supervisor(tiny_stores("mixtral"), BIG) as (ep, _):
        with Client(ep, timeout=60) as c:
            ctx, s = _dealer(ep)
            try:
                for name, raw in raws.items():
                    t0 = time.monotonic()
                    s.send(raw)
                    assert c.health()["ok"]
                    health_s = time.monotonic() - t0
                    assert s.poll(2_000), name
                    reply = s.recv()
                    m = msgpack.unpackb(reply)
                    assert (m["type"], m["code"]) == ("error", "bad_message"), (name, m)
                    assert len(reply) < 2048 and time.monotonic() - t0 < 2.0, (name, len(reply))
                    assert health_s < 1.0, (name, health_s)
                    if "deep" in name:
                        assert "deeper than" in m["message"], m
                # an integer msgpack cannot carry is the client's typed error; the largest it can
                # carry is served
                with pytest.raises(RequestError, match="cannot encode") as e:
                    c.generate([1, 2, 3], max_tokens=2, seed=2**64)
                assert e.value.code == "bad_request"
                s.send(msgpack.packb({"type": "generate", "id": 9, "token_ids": [1, 2, 3],
                                      "max_tokens": 2, "temperature": 1.0, "seed": 2**64 - 1}))
                while True:
                    assert s.poll(30_000)
                    m = msgpack.unpackb(s.recv())
                    if m["type"] != "token":
                        break
                assert m["type"] == "done", m
            finally:
                s.close(0)
                ctx.term()


# -- socket paths ---------------------------------------------------------------------------------
def test_socket_paths_over_the_os_limit_are_refused_clearly(tiny_stores, tmp_path):
    assert ipc_path_max("linux") == 107 and ipc_path_max("darwin") == 103
    check_ipc_length("/" + "a" * 106, "linux")
    with pytest.raises(SecurityError, match="107 bytes; this OS takes at most 103"):
        check_ipc_length("/" + "a" * 106, "darwin")
    # a run root whose sockets would not fit: an error naming it at start, not a ZMQError
    root = tmp_path / ("r" * max(1, 100 - len(str(tmp_path))))
    r = subprocess.run([sys.executable, "-m", "deltafin.workers.supervisor", "--model",
                        str(tiny_stores("mixtral")), "--memory-budget", BIG], capture_output=True,
                       text=True, timeout=120, env={**os.environ, "DELTAFIN_RUN_ROOT": str(root)})
    assert r.returncode == 2 and "this OS takes at most" in r.stderr and "ZMQError" not in r.stderr, r.stderr
    assert "DELTAFIN_RUN_ROOT" in r.stderr
    # a user-given endpoint likewise
    private = tmp_path / "p"
    private.mkdir(mode=0o700)
    with pytest.raises(SecurityError, match="this OS takes at most"):
        check_endpoint(f"ipc://{private}/{'s' * 120}.ipc", allow_remote=False)


# -- fair share -----------------------------------------------------------------------------------
def _final(s, rid: int, timeout_ms: int = 60_000) -> dict:
    """The next message for rid on DEALER s other than a token (None: none within timeout_ms)."""
    while s.poll(timeout_ms):
        m = msgpack.unpackb(s.recv())
        if m["id"] == rid and m["type"] != "token":
            return m
    return None


def test_a_flooding_client_leaves_room_for_another(tiny_stores, tmp_path):
    """max_batch 1 + max_queue 3: a client alone fills all 4 places; another client is still
    admitted (its fair share is 2), and the flooder gets no more while the other waits."""
    generate = lambda rid, n: msgpack.packb({"type": "generate", "id": rid, "token_ids": [1, 2, 3],
                                             "max_tokens": n})
    flags = config_flags(tmp_path, compute={"max_batch": 1, "max_queue": 3, "max_context": 4096})
    with running_supervisor(tiny_stores("mixtral"), BIG, flags) as (ep, _), Client(ep, timeout=60) as c:
        (ca, a), (cb, b) = _dealer(ep), _dealer(ep)
        try:
            for rid in range(4):
                a.send(generate(rid, 3000))
            a.send(generate(4, 3000))
            assert _final(a, 4, 10_000)["code"] == "queue_full"  # the bound, alone
            b.send(generate(1, 2))
            assert not b.poll(1_000) or msgpack.unpackb(b.recv())["type"] == "token"  # admitted
            assert c.stats()["active_requests"] == 5
            a.send(generate(5, 3000))
            refused = _final(a, 5, 10_000)
            assert refused["code"] == "queue_full" and "one holds at most 2" in refused["message"]
            for rid in range(4):
                a.send(msgpack.packb({"type": "cancel", "id": rid}))
            assert _final(b, 1)["type"] == "done"
        finally:
            for ctx, s in ((ca, a), (cb, b)):
                s.close(0)
                ctx.term()
