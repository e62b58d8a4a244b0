"""The registry of model families: what the runtime knows of each without MLX.

One `ArchInfo` per family (`ARCHS`, the one list of supported architectures): where its routed
experts sit in a checkpoint (the store and converter copy every other tensor as it is), which
layers have them, the cache each layer's attention keeps (runtime/layerkinds.py: the budget and
admission size caches from it), and the module of runtime/models holding its forward pass
(`build_model` imports it from here).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from deltafin.runtime.layerkinds import CacheKind, FullKV, LatentKV, RecurrentState, SlidingKV

PROJS = ("gate_proj", "up_proj", "down_proj")


class UnsupportedArchitecture(ValueError):
    pass


class ConfigMismatch(ValueError):
    """A supported family's config without a key the family reads (or with it null): most often
    another family's config under this model_type."""


# ---------------------------------------------------------------- which layers have routed experts

def every_layer(config: dict) -> list[int]:
    return list(range(int(config["num_hidden_layers"])))


def deepseek_moe_layers(config: dict) -> list[int]:
    """DeepSeek layout: dense up to first_k_dense_replace, then MoE every moe_layer_freq layers."""
    first = int(config.get("first_k_dense_replace", 0))
    step = int(config.get("moe_layer_freq", 1))
    return [i for i in every_layer(config) if i >= first and i % step == 0]


def dense_first_layers(config: dict) -> list[int]:
    """GLM-4.5 layout: every layer from first_k_dense_replace on has routed experts."""
    first = int(config.get("first_k_dense_replace", 0))
    return [i for i in every_layer(config) if i >= first]


def qwen_moe_layers(config: dict) -> list[int]:
    """Qwen-MoE layout: MoE every decoder_sparse_step layers except those in mlp_only_layers."""
    step = int(config.get("decoder_sparse_step", 1) or 1)
    skip = set(config.get("mlp_only_layers") or [])
    return [i for i in every_layer(config) if i not in skip and (i + 1) % step == 0]


# ---------------------------------------------------------------- the cache of each layer

def gqa_caches(config: dict) -> list[CacheKind]:
    """Grouped-query attention over every position in every layer."""
    heads = int(config["num_attention_heads"])
    width = int(config.get("num_key_value_heads") or heads) * int(
        config.get("head_dim") or config["hidden_size"] // heads)
    return [FullKV(width, width)] * int(config["num_hidden_layers"])


def gated_delta_caches(config: dict) -> list[CacheKind]:
    """Qwen3-Next / Qwen3.5 hybrids: every full_attention_interval-th layer is gated softmax
    attention (FullKV), the others Gated DeltaNet: a float32 state [value heads, value dim, key
    dim] and the short convolution's last kernel - 1 inputs of q, k and v."""
    interval = int(config.get("full_attention_interval", 4))
    nk, nv = int(config["linear_num_key_heads"]), int(config["linear_num_value_heads"])
    dk, dv = int(config["linear_key_head_dim"]), int(config["linear_value_head_dim"])
    linear = RecurrentState((nv, dv, dk), (int(config["linear_conv_kernel_dim"]) - 1, 2 * nk * dk + nv * dv), 4)
    full = gqa_caches(config)[0]
    return [full if (i + 1) % interval == 0 else linear for i in every_layer(config)]


def gpt_oss_caches(config: dict) -> list[CacheKind]:
    """gpt-oss: layer_types names each layer's attention (default: sliding then full, alternating);
    a sliding layer keeps its last sliding_window positions."""
    full = gqa_caches(config)[0]
    n = int(config["num_hidden_layers"])
    types = config.get("layer_types") or ["sliding_attention", "full_attention"] * (n // 2)
    window = SlidingKV(full.k_width, full.v_width, window=int(config["sliding_window"]))
    return [window if t == "sliding_attention" else full for t in types]


def _mla_widths(config: dict) -> tuple[int, int]:
    """MLA's per-head keys (no-position + rotary part) and values, elements per position."""
    heads = int(config["num_attention_heads"])
    k = heads * (int(config["qk_nope_head_dim"]) + int(config["qk_rope_head_dim"]))
    return k, heads * int(config["v_head_dim"])


def mla_expanded_caches(config: dict) -> list[CacheKind]:
    """MLA expanded per head (DeepSeek-V2): full keys and values."""
    return [FullKV(*_mla_widths(config))] * int(config["num_hidden_layers"])


def mla_latent_caches(config: dict) -> list[CacheKind]:
    """Absorbed MLA (DeepSeek-V3, Kimi-K2): the latent and the shared rotary key per position."""
    return [LatentKV(*_mla_widths(config))] * int(config["num_hidden_layers"])


def kimi_caches(config: dict) -> list[CacheKind]:
    """Kimi Linear / K3: the 1-based `linear_attn_config.kda_layers` keep KDA's float32 state
    [heads, head_dim, head_dim] and the short convolution's last kernel - 1 inputs of q, k and v;
    the others absorbed MLA (mlx-lm's width defaults: head_dim, no rotary part)."""
    lin = config["linear_attn_config"]
    heads, dim = int(lin["num_heads"]), int(lin["head_dim"])
    linear = RecurrentState((heads, dim, dim), conv_shape=(int(lin.get("short_conv_kernel_size", 4)) - 1,
                                                            3 * heads * dim), state_itemsize=4)
    head = config.get("head_dim")
    n = int(config["num_attention_heads"])
    full = LatentKV(n * int((config.get("qk_nope_head_dim") or head) + (config.get("qk_rope_head_dim") or 0)),
                    n * int(config.get("v_head_dim") or head))
    kda = set(lin["kda_layers"])
    return [linear if i + 1 in kda else full for i in every_layer(config)]


def kimi_moe_layers(config: dict) -> list[int]:
    return deepseek_moe_layers(config) if config.get("num_experts") else []


# ---------------------------------------------------------------- the activation of the routed experts

def swiglu_experts(config: dict) -> dict | None:
    """None: the experts' GLU is SwiGLU."""
    return None


def swiglu_oai_experts(config: dict) -> dict | None:
    """gpt-oss's clamped SwiGLU, as a record layout's quant names it (runtime/models/switch.py
    glu_activation; its alpha and limit are mlx-lm's constants, whatever the config says)."""
    return {"name": "swiglu_oai"}

def situ_experts(config: dict) -> dict | None:
    """Kimi K3's SiTU, as a record layout's quant names it (runtime/models/switch.py glu_activation)."""
    return {"name": "situ", "beta": float(config.get("activation_situ_beta") or 1.0),
            "linear_beta": config.get("activation_situ_linear_beta")}


# ---------------------------------------------------------------- the registry

@dataclass(frozen=True)
class ArchInfo:
    model_type: str
    model: str                 # "module.Class" of its forward pass in runtime/models
    block: str                 # module holding the experts: "mlp" or "block_sparse_moe"
    proj_names: dict           # checkpoint projection name -> canonical name
    experts_key: str           # config key with the routed expert count
    moe_layers: Callable[[dict], list[int]]        # config -> the layers with routed experts
    caches: Callable[[dict], list[CacheKind]]      # config -> each layer's cache kind
    top_k_key: str = "num_experts_per_tok"
    aliases: tuple = ()        # other model_type names of the same architecture
    activation: Callable[[dict], dict | None] = swiglu_experts  # config -> the experts' activation
    stacked: str = "switch_mlp"  # module of mlx-lm's stacked experts under `block`
    renames: tuple = ()        # (regex, replacement): checkpoint names -> the names the model reads


_STD = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}
_KIMI_EXPERTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
# The names mlx-lm's kimi sanitize maps: the Hugging Face layout's MoE block, router bias, short
# convolutions and attention-residual weights (Kimi K3's language_model. wrapper: `text_name`).
_KIMI_NAMES = ((r"\.block_sparse_moe\.gate\.e_score_correction_bias$", ".mlp.e_score_correction_bias"),
               (r"\.block_sparse_moe\.", ".mlp."),
               (r"\.([qkv])_conv1d\.weight$", r".\1_conv.conv.weight"),
               (r"_res\.(proj|norm)_weight$", r"_res_\1.weight"))
ARCHS = {a.model_type: a for a in (
    ArchInfo("mixtral", "mixtral.Mixtral", "block_sparse_moe", {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"},
             "num_local_experts", every_layer, gqa_caches),
    ArchInfo("qwen2_moe", "qwen2_moe.Qwen2Moe", "mlp", _STD, "num_experts", qwen_moe_layers, gqa_caches),
    ArchInfo("qwen3_moe", "qwen3_moe.Qwen3Moe", "mlp", _STD, "num_experts", qwen_moe_layers, gqa_caches),
    ArchInfo("olmoe", "olmoe.Olmoe", "mlp", _STD, "num_experts", every_layer, gqa_caches),
    ArchInfo("deepseek_v2", "deepseek_v2.DeepseekV2", "mlp", _STD, "n_routed_experts", deepseek_moe_layers,
             mla_expanded_caches),
    # Kimi-K2 ships the DeepSeek-V3 architecture under its own model_type
    ArchInfo("deepseek_v3", "deepseek_v3.DeepseekV3", "mlp", _STD, "n_routed_experts", deepseek_moe_layers,
             mla_latent_caches, aliases=("kimi_k2",)),
    ArchInfo("qwen3_next", "qwen3_next.Qwen3Next", "mlp", _STD, "num_experts", qwen_moe_layers, gated_delta_caches),
    # Qwen3.5 / Qwen3.6 MoE: every layer routed; checkpoints nest the language model (text_model)
    ArchInfo("qwen3_5_moe", "qwen3_5_moe.Qwen3_5Moe", "mlp", _STD, "num_experts", every_layer,
             gated_delta_caches),
    ArchInfo("glm4_moe", "glm4_moe.Glm4Moe", "mlp", _STD, "n_routed_experts", dense_first_layers, gqa_caches),
    ArchInfo("gpt_oss", "gpt_oss.GptOss", "mlp", _STD, "num_local_experts", every_layer, gpt_oss_caches,
             stacked="experts", activation=swiglu_oai_experts),
    ArchInfo("minimax_m2", "minimax.MiniMax", "block_sparse_moe",
             {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}, "num_local_experts", every_layer, gqa_caches),
    ArchInfo("kimi_linear", "kimi_linear.KimiLinear", "mlp", _KIMI_EXPERTS, "num_experts", kimi_moe_layers,
             kimi_caches, top_k_key="num_experts_per_token", renames=_KIMI_NAMES),
    ArchInfo("kimi_k3", "kimi_k3.KimiK3", "mlp", _KIMI_EXPERTS, "num_experts", kimi_moe_layers, kimi_caches,
             top_k_key="num_experts_per_token", activation=situ_experts, renames=_KIMI_NAMES),
)}
_BY_NAME = {name: a for a in ARCHS.values() for name in (a.model_type, *a.aliases)}


def arch_for(config: dict) -> ArchInfo:
    mt = config.get("model_type")
    if mt not in _BY_NAME:
        raise UnsupportedArchitecture(
            f"unsupported architecture model_type={mt!r}; supported: {', '.join(sorted(_BY_NAME))}")
    return _BY_NAME[mt]


def text_model(config: dict) -> dict:
    """The config of a checkpoint's language model: a checkpoint that nests it under `text_config`
    (Qwen3.5-MoE, Kimi K3) has its keys lifted over the top-level ones, the top-level model_type
    kept and the quantization entries named as `text_name` gives them; any other config as it is."""
    if not isinstance(config.get("text_config"), dict):
        return config
    flat = {**{k: v for k, v in config.items() if k != "text_config"}, **config["text_config"],
            "model_type": config["model_type"]}
    for key in ("quantization", "quantization_config"):
        if isinstance(config.get(key), dict):
            flat[key] = {text_name(k) or k: v for k, v in config[key].items()}
    return flat


_WRAPPERS = (("language_model.model.", "model."), ("model.language_model.", "model."),
             ("language_model.lm_head.", "lm_head."))
# what a multimodal checkpoint holds beside its language model (vision towers and projectors of
# Qwen3.5 and Kimi K3) and multi-token-prediction heads, which the decoder never runs
_NOT_TEXT = ("model.visual.", "vision_tower.", "vision_model.", "multi_modal_projector.", "mm_projector.",
             "mtp.", "model.mtp.", "language_model.model.mtp.")


def text_name(name: str) -> str | None:
    """A checkpoint tensor's name in the language model (`model.…`, `lm_head.…`): multimodal
    wrappers stripped (Hugging Face's model.language_model., mlx-lm's language_model.model.);
    None for the vision tower and multi-token-prediction heads, which the decoder never runs."""
    if name.startswith(_NOT_TEXT):
        return None
    for outer, inner in _WRAPPERS:
        if name.startswith(outer):
            return inner + name[len(outer):]
    return name


def n_experts(config: dict) -> int:
    info = arch_for(config)
    for key in (info.experts_key, "num_experts", "num_local_experts", "n_routed_experts"):
        if config.get(key):
            return int(config[key])
    raise ValueError(f"config has no routed expert count ({info.experts_key})")


def top_k(config: dict) -> int:
    return int(config[arch_for(config).top_k_key])


class _ReadConfig(dict):
    """A config that records the keys read from it that were absent or null, the latest last
    (a model may keep it: one entry per key)."""

    def __init__(self, config: dict):
        super().__init__(config)
        self.lacking: dict[str, None] = {}

    def _read(self, key) -> None:
        if dict.get(self, key) is None:
            self.lacking.pop(key, None)
            self.lacking[key] = None

    def __getitem__(self, key):
        self._read(key)
        return dict.__getitem__(self, key)

    def get(self, key, default=None):
        if default is None:
            self._read(key)
        return dict.get(self, key, default)


def read_config(read, config: dict):
    """read(config), where a KeyError for a key the config lacks, or a TypeError of a null value
    (int(None)), is raised as ConfigMismatch naming the key and the family."""
    traced = _ReadConfig(config)
    try:
        return read(traced)
    except KeyError as e:
        if not e.args or e.args[0] not in traced.lacking:
            raise
        key = e.args[0]
    except TypeError as e:
        if "NoneType" not in str(e) or not traced.lacking:
            raise
        key = list(traced.lacking)[-1]
    family = config.get("model_type")
    raise ConfigMismatch(f"the config has {'a null' if key in config else 'no'} {key!r}, which a {family} "
                         f"model needs: is this config another family's?") from None


def check_config(config: dict) -> None:
    """Raises ConfigMismatch unless the config holds what its family's routed experts and layer
    caches are computed from, in a shape a model can have (a layer picks 1 to n_experts experts;
    the MoE layers are among the layers); an unsupported model_type is arch_for's error, raised
    where the model is built."""
    if not isinstance(config, dict):
        raise ConfigMismatch(f"the model config is a {type(config).__name__}, not a JSON object")
    if config.get("model_type") not in _BY_NAME:
        return
    n, k, layers, _ = read_config(lambda c: (n_experts(c), top_k(c), moe_layers(c), layer_caches(c)), config)
    family = config.get("model_type")
    if not 1 <= k <= n:
        raise ConfigMismatch(f"{family} config: each token picks {k} of {n} experts per layer "
                             f"(num_experts_per_tok must be 1..{n})")
    n_layers = int(config["num_hidden_layers"])
    if any(not 0 <= layer < n_layers for layer in layers):
        raise ConfigMismatch(f"{family} config: MoE layers {layers} are not all among its "
                             f"{n_layers} layers")


def moe_layers(config: dict) -> list[int]:
    """Indices of the layers with routed experts."""
    return arch_for(config).moe_layers(config)


def layer_caches(config: dict) -> list[CacheKind]:
    """The cache kind of every layer, in layer order."""
    return arch_for(config).caches(config)


def store_name(info: ArchInfo, name: str) -> str:
    """A checkpoint tensor's (or quantization override's) name as the store and the model know it:
    the family's `renames` applied in order (most families: unchanged)."""
    for pattern, replacement in info.renames:
        name = re.sub(pattern, replacement, name)
    return name


def expert_pattern(info: ArchInfo) -> re.Pattern:
    """Per-expert tensors: model.layers.L.<block>.experts.E.<proj>.weight"""
    projs = "|".join(info.proj_names)
    return re.compile(rf"^model\.layers\.(\d+)\.{info.block}\.experts\.(\d+)\.({projs})\.weight$")


def stacked_pattern(info: ArchInfo) -> re.Pattern:
    """Stacked experts [E, out, in]: mlx-lm's switch_mlp (float or quantized with scales/biases),
    with per-expert output biases [E, out] where the family has them (gpt-oss)."""
    return re.compile(rf"^model\.layers\.(\d+)\.{info.block}\.{info.stacked}\.({'|'.join(PROJS)})"
                      rf"\.(weight|scales|biases|bias)$")


def fused_pattern(info: ArchInfo) -> re.Pattern:
    """transformers-5 fused experts: experts.gate_up_proj [E, 2I, H] and experts.down_proj [E, H, I]
    (gpt-oss: transposed, with gate_up_proj_bias [E, 2I] and down_proj_bias [E, H]; OpenAI's own
    gpt-oss checkpoints: mxfp4 _blocks [E, out, G, 16] and _scales [E, out, G], not transposed)."""
    return re.compile(rf"^model\.layers\.(\d+)\.{info.block}\.experts\.(gate_up_proj|down_proj)"
                      rf"(_bias|_blocks|_scales)?$")
