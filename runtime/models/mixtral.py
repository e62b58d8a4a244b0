"""Mixtral: GQA attention; every layer is a top-k MoE weighted by a softmax over the chosen logits."""

import mlx.core as mx

from .base import Linear
from .decoder import GQAModel, SparseMoE


class Mixtral(GQAModel):
    default_rope_theta = 1e6
    scaled_rope = False

    def make_mlp(self, i, prefix):
        prefix = prefix.replace(".mlp", ".block_sparse_moe")
        return SparseMoE(i, Linear(self.w, f"{prefix}.gate", self.qspec), self.route)

    def route(self, logits):
        k = self.top_k
        inds = mx.argpartition(-logits, kth=k - 1, axis=-1)[..., :k]
        return inds, mx.softmax(mx.take_along_axis(logits, inds, axis=-1), axis=-1, precise=True)
