"""Shared building blocks for the MoE forward passes.

Weights are plain dicts of mx.array keyed by checkpoint names. Every op mirrors the MLX primitive
mlx-lm uses for the same layer, so logits match mlx-lm on the same quantized checkpoint.
"""

import math
from functools import partial

import mlx.core as mx
import mlx.nn as nn
from deltafin.runtime import dtypes, quantmodes

# ---------------------------------------------------------------- config and dtype helpers

# mlx-lm keeps these tensors as stored whatever the model dtype (its cast_predicate).
_KEEP_DTYPE = ("e_score_correction_bias", "A_log", "dt_bias")


def rope_settings(config: dict, default_theta: float):
    """(theta, scaling dict or None). theta: top-level rope_theta, else transformers-5 rope_parameters.
    Scaling comes only from the top-level rope_scaling, as mlx-lm (our numerics reference) reads it:
    mlx-lm ignores a scaling given only in rope_parameters (what transformers 5 save_pretrained writes),
    so applying it here would make the logits differ from mlx-lm on the same checkpoint."""
    params = config.get("rope_parameters") or {}
    theta = config.get("rope_theta") or params.get("rope_theta") or default_theta
    return float(theta), config.get("rope_scaling")


def resolve_dtype(dtype, weights: dict):
    """'auto'/None: the dtype of the checkpoint's float tensors (taken from the embedding)."""
    if isinstance(dtype, mx.Dtype):
        return dtype
    if dtype not in (None, "auto"):
        if str(dtype) not in dtypes.NAMES:
            raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(dtypes.NAMES)} or 'auto'")
        return getattr(mx, dtypes.canonical(dtype))
    emb = weights.get("model.embed_tokens.scales", weights.get("model.embed_tokens.weight"))
    if emb is not None and mx.issubdtype(emb.dtype, mx.floating):
        return emb.dtype
    floats = [v.dtype for v in weights.values() if mx.issubdtype(v.dtype, mx.floating)]
    return max(set(floats), key=floats.count) if floats else mx.float32


def cast_weights(weights: dict, dtype) -> dict:
    out, cast = dict(weights), {}
    for k, v in weights.items():
        if mx.issubdtype(v.dtype, mx.floating) and v.dtype != dtype and not k.endswith(_KEEP_DTYPE):
            cast[k] = v.astype(dtype)
    out.update(cast)
    # Materialise every weight now: mx.load is lazy, and weights first read during the first
    # forward would escape the start-up measurement that sizes the slot pool (the budget).
    mx.eval(list(out.values()))
    return out


class QuantSpec:
    """mlx-lm's `quantization` dict: default bits/group_size/mode plus per-module-path overrides
    (an override without "mode" is affine, as MLX's to_quantized has it)."""

    def __init__(self, dense_quantization: dict | None):
        self.q = dense_quantization or {}

    def params(self, path: str, weight, scales) -> tuple[int, int, str]:
        """(group_size, bits, mode) of the quantized tensor at `path`: its override, else inferred
        from the shapes as mlx-lm infers it (uint8 scales: the microscaling mode whose bits x
        group fits; float scales: affine at the default group size, bits from the packed width)."""
        o = quantmodes.override(self.q, path)
        if o:
            return o["group_size"], o["bits"], o["mode"]
        packed_in, n_groups = weight.shape[-1] * 32, scales.shape[-1]
        if scales.dtype == mx.uint8:
            for mode, (bits, group) in quantmodes.FLOAT_MODES.items():
                if packed_in == n_groups * group * bits:
                    return group, bits, mode
            raise ValueError(f"{path}: uint8 scales fit no quantization mode "
                             f"({packed_in // 32} packed words, {n_groups} groups)")
        group = self.q.get("group_size", 64)
        bits, rem = divmod(packed_in, n_groups * group)
        if rem or bits not in quantmodes.AFFINE_BITS:
            raise ValueError(f"{path}: quantized shapes do not fit group_size={group}")
        return group, bits, "affine"


# ---------------------------------------------------------------- layers

class Linear:
    """Float (`X.weight` [out, in]) or quantized (`X.weight` uint32 + scales [+ biases]) matmul.

    The weight may carry leading batch dims (per-head matrices of MLA's embed_q/unembed_out)."""

    def __init__(self, weights: dict, path: str, qspec: QuantSpec):
        self.path = path
        self.weight = weights[f"{path}.weight"]
        self.bias = weights.get(f"{path}.bias")
        self.scales = weights.get(f"{path}.scales")
        self.biases = weights.get(f"{path}.biases")
        if self.scales is not None:
            self.group_size, self.bits, self.mode = qspec.params(path, self.weight, self.scales)

    @property
    def quantized(self):
        return self.scales is not None

    def __call__(self, x, transpose=True):
        if self.quantized:
            y = mx.quantized_matmul(x, self.weight, scales=self.scales, biases=self.biases,
                                    transpose=transpose, group_size=self.group_size,
                                    bits=self.bits, mode=self.mode)
            return y if self.bias is None else y + self.bias
        w = self.weight.swapaxes(-1, -2) if transpose else self.weight
        return x @ w if self.bias is None else mx.addmm(self.bias, x, w)

    def dense(self):
        """The float weight (dequantized if needed)."""
        if not self.quantized:
            return self.weight
        return mx.dequantize(self.weight, self.scales, self.biases, group_size=self.group_size,
                             bits=self.bits, mode=self.mode)


class Embedding(Linear):
    def lookup(self, ids):
        if not self.quantized:
            return self.weight[ids]
        return mx.dequantize(self.weight[ids], scales=self.scales[ids],
                             biases=None if self.biases is None else self.biases[ids],
                             group_size=self.group_size, bits=self.bits, mode=self.mode)


def rms_norm(x, weight, eps):
    return mx.fast.rms_norm(x, weight, eps)


@partial(mx.compile, shapeless=True)
def swiglu(gate, up):
    # Compiled like mlx-lm's, so the fused kernel rounds the same way.
    return nn.silu(gate) * up


@partial(mx.compile, shapeless=True)
def _situ(x, gate, beta, linear_beta):
    # Compiled like mlx-lm's kimi_k3 SiTU (its argument order, float32 inside), so it rounds the same.
    dtype = x.dtype
    gate, x = gate.astype(mx.float32), x.astype(mx.float32)
    a = beta * mx.tanh(gate / beta) * mx.sigmoid(gate)
    if linear_beta is not None:
        x = linear_beta * mx.tanh(x / linear_beta)
    return (a * x).astype(dtype)


def situ(beta: float = 1.0, linear_beta: float | None = None):
    """SiTU as a GLU activation act(gate, up): beta*tanh(gate/beta)*sigmoid(gate) times up (up
    itself squashed to linear_beta*tanh(up/linear_beta) where linear_beta is given)."""
    def act(gate, up):
        return _situ(up, gate, beta, linear_beta)
    return act


class GLU:
    """Dense gated MLP: down(act(gate(x), up(x))), SwiGLU unless `act` says otherwise."""

    def __init__(self, weights, prefix, qspec, act=swiglu):
        self.gate, self.up, self.down = (Linear(weights, f"{prefix}.{n}", qspec)
                                         for n in ("gate_proj", "up_proj", "down_proj"))
        self.act = act

    def __call__(self, x, experts=None):
        return self.down(self.act(self.gate(x), self.up(x)))


# ---------------------------------------------------------------- rotary embeddings

def _yarn_mscale(factor, mscale):
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_scale(scaling: dict | None) -> float:
    """Extra softmax-scale factor DeepSeek applies under yarn (mscale_all_dim squared)."""
    if not scaling or not scaling.get("mscale_all_dim"):
        return 1.0
    return _yarn_mscale(scaling.get("factor", 1.0), scaling["mscale_all_dim"]) ** 2


class Rope:
    """mx.fast.rope with optional linear or yarn scaling (yarn as DeepSeek defines it)."""

    def __init__(self, dims, base, traditional=False, scaling: dict | None = None):
        self.dims, self.base, self.traditional = dims, base, traditional
        self.scale, self.mscale, self.freqs = 1.0, 1.0, None
        kind = (scaling or {}).get("type") or (scaling or {}).get("rope_type") or "default"
        if kind == "linear":
            self.scale = 1.0 / scaling["factor"]
        elif kind in ("yarn", "deepseek_yarn"):
            self._init_yarn(scaling)
        elif kind != "default":
            raise NotImplementedError(f"rope scaling type {kind!r} is not supported")

    def _init_yarn(self, s):
        dims, base, factor = self.dims, self.base, s["factor"]
        orig = s.get("original_max_position_embeddings", 4096)

        def correction_dim(rotations):
            return dims * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(correction_dim(s.get("beta_fast", 32))), 0)
        high = min(math.ceil(correction_dim(s.get("beta_slow", 1))), dims - 1)
        high = high + 0.001 if low == high else high
        ramp = mx.clip((mx.arange(dims // 2, dtype=mx.float32) - low) / (high - low), 0, 1)
        extra = base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
        inter = factor * extra
        keep = 1.0 - ramp
        self.freqs = (inter * extra) / (inter * keep + extra * (1 - keep))
        self.mscale = _yarn_mscale(factor, s.get("mscale", 1)) / _yarn_mscale(factor, s.get("mscale_all_dim", 0))
        self.base = None

    def __call__(self, x, offset=0):
        if self.mscale != 1.0:
            x = x.at[..., : self.dims].multiply(self.mscale)
        return mx.fast.rope(x, self.dims, traditional=self.traditional, base=self.base,
                            scale=self.scale, offset=offset, freqs=self.freqs)


# ---------------------------------------------------------------- attention in stages

class StagedAttention:
    """What every architecture's attention shares: three stages, so that sequences decoded
    together (`MoETransformer.forward_batch`) run the row-wise work once on their stacked rows.

    `project(x, offset)`: x [B, L, D] -> the parts `attend` takes (projections, norms, rope at
    `offset`: an int, or an int array [B] of one offset per row); `attend(parts, mask, cache,
    offset)`: one sequence's cache update and attention; `output(out)`: [B, H, L, d] -> [B, L, D].
    Only `attend` depends on a sequence's cache, so it alone runs once per sequence (rows of
    different lengths: padding them into one attention would change its reduction, so its
    numerics). Each row's projections, norms and rope are computed from that row only; on the CPU
    the stacked rows give each row bitwise what it gives alone (tests/test_batch.py). A GPU may
    pick another matmul kernel for several rows than for one (MLX CUDA: docs/batch11.md), as it
    already did for the MLPs and the head on stacked rows."""

    def __call__(self, x, mask, cache):
        offset = cache.offset if cache is not None else 0
        return self.output(self.attend(self.project(x, offset), mask, cache, offset))

    def rows(self, x, caches: list, offsets):
        """One decode step of B sequences: x [B, 1, D] (row b is sequence b's token), caches[b]
        its cache, offsets an int array [B] of their lengths (the rope positions) -> [B, 1, D]."""
        parts = self.project(x, offsets)
        outs = [self.attend([p[b:b + 1] for p in parts], None, c, c.offset) for b, c in enumerate(caches)]
        return self.output(mx.concatenate(outs, axis=0))

    def project(self, x, offset):
        raise NotImplementedError

    def attend(self, parts, mask, cache, offset):
        """parts (q, k, v) [B, heads, L, d]: the cache grows by k and v, the queries attend to it."""
        q, k, v = parts
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)

    def output(self, out):
        B, _, L, _ = out.shape
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


