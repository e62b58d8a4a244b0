"""deltafin-run: one-shot generation. Starts the runtime, streams the answer, prints stage latencies.

The runtime is the same `deltafin-supervisor` a user would start (a child process); this
command is just its first client.
"""
from __future__ import annotations

import argparse
import selectors
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

from deltafin.client import Client, DeltafinError
from deltafin.runtime.cli import Help
from deltafin.runtime.procs import stop_process


class StartError(RuntimeError):
    pass


@contextmanager
def running_supervisor(model: str, memory_budget: str | None = None, extra: list[str] | None = None,
                       timeout: float = 900.0, stderr=None, preexec_fn=None):
    """Starts deltafin-supervisor, yields (endpoint, process) once it printed READY; stops it after.
    preexec_fn runs in the child before exec (the benchmark puts it into a memory cgroup there).
    `timeout` is a backstop: the supervisor gives up by itself, after runtime.startup_timeout_s
    and, where compute warms up on a GPU (minutes on a fresh machine), runtime.warmup_timeout_s."""
    cmd = [sys.executable, "-m", "deltafin.workers.supervisor", "--model", str(model)]
    if memory_budget:
        cmd += ["--memory-budget", str(memory_budget)]
    cmd += extra or []
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, preexec_fn=preexec_fn)
    try:
        endpoint = _await_ready(proc, timeout)
        yield endpoint, proc
    finally:
        reap(proc, 15, signal.SIGINT)


def reap(proc: subprocess.Popen, timeout: float, first: int | None = None) -> None:
    """Stops a supervisor: sends `first` (None: it was told to stop already), waits up to
    timeout, then kills it (runtime/procs.py); closes its pipe."""
    stop_process(proc, timeout, first)
    if proc.stdout:
        proc.stdout.close()


def _await_ready(proc: subprocess.Popen, timeout: float) -> str:
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sel.select(timeout=0.5):
            line = proc.stdout.readline()
            if line.startswith("READY "):
                return line.split(None, 1)[1].strip()
            if not line and proc.poll() is not None:
                break
        elif proc.poll() is not None:
            break
    if proc.poll() is None:
        raise StartError(f"the runtime did not become ready within {timeout:.0f} s")
    raise StartError(f"the runtime exited with code {proc.returncode} before it was ready")


def format_latencies(stats: dict) -> str:
    lines = ["stage latencies (p50 / p99):"]
    for stage, unit in (("read", "per expert"), ("prepare", "per expert"), ("compute", "per forward pass")):
        s = (stats.get("stage_latency") or {}).get(stage) or {}
        if s.get("count"):
            lines.append(f"  {stage:8s} {s['p50_ms']:8.2f} ms / {s['p99_ms']:8.2f} ms  "
                         f"({unit}, n={s['count']})")
        else:
            lines.append(f"  {stage:8s}        -   (no samples)")
    fmt = lambda v, f: (f.format(v) if v is not None else "-")
    mem = stats.get("memory") or {}
    mode = stats.get("bench_mode")
    if mode and (mode.get("routing") != "gate" or mode.get("standin")):
        standin = mode.get("standin")
        lines.insert(0, f"BENCHMARK MODE: routing {mode.get('routing')}, compute "
                        + (f"stand-in ({standin['moe_ms']} ms per MoE layer, {standin['dense_ms']} ms "
                           f"per dense layer)" if standin else "real"))
    lossy = stats.get("lossy") or {}
    if lossy and not lossy.get("exact"):
        lines.insert(0, f"LOSSY MODE {lossy.get('name')}: not the exact model's answer "
                        f"({lossy.get('rerouted', 0)} experts rerouted)")
    lines.append(f"decode {fmt(stats.get('decode_tok_s'), '{:.2f}')} tok/s, prefill "
                 f"{fmt(stats.get('prefill_tok_s'), '{:.2f}')} tok/s, hit rate "
                 f"{fmt(stats.get('hit_rate'), '{:.1%}')}, stall share {fmt(stats.get('stall_share'), '{:.1%}')}, "
                 f"SSD {fmt(stats.get('ssd_gbps'), '{:.2f}')} GB/s, "
                 f"{fmt(stats.get('bytes_read_per_token'), '{:,.0f}')} B read/token")
    pc, tot = stats.get("prompt_cache") or {}, stats.get("totals") or {}
    if "capacity_bytes" in pc:
        lines.append(f"prompt cache: {tot.get('prompt_cache_hits', 0)} hits of {tot.get('prompt_cache_lookups', 0)} "
                     f"lookups, {tot.get('prompt_cache_reused_tokens', 0)} tokens reused")
    for p in stats.get("prefill") or []:
        lines.append(f"prefilling: {p['done']}/{p['total']} tokens ({p.get('cached', 0)} cached)")
    if mem:
        lines.append(f"memory: peak tree {mem.get('peak_tree_bytes', 0) / 2**20:.0f} MiB of a "
                     f"{mem.get('budget', 0) / 2**20:.0f} MiB budget; {mem.get('n_slots')} expert slots")
    return "\n".join(lines)


def format_split(gen_stats: dict) -> str:
    total = gen_stats.get("total_s") or 0
    if not total:
        return ""
    parts = [(k, gen_stats.get(f"{k}_s", 0)) for k in ("compute", "ipc", "wait", "prepare")]
    names = {"compute": "compute", "ipc": "IPC", "wait": "waiting for experts", "prepare": "prepare"}
    ttft = gen_stats.get("ttft_s")
    return ("time split: " + ", ".join(f"{names[k]} {v / total:.1%}" for k, v in parts) + f" of {total:.2f} s"
            + (f"; time to first token {ttft:.3f} s" if ttft is not None else ""))


def progress_line(progress: list, last: list | None, tty: bool) -> str | None:
    """What PrefillProgress writes for an update: on a terminal the line again after a carriage
    return; elsewhere (a log, a pipe) a line of its own, only where the tokens done moved since
    the last update (`last`), so a log holds one line per step and no run of repeats."""
    from deltafin.tools.monitor import prefill_text
    if tty:
        return f"\rprefill {prefill_text(progress)}   "
    if last == [p["done"] for p in progress]:
        return None
    return f"prefill {prefill_text(progress)}\n"


class PrefillProgress:
    """While a prompt is prefilled: its progress (tokens done / total, rate) on `out` (on a
    terminal one carriage-returned line, elsewhere a line per step: `progress_line`), from the
    metrics stream of the runtime serving `endpoint` (a client endpoint: telemetry.metrics_endpoint
    finds the stream). `stop()` ends it (the first piece arrived) and ends the line where one was
    written."""

    def __init__(self, endpoint: str, out=sys.stderr, interval: float = 0.2):
        self.endpoint, self.out, self.interval = endpoint, out, interval
        self.shown = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="prefill-progress", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from deltafin.runtime.telemetry import metrics_endpoint
        from deltafin.tools.monitor import Feed
        feed = Feed(metrics_endpoint(self.endpoint))
        tty = bool(getattr(self.out, "isatty", lambda: False)())
        last = None  # the prompts' tokens done at the last update
        try:
            while not self._stop.wait(self.interval):
                snaps = feed.poll()
                progress = snaps[-1].get("prefill") if snaps else None
                if progress and not self._stop.is_set():
                    line = progress_line(progress, last, tty)
                    last = [p["done"] for p in progress]
                    if line:
                        self.out.write(line)
                        self.out.flush()
                        if tty:  # a carriage-returned line, ended by stop()
                            self.shown += 1
        finally:
            feed.close()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if self.shown:
            self.out.write("\n")
            self.out.flush()
            self.shown = 0


def stream_with_progress(client: Client, endpoint: str, prompt, **kw):
    """client.stream(prompt, **kw)'s pieces, with the prefill's progress on stderr until the first."""
    progress = PrefillProgress(endpoint)
    try:
        for piece in client.stream(prompt, **kw):
            progress.stop()
            yield piece
    finally:
        progress.stop()


def run_once(model, prompt: str, max_tokens: int = 128, memory_budget: str | None = None,
             chat: bool = False, temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
             config: str | None = None, supervisor_args: list[str] | None = None) -> int:
    """Starts the runtime, streams one answer to stdout, prints the stage latencies to stderr."""
    extra = (["--config", config] if config else []) + list(supervisor_args or [])
    try:
        with running_supervisor(model, memory_budget, extra) as (endpoint, _proc):
            with Client(endpoint, timeout=600) as c:
                for piece in stream_with_progress(c, endpoint, prompt, max_tokens=max_tokens, chat=chat,
                                                  temperature=temperature, top_p=top_p, seed=seed):
                    sys.stdout.write(piece)
                    sys.stdout.flush()
                sys.stdout.write("\n")
                gen = c.last
                stats = c.stats()
        print(format_latencies(stats), file=sys.stderr)
        print(format_split(gen.stats), file=sys.stderr)
        return 0
    except (StartError, DeltafinError) as e:
        print(f"deltafin-run: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def main(argv=None) -> int:
    p = argparse.ArgumentParser(formatter_class=Help, prog="deltafin-run", description="Generate once: start the runtime, "
                                "stream the answer, print stage latencies, shut down.")
    p.add_argument("--model", required=True, help="expert store directory (deltafin-convert output)")
    p.add_argument("--prompt", required=True, help="the prompt (a user message with --chat)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most")
    p.add_argument("--memory-budget", help="bound for the whole process tree, e.g. 6GiB (default: config)")
    p.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    p.add_argument("--seed", type=int, help="sampling seed (default: none, a fresh one)")
    p.add_argument("--config", help="TOML file overriding configs/default.toml")
    p.add_argument("--max-slots", type=int, help="upper bound on expert slots (cache.max_slots)")
    p.add_argument("--policy", help="slot replacement policy (cache.policy)")
    p.add_argument("--record-trace", metavar="OUT.npz", help="record the routing of every token processed")
    p.add_argument("--routing-trace", metavar="TRACE.npz", help="route MoE layers from this trace, not the gate")
    p.add_argument("--standin", action="store_true", help="replace each layer's math by a wait")
    p.add_argument("--standin-moe-ms", type=float, metavar="MS", help="stand-in wait per MoE layer (default: config)")
    p.add_argument("--standin-dense-ms", type=float, metavar="MS", help="stand-in wait per dense layer (default: config)")
    a = p.parse_args(argv)
    return run_once(a.model, a.prompt, a.max_tokens, a.memory_budget, a.chat, a.temperature,
                    a.top_p, a.seed, a.config, supervisor_args=supervisor_flags(a))


def supervisor_flags(a: argparse.Namespace) -> list[str]:
    """The cache and benchmark flags, passed on to deltafin-supervisor as given."""
    out = ["--standin"] if a.standin else []
    for flag in ("max_slots", "policy", "record_trace", "routing_trace", "standin_moe_ms", "standin_dense_ms"):
        value = getattr(a, flag)
        if value is not None:
            out += [f"--{flag.replace('_', '-')}", str(value)]
    return out


if __name__ == "__main__":
    sys.exit(main())
