"""deltafin-bench's contenders by name (tools/bench.py): deltafin's named modes, its prefetch
settings ("deltafin-pf:t=..:d=.."), its lossy settings ("deltafin-lossy@M[:S]"), the baselines and
the real peers; what flags and configuration sections each deltafin contender runs with, and
whether a name is one."""
from __future__ import annotations

from deltafin.runtime.config import load_config
from deltafin.tools.peer_runner import PEERS

# deltafin's named modes: the runtime, the reference design ("sync-lru": synchronous layers,
# LRU, bench.pipeline "sync") and one mode per question still open (docs/BENCHMARKS.md).
DELTAFIN_MODES = {
    "deltafin": [],
    "deltafin-sync-lru": ["--policy", "lru"],
    "deltafin-lfuda": ["--policy", "lfuda"],
    "deltafin-no-prefetch": ["--prefetch", "off"],  # the default policy (predictive), no prefetch
    "deltafin-chunked": [],  # the default with each record read as 1 MiB chunks by all threads
    "deltafin-yield": [],  # the default, prefetch and lease reads in 256 KiB pieces yielding to demand reads
    "deltafin-prefetch-0.7": [],  # the default, prefetch only from probability 0.7 (fewer bytes)
    "deltafin-no-stream-misses": [],  # the default with a layer's misses computed once all have landed
    "deltafin-no-leases": [],  # the default with gate lookahead as a hint only, not asked as a lease
    "deltafin-early-fills": [],  # the default with landed read-ahead fills taken before a layer asks
    "deltafin-no-early-fills": [],  # ... and without
    "deltafin-no-eager-layers": [],  # the default with no layer launched before the pass's next read-back
    "deltafin-no-run-ahead": [],  # the default with each partial layer's routing read back before its experts
    "deltafin-run-ahead": [],  # ... and with partial layers run ahead (the CPU too)
    "deltafin-device-pools": [],  # the default with streaming pools in device memory, filled through MLX
    "deltafin-host-pools": [],  # the default with streaming pools in host memory, written with numpy (MLX CUDA)
    "deltafin-prefetch-first": [],  # the default with the router planning prefetch before answering
    "deltafin-unfolded": [],  # the default with hints and uses sent alone, the router learning before reading
    "deltafin-launch-first": [],  # the default with a layer run ahead launched before the one before is checked
    "deltafin-one-ahead": [],  # the default with one lease or prefetch read in flight at most
    "deltafin-no-cuda-graphs": [],  # the default with MLX CUDA launching compute's kernels one by one
    "deltafin-cuda-graphs": [],  # ... and with them in CUDA graphs (MLX's default) though experts stream
    "deltafin-spin": [],  # the default with the workers polling 2 ms without sleeping after each message (a GPU's default)
    "deltafin-no-spin": [],  # the default with the workers sleeping in poll (a CPU's default)
    "deltafin-ahead-deep": [],  # the default with up to 8 layers run ahead left unchecked (launched first)
    "deltafin-ahead-layer": [],  # the default with each layer run ahead launched as built, checked at the next
    "deltafin-no-foresight": [],  # the default with a run-ahead miss foretelling nothing of the layers after it
    "deltafin-early-passes": [],  # a streaming pass launched before the last token is read (the default since stop 51; kept for earlier commands)
    "deltafin-no-early-passes": [],  # ... and with the next pass launched once this token is read
    "deltafin-check-each": [],  # the default with the layers run ahead checked one by one as the device has them
    "deltafin-next-leases": [],  # each partial layer's runner-up leased for the next token (the default since stop 58; kept for earlier commands)
    "deltafin-no-next-leases": [],  # the default without the next token's leases
    "deltafin-no-defer-needs": [],  # the default with a need's reads waited for before the rest of the pass is built
    "deltafin-device-waits": [],  # the default with lookups on the device, which waits for a missing expert (MLX CUDA)
    "deltafin-no-fold-sends": [],  # the default with a message per lease and per fill's acknowledgement
    "deltafin-batch-copies": [],  # the driver's copies waited for once per acknowledgement (the default since stop 62; kept for earlier commands)
    "deltafin-no-batch-copies": [],  # the default with a wait per record for the driver's copies
    "deltafin-early-each": [],  # early passes and layers checked one by one (as deltafin-check-each since early passes are the default)
    "deltafin-unweighted": [],  # the default with victims chosen by probability alone (cache.weigh_misses off)
    "deltafin-demand-324k": [],  # demand reads in 324 KiB pieces by all threads (a quarter of issue 28's records), ahead reads whole and held behind them (the default on that store since bench.demand_pieces; kept for earlier commands)
    "deltafin-whole-reads": [],  # the default with every read one whole record (bench.demand_pieces 1), ahead reads not held behind demand reads
}
# Modes' settings that have no flag of their own: written to a TOML file passed with --config.
DELTAFIN_MODE_CONFIG = {
    "deltafin-sync-lru": {"bench": {"pipeline": "sync"}},
    "deltafin-chunked": {"bench": {"chunk_bytes": 1 << 20}},
    "deltafin-yield": {"bench": {"ahead_piece_bytes": 256 << 10}},
    "deltafin-prefetch-0.7": {"cache": {"prefetch_threshold": 0.7}},
    "deltafin-no-stream-misses": {"bench": {"stream_misses": False}},
    "deltafin-no-leases": {"bench": {"leases": False}},
    "deltafin-early-fills": {"bench": {"early_fills": True}},
    "deltafin-no-early-fills": {"bench": {"early_fills": False}},
    "deltafin-no-eager-layers": {"bench": {"eager_layers": False}},
    "deltafin-no-run-ahead": {"bench": {"run_ahead": False}},
    "deltafin-run-ahead": {"bench": {"run_ahead": True}},
    "deltafin-device-pools": {"bench": {"device_pools": True}},
    "deltafin-host-pools": {"bench": {"device_copies": False}},
    "deltafin-prefetch-first": {"bench": {"defer_prefetch": False}},
    "deltafin-unfolded": {"bench": {"fold_notes": False}},
    "deltafin-launch-first": {"bench": {"launch_first": True}},
    "deltafin-spin": {"bench": {"spin_ms": 2.0}},
    "deltafin-no-spin": {"bench": {"spin_ms": 0.0}},
    "deltafin-ahead-deep": {"bench": {"launch_first": True, "ahead_depth": 8}},
    "deltafin-ahead-layer": {"bench": {"ahead_launch": "layer"}},
    "deltafin-no-foresight": {"bench": {"foresight": False}},
    "deltafin-early-passes": {"bench": {"early_passes": True}},
    "deltafin-no-early-passes": {"bench": {"early_passes": False}},
    "deltafin-check-each": {"bench": {"check_each": True}},
    "deltafin-next-leases": {"bench": {"next_leases": True}},
    "deltafin-no-next-leases": {"bench": {"next_leases": False}},
    "deltafin-no-defer-needs": {"bench": {"defer_needs": False}},
    "deltafin-device-waits": {"bench": {"device_waits": True}},
    "deltafin-no-fold-sends": {"bench": {"fold_sends": False}},
    "deltafin-batch-copies": {"bench": {"batch_copies": True}},
    "deltafin-no-batch-copies": {"bench": {"batch_copies": False}},
    "deltafin-demand-324k": {"bench": {"chunk_bytes": 324 << 10, "ahead_piece_bytes": 4 << 20}},
    "deltafin-whole-reads": {"bench": {"demand_pieces": 1}},
    "deltafin-early-each": {"bench": {"early_passes": True, "check_each": True}},
    "deltafin-one-ahead": {"bench": {"ahead_reads": 1}},
    "deltafin-no-cuda-graphs": {"bench": {"cuda_graphs": False}},
    "deltafin-cuda-graphs": {"bench": {"cuda_graphs": True}},
    "deltafin-unweighted": {"cache": {"weigh_misses": False}},
}
# The real peers (tools/peer_runner.py) run their own layout of the mlx-lm checkpoint, routed by the
# model's own gate, with their expert budget at deltafin's share of the experts.
CONTENDERS = [*DELTAFIN_MODES, "mmap", "mlx-lm", *PEERS]
# The opt-in lossy mode as a contender: "deltafin-lossy@0.3" is the default with cache_aware routing
# at margin 0.3 (lossy.max_share: the config's), "deltafin-lossy@0.3:0.25" also sets max_share.
LOSSY_PREFIX = "deltafin-lossy@"
# Prefetch settings as contenders, for a sweep: "deltafin-pf:t=0.6:d=1" is the default with
# prefetch on at threshold 0.6, depth 1. Colons, not commas, so that --contenders still splits on
# commas.
PF_PREFIX = "deltafin-pf:"
# A peer at deltafin's measured peak memory: "mlx-vlm@mem" is mlx-vlm with its expert budget moved
# by deltafin's peak tree PSS minus mlx-vlm's own, both measured earlier in the same round at an
# equal share of the experts (so deltafin and the peer come before it in --contenders).
EQUAL_MEMORY = "@mem"
PF_KEYS = {"t": ("prefetch_threshold", float), "d": ("prefetch_depth", int)}


def prefetch_mode(name: str) -> dict:
    """The [cache] overrides a "deltafin-pf:t=..:d=.." contender names; ValueError
    for a malformed one."""
    if not name.startswith(PF_PREFIX):
        raise ValueError(f"{name}: not a {PF_PREFIX} contender")
    cache: dict = {"prefetch": True}
    for part in name[len(PF_PREFIX):].split(":"):
        key, _, value = part.partition("=")
        if key not in PF_KEYS or not value:
            raise ValueError(f"{name}: {part!r} is not t=<threshold> or d=<depth>")
        field_name, conv = PF_KEYS[key]
        try:
            cache[field_name] = conv(value)
        except (KeyError, ValueError):
            raise ValueError(f"{name}: bad value in {part!r}") from None
    load_config(None, {f"cache.{k}": v for k, v in cache.items()})  # the config's own range checks
    return cache


def lossy_flags(margin: float, max_share: float | None = None) -> list[str]:
    """deltafin-supervisor's (and deltafin-eval's) flags for cache_aware routing at a margin."""
    share = [] if max_share is None else ["--lossy-max-share", f"{max_share:g}"]
    return ["--lossy", "cache_aware", "--lossy-margin", f"{margin:g}", *share]


def lossy_mode(name: str) -> list[str]:
    """The flags a "deltafin-lossy@M[:S]" contender names; ValueError for a malformed one."""
    if not name.startswith(LOSSY_PREFIX):
        raise ValueError(f"{name}: not a {LOSSY_PREFIX} contender")
    parts = name[len(LOSSY_PREFIX):].split(":")
    try:
        if len(parts) > 2:
            raise ValueError
        margin, share = float(parts[0]), (float(parts[1]) if len(parts) == 2 else None)
    except ValueError:
        raise ValueError(f"{name}: not {LOSSY_PREFIX}<margin> or {LOSSY_PREFIX}<margin>:<max_share>") from None
    load_config(None, {"lossy.mode": "cache_aware", "lossy.margin": margin,  # the config's own range checks
                       **({"lossy.max_share": share} if share is not None else {})})
    return lossy_flags(margin, share)


def is_deltafin(name: str) -> bool:
    return name in DELTAFIN_MODES or name.startswith((PF_PREFIX, LOSSY_PREFIX))


def mode_flags(name: str) -> list[str]:
    return lossy_mode(name) if name.startswith(LOSSY_PREFIX) else DELTAFIN_MODES.get(name, [])


def mode_config(name: str) -> dict | None:
    """The TOML sections a deltafin mode writes for --config (None: no file)."""
    if name.startswith(PF_PREFIX):
        return {"cache": prefetch_mode(name)}
    return DELTAFIN_MODE_CONFIG.get(name)


def bad_contender(name: str) -> str | None:
    if name in CONTENDERS:
        return None
    if name.endswith(EQUAL_MEMORY) and name[:-len(EQUAL_MEMORY)] in PEERS:
        return None
    if name.startswith((PF_PREFIX, LOSSY_PREFIX)):
        try:
            (prefetch_mode if name.startswith(PF_PREFIX) else lossy_mode)(name)
            return None
        except Exception as e:  # ValueError or the config's ConfigError
            return str(e)
    return name
