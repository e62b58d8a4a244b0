"""The metrics stream and deltafin-monitor, against real supervisors serving tiny models.

The monitor runs headless under Textual's Pilot; a subscriber of the test's own receives the same
snapshots, so what the screen shows is checked against the published numbers, computed here
independently where it matters (window counts and percentiles from the histograms, memory,
resident experts)."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import zmq

from deltafin.client import Client
from deltafin.protocol import messages as M
from deltafin.runtime.metrics import Latency, bin_ms, histogram_percentiles
from deltafin.runtime.telemetry import STAGES, live_runs, merge, window_figures
from deltafin.tools.monitor import Feed, MonitorModel, build_app, fmt_ms, heat_rows
from deltafin.tools.run import running_supervisor

BIG = "4GiB"
ARCH = "qwen2_moe"  # 2 MoE layers x 8 experts, top-2


class Collector:
    """The test's own subscriber: every merged snapshot by sequence number."""

    def __init__(self, endpoint: str):
        self.snaps: dict[int, dict] = {}
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(endpoint,), daemon=True)
        self.thread.start()

    def _run(self, endpoint):
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(endpoint)
        try:
            while not self.stop.is_set():
                if sub.poll(100):
                    msg = M.decode(sub.recv())
                    with self.lock:
                        self.snaps[msg.seq] = msg.stats
        finally:
            sub.close(0)
            ctx.term()

    def get(self, seq):
        with self.lock:
            return self.snaps.get(seq)

    def close(self):
        self.stop.set()
        self.thread.join(timeout=5)


class Generator:
    """Short requests one after another until stopped, so the figures keep moving."""

    def __init__(self, endpoint: str):
        self.stop = threading.Event()
        self.done = 0
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(endpoint,), daemon=True)
        self.thread.start()

    def _run(self, endpoint):
        try:
            with Client(endpoint, timeout=60) as c:
                i = 0
                while not self.stop.is_set():
                    i += 1
                    list(c.stream(f"count {i} sheep and then {i + 1}", max_tokens=8))
                    self.done += 1
        except BaseException as e:  # reported by the test
            self.error = e

    def close(self):
        self.stop.set()
        self.thread.join(timeout=60)
        assert self.error is None, self.error


async def until(pilot, cond, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        await pilot.pause(0.1)


def window_p(hist_new, hist_old, q) -> str:
    """The p-th percentile of the samples between two cumulative histograms, as shown: the
    nearest-rank sample's bin, recomputed here with numpy from the bins themselves."""
    old = dict(map(tuple, hist_old))
    values = np.concatenate([np.full(n - old.get(b, 0), b) for b, n in hist_new if n > old.get(b, 0)] or [[]])
    if values.size == 0:
        return "–"
    return fmt_ms(bin_ms(int(np.percentile(values, q, method="inverted_cdf"))))


def text_of(widget) -> str:
    return str(widget.render())


def check_screen_against(app, collector):
    """Every figure on screen against the snapshot(s) it comes from, as received by the test."""
    from textual.widgets import DataTable, Static
    snap = app.shown
    first, last = app.model.window_seqs
    assert last == snap["seq"]
    new, old = collector.get(last), collector.get(first)
    assert new == snap  # the very snapshot the supervisor published
    stages = app.query_one("#stages", DataTable)
    for s in STAGES:
        h_new = (new["stage_latency"].get(s) or {}).get("hist") or []
        h_old = (old["stage_latency"].get(s) or {}).get("hist") or []
        n = sum(c for _, c in h_new) - sum(c for _, c in h_old)
        assert stages.get_cell(s, "n") == str(n), s
        assert stages.get_cell(s, "p50") == window_p(h_new, h_old, 50), s
        assert stages.get_cell(s, "p99") == window_p(h_new, h_old, 99), s
    through = app.query_one("#throughput", DataTable)
    dt = new["clock"] - old["clock"]
    decode = (new["totals"]["decode_tokens"] - old["totals"]["decode_tokens"]) / dt
    assert through.get_cell("decode", "value") == f"{decode:,.1f} tok/s"
    uses = new["totals"]["uses"] - old["totals"]["uses"]
    hits = new["totals"]["hits"] - old["totals"]["hits"]
    assert through.get_cell("hit rate", "value") == (f"{hits / uses:.1%}" if uses else "–")
    waited = new["totals"]["wait_s"] - old["totals"]["wait_s"]
    busy = new["totals"]["token_s"] - old["totals"]["token_s"]
    assert through.get_cell("stall share", "value") == (f"{waited / busy:.1%}" if busy else "–")
    assert through.get_cell("requests", "value") == \
        f"{snap['active_requests']} active, {snap['totals']['requests']} done"
    memory = app.query_one("#memory", DataTable)
    for name in ("supervisor", "router", "loader", "compute"):
        pss = snap["processes"][name]["pss"]  # None where the OS has no PSS (macOS)
        assert memory.get_cell(name, "pss") == ("–" if pss is None else f"{pss / 2**20:.1f} MiB")
    # the heat map: one row per MoE layer, a filled cell exactly where the snapshot has an expert
    heat = text_of(app.query_one("#heat", Static)).splitlines()
    resident = dict((layer, set(ids)) for layer, ids in snap["slots"]["experts"])
    for layer, line in zip(snap["model"]["moe_layers"], heat):
        assert line.startswith(f"L{layer}")
        cells = line.split()[1:1 + snap["model"]["n_experts"]]
        assert [c == "■" for c in cells] == [e in resident.get(layer, ()) for e in range(len(cells))]
    return snap


def test_monitor_shows_the_published_snapshot_while_tokens_are_produced(tiny_stores):
    # 4 slots for 16 experts: experts are read and evicted all the time, so every figure moves
    with running_supervisor(tiny_stores(ARCH), BIG, ["--max-slots", "4"]) as (endpoint, _):
        [run] = live_runs()
        collector = Collector(run.metrics)
        gen = Generator(endpoint)
        app = build_app(Feed(), disk_gbps=2.0)

        async def drive():
            from textual.widgets import Static
            async with app.run_test(size=(150, 48)) as pilot:
                await until(pilot, lambda: app.model.window_seqs and app.model.window["seconds"] > 2
                            and gen.done >= 2 and app.shown["totals"]["requests"] >= 2, "a window")
                await until(pilot, lambda: all(collector.get(q) is not None for q in app.model.window_seqs),
                            "the test's copy")
                before = check_screen_against(app, collector)
                status = text_of(app.query_one("#status", Static))
                assert "live" in status and run.run_id in status and f"seq {before['seq']}" in status
                # values move while tokens are produced
                await until(pilot, lambda: app.shown["totals"]["requests"] > before["totals"]["requests"] + 1,
                            "more requests on screen")
                await until(pilot, lambda: all(collector.get(q) is not None for q in app.model.window_seqs),
                            "the copy")
                after = check_screen_against(app, collector)
                assert after["totals"]["decode_tokens"] > before["totals"]["decode_tokens"]
                assert after["stage_latency"]["read"]["count"] > before["stage_latency"]["read"]["count"]
                # p pauses the view while snapshots keep arriving
                await pilot.press("p")
                frozen = app.shown["seq"]
                await until(pilot, lambda: app.model.latest["seq"] >= frozen + 4, "snapshots while paused")
                assert app.shown["seq"] == frozen and "paused" in text_of(app.query_one("#status", Static))
                await pilot.press("p")
                await until(pilot, lambda: app.shown["seq"] > frozen + 3, "the view resumed")
                # r restarts the window at the newest snapshot
                at_reset = app.model.latest["seq"]
                await pilot.press("r")
                await until(pilot, lambda: app.model.window_seqs is not None, "a window after the reset")
                assert app.model.resets == 1 and app.model.window_seqs[0] >= at_reset
                await until(pilot, lambda: all(collector.get(q) is not None for q in app.model.window_seqs),
                            "the copy")
                check_screen_against(app, collector)
                # ? shows the help, escape closes it, q quits
                await pilot.press("question_mark")
                await until(pilot, lambda: bool(app.screen.query("#help")), "the help screen")
                await pilot.press("escape")
                await until(pilot, lambda: not app.screen.query("#help"), "the help closed")
                await pilot.press("q")
                await until(pilot, lambda: not app.is_running, "the app to quit", timeout=10)

        try:
            asyncio.run(drive())
        finally:
            gen.close()
            collector.close()


def test_monitor_says_when_the_supervisor_goes_and_follows_the_next_one(tiny_stores):
    store = tiny_stores(ARCH)
    app = build_app(Feed(), disk_gbps=2.0)

    async def drive():
        from textual.widgets import Static
        async with app.run_test(size=(150, 48)) as pilot:
            await until(pilot, lambda: app.feed.state == "searching", "the search")
            with running_supervisor(store, BIG) as (endpoint, _):
                with Client(endpoint, timeout=60) as c:
                    c.generate("first run", max_tokens=4)
                await until(pilot, lambda: app.feed.state == "connected" and app.shown is not None
                            and app.shown["totals"]["requests"] == 1, "the first supervisor")
                first = app.shown["run_id"]
            await until(pilot, lambda: app.feed.state == "lost", "the loss noticed")
            status = text_of(app.query_one("#status", Static))
            assert "supervisor gone since" in status and "waiting for one" in status
            with running_supervisor(store, BIG) as (endpoint, _):
                await until(pilot, lambda: app.feed.state == "connected" and app.shown["run_id"] != first,
                            "the second supervisor")
                assert app.shown["totals"]["requests"] == 0  # its own counters, not the old run's
                assert app.model.window_seqs is None or \
                    app.model.history[0]["run_id"] == app.shown["run_id"]
                assert "live" in text_of(app.query_one("#status", Static))

    asyncio.run(drive())


SCHEMA = {  # key -> accepted types; a script may rely on every one of these
    "seq": int, "time": float, "clock": float, "run_id": str, "supervisor_pid": int,
    "decode_tok_s": (float, type(None)), "prefill_tok_s": (float, type(None)),
    "hit_rate": (float, type(None)), "stall_share": (float, type(None)),
    "stage_latency": dict, "bytes_read": int, "bytes_read_per_token": (float, type(None)),
    "ssd_gbps": (float, type(None)), "prefetch_precision": type(None), "prefetch_recall": type(None),
    "memory": dict, "processes": dict, "active_requests": int, "slots": dict, "totals": dict,
    "model": dict, "window": (dict, type(None)), "workers": dict, "missing": list,
}


def monitor(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "deltafin.tools.monitor", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_once_json_is_one_snapshot_a_script_can_read(tiny_stores):
    r = monitor("--once", "--json", "--timeout", "1")
    assert r.returncode == 1 and "no running supervisor" in r.stderr
    store = tiny_stores(ARCH)
    with running_supervisor(store, BIG) as (ep_a, _):
        with Client(ep_a, timeout=60) as c:
            # a stats request sent after a reply counts that reply (the snapshots are synced)
            for i in range(1, 4):
                c.generate(f"request {i}", max_tokens=5)
                from_client = c.stats()
                assert from_client["totals"]["requests"] == i
                assert from_client["totals"]["decode_tokens"] == 4 * i
        r = monitor("--once", "--json")
        assert r.returncode == 0, r.stderr
        snap = json.loads(r.stdout)  # one JSON document, nothing else on stdout
        for key, kinds in SCHEMA.items():
            assert isinstance(snap[key], kinds) and not isinstance(snap[key], bool), key
        assert set(snap) == set(from_client)  # Client.stats() answers with the same snapshot
        for s in STAGES:
            assert {"count", "hist"} <= set(snap["stage_latency"][s])
        assert {"budget", "tree_bytes", "peak_tree_bytes", "n_slots", "slot_bytes"} <= set(snap["memory"])
        assert set(snap["processes"]) == {"supervisor", "router", "loader", "compute", "forkserver"}
        assert all({"pid", "rss", "pss", "cpu_percent"} <= set(p) for p in snap["processes"].values())
        assert snap["totals"]["requests"] == 3 and snap["totals"]["decode_tokens"] == 12
        assert snap["hit_rate"] == snap["totals"]["hits"] / snap["totals"]["uses"]
        assert sum(n for _, n in snap["slots"]["per_layer"]) == snap["slots"]["resident"] > 0
        # two supervisors: the monitor lists them and takes the one named with --endpoint
        with running_supervisor(store, BIG) as (ep_b, _):
            runs = live_runs()
            assert len(runs) == 2
            r = monitor("--once", "--json")
            assert r.returncode == 2 and all(run.run_id in r.stderr for run in runs)
            r = monitor("--once", "--json", "--endpoint", runs[1].metrics)
            assert r.returncode == 0 and json.loads(r.stdout)["run_id"] == runs[1].run_id


def test_stats_answer_at_once_in_the_middle_of_a_long_prefill(tiny_stores, tmp_path):
    """One forward pass per prompt token and the compute stand-in waiting 40 ms per MoE layer:
    100 prompt tokens take at least 8 s on any machine, during which compute's main thread never
    looks at its control channel (as inside MLX during a real long prompt)."""
    config = tmp_path / "long-prefill.toml"
    config.write_text("[compute]\nprefill_chunk = 1\n")
    # 4 resident slots of 16: random routing keeps filling them, so the prepare stage (the fill of
    # the resident tier) moves during the prompt too
    args = ["--config", str(config), "--standin", "--standin-moe-ms", "40", "--standin-dense-ms", "0",
            "--max-slots", "4"]
    with running_supervisor(tiny_stores(ARCH), BIG, args) as (endpoint, _):
        finished = threading.Event()

        def long_prompt():
            with Client(endpoint, timeout=120) as c:
                c.generate(list(range(1, 101)), max_tokens=1)
            finished.set()
        t = threading.Thread(target=long_prompt, daemon=True)
        t.start()
        try:
            with Client(endpoint, timeout=30) as c:
                deadline = time.monotonic() + 60
                while c.stats()["totals"]["prefill_tokens"] < 5:
                    assert time.monotonic() < deadline and not finished.is_set()
                    time.sleep(0.1)
                t0 = time.monotonic()
                first = c.stats()
                answered_in = time.monotonic() - t0
                assert not finished.is_set()  # still inside the prompt
                assert answered_in < 2.0, f"stats took {answered_in:.2f} s during the prefill"
                assert first["active_requests"] == 1 and first["missing"] == []
                time.sleep(1.0)
                second = c.stats()
                assert not finished.is_set()
                # compute's own counters, published from its thread, moved within the prompt
                assert second["totals"]["prefill_tokens"] > first["totals"]["prefill_tokens"]
                assert second["stage_latency"]["prepare"]["count"] > first["stage_latency"]["prepare"]["count"]
                print(f"stats answered in {answered_in * 1e3:.1f} ms during the prefill; prompt tokens "
                      f"processed {first['totals']['prefill_tokens']} -> {second['totals']['prefill_tokens']}")
        finally:
            t.join(timeout=120)
        assert finished.is_set()


# -- pieces without processes --------------------------------------------------------------------------
def test_latency_can_be_read_while_another_thread_adds():
    lat = Latency()
    stop = threading.Event()

    def add():
        while not stop.is_set():
            lat.add(1e-4)
    t = threading.Thread(target=add, daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            s = lat.summary()  # iterating the samples while they grow raised RuntimeError once
            assert s["count"] == sum(n for _, n in s["hist"])  # one consistent moment
    finally:
        stop.set()
        t.join()
    assert lat.summary()["count"] == sum(n for _, n in lat.summary()["hist"])


def test_window_percentiles_come_from_the_difference_of_two_histograms():
    rng = np.random.default_rng(0)
    lat = Latency()
    slow = rng.lognormal(np.log(20e-3), 0.3, 2000)   # ~20 ms, before the window
    fast = rng.lognormal(np.log(0.5e-3), 0.5, 3000)  # ~0.5 ms, inside it
    for x in slow:
        lat.add(x)
    old = {"clock": 0.0, "totals": {"prefill_tokens": 0, "decode_tokens": 0, "uses": 10, "hits": 5,
                                    "bytes_read": 0, "reads": 0, "requests": 0, "wait_s": 0.5, "token_s": 1.0},
           "stage_latency": {"read": lat.summary(), "stall": {"count": 1, "total_s": 0.5}}}
    for x in fast:
        lat.add(x)
    new = {"clock": 2.0, "totals": {"prefill_tokens": 50, "decode_tokens": 20, "uses": 30, "hits": 20,
                                    "bytes_read": 4_000_000_000, "reads": 3000, "requests": 1,
                                    "wait_s": 1.0, "token_s": 2.0},
           "stage_latency": {"read": lat.summary(), "stall": {"count": 3, "total_s": 1.5}}}
    w = window_figures(new, old)
    read = w["stage_latency"]["read"]
    assert read["count"] == len(fast)
    for q in (50, 99):  # within half a bin (4.5 %) of the exact percentile of the window's samples
        exact = np.percentile(fast, q) * 1e3
        assert abs(read[f"p{q}_ms"] / exact - 1) < 0.05, (q, read[f"p{q}_ms"], exact)
    assert w["decode_tok_s"] == 10 and w["prefill_tok_s"] == 25 and w["hit_rate"] == 0.75
    assert w["ssd_gbps"] == 2.0 and w["bytes_read_per_token"] == 4e9 / 70 and w["stall_share"] == 0.5
    assert histogram_percentiles({}) == {"count": 0}


def test_heat_map_groups_experts_when_a_layer_has_more_than_fit():
    snap = {"model": {"n_experts": 384, "moe_layers": [1, 2]},
            "slots": {"experts": [[1, list(range(0, 384, 2))], [2, list(range(6))]]}}
    (l1, cells1, n1), (l2, cells2, n2) = heat_rows(snap, width=64)
    assert len(cells1) == len(cells2) == 64  # 6 experts per cell
    assert set(cells1) == {"▒"} and n1 == "192/384"  # half of each group resident
    assert cells2[0] == "█" and set(cells2[1:]) == {" "} and n2 == "6/384"
    small = {"model": {"n_experts": 4, "moe_layers": [0]}, "slots": {"experts": [[0, [1, 3]]]}}
    assert heat_rows(small)[0][1] == "· ■ · ■"


def test_model_resets_its_window_and_on_a_new_run():
    def snap(run, seq, clock, decode):
        totals = {"prefill_tokens": 0, "decode_tokens": decode, "uses": 0, "hits": 0, "bytes_read": 0,
                  "reads": 0, "requests": 0}
        return {"run_id": run, "seq": seq, "clock": clock, "totals": totals, "stage_latency": {},
                "memory": {}}
    m = MonitorModel(window_s=10)
    for i in range(60):  # 15 s at 4 snapshots a second, 4 tokens each
        m.add(snap("a", i + 1, i * 0.25, 4 * i))
    assert m.window["seconds"] == 10 and m.window["decode_tok_s"] == 16
    assert m.window_seqs == (20, 60) and len(m.series["decode_tok_s"]) == 59
    m.reset()
    assert m.window is None and not m.series["decode_tok_s"]
    m.add(snap("a", 61, 15.0, 4 * 60))
    assert m.window_seqs == (60, 61)
    m.add(snap("b", 100, 100.0, 0))  # a restarted supervisor: nothing of run a stays
    assert m.window is None and list(m.history) == [m.latest] and m.resets == 2


def test_feed_finds_the_one_live_run_and_lists_several(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()

    def fake_run(name, pid):
        d = tmp_path / name
        d.mkdir()
        (d / "run.json").write_text(json.dumps({"pid": pid, "segments": []}))
        (d / "run-config.json").write_text(json.dumps({"store": "/s", "endpoints": {
            "metrics": f"ipc://{d}/metrics.ipc"}}))
    fake_run("gone", dead.pid)
    fake_run("alive", os.getpid())
    (tmp_path / "other").mkdir()  # a directory that is no run
    assert [r.run_id for r in live_runs(tmp_path)] == ["alive"]
    feed = Feed(root=tmp_path)
    try:
        feed.poll()
        assert feed.run.run_id == "alive" and feed.state == "searching"  # no snapshot yet
        fake_run("second", os.getppid())
        feed2 = Feed(root=tmp_path)
        feed2.poll()
        assert feed2.state == "several" and {r.run_id for r in feed2.runs} == {"alive", "second"}
        feed2.close()
    finally:
        feed.close()


def test_merge_keeps_the_stats_keys_tools_read():
    parts = {"router": {"uses": 4, "hits": 3, "hit_rate": 0.75, "n_slots": 8, "resident": 2,
                        "resident_experts": [[0, [1, 5]]], "stall": {"count": 0, "hist": []}},
             "loader": {"bytes": 100, "reads": 1, "read": {"count": 1, "hist": [[10, 1]]}},
             "compute": {"prompt_tokens": 3, "generated_tokens": 2, "forward": {"count": 2, "hist": []},
                         "prepare": {"count": 4, "hist": []}, "decode_forward_tokens": 1,
                         "prefill_forward_tokens": 3}}
    sup = {"memory": {"budget": 1, "n_slots": 8}, "processes": {}, "active_requests": 0,
           "model": {}, "run_id": "x"}
    s = merge(parts, [], sup)
    for key in ("decode_tok_s", "prefill_tok_s", "hit_rate", "stall_share", "stage_latency",
                "bytes_read_per_token", "ssd_gbps", "prefetch_precision", "prefetch_recall", "memory",
                "workers", "missing"):
        assert key in s
    assert s["bytes_read_per_token"] == 20 and s["slots"]["per_layer"] == [[0, 2]]
    assert "resident_experts" not in s["workers"]["router"]  # carried once, in `slots`
    assert s["totals"]["decode_tokens"] == 1 and s["totals"]["hits"] == 3


def test_merge_computes_each_figure_from_counters_by_its_definition():
    from deltafin.runtime import metrics
    parts = {"router": {"uses": 8, "hits": 6},
             "loader": {"bytes": 3000, "disk_busy_s": 1e-6},
             "compute": {"prompt_tokens": 10, "generated_tokens": 5, "decode_tokens": 4, "decode_s": 2.0,
                         "prefill_s": 0.5, "wait_s": 0.25, "forward": {"count": 3, "total_s": 1.0},
                         "hit_rate": 0.1}}  # compute's own figure is not the hit rate
    sup = {"memory": {}, "processes": {}, "active_requests": 0, "model": {}, "run_id": "x"}
    s = merge(parts, [], sup)
    assert s["decode_tok_s"] == 2.0 and s["prefill_tok_s"] == 20.0
    assert s["hit_rate"] == 0.75 == metrics.hit_rate(6, 8)
    assert s["stall_share"] == 0.25  # compute's wait / its token time (forward passes)
    assert s["bytes_read_per_token"] == 200 and s["ssd_gbps"] == pytest.approx(3.0)
    assert merge({}, ["router", "loader", "compute"], sup)["hit_rate"] is None


def test_one_definition_per_design_notes_metric():
    from deltafin.runtime.metrics import METRICS, TOTALS
    for key in ("decode_tok_s", "prefill_tok_s", "stage_latency", "stall_share", "hit_rate",
                "prefetch_precision", "prefetch_recall", "bytes_read_per_token", "ssd_gbps", "bound",
                "share_of_bound"):
        assert METRICS[key].counts and METRICS[key].window
    exported = [m.prom for m in (*METRICS.values(), *TOTALS.values()) if m.prom]
    assert len(exported) == len(set(exported)) and all(p.startswith("deltafin_") for p in exported)
    assert all(m.prom.endswith("_total") for m in TOTALS.values())
