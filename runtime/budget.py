"""The memory budget: what the process tree needs besides experts, and how many experts fit.

Two steps. Before starting workers, an estimate refuses budgets that cannot work. After the
workers are up (dense weights loaded), the tree's proportional set size is measured. From the
budget minus that, minus reserves for what grows while serving (KV cache, MLX's buffer cache,
activations, logits), come the two expert tiers (runtime/tiers.py): first the staging tier, a
small fixed ring of shared-memory slots the loader reads into; then the resident tier, MLX
memory in compute holding the experts it uses, which gets all the rest.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from deltafin.runtime import archinfo, tiers
from deltafin.runtime.config import Config, format_size
from deltafin.runtime.layerkinds import prefix_unsupported
from deltafin.runtime.dtypes import FLOAT_DTYPES, itemsize as dtype_itemsize
from deltafin.runtime.store import Store
from deltafin.runtime.tensorfile import read_header

PROCESS_OVERHEAD_FLOOR = 64 << 20  # the smallest tree measured (no metrics threads, small MLX heap)
PROCESS_OVERHEAD_ESTIMATE = 128 << 20  # 4 interpreters + MLX + metrics threads, before dense weights: measured 98-105 MiB PSS on Linux
MARGIN = 32 << 20
MEASURE_QUANTUM = 8 << 20  # the measured tree is rounded up to this, so launches alike size the pool alike
FEW_SLOTS = 0.25  # a share of the experts below which the plan says what would give more
CONTEXT_FLOOR = 512  # compute.fit_context lowers max_context no further than this
# llguidance's token table in compute (workers/structured.TokenTable, built on the first
# json_schema or tool_choice request), per vocabulary entry. Measured (RSS of the process once
# the table is built and the parse's freed memory is handed back, plus one grammar and its mask):
# 38.8 MiB for the demo store's 49,152 tokens (830 B each), 37.3 MiB for a 32,000-entry table of
# GLM-4.5's tokenizer (1,220 B each), 3.1 MiB for the tiny stores' 603; the larger rate, rounded up.
TOKEN_TABLE_BYTES_PER_TOKEN = 1280


class BudgetError(RuntimeError):
    pass


def kv_bytes_per_token(config: dict, itemsize: int) -> int:
    """Bytes every layer's cache holds for one position (archinfo.layer_caches)."""
    return sum(kind.nbytes(1, itemsize) for kind in archinfo.layer_caches(config))


def kv_reserve_tokens(max_context: int, kv_tokens: int = 0) -> int:
    """Positions the KV reserve holds, shared by the sequences decoded together
    (compute.kv_tokens; never fewer than one max_context sequence)."""
    return max(int(kv_tokens), int(max_context))


def kv_reserve_bytes(config: dict, itemsize: int, max_context: int, kv_tokens: int = 0, sequences: int = 1) -> int:
    """The KV reserve: what the layers' caches hold at kv_reserve_tokens positions shared by up to
    `sequences` sequences (compute.max_batch), each layer's as its kind says (a window holds less
    than every position, a recurrent state the same bytes per sequence at any length)."""
    tokens = kv_reserve_tokens(max_context, kv_tokens)
    return sum(kind.reserve_bytes(tokens, sequences, itemsize) for kind in archinfo.layer_caches(config))


def sequence_cache_bytes(config: dict, n_tokens: int, itemsize: int) -> int:
    """What one sequence's caches may grow to holding n_tokens positions (admission charges it):
    growing caches allocate whole steps, windows and recurrent states stay bounded."""
    return sum(kind.grown_bytes(n_tokens, itemsize) for kind in archinfo.layer_caches(config))


def prompt_cache_bytes(model_config: dict, config: Config) -> int:
    """The prompt cache's reserve (compute.prompt_cache; 0 where the family cannot use one, or
    the distributed ranks, which run without it)."""
    if prefix_unsupported(archinfo.layer_caches(model_config)) or config.distributed.enabled:
        return 0
    return config.compute.prompt_cache_bytes


@dataclass
class BudgetPlan:
    budget: int
    dense: int
    kv_cache: int
    mlx_cache: int          # MLX's buffer cache is capped to this (freed buffers kept for reuse)
    activations: int
    slot_bytes: int         # one staging slot: the largest record, rounded to the store alignment
    staging_slots: int
    group_experts: dict     # group -> experts it has
    resident_bytes: dict    # group -> bytes of one expert in the resident tier
    min_slots: int          # resident slots each group needs at least: one token's top_k
    processes: int = PROCESS_OVERHEAD_ESTIMATE
    frontend: int = 0       # with --http: the frontend's bodies in flight (it is measured with the tree)
    prompt_cache: int = 0   # compute.prompt_cache: prompt prefixes' keys and values kept across requests
    token_table: int = 0    # llguidance's token table for constrained decoding (stores with a tokenizer)
    resident: dict = field(default_factory=dict)  # group -> resident slots, once sized
    layouts: dict = field(default_factory=dict, repr=False)  # group -> record layout (set_dtype)

    @property
    def n_slots(self) -> int:
        return sum(self.resident.values())

    @property
    def staging(self) -> int:
        return self.staging_slots * self.slot_bytes

    @property
    def reserves(self) -> int:
        return (self.kv_cache + self.prompt_cache + self.mlx_cache + self.activations + self.frontend
                + self.token_table + MARGIN)

    @property
    def min_resident(self) -> int:
        return sum(self.min_slots * b for b in self.resident_bytes.values())

    @property
    def minimum(self) -> int:
        return self.dense + self.processes + self.reserves + self.staging + self.min_resident

    def set_dtype(self, name: str) -> None:
        """The resident tier holds float tensors in compute's dtype (known once compute is up:
        "auto" is the checkpoint's); name as MLX prints it, e.g. "mlx.core.bfloat16"."""
        itemsize = dtype_itemsize(name)
        if itemsize:
            self.resident_bytes = {g: tiers.resident_bytes(self.layouts[g], itemsize) for g in self.layouts}

    def describe(self) -> str:
        per = ", ".join(format_size(b) for b in self.resident_bytes.values())
        return (f"dense weights {format_size(self.dense)} + KV cache {format_size(self.kv_cache)} + "
                f"{f'prompt cache {format_size(self.prompt_cache)} + ' if self.prompt_cache else ''}"
                f"MLX cache {format_size(self.mlx_cache)} + activations {format_size(self.activations)} + "
                f"{f'token table {format_size(self.token_table)} + ' if self.token_table else ''}"
                f"{f'HTTP bodies {format_size(self.frontend)} + ' if self.frontend else ''}"
                f"processes {format_size(self.processes)} + {self.staging_slots} staging slots of "
                f"{format_size(self.slot_bytes)} + {self.min_slots} resident experts of {per}"
                f"{' per layout' if len(self.resident_bytes) > 1 else ''}")

    def check_before_start(self) -> None:
        """Before the workers exist their size is an estimate: refuse only a budget that cannot hold
        even the smallest process tree seen (PROCESS_OVERHEAD_FLOOR), and name the conservative
        minimum (PROCESS_OVERHEAD_ESTIMATE), which starts when passed back. Budgets in between
        start, and the measurement after start decides exactly."""
        estimate, self.processes = self.processes, PROCESS_OVERHEAD_FLOOR
        try:
            fits = self.budget >= self.minimum
        finally:
            self.processes = estimate
        if not fits:
            self.check()

    def check(self) -> None:
        if self.budget < self.minimum:
            raise BudgetError(f"memory budget {format_size(self.budget)} is below the minimum "
                              f"{format_size(self.minimum, up=True)} for this model ({self.describe()})")

    def size_pool(self, measured_tree: int, cap: int = 0) -> int:
        """Resident slots that fit once the workers are up (measured_tree already holds the dense
        weights), after the reserves and the staging tier; cap bounds them (0: none)."""
        measured = -(-measured_tree // MEASURE_QUANTUM) * MEASURE_QUANTUM
        self.processes = max(0, measured - self.dense)
        self.check()
        room = self.budget - measured_tree - self.reserves - self.staging
        self.resident = tiers.split_resident(self.group_experts, self.resident_bytes, room, cap)
        return self.n_slots

    def unplanned(self) -> int:
        """Budget bytes no part of the plan takes (where cache.max_slots capped the resident
        tier, or every expert fits): free for what a request needs beyond the reserves."""
        resident = sum(n * self.resident_bytes[g] for g, n in self.resident.items())
        return max(0, self.budget - self.dense - self.processes - self.reserves - self.staging - resident)

    def budget_for(self, n_resident: int) -> int:
        """The whole-tree budget that gives about n_resident resident experts (bench, tests)."""
        total = sum(self.group_experts.values())
        per = sum(self.group_experts[g] * self.resident_bytes[g] for g in self.group_experts) / max(1, total)
        return int(self.dense + self.processes + self.reserves + self.staging + n_resident * per)

    def estimated_slots(self, cap: int = 0) -> int:
        """Resident slots before the workers exist: the process tree at its estimate (cap:
        cache.max_slots, 0 none)."""
        room = self.budget - self.dense - self.processes - self.reserves - self.staging
        return sum(tiers.split_resident(self.group_experts, self.resident_bytes, room, cap).values())

    def streams(self, cap: int = 0) -> bool:
        """Whether the estimate before start leaves some expert out of the resident tier: what
        compute's process decides its MLX CUDA graphs on before its first kernel, while the pool
        is sized only once the workers are measured."""
        return self.estimated_slots(cap) < sum(self.group_experts.values())

    def explain(self, max_context: int, max_batch: int, chunk: int, note: str = "") -> list[str]:
        """The plan as lines a person reads at start: each part of the budget, the expert slots as
        a count and a share of all experts, and where the share is below FEW_SLOTS what gives
        more (a smaller max_context, a larger budget). The same inputs give the same lines."""
        total = sum(self.group_experts.values())
        slots = self.n_slots or self.estimated_slots()
        per = ", ".join(format_size(b) for b in self.resident_bytes.values())
        lines = [f"memory plan for a {format_size(self.budget)} budget:",
                 f"  dense weights      {format_size(self.dense)}",
                 f"  KV cache           {format_size(self.kv_cache)} (max_context {max_context} "
                 f"positions, shared by up to {max_batch} sequences)",
                 f"  activations        {format_size(self.activations)} (prefill chunk {chunk} tokens)",
                 f"  MLX buffer cache   {format_size(self.mlx_cache)}",
                 *([f"  token table        {format_size(self.token_table)} (constrained decoding's, "
                    f"{self.token_table // TOKEN_TABLE_BYTES_PER_TOKEN} tokens)"] if self.token_table else []),
                 f"  staging            {self.staging_slots} slots of {format_size(self.slot_bytes)}",
                 f"  processes          {format_size(self.processes)}"
                 + (f" + HTTP bodies {format_size(self.frontend)}" if self.frontend else ""),
                 f"  expert slots       {slots} of {total} experts ({slots / max(1, total):.0%}), {per} each"]
        if note:
            lines.append(f"  {note}")
        if slots < FEW_SLOTS * total:
            lines.append("  few slots: every miss reads from disk; more slots with "
                         + "; ".join(self.more_slots(max_context)))
        return lines

    def more_slots(self, max_context: int) -> list[str]:
        """What gives more slots: a quarter of max_context (its KV reserve shrinks in
        proportion where the layers keep every position), a budget giving FEW_SLOTS of the experts."""
        total = sum(self.group_experts.values())
        out = []
        if max_context // 4 >= CONTEXT_FLOOR // 2 and self.kv_cache:
            smaller = self.kv_cache - self.kv_cache // 4
            per = max(self.resident_bytes.values())
            out.append(f"--max-context {max_context // 4} (about {smaller // per} more)")
        want = -(-int(FEW_SLOTS * total * 100) // 100)
        out.append(f"--memory-budget {format_size(self.budget_for(want), up=True).replace(' ', '')} "
                   f"(about {want})")
        return out

    def to_dict(self) -> dict:
        out = asdict(self)
        del out["layouts"]
        return {**out, "n_slots": self.n_slots, "staging": self.staging, "minimum": self.minimum}


def fit_context(store: Store, config: Config, frontend: int = 0) -> str:
    """With compute.fit_context, a max_context whose KV reserve would leave the expert slots
    below FEW_SLOTS of the experts (estimated before start) is halved until it does not, down to
    CONTEXT_FLOOR; config.compute.max_context is set to what was chosen. Returns a line saying
    what was lowered and how to keep it ("" where nothing was)."""
    cc = config.compute
    if not cc.fit_context:
        return ""
    asked = context = cc.max_context
    total = sum(tiers.group_sizes(store).values())
    while context // 2 >= CONTEXT_FLOOR and _trial(store, config, context, frontend) < FEW_SLOTS * total:
        context //= 2
    if context == asked:
        return ""
    cc.max_context = context
    return (f"max_context lowered from {asked} to {context} so the KV reserve leaves room for experts; "
            f"--max-context {asked} (or compute.fit_context = false) keeps {asked}")


def _trial(store: Store, config: Config, max_context: int, frontend: int) -> int:
    plan = plan_budget(store, config, max_context)
    plan.frontend = frontend
    return plan.estimated_slots()


def plan_budget(store: Store, config: Config, max_context: int = 0) -> BudgetPlan:
    """The plan for this store and configuration (max_context: another context than the
    configuration's, for fit_context's trials)."""
    cc = config.compute
    cast = dtype_itemsize(cc.dtype)
    dense = 0
    for name in store.manifest["dense_files"]:
        for ref in read_header(store.path / name).values():
            if cast and ref.dtype in FLOAT_DTYPES:
                dense += ref.nbytes // ref.itemsize * cast
            else:
                dense += ref.nbytes
    itemsize = cast or 4
    hidden = int(store.config["hidden_size"])
    vocab = int(store.config["vocab_size"])
    chunk = cc.prefill_chunk
    plan = BudgetPlan(
        budget=config.runtime.budget_bytes,
        dense=dense,
        kv_cache=kv_reserve_bytes(store.config, itemsize, max_context or cc.max_context, cc.kv_tokens, cc.max_batch),
        prompt_cache=prompt_cache_bytes(store.config, config),
        token_table=vocab * TOKEN_TABLE_BYTES_PER_TOKEN
        if cc.constrained and (store.tokenizer_dir / "tokenizer.json").is_file() else 0,
        mlx_cache=2 * store.top_k * store.max_record_bytes,
        activations=chunk * (vocab * 4 * 2 + hidden * itemsize * 16),
        slot_bytes=store.max_record_bytes,
        staging_slots=tiers.staging_slots(store, config.loader.threads, config.cache.staging_slots),
        group_experts=tiers.group_sizes(store),
        resident_bytes=tiers.group_resident_bytes(store, cast),
        min_slots=store.top_k,
    )
    plan.layouts = {g: store.layouts[g] for g in plan.group_experts}
    return plan
