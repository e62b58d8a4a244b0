"""Qwen3-Next: Gated DeltaNet linear attention on most layers and gated softmax attention (q/k
RMSNorm per head, partial rope) on every full_attention_interval-th one (gated_delta.py); softmax
top-k routing (optionally renormalised) with a shared expert under a sigmoid gate."""

from functools import partial

import mlx.core as mx

from deltafin.runtime.layerkinds import RecurrentState

from . import routing
from .base import Rope, rope_settings
from .decoder import GQAModel, gated_shared_moe
from .gated_delta import GatedAttention, GatedDeltaNet

# Norms Hugging Face checkpoints store zero-centred (the layer scales by 1 + weight); mlx-lm
# adds the 1 when it loads such a checkpoint (one whose conv1d weights are [channels, 1, kernel]).
CENTRED_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
                 ".q_norm.weight", ".k_norm.weight")


class Qwen3Next(GQAModel):
    default_rope_theta = 1e4
    norm_topk_default = False

    def configure(self, c):
        super().configure(c)
        theta, rotary, scaling = self.rope_parameters(c)
        self.rope = Rope(int(self.head_dim * rotary), theta, False, scaling)
        if any(k.endswith("conv1d.weight") and v.shape[-1] != 1 for k, v in self.w.items()):
            self.w.update(self.from_hugging_face())
            mx.eval(list(self.w.values()))  # inside the start-up measurement, as cast_weights does

    def from_hugging_face(self) -> dict:
        """The tensors a Hugging Face checkpoint stores otherwise than mlx-lm: conv1d weights
        [channels, 1, kernel] -> [channels, kernel, 1], zero-centred norms w -> 1 + w."""
        out = {k: v.moveaxis(2, 1) for k, v in self.w.items() if k.endswith("conv1d.weight")}
        out.update({k: v + 1.0 for k, v in self.w.items() if k.endswith(CENTRED_NORMS) and v.ndim == 1})
        return out

    def rope_parameters(self, c):
        """(theta, rotary fraction of head_dim, scaling): the top-level keys, as mlx-lm reads them
        (transformers 5 writes them into rope_parameters only)."""
        params = c.get("rope_parameters") or {}
        rotary = c.get("partial_rotary_factor") or params.get("partial_rotary_factor") or 1.0
        return rope_settings(c, self.default_rope_theta)[0], float(rotary), c.get("rope_scaling")

    def configure_moe(self, c):
        self.route = partial(routing.softmax_topk_tail, k=self.top_k,
                             norm=c.get("norm_topk_prob", self.norm_topk_default))

    def make_attention(self, i, prefix):
        if isinstance(self.layer_kinds[i], RecurrentState):
            return GatedDeltaNet(self.w, f"model.layers.{i}.linear_attn", self.qspec, self.config)
        return GatedAttention(self.w, prefix, self.qspec, self.n_heads, self.n_kv_heads, self.head_dim,
                              self.rope, qk_norm="head", eps=self.eps)

    def make_mlp(self, i, prefix):
        return gated_shared_moe(self, i, prefix)
