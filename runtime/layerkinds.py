"""Which cache each layer's attention keeps, as numbers (no MLX here: the budget and the
supervisor import this; runtime/models/caches.py holds the MLX caches of each kind).

A family declares one kind per layer (archinfo.ArchInfo.caches): softmax attention over every
position keeps a `FullKV`, a windowed one a `SlidingKV`, multi-head latent attention a `LatentKV`
and a linear-attention layer a `RecurrentState`. The kind also names the attention the layer
runs, so a hybrid model builds each layer's attention from its kind. Each kind says what its
cache holds at n positions (`nbytes`: the budget's KV reserve) and what it may have allocated by
then (`grown_bytes`: what admission charges a sequence).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

STEP = 256  # positions a growing cache allocates at once


def sequence_kv_tokens(n_tokens: int, step: int = STEP) -> int:
    """Positions a growing cache of n_tokens has allocated: whole steps."""
    return -(-max(1, int(n_tokens)) // step) * step


@dataclass(frozen=True)
class CacheKind:
    """One layer's cache. Subclasses say how many elements it holds at n positions."""

    def elements(self, n_tokens: int) -> int:
        raise NotImplementedError

    def allocated(self, n_tokens: int) -> int:
        """Elements allocated once n_tokens positions went in (a growing cache rounds up)."""
        return self.elements(n_tokens)

    def nbytes(self, n_tokens: int, itemsize: int) -> int:
        return self.elements(n_tokens) * itemsize

    def grown_bytes(self, n_tokens: int, itemsize: int) -> int:
        return self.allocated(n_tokens) * itemsize

    def reserve_bytes(self, n_tokens: int, sequences: int, itemsize: int) -> int:
        """The KV reserve's share for this layer: n_tokens positions shared by up to `sequences`
        sequences decoded together."""
        return self.nbytes(n_tokens, itemsize)


@dataclass(frozen=True)
class FullKV(CacheKind):
    """Keys and values of every position: k_width and v_width elements per position (heads x dim)."""

    k_width: int
    v_width: int

    def elements(self, n_tokens: int) -> int:
        return int(n_tokens) * (self.k_width + self.v_width)

    def allocated(self, n_tokens: int) -> int:
        return self.elements(sequence_kv_tokens(n_tokens))


@dataclass(frozen=True)
class LatentKV(FullKV):
    """Multi-head latent attention with the latent cached (absorbed): the cache holds the latent
    and the shared rotary key of every position, and is charged as the per-head keys (k_width)
    and values (v_width) they stand for, an upper bound of what it holds."""


@dataclass(frozen=True)
class SlidingKV(FullKV):
    """Keys and values of the last `window` positions only. The cache keeps window - 1 positions
    between passes plus the pass's own (`chunk`: the longest pass, the prefill chunk), in steps."""

    window: int
    chunk: int = 1

    def elements(self, n_tokens: int) -> int:
        return min(int(n_tokens), self.window) * (self.k_width + self.v_width)

    def allocated(self, n_tokens: int) -> int:
        held = min(sequence_kv_tokens(n_tokens), self.window - 1 + sequence_kv_tokens(self.chunk))
        return held * (self.k_width + self.v_width)


@dataclass(frozen=True)
class RecurrentState(CacheKind):
    """A linear-attention layer's fixed-size state: the recurrent state (e.g. heads x key dim x
    value dim, kept in `state_itemsize` bytes, often float32 whatever the model dtype; 0: the
    model's) and the short convolution's last kernel - 1 inputs (conv_shape). The same bytes
    at any length."""

    state_shape: tuple
    conv_shape: tuple = ()
    state_itemsize: int = 0

    def elements(self, n_tokens: int) -> int:
        return math.prod(self.state_shape) + (math.prod(self.conv_shape) if self.conv_shape else 0)

    def nbytes(self, n_tokens: int, itemsize: int) -> int:
        conv = math.prod(self.conv_shape) if self.conv_shape else 0
        return math.prod(self.state_shape) * (self.state_itemsize or itemsize) + conv * itemsize

    def grown_bytes(self, n_tokens: int, itemsize: int) -> int:
        return self.nbytes(n_tokens, itemsize)

    def reserve_bytes(self, n_tokens: int, sequences: int, itemsize: int) -> int:
        """One state per sequence, whatever their lengths."""
        return max(1, int(sequences)) * self.nbytes(n_tokens, itemsize)


def prefix_unsupported(layer_kinds) -> str | None:
    """Why a model's caches cannot start from a cached prompt prefix (workers/prompt_cache.py;
    None: they can: keys and values of every position, or a recurrent state kept per block)."""
    for kind in layer_kinds:
        if isinstance(kind, SlidingKV):
            return "sliding-window attention: its cache drops positions, a prefix is not its keys alone"
    return None
