"""OLMoE: GQA attention with RMSNorm over the whole q and k projections, softmax top-k routing."""

from .base import Linear
from .decoder import GQAModel, SparseMoE, softmax_topk


class Olmoe(GQAModel):
    qk_norm = "full"

    def configure_moe(self, c):
        self.norm_topk = c.get("norm_topk_prob", False)

    def make_mlp(self, i, prefix):
        return SparseMoE(i, Linear(self.w, f"{prefix}.gate", self.qspec), self.route)

    def route(self, logits):
        return softmax_topk(logits, self.top_k, self.norm_topk)
