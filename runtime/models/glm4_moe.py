"""GLM-4.5 / 4.6 / 4.7 (glm4_moe): GQA attention with optional biased q/k/v, per-head q/k RMSNorm
and rotary on the first partial_rotary_factor of each head; the first first_k_dense_replace layers
dense, the others routed experts chosen as DeepSeek-V3 chooses them (sigmoid scores, a correction
bias in the selection only, expert groups, routed scaling) plus always-on shared experts."""

from functools import partial

import mlx.core as mx

from . import routing
from .base import GLU, Linear, Rope
from .decoder import Attention, GQAModel, SparseMoE


class Glm4Moe(GQAModel):
    def configure(self, c):
        self.n_heads, self.n_kv_heads, self.head_dim = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        self.qk_norm = "head" if c["use_qk_norm"] else None
        # mlx-lm rotates int(head_dim * partial_rotary_factor) dims, unscaled whatever rope_scaling
        # says; transformers 5 writes the factor inside rope_parameters only
        factor = c.get("partial_rotary_factor") or (c.get("rope_parameters") or {})["partial_rotary_factor"]
        self.rope = Rope(int(self.head_dim * factor), self.rope_theta)
        self.route = partial(routing.sigmoid_grouped_topk, k=self.top_k, n_group=c["n_group"],
                             topk_group=c["topk_group"], scale=c["routed_scaling_factor"],
                             norm=bool(c["norm_topk_prob"]))

    def make_attention(self, i, prefix):
        return Attention(self.w, prefix, self.qspec, self.n_heads, self.n_kv_heads, self.head_dim,
                         self.rope, qk_norm=self.qk_norm, eps=self.eps)

    def make_mlp(self, i, prefix):
        if i not in self.sparse:
            return GLU(self.w, prefix, self.qspec)
        bias = self.w.get(f"{prefix}.gate.e_score_correction_bias")
        bias = mx.zeros((self.n_experts,), mx.float32) if bias is None else bias
        has_shared = self.config.get("n_shared_experts") is not None
        shared = GLU(self.w, f"{prefix}.shared_experts", self.qspec) if has_shared else None
        return SparseMoE(i, Linear(self.w, f"{prefix}.gate", self.qspec), partial(self.route, bias=bias),
                         shared=shared)
