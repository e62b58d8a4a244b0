"""Who may talk to a runtime (docs/SECURITY.md): ipc endpoints only in private directories and
never over an existing path, the socket file gone after a stop (and after a kill, at the next
start), tcp loopback unless --allow-remote, and then CURVE with the supervisor's keys: only
clients whose public key is allowed in get an answer. No pickle in the code."""
from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import zmq

from deltafin.client import Client, RuntimeUnavailable
from deltafin.runtime.security import KeyDir, SecurityError, check_endpoint
from deltafin.tools.run import running_supervisor

BIG = "4GiB"
ROOT = Path(__file__).resolve().parents[1]


def _start(store, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deltafin.workers.supervisor", "--model", str(store),
                           "--memory-budget", BIG, *args], capture_output=True, text=True, timeout=120)


@pytest.fixture
def private(tmp_path):
    d = tmp_path / "private"
    d.mkdir(mode=0o700)
    return d


def test_ipc_endpoint_in_an_open_directory_is_refused(tiny_stores, tmp_path):
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o755)
    r = _start(tiny_stores("mixtral"), "--endpoint", f"ipc://{open_dir}/rt.ipc")
    assert r.returncode == 2 and "open to other users" in r.stderr and "READY" not in r.stdout
    assert not (open_dir / "rt.ipc").exists()


def test_an_existing_path_is_never_replaced(tiny_stores, private):
    precious = private / "notes.txt"
    precious.write_text("keep me")
    r = _start(tiny_stores("mixtral"), "--endpoint", f"ipc://{precious}")
    assert r.returncode == 2 and "already exists as a file" in r.stderr
    assert precious.read_text() == "keep me"
    # a socket another runtime serves is not taken over either
    endpoint = f"ipc://{private}/rt.ipc"
    with running_supervisor(tiny_stores("mixtral"), BIG, ["--endpoint", endpoint]) as (ep, _):
        r = _start(tiny_stores("mixtral"), "--endpoint", endpoint)
        assert r.returncode == 2 and "already exists as a socket" in r.stderr
        with Client(ep, timeout=60) as c:  # the first runtime still serves it
            assert c.health()["ok"]
    assert not (private / "rt.ipc").exists()  # removed at a clean stop


def test_socket_file_of_a_killed_runtime_is_swept_by_the_next_start(tiny_stores, private):
    endpoint = f"ipc://{private}/rt.ipc"
    with running_supervisor(tiny_stores("mixtral"), BIG, ["--endpoint", endpoint]) as (ep, proc):
        kids = psutil.Process(proc.pid).children()
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        psutil.wait_procs(kids, timeout=10)
    assert stat.S_ISSOCK(os.lstat(private / "rt.ipc").st_mode)  # SIGKILL skips every cleanup
    with running_supervisor(tiny_stores("mixtral"), BIG, ["--endpoint", endpoint]) as (ep, _):
        with Client(ep, timeout=60) as c:
            assert len(c.generate([1, 2, 3], max_tokens=2).token_ids) == 2
    assert not (private / "rt.ipc").exists()


def test_endpoint_checks():
    for bad in ("tcp://0.0.0.0:5000", "tcp://*:5000", "tcp://10.1.2.3:80"):
        with pytest.raises(SecurityError, match="--allow-remote"):
            check_endpoint(bad, allow_remote=False)
        check_endpoint(bad, allow_remote=True)
    for ok in ("tcp://127.0.0.1:0", "tcp://localhost:5000", "tcp://[::1]:5000"):
        check_endpoint(ok, allow_remote=False)
    with pytest.raises(SecurityError, match="must start with"):
        check_endpoint("inproc://x", allow_remote=False)
    with pytest.raises(SecurityError, match="does not exist"):
        check_endpoint("ipc:///nonexistent-dir-of-deltafin/x.ipc", allow_remote=False)


def _keys_config(tmp_path, keys: Path) -> list[str]:
    cfg = tmp_path / "remote.toml"
    cfg.write_text(f'[runtime]\nkeys_dir = "{keys}"\n')
    return ["--config", str(cfg)]


def test_remote_tcp_requires_curve_keys(tiny_stores, tmp_path):
    keys = tmp_path / "keys"
    extra = ["--endpoint", "tcp://127.0.0.1:0", "--allow-remote", *_keys_config(tmp_path, keys)]
    with running_supervisor(tiny_stores("mixtral"), BIG, extra) as (ep, _):
        # the supervisor made its key pair and one client key pair, private to this user
        assert stat.S_IMODE(os.stat(keys).st_mode) == 0o700
        for secret in ("server.key_secret", "client.key_secret"):
            assert stat.S_IMODE(os.stat(keys / secret).st_mode) == 0o600
        assert (keys / "clients" / "client.key").exists()
        with Client(ep, timeout=60, keys=keys) as c:  # server.key + client.key_secret
            assert len(c.generate([1, 2, 3], max_tokens=3).token_ids) == 3
        # no keys: the handshake never completes, nothing is answered
        with pytest.raises(RuntimeUnavailable):
            Client(ep, timeout=2)
        # a key pair the server does not know: refused by the authenticator
        stranger = tmp_path / "stranger"
        stranger.mkdir(mode=0o700)
        KeyDir(stranger).ensure()
        (stranger / "server.key").unlink()
        (stranger / "server.key").write_bytes((keys / "server.key").read_bytes())
        (stranger / "server.key_secret").unlink()
        with pytest.raises(RuntimeUnavailable):
            Client(ep, timeout=2, keys=stranger)
        # plain zmq without CURVE gets nothing either
        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(ep)
        s.send(b"\x81\xa4type\xa5hello")
        assert not s.poll(1000)
        s.close(0)
        ctx.term()


def test_deltafin_keys_adds_a_client_that_gets_in(tiny_stores, tmp_path):
    keys = tmp_path / "keys"
    r = subprocess.run([sys.executable, "-m", "deltafin.runtime.security", "--dir", str(keys),
                        "add-client", "laptop"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert (keys / "clients" / "laptop.key").exists()
    handed = tmp_path / "laptop"  # what the remote user receives: their secret + server.key
    handed.mkdir(mode=0o700)
    (handed / "laptop.key_secret").write_bytes((keys / "laptop.key_secret").read_bytes())
    (handed / "server.key").write_bytes((keys / "server.key").read_bytes())
    extra = ["--endpoint", "tcp://127.0.0.1:0", "--allow-remote", *_keys_config(tmp_path, keys)]
    with running_supervisor(tiny_stores("mixtral"), BIG, extra) as (ep, _):
        with Client(ep, timeout=60, keys=handed) as c:
            assert c.health()["ok"]


def test_no_pickle_anywhere():
    """No module deserializes with pickle (or marshal/shelve), and numpy loads refuse pickles."""
    offenders = []
    # the project's own folders only: a venv or build tree inside the checkout is not ours
    paths = [p for folder in ("runtime", "workers", "protocol", "tools", "configs", "tests")
             for p in (ROOT / folder).rglob("*.py")]
    assert len(paths) > 40
    for path in paths:
        if path.name == "test_security.py":
            continue
        text = path.read_text()
        if re.search(r"^\s*(import|from)\s+(pickle|cPickle|dill|cloudpickle|marshal|shelve)\b", text, re.M) \
                or re.search(r"recv_pyobj|send_pyobj|allow_pickle\s*=\s*True", text):
            offenders.append(str(path.relative_to(ROOT)))
        for call in re.finditer(r"np\.load\(([^)]*)\)", text):
            if "allow_pickle=False" not in call.group(1):
                offenders.append(f"{path.relative_to(ROOT)}: {call.group(0)}")
    assert offenders == []
