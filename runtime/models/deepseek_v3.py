"""DeepSeek-V3 / Kimi-K2: sigmoid router whose selection adds e_score_correction_bias, restricted to
the topk_group best groups (a group scores the sum of its two best experts); weights are the raw
sigmoids, optionally renormalised, times routed_scaling_factor."""

import mlx.core as mx

from .deepseek_common import DeepseekModel


@mx.compile
def _route(logits, bias, k, n_group, topk_group, scale, norm):
    # Compiled like mlx-lm's group_expert_select so the float32 math fuses the same way.
    probs = mx.sigmoid(logits.astype(mx.float32))
    pick = probs + bias
    if n_group > 1 and topk_group < n_group:
        pick = mx.unflatten(pick, -1, (n_group, -1))
        group_score = mx.topk(pick, 2, axis=-1).sum(axis=-1, keepdims=True)
        drop = n_group - topk_group
        dropped = mx.argpartition(group_score, kth=drop - 1, axis=-2)[..., :drop, :]
        pick = mx.flatten(mx.put_along_axis(pick, dropped, mx.array(0.0), axis=-2), -2, -1)
    inds = mx.argpartition(-pick, kth=k - 1, axis=-1)[..., :k]
    weights = mx.take_along_axis(probs, inds, axis=-1)
    if k > 1 and norm:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return inds, weights * scale


class DeepseekV3(DeepseekModel):
    absorb_mla = True

    def router(self, prefix):
        bias = self.w.get(f"{prefix}.gate.e_score_correction_bias")
        bias = mx.zeros((self.n_experts,), mx.float32) if bias is None else bias
        norm = bool(self.config.get("norm_topk_prob", True))

        def route(logits):
            return _route(logits, bias, self.top_k, self.n_group, self.topk_group, self.routed_scale, norm)

        return route
