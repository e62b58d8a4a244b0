"""deltafin-monitor: a live terminal view of a running supervisor, fed by its metrics stream.

    deltafin-monitor                      # the one supervisor running now (lists them if several)
    deltafin-monitor --endpoint EP        # a given metrics endpoint (ipc:// or tcp://)
    deltafin-monitor --once --json        # one merged snapshot as JSON, for scripts
    deltafin-monitor --json               # one JSON line per snapshot until interrupted

The supervisor publishes a merged snapshot a few times a second (docs/PROTOCOL.md, "metrics").
`Feed` subscribes to it and notices when the supervisor goes away and when one comes back;
`MonitorModel` turns the snapshots into what is shown (figures over the window, sparkline
history); `MonitorApp` (tools/monitor_app.py) is the Textual view of both. The window is the
last WINDOW_S seconds or the time since `r` was pressed, whichever is shorter; its figures are
differences of two full snapshots (runtime/telemetry.window_figures), the same computation as the snapshot's own `window`.

SSD throughput is shown against the disk's direct-read bandwidth: `--disk-gbps` when given,
otherwise measured once at start by a one-second probe of the store's expert files at queue depth
4 (runtime/diskprobe.py, the loader's default reads in flight); `--no-probe` skips it.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import deque
from pathlib import Path

import zmq

from deltafin.protocol import messages as M
from deltafin.runtime.cli import Help
from deltafin.runtime.shm import pid_alive
from deltafin.runtime.telemetry import (STAGES, WINDOW_S, WINDOW_SERIES, RunInfo, live_runs,
                                       metrics_endpoint, window_figures)

LOST_AFTER_S = 2.0      # no snapshot for this long (8 publish intervals): the supervisor is gone
RESCAN_S = 1.0          # how often the run directories are scanned while looking for a supervisor
HISTORY_POINTS = 240    # 60 s of snapshots
SPARK_POINTS = 24       # the sparklines in the tables: the last 6 s
STEP_S = 1.0            # history points are rates over the last second (per snapshot they comb)
PROBE_QUEUE_DEPTH = 4
PROBE_SECONDS = 1.0


# -- where snapshots come from ------------------------------------------------------------------------
class Feed:
    """One SUB socket, made and used by the caller's thread. With a fixed endpoint ZeroMQ
    reconnects by itself; without one the run directories are scanned for the one live supervisor
    (a restarted supervisor has a new run directory, so a lost one is dropped and searched anew).

    state: "searching" (no supervisor found yet or waiting for its first snapshot), "connected",
    "lost" (it went away; `lost_at` says when), "several" (`runs` lists them)."""

    def __init__(self, endpoint: str | None = None, root: Path | None = None,
                 lost_after: float = LOST_AFTER_S, rescan: float = RESCAN_S):
        self.fixed, self.root, self.lost_after, self.rescan = endpoint, root, lost_after, rescan
        self.ctx = zmq.Context()
        self.sock: zmq.Socket | None = None
        self.run: RunInfo | None = None
        self.runs: list[RunInfo] = []
        self.state = "searching"
        self.lost_at: float | None = None     # wall time the supervisor was found gone
        self.last_at: float | None = None     # monotonic time of the last snapshot
        self.since = time.monotonic()          # monotonic time of the (re)connection
        self.last_scan = -math.inf
        self.received = 0
        if endpoint:
            self._connect(endpoint)

    @property
    def endpoint(self) -> str | None:
        return self.fixed or (self.run.metrics if self.run else None)

    def _connect(self, endpoint: str) -> None:
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 64)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.since = time.monotonic()

    def _disconnect(self) -> None:
        if self.sock is not None:
            self.sock.close(0)
            self.sock = None
        self.run = None

    def close(self) -> None:
        self._disconnect()
        self.ctx.term()

    def poll(self) -> list[dict]:
        """The snapshots received since the last call, oldest first; never blocks."""
        now = time.monotonic()
        if self.sock is None and now - self.last_scan >= self.rescan:
            self._search(now)
        out = []
        while self.sock is not None and self.sock.poll(0):
            try:
                msg = M.decode(self.sock.recv())
            except M.ProtocolError:
                continue
            if isinstance(msg, M.Metrics) and msg.source == "supervisor":
                out.append(msg.stats)
        if out:
            self.received += len(out)
            self.last_at = now
            self.state, self.lost_at = "connected", None
            return out
        dead = self.run is not None and not pid_alive(self.run.pid)
        silent = self.state == "connected" and now - self.last_at > self.lost_after
        if dead or silent:
            if self.state == "connected":
                self.state, self.lost_at = "lost", time.time()
            if self.fixed is None:
                self._disconnect()
        return out

    def _search(self, now: float) -> None:
        self.last_scan = now
        self.runs = live_runs(self.root)
        if len(self.runs) == 1:
            self.run = self.runs[0]
            self._connect(self.run.metrics)
            if self.state != "lost":
                self.state = "searching"
        elif len(self.runs) > 1:
            self.state = "several"


# -- what is shown ----------------------------------------------------------------------------------
class MonitorModel:
    """Snapshots -> figures over the window and sparkline history. `reset()` restarts the window
    and the history (key r). A snapshot of another run (a restarted supervisor) resets too."""

    SERIES = (*WINDOW_SERIES, *(f"{s}_p50" for s in STAGES))

    def __init__(self, window_s: float = WINDOW_S, points: int = HISTORY_POINTS):
        self.window_s, self.points = window_s, points
        self.latest: dict | None = None
        self.history: deque = deque()
        self.window: dict | None = None
        self.window_seqs: tuple[int, int] | None = None  # (first, last) snapshot of the window
        self.series = {k: deque(maxlen=points) for k in self.SERIES}
        self.resets = 0

    def reset(self) -> None:
        self.history = deque([self.latest] if self.latest else [])
        self.window, self.window_seqs = None, None
        for s in self.series.values():
            s.clear()
        self.resets += 1

    def add(self, snap: dict) -> None:
        prev = self.latest
        if prev is not None and (snap.get("run_id") != prev.get("run_id") or snap["seq"] <= prev["seq"]):
            self.latest = None  # another run: nothing of the old one stays
            self.reset()
        self.latest = snap
        self.history.append(snap)
        while len(self.history) > 1 and self.history[0]["clock"] < snap["clock"] - self.window_s:
            self.history.popleft()
        first = self.history[0]
        self.window = window_figures(snap, first) if first is not snap else None
        self.window_seqs = (first["seq"], snap["seq"]) if self.window else None
        ref = next((s for s in reversed(self.history) if snap["clock"] - s["clock"] >= STEP_S), first)
        step = window_figures(snap, ref) if ref is not snap else None
        if step is not None:
            for k in WINDOW_SERIES:
                self.series[k].append(step[k])
            for s in STAGES:
                self.series[f"{s}_p50"].append(step["stage_latency"][s].get("p50_ms"))


# -- formatting (shared by the view, --once and the tests) ------------------------------------------
def fmt_ms(v) -> str:
    return "–" if v is None else (f"{v:.3f}" if v < 1 else f"{v:.2f}" if v < 100 else f"{v:.0f}")


def fmt_rate(v, unit: str = "") -> str:
    return "–" if v is None else f"{v:,.1f}{unit}"


def fmt_pct(v) -> str:
    return "–" if v is None else f"{v:.1%}"


def fmt_bytes(v) -> str:
    if v is None:
        return "–"
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(v) >= scale:
            return f"{v / scale:.1f} {unit}"
    return f"{v:.0f} B"


def fmt_gbps(v) -> str:
    return "–" if v is None else f"{v:.3f} GB/s" if v < 10 else f"{v:.1f} GB/s"


def sparkline(values, width: int = SPARK_POINTS) -> str:
    """Block characters scaled to the largest value shown; a gap where a value is missing."""
    vals = list(values)[-width:]
    top = max((v for v in vals if v is not None), default=0) or 1
    blocks = "▁▂▃▄▅▆▇█"
    return "".join(" " if v is None else blocks[min(7, int(v / top * 7.999))] for v in vals)


def bar(share: float | None, width: int = 20) -> str:
    if share is None:
        return " " * width
    filled = min(width, int(round(max(0.0, share) * width)))
    return "█" * filled + "░" * (width - filled)


def stage_rows(window: dict | None) -> dict:
    """{stage: (p50, p99, n)} as shown, over the window."""
    rows = {}
    for s in STAGES:
        w = (window or {}).get("stage_latency", {}).get(s) or {}
        rows[s] = (fmt_ms(w.get("p50_ms")), fmt_ms(w.get("p99_ms")), str(w.get("count", 0)))
    return rows


def throughput_rows(snap: dict, window: dict | None, disk_gbps: float | None) -> dict:
    """{row: value text}: figures over the window, and the run's own totals."""
    w = window or {}
    ssd = w.get("ssd_gbps")
    share = f" of {disk_gbps:.2f} ({ssd / disk_gbps:.0%})" if ssd is not None and disk_gbps else ""
    return {"decode": fmt_rate(w.get("decode_tok_s"), " tok/s"),
            "prefill": fmt_rate(w.get("prefill_tok_s"), " tok/s"),
            "hit rate": fmt_pct(w.get("hit_rate")),
            "bytes/token": fmt_bytes(w.get("bytes_read_per_token")),
            "SSD": fmt_gbps(ssd) + share,
            "requests": f"{snap.get('active_requests', 0)} active, {snap['totals'].get('requests', 0)} done",
            "stall share": fmt_pct(w.get("stall_share")),
            "prefetch": f"precision {fmt_pct(snap.get('prefetch_precision'))}, "
                        f"recall {fmt_pct(snap.get('prefetch_recall'))}",
            "prompt cache": prompt_cache_text(snap),
            "prefilling": prefill_text(snap.get("prefill") or []),
            "token time": split_text(w.get("token_split_ms"))}


def prefill_text(progress: list) -> str:
    """The prompts being prefilled now: tokens done of the total (the prompt cache's among
    them), and the rate they are computed at; "-" when none is."""
    return "; ".join(prefill_line(p) for p in progress) or "–"


def prefill_line(p: dict) -> str:
    """One prompt's prefill progress (an entry of the stats' `prefill`)."""
    cached = f" ({p['cached']} cached)" if p.get("cached") else ""
    return f"{p['done']}/{p['total']} tokens{cached}, {fmt_rate(p.get('tok_s'), ' tok/s')}"


def split_text(split: dict | None) -> str:
    """A token's time split in ms: compute, waiting for experts, prepare, messages."""
    if not split:
        return "–"
    return ", ".join(f"{k} {v:.1f}" for k, v in split.items()) + " ms"


def prompt_cache_text(snap: dict) -> str:
    """The prompt cache: hits of lookups, tokens reused, bytes held of its share (or why it is off)."""
    pc, tot = snap.get("prompt_cache") or {}, snap["totals"]
    if "capacity_bytes" not in pc:
        return "off"
    return (f"{tot.get('prompt_cache_hits', 0)}/{tot.get('prompt_cache_lookups', 0)} hits, "
            f"{tot.get('prompt_cache_reused_tokens', 0)} tok, {fmt_bytes(pc.get('bytes'))} of "
            f"{fmt_bytes(pc.get('capacity_bytes'))}")


def memory_rows(snap: dict) -> dict:
    """{process: (PSS, or its own memory where the OS has no PSS; RSS; CPU)} and the tree against
    the budget."""
    rows = {}
    for name, p in (snap.get("processes") or {}).items():
        cpu = p.get("cpu_percent")
        own = p.get("pss") if p.get("pss") is not None else p.get("own")  # macOS: its own memory
        rows[name] = (fmt_bytes(own), fmt_bytes(p.get("rss")), "–" if cpu is None else f"{cpu:.0f} %")
    mem = snap["memory"]
    budget, tree = mem.get("budget"), mem.get("tree_bytes")
    rows["tree"] = (fmt_bytes(tree), f"peak {fmt_bytes(mem.get('peak_tree_bytes'))}",
                    f"{tree / budget:.0%} of {fmt_bytes(budget)}" if budget and tree is not None else "–")
    return rows


def budget_line(snap: dict) -> str:
    mem = snap["memory"]
    budget, tree = mem.get("budget"), mem.get("tree_bytes")
    share = tree / budget if budget and tree is not None else None
    return (f"tree {bar(share, 24)} {fmt_pct(share)} of {fmt_bytes(budget)}, "
            f"{mem.get('n_slots')} slots of {fmt_bytes(mem.get('slot_bytes'))}")


def chart(values, width: int, height: int) -> list[str]:
    """Vertical bars, `height` rows of eighth blocks, the newest on the right, and a scale line."""
    vals = [v or 0.0 for v in list(values)[-width:]]
    top = max(vals, default=0.0)
    scale = top or 1.0
    eighths = [int(round(v / scale * height * 8)) for v in vals]
    blocks = " ▁▂▃▄▅▆▇█"
    rows = []
    for r in range(height - 1, -1, -1):
        rows.append("".join(blocks[max(0, min(8, e - r * 8))] for e in eighths).rjust(width))
    rows[0] += f"  {top:,.0f}"
    rows[-1] += "  0"
    return rows


def heat_rows(snap: dict, width: int = 64) -> list[tuple[str, str, str]]:
    """Per MoE layer: (label, cells, count). One cell per expert, or per group of experts shaded
    by the share resident when a layer has more experts than `width`."""
    model = snap.get("model") or {}
    n = int(model.get("n_experts") or 0)
    resident = {layer: set(ids) for layer, ids in (snap.get("slots") or {}).get("experts", [])}
    group = max(1, math.ceil(n / width)) if n else 1
    shades = " ░▒▓█"
    rows = []
    for layer in model.get("moe_layers", []):
        have = resident.get(layer, set())
        if group == 1:
            gap = " " if 2 * n <= width else ""  # few experts: spaced, so each one reads apart
            cells = gap.join("■" if e in have else "·" for e in range(n))
        else:
            cells = "".join(shades[math.ceil(sum(e in have for e in range(g, min(n, g + group)))
                                             / min(group, n - g) * 4)]
                            for g in range(0, n, group))
        rows.append((f"L{layer:<3d}", cells, f"{len(have)}/{n}"))
    return rows


def setting_label(snap: dict) -> str:
    """The run's lossy setting as the monitor shows it: "exact", or "LOSSY <its name>"."""
    lossy = snap.get("lossy") or {}
    if not lossy:
        return "setting unknown"
    return "exact" if lossy.get("exact") else f"LOSSY {lossy.get('name')}"


def format_text(snap: dict, disk_gbps: float | None = None) -> str:
    """--once without --json: the snapshot as plain text (window = the supervisor's own)."""
    w = snap.get("window")
    lines = [f"run {snap.get('run_id')}  pid {snap.get('supervisor_pid')}  "
             f"{(snap.get('model') or {}).get('architecture')}  {setting_label(snap)}  seq {snap['seq']}",
             f"stage      p50 ms    p99 ms        n   (last {w['seconds']:.1f} s)" if w else
             "stage      p50 ms    p99 ms        n   (no window yet)"]
    for s, (p50, p99, n) in stage_rows(w).items():
        lines.append(f"{s:8s} {p50:>9s} {p99:>9s} {n:>8s}")
    lines += [f"{k:12s} {v}" for k, v in throughput_rows(snap, w, disk_gbps).items()]
    lines += [f"{k:12s} {' '.join(v)}" for k, v in memory_rows(snap).items()]
    return "\n".join(lines)


# -- the Textual view (tools/monitor_app.py; Textual is imported only for it) ---------------------
def build_app(feed: Feed, disk_gbps: float | None = None, probe: bool = True):
    from deltafin.tools.monitor_app import MonitorApp
    return MonitorApp(feed, disk_gbps, probe)


# -- command line ---------------------------------------------------------------------------------
def _next_snapshots(feed: Feed, timeout: float) -> list[dict]:
    """The snapshots that arrive first within timeout; [] if none came (feed.state says why)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = feed.poll()
        if got or feed.state == "several":
            return got
        time.sleep(0.05)
    return []


def _no_snapshot(feed: Feed, timeout: float) -> int:
    if feed.state == "several":
        print("deltafin-monitor: several supervisors are running; pick one with --endpoint:",
              file=sys.stderr)
        for r in feed.runs:
            print(f"  {r.describe()}", file=sys.stderr)
        return 2
    where = feed.endpoint or "no running supervisor found"
    print(f"deltafin-monitor: no snapshot within {timeout:.0f} s ({where})", file=sys.stderr)
    return 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(formatter_class=Help, prog="deltafin-monitor",
                                description="Live view of a running deltafin supervisor: stage latencies, "
                                            "throughput, cache, SSD, memory, resident experts.")
    p.add_argument("--endpoint", help="the supervisor to watch: its client endpoint (the READY line), "
                                      "its run directory, or its metrics endpoint (default: the one "
                                      "running supervisor, found in its run directory)")
    p.add_argument("--once", action="store_true", help="print one snapshot and exit")
    p.add_argument("--json", action="store_true", help="JSON output (one line per snapshot; with --once, one)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for a snapshot (--once, --json)")
    p.add_argument("--disk-gbps", type=float, help="the disk's direct-read bandwidth (skips the probe)")
    p.add_argument("--no-probe", action="store_true", help="do not measure the disk at start")
    p.add_argument("--screenshot", metavar="OUT.svg", help="run headless, save an SVG after --after seconds")
    p.add_argument("--after", type=float, default=10.0, help="seconds before --screenshot (default 10)")
    a = p.parse_args(argv)
    try:
        a.endpoint = metrics_endpoint(a.endpoint) if a.endpoint else None
    except ValueError as e:
        print(f"deltafin-monitor: error: {e}", file=sys.stderr)
        return 2
    feed = Feed(a.endpoint)
    try:
        if a.once or a.json:
            return _print_snapshots(feed, a)
        if a.screenshot:
            import asyncio
            return asyncio.run(_screenshot(feed, a))
        if not a.endpoint:  # say which supervisor before the screen takes over, or why none
            feed.poll()
            if feed.state == "several":
                return _no_snapshot(feed, 0)
        build_app(feed, a.disk_gbps, probe=not a.no_probe).run()
        return 0
    except KeyboardInterrupt:
        return 130
    finally:
        if not feed.ctx.closed:
            feed.close()


def _print_snapshots(feed: Feed, a) -> int:
    while True:
        got = _next_snapshots(feed, a.timeout)
        if not got:
            return _no_snapshot(feed, a.timeout)
        for snap in got[-1:] if a.once else got:
            print(json.dumps(snap) if a.json else format_text(snap, a.disk_gbps), flush=True)
        if a.once:
            return 0


async def _screenshot(feed: Feed, a) -> int:
    app = build_app(feed, a.disk_gbps, probe=not a.no_probe)
    async with app.run_test(size=(150, 48)) as pilot:
        await pilot.pause(a.after)
        app.save_screenshot(Path(a.screenshot).name, str(Path(a.screenshot).parent or "."))
    return 0 if app.model.latest is not None else 1


if __name__ == "__main__":
    sys.exit(main())
