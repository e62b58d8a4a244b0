"""OLMoE: GQA attention with RMSNorm over the whole q and k projections, softmax top-k routing."""

from functools import partial

from . import routing
from .base import Linear
from .decoder import GQAModel, SparseMoE


class Olmoe(GQAModel):
    qk_norm = "full"

    def configure_moe(self, c):
        self.route = partial(routing.softmax_topk, k=self.top_k, norm=c.get("norm_topk_prob", False))

    def make_mlp(self, i, prefix):
        return SparseMoE(i, Linear(self.w, f"{prefix}.gate", self.qspec), self.route)
