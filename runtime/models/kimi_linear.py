"""Kimi Linear (kimi_linear): Kimi Delta Attention layers (kda.py) interleaved with multi-head
latent attention layers that apply no rotary embedding (the latent cached, absorbed), sigmoid
grouped top-k routing with a correction bias, shared experts, SwiGLU. Which layer is which comes
from its cache kind (archinfo: the 1-based `linear_attn_config.kda_layers` are the linear ones)."""

from functools import partial

import mlx.core as mx

from deltafin.runtime.layerkinds import RecurrentState

from . import routing
from .base import GLU, Linear, swiglu
from .decoder import MoETransformer, SparseMoE
from .deepseek_common import MLAttention
from .kda import KimiDeltaAttention


def _no_rope(x, offset):
    return x


class KimiMLA(MLAttention):
    """Absorbed MLA without rotary embedding: the "rope" part of q and k enters the scores as
    it is. kv_a_eps: the latent norm's eps; gated: the output times sigmoid(g_proj(x)) before
    o_proj (Kimi K3's `mla_use_output_gate`)."""

    def __init__(self, model, prefix, kv_a_eps: float, gated: bool = False):
        super().__init__(model, prefix, absorbed=True)
        self.rope, self.kv_a_eps = _no_rope, kv_a_eps
        self.scale = (self.nope + self.rope_dim) ** -0.5
        self.g_proj = Linear(model.w, f"{prefix}.g_proj", model.qspec) if gated else None

    def __call__(self, x, mask, cache):
        offset = cache.offset if cache is not None else 0
        return self.gated_output(self.attend(self.project(x, offset), mask, cache, offset), x)

    def rows(self, x, caches: list, offsets):
        parts = self.project(x, offsets)
        outs = [self.attend([p[b:b + 1] for p in parts], None, c, c.offset) for b, c in enumerate(caches)]
        return self.gated_output(mx.concatenate(outs, axis=0), x)

    def gated_output(self, out, x):
        if out.shape[2] == 1:  # absorbed decode: back from latent space
            out = self.unembed_out(out)
        B, _, L, _ = out.shape
        out = out.transpose(0, 2, 1, 3).reshape(B, L, -1)
        if self.g_proj is not None:
            out = out * mx.sigmoid(self.g_proj(x))
        return self.o_proj(out)


class KimiLinear(MoETransformer):
    route_in_float32 = False  # Kimi K3 takes the router's sigmoid in float32

    def configure(self, c):
        head_dim = c.get("head_dim")
        # mlx-lm's defaults for the MLA widths; no rotary embedding, so no rope scaling either
        self.config = {**c, "qk_nope_head_dim": c.get("qk_nope_head_dim") or head_dim,
                       "qk_rope_head_dim": c.get("qk_rope_head_dim") or 0,
                       "v_head_dim": c.get("v_head_dim") or head_dim}
        self.rope_scaling = None
        self.act = self.activation(c)
        self.route = partial(routing.kimi_grouped_topk, k=self.top_k, n_group=c.get("num_expert_group", 1),
                             topk_group=c.get("topk_group", 1), scale=c.get("routed_scaling_factor", 1.0),
                             norm=c.get("moe_renormalize", True), score=c.get("moe_router_activation_func", "sigmoid"),
                             in_float32=self.route_in_float32)

    def activation(self, c):
        """The MLPs' act(gate, up)."""
        return swiglu

    def make_attention(self, i, prefix):
        if isinstance(self.layer_kinds[i], RecurrentState):
            return KimiDeltaAttention(self, prefix)
        return self.mla(prefix)

    def mla(self, prefix):
        return KimiMLA(self, prefix, kv_a_eps=self.eps)

    def make_mlp(self, i, prefix):
        if i not in self.sparse:
            return GLU(self.w, prefix, self.qspec, self.act)
        shared = GLU(self.w, f"{prefix}.shared_experts", self.qspec, self.act) \
            if self.config.get("num_shared_experts") else None
        route = partial(self.route, bias=self.w[f"{prefix}.e_score_correction_bias"])
        return SparseMoE(i, Linear(self.w, f"{prefix}.gate", self.qspec), route, shared=shared,
                         latent=self.latent(prefix))

    def latent(self, prefix):
        """(down, up) around the routed experts, or None."""
        return None
