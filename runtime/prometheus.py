"""The Prometheus text exposition (version 0.0.4) of a merged metrics snapshot (docs/PROTOCOL.md,
"Metrics stream") and the HTTP frontend's own counters, all named deltafin_*; counters end in
_total. The series of the metrics of runtime/metrics.py (METRICS, TOTALS) take their name, type
and help from those definitions.
"""
from __future__ import annotations

import math

from deltafin.runtime.metrics import BINS_PER_OCTAVE, METRICS, TOTALS


def _label(v) -> str:
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class Exposition:
    """Prometheus text exposition: one HELP and TYPE per family, then samples."""

    def __init__(self):
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_: str, samples) -> None:
        """samples: [(labels dict, value, suffix)]; families with no numeric sample are left out."""
        rows = [(lab, v, suf) for lab, v, suf in samples
                if isinstance(v, (int, float)) and math.isfinite(v)]
        if not rows:
            return
        self.lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
        for labels, value, suffix in rows:
            lab = ",".join(f'{k}="{_label(v)}"' for k, v in labels.items())
            self.lines.append(f"{name}{suffix}{{{lab}}} {float(value)!r}" if lab
                              else f"{name}{suffix} {float(value)!r}")

    def one(self, name, kind, help_, value, **labels) -> None:
        self.family(name, kind, help_, [(labels, value, "")])

    def metric(self, m, value) -> None:
        """One sample of a defined metric (runtime/metrics.py), under its own name, type and help."""
        self.one(m.prom, m.kind, m.help, value)

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def hist_buckets(hist) -> list[tuple[float, int]]:
    """runtime/metrics.py's log bins (bin i: [2^(i/8), 2^((i+1)/8)) microseconds, counts per bin)
    as Prometheus cumulative buckets: (upper bound in seconds, samples at or below)."""
    out, total = [], 0
    for i, n in sorted((int(i), int(n)) for i, n in hist or []):
        total += n
        out.append((2 ** ((i + 1) / BINS_PER_OCTAVE) * 1e-6, total))
    return out


def stage_samples(stages: dict) -> list:
    """The stage latency histograms as the samples of one Prometheus histogram family."""
    samples = []
    for stage in sorted(stages):
        s = stages[stage] or {}
        if not s.get("count"):
            continue
        for le, n in hist_buckets(s.get("hist")):
            samples.append(({"stage": stage, "le": f"{le:.6g}"}, n, "_bucket"))
        samples += [({"stage": stage, "le": "+Inf"}, s["count"], "_bucket"),
                    ({"stage": stage}, s.get("total_s") or 0.0, "_sum"),
                    ({"stage": stage}, s["count"], "_count")]
    return samples


def prometheus_text(snap: dict, http: dict) -> str:
    """The runtime's merged metrics snapshot and the frontend's own counters (http: `requests`
    {(path, status): n}, `cancelled`, `started`)."""
    e = Exposition()
    tot = snap.get("totals") or {}
    e.one("deltafin_up", "gauge", "1 while the runtime serves (workers alive, not restarting)",
          1 if snap.get("state") == "serving" and not snap.get("missing") else 0)
    e.one("deltafin_worker_restarts_total", "counter", "worker restarts since the supervisor started",
          snap.get("restarts"))
    for key, m in TOTALS.items():
        e.metric(m, tot.get(key))
    for key, m in METRICS.items():
        if m.prom and m.kind == "gauge":
            e.metric(m, snap.get(key))
    mem = snap.get("memory") or {}
    for key, help_ in (("budget", "memory budget of the process tree"),
                       ("tree_bytes", "proportional set size of the process tree"),
                       ("peak_tree_bytes", "largest tree_bytes sampled"),
                       ("startup_tree_bytes", "tree measured with the dense weights loaded"),
                       ("staging_bytes", "staging slots of the expert pool")):
        name = key if key.endswith("_bytes") else f"{key}_bytes"
        e.one(f"deltafin_memory_{name}", "gauge", help_, mem.get(key))
    pc = snap.get("prompt_cache") or {}
    e.one("deltafin_prompt_cache_bytes", "gauge", "bytes the prompt cache holds", pc.get("bytes"))
    e.one("deltafin_prompt_cache_capacity_bytes", "gauge", "the prompt cache's share of the budget",
          pc.get("capacity_bytes"))
    slots = snap.get("slots") or {}
    e.one("deltafin_expert_slots", "gauge", "resident expert slots", slots.get("n_slots"))
    e.one("deltafin_resident_experts", "gauge", "slots holding an expert", slots.get("resident"))
    procs = snap.get("processes") or {}
    for key, name, help_ in (("rss", "deltafin_process_resident_memory_bytes", "resident set size per process"),
                             ("pss", "deltafin_process_pss_bytes", "proportional set size per process"),
                             ("cpu_percent", "deltafin_process_cpu_percent", "CPU use per process")):
        e.family(name, "gauge", help_, [({"process": p}, v.get(key), "") for p, v in sorted(procs.items())])
    lat = METRICS["stage_latency"]
    e.family(lat.prom, lat.kind, lat.help, stage_samples(snap.get("stage_latency") or {}))
    e.family("deltafin_http_requests_total", "counter", "HTTP requests answered by the frontend",
             [({"path": p, "status": s}, n, "") for (p, s), n in sorted(http["requests"].items())])
    e.one("deltafin_http_streams_cancelled_total", "counter",
          "streams whose HTTP client disconnected before the end", http["cancelled"])
    e.one("deltafin_http_frontend_start_time_seconds", "gauge", "Unix time the frontend started",
          http["started"])
    return e.text()
