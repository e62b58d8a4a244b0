"""What DeepSeek-V2 and V3 (and Kimi-K2) share: multi-head latent attention (MLA), leading dense
layers, shared experts. The two differ only in routing (see deepseek_v2.py / deepseek_v3.py)."""

import mlx.core as mx

from deltafin.runtime.layerkinds import LatentKV

from .base import GLU, Linear, QuantSpec, Rope, StagedAttention, rms_norm, yarn_attention_scale
from .decoder import MoETransformer, SparseMoE

LATENT_NORM_EPS = 1e-6  # DeepSeek's q_a/kv_a layernorms use a fixed eps, not rms_norm_eps


def split_kv_b(kv_b: Linear, n_heads, nope_dim):
    """kv_b_proj [H*(nope+v), rank] -> embed_q [H, rank, nope] and unembed_out [H, v, rank], the
    per-head matrices absorbed attention multiplies the latent by (re-quantized like kv_b_proj)."""
    w = kv_b.dense()
    w = w.reshape(n_heads, -1, w.shape[-1])
    parts = {"embed_q.weight": mx.contiguous(w[:, :nope_dim, :].swapaxes(-1, -2)),
             "unembed_out.weight": mx.contiguous(w[:, nope_dim:, :])}
    spec = QuantSpec(None)
    if kv_b.quantized:
        spec = QuantSpec({"group_size": kv_b.group_size, "bits": kv_b.bits, "mode": kv_b.mode})
        for name in ("embed_q", "unembed_out"):
            dense = parts[f"{name}.weight"]
            if dense.shape[-1] % kv_b.group_size == 0:
                q, s, b = mx.quantize(dense, group_size=kv_b.group_size, bits=kv_b.bits)
                parts.update({f"{name}.weight": q, f"{name}.scales": s, f"{name}.biases": b})
    mx.eval(parts)
    return Linear(parts, "embed_q", spec), Linear(parts, "unembed_out", spec)


class MLAttention(StagedAttention):
    """Queries/keys split into a no-position part and a rotary part; keys and values come from a
    shared low-rank latent. "Absorbed" mode caches only the latent (what mlx-lm does for V3);
    "expanded" mode expands it per head through kv_b_proj (what mlx-lm does for V2)."""

    def __init__(self, model, prefix, absorbed: bool):
        c, w, qs = model.config, model.w, model.qspec
        self.n_heads = c["num_attention_heads"]
        self.nope, self.rope_dim = c["qk_nope_head_dim"], c["qk_rope_head_dim"]
        self.rank = c["kv_lora_rank"]
        if c.get("q_lora_rank"):
            self.q_a = Linear(w, f"{prefix}.q_a_proj", qs)
            self.q_a_norm = w[f"{prefix}.q_a_layernorm.weight"]
            self.q_b = Linear(w, f"{prefix}.q_b_proj", qs)
        else:
            self.q_proj = Linear(w, f"{prefix}.q_proj", qs)
        self.kv_a = Linear(w, f"{prefix}.kv_a_proj_with_mqa", qs)
        self.kv_a_norm = w[f"{prefix}.kv_a_layernorm.weight"]
        self.kv_a_eps = LATENT_NORM_EPS
        self.o_proj = Linear(w, f"{prefix}.o_proj", qs)
        self.scale = (self.nope + self.rope_dim) ** -0.5 * yarn_attention_scale(model.rope_scaling)
        self.rope = Rope(self.rope_dim, model.rope_theta, traditional=True, scaling=model.rope_scaling)
        self.kv_b = None
        if f"{prefix}.embed_q.weight" in w:
            self.embed_q = Linear(w, f"{prefix}.embed_q", qs)
            self.unembed_out = Linear(w, f"{prefix}.unembed_out", qs)
        elif absorbed:
            self.embed_q, self.unembed_out = split_kv_b(Linear(w, f"{prefix}.kv_b_proj", qs),
                                                        self.n_heads, self.nope)
        else:
            self.kv_b = Linear(w, f"{prefix}.kv_b_proj", qs)

    def queries(self, x):
        if hasattr(self, "q_proj"):
            return self.q_proj(x)
        return self.q_b(rms_norm(self.q_a(x), self.q_a_norm, LATENT_NORM_EPS))

    def project(self, x, offset):
        """Expanded: (q, k, v) per head, as GQA's. Absorbed: (q_nope, q_pe, latent, k_pe), the
        latent and the rotary key being what its cache holds; a decode step's q_nope is already
        moved into latent space (embed_q), a row-wise product like the projections."""
        B, L, _ = x.shape
        q = self.queries(x).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        q_nope, q_pe = mx.split(q, [self.nope], axis=-1)
        latent, k_pe = mx.split(self.kv_a(x), [self.rank], axis=-1)
        k_pe = k_pe.reshape(B, L, 1, self.rope_dim).transpose(0, 2, 1, 3)
        latent = rms_norm(latent, self.kv_a_norm, self.kv_a_eps)
        q_pe, k_pe = self.rope(q_pe, offset), self.rope(k_pe, offset)
        if self.kv_b is None:
            # decode: the query moves into latent space instead of expanding every key
            return self.embed_q(q_nope) if L == 1 else q_nope, q_pe, mx.expand_dims(latent, axis=1), k_pe
        kv = self.kv_b(latent).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        k_nope, v = mx.split(kv, [self.nope], axis=-1)
        k = mx.concatenate([k_nope, mx.repeat(k_pe, self.n_heads, axis=1)], axis=-1)
        return mx.concatenate([q_nope, q_pe], axis=-1), k, v

    def attend(self, parts, mask, cache, offset):
        if self.kv_b is not None:
            return super().attend(parts, mask, cache, offset)
        q_nope, q_pe, latent, k_pe = parts
        L = q_pe.shape[2]
        if cache is not None:
            latent, k_pe = cache.update_and_fetch(latent, k_pe)
        # The rotary part's scores enter the attention as an additive mask over the latent scores.
        pe_scores = (q_pe * self.scale) @ k_pe.swapaxes(-1, -2)
        if mask is not None:
            causal = mx.arange(offset, offset + L)[:, None] >= mx.arange(offset + L)[None]
            pe_scores = mx.where(causal, pe_scores, mx.array(mx.finfo(pe_scores.dtype).min, pe_scores.dtype))
        if L == 1:  # decode: keys and values are the latent itself
            k = v = latent
        else:
            k, v = self.embed_q(latent, transpose=False), self.unembed_out(latent)
        return mx.fast.scaled_dot_product_attention(q_nope, k, v, scale=self.scale, mask=pe_scores)

    def output(self, out):
        if self.kv_b is None and out.shape[2] == 1:  # absorbed decode: back from latent space
            out = self.unembed_out(out)
        return super().output(out)


class DeepseekModel(MoETransformer):
    """MLA attention, absorbed (kv_b_proj split into embed_q/unembed_out) where the layer's cache
    kind is the latent (archinfo); the first `first_k_dense_replace` layers (and those off
    `moe_layer_freq`) are dense GLUs, the others routed experts plus `n_shared_experts` always-on
    experts."""

    def configure(self, c):
        self.routed_scale = c.get("routed_scaling_factor", 1.0)
        self.n_group, self.topk_group = c.get("n_group") or 1, c.get("topk_group") or 1

    def make_attention(self, i, prefix):
        return MLAttention(self, prefix, absorbed=isinstance(self.layer_kinds[i], LatentKV))

    def make_mlp(self, i, prefix):
        c = self.config
        if i not in self.sparse:
            return GLU(self.w, prefix, self.qspec)
        shared = GLU(self.w, f"{prefix}.shared_experts", self.qspec) if c.get("n_shared_experts") else None
        return SparseMoE(i, Linear(self.w, f"{prefix}.gate", self.qspec), self.router(prefix), shared=shared)

    def router(self, prefix):
        """The layer's routing function (routing.py): logits [N, E] -> (inds [N, k], weights [N, k])."""
        raise NotImplementedError
