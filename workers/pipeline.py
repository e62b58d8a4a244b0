"""How compute overlaps its expert reads with its own work: one object, resolved once at start
from the backend and the [bench] section, handed to `SlotExperts` and reported in compute's stats
(`pipeline`). Nothing else on the hot path reads a setting.

"overlapped" is the runtime: each of its parts was measured faster where it is on
(docs/BENCHMARKS.md, settled questions); "sync" is the reference design deltafin-bench compares
with (deltafin-sync-lru): a layer waits for all its experts, fills go through MLX, the pools stay
where MLX puts them. The [bench] keys that remain are open or thin questions, each a bench mode.

Exactness decides one thing per backend: a layer computed in pieces (its hits first, each miss as
it lands) is the one-call result bit for bit only where a row's result does not depend on how many
rows the kernel call holds. On the MLX CPU backend it does not (tests/test_resident.py); on MLX
CUDA the quantized matmuls pick their kernel by row count, and a layer in pieces gave other greedy
tokens than the same layer in one call (H200, bfloat16, docs/BENCHMARKS.md "Exactness"). So on a
GPU every partial layer runs in one call once its experts are in: the result is the all-resident
one whatever the budget and whenever a read lands.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from deltafin.runtime.config import BenchConfig

CUDA_GRAPHS_ENV = "MLX_USE_CUDA_GRAPHS"


def on_gpu() -> bool:
    import mlx.core as mx
    return mx.default_device().type == mx.DeviceType.gpu


AUTO_SPIN_MS = 2.0


def resolved_spin_ms(bench: BenchConfig, gpu: bool) -> float:
    """bench.spin_ms as the workers run it: "auto" spins AUTO_SPIN_MS where compute runs on a GPU,
    whose host has cores to spare (H100, issue 28's store, 16 cores: 1.02x at 25%, 1.10x at 50%;
    docs/BENCHMARKS.md), and not on a CPU, where the spinning workers take the cores compute
    computes on (2 cores: the router's need 1.2-1.3 against 0.5-0.6 ms)."""
    if bench.spin_ms == "auto":
        return AUTO_SPIN_MS if gpu else 0.0
    return float(bench.spin_ms)


def cuda_graphs_env(bench: BenchConfig, gpu: bool, streams: bool, environ=os.environ) -> str | None:
    """"0" where compute's process should run MLX CUDA without CUDA graphs, else None (the
    environment left as it is; MLX's default is graphs on). Off where bench.cuda_graphs is false,
    or "auto" and the plan streams experts (`streams`: the budget's estimate before start leaves
    some out of the resident tier); only on a GPU, and a value set in the environment wins.
    Off, each kernel starts as it is encoded instead of once its graph of up to 20 nodes is: a
    partial layer's routing comes back to the host, so the device drains once per layer (H200,
    the `--init hf` 8 x 32 store at 25%, real processes: 1.10x; all resident graphs keep ~6%,
    docs/BENCHMARKS.md). The kernels are the same: greedy tokens equal mlx-lm's either way
    (tests/test_greedy_exact.py, on the H200)."""
    graphs = (not streams) if bench.cuda_graphs == "auto" else bench.cuda_graphs
    if not gpu or CUDA_GRAPHS_ENV in environ or graphs:
        return None
    return "0"


def use_cuda_graphs(bench: BenchConfig, gpu: bool, streams: bool) -> None:
    """Sets MLX_USE_CUDA_GRAPHS in this process (`cuda_graphs_env`); MLX reads it once, at its
    first kernel, so the compute process calls this before any."""
    value = cuda_graphs_env(bench, gpu, streams)
    if value is not None:
        os.environ[CUDA_GRAPHS_ENV] = value


@dataclass(frozen=True)
class Pipeline:
    hits_first: bool      # a layer's resident experts compute while its misses are read
    stream_misses: bool   # each miss computes as soon as its fill lands (fills in place only)
    host_fills: bool      # fills write the pools' memory with numpy where the backend allows it
    host_pools: bool      # MLX CUDA: the pools of slot groups that stream live in host memory
    early_fills: bool     # prefetch fills that landed are applied before a layer asks
    leases: bool          # the gate lookahead is also asked as a lease
    eager_layers: bool    # resident layers launched at once where a later layer reads back
    run_ahead: bool       # a partial layer computes on what is resident, checked one layer later
    fold_notes: bool = True  # hints and uses ride the need or lease after them (bench.fold_notes)
    launch_first: bool = False  # running ahead: launched before the previous layer is checked
    ahead_depth: int = 1  # running ahead: layers left unchecked after a layer's step
    ahead_launch: str = "pass"  # running ahead: launched and checked once per pass, or "layer" (bench.ahead_launch)
    foresight: bool = True  # running ahead: a miss's later layers foretell theirs (bench.foresight)
    ahead_waste: float = 1.0  # running ahead a pass at once: the read-back threshold (bench.ahead_waste)
    early_passes: bool = True  # running ahead a pass at once: the next launched before a token is read
    check_each: bool = False  # running ahead: each pending layer launched apart, checked once computed
    next_leases: bool = True  # running ahead: each partial layer's runner-up leased for the next token (bench.next_leases)
    defer_needs: bool = True  # running ahead a pass at once: the rest of the pass built while a need's reads land (bench.defer_needs)
    device_waits: bool = False  # running ahead a pass at once (MLX CUDA): lookups on the device, which waits for a miss (bench.device_waits)
    cuda_graphs: str = ""  # MLX_USE_CUDA_GRAPHS in this process ("": unset, MLX's default: graphs on CUDA)
    device_copies: bool = False  # MLX CUDA: those pools in device memory instead, filled by the driver
    batch_copies: bool = False  # those copies waited for once per acknowledgement, not per record (bench.batch_copies)

    @classmethod
    def resolve(cls, bench: BenchConfig, gpu: bool, standin: bool) -> "Pipeline":
        """"auto" early fills and eager layers where compute leaves the CPU to the reads (a GPU
        backend; early fills also in the stand-in); on the CPU backend they took cycles from
        compute (demo 0.97-0.98x). "auto" run ahead on a GPU, where a read-back per layer
        leaves the device idle while the host builds the next layer."""
        # taken as they are, whichever pipeline
        same = dict(eager_layers=gpu if bench.eager_layers == "auto" else bench.eager_layers,
                    cuda_graphs=os.environ.get(CUDA_GRAPHS_ENV, ""),  # as use_cuda_graphs left it
                    fold_notes=bench.fold_notes, launch_first=bench.launch_first,
                    ahead_depth=bench.ahead_depth, ahead_launch=bench.ahead_launch,
                    foresight=bench.foresight, ahead_waste=float(bench.ahead_waste),
                    early_passes=bench.early_passes, check_each=bench.check_each,
                    next_leases=bench.next_leases, defer_needs=bench.defer_needs)
        if bench.pipeline == "sync":
            return cls(hits_first=False, stream_misses=False, host_fills=False, host_pools=False,
                       early_fills=False, leases=False, run_ahead=False, **same)
        ahead = gpu if bench.run_ahead == "auto" else bench.run_ahead
        early = (gpu or standin) if bench.early_fills == "auto" else bench.early_fills
        # a layer in pieces is exact only where row counts do not pick kernels (not on a GPU)
        pieces = not gpu and bench.layer_pieces is not False
        host = not bench.device_pools
        copies = host and (gpu if bench.device_copies == "auto" else bool(bench.device_copies))
        waits = bool(bench.device_waits and gpu and ahead and bench.ahead_launch == "pass")
        return cls(hits_first=pieces, stream_misses=pieces and bench.stream_misses, host_fills=host,
                   host_pools=host, early_fills=early, leases=bench.leases, run_ahead=ahead,
                   device_copies=copies, batch_copies=copies and bench.batch_copies, device_waits=waits, **same)

    def report(self) -> dict:
        return asdict(self)
