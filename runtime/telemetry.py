"""The metrics stream: every role publishes full snapshots of its counters, the supervisor merges
them and republishes a few times a second for `deltafin-monitor` and any ZeroMQ subscriber.

Snapshots are cumulative, never deltas, and carry a sequence number: a subscriber that joins late
or loses messages (PUB/SUB drops under load and before the connection is up) is right with the
next one. Figures over an interval (a sliding window, the time since the monitor's reset) are the
difference of two snapshots, computed by `window_figures` for the supervisor and the monitor alike.

- `SnapshotPublisher` (workers): a thread with its own PUB socket (sockets are not thread-safe)
  that takes the role's snapshot every PUBLISH_INTERVAL_S. Compute's main thread spends a long
  prompt inside MLX, so only a thread of its own publishes in the middle of one.
- `MetricsHub` (supervisor): binds the inbound SUB the workers connect to and the outbound PUB,
  keeps the newest snapshot of each role, and which `worker_stats` request each has answered.
- `merge`: the merged snapshot, in the key names of DESIGN-NOTES (docs/PROTOCOL.md, "metrics"),
  each figure computed from the roles' counters by its definition in runtime/metrics.py.
- `live_runs`: the supervisors running now, found through their run directories.
"""
from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import psutil
import zmq

from deltafin.protocol import messages as M
from deltafin.runtime import metrics, procmem
from deltafin.runtime.metrics import histogram_percentiles
from deltafin.runtime.shm import pid_alive, runs_root
from deltafin.runtime.sockets import make_socket

PUBLISH_INTERVAL_S = 0.25   # workers and supervisor alike: a few snapshots a second
WINDOW_S = 10.0             # the sliding window of `window` figures
STALE_S = 2.0               # a role with no snapshot for this long is reported `missing`
STAGES = ("read", "prepare", "compute", "stall")
# The figures `window_figures` gives over an interval, by their names in runtime/metrics.py
WINDOW_SERIES = ("decode_tok_s", "prefill_tok_s", "hit_rate", "bytes_read_per_token", "ssd_gbps", "stall_share")
ROLES = ("router", "loader", "compute")
RUN_CONFIG = "run-config.json"


class SnapshotPublisher:
    """Publishes `take()` (an M.Metrics) every `interval` seconds from a thread of its own; `now()`
    asks for one at once. A failing `take` skips that tick (the next one is whole again)."""

    def __init__(self, ctx: zmq.Context, endpoint: str, take: Callable[[], M.Metrics],
                 interval: float = PUBLISH_INTERVAL_S):
        self.ctx, self.endpoint, self.take, self.interval = ctx, endpoint, take, interval
        self.published = 0
        self.failures = 0
        self.last_error: str | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics-publisher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def now(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        """Joins the thread: its socket must be closed before the context is destroyed."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        pub = make_socket(self.ctx, zmq.PUB, hwm=8)  # a slow reader loses old snapshots, not new ones
        pub.connect(self.endpoint)
        try:
            while not self._stop.is_set():
                try:
                    raw = M.encode(self.take())
                except Exception as e:  # a role's stats() raised: report it on the next good tick
                    self.failures += 1
                    self.last_error = f"{type(e).__name__}: {e}"
                else:
                    try:
                        pub.send(raw, zmq.NOBLOCK)
                        self.published += 1
                    except zmq.Again:
                        pass
                self._wake.wait(self.interval)
                self._wake.clear()
        finally:
            pub.close(0)


class MetricsHub:
    """The supervisor's end: inbound SUB (workers' PUBs connect to it), outbound PUB for subscribers.
    Keeps the newest snapshot of each role by sequence number; a snapshot also arrives on the
    control channel as the answer to `worker_stats` (`sync` names the request answered)."""

    def __init__(self, ctx: zmq.Context, inbound: str, outbound: str):
        self.sub = make_socket(ctx, zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.bind(inbound)
        self.pub = make_socket(ctx, zmq.PUB, hwm=16)
        self.pub.bind(outbound)
        self.latest: dict[str, M.Metrics] = {}
        self.received_at: dict[str, float] = {}
        self.synced: dict[str, int] = {}
        self.seq = 0
        self.history: deque = deque()  # (clock, snapshot) of the last WINDOW_S, for `window`
        self.dropped = 0

    def offer(self, msg: M.Metrics) -> None:
        role = msg.source
        if role not in ROLES:
            self.dropped += 1
            return
        self.synced[role] = max(self.synced.get(role, 0), msg.sync)
        old = self.latest.get(role)
        if old is None or msg.seq > old.seq or msg.pid != old.pid:
            self.latest[role] = msg
            self.received_at[role] = time.monotonic()

    def drain(self) -> None:
        while self.sub.poll(0):
            try:
                msg = M.decode(self.sub.recv())
            except M.ProtocolError:
                self.dropped += 1
                continue
            if isinstance(msg, M.Metrics):
                self.offer(msg)
            else:
                self.dropped += 1

    def synced_all(self, sync: int) -> bool:
        return all(self.synced.get(r, 0) >= sync for r in ROLES)

    def parts(self) -> tuple[dict, list, dict]:
        """(stats by role, roles missing or stale, age of each role's snapshot in seconds)."""
        now = time.monotonic()
        ages = {r: now - t for r, t in self.received_at.items()}
        parts = {r: m.stats for r, m in self.latest.items()}
        missing = [r for r in ROLES if r not in parts or ages[r] > STALE_S]
        return parts, missing, {r: round(a, 3) for r, a in ages.items()}

    def stamp(self, snapshot: dict) -> dict:
        """Gives a merged snapshot its sequence number and clock, and its `window` figures."""
        self.seq += 1
        clock = time.monotonic()
        snapshot.update(seq=self.seq, time=time.time(), clock=clock)
        while self.history and clock - self.history[0][0] > WINDOW_S:
            self.history.popleft()
        snapshot["window"] = window_figures(snapshot, self.history[0][1]) if self.history else None
        return snapshot

    def publish(self, snapshot: dict) -> None:
        self.history.append((snapshot["clock"], {k: snapshot[k] for k in ("clock", "totals", "stage_latency")}))
        try:
            self.pub.send(M.encode(M.Metrics(source="supervisor", pid=os.getpid(), seq=snapshot["seq"],
                                             time=snapshot["time"], stats=snapshot)), zmq.NOBLOCK)
        except zmq.Again:
            pass


def merge(parts: dict, missing: list, supervisor: dict) -> dict:
    """The merged snapshot: the keys `Client.stats()` always had (cumulative since start), plus
    `totals` (cumulative counters for interval figures), `slots`, `processes` and the supervisor's
    own figures. `supervisor` holds memory, processes, model, active_requests, run_id."""
    router, loader, compute = (parts.get(r, {}) for r in ROLES)
    tokens = compute.get("prompt_tokens", 0) + compute.get("generated_tokens", 0)
    router_raw = {k: v for k, v in router.items() if k not in ("resident_experts", "stall")}
    stall = router.get("stall")
    prompt_cache = compute.get("prompt_cache") or {}
    return {
        "decode_tok_s": metrics.tok_s(compute.get("decode_tokens", 0), compute.get("decode_s")),
        "prefill_tok_s": metrics.tok_s(compute.get("prompt_tokens", 0), compute.get("prefill_s")),
        "hit_rate": metrics.hit_rate(router.get("hits", 0), router.get("uses", 0)),
        "stall_share": metrics.stall_share(compute.get("wait_s", 0.0), _token_s(compute)),
        "stage_latency": {"read": loader.get("read"), "prepare": compute.get("prepare"),
                          "compute": compute.get("forward"), "stall": stall},
        "bytes_read": loader.get("bytes", 0),
        "bytes_read_per_token": metrics.bytes_per_token(loader.get("bytes", 0), tokens),
        "ssd_gbps": metrics.ssd_gbps(loader.get("bytes", 0), loader.get("disk_busy_s")),
        "prefetch_precision": router.get("prefetch_precision"),  # nil until a prefetcher runs
        "prefetch_recall": router.get("prefetch_recall"),
        "memory": supervisor["memory"],
        "processes": supervisor["processes"],
        "active_requests": supervisor["active_requests"],
        "slots": {"n_slots": router.get("n_slots", supervisor["memory"].get("n_slots")),
                  "resident": router.get("resident", 0),
                  "per_layer": [[layer, len(ids)] for layer, ids in router.get("resident_experts", [])],
                  "experts": router.get("resident_experts", [])},
        "totals": {"prefill_tokens": compute.get("prefill_forward_tokens", 0),
                   "decode_tokens": compute.get("decode_forward_tokens", 0),
                   "requests": compute.get("requests", 0),
                   "uses": router.get("uses", 0), "hits": router.get("hits", 0),
                   "reads": loader.get("reads", 0), "bytes_read": loader.get("bytes", 0),
                   "wait_s": compute.get("wait_s", 0.0), "token_s": _token_s(compute),
                   "prepare_s": compute.get("prepare_s", 0.0), "ipc_s": compute.get("ipc_s", 0.0),
                   **{f"prompt_cache_{k}": prompt_cache.get(k, 0) for k in metrics.PROMPT_CACHE_TOTALS}},
        "prompt_cache": prompt_cache,
        "prefill": (compute.get("batch") or {}).get("prefill", []),  # prompts being prefilled now
        "model": supervisor["model"],
        "run_id": supervisor["run_id"], "supervisor_pid": os.getpid(),
        "bench_mode": compute.get("bench_mode"),
        "lossy": compute.get("lossy"),
        "workers": {**parts, **({"router": router_raw} if router else {})},
        "missing": missing, "snapshot_age_s": supervisor.get("ages", {}),
    }


def _token_s(compute: dict) -> float:
    """Compute's token time: seconds inside forward passes (counted as each pass ends)."""
    return (compute.get("forward") or {}).get("total_s") or 0.0


def window_figures(new: dict, old: dict) -> dict | None:
    """Figures over the interval between two merged snapshots (old earlier), by the definitions
    of runtime/metrics.py: tok/s (tokens / wall time), hit rate, bytes per token, SSD GB/s (bytes
    read / wall time), stall share (compute's wait / its token time) and per-stage p50/p99 from
    the histograms."""
    dt = new["clock"] - old["clock"]
    if dt <= 0:
        return None
    a, b = new["totals"], old["totals"]
    d = {k: a.get(k, 0) - b.get(k, 0) for k in a}
    stages = {}
    for s in STAGES:
        h_new = dict(map(tuple, ((new["stage_latency"].get(s) or {}).get("hist") or [])))
        h_old = dict(map(tuple, ((old["stage_latency"].get(s) or {}).get("hist") or [])))
        stages[s] = histogram_percentiles({k: n - h_old.get(k, 0) for k, n in h_new.items()})
    return {"seconds": dt,
            "decode_tok_s": metrics.tok_s(d["decode_tokens"], dt),
            "prefill_tok_s": metrics.tok_s(d["prefill_tokens"], dt),
            "hit_rate": metrics.hit_rate(d["hits"], d["uses"]),
            "bytes_read": d["bytes_read"],
            "bytes_read_per_token": metrics.bytes_per_token(d["bytes_read"], d["prefill_tokens"] + d["decode_tokens"]),
            "ssd_gbps": metrics.ssd_gbps(d["bytes_read"], dt),
            "requests": d["requests"],
            "stall_share": metrics.stall_share(d.get("wait_s", 0.0), d.get("token_s", 0.0)),
            "token_split_ms": token_split_ms(d),
            "stage_latency": stages}


def token_split_ms(d: dict) -> dict | None:
    """A token's time inside forward passes over an interval, split: waiting for experts,
    preparing them, messages with the router, and compute (the rest); ms per token passed
    (prompt and decode tokens alike). None without tokens."""
    tokens = d.get("prefill_tokens", 0) + d.get("decode_tokens", 0)
    if not tokens:
        return None
    wait, prepare, ipc = (d.get(k, 0.0) for k in ("wait_s", "prepare_s", "ipc_s"))
    compute = max(0.0, d.get("token_s", 0.0) - wait - prepare - ipc)
    return {k: v * 1e3 / tokens for k, v in
            (("compute", compute), ("waiting", wait), ("prepare", prepare), ("messages", ipc))}


class ProcessSampler:
    """Memory (runtime/procmem.py: PSS on Linux, the process's own memory on macOS) and CPU of
    each process of the tree."""

    def __init__(self):
        self._procs: dict[int, psutil.Process] = {}

    def sample(self, pids: dict[str, int]) -> dict:
        out = {}
        for name, pid in pids.items():
            try:
                p = self._procs.get(pid)
                first = p is None
                if first:
                    p = self._procs[pid] = psutil.Process(pid)
                cpu = p.cpu_percent(None)  # since the previous sample; the first call only starts it
                out[name] = {"pid": pid, **procmem.measure(p), "cpu_percent": None if first else cpu}
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                out[name] = {"pid": pid, "rss": None, "pss": None, "uss": None, "own": None,
                             "private": False, "cpu_percent": None}
        return out


# -- discovery --------------------------------------------------------------------------------------
@dataclass
class RunInfo:
    run_id: str
    pid: int
    store: str
    metrics: str
    started: float
    client: str = ""  # the client endpoint (the supervisor's READY line)

    def describe(self) -> str:
        when = time.strftime("%H:%M:%S", time.localtime(self.started))
        return f"run {self.run_id}  pid {self.pid}  since {when}  {self.store}  --endpoint {self.metrics}"


def live_runs(root: Path | None = None) -> list[RunInfo]:
    """Runs whose supervisor is alive and publishes metrics, oldest first."""
    root = root or runs_root()
    found = []
    if not root.is_dir():
        return found
    for run in root.iterdir():
        try:
            pid = int(json.loads((run / "run.json").read_text())["pid"])
            cfg = json.loads((run / RUN_CONFIG).read_text())
            endpoint = cfg["endpoints"]["metrics"]
        except (OSError, ValueError, KeyError, TypeError):
            continue  # another tool's directory, a run starting or one from before the stream
        if pid_alive(pid):
            found.append(RunInfo(run.name, pid, cfg.get("store", "?"), endpoint,
                                 (run / RUN_CONFIG).stat().st_mtime, cfg["endpoints"].get("client", "")))
    return sorted(found, key=lambda r: r.started)


def metrics_endpoint(given: str, root: Path | None = None) -> str:
    """The metrics endpoint of what a user names: a run directory (its run-config.json says),
    a running supervisor's client endpoint (its READY line), or a metrics endpoint as it is."""
    path = Path(given).expanduser()
    if path.is_dir():
        try:
            return json.loads((path / RUN_CONFIG).read_text())["endpoints"]["metrics"]
        except (OSError, ValueError, KeyError, TypeError):
            raise ValueError(f"{given}: not a deltafin run directory (no {RUN_CONFIG} naming "
                             f"a metrics endpoint)") from None
    for run in live_runs(root):
        if given in (run.client, run.metrics):
            return run.metrics
    return given
