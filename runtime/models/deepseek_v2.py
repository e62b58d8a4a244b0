"""DeepSeek-V2: softmax router, greedy or group-limited-greedy top-k, scaled by routed_scaling_factor."""

import mlx.core as mx

from .deepseek_common import DeepseekModel


class DeepseekV2(DeepseekModel):
    def router(self, prefix):
        return self.route

    def route(self, logits):
        probs = mx.softmax(logits, axis=-1, precise=True)
        drop = self.n_group - self.topk_group
        if self.config.get("topk_method") == "group_limited_greedy" and drop > 0:
            # Zero every expert outside the topk_group groups with the best single expert.
            grouped = mx.unflatten(probs, -1, (self.n_group, -1))
            best = grouped.max(axis=-1, keepdims=True)
            dropped = mx.argpartition(best, kth=drop - 1, axis=-2)[..., :drop, :]
            probs = mx.put_along_axis(grouped, dropped, mx.array(0.0, probs.dtype), axis=-2)
            probs = probs.reshape(logits.shape)
        k = self.top_k
        inds = mx.argpartition(-probs, kth=k - 1, axis=-1)[..., :k]
        return inds, mx.take_along_axis(probs, inds, axis=-1) * self.routed_scale
