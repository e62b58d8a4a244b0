"""Benchmark modes (config [bench]): where the expert ids come from, and the stand-in's wait.

Normal mode (no [bench] keys) routes by the gate. `bench.routing_trace` routes every MoE layer from a
recorded trace (docs/TRACES.md), so a synthetic store is read in a real model's access pattern;
`bench.standin` replaces each layer's math by a wait (`StandInModel`, picked by workers/engine.py) and,
having no gate, routes from the trace or from seeded uniform random ids. Every stats report
carries `bench_mode`, so no figure is mistaken for the other mode's. numpy only: the supervisor
checks a trace against the store before any worker starts, without importing MLX (the
stand-in imports it when it runs).
"""
from __future__ import annotations

import os
import time

import numpy as np

from deltafin.runtime.config import BenchConfig, Config, ConfigError
from deltafin.runtime.store import Store
from deltafin.runtime.traces import TraceError, load_trace


def precise_wait(seconds: float) -> None:
    """Sleep, then spin through the last 0.2 ms: time.sleep alone overshoots by tens of µs, which
    summed over every layer would skew a stand-in run."""
    end = time.perf_counter() + seconds
    if seconds > 2e-4:
        time.sleep(seconds - 2e-4)
    while time.perf_counter() < end:
        pass


class StandInModel:
    """The model's call signature with each layer's math replaced by a wait: the MoE layers still
    request their experts and fill them (`fetch`), so reads, messages and copies stay real; the
    logits are zeros (greedy then picks token 0)."""

    def __init__(self, n_layers: int, moe_layers: list[int], vocab: int, moe_ms: float, dense_ms: float):
        self.n_layers, self.moe_layers, self.vocab = n_layers, set(moe_layers), vocab
        self.moe_s, self.dense_s = moe_ms / 1e3, dense_ms / 1e3

    def make_cache(self):
        return None  # no attention, so no KV cache

    def __call__(self, tokens, cache, experts):
        import mlx.core as mx  # here, not at import: the supervisor imports this module without MLX
        n = int(tokens.size) if isinstance(tokens, mx.array) else len(tokens)
        for i in range(self.n_layers):
            if i in self.moe_layers:
                precise_wait(self.moe_s)
                experts.fetch(i)
            else:
                precise_wait(self.dense_s)
        return mx.zeros((n, self.vocab), dtype=mx.float32)

    def forward_batch(self, tokens, caches, experts, float32=True):
        return self(tokens, None, experts)  # one sequence at a time (its scheduler's max_batch)


def load_routing_trace(store: Store, path: str) -> np.ndarray:
    """The trace's ids for this store's MoE layers [tokens, len(moe_layers), top_k], checked
    against the store, or a ConfigError that says what does not fit."""
    try:
        ids = load_trace(path).ids
    except TraceError as e:
        raise ConfigError(f"bench.routing_trace: {e}") from None
    where = f"bench.routing_trace {path}"
    tokens, layers, k = ids.shape
    if tokens == 0:
        raise ConfigError(f"{where}: the trace has no tokens")
    if k != store.top_k:
        raise ConfigError(f"{where}: the trace routes {k} experts per token, the store's model "
                          f"routes top_k={store.top_k}")
    if layers < len(store.moe_layers):
        raise ConfigError(f"{where}: the trace has {layers} MoE layers, the store has "
                          f"{len(store.moe_layers)}")
    ids = ids[:, :len(store.moe_layers)]  # a deeper trace: its first layers route ours
    if int(ids.max()) >= store.n_experts:
        raise ConfigError(f"{where}: expert id {int(ids.max())} is out of range for the store's "
                          f"{store.n_experts} experts per layer")
    return ids


class Routing:
    """Which experts each MoE layer uses: the gate's choice (normal), a trace's (bench.routing_trace)
    or seeded uniform random ones (the stand-in without a trace).

    The trace's layer axis is the MoE-layer ordinal; a pass over n tokens takes the trace's next n
    rows, one per token (a cursor over every token processed, wrapping around at the end). A pass
    begun ahead of need and then dropped (the decode loop launches the next pass before it knows
    the answer ended) is undone, so the trace and the random stream continue as if it never ran."""

    RANDOM_SEED = 0

    def __init__(self, store: Store, trace_path: str = "", random: bool = False):
        self.ordinal = {layer: j for j, layer in enumerate(store.moe_layers)}
        self.n_experts, self.top_k = store.n_experts, store.top_k
        self.trace, self.rng = None, None
        if trace_path:
            self.trace = load_routing_trace(store, trace_path)
            self.mode = f"trace:{trace_path}"
        elif random:
            self.rng = np.random.default_rng(self.RANDOM_SEED)
            self.mode = "random"
        else:
            self.mode = "gate"
        self.cursor = 0
        self.n = self.start = 0

    def begin_pass(self, n_tokens: int) -> dict:
        """A pass over n tokens starts; returns what `undo_pass` needs to take it back."""
        undo = {"cursor": self.cursor, "rng": self.rng.bit_generator.state if self.rng else None}
        self.n, self.start = n_tokens, self.cursor
        self.cursor += n_tokens
        return undo

    def undo_pass(self, undo: dict) -> None:
        self.cursor = undo["cursor"]
        if self.rng is not None:
            self.rng.bit_generator.state = undo["rng"]

    def choose(self, layer: int, gate_inds):
        """Expert ids [n, top_k] for this layer of the current pass. gate_inds: the gate's (an
        mx.array [..., top_k]), returned as it is, on the device (reading it back is the caller's
        choice: a sync); None where no gate ran (the stand-in). Trace and random ids: numpy."""
        if self.trace is not None:
            j = self.ordinal[layer]
            return self.trace[(self.start + np.arange(self.n)) % len(self.trace), j].astype(np.int64)
        if self.rng is not None:
            return np.argsort(self.rng.random((self.n, self.n_experts)), axis=1)[:, :self.top_k]
        return gate_inds

    def rows(self, n_tokens: int, used: list) -> np.ndarray:
        """A pass's ids [n, moe_layers, top_k] from its (layer, ids) uses, ids read back already."""
        rows = np.zeros((n_tokens, len(self.ordinal), self.top_k), dtype=np.uint16)
        for layer, ids in used:
            rows[:, self.ordinal[layer]] = np.asarray(ids).reshape(n_tokens, self.top_k)
        return rows


def bench_mode(store: Store, bench: BenchConfig, source: str = "slots") -> tuple[Routing, dict | None, dict]:
    """(routing, stand-in waits or None, the `bench_mode` report) from the [bench] section.
    source names where expert bytes come from: "slots" or "mmap". Raises ConfigError for a trace
    that does not fit the store."""
    standin = None
    if bench.standin:
        standin = {"moe_ms": float(bench.standin_moe_ms), "dense_ms": float(bench.standin_dense_ms)}
    routing = Routing(store, bench.routing_trace, random=standin is not None)
    return routing, standin, {"routing": routing.mode, "standin": standin, "expert_source": source}


def check_bench_config(store: Store, config: Config) -> dict:
    """What the supervisor checks before starting workers: the trace fits the store and a trace
    to record has a directory to go to. Returns the bench_mode report."""
    out = config.runtime.record_trace
    if out and not os.path.isdir(os.path.dirname(os.path.abspath(out))):
        raise ConfigError(f"runtime.record_trace {out}: its directory does not exist")
    history = config.cache.routing_history
    if history:
        try:
            ids = load_trace(history).ids
        except TraceError as e:
            raise ConfigError(f"cache.routing_history: {e}") from None
        if ids.shape[1] != len(store.moe_layers) or ids.max(initial=0) >= store.n_experts:
            raise ConfigError(f"cache.routing_history {history}: {ids.shape[1]} MoE layers of ids below "
                              f"{int(ids.max(initial=0)) + 1}; the store has {len(store.moe_layers)} MoE layers "
                              f"of {store.n_experts} experts")
    return bench_mode(store, config.bench)[2]
