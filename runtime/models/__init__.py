"""Forward passes of the supported MoE architectures, looked up by config["model_type"]."""

from .base import KVCache, UnsupportedArchitecture
from .decoder import MoETransformer
from .deepseek_v2 import DeepseekV2
from .deepseek_v3 import DeepseekV3
from .mixtral import Mixtral
from .olmoe import Olmoe
from .qwen2_moe import Qwen2Moe
from .qwen3_moe import Qwen3Moe
from .switch import ResidentExperts, switch_glu

MODELS = {
    "mixtral": Mixtral,
    "qwen2_moe": Qwen2Moe,
    "qwen3_moe": Qwen3Moe,
    "olmoe": Olmoe,
    "deepseek_v2": DeepseekV2,
    "deepseek_v3": DeepseekV3,
    "kimi_k2": DeepseekV3,  # Kimi-K2 ships the DeepSeek-V3 architecture under its own name
}


def build_model(config: dict, weights: dict, dense_quantization: dict | None = None, dtype="auto"):
    """config: the checkpoint's config.json; weights: dense (non-routed-expert) tensors by name;
    dense_quantization: mlx-lm's `quantization` dict or None; dtype: "auto", a name or an mx.Dtype."""
    model_type = config.get("model_type")
    if model_type not in MODELS:
        raise UnsupportedArchitecture(
            f"model_type {model_type!r} is not supported; supported: {', '.join(sorted(MODELS))}")
    return MODELS[model_type](config, weights, dense_quantization, dtype)


__all__ = ["MODELS", "build_model", "KVCache", "MoETransformer", "ResidentExperts", "UnsupportedArchitecture",
           "switch_glu"]
