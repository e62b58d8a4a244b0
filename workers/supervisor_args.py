"""deltafin-supervisor's command line: its flags, and the run's configuration they override."""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from deltafin.runtime.cli import Help
from deltafin.runtime.config import load_config
from deltafin.runtime.dtypes import FLOAT_DTYPES
from deltafin.runtime.lossy import MODES as LOSSY_MODES
from deltafin.runtime.security import SecurityError
from deltafin.runtime.store import is_checkpoint
from deltafin.workers.frontend_process import parse_listen


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(formatter_class=Help, prog="deltafin-supervisor",
                                description="Run a deltafin model: router, loader and compute workers "
                                            "over shared memory, serving clients on a ZeroMQ endpoint.")
    p.add_argument("--model", required=True, help="a deltafin store; or a Hugging Face / mlx-lm checkpoint "
                   "directory or a model id in the local Hugging Face cache, converted once into a store "
                   "in the deltafin cache (tools/model_source.py)")
    p.add_argument("--download", action="store_true", help="with a model id missing from the Hugging Face "
                   "cache: fetch it first")
    p.add_argument("--memory-budget", help="bound for the whole process tree, e.g. 6GiB or 6G (powers of 1024), "
                                           "6GB (powers of 1000) (default: config, auto = half the memory)")
    p.add_argument("--endpoint", help="client endpoint, ipc://PATH (in a directory only you can open; "
                                      "the path must not exist) or tcp://127.0.0.1:PORT "
                                      "(default: ipc socket in a private run directory)")
    p.add_argument("--allow-remote", action="store_true",
                   help="allow tcp:// on non-loopback addresses; turns CURVE authentication on "
                        "(keys in runtime.keys_dir, docs/SECURITY.md)")
    p.add_argument("--config", help="TOML file overriding configs/default.toml")
    p.add_argument("--http", metavar="HOST:PORT",
                   help="also serve the OpenAI-compatible HTTP API (deltafin-http, docs/HTTP.md) "
                        "as a child process, restarted if it dies; loopback unless --allow-remote")
    p.add_argument("--api-key", help="with --http: require `Authorization: Bearer KEY` on every request "
                                      "but /health (default: $DELTAFIN_API_KEY, else none)")
    p.add_argument("--max-context", type=int, help="longest prompt + answer in tokens; given, it is kept "
                   "(default: config, 2048, lowered where its KV reserve would starve the expert slots)")
    p.add_argument("--prompt-cache", metavar="SIZE", help="memory for prompt prefixes kept across requests, "
                   "e.g. 64MiB (compute.prompt_cache; default: config, 0 = off)")
    p.add_argument("--dtype", choices=("auto", *FLOAT_DTYPES),
                   help="activation dtype (compute.dtype; default: config, auto = the checkpoint's)")
    p.add_argument("--max-slots", type=int, help="upper bound on expert slots (cache.max_slots)")
    p.add_argument("--no-constrained", action="store_true",
                   help="refuse json_schema / tool_choice requests and leave their token table out of the "
                        "budget (compute.constrained = false)")
    p.add_argument("--distributed", action="store_true",
                   help="join an mx.distributed group as one rank (run under mlx.launch, or with "
                        "MLX_RANK and MLX_HOSTFILE set): this tree reads, caches and computes only its "
                        "share of the experts; rank 0 serves clients (docs/DISTRIBUTED.md)")
    p.add_argument("--balance-trace", metavar="TRACE.npz",
                   help="with --distributed: share the experts among ranks by their use in this trace")
    p.add_argument("--policy", help="slot replacement policy (cache.policy)")
    p.add_argument("--prefetch", choices=("on", "off", "auto"), help="prefetch reads from routing prediction (cache.prefetch)")
    p.add_argument("--routing-history", metavar="TRACE.npz",
                   help="routing trace the router's predictor learns from at start (cache.routing_history)")
    lossy = p.add_argument_group("lossy modes, off by default (every stats reply, the monitor and the "
                                 "HTTP system_fingerprint name the setting; [lossy] in configs/default.toml)")
    lossy.add_argument("--lossy", choices=LOSSY_MODES, help="off: exact; cache_aware: a missing routed expert "
                       "may be replaced by a resident one scored within the margin (lossy.mode)")
    lossy.add_argument("--lossy-margin", type=float, metavar="M",
                       help="share of a token's gate-logit range a replacement may score below (lossy.margin)")
    lossy.add_argument("--lossy-max-share", type=float, metavar="S",
                       help="share of a token's top-k that may be replaced, at most (lossy.max_share)")
    bench = p.add_argument_group("benchmark modes (every stats report says which is on)")
    bench.add_argument("--record-trace", metavar="OUT.npz",
                       help="record the routing of every token processed (saved after each request)")
    bench.add_argument("--routing-trace", metavar="TRACE.npz",
                       help="route every MoE layer from this trace instead of the gate")
    bench.add_argument("--standin", action="store_true",
                       help="replace each layer's math by a wait; reads and messages stay real")
    bench.add_argument("--standin-moe-ms", type=float, metavar="MS", help="stand-in wait per MoE layer")
    bench.add_argument("--standin-dense-ms", type=float, metavar="MS", help="stand-in wait per dense layer")
    return p


def run_config(a: argparse.Namespace):
    """The run's configuration: the TOML file over the defaults, the flags over both; the run
    record gets absolute paths, which mean the same to every process that reads it."""
    absolute = lambda path: os.path.abspath(path) if path else None
    return load_config(a.config, {"runtime.memory_budget": a.memory_budget,
                                  "runtime.allow_remote": True if a.allow_remote else None,
                                  "compute.max_context": a.max_context, "compute.dtype": a.dtype,
                                  "compute.prompt_cache": a.prompt_cache,
                                  "compute.constrained": False if a.no_constrained else None,
                                  "compute.fit_context": False if a.max_context else None,
                                  "cache.max_slots": a.max_slots, "cache.policy": a.policy,
                                  "cache.prefetch": {"on": True, "off": False}.get(a.prefetch, a.prefetch),
                                  "cache.routing_history": absolute(a.routing_history),
                                  "distributed.enabled": True if a.distributed else None,
                                  "distributed.balance_trace": absolute(a.balance_trace),
                                  "runtime.record_trace": absolute(a.record_trace),
                                  "bench.routing_trace": absolute(a.routing_trace),
                                  "bench.standin": True if a.standin else None,
                                  "bench.standin_moe_ms": a.standin_moe_ms,
                                  "bench.standin_dense_ms": a.standin_dense_ms,
                                  "lossy.mode": a.lossy, "lossy.margin": a.lossy_margin,
                                  "lossy.max_share": a.lossy_max_share})


def check_http(a: argparse.Namespace) -> None:
    """A bad --http is refused before anything starts."""
    if a.http:
        try:
            parse_listen(a.http, a.allow_remote)
        except ValueError as e:
            raise SecurityError(str(e)) from None


def resolved_model(model: str, download: bool):
    """The store --model names: a checkpoint directory or a model id converted once (the same
    resolution as `deltafin chat`; the converter is loaded only then); any other folder as it is,
    so opening it says what it is (a store, a damaged one, a folder that holds none)."""
    path = Path(model).expanduser()
    if path.is_dir() and not is_checkpoint(path):
        return model
    from deltafin.tools.model_source import store_for
    return store_for(model, download)
