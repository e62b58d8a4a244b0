"""The runtime as users run it: real supervisor, router, loader and compute processes, ipc sockets,
POSIX shared memory. After every test the conftest asserts nothing is left behind."""
from __future__ import annotations

import json
import signal
import subprocess
import sys

import mlx.core as mx
import numpy as np
import psutil
import pytest
import zmq

from conftest import ARCHS, deltafin_processes, deltafin_segments, config_flags, worker_process
from deltafin.client import Client, RequestError, RuntimeDeadError, RuntimeUnavailable
from deltafin.protocol import messages as M
from deltafin.runtime.store import Store
from deltafin.tools.run import StartError, running_supervisor

BIG = "4GiB"


@pytest.mark.parametrize("arch", ARCHS)
def test_generation_on_every_architecture(tiny_stores, arch):
    store = tiny_stores(arch)
    with running_supervisor(store, BIG) as (endpoint, proc):
        with Client(endpoint, timeout=60) as c:
            assert c.info.architecture == arch
            pieces = list(c.stream("hello there", max_tokens=6))
            gen = c.last
            assert gen.finish_reason in ("length", "stop")
            assert len(gen.token_ids) == 6 or gen.finish_reason == "stop"
            assert "".join(pieces) == gen.text
            # supervisor + router + loader + compute, all separate processes (and the fork
            # server the workers are forked from)
            names = sorted(k.name() for k in psutil.Process(proc.pid).children())
            assert names == ["dfn-compute", "dfn-forkserver", "dfn-loader", "dfn-router"]
            stats = c.stats()
            assert stats["missing"] == []
            assert stats["hit_rate"] is not None
            assert stats["stage_latency"]["read"]["count"] > 0
            # each "auto" resolved once at start for this backend, and said so
            res = stats["resolved"]
            gpu = mx.default_device().type == mx.DeviceType.gpu
            assert res["backend"] == ("gpu" if gpu else "cpu") and res["dtype"]
            assert res["pipeline"]["early_fills"] is gpu and res["pipeline"]["eager_layers"] is gpu
            assert res["pipeline"]["hits_first"] is (not gpu) and isinstance(res["prefetch"], bool)
            assert res["spin_ms"] == (2.0 if gpu else 0.0)  # workers spin after a message on a GPU only


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_mlx_lm(mlx_lm_stores, arch):
    from mlx_lm.utils import load
    import mlx.core as mx
    qpath, store = mlx_lm_stores(arch)
    model, _ = load(str(qpath))
    ids = [1, 17, 42, 99, 3, 250, 7, 301, 64, 12, 5, 400]
    ref = np.array(model(mx.array([ids]))[0].astype(mx.float32))
    with running_supervisor(store, BIG) as (endpoint, _):
        with Client(endpoint, timeout=120) as c:
            got = c.logits(ids)
    assert got.shape == ref.shape and got.dtype == np.float32
    scale = np.abs(ref).max()
    assert np.abs(got - ref).max() <= 1e-3 * scale
    top2 = np.sort(ref, axis=-1)[:, -2:]
    sure = (top2[:, 1] - top2[:, 0]) > 1e-3
    assert (got.argmax(-1)[sure] == ref.argmax(-1)[sure]).all()


def test_greedy_tokens_identical_across_budgets(tmp_path):
    """DeepSeek-V3 shape with four MoE layers, so two layers' worth of slots is half the store."""
    from deltafin.tools import convert
    from deltafin.tools.synth import tiny
    src = tiny("deepseek_v3", tmp_path / "hf", layers=5, seed=11)
    store_path = tmp_path / "store"
    assert convert.main([str(src), str(store_path), "--no-progress"]) == 0
    store = Store(store_path)
    two_layers = 2 * store.n_experts
    assert two_layers < len(store.records)
    prompt = "the quick brown fox jumps over the lazy dog"
    results = {}
    for name, slots in (("all", 0), ("two_layers", two_layers), ("one_token", store.top_k)):
        with running_supervisor(store_path, BIG, config_flags(tmp_path, cache={"max_slots": slots})) as (ep, _):
            with Client(ep, timeout=60) as c:
                results[name] = (c.generate(prompt, max_tokens=16).token_ids, c.stats())
    assert results["all"][0] == results["two_layers"][0] == results["one_token"][0]
    # the small pools really were small, and really did evict and re-read
    assert results["all"][1]["memory"]["n_slots"] == len(store.records)
    assert results["two_layers"][1]["memory"]["n_slots"] == two_layers < len(store.records)
    assert results["one_token"][1]["memory"]["n_slots"] == store.top_k
    assert results["two_layers"][1]["workers"]["router"].get("evictions", 0) > 0
    assert results["one_token"][1]["workers"]["router"].get("evictions", 0) > 0
    assert results["all"][1]["workers"]["router"].get("evictions", 0) == 0


def test_greedy_tokens_identical_across_budgets_many_layers(tmp_path):
    """A deeper model where two layers' worth of slots is far less than the store."""
    from deltafin.tools import convert
    from deltafin.tools.synth import tiny
    src = tiny("qwen3_moe", tmp_path / "hf", layers=6, experts=16, top_k=4, seed=3)
    out = tmp_path / "store"
    assert convert.main([str(src), str(out), "--no-progress"]) == 0
    logits = {}
    for slots in (0, 32):
        with running_supervisor(out, BIG, config_flags(tmp_path, cache={"max_slots": slots})) as (ep, _):
            with Client(ep, timeout=60) as c:
                toks = c.generate([5, 9, 200, 31, 77], max_tokens=12).token_ids
                logits[slots] = (toks, c.logits([5, 9, 200, 31, 77] + toks))
    assert logits[0][0] == logits[32][0]
    np.testing.assert_array_equal(logits[0][1], logits[32][1])


def test_budget_below_minimum_is_refused(tiny_stores):
    r = subprocess.run([sys.executable, "-m", "deltafin.workers.supervisor", "--model",
                        str(tiny_stores("mixtral")), "--memory-budget", "64MiB"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "memory budget 64.00 MiB is below the minimum" in r.stderr
    assert "READY" not in r.stdout


def test_the_printed_minimum_budget_starts(tiny_stores):
    """The refusal's minimum is rounded up, so passing the printed figure back is enough."""
    import re
    store = str(tiny_stores("mixtral"))
    r = subprocess.run([sys.executable, "-m", "deltafin.workers.supervisor", "--model", store,
                        "--memory-budget", "64MiB"], capture_output=True, text=True, timeout=60)
    from deltafin.runtime.config import parse_size
    minimum = re.search(r"below the minimum ([0-9.]+ [KMG]iB)", r.stderr)[1]
    with running_supervisor(store, minimum.replace(" ", ""), stderr=subprocess.PIPE) as (ep, _):
        with Client(ep, timeout=60) as c:
            assert len(c.generate([1, 2, 3], max_tokens=2).token_ids) == 2
            assert c.stats()["memory"]["budget"] == parse_size(minimum)


def test_unknown_store_and_bad_flags_are_refused(tmp_path):
    r = subprocess.run([sys.executable, "-m", "deltafin.workers.supervisor", "--model", str(tmp_path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "not a deltafin store" in r.stderr
    with pytest.raises(StartError):
        with running_supervisor(tmp_path, BIG, stderr=subprocess.DEVNULL):
            pass


def test_remote_tcp_needs_allow_remote(tiny_stores):
    r = subprocess.run([sys.executable, "-m", "deltafin.workers.supervisor", "--model",
                        str(tiny_stores("mixtral")), "--memory-budget", BIG, "--endpoint", "tcp://0.0.0.0:5999"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--allow-remote" in r.stderr


def test_tcp_loopback_and_bad_messages(tiny_stores):
    with running_supervisor(tiny_stores("olmoe"), BIG, ["--endpoint", "tcp://127.0.0.1:0"]) as (ep, _):
        assert ep.startswith("tcp://127.0.0.1:")
        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(ep)
        try:
            for bad in (b"\xc1garbage", M.encode(M.Hello(id=1, version=99)),
                        b"\x81\xa4type\xa8generate"):
                s.send(bad)
                assert s.poll(10000)
                reply = M.decode(s.recv())
                assert isinstance(reply, M.Error)
                assert reply.code in ("bad_message", "version_mismatch")
        finally:
            s.close(0)
            ctx.term()
        with Client(ep, timeout=60) as c:  # still serving
            with pytest.raises(RequestError, match="max_context"):
                c.generate([1] * 10, max_tokens=100000)
            with pytest.raises(RequestError, match="token ids"):
                c.logits([10**9])
            assert len(c.generate("ok", max_tokens=3).token_ids) == 3
            assert c.health()["ok"]


def test_dead_worker_is_an_error_not_a_hang(tiny_stores, tmp_path):
    """Without restarts (restart_max = 0): the request fails with the typed error naming the
    role (RuntimeUnavailable would mean the client waited out its timeout), the runtime exits 1."""
    cfg = config_flags(tmp_path, runtime={"restart_max": 0})
    with running_supervisor(tiny_stores("mixtral"), BIG, cfg, stderr=subprocess.PIPE) as (ep, proc):
        compute = worker_process(proc.pid, "compute")
        with Client(ep, timeout=20) as c:
            c.generate("warm up", max_tokens=2)
            stream = c.stream("are you there", max_tokens=500)
            next(stream)  # compute is generating
            compute.send_signal(signal.SIGKILL)
            with pytest.raises(RuntimeDeadError, match="worker compute .* killed by SIGKILL"):
                list(stream)
        assert proc.wait(timeout=30) == 1
        err = proc.stderr.read()
    assert "worker compute" in err and "SIGKILL" in err and "restart_max = 0" in err


def test_sigkill_of_the_supervisor_leaves_nothing(tiny_stores):
    with running_supervisor(tiny_stores("qwen2_moe"), BIG) as (ep, proc):
        kids = psutil.Process(proc.pid).children()
        assert len(kids) == 4 and deltafin_segments()  # the workers and their fork server
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        gone, alive = psutil.wait_procs(kids, timeout=15)
        assert not alive
    # the segment of the killed run is swept by the next start
    leftover = deltafin_segments()
    assert leftover
    with running_supervisor(tiny_stores("qwen2_moe"), BIG) as (ep, proc):
        assert not set(leftover) & set(deltafin_segments())
    assert not deltafin_processes()


def test_sigterm_exits_zero(tiny_stores):
    with running_supervisor(tiny_stores("mixtral"), BIG) as (ep, proc):
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


def test_memory_budget_holds_for_the_tree(tiny_stores):
    """Peak PSS of the whole tree, sampled from outside every few milliseconds (not the
    supervisor's own once-a-second samples), over a 1,000-token generation."""
    from deltafin.tools.treesampler import TreeSampler
    budget = 600 * 2**20
    with running_supervisor(tiny_stores("deepseek_v2"), str(budget)) as (ep, proc):
        sampler = TreeSampler(proc.pid, interval=0.005).start()
        with Client(ep, timeout=60) as c:
            ids = c.generate([100, 200, 300, 400], max_tokens=1000).token_ids  # no EOS within 1,000
            c.generate("measure me " * 20, max_tokens=20)
            s = c.stats()
        seen = sampler.stop()
    print(f"{len(ids)} tokens; peak tree PSS {seen['peak_tree_pss_bytes'] / 2**20:.1f} MiB of "
          f"{budget / 2**20:.0f} MiB; {seen['samples']} samples, every {seen['mean_interval_ms']:.1f} ms")
    assert len(ids) == 1000
    assert s["memory"]["budget"] == budget
    assert seen["samples"] > 100
    assert 0 < seen["peak_tree_pss_bytes"] <= budget
    assert 0 < s["memory"]["peak_tree_bytes"] <= budget


def _write_bytes(pids) -> int:
    """Bytes the processes caused to be written to storage (Linux /proc/<pid>/io)."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/io") as f:
            total += next(int(line.split()[1]) for line in f if line.startswith("write_bytes:"))
    return total


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-process I/O counters: Linux /proc")
def test_inference_writes_nothing_to_disk(tiny_stores):
    with running_supervisor(tiny_stores("qwen3_moe"), BIG, ["--max-slots", "4"]) as (ep, proc):
        pids = [proc.pid] + [k.pid for k in psutil.Process(proc.pid).children()]
        with Client(ep, timeout=60) as c:
            c.generate("warm up", max_tokens=2)
            before = _write_bytes(pids)
            gen = c.generate("write nothing " * 30, max_tokens=64)
            c.logits(list(range(1, 200)))
            after = _write_bytes(pids)
            assert c.stats()["workers"]["router"].get("evictions", 0) > 0  # the pool really churned
    assert len(gen.token_ids) > 0
    assert after - before == 0


def test_run_command_streams_and_reports(tiny_stores):
    r = subprocess.run([sys.executable, "-m", "deltafin.tools.run", "--model", str(tiny_stores("qwen3_moe")),
                        "--prompt", "hello", "--max-tokens", "5", "--memory-budget", BIG, "--chat"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "stage latencies" in r.stderr and "read" in r.stderr and "time split" in r.stderr
    assert r.stdout.strip()


def test_logits_match_mlx_lm_when_a_projection_stays_float(tmp_path):
    """mlx-lm leaves a projection float when its input dimension does not fit the group size
    (here down_proj with moe_intermediate 32); the store keeps it float, exactly."""
    pytest.importorskip("mlx_lm")
    import mlx.core as mx
    from mlx_lm import convert as mlx_convert
    from mlx_lm.utils import load

    from deltafin.tools import convert
    from deltafin.tools.synth import tiny
    src = tiny("qwen2_moe", tmp_path / "hf", moe_intermediate=32, seed=3)
    mlx_convert(str(src), str(tmp_path / "q"), quantize=True, q_bits=4, q_group_size=64)
    assert convert.main([str(tmp_path / "q"), str(tmp_path / "store"), "--no-progress"]) == 0
    assert Store(tmp_path / "store").layout(0)["quant"]["down_proj"] is None
    model, _ = load(str(tmp_path / "q"))
    ids = [1, 17, 42, 99, 3, 250, 7, 301]
    ref = np.array(model(mx.array([ids]))[0].astype(mx.float32))
    with running_supervisor(tmp_path / "store", BIG) as (ep, _):
        with Client(ep, timeout=60) as c:
            got = c.logits(ids)
    assert np.abs(got - ref).max() <= 1e-3 * np.abs(ref).max()


def test_corrupt_record_is_a_clear_error_and_the_runtime_keeps_serving(tiny_stores, tmp_path):
    import shutil

    from deltafin.client import ExpertUnavailableError
    shutil.copytree(tiny_stores("mixtral"), tmp_path / "s")
    store = Store(tmp_path / "s")
    for e in range(store.n_experts):  # every expert of the last layer is damaged
        rec = store.record(store.moe_layers[-1], e)
        with open(store.path / rec.file, "r+b") as f:
            f.seek(rec.offset + 3)
            f.write(b"\x00\xff\x00")
    with running_supervisor(tmp_path / "s", BIG) as (ep, proc):
        with Client(ep, timeout=60) as c:
            with pytest.raises(ExpertUnavailableError, match="checksum mismatch"):
                c.generate("hello", max_tokens=3)
            assert c.health()["ok"] and proc.poll() is None


def test_sampling_stop_strings_and_streaming(tiny_stores):
    with running_supervisor(tiny_stores("qwen3_moe"), BIG) as (ep, _):
        with Client(ep, timeout=60) as c:
            a = c.generate("once upon a time", max_tokens=12, temperature=0.8, top_p=0.9, seed=7)
            b = c.generate("once upon a time", max_tokens=12, temperature=0.8, top_p=0.9, seed=7)
            greedy = c.generate("once upon a time", max_tokens=12)
            assert a.token_ids == b.token_ids
            assert a.stats["generated_tokens"] == len(a.token_ids)
            pieces = list(c.stream("once upon a time", max_tokens=12))
            assert "".join(pieces) == greedy.text == c.last.text
            if len(greedy.text) > 4:
                stop = greedy.text[2:4]
                cut = c.generate("once upon a time", max_tokens=12, stop=[stop])
                assert cut.finish_reason == "stop" and stop not in cut.text
                assert greedy.text.startswith(cut.text)
            with pytest.raises(RequestError, match="top_p"):
                c.generate("x", top_p=0.0)
            with pytest.raises(RequestError, match="empty prompt"):
                c.generate([], max_tokens=2)


def test_config_file_errors_are_clear(tiny_stores, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[cache]\npolicy = \"mru\"\n")
    r = subprocess.run([sys.executable, "-m", "deltafin.workers.supervisor", "--model", str(tiny_stores("mixtral")),
                        "--config", str(bad)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "cache.policy 'mru'" in r.stderr
    bad.write_text("[runtime]\nbudget = 5\n")
    r = subprocess.run([sys.executable, "-m", "deltafin.workers.supervisor", "--model", str(tiny_stores("mixtral")),
                        "--config", str(bad)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "unknown key runtime.budget" in r.stderr


def test_unknown_architecture_is_refused_before_workers_start(tiny_stores, tmp_path):
    import shutil
    shutil.copytree(tiny_stores("mixtral"), tmp_path / "s")
    m = json.loads((tmp_path / "s" / "manifest.json").read_text())
    m["config"]["model_type"] = "not_a_family"
    (tmp_path / "s" / "manifest.json").write_text(json.dumps(m))
    r = subprocess.run([sys.executable, "-m", "deltafin.workers.supervisor", "--model", str(tmp_path / "s")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "unsupported architecture model_type='not_a_family'" in r.stderr


def test_greedy_tokens_identical_when_the_budget_holds_two_layers(tmp_path):
    """Budget-driven (no slot cap): first a budget that holds every expert, then one computed
    from the first run's measurement to hold about two layers' worth of experts."""
    from deltafin.tools import convert
    from deltafin.tools.synth import tiny
    src = tiny("mixtral", tmp_path / "hf", layers=6, experts=16, top_k=2, hidden=512,
               moe_intermediate=1024, seed=4)
    out = tmp_path / "store"
    assert convert.main([str(src), str(out), "--no-progress"]) == 0
    store = Store(out)
    prompt = [7, 3, 99, 150, 42, 8, 301, 17]
    with running_supervisor(out, BIG) as (ep, _):
        with Client(ep, timeout=120) as c:
            full = c.generate(prompt, max_tokens=10).token_ids
            mem = c.stats()["memory"]
    assert mem["n_slots"] == len(store.records)
    (per_expert,) = mem["resident_bytes"].values()  # one record layout: one resident group
    two_layers = 2 * store.n_experts * per_expert
    budget = (mem["startup_tree_bytes"] + mem["cow_reserve_bytes"] + mem["reserves_bytes"] + mem["staging_bytes"]
              + two_layers)
    with running_supervisor(out, str(budget), ["--max-context", "2048"]) as (ep, _):  # the first run's context
        with Client(ep, timeout=120) as c:
            small = c.generate(prompt, max_tokens=10).token_ids
            s = c.stats()
    print(f"budget {budget / 2**20:.1f} MiB -> {s['memory']['n_slots']} slots of {len(store.records)}")
    assert store.n_experts <= s["memory"]["n_slots"] <= 3 * store.n_experts < len(store.records)
    assert s["workers"]["router"].get("evictions", 0) > 0
    assert small == full
