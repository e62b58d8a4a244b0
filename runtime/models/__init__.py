"""Forward passes of the supported MoE architectures: one module per family, found through the
family registry (runtime/archinfo.py, ARCHS) by config["model_type"]."""

from importlib import import_module

from deltafin.runtime import archinfo
from deltafin.runtime.archinfo import UnsupportedArchitecture

from .switch import ResidentExperts, switch_glu


def model_class(config: dict):
    """The class of the family's forward pass (archinfo.ArchInfo.model, "module.Class")."""
    module, name = archinfo.arch_for(config).model.rsplit(".", 1)
    return getattr(import_module(f"{__name__}.{module}"), name)


def build_model(config: dict, weights: dict, dense_quantization: dict | None = None, dtype="auto"):
    """config: the checkpoint's config.json; weights: dense (non-routed-expert) tensors by name;
    dense_quantization: mlx-lm's `quantization` dict or None; dtype: "auto", a name or an mx.Dtype."""
    return model_class(config)(config, weights, dense_quantization, dtype)


__all__ = ["build_model", "model_class", "ResidentExperts", "UnsupportedArchitecture", "switch_glu"]
