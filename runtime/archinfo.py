"""What the store and converter need to know about each architecture's checkpoint layout.

Only the routed experts are special: where they sit in a checkpoint, which layers have them,
how many there are. Everything else is a dense tensor copied as it is.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

PROJS = ("gate_proj", "up_proj", "down_proj")


class UnsupportedArchitecture(ValueError):
    pass


@dataclass(frozen=True)
class ArchInfo:
    model_type: str
    block: str                 # module holding the experts: "mlp" or "block_sparse_moe"
    proj_names: dict           # checkpoint projection name -> canonical name
    experts_key: str           # config key with the routed expert count
    top_k_key: str = "num_experts_per_tok"


_STD = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}
ARCHS = {
    "mixtral": ArchInfo("mixtral", "block_sparse_moe",
                        {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}, "num_local_experts"),
    "qwen2_moe": ArchInfo("qwen2_moe", "mlp", _STD, "num_experts"),
    "qwen3_moe": ArchInfo("qwen3_moe", "mlp", _STD, "num_experts"),
    "olmoe": ArchInfo("olmoe", "mlp", _STD, "num_experts"),
    "deepseek_v2": ArchInfo("deepseek_v2", "mlp", _STD, "n_routed_experts"),
    "deepseek_v3": ArchInfo("deepseek_v3", "mlp", _STD, "n_routed_experts"),
}
# Kimi-K2 ships as model_type "kimi_k2" in some configs; it is deepseek_v3 underneath.
ALIASES = {"kimi_k2": "deepseek_v3"}


def arch_for(config: dict) -> ArchInfo:
    mt = config.get("model_type")
    mt = ALIASES.get(mt, mt)
    if mt not in ARCHS:
        raise UnsupportedArchitecture(
            f"unsupported architecture model_type={config.get('model_type')!r}; "
            f"supported: {', '.join(sorted(ARCHS))}")
    return ARCHS[mt]


def n_experts(config: dict) -> int:
    info = arch_for(config)
    for key in (info.experts_key, "num_experts", "num_local_experts", "n_routed_experts"):
        if config.get(key):
            return int(config[key])
    raise ValueError(f"config has no routed expert count ({info.experts_key})")


def top_k(config: dict) -> int:
    return int(config[arch_for(config).top_k_key])


def moe_layers(config: dict) -> list[int]:
    """Indices of the layers with routed experts."""
    info = arch_for(config)
    n = int(config["num_hidden_layers"])
    if info.model_type.startswith("deepseek"):
        first = int(config.get("first_k_dense_replace", 0))
        step = int(config.get("moe_layer_freq", 1))
        return [i for i in range(n) if i >= first and i % step == 0]
    if info.model_type in ("qwen2_moe", "qwen3_moe"):
        step = int(config.get("decoder_sparse_step", 1) or 1)
        skip = set(config.get("mlp_only_layers") or [])
        return [i for i in range(n) if i not in skip and (i + 1) % step == 0]
    return list(range(n))


def expert_pattern(info: ArchInfo) -> re.Pattern:
    """Per-expert tensors: model.layers.L.<block>.experts.E.<proj>.weight"""
    projs = "|".join(info.proj_names)
    return re.compile(rf"^model\.layers\.(\d+)\.{info.block}\.experts\.(\d+)\.({projs})\.weight$")


def stacked_pattern(info: ArchInfo) -> re.Pattern:
    """Stacked experts [E, out, in]: mlx-lm's switch_mlp (float or quantized with scales/biases)."""
    return re.compile(rf"^model\.layers\.(\d+)\.{info.block}\.switch_mlp\.({'|'.join(PROJS)})"
                      rf"\.(weight|scales|biases)$")


def fused_pattern(info: ArchInfo) -> re.Pattern:
    """transformers-5 fused experts: experts.gate_up_proj [E, 2I, H] and experts.down_proj [E, H, I]."""
    return re.compile(rf"^model\.layers\.(\d+)\.{info.block}\.experts\.(gate_up_proj|down_proj)$")
