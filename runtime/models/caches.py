"""The caches layers keep between passes, one class per kind of runtime/layerkinds.py.

Every cache counts the positions it has seen (`offset`: a sequence's length, its rope position)
and the bytes it holds now (`nbytes`). Batching: sequences decoded together keep their own caches;
attention caches are updated and read per sequence (StagedAttention.rows), while a linear-attention
layer steps the state rows of all of them at once (`RecurrentCache.stack` -> one step on
[B, ...] -> `RecurrentCache.unstack`).
"""
from __future__ import annotations

import mlx.core as mx

from deltafin.runtime.layerkinds import STEP, CacheKind, FullKV, RecurrentState, SlidingKV


class LayerCache:
    offset: int = 0

    @property
    def nbytes(self) -> int:
        raise NotImplementedError


class KVCache(LayerCache):
    """Keys and values of every position, grown in steps, shape [B, heads, positions, dim]
    (also MLA's latent and rotary key: heads 1)."""

    step = STEP

    def __init__(self):
        self.keys = self.values = None
        self.offset = 0

    def update_and_fetch(self, keys, values):
        k, v = self.append(keys, values, self.offset)
        self.offset += keys.shape[2]
        return k, v

    def rewind(self, n: int) -> None:
        """Takes the last n positions back (a pass computed again): the next update writes over
        them; the rows up to the offset are untouched."""
        self.offset -= n

    def append(self, keys, values, start: int):
        """Write keys/values at buffer row `start` (growing the buffers in steps); the rows up to
        them."""
        n = keys.shape[2]
        if self.keys is None or start + n > self.keys.shape[2]:
            room = -(-n // self.step) * self.step

            def grow(buf, new):
                pad = mx.zeros((*new.shape[:2], room, new.shape[3]), new.dtype)
                return pad if buf is None else mx.concatenate([buf[..., :start, :], pad], axis=2)

            self.keys, self.values = grow(self.keys, keys), grow(self.values, values)
        end = start + n
        self.keys[..., start:end, :] = keys
        self.values[..., start:end, :] = values
        return self.keys[..., :end, :], self.values[..., :end, :]

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


class SlidingKVCache(KVCache):
    """Keys and values of the last `window` positions. `update_and_fetch` returns every key a query
    of the pass may see: the window - 1 positions before the pass, then the pass's own; the first
    of them is at absolute position `visible` (the attention masks each query to its own window).
    Positions no later query can see are dropped before the buffer grows, so it holds at most
    window - 1 positions plus one pass's, in steps (layerkinds.SlidingKV)."""

    def __init__(self, window: int):
        super().__init__()
        self.window = window
        self.start = self.visible = 0  # absolute positions of the buffer's first row, the first key returned

    def rewind(self, n: int) -> None:
        raise TypeError("a sliding-window cache drops positions as it goes: it cannot take a pass back")

    def update_and_fetch(self, keys, values):
        n = keys.shape[2]
        self.visible = max(self.start, self.offset - (self.window - 1))
        held = self.offset - self.start
        if self.keys is not None and held + n > self.keys.shape[2] and self.visible > self.start:
            drop = self.visible - self.start
            self.keys = mx.contiguous(self.keys[..., drop:held, :])
            self.values = mx.contiguous(self.values[..., drop:held, :])
            self.start, held = self.visible, held - drop
        k, v = self.append(keys, values, held)
        self.offset += n
        skip = self.visible - self.start
        return k[..., skip:, :], v[..., skip:, :]


class RecurrentCache(LayerCache):
    """A linear-attention layer's state: `state` [B, *state_shape] (the recurrent state) and `conv`
    [B, kernel - 1, channels] (the short convolution's last inputs); None until the first pass.
    One sequence's layer math calls `conv_window` with its convolution input, `set_state` with
    the new state and `advance(n)` with the pass's positions; B sequences decoded together run
    `stack` -> `shift` and the step on the [B, ...] rows -> `unstack` and `advance(1)` each."""

    def __init__(self, kind: RecurrentState):
        self.kind, self.state, self.conv, self.offset = kind, None, None, 0

    @property
    def conv_width(self) -> int:
        return self.kind.conv_shape[0] if self.kind.conv_shape else 0

    def conv_window(self, x):
        """x [1, L, channels] -> [1, kernel - 1 + L, channels] (see `shift`); keeps the new tail."""
        full, self.conv = self.shift(self.conv, x, self.conv_width)
        return full

    @staticmethod
    def shift(prev, x, width: int):
        """The convolution's input over a pass: prev [B, width, channels] (None: zeros, before the
        first pass) then x [B, L, channels]; returns it and its last `width` rows (kept for the next
        pass). Works on one sequence's rows or on B stacked ones alike."""
        if prev is None:
            prev = mx.zeros((x.shape[0], width, x.shape[-1]), x.dtype)
        full = mx.concatenate([prev, x], axis=1)
        # a copy, so the cache does not keep the whole pass's input alive
        return full, mx.contiguous(full[:, full.shape[1] - width:, :])

    def set_state(self, state) -> None:
        self.state = state

    def advance(self, n: int) -> None:
        self.offset += n

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.state, self.conv) if a is not None)

    @staticmethod
    def stack(caches: list):
        """The state and conv rows of B sequences as [B, ...] arrays (None where none has one yet:
        a new sequence's state is zeros of its first row's shape, made by the layer)."""
        def rows(name):
            parts = [getattr(c, name) for c in caches]
            if all(p is None for p in parts):
                return None
            like = next(p for p in parts if p is not None)
            return mx.concatenate([mx.zeros_like(like) if p is None else p for p in parts], axis=0)
        return rows("state"), rows("conv")

    @staticmethod
    def unstack(caches: list, state, conv) -> None:
        """Row b of state/conv [B, ...] back into caches[b]."""
        for b, c in enumerate(caches):
            c.state = None if state is None else state[b:b + 1]
            c.conv = None if conv is None else conv[b:b + 1]


def make_cache(kind: CacheKind) -> LayerCache:
    """The empty cache of one layer of this kind."""
    if isinstance(kind, SlidingKV):
        return SlidingKVCache(kind.window)
    if isinstance(kind, FullKV):  # LatentKV too: the latent and rotary key grow like keys and values
        return KVCache()
    if isinstance(kind, RecurrentState):
        return RecurrentCache(kind)
    raise TypeError(f"no cache for layer kind {kind!r}")
