"""Experts sharded across two ranks on this machine: two supervisor trees, each with its own
budget, shared memory and workers, whose compute processes form one mx.distributed group over the
ring backend on loopback (what `mlx.launch -n 2 --backend ring` sets up: MLX_RANK and a hostfile
in MLX_HOSTFILE). Checked against one supervisor tree running alone: the same greedy tokens and
bit-identical logits, each rank's loader reading only its share, and a rank that dies or hangs
failing the request in flight with `rank_lost` naming it. conftest checks that no process and
no segment is left after each test."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import numpy as np
import psutil
import pytest

from deltafin.client import Client, RequestError, RuntimeDeadError
from deltafin.runtime.store import Store
from deltafin.tools.run import StartError, _await_ready, reap, running_supervisor
from conftest import worker_process

mx = pytest.importorskip("mlx.core")

BUDGET = "2GiB"
PROMPT = [(13 * i + 5) % 500 + 1 for i in range(40)]  # 80 (token, expert) pairs: the sorted kernels


def _ring_available() -> bool:
    if not mx.distributed.is_available():
        return False
    try:
        import mlx._distributed_utils.launch  # noqa: F401  (mlx.launch, which sets up the ring)
    except ImportError:
        return False
    return True


pytestmark = pytest.mark.skipif(not _ring_available(), reason="mx.distributed / mlx.launch ring unavailable")


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _free_pair() -> int:
    """A port p with p + 1 free too (mlx.launch's ring listens on consecutive ports)."""
    for _ in range(50):
        p = _free_ports(1)[0]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", p + 1))
            return p
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports")


def _config(tmp: Path, text: str) -> str:
    path = tmp / f"cfg-{abs(hash(text))}.toml"
    path.write_text(text)
    return str(path)


@contextmanager
def ranks(store, tmp: Path, n: int = 2, extra: list[str] | None = None, per_rank: dict | None = None):
    """n supervisor trees started as mlx.launch starts them (MLX_RANK, MLX_HOSTFILE), with
    --distributed (and per_rank[r]'s flags on rank r); yields [(endpoint, process, log path)] in
    rank order."""
    ports = _free_ports(n)
    hostfile = tmp / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ports]))
    procs, logs = [], []
    try:
        for r in range(n):
            log = open(tmp / f"rank{r}.log", "w+")
            logs.append(log)
            env = {**os.environ, "MLX_RANK": str(r), "MLX_HOSTFILE": str(hostfile)}
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "deltafin.workers.supervisor", "--model", str(store),
                 "--memory-budget", BUDGET, "--distributed", *(extra or []), *(per_rank or {}).get(r, [])],
                stdout=subprocess.PIPE, stderr=log, text=True, env=env))
        try:
            eps = [_await_ready(p, 180) for p in procs]
        except StartError as e:
            raise StartError(f"{e}: " + " | ".join(Path(l.name).read_text() for l in logs)) from None
        yield [(ep, p, Path(l.name)) for ep, p, l in zip(eps, procs, logs)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in procs:
            reap(p, 20)
        for log in logs:
            log.close()


def _single(store, extra: list[str] | None = None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_")}
    assert env == dict(os.environ), "the test process must not run inside mlx.launch"
    return running_supervisor(store, BUDGET, extra)


def _compute_pid(sup: subprocess.Popen) -> int:
    return worker_process(sup.pid, "compute").pid


def _loader_bytes(client: Client, want: int | None = None, timeout_s: float = 60.0) -> int:
    """Bytes the tree's loader read; with want: polled until it reads that much (the preload
    runs while idle) or the deadline passes, then whatever it read."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = int(client.stats()["workers"]["loader"].get("bytes", 0))  # none before the first read
        if want is None or got == want or time.monotonic() > deadline:
            return got
        time.sleep(0.1)


def _settled_loader_bytes(client: Client, quiet_s: float = 1.5, timeout_s: float = 60.0) -> int:
    """Bytes the tree's loader read, once the figure has not changed for quiet_s: a rank that
    did not serve the request itself answers stats from its latest published snapshot, which
    can lag its last reads (more so on a busy machine)."""
    deadline = time.monotonic() + timeout_s
    last, since = _loader_bytes(client), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.1)
        got = _loader_bytes(client)
        if got != last:
            last, since = got, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            break
    return last


# -- the share, no processes ---------------------------------------------------------------------------
def test_share_modulo_and_balanced(tiny_stores):
    from deltafin.workers.distributed import ExpertShare
    store = Store(tiny_stores("qwen3_moe"))
    shares = [ExpertShare.modulo(store, r, 3) for r in range(3)]
    for layer in store.moe_layers:
        owned = [set(s.mine(layer)) for s in shares]
        assert set().union(*owned) == set(range(store.n_experts))
        assert sum(map(len, owned)) == store.n_experts  # disjoint
        assert owned[1] == {e for e in range(store.n_experts) if e % 3 == 1}
    # balanced: per layer, the most used first, each to the least loaded rank
    counts = np.zeros((len(store.moe_layers), store.n_experts), dtype=np.int64)
    counts[:, 0], counts[:, 1], counts[:, 2], counts[:, 3] = 100, 60, 50, 10
    b = [ExpertShare.balanced(store, r, 2, counts) for r in range(2)]
    layer = store.moe_layers[0]
    assert b[0].mine(layer)[:1] == [0] and {1, 2} <= set(b[1].mine(layer))  # 100 | 60 + 50
    load = [counts[0, b[r].mine(layer)].sum() for r in range(2)]
    assert load == [110, 110]


# -- the forecast's arithmetic -------------------------------------------------------------------------
def test_forecast_hosts_arithmetic():
    """One host: the same price as the single-host forecast. Two hosts: each rank's misses come
    from its share only, the slower rank sets each layer, plus the ring exchanges."""
    from deltafin.tools.forecast import Shape, forecast, forecast_hosts, ring_all_sum_s, share_steps
    shape = Shape("toy", n_moe=2, n_dense=0, n_experts=4, top_k=2, record_bytes=1_000_000)
    ids = np.array([[[0, 1], [2, 3]], [[0, 2], [1, 3]], [[0, 1], [2, 3]]], dtype=np.uint8)
    gbps = {1: 1.0, 2: 2.0}
    one = share_steps(shape, ids, 8, "lru", 1)
    assert one.shape == (1, 3, 2) and one[0].tolist() == [[2, 2], [1, 1], [0, 0]]
    f1 = forecast_hosts(shape, one, 0.01, 1e-4, 1e-3, gbps, 2, 1, 40.0, 50e-6, 16)
    assert f1["s_per_token"] == pytest.approx(forecast(shape, one[0], 0.01, 1e-4, 1e-3, gbps, 2)["s_per_token"])
    two = share_steps(shape, ids, 8, "lru", 2)  # rank 0 owns 0 and 2, rank 1 owns 1 and 3
    assert two[0].tolist() == [[1, 1], [1, 0], [0, 0]] and two[1].tolist() == [[1, 1], [0, 1], [0, 0]]
    f2 = forecast_hosts(shape, two, 0.01, 1e-4, 1e-3, gbps, 2, 2, 40.0, 50e-6, 16)
    layer = 1e6 / 1e9 + 2e-4 + 1e-3  # one miss: a read at queue depth 1, two hops, one fill
    ring = 2 * 50e-6 + (2 * 1 / 2) * 64 * 8 / 40e9  # 2(N-1) steps + 2(N-1)/N x 64 B at 40 Gb/s
    assert ring_all_sum_s(64, 2, 40.0, 50e-6) == pytest.approx(ring)
    exchange = 2 * ring_all_sum_s(64, 2, 40.0, 50e-6) + ring_all_sum_s(8, 2, 40.0, 50e-6)
    assert f2["s_per_token"] == pytest.approx(0.01 + (2 * layer + 2 * layer + 0) / 3 + exchange)
    assert f2["exchange_bytes"] == 64 and f2["exchanges_per_token"] == 3


# -- exactness ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch,max_slots", [("qwen3_moe", 0), ("qwen3_moe", 3), ("qwen3_5_moe", 3)],
                         ids=["share-resident", "3-slots-per-rank", "hybrid-3-slots-per-rank"])
def test_two_ranks_equal_one_host(tiny_stores, tmp_path, arch, max_slots):
    """Greedy tokens equal and logits bit-identical: every (token, k) output is computed by one
    rank exactly as on one host and summed with zeros. 3 slots per rank: its share of a layer
    (4 experts) does not fit, so the prefill goes in chunks and decoding misses. The hybrid's
    linear layers are dense, so every rank keeps every sequence's recurrent state (replicated)."""
    store = tiny_stores(arch)
    extra = ["--max-slots", str(max_slots)] if max_slots else []
    with _single(store, extra) as (ep, _):
        with Client(ep, timeout=60) as c:
            want = c.generate(PROMPT, max_tokens=24).token_ids
            want_logits = c.logits(PROMPT[:20])
    with ranks(store, tmp_path, 2, extra) as rs:
        with Client(rs[0][0], timeout=60) as c:
            got = c.generate(PROMPT, max_tokens=24).token_ids
            got_logits = c.logits(PROMPT[:20])
            # a cancel on rank 0 stops every rank at the same token; they serve on in step
            stream = c.stream(PROMPT, max_tokens=1500)
            next(iter(stream))
            stream.cancel()
            for _ in stream:
                pass
            assert stream.result.finish_reason == "cancelled"
            assert c.generate(PROMPT, max_tokens=24).token_ids == want
            dist = c.stats()["workers"]["compute"]["distributed"]
        with Client(rs[1][0], timeout=60) as c:  # a follower takes no requests of its own
            with pytest.raises(RequestError) as e:
                c.generate(PROMPT, max_tokens=2)
            assert e.value.code == "not_leader"
    assert got == want
    assert np.abs(got_logits - want_logits).max() <= 1e-3 * np.abs(want_logits).max()
    assert np.array_equal(got_logits, want_logits)  # exact, not only within the bound
    assert dist["rank"] == 0 and dist["size"] == 2 and dist["exchanges"] > 0


# -- each rank reads its share -------------------------------------------------------------------------------
def test_each_rank_reads_its_share(tiny_stores, tmp_path):
    """At the same per-host budget (every expert fits): one host preloads every expert, each of
    two ranks exactly its half; without preload, each rank reads only the experts of its share
    that were used, and the two together read what one host reads."""
    store = tiny_stores("qwen3_moe")
    st = Store(store)
    record = st.layout(st.moe_layers[0])["nbytes"]
    full = record * st.n_experts * len(st.moe_layers)
    no_preload = ["--config", _config(tmp_path, "[cache]\npreload = false\n")]
    with _single(store) as (ep, _):
        with Client(ep, timeout=60) as c:
            one_preload = _loader_bytes(c, full)
    with _single(store, no_preload) as (ep, _):
        with Client(ep, timeout=60) as c:
            c.generate(PROMPT, max_tokens=8)
            one_demand = _settled_loader_bytes(c)
    with ranks(store, tmp_path, 2) as rs:
        per_rank = []
        for ep, _, _ in rs:
            with Client(ep, timeout=60) as c:
                per_rank.append(_loader_bytes(c, full // 2))
    assert one_preload == full
    assert per_rank == [one_preload // 2, one_preload // 2]
    with ranks(store, tmp_path, 2, no_preload) as rs:
        with Client(rs[0][0], timeout=60) as c:
            c.generate(PROMPT, max_tokens=8)
        demand = []
        for ep, _, _ in rs:
            with Client(ep, timeout=60) as c:
                s = c.stats()
                demand.append(_settled_loader_bytes(c))
                # the router's tables only ever held this rank's experts (e % 2 == rank)
                assert s["workers"]["compute"]["distributed"]["rank"] == len(demand) - 1
    assert sum(demand) == one_demand
    assert all(0 < b < one_demand for b in demand)


# -- faults ---------------------------------------------------------------------------------------------
def _in_flight(client: Client):
    stream = client.stream(PROMPT, max_tokens=1500)
    next(iter(stream))  # a token arrived: the request runs on both ranks
    return stream


@pytest.mark.parametrize("how", ["killed", "hung"])
def test_lost_rank_fails_the_request(tiny_stores, tmp_path, how):
    """Rank 1's compute stops (SIGSTOP) mid-request; then it is killed (the ring sees the closed
    peer), or left hanging (rank 0's watchdog gives up after distributed.timeout_s=3). Either way
    the request in flight fails with `rank_lost` naming rank 1 well within the client's 20 s,
    and both trees restart their workers, rejoin the group and serve the same tokens again."""
    store = tiny_stores("qwen3_moe")
    cfg = ["--config", _config(tmp_path, "[distributed]\ntimeout_s = 3\n[compute]\nmax_context = 2048\n")]
    with _single(store) as (ep, _):
        with Client(ep, timeout=60) as c:
            want = c.generate(PROMPT[:8], max_tokens=8).token_ids
    with ranks(store, tmp_path, 2, cfg) as rs:
        victim = psutil.Process(_compute_pid(rs[1][1]))
        with Client(rs[0][0], timeout=20) as c:
            stream = _in_flight(c)
            victim.send_signal(signal.SIGSTOP)
            if how == "killed":
                victim.kill()
            with pytest.raises(RuntimeDeadError) as e:
                for _ in stream:
                    pass
            if how == "hung":
                victim.kill()
        assert e.value.code == "rank_lost", e.value
        assert "peer rank(s) [1]" in str(e.value)
        with Client(rs[0][0], timeout=120) as c:
            c.wait_until_serving(120)
            assert c.generate(PROMPT[:8], max_tokens=8).token_ids == want
        assert "distributed group lost" in rs[0][2].read_text()


# -- as a user starts it -------------------------------------------------------------------------------
def test_mlx_launch_two_ranks(tiny_stores, tmp_path):
    """docs/DISTRIBUTED.md's command on one machine: `mlx.launch -n 2 --backend ring --
    deltafin-supervisor --distributed --endpoint tcp://...` (one command line; rank 0 takes the
    endpoint), then a client of rank 0; Ctrl-C (SIGINT to the launch's process group) stops all."""
    store = tiny_stores("qwen3_moe")
    with _single(store) as (ep, _):
        with Client(ep, timeout=60) as c:
            want = c.generate(PROMPT, max_tokens=16).token_ids
    launcher = Path(sys.executable).with_name("mlx.launch")
    if not launcher.exists():
        pytest.skip("mlx.launch is not installed next to this python")
    port, ring_port = _free_ports(1)[0], _free_pair()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_")}
    log = open(tmp_path / "launch.log", "w+")
    proc = subprocess.Popen([str(launcher), "-n", "2", "--backend", "ring", "--starting-port", str(ring_port),
                             "--", sys.executable, "-m", "deltafin.workers.supervisor", "--model", str(store),
                             "--memory-budget", BUDGET, "--distributed", "--endpoint", f"tcp://127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        from deltafin.client import wait_until_ready
        wait_until_ready(f"tcp://127.0.0.1:{port}", timeout=180).close()
        with Client(f"tcp://127.0.0.1:{port}", timeout=60) as c:
            got = c.generate(PROMPT, max_tokens=16).token_ids
            dist = c.stats()["workers"]["compute"]["distributed"]
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in the terminal does
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)
        log.close()
    assert got == want, (tmp_path / "launch.log").read_text()
    assert dist["size"] == 2 and dist["leader"]


def test_share_balanced_by_a_recorded_trace(tiny_stores, tmp_path):
    """--balance-trace: the routing one host recorded deals the experts out by use; the two
    ranks still give the single-host tokens, and each reads only what it owns."""
    from deltafin.runtime.traces import load_trace
    from deltafin.workers.distributed import ExpertShare
    store = tiny_stores("qwen3_moe")
    trace = tmp_path / "routing.npz"
    with _single(store, ["--record-trace", str(trace)]) as (ep, _):
        with Client(ep, timeout=60) as c:
            want = c.generate(PROMPT, max_tokens=16).token_ids
    st = Store(store)
    shares = [ExpertShare.from_trace(st, r, 2, trace) for r in range(2)]
    modulo = ExpertShare.modulo(st, 0, 2)
    assert any(shares[0].mine(l) != modulo.mine(l) for l in st.moe_layers)  # a different deal
    ids = load_trace(trace).ids
    for i, layer in enumerate(st.moe_layers):  # within one most-used expert's uses of even
        uses = np.bincount(ids[:, i].reshape(-1), minlength=st.n_experts)
        load = [int(uses[s.mine(layer)].sum()) for s in shares]
        assert abs(load[0] - load[1]) <= uses.max()
    with ranks(store, tmp_path, 2, ["--balance-trace", str(trace)]) as rs:
        with Client(rs[0][0], timeout=60) as c:
            got = c.generate(PROMPT, max_tokens=16).token_ids
        record = st.layout(st.moe_layers[0])["nbytes"]
        owned = [record * sum(len(s.mine(l)) for l in st.moe_layers) for s in shares]
        read = []
        for (ep, _, _), want_bytes in zip(rs, owned):
            with Client(ep, timeout=60) as c:
                read.append(_loader_bytes(c, want_bytes))  # the preload of its share
                share = c.stats()["workers"]["compute"]["distributed"]["share"]
                assert share == shares[0].digest() != modulo.digest()
        logs = [log.read_text() for _, _, log in rs]
    assert got == want
    assert read == owned
    assert all("balanced by" in text for text in logs)


def test_ranks_that_route_differently_stop(tiny_stores, tmp_path):
    """Ranks whose routing differs (here rank 1 routes from a trace, as if its hardware rounded
    differently) would sum the wrong experts: the between-tokens digest catches it, rank 1
    stops saying so, and rank 0's request fails with `rank_lost` instead of wrong tokens."""
    store = tiny_stores("qwen3_moe")
    trace = tmp_path / "other.npz"
    with _single(store, ["--record-trace", str(trace)]) as (ep, _):
        with Client(ep, timeout=60) as c:
            c.generate(PROMPT[::-1], max_tokens=8)  # another prompt: other routing
    with ranks(store, tmp_path, 2, per_rank={1: ["--routing-trace", str(trace)]}) as rs:
        with Client(rs[0][0], timeout=30) as c:
            with pytest.raises(RuntimeDeadError) as e:
                c.generate(PROMPT, max_tokens=8)
        assert e.value.code == "rank_lost"
        assert "routing diverged from rank 0's" in rs[1][2].read_text()
