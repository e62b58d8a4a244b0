"""Qwen3-MoE: GQA attention with a per-head RMSNorm on q and k, softmax top-k routing (optionally
renormalised), no shared expert."""

import mlx.core as mx

from .base import GLU, Linear
from .decoder import GQAModel, SparseMoE


def is_sparse_layer(config, n_experts, i):
    """Qwen-MoE layout: MoE every `decoder_sparse_step` layers except those in mlp_only_layers."""
    return (n_experts > 0 and i not in (config.get("mlp_only_layers") or [])
            and (i + 1) % config.get("decoder_sparse_step", 1) == 0)


class Qwen3Moe(GQAModel):
    default_rope_theta = 1e6
    qk_norm = "head"
    scaled_rope = False

    def configure_moe(self, c):
        self.norm_topk = c.get("norm_topk_prob", False)

    def make_mlp(self, i, prefix):
        if not is_sparse_layer(self.config, self.n_experts, i):
            return GLU(self.w, prefix, self.qspec)
        return SparseMoE(i, Linear(self.w, f"{prefix}.gate", self.qspec), self.route)

    def route(self, logits):
        k = self.top_k
        probs = mx.softmax(logits, axis=-1, precise=True)
        # Same selection form as mlx-lm: it fixes the order in which the k experts are summed.
        inds = mx.argpartition(probs, kth=-k, axis=-1)[..., -k:]
        scores = mx.take_along_axis(probs, inds, axis=-1)
        if self.norm_topk:
            scores = scores / mx.sum(scores, axis=-1, keepdims=True)
        return inds, scores
