"""DeepSeek-V3 / Kimi-K2: sigmoid router whose selection adds e_score_correction_bias, restricted to
the topk_group best groups; MLA with the latent cached (absorbed)."""

from functools import partial

import mlx.core as mx

from . import routing
from .deepseek_common import DeepseekModel


class DeepseekV3(DeepseekModel):
    def router(self, prefix):
        bias = self.w.get(f"{prefix}.gate.e_score_correction_bias")
        bias = mx.zeros((self.n_experts,), mx.float32) if bias is None else bias
        return partial(routing.sigmoid_grouped_topk, bias=bias, k=self.top_k, n_group=self.n_group,
                       topk_group=self.topk_group, scale=self.routed_scale,
                       norm=bool(self.config.get("norm_topk_prob", True)))
