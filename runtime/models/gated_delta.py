"""Gated DeltaNet, the linear attention of Qwen3-Next and Qwen3.5: a depthwise short convolution
over q, k and v, then the gated delta rule recurrence on a float32 state [heads, value dim, key
dim] per sequence, read out through a gated RMSNorm. Also the gated softmax attention the
same models put on every full_attention_interval-th layer.

The recurrence runs as mlx-lm 0.32.2 runs it: off Metal its ops path, one compiled step per
position (the CPU and CUDA take it), so the state and the logits match mlx-lm's bitwise there; on
an Apple GPU mlx-lm's own Metal kernel (`mlx_lm.models.gated_delta.gated_delta_kernel`) where
mlx-lm is installed and would take it (not run here: no Mac).
"""
from functools import cache, partial

import mlx.core as mx
import mlx.nn as nn

from .base import Linear, rms_norm
from .caches import RecurrentCache
from .decoder import Attention

L2_EPS = 1e-6  # the l2 normalisation's eps, added to the sum of squares


@partial(mx.compile, shapeless=True)
def decay(A_log, a, dt_bias):
    """The per-head decay g = exp(-exp(A_log) * softplus(a + dt_bias)), in float32."""
    return mx.exp(-mx.exp(A_log.astype(mx.float32)) * nn.softplus(a + dt_bias))


@partial(mx.compile, shapeless=True)
def gated_output(y, z, normed):
    """silu(z) * rms_norm(y), in float32, back in y's dtype."""
    return (nn.silu(z.astype(mx.float32)) * normed.astype(mx.float32)).astype(y.dtype)


def normalize_qk(q, k, dk: int):
    """L2-normalised q and k (as rms_norm with the eps scaled to the mean), with the readout scale
    dk**-0.5 folded into q."""
    inv = dk ** -0.5
    eps = L2_EPS * inv ** 2
    return (inv ** 2) * mx.fast.rms_norm(q, None, eps), inv * mx.fast.rms_norm(k, None, eps)


@mx.compile
def delta_step(q, k, v, g, beta, state):
    """One position: q, k [B, H, Dk], v [B, H, Dv], g and beta [B, H], state [B, H, Dv, Dk] ->
    (y [B, H, Dv] in q's dtype, the new state)."""
    state = state * g[..., None, None]
    remembered = (state * k[..., None, :]).sum(axis=-1)
    delta = (v - remembered) * beta[..., None]
    state = state + k[..., None, :] * delta[..., None]
    y = (state * q[..., None, :]).sum(axis=-1)
    return y.astype(q.dtype), state


@cache
def _mlx_lm_kernel():
    try:
        from mlx_lm.models.gated_delta import gated_delta_kernel
    except ImportError:
        return None
    return gated_delta_kernel


def metal_kernel(dk: int):
    """mlx-lm's Metal kernel of the recurrence where mlx-lm would run it (the default device an
    Apple GPU, key dim a multiple of 32) and mlx-lm is installed; else None."""
    if mx.default_device() != mx.gpu or not mx.metal.is_available() or dk < 32 or dk % 32:
        return None
    return _mlx_lm_kernel()


def gated_delta(q, k, v, g, beta, state):
    """The recurrence over T positions: q, k [B, T, Hk, Dk], v [B, T, Hv, Dv], g, beta [B, T, Hv],
    state [B, Hv, Dv, Dk] float32 or None (zeros) -> (y [B, T, Hv, Dv], the state after T)."""
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    if state is None:
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    if (kernel := metal_kernel(Dk)) is not None:
        return kernel(q, k, v, g, beta, state)
    if Hv // Hk > 1:
        q, k = mx.repeat(q, Hv // Hk, -2), mx.repeat(k, Hv // Hk, -2)
    ys = []
    for t in range(T):
        y, state = delta_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        ys.append(y)
    return mx.stack(ys, axis=1), state


class GatedDeltaNet:
    """One linear-attention layer. Its projections come in two layouts: Qwen3-Next's
    in_proj_qkvz / in_proj_ba (interleaved per key head) and Qwen3.5's in_proj_qkv, in_proj_z,
    in_proj_b, in_proj_a. The conv1d weight is mlx-lm's, [channels, kernel, 1] (the family turns a
    Hugging Face checkpoint's into it)."""

    def __init__(self, weights, prefix, qspec, c: dict):
        self.nk, self.nv = c["linear_num_key_heads"], c["linear_num_value_heads"]
        self.dk, self.dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
        if self.nv % self.nk:
            raise ValueError(f"linear_num_value_heads {self.nv} is not a multiple of linear_num_key_heads {self.nk}")
        self.key_dim = self.nk * self.dk
        self.channels = 2 * self.key_dim + self.nv * self.dv
        self.width = c["linear_conv_kernel_dim"] - 1
        self.eps = c.get("rms_norm_eps", 1e-6)
        self.conv = weights[f"{prefix}.conv1d.weight"]
        self.A_log, self.dt_bias = weights[f"{prefix}.A_log"], weights[f"{prefix}.dt_bias"]
        self.norm = weights[f"{prefix}.norm.weight"]
        self.out_proj = Linear(weights, f"{prefix}.out_proj", qspec)
        self.fused = f"{prefix}.in_proj_qkvz.weight" in weights
        names = ("in_proj_qkvz", "in_proj_ba") if self.fused else ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
        self.proj = [Linear(weights, f"{prefix}.{n}", qspec) for n in names]

    def inputs(self, x):
        """x [B, S, D] -> the convolution's input qkv [B, S, channels], z [B, S, Hv, Dv], b and a
        [B, S, Hv]."""
        B, S, _ = x.shape
        if not self.fused:
            qkv_p, z_p, b_p, a_p = self.proj
            return qkv_p(x), z_p(x).reshape(B, S, self.nv, self.dv), b_p(x), a_p(x)
        per = self.nv // self.nk
        qkvz = self.proj[0](x).reshape(B, S, self.nk, -1)
        ba = self.proj[1](x).reshape(B, S, self.nk, -1)
        q, k, v, z = mx.split(qkvz, [self.dk, 2 * self.dk, 2 * self.dk + per * self.dv], axis=-1)
        b, a = mx.split(ba, [per], axis=-1)
        qkv = mx.concatenate([q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1)], axis=-1)
        return qkv, z.reshape(B, S, -1, self.dv), b.reshape(B, S, self.nv), a.reshape(B, S, self.nv)

    def mix(self, full, z, b, a, state):
        """full: the convolution's input over the pass [B, width + S, channels] -> (output
        [B, S, D], the new state)."""
        B, S = z.shape[:2]
        conv = nn.silu(mx.conv1d(full, self.conv, groups=self.channels))
        q, k, v = mx.split(conv, [self.key_dim, 2 * self.key_dim], -1)
        q, k = normalize_qk(q.reshape(B, S, self.nk, self.dk), k.reshape(B, S, self.nk, self.dk), self.dk)
        y, state = gated_delta(q, k, v.reshape(B, S, self.nv, self.dv), decay(self.A_log, a, self.dt_bias),
                               mx.sigmoid(b), state)
        y = gated_output(y, z, rms_norm(y, self.norm, self.eps))
        return self.out_proj(y.reshape(B, S, -1)), state

    def __call__(self, x, mask, cache: RecurrentCache | None):
        """One sequence's pass (no padding: the mask is unused)."""
        qkv, z, b, a = self.inputs(x)
        if cache is None:
            full = RecurrentCache.shift(None, qkv, self.width)[0]
            return self.mix(full, z, b, a, None)[0]
        out, state = self.mix(cache.conv_window(qkv), z, b, a, cache.state)
        cache.set_state(state)
        cache.advance(x.shape[1])
        return out

    def rows(self, x, caches: list, offsets):
        """One decode step of B sequences on their stacked state rows (x [B, 1, D])."""
        qkv, z, b, a = self.inputs(x)
        state, conv = RecurrentCache.stack(caches)
        full, tail = RecurrentCache.shift(conv, qkv, self.width)
        out, state = self.mix(full, z, b, a, state)
        RecurrentCache.unstack(caches, state, tail)
        for c in caches:
            c.advance(1)
        return out


class GatedAttention(Attention):
    """Softmax attention whose q_proj also gives a per-head output gate: the output is
    attention * sigmoid(gate) before o_proj (q and k RMSNorm per head, partial rope)."""

    def project(self, x, offset):
        B, L, _ = x.shape
        q, gate = mx.split(self.q_proj(x).reshape(B, L, self.n_heads, -1), 2, axis=-1)
        k, v = self.k_proj(x), self.v_proj(x)
        q = rms_norm(q, self.q_norm, self.eps).transpose(0, 2, 1, 3)
        k = rms_norm(k.reshape(B, L, self.n_kv_heads, -1), self.k_norm, self.eps).transpose(0, 2, 1, 3)
        v = v.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        return self.rope(q, offset), self.rope(k, offset), v, gate.transpose(0, 2, 1, 3)

    def attend(self, parts, mask, cache, offset):
        return super().attend(parts[:3], mask, cache, offset) * mx.sigmoid(parts[3])
