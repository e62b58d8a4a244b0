"""The configuration tree: configs/default.toml, an optional user file, then command-line flags.

Loaded and validated once, then passed explicitly; workers receive it as a plain dict.
"""
from __future__ import annotations

import math
import os
import re
import tomllib
from dataclasses import asdict, dataclass, field, fields
from importlib import resources
from pathlib import Path

import psutil

from deltafin.runtime.cache import policy_names
from deltafin.runtime.dtypes import FLOAT_DTYPES
from deltafin.runtime.lossy import MODES as LOSSY_MODES


def cache_dir() -> Path:
    """Where deltafin keeps what it makes once (converted stores, the demo's, benchmark stores,
    compiled kernels): $DELTAFIN_CACHE, else ~/.cache/deltafin."""
    return Path(os.environ.get("DELTAFIN_CACHE") or Path.home() / ".cache" / "deltafin")


class ConfigError(ValueError):
    pass


MAX_QUEUE = 4096  # requests waiting in compute, at most (each holds its request message)


# A bare letter and the IEC names are powers of 1024 (400M = 400MiB, as docker and ulimit read
# it); the SI names with B are powers of 1000 (6GB = 6 * 10^9 bytes). Case does not matter.
_UNITS = {"": 1, "b": 1, "k": 1024, "kib": 1024, "kb": 1000, "m": 1024**2, "mib": 1024**2,
          "mb": 1000**2, "g": 1024**3, "gib": 1024**3, "gb": 1000**3, "t": 1024**4, "tib": 1024**4,
          "tb": 1000**4}


def parse_size(text) -> int:
    """Bytes from a size: a number of bytes, or a number and a unit (512MiB, 512M, 6GB)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m[2].lower() not in _UNITS:
        raise ConfigError(f"cannot read size {text!r} (examples: 512MiB or 512M = 512 x 2^20 bytes, "
                          f"6GB = 6 x 10^9 bytes)")
    return round(float(m[1]) * _UNITS[m[2].lower()])


def format_size(n: int, up: bool = False) -> str:
    """Two decimals in the largest fitting unit; up=True rounds up, for a minimum that must
    still be enough when a user passes the printed figure back."""
    for unit, div in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= div:
            value = -(-n * 100 // div) / 100 if up else n / div
            return f"{value:.2f} {unit}"
    return f"{n} B"


@dataclass
class RuntimeConfig:
    memory_budget: str = "auto"
    endpoint: str = ""
    allow_remote: bool = False
    startup_timeout_s: float = 180.0
    warmup_timeout_s: float = 600.0  # from a worker's first start-up progress message (compute's GPU warm-up)
    control_timeout_s: float = 30.0
    record_trace: str = ""
    restart_max: int = 3
    restart_window_s: float = 300.0
    max_request_bytes: str = "16MiB"
    keys_dir: str = ""
    fork_server: bool = True
    kernel_cache: str = ""  # runtime/kernelcache.py: "" the user's cache directory, "mlx" MLX's /tmp default

    @property
    def request_bytes(self) -> int:
        return parse_size(self.max_request_bytes)

    @property
    def budget_bytes(self) -> int:
        if self.memory_budget == "auto":
            return psutil.virtual_memory().total // 2
        return parse_size(self.memory_budget)


@dataclass
class ComputeConfig:
    dtype: str = "auto"
    max_context: int = 2048
    fit_context: bool = True  # the supervisor may lower max_context for slots (runtime/budget.py, fit_context)
    prefill_chunk: int = 128
    expert_timeout_s: float = 60.0
    max_queue: int = 16
    max_batch: int = 8
    kv_tokens: int = 0
    prompt_cache: str = "0"  # the prompt cache's share of the budget (workers/prompt_cache.py)
    constrained: bool = True  # json_schema / tool_choice masks: their token table is in the budget
    # zero-expert passes before "ready" (Compute.warm_up): true, false, "auto" (on a GPU)
    warm_up: bool | str = field(default="auto", metadata={"types": (bool, str)})

    @property
    def prompt_cache_bytes(self) -> int:
        return parse_size(self.prompt_cache)

    @property
    def max_inflight(self) -> int:
        """Requests in flight at most, over all clients: those decoded together and the waiting ones."""
        return self.max_batch + self.max_queue


@dataclass
class CacheConfig:
    policy: str = "predictive"
    max_slots: int = 0
    staging_slots: int = 0
    preload: bool = True
    # whole layers kept resident apart from the rest (runtime/tiers.py): true, false, "auto"
    whole_layers: bool | str = field(default="auto", metadata={"types": (bool, str)})
    prefetch: bool | str = field(default="auto", metadata={"types": (bool, str)})
    prefetch_threshold: float = 0.4
    prefetch_depth: int = 3  # layers ahead the prefetcher reads for
    weigh_misses: bool = True  # predictive: a key no gate lookahead foresees weighs more (its miss costs a whole read)
    routing_history: str = ""  # a routing trace (.npz) the router's predictor learns from at start
    history_tokens: int = 4096  # of it, at most this many tokens (the last ones)


@dataclass
class LoaderConfig:
    threads: int = 4
    verify_checksums: bool = True


@dataclass
class BenchConfig:
    routing_trace: str = ""
    standin: bool = False
    standin_moe_ms: float = 0.31
    standin_dense_ms: float = 0.21
    pipeline: str = "overlapped"  # or "sync": the reference design (workers/pipeline.py)
    stream_misses: bool = True  # open questions, each a bench mode (docs/BENCHMARKS.md)
    leases: bool = True
    early_fills: bool | str = field(default="auto", metadata={"types": (bool, str)})
    eager_layers: bool | str = field(default="auto", metadata={"types": (bool, str)})
    # a layer with misses computed in pieces (its hits first, each miss as it lands): "auto" on a CPU,
    # where a call's row count picks no kernel; false runs a GPU's one call per layer on any backend
    layer_pieces: bool | str = field(default="auto", metadata={"types": (bool, str)})
    run_ahead: bool | str = field(default="auto", metadata={"types": (bool, str)})
    device_pools: bool = False  # streaming pools where MLX puts them, filled through MLX (deltafin-device-pools)
    # MLX CUDA: streaming pools in device memory, filled by the driver's copies (true / "auto": on a
    # GPU; false: in host memory, written with numpy, deltafin-host-pools)
    device_copies: bool | str = field(default="auto", metadata={"types": (bool, str)})
    chunk_bytes: int = 0  # one read's piece of a record (0: whole records, or demand_pieces)
    demand_pieces: int = 4  # a demand read's record in this many pieces read at once; ahead reads wait behind it
    ahead_piece_bytes: int = 0  # ahead reads in pieces, none started while a demand read is in flight (deltafin-yield)
    defer_prefetch: bool = True  # the router answers a need before planning the prefetch after it
    fold_notes: bool = True  # hints and uses ride the need or lease after them; its reads go out first
    launch_first: bool = False  # a layer running ahead is launched before the one before it is checked
    ahead_depth: int = 1  # layers that ran ahead left unchecked after a layer's step (1: one)
    ahead_launch: str = "pass"  # running ahead: the pass launched and checked at once, or each layer ("layer")
    foresight: bool = True  # running ahead: after a miss, the later layers' ids foretell their misses
    ahead_waste: float = 1.0  # running ahead a pass at once: a layer whose miss share x layers after it reaches this reads back
    early_passes: bool = True  # running ahead a pass at once: the next pass launched before this token is read
    check_each: bool = False  # running ahead: the layers pending launched apart, each checked once computed
    next_leases: bool = True  # running ahead: at a pass's end each partial layer's runner-up leased for the next token
    defer_needs: bool = True  # running ahead a pass at once: a need's reads overlap the build of the pass's rest
    device_waits: bool = False  # running ahead a pass at once (MLX CUDA): the device looks experts up and waits for a missing one
    fold_sends: bool = True  # a pass's leases in one message, fills applied together acknowledged in one
    batch_copies: bool = True  # driver copies: addressed directly, the fills acknowledged together waited for once
    # workers poll without sleeping this long (ms) after a message (and compute in a need's wait);
    # "auto": on a GPU AUTO_SPIN_MS (workers/pipeline.py), on a CPU 0
    spin_ms: float | str = field(default="auto", metadata={"types": (float, int, str)})
    ahead_reads: int = 0  # staging slots lease and prefetch reads may hold at once (0: half the ring)
    # MLX CUDA graphs in compute: "auto" off where the plan leaves experts out of the resident tier
    cuda_graphs: bool | str = field(default="auto", metadata={"types": (bool, str)})


@dataclass
class LossyConfig:
    """Opt-in settings that give up exactness for fewer reads (runtime/lossy.py). "off": every
    answer is bit for bit the one of the whole model in memory."""
    mode: str = "off"  # or "cache_aware"
    margin: float = 0.1
    max_share: float = 0.5


@dataclass
class HttpConfig:
    """The HTTP frontend's limits (deltafin-supervisor --http; docs/HTTP.md, "Limits")."""
    header_timeout_s: float = 10.0  # a request's head complete within this of the connection opening or the last answer
    body_timeout_s: float = 30.0    # a request's body complete within this of its head
    idle_timeout_s: float = 5.0     # a kept-alive connection with nothing to say is closed after this
    max_body_bytes: str = "4MiB"    # a larger body is refused with 413 while it arrives
    default_max_tokens: int = 0     # a chat request's max_tokens when it gives none (0: the rest of the context)

    @property
    def body_bytes(self) -> int:
        return parse_size(self.max_body_bytes)


@dataclass
class DistributedConfig:
    enabled: bool = False
    backend: str = "ring"
    timeout_s: float = 20.0
    balance_trace: str = ""


@dataclass
class Config:
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    compute: ComputeConfig = field(default_factory=ComputeConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    loader: LoaderConfig = field(default_factory=LoaderConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    lossy: LossyConfig = field(default_factory=LossyConfig)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict, where: str = "config") -> "Config":
        cfg = cls()
        for section, values in data.items():
            target = getattr(cfg, section, None)
            if target is None or not isinstance(values, dict):
                raise ConfigError(f"{where}: unknown section [{section}]")
            known = {f.name: f for f in fields(target)}
            for key, value in values.items():
                if key not in known:
                    raise ConfigError(f"{where}: unknown key {section}.{key}")
                want = type(getattr(target, key))
                types = known[key].metadata.get("types", (want,))  # a key of several types
                # a TOML boolean is a Python int: only a key that takes booleans takes one
                if float in types and isinstance(value, int) and not isinstance(value, bool):
                    value = float(value)
                if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
                    raise ConfigError(f"{where}: {section}.{key} must be "
                                      f"{' or '.join(t.__name__ for t in types)}")
                setattr(target, key, value)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        self._check_numbers()
        if self.runtime.memory_budget != "auto" and parse_size(self.runtime.memory_budget) <= 0:
            raise ConfigError(f"runtime.memory_budget {self.runtime.memory_budget!r} must be more than 0 bytes")
        if self.cache.policy not in (names := policy_names(online_only=True)):
            raise ConfigError(f"cache.policy {self.cache.policy!r} is not one of: {', '.join(names)}")
        if self.compute.dtype not in ("auto", *FLOAT_DTYPES):
            raise ConfigError(f"compute.dtype {self.compute.dtype!r}: use auto, {', '.join(FLOAT_DTYPES)}")
        if self.compute.max_context < 16 or self.compute.prefill_chunk < 1:
            raise ConfigError("compute.max_context must be >= 16 and prefill_chunk >= 1")
        if self.cache.max_slots < 0:
            raise ConfigError("cache.max_slots must be >= 0 (0: as many as the budget allows)")
        if self.cache.prefetch not in (True, False, "auto"):
            raise ConfigError(f"cache.prefetch {self.cache.prefetch!r}: use true, false or \"auto\"")
        for name, value in (("cache.whole_layers", self.cache.whole_layers),
                            ("compute.warm_up", self.compute.warm_up),
                            ("bench.early_fills", self.bench.early_fills),
                            ("bench.eager_layers", self.bench.eager_layers),
                            ("bench.layer_pieces", self.bench.layer_pieces),
                            ("bench.run_ahead", self.bench.run_ahead),
                            ("bench.cuda_graphs", self.bench.cuda_graphs),
                            ("bench.device_copies", self.bench.device_copies)):
            if value not in (True, False, "auto"):
                raise ConfigError(f"{name} {value!r}: use true, false or \"auto\"")
        if self.bench.pipeline not in ("overlapped", "sync"):
            raise ConfigError(f"bench.pipeline {self.bench.pipeline!r}: use \"overlapped\" or \"sync\"")
        if not 1 <= self.cache.prefetch_depth <= 16:
            raise ConfigError("cache.prefetch_depth must be within 1..16 (layers ahead)")
        if self.cache.history_tokens < 0:
            raise ConfigError("cache.history_tokens must be >= 0")
        if not 0.0 <= self.cache.prefetch_threshold <= 1.0:
            raise ConfigError("cache.prefetch_threshold must be within 0..1 (a probability of use)")
        if self.cache.staging_slots < 0:
            raise ConfigError("cache.staging_slots must be >= 0 (0: automatic)")
        if self.bench.standin_moe_ms < 0 or self.bench.standin_dense_ms < 0:
            raise ConfigError("bench.standin_moe_ms and bench.standin_dense_ms must be >= 0")
        spin = self.bench.spin_ms
        if spin != "auto" and (isinstance(spin, str) or spin < 0):
            raise ConfigError("bench.spin_ms must be >= 0 (0: sleep in poll) or \"auto\"")
        if self.bench.ahead_reads < 0:
            raise ConfigError("bench.ahead_reads must be >= 0 (0: half the staging ring)")
        if self.bench.ahead_launch not in ("layer", "pass"):
            raise ConfigError(f"bench.ahead_launch must be \"layer\" or \"pass\", not {self.bench.ahead_launch!r}")
        if not self.bench.ahead_waste > 0:
            raise ConfigError("bench.ahead_waste must be > 0 (layers computed in vain a read-back is worth)")
        if self.bench.ahead_depth < 1:
            raise ConfigError("bench.ahead_depth must be >= 1 (layers that ran ahead left unchecked)")
        if not 1 <= self.loader.threads <= 64:
            raise ConfigError("loader.threads must be within 1..64")
        if self.bench.chunk_bytes < 0:
            raise ConfigError("bench.chunk_bytes must be >= 0 (0: each record in one read)")
        if self.bench.demand_pieces < 1:
            raise ConfigError("bench.demand_pieces must be >= 1 (1: each demand read whole)")
        if self.bench.ahead_piece_bytes < 0:
            raise ConfigError("bench.ahead_piece_bytes must be >= 0 (0: ahead reads as demand reads are)")
        if self.runtime.restart_max < 0 or self.runtime.restart_window_s <= 0:
            raise ConfigError("runtime.restart_max must be >= 0 and runtime.restart_window_s > 0")
        from deltafin.protocol.messages import MAX_MESSAGE_BYTES
        if not 1024 <= parse_size(self.runtime.max_request_bytes) <= MAX_MESSAGE_BYTES:
            raise ConfigError(f"runtime.max_request_bytes must be within 1KiB..{MAX_MESSAGE_BYTES >> 20}MiB")
        if not 1024 <= self.http.body_bytes <= parse_size(self.runtime.max_request_bytes):
            raise ConfigError("http.max_body_bytes must be within 1KiB..runtime.max_request_bytes")
        if self.http.default_max_tokens < 0:
            raise ConfigError("http.default_max_tokens must be >= 0 (0: the rest of the context)")
        if self.distributed.backend not in ("ring", "jaccl", "mpi", "any"):
            raise ConfigError(f"distributed.backend {self.distributed.backend!r}: use ring, jaccl, mpi or any")
        if self.distributed.enabled:
            # the router's prefetch would read experts of other ranks' shares; the predictive
            # policy alone only ranks what this rank's router sees, its share
            if self.cache.prefetch is True:
                raise ConfigError("distributed.enabled: cache.prefetch is not supported yet (the router "
                                  "does not know its rank's share); use false or \"auto\" (off here)")
            self.cache.prefetch = False
        if not 1 <= self.compute.max_batch <= 256 or self.compute.kv_tokens < 0:
            raise ConfigError("compute.max_batch must be within 1..256 and compute.kv_tokens >= 0")
        parse_size(self.compute.prompt_cache)
        if not 0 <= self.compute.max_queue <= MAX_QUEUE:
            raise ConfigError(f"compute.max_queue must be within 0..{MAX_QUEUE}")
        self._check_lossy()

    def _check_lossy(self) -> None:
        lossy = self.lossy
        if lossy.mode not in LOSSY_MODES:
            raise ConfigError(f"lossy.mode {lossy.mode!r}: use {' or '.join(map(repr, LOSSY_MODES))}")
        if not 0.0 <= lossy.margin <= 1.0:
            raise ConfigError("lossy.margin must be within 0..1 (a share of a token's gate-logit range)")
        if not 0.0 < lossy.max_share <= 1.0:
            raise ConfigError("lossy.max_share must be within 0..1, above 0 (a share of a token's top-k)")
        if lossy.mode != "off" and self.distributed.enabled:
            raise ConfigError("lossy.mode: the ranks of distributed.enabled run exact only (use \"off\")")


    def _check_numbers(self) -> None:
        """Every float is finite (TOML has nan and inf) and every timeout is > 0."""
        for section in fields(self):
            part = getattr(self, section.name)
            for f in fields(part):
                value = getattr(part, f.name)
                if isinstance(value, float) and not math.isfinite(value):
                    raise ConfigError(f"{section.name}.{f.name} must be a finite number, got {value}")
                if f.name.endswith("timeout_s") and value <= 0:
                    raise ConfigError(f"{section.name}.{f.name} must be > 0 (seconds), got {value}")


def as_config(config: "Config | dict") -> Config:
    """The typed configuration: a Config as it is, a dict (a run's JSON, a test's sections)
    validated once into one; keys a dict leaves out take the documented defaults."""
    return config if isinstance(config, Config) else Config.from_dict(config)


def load_config(path: str | Path | None = None, overrides: dict | None = None) -> Config:
    """defaults.toml, then the user's file, then overrides {"section.key": value} (flags)."""
    data = tomllib.loads(resources.files("deltafin.configs").joinpath("default.toml").read_text())
    if path:
        try:
            user = tomllib.loads(Path(path).read_text())
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"{path}: {e}") from None
        for section, values in user.items():
            data.setdefault(section, {}).update(values if isinstance(values, dict) else {})
            if not isinstance(values, dict):
                raise ConfigError(f"{path}: {section} must be a [section]")
    for dotted, value in (overrides or {}).items():
        if value is not None:
            section, key = dotted.split(".")
            data.setdefault(section, {})[key] = value
    return Config.from_dict(data, str(path or "defaults"))
