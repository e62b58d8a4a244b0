"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): biased q/k/v, softmax top-k routing, and a shared expert
scaled by a sigmoid gate."""

from functools import partial

from . import routing
from .decoder import GQAModel, gated_shared_moe


class Qwen2Moe(GQAModel):
    default_rope_theta = 1e6
    scaled_rope = False

    def configure_moe(self, c):
        # mlx-lm's qwen2_moe, our numerics reference, never renormalises the top-k weights, whatever
        # norm_topk_prob says (transformers does; published Qwen2-MoE configs all set it false).
        self.route = partial(routing.softmax_topk, k=self.top_k, norm=False)

    def make_mlp(self, i, prefix):
        return gated_shared_moe(self, i, prefix)
