"""The decoder skeleton the architectures share: embedding, pre-norm attention + MLP/MoE blocks,
final norm, LM head; plus grouped-query attention and the routed-MoE block."""

from functools import cached_property

import mlx.core as mx

from deltafin.runtime import archinfo

from .base import (GLU, Embedding, Linear, QuantSpec, Rope, StagedAttention, cast_weights, resolve_dtype, rms_norm,
                   rope_settings)
from .caches import KVCache, make_cache


class RunAheadMiss(Exception):
    """A MoE layer computed ahead of its routing's read-back (`ExpertProvider.begin_ahead`) chose
    an expert that was not resident when it was built: the model goes back to that layer's MLP."""

    def __init__(self, layer: int):
        super().__init__(f"layer {layer} ran ahead on an expert that was not resident")
        self.layer = layer


class Attention(StagedAttention):
    """Grouped-query attention with optional q/k RMSNorm, per head ("head") or over the whole
    projection ("full")."""

    def __init__(self, weights, prefix, qspec, n_heads, n_kv_heads, head_dim, rope, qk_norm=None,
                 eps=1e-6):
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            Linear(weights, f"{prefix}.{n}", qspec) for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
        self.n_heads, self.n_kv_heads, self.rope = n_heads, n_kv_heads, rope
        self.scale = head_dim ** -0.5
        self.qk_norm, self.eps = qk_norm, eps
        if qk_norm:
            self.q_norm = weights[f"{prefix}.q_norm.weight"]
            self.k_norm = weights[f"{prefix}.k_norm.weight"]

    def project(self, x, offset):
        B, L, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.qk_norm == "full":
            q, k = rms_norm(q, self.q_norm, self.eps), rms_norm(k, self.k_norm, self.eps)
        q = q.reshape(B, L, self.n_heads, -1)
        k = k.reshape(B, L, self.n_kv_heads, -1)
        if self.qk_norm == "head":
            q, k = rms_norm(q, self.q_norm, self.eps), rms_norm(k, self.k_norm, self.eps)
        q, k = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)
        v = v.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        return self.rope(q, offset), self.rope(k, offset), v


class SparseMoE:
    """Routed experts (through the provider) weighted by the router, plus optional shared experts.

    route: the family's routing function (routing.py). Experts in a latent space: `latent` =
    (down, up) projections around them (the experts see down(x), the block returns up of their
    weighted sum). `expert_bias` [E, D]: a per-expert output bias added to each chosen expert's
    output before weighting (biases inside an expert's GLU belong to the expert math)."""

    def __init__(self, layer, gate: Linear, route, shared=None, shared_gate: Linear | None = None,
                 latent: tuple | None = None, expert_bias=None):
        self.layer, self.gate, self.route = layer, gate, route
        self.shared, self.shared_gate = shared, shared_gate
        self.latent, self.expert_bias = latent, expert_bias
        self.next: SparseMoE | None = None  # the next MoE layer, for gate lookahead

    def __call__(self, x, experts):
        logits = self.gate(x)
        inds, scores = self.route(logits)
        if getattr(experts, "wants_logits", None) and experts.wants_logits(self.layer):
            experts.gate_logits(self.layer, logits)  # a lossy mode reroutes, or next leases (slot_experts.py)
        if self.next is not None and getattr(experts, "wants_lookahead", None) and experts.wants_lookahead(self.layer):
            # Gate lookahead: the next MoE layer's gate on this layer's input guesses its experts
            # early, so the router can read them while this layer and the next attention run.
            experts.lookahead(self.next.layer, self.next.route(self.next.gate(x))[0].reshape(-1, inds.shape[-1]))
        y = self.routed(x if self.latent is None else self.latent[0](x), inds, scores, experts)
        if self.latent is not None:
            y = self.latent[1](y)
        if self.shared is not None:
            s = self.shared(x)
            y = y + (s if self.shared_gate is None else mx.sigmoid(self.shared_gate(x)) * s)
        return y

    def routed(self, x, inds, scores, experts):
        """The chosen experts' outputs weighted by their scores. The gate and the shared experts see
        x as mlx-lm's do, [B, L, D]: a GPU picks its matmul kernel by shape, and a float gate on
        [N, D] rounds differently in bfloat16 on CUDA. The routed experts take them so too where
        the provider keeps shapes (as mlx-lm's SwitchGLU: no reshape per layer), else the rows
        flat, [N, D] with inds [N, k]."""
        k = inds.shape[-1]
        if getattr(experts, "keeps_shape", False):
            y = experts(self.layer, x, inds)
            if self.expert_bias is not None:
                y = y + self.expert_bias[inds]
            return (y * scores[..., None]).sum(axis=-2).astype(y.dtype)
        flat = inds.reshape(-1, k)
        y = experts(self.layer, x.reshape(-1, x.shape[-1]), flat)
        if self.expert_bias is not None:
            y = y + self.expert_bias[flat]
        return (y * scores.reshape(-1, k)[..., None]).sum(axis=-2).astype(y.dtype).reshape(x.shape)


def gated_shared_moe(model, i: int, prefix: str):
    """Layer i's MLP in the Qwen MoE families with a shared expert under a sigmoid gate (Qwen2-MoE,
    Qwen3-Next, Qwen3.5-MoE): routed experts plus `shared_expert` scaled by
    sigmoid(`shared_expert_gate`); a dense GLU where the layer has no routed experts."""
    if i not in model.sparse:
        return GLU(model.w, prefix, model.qspec)
    return SparseMoE(i, Linear(model.w, f"{prefix}.gate", model.qspec), model.route,
                     shared=GLU(model.w, f"{prefix}.shared_expert", model.qspec),
                     shared_gate=Linear(model.w, f"{prefix}.shared_expert_gate", model.qspec))


class MoETransformer:
    """Embedding -> layers of (pre-norm attention, pre-norm MLP or MoE) -> norm -> LM head.

    The family's registry entry (archinfo) gives each layer's cache kind (`layer_kinds`, which
    also names the attention a layer runs) and the layers with routed experts (`sparse`).
    Subclasses read their settings in `configure` and build per-layer blocks in
    `make_attention(i, prefix)` and `make_mlp(i, prefix)` (an MoE block or a dense GLU)."""

    default_rope_theta = 10000.0

    def __init__(self, config: dict, weights: dict, dense_quantization: dict | None, dtype="auto"):
        self.config = config
        self.dtype = resolve_dtype(dtype, weights)
        self.w = cast_weights(weights, self.dtype)
        self.qspec = QuantSpec(dense_quantization)
        self.n_layers = config["num_hidden_layers"]
        self.eps = config.get("rms_norm_eps", 1e-6)
        self.rope_theta, self.rope_scaling = rope_settings(config, self.default_rope_theta)
        # one reading of the expert count and top-k (with every spelling) for converter and models
        self.n_experts, self.top_k = archinfo.n_experts(config), archinfo.top_k(config)
        self.layer_kinds = archinfo.layer_caches(config)
        self.sparse = set(archinfo.moe_layers(config))
        self.configure(config)
        self.embed = Embedding(self.w, "model.embed_tokens", self.qspec)
        tied = config.get("tie_word_embeddings", False) or "lm_head.weight" not in self.w
        self.head = self.embed if tied else Linear(self.w, "lm_head", self.qspec)
        self.final_norm = self.w["model.norm.weight"]
        self.layers, self.moe_layers = [], []
        for i in range(self.n_layers):
            p = f"model.layers.{i}"
            mlp = self.make_mlp(i, f"{p}.mlp")
            if isinstance(mlp, SparseMoE):
                if self.moe_layers:
                    self.layers[self.moe_layers[-1]][3].next = mlp
                self.moe_layers.append(i)
            self.layers.append((self.w[f"{p}.input_layernorm.weight"], self.make_attention(i, f"{p}.self_attn"),
                                self.w[f"{p}.post_attention_layernorm.weight"], mlp))

    def configure(self, config):
        raise NotImplementedError

    def make_attention(self, i, prefix):
        raise NotImplementedError

    def make_mlp(self, i, prefix):
        raise NotImplementedError

    def make_cache(self):
        """One sequence's caches, one per layer of its kind (runtime/models/caches.py)."""
        return [make_cache(kind) for kind in self.layer_kinds]

    def __call__(self, tokens, cache=None, experts=None, float32: bool = True):
        """tokens int32 [T] -> float32 logits [T, vocab]; `cache` (from make_cache) is advanced by T.
        float32=False: the logits in the model's dtype, as mlx-lm's model gives them (the decode
        loop samples them so; a cast to float32 and back is two more primitives per token)."""
        if self.moe_layers and experts is None:
            raise ValueError("this model has routed experts: pass an ExpertProvider")
        tokens = mx.array(tokens, dtype=mx.int32) if not isinstance(tokens, mx.array) else tokens
        h = self.embed.lookup(tokens[None] if tokens.ndim == 1 else tokens.reshape(1, -1))
        mask = "causal" if h.shape[1] > 1 else None
        n = h.shape[1]
        h = self.run_layers(h, lambda i, attn, x: attn(x, mask, None if cache is None else cache[i]), experts,
                            rewind=None if cache is None else (lambda i: cache[i].rewind(n)))
        h = rms_norm(h, self.final_norm, self.eps)
        logits = self.head(h).squeeze(0)
        return logits.astype(mx.float32) if float32 else logits

    @cached_property
    def rewinds(self) -> bool:
        """Whether a pass's attention can be taken back (`run_layers`' rewind): every layer keeps a
        plain key/value cache, where going back is lowering its offset."""
        return all(type(make_cache(kind)) is KVCache for kind in self.layer_kinds)

    def run_layers(self, h, attend, experts, rewind=None):
        """h [B, L, D] through every layer, before the final norm; attend(i, attn, x) runs layer
        i's attention on x with its cache (one sequence's, or the batch's rows); rewind(i) takes
        layer i's cache back by this pass's positions (None: it cannot be). Where the provider
        runs ahead (`begin_ahead`), see `_run_ahead`."""
        if rewind is not None and getattr(experts, "begin_ahead", None) and experts.begin_ahead(self.rewinds):
            return self._run_ahead(h, attend, experts, rewind)
        for i, (in_norm, attn, post_norm, mlp) in enumerate(self.layers):
            h = h + attend(i, attn, rms_norm(h, in_norm, self.eps))
            h = h + mlp(rms_norm(h, post_norm, self.eps), experts)
        return h

    def _run_ahead(self, h, attend, experts, rewind):
        """The layers with the provider computing a partially resident MoE layer on the experts
        resident when it is built and checking its routing one such layer later (`end_ahead`
        checks the last), so the device never waits for the host between them. A layer found to
        have used a missing expert (RunAheadMiss) is computed again from its attention's output,
        the provider then knowing its routing; the attention of the layers after it, which ran on
        the wrong input, is taken back (rewind) and runs again. A layer's result depends only on
        its input, so what is kept is what the plain loop computes, bit for bit."""
        after_attention = {}
        i, n = 0, len(self.layers)
        while True:
            try:
                while i < n:
                    in_norm, attn, post_norm, mlp = self.layers[i]
                    h = h + attend(i, attn, rms_norm(h, in_norm, self.eps))
                    after_attention[i] = h
                    h = h + mlp(rms_norm(h, post_norm, self.eps), experts)
                    i += 1
                experts.end_ahead()
                return h
            except RunAheadMiss as miss:
                at = miss.layer
                for j in range(at + 1, min(i, n - 1) + 1):
                    rewind(j)
                _, _, post_norm, mlp = self.layers[at]
                h = after_attention[at]
                h = h + mlp(rms_norm(h, post_norm, self.eps), experts)
                i = at + 1

    def forward_batch(self, tokens, caches: list, experts=None, float32: bool = True):
        """One decode step of B sequences: tokens int [B] (one per sequence), caches[b] that
        sequence's cache (each advanced by 1) -> float32 logits [B, vocab] (float32=False: in
        the model's dtype).

        Everything per row (embedding, norms, attention's projections and rope, MoE and dense
        MLPs, head) runs on the B rows stacked, so each MoE layer calls the provider once with
        all of them (one union of experts) and each layer launches its row-wise kernels once,
        not B times. Only the cache update and the attention itself run per sequence, on its
        own cache (StagedAttention.rows). B=1 is the single-sequence pass itself, so a request
        alone keeps its numerics and its graph."""
        tokens = mx.array(tokens, dtype=mx.int32) if not isinstance(tokens, mx.array) else tokens
        if tokens.ndim != 1:
            tokens = tokens.reshape(-1)
        if len(caches) == 1:
            return self(tokens, caches[0], experts, float32)
        if self.moe_layers and experts is None:
            raise ValueError("this model has routed experts: pass an ExpertProvider")
        # [B, 1, D]: each sequence's row keeps the [1, 1, D] shape its own pass would give it
        h = self.embed.lookup(tokens.reshape(-1, 1))
        # Each sequence's rope position: its length, the same in every layer's cache (a pass
        # advances them all by one); one small array per step, not one per layer.
        offsets = mx.array([c[0].offset for c in caches], dtype=mx.int32)
        h = self.run_layers(h, lambda i, attn, x: attn.rows(x, [c[i] for c in caches], offsets), experts,
                            rewind=lambda i: [c[i].rewind(1) for c in caches])
        h = rms_norm(h, self.final_norm, self.eps)
        logits = self.head(h).squeeze(1)
        return logits.astype(mx.float32) if float32 else logits


class GQAModel(MoETransformer):
    """Skeleton with grouped-query attention (Mixtral, Qwen-MoE, OLMoE); subclasses set the MoE."""

    qk_norm = None  # None, "head" or "full" (see Attention)
    scaled_rope = True  # False where mlx-lm, our numerics reference, ignores rope_scaling

    def configure(self, c):
        self.n_heads = c["num_attention_heads"]
        self.n_kv_heads = c.get("num_key_value_heads") or self.n_heads
        self.head_dim = c.get("head_dim") or c["hidden_size"] // self.n_heads
        self.rope = Rope(self.head_dim, self.rope_theta, c.get("rope_traditional", False),
                         self.rope_scaling if self.scaled_rope else None)
        self.configure_moe(c)

    def configure_moe(self, c):
        """The family's routing function, `self.route` (routing.py), from the config."""

    def make_attention(self, i, prefix):
        return Attention(self.w, prefix, self.qspec, self.n_heads, self.n_kv_heads, self.head_dim,
                         self.rope, qk_norm=self.qk_norm, eps=self.eps)
