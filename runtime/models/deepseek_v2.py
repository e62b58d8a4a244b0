"""DeepSeek-V2: softmax router, greedy or group-limited-greedy top-k, scaled by routed_scaling_factor."""

from functools import partial

from . import routing
from .deepseek_common import DeepseekModel


class DeepseekV2(DeepseekModel):
    def router(self, prefix):
        return partial(routing.softmax_group_limited, k=self.top_k, n_group=self.n_group,
                       topk_group=self.topk_group, scale=self.routed_scale,
                       group_limited=self.config.get("topk_method") == "group_limited_greedy")
