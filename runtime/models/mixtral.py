"""Mixtral: GQA attention; every layer is a top-k MoE weighted by a softmax over the chosen logits."""

from functools import partial

from . import routing
from .base import Linear
from .decoder import GQAModel, SparseMoE


class Mixtral(GQAModel):
    default_rope_theta = 1e6
    scaled_rope = False

    def configure_moe(self, c):
        self.route = partial(routing.topk_softmax, k=self.top_k)

    def make_mlp(self, i, prefix):
        prefix = prefix.replace(".mlp", ".block_sparse_moe")
        return SparseMoE(i, Linear(self.w, f"{prefix}.gate", self.qspec), self.route)
