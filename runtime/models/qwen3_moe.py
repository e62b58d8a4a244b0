"""Qwen3-MoE: GQA attention with a per-head RMSNorm on q and k, softmax top-k routing (optionally
renormalised), no shared expert."""

from functools import partial

from . import routing
from .base import GLU, Linear
from .decoder import GQAModel, SparseMoE


class Qwen3Moe(GQAModel):
    default_rope_theta = 1e6
    qk_norm = "head"
    scaled_rope = False

    def configure_moe(self, c):
        self.route = partial(routing.softmax_topk_tail, k=self.top_k, norm=c.get("norm_topk_prob", False))

    def make_mlp(self, i, prefix):
        if i not in self.sparse:
            return GLU(self.w, prefix, self.qspec)
        return SparseMoE(i, Linear(self.w, f"{prefix}.gate", self.qspec), self.route)
