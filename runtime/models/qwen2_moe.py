"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): biased q/k/v, softmax top-k routing, and a shared expert
scaled by a sigmoid gate."""

from functools import partial

from . import routing
from .base import GLU, Linear
from .decoder import GQAModel, SparseMoE


class Qwen2Moe(GQAModel):
    default_rope_theta = 1e6
    scaled_rope = False

    def configure_moe(self, c):
        # mlx-lm's qwen2_moe, our numerics reference, never renormalises the top-k weights, whatever
        # norm_topk_prob says (transformers does; published Qwen2-MoE configs all set it false).
        self.route = partial(routing.softmax_topk, k=self.top_k, norm=False)

    def make_mlp(self, i, prefix):
        if i not in self.sparse:
            return GLU(self.w, prefix, self.qspec)
        return SparseMoE(i, Linear(self.w, f"{prefix}.gate", self.qspec), self.route,
                         shared=GLU(self.w, f"{prefix}.shared_expert", self.qspec),
                         shared_gate=Linear(self.w, f"{prefix}.shared_expert_gate", self.qspec))
