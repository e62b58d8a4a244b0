"""MiniMax-M2 (minimax): GQA attention with RMSNorm over the whole q and k projections and rotary
on the first rotary_dim dims of each head; every layer routed experts, no shared expert, chosen by
sigmoid scores of a float32 gate with a correction bias in the selection only."""

from functools import partial

import mlx.core as mx

from . import routing
from .base import Linear, Rope
from .decoder import Attention, GQAModel, SparseMoE


class Float32Gate:
    """The router run on the input cast to float32, as MiniMax-M2's."""

    def __init__(self, gate: Linear):
        self.gate = gate

    def __call__(self, x):
        return self.gate(x.astype(mx.float32))


class MiniMax(GQAModel):
    def configure(self, c):
        self.n_heads, self.n_kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
        self.head_dim = c.get("head_dim") or c["hidden_size"] // self.n_heads
        self.qk_norm = "full" if c.get("use_qk_norm", True) else None
        self.rope = Rope(c["rotary_dim"], self.rope_theta)

    def make_attention(self, i, prefix):
        return Attention(self.w, prefix, self.qspec, self.n_heads, self.n_kv_heads, self.head_dim,
                         self.rope, qk_norm=self.qk_norm, eps=self.eps)

    def make_mlp(self, i, prefix):
        prefix = prefix.replace(".mlp", ".block_sparse_moe")
        bias = self.w.get(f"{prefix}.e_score_correction_bias")
        bias = mx.zeros((self.n_experts,), mx.float32) if bias is None else bias
        route = partial(routing.sigmoid_bias_topk, bias=bias, k=self.top_k, dtype=self.dtype)
        return SparseMoE(i, Float32Gate(Linear(self.w, f"{prefix}.gate", self.qspec)), route)
