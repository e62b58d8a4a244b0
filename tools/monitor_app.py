"""The Textual view of deltafin-monitor (tools/monitor.py): `MonitorApp` shows a `Feed`'s
snapshots through a `MonitorModel`; `HelpScreen` is its key help. Imported only when the view
is shown, so --once and --json run without Textual."""
from __future__ import annotations

import time

from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.css.query import NoMatches
from textual.screen import ModalScreen
from textual.widgets import DataTable, Footer, Static

from deltafin.runtime.telemetry import STAGES
from deltafin.tools.monitor import (PROBE_QUEUE_DEPTH, PROBE_SECONDS, SPARK_POINTS, Feed, MonitorModel,
                                    budget_line, chart, heat_rows, memory_rows, sparkline, stage_rows,
                                    setting_label, throughput_rows)

HELP_TEXT = """[b]deltafin-monitor[/b]

Stage latency: p50 and p99 over the window, per expert for read and
prepare, per forward pass for compute, per waiting layer for stall.
Throughput: tokens, hit rate, bytes read per token and SSD throughput
over the window; SSD against the disk's direct-read bandwidth.
Memory: proportional set size, resident set and CPU per process; the
tree's total against the memory budget.
Heat map: which experts hold a slot, per MoE layer.

[b]q[/b] quit   [b]p[/b] pause the view   [b]r[/b] reset the window   [b]?[/b] this help

The window is the last 10 s, or the time since r was pressed. History
points are rates over the last second. Without --endpoint the monitor
finds the running supervisor and follows it across restarts.
Close with escape or ?."""


class HelpScreen(ModalScreen):
    BINDINGS = [Binding("escape,question_mark,q", "app.pop_screen", "close")]
    DEFAULT_CSS = "HelpScreen { align: center middle; } #help { width: 76; padding: 1 2; border: round $accent; background: $panel; }"

    def compose(self) -> ComposeResult:
        yield Static(HELP_TEXT, id="help")


class MonitorApp(App):
    TITLE = "deltafin-monitor"
    CSS = """
    #status { height: 2; padding: 0 1; background: $boost; }
    #columns { height: 1fr; }
    #left, #right { width: 1fr; height: 1fr; }
    DataTable { height: auto; border: round $primary; scrollbar-size: 0 0; }
    #budget { height: auto; padding: 0 1; border: round $primary; }
    #heat-box { border: round $primary; height: 1fr; }
    #chart { border: round $primary; height: 1fr; padding: 0 1; }
    """
    BINDINGS = [Binding("q", "quit", "quit"), Binding("p", "pause", "pause"),
                Binding("r", "reset", "reset window"), Binding("question_mark", "help", "help")]

    def __init__(self, feed: Feed, disk_gbps: float | None = None, probe: bool = True):
        super().__init__()
        self.feed, self.model = feed, MonitorModel()
        self.disk_gbps = disk_gbps
        self.probe = probe and disk_gbps is None
        self.disk_source = ("--disk-gbps" if disk_gbps else
                            "waiting for the store's path" if self.probe else "not measured (--no-probe)")
        self.paused = False
        self.shown: dict | None = None       # the snapshot on screen
        self.shown_window: dict | None = None

    def compose(self) -> ComposeResult:
        yield Static("", id="status")
        with Horizontal(id="columns"):
            with Vertical(id="left"):
                yield DataTable(id="stages", cursor_type="none", zebra_stripes=True)
                yield DataTable(id="throughput", cursor_type="none", zebra_stripes=True)
                yield Static("", id="chart")
            with Vertical(id="right"):
                yield DataTable(id="memory", cursor_type="none", zebra_stripes=True)
                yield Static("", id="budget")
                with VerticalScroll(id="heat-box"):
                    yield Static("", id="heat")
        yield Footer()

    def on_mount(self) -> None:
        t = self.query_one("#stages", DataTable)
        t.border_title = "stage latency (ms, over the window)"
        for label, key, width in (("stage", "stage", 8), ("p50", "p50", 8), ("p99", "p99", 8),
                                  ("n", "n", 8), ("p50 history (1 s)", "spark", 24)):
            t.add_column(label, key=key, width=width)
        for s in STAGES:
            t.add_row(s, "–", "–", "0", "", key=s)
        t = self.query_one("#throughput", DataTable)
        t.border_title = "throughput (over the window)"
        for label, key, width in (("", "name", 11), ("value", "value", 28), ("history (1 s)", "spark", 24)):
            t.add_column(label, key=key, width=width)
        for name in ("decode", "prefill", "hit rate", "bytes/token", "SSD", "requests",
                     "stall share", "prefetch", "prompt cache", "prefilling", "token time"):
            t.add_row(name, "–", "", key=name)
        t = self.query_one("#memory", DataTable)
        t.border_title = "memory and CPU per process"
        for label, key, width in (("process", "name", 11), ("PSS", "pss", 11), ("RSS", "rss", 16),
                                  ("CPU", "cpu", 16)):
            t.add_column(label, key=key, width=width)
        self.query_one("#budget").border_title = "memory budget"
        self.query_one("#chart").border_title = "tokens per second (decode + prefill) over the last second"
        self.query_one("#heat-box").border_title = "resident experts per layer"
        self.set_interval(0.1, self.tick)
        self.tick()

    # -- updates ------------------------------------------------------------------------------
    def tick(self) -> None:
        for snap in self.feed.poll():
            self.model.add(snap)
        if self.probe and self.model.latest is not None:
            self.probe = False
            self.disk_source = "probing the store's disk"
            self.run_worker(lambda: self._probe(self.model.latest["model"]["store"]),
                            thread=True, exit_on_error=False)
        try:
            if not self.paused and self.model.latest is not None and self.model.latest is not self.shown:
                self.render_snapshot()
            self.render_status()
        except NoMatches:  # the app is closing: its widgets are gone before its timer has stopped
            return

    def _probe(self, store: str) -> None:
        from deltafin.runtime.diskprobe import probe_disk
        try:
            r = probe_disk(store, None, PROBE_QUEUE_DEPTH, PROBE_SECONDS, drop_cache=False)
        except (OSError, ValueError) as e:
            self.disk_source = f"probe failed: {e}"
            return
        self.disk_gbps, self.disk_source = r["gbps"], f"probed {PROBE_SECONDS:.0f} s at start"

    def render_status(self) -> None:
        f, snap = self.feed, self.model.latest
        if f.state == "connected":
            state = "[b green]● live[/]" if not self.paused else "[b yellow]‖ paused[/] (p resumes)"
        elif f.state == "lost":
            state = (f"[b red]✕ supervisor gone since {time.strftime('%H:%M:%S', time.localtime(f.lost_at))}"
                     f"[/], waiting for one")
        elif f.state == "several":
            state = (f"[b yellow]{len(f.runs)} supervisors running[/]: pick one with --endpoint "
                     + "; ".join(r.metrics for r in f.runs))
        else:
            state = f"[b yellow]looking for a supervisor[/] {f.endpoint or ''}"
        line1 = state
        if snap is not None:
            age = time.time() - snap["time"]
            m = snap.get("model") or {}
            line1 += (f"   run {snap.get('run_id')}  pid {snap.get('supervisor_pid')}  "
                      f"{m.get('architecture')}  {setting_label(snap)}  seq {snap['seq']}  {age:.1f} s ago")
        w = self.model.window
        line2 = (f"window: last {w['seconds']:.1f} s" if w else "window: waiting for a second snapshot")
        line2 += f" (of {self.model.window_s:.0f} s, r resets)   disk: "
        line2 += f"{self.disk_gbps:.2f} GB/s ({self.disk_source})" if self.disk_gbps else self.disk_source
        if snap is not None and snap.get("missing"):
            line2 += f"   [red]no snapshot from {', '.join(snap['missing'])}[/]"
        self.query_one("#status", Static).update(line1 + "\n" + line2)

    def render_snapshot(self) -> None:
        snap, w, series = self.model.latest, self.model.window, self.model.series
        t = self.query_one("#stages", DataTable)
        for s, (p50, p99, n) in stage_rows(w).items():
            t.update_cell(s, "p50", p50)
            t.update_cell(s, "p99", p99)
            t.update_cell(s, "n", n)
            t.update_cell(s, "spark", sparkline(series[f"{s}_p50"], SPARK_POINTS))
        t = self.query_one("#throughput", DataTable)
        sparks = {"decode": "decode_tok_s", "prefill": "prefill_tok_s", "hit rate": "hit_rate",
                  "bytes/token": "bytes_read_per_token", "SSD": "ssd_gbps", "stall share": "stall_share"}
        for name, text in throughput_rows(snap, w, self.disk_gbps).items():
            t.update_cell(name, "value", text)
            t.update_cell(name, "spark", sparkline(series[sparks[name]], SPARK_POINTS) if name in sparks else "")
        t = self.query_one("#memory", DataTable)
        for name, (pss, rss, cpu) in memory_rows(snap).items():
            if name not in t.rows:
                t.add_row(name, pss, rss, cpu, key=name)
            else:
                t.update_cell(name, "pss", pss)
                t.update_cell(name, "rss", rss)
                t.update_cell(name, "cpu", cpu)
        self.query_one("#budget", Static).update(budget_line(snap))
        box = self.query_one("#chart", Static).content_region
        tok = [None if d is None else d + (p or 0) for d, p in zip(series["decode_tok_s"], series["prefill_tok_s"])]
        self.query_one("#chart", Static).update(
            "\n".join(chart(tok, max(8, box.width - 10), max(2, box.height - 1))))
        rows = heat_rows(snap)
        slots = snap.get("slots") or {}
        lines = [f"[dim]{label}[/] [green]{cells}[/]  {count}" for label, cells, count in rows]
        lines.append(f"[dim]{slots.get('resident', 0)} of {slots.get('n_slots')} slots hold an expert[/]")
        self.query_one("#heat", Static).update("\n".join(lines))
        self.shown, self.shown_window = snap, w

    # -- keys ---------------------------------------------------------------------------------
    def action_pause(self) -> None:
        self.paused = not self.paused
        self.render_status()

    def action_reset(self) -> None:
        self.model.reset()
        self.shown = None  # redraw with the emptied window at the next tick

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def on_unmount(self) -> None:
        self.feed.close()
