"""gpt-oss (gpt_oss): GQA attention with biased projections and a learned sink per head, layers
alternating between a sliding window and every position (layer_types); every layer routed experts
picked by a biased router (the k best logits, softmax over them), each expert a clamped SwiGLU
with its own biases (switch.py: swiglu_oai; the biases travel in the expert's record)."""

from functools import partial

import mlx.core as mx

from deltafin.runtime.layerkinds import SlidingKV

from . import routing
from .base import Linear, Rope
from .decoder import Attention, GQAModel, SparseMoE


def window_mask(n: int, before: int, window: int):
    """The mask of n queries after `before` earlier keys, each query seeing its last `window`
    positions: "causal" while that is all of them, else a boolean [n, before + n] array."""
    if before + n <= window:
        return "causal"
    keys = mx.arange(before + n)[None]
    queries = (mx.arange(before, before + n) if before else mx.arange(before + n))[:, None]
    return (queries >= keys) & (queries < keys + window)


class SinkAttention(Attention):
    """Attention whose softmax also weighs a learned per-head sink logit; `window`: the layer sees
    only the last `window` positions (its cache is a SlidingKVCache), None: every position."""

    def __init__(self, weights, prefix, qspec, n_heads, n_kv_heads, head_dim, rope, window=None):
        super().__init__(weights, prefix, qspec, n_heads, n_kv_heads, head_dim, rope)
        self.sinks, self.window = weights[f"{prefix}.sinks"], window

    def attend(self, parts, mask, cache, offset):
        q, k, v = parts
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        if self.window is not None and mask is not None:
            mask = window_mask(q.shape[2], k.shape[2] - q.shape[2], self.window)
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask, sinks=self.sinks)


class GptOss(GQAModel):
    default_rope_theta = 150000.0

    def configure(self, c):
        self.n_heads, self.n_kv_heads, self.head_dim = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        self.rope = Rope(self.head_dim, self.rope_theta, scaling=self.rope_scaling)
        self.route = partial(routing.topk_tail_softmax, k=self.top_k)

    def make_attention(self, i, prefix):
        kind = self.layer_kinds[i]
        return SinkAttention(self.w, prefix, self.qspec, self.n_heads, self.n_kv_heads, self.head_dim, self.rope,
                             window=kind.window if isinstance(kind, SlidingKV) else None)

    def make_mlp(self, i, prefix):
        return SparseMoE(i, Linear(self.w, f"{prefix}.router", self.qspec), self.route)
