"""Kimi K3 (kimi_k3): kimi_linear's layers with q, k, v of KDA projected and convolved as one, the
SiTU activation in every MLP and expert, routed experts in a latent space (down to
`routed_expert_hidden_size` before them, optionally RMS-normed and up after: the streamed experts
are the latent-width ones), the router's sigmoid in float32, an optional output gate on MLA, and
attention residuals: with `attn_res_block_size`, each attention and MLP input is a softmax mix of
the block starts so far and the running partial sum, and so is the final norm's input.

Config: the text model's keys at the top level (mlx-lm reads a flat config as its text_config)."""

import mlx.core as mx

from deltafin.runtime import archinfo

from .base import Linear, rms_norm
from .kimi_linear import KimiLinear, KimiMLA
from .switch import glu_activation

MLA_NORM_EPS = 1e-6  # Kimi K3's q_a / kv_a layernorms


@mx.compile
def _mix(raw, inv_rms, partial_sum, w_eff, eps):
    # Compiled like mlx-lm's attention-residual combine (its op order), so it rounds the same.
    pf = partial_sum.astype(mx.float32)
    p_logit = (pf @ w_eff) * mx.rsqrt((pf * pf).mean(axis=-1) + eps)
    logits = mx.concatenate([(raw.astype(mx.float32) @ w_eff) * inv_rms, p_logit[None]])
    p = mx.softmax(logits, axis=0, precise=True)
    out = (p[:-1, ..., None] * raw).sum(axis=0) + p[-1, ..., None] * partial_sum
    return out.astype(partial_sum.dtype)


class ResidualBlocks:
    """The block starts of one pass ([K, B, L, D], and each position's inverse RMS in float32)."""

    def __init__(self, eps: float):
        self.eps, self.raw, self.inv_rms = eps, None, None

    def append(self, x):
        xf = x.astype(mx.float32)
        n = mx.rsqrt((xf * xf).mean(axis=-1) + self.eps)[None]
        self.raw = x[None] if self.raw is None else mx.concatenate([self.raw, x[None]])
        self.inv_rms = n if self.inv_rms is None else mx.concatenate([self.inv_rms, n])

    def mix(self, partial_sum, w_eff):
        """partial_sum itself before the first block start, else its softmax mix with them."""
        if self.raw is None:
            return partial_sum
        return _mix(self.raw, self.inv_rms, partial_sum, w_eff, self.eps)


class KimiK3(KimiLinear):
    route_in_float32 = True

    def configure(self, c):
        self.eps = c.get("rms_norm_eps", 1e-5)
        super().configure(c)
        self.block_size = c.get("attn_res_block_size")
        if self.block_size is not None:
            self.res_w = [(self.res_weight(f"model.layers.{i}.self_attention_res"),
                           self.res_weight(f"model.layers.{i}.mlp_res")) for i in range(self.n_layers)]
            self.out_res_w = self.res_weight("model.output_attn_res")

    def res_weight(self, prefix):
        """An attention residual's logit weights: its norm's weight times its projection's."""
        return self.w[f"{prefix}_norm.weight"].astype(mx.float32) * self.w[f"{prefix}_proj.weight"].reshape(-1)

    def activation(self, c):
        return glu_activation(archinfo.arch_for(c).activation(c))

    def mla(self, prefix):
        return KimiMLA(self, prefix, kv_a_eps=MLA_NORM_EPS, gated=self.config.get("mla_use_output_gate", False))

    def latent(self, prefix):
        if self.config.get("routed_expert_hidden_size") is None:
            return None
        down = Linear(self.w, f"{prefix}.routed_expert_down_proj", self.qspec)
        up = Linear(self.w, f"{prefix}.routed_expert_up_proj", self.qspec)
        if not self.config.get("latent_moe_use_norm", False):
            return down, up
        norm = self.w[f"{prefix}.routed_expert_norm.weight"]
        return down, lambda y: up(rms_norm(y, norm, self.eps))

    def run_layers(self, h, attend, experts, rewind=None):
        if self.block_size is None:
            return super().run_layers(h, attend, experts, rewind)
        blocks = ResidualBlocks(self.eps)
        for i, (in_norm, attn, post_norm, mlp) in enumerate(self.layers):
            w_attn, w_mlp = self.res_w[i]
            partial_sum = h
            x = blocks.mix(partial_sum, w_attn)
            if i % self.block_size == 0:
                blocks.append(partial_sum)
                partial_sum = None
            y = attend(i, attn, rms_norm(x, in_norm, self.eps))
            partial_sum = y if partial_sum is None else partial_sum + y
            x = blocks.mix(partial_sum, w_mlp)
            h = partial_sum + mlp(rms_norm(x, post_norm, self.eps), experts)
        return blocks.mix(h, self.out_res_w)
