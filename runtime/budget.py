"""The memory budget: what the process tree needs besides expert slots, and what is left for them.

Two steps. Before starting workers, an estimate refuses budgets that cannot work. After the
workers are up (dense weights loaded), the tree's proportional set size is measured, and the
slot pool gets the budget minus that, minus reserves for what grows while serving (KV cache,
staging copies of one chunk of experts, activations, logits).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import psutil

from deltafin.runtime.config import Config, format_size
from deltafin.runtime.store import Store
from deltafin.runtime.tensorfile import FLOAT_DTYPES, read_header

PROCESS_OVERHEAD_ESTIMATE = 96 << 20  # 4 interpreters + MLX, before dense weights: measured 66 MiB PSS on Linux
MARGIN = 32 << 20
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


class BudgetError(RuntimeError):
    pass


def kv_bytes_per_token(config: dict, itemsize: int) -> int:
    layers = int(config["num_hidden_layers"])
    heads = int(config["num_attention_heads"])
    if config.get("kv_lora_rank"):  # MLA: bounded by full per-head keys and values
        per = heads * (int(config["qk_nope_head_dim"]) + int(config["qk_rope_head_dim"])
                       + int(config["v_head_dim"]))
    else:
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
        per = 2 * kv_heads * head_dim
    return layers * per * itemsize


@dataclass
class BudgetPlan:
    budget: int
    dense: int
    kv_cache: int
    staging: int
    activations: int
    slot_bytes: int
    min_slots: int
    processes: int = PROCESS_OVERHEAD_ESTIMATE
    n_slots: int = 0

    @property
    def reserves(self) -> int:
        return self.kv_cache + self.staging + self.activations + MARGIN

    @property
    def minimum(self) -> int:
        return self.dense + self.processes + self.reserves + self.min_slots * self.slot_bytes

    def describe(self) -> str:
        return (f"dense weights {format_size(self.dense)} + KV cache {format_size(self.kv_cache)} + "
                f"staging {format_size(self.staging)} + activations {format_size(self.activations)} + "
                f"processes {format_size(self.processes)} + {self.min_slots} expert slots of "
                f"{format_size(self.slot_bytes)}")

    def check(self) -> None:
        if self.budget < self.minimum:
            raise BudgetError(f"memory budget {format_size(self.budget)} is below the minimum "
                              f"{format_size(self.minimum, up=True)} for this model ({self.describe()})")

    def size_pool(self, measured_tree: int) -> int:
        """Slots that fit once the workers are up; measured_tree already holds the dense weights."""
        self.processes = max(0, measured_tree - self.dense)
        self.check()
        self.n_slots = int((self.budget - measured_tree - self.reserves) // self.slot_bytes)
        return self.n_slots

    def to_dict(self) -> dict:
        return {**asdict(self), "minimum": self.minimum}


def plan_budget(store: Store, config: Config) -> BudgetPlan:
    cc = config.compute
    cast = ITEMSIZE.get(cc.dtype)
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
    return BudgetPlan(
        budget=config.runtime.budget_bytes,
        dense=dense,
        kv_cache=kv_bytes_per_token(store.config, itemsize) * cc.max_context,
        staging=2 * store.top_k * store.max_record_bytes,
        activations=chunk * (vocab * 4 * 2 + hidden * itemsize * 16),
        slot_bytes=store.max_record_bytes,
        min_slots=store.top_k,
    )


def tree_memory(pids: list[int]) -> int:
    """Proportional set size of the processes (shared pages split among their users); RSS where
    the OS has no PSS (macOS), which over-counts shared memory and so stays on the safe side."""
    total = 0
    for pid in pids:
        try:
            info = psutil.Process(pid).memory_full_info()
            total += getattr(info, "pss", None) or info.rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total
