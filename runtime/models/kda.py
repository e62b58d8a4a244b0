"""Kimi Delta Attention (KDA), the linear-attention layer of kimi_linear and Kimi K3: q, k, v
through a causal depthwise short convolution (its last kernel - 1 inputs kept between passes),
then the gated delta rule with a per-channel decay over a [heads, head_dim, head_dim] float32
state, an RMS-normed and sigmoid-gated output.

The recurrence runs as mlx-lm's ops path does on the CPU (one compiled step per position), so the
state and the output match it bit for bit there. Sequences decoded together step their state rows
at once (`rows`: RecurrentCache.stack -> one step on [B, ...] -> unstack); every op is row-wise.
"""
from functools import partial

import mlx.core as mx
import mlx.nn as nn

from .base import Linear, rms_norm
from .caches import RecurrentCache

QK_NORM_EPS = 1e-6  # the l2 norm's eps of q and k (added to the sum of squares)


@partial(mx.compile, shapeless=True)
def _decay(A_log, a, dt_bias):
    return mx.exp(-mx.exp(A_log.astype(mx.float32)) * nn.softplus(a + dt_bias))


@partial(mx.compile, shapeless=True)
def _bounded_decay(A_log, a, dt_bias, lower_bound):
    return mx.exp(lower_bound * mx.sigmoid(mx.exp(A_log.astype(mx.float32)) * (a.astype(mx.float32) + dt_bias)))


@mx.compile
def _delta_step(q, k, v, g, beta, state):
    """One position of the gated delta rule: q, k [B, H, Dk], v [B, H, Dv], g [B, H, Dk] (per
    channel decay), beta [B, H], state [B, H, Dv, Dk] -> (y [B, H, Dv] in q's dtype, new state)."""
    state = state * g[..., None, :]
    kv_mem = (state * k[..., None, :]).sum(axis=-1)
    delta = (v - kv_mem) * beta[..., None]
    state = state + k[..., None, :] * delta[..., None]
    y = (state * q[..., None, :]).sum(axis=-1)
    return y.astype(q.dtype), state


def normalize_qk(q, k, scale: float):
    """q and k L2-normalised over head_dim (eps QK_NORM_EPS on the sum of squares, hence scaled
    for rms_norm's mean), the readout scale head_dim**-0.5 folded into q."""
    eps = QK_NORM_EPS * scale ** 2
    return (scale ** 2) * mx.fast.rms_norm(q, None, eps), scale * mx.fast.rms_norm(k, None, eps)


def delta_rule(q, k, v, g, beta, state):
    """The recurrence over a pass: q, k, v [B, T, H, D], g [B, T, H, Dk], beta [B, T, H];
    state [B, H, Dv, Dk] or None (zeros) -> (y [B, T, H, Dv], the state after the last position)."""
    B, T, H, Dk = q.shape
    if state is None:
        state = mx.zeros((B, H, v.shape[-1], Dk), dtype=mx.float32)
    ys = []
    for t in range(T):
        y, state = _delta_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        ys.append(y)
    return mx.stack(ys, axis=1), state


class ShortConv:
    """Causal depthwise convolution, kernel K, over one or more channel groups kept apart (Kimi K3
    convolves q, k, v as one [3P] group; kimi_linear as three of P): the conv state is their last
    K - 1 inputs side by side [B, K - 1, sum of widths]; silu on the output."""

    def __init__(self, weights: list, widths: list):
        self.weights, self.widths = weights, widths
        self.width = weights[0].shape[1] - 1

    def __call__(self, xs: list, prev):
        """xs: each group's input [B, T, width]; prev: the state or None -> (outputs, new state)."""
        outs, tails, s = [], [], 0
        for x, w, n in zip(xs, self.weights, self.widths):
            full, tail = RecurrentCache.shift(None if prev is None else prev[..., s:s + n], x, self.width)
            outs.append(nn.silu(mx.conv1d(full, w, groups=n)))
            tails.append(tail)
            s += n
        return outs, (tails[0] if len(tails) == 1 else mx.concatenate(tails, axis=-1))


def conv_weight(w):
    """A depthwise convolution's weight as MLX takes it, [C, K, 1] (the Hugging Face layout is
    [C, 1, K])."""
    return w.moveaxis(2, 1) if w.shape[1] == 1 else w


class KimiDeltaAttention:
    """One KDA layer: Kimi K3's fused qkv_proj / qkv_conv where the checkpoint has them (mlx-lm
    fuses them), else q/k/v_proj and q/k/v_conv; `gate_lower_bound` in the config selects the
    bounded decay; `use_full_rank_gate` g_proj."""

    def __init__(self, model, prefix: str):
        c, w, qs = model.config["linear_attn_config"], model.w, model.qspec
        fused = f"{prefix}.qkv_proj.weight" in w
        self.heads, self.head_dim = int(c["num_heads"]), int(c["head_dim"])
        self.scale = float(self.head_dim) ** -0.5
        self.lower_bound = c.get("gate_lower_bound")
        self.eps = model.eps
        P = self.heads * self.head_dim
        names = ("qkv",) if fused else ("q", "k", "v")
        self.in_proj = [Linear(w, f"{prefix}.{n}_proj", qs) for n in names]
        self.conv = ShortConv([conv_weight(w[f"{prefix}.{n}_conv.conv.weight"]) for n in names],
                              [3 * P] if fused else [P, P, P])
        self.f_a, self.f_b = Linear(w, f"{prefix}.f_a_proj", qs), Linear(w, f"{prefix}.f_b_proj", qs)
        self.b_proj = Linear(w, f"{prefix}.b_proj", qs)
        if c.get("use_full_rank_gate", False):
            self.gate = [Linear(w, f"{prefix}.g_proj", qs)]
        else:
            self.gate = [Linear(w, f"{prefix}.g_a_proj", qs), Linear(w, f"{prefix}.g_b_proj", qs)]
        self.A_log = w[f"{prefix}.A_log"].reshape(self.heads, 1)
        self.dt_bias = w[f"{prefix}.dt_bias"].reshape(self.heads, self.head_dim)
        self.o_norm = w[f"{prefix}.o_norm.weight"]
        self.o_proj = Linear(w, f"{prefix}.o_proj", qs)

    def step(self, x, state, conv):
        """x [B, T, D] with the state and conv rows of its B sequences (None: a first pass) ->
        (output [B, T, D], new state, new conv)."""
        B, T, _ = x.shape
        shape = (B, T, self.heads, self.head_dim)
        outs, conv = self.conv([p(x) for p in self.in_proj], conv)
        if len(outs) == 1:  # fused: q, k, v side by side
            P = self.heads * self.head_dim
            outs = [outs[0][..., :P], outs[0][..., P:2 * P], outs[0][..., 2 * P:]]
        q, k, v = (o.reshape(shape) for o in outs)
        q, k = normalize_qk(q, k, self.scale)
        a = self.f_b(self.f_a(x)).reshape(shape)
        beta = mx.sigmoid(self.b_proj(x).reshape(B, T, self.heads))
        if self.lower_bound is None:
            g = _decay(self.A_log, a, self.dt_bias)
        else:
            g = _bounded_decay(self.A_log, a, self.dt_bias, self.lower_bound)
        y, state = delta_rule(q, k, v, g, beta, state)
        gate = x
        for proj in self.gate:
            gate = proj(gate)
        y = rms_norm(y.reshape(shape), self.o_norm, self.eps) * mx.sigmoid(gate.reshape(shape))
        return self.o_proj(y.reshape(B, T, -1)), state, conv

    def __call__(self, x, mask, cache):
        if cache is None:
            return self.step(x, None, None)[0]
        y, cache.state, cache.conv = self.step(x, cache.state, cache.conv)
        cache.advance(x.shape[1])
        return y

    def rows(self, x, caches: list, offsets):
        """One decode step of B sequences (x [B, 1, D]): their states stepped as one [B, ...] array."""
        state, conv = RecurrentCache.stack(caches)
        y, state, conv = self.step(x, state, conv)
        RecurrentCache.unstack(caches, state, conv)
        for c in caches:
            c.advance(1)
        return y
