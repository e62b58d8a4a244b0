"""The prompt cache: the KV (and linear-attention layers' recurrent state) of prompt prefixes
kept across requests, so a shared prefix is prefilled once.

A prompt is cut into blocks of `block` tokens (the prefill chunk, compute.prefill_chunk: a
sequence's prefill passes are exactly its blocks, so a sequence starting from cached blocks
computes its remaining chunks over the same rows, with the same keys before them, as a fresh
prefill does: its logits are bit-identical). Each block is named by a hash chain (the block's
tokens and its parent's name), so a block stands for the whole prefix it ends. An entry holds,
per layer, an attention layer's keys and values of its block's positions, copied out of the
sequence that prefilled it and never written again, or a linear-attention layer's recurrent
state and convolution tail at the block's end (what that layer had summed of the whole prefix;
the layers replace those arrays at each pass, never write into them, so the entry keeps the
arrays the block's pass produced). A
sequence starting from cached blocks copies the keys and values into its own cache and takes the
last block's states, so requests decoding together share a prefix without sharing buffers.

Entries live in memory only (nothing is written to disk), within compute.prompt_cache_bytes (a
share of the memory budget, runtime/budget.py reserves it beside the KV reserve, so the cache
never takes an expert slot's room); the least recently used blocks go first when a new one does
not fit.

Families with a sliding window are excluded (runtime/layerkinds.py `prefix_unsupported`): a
window's cache at a block boundary has dropped positions a later block's queries still see.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from deltafin.runtime.metrics import Counter
from deltafin.runtime.models.caches import RecurrentCache


@dataclass(eq=False)
class Block:
    """One cached block: its tokens, and per layer a pair of arrays: an attention layer's keys
    and values of the block's positions, a recurrent layer's state and conv at its end."""
    tokens: tuple
    layers: list
    nbytes: int


def snapshot(cache, start: int, end: int) -> tuple:
    """One layer's share of the block of positions [start, end), just prefilled into cache."""
    if isinstance(cache, RecurrentCache):
        return cache.state, cache.conv
    return mx.contiguous(cache.keys[..., start:end, :]), mx.contiguous(cache.values[..., start:end, :])


def chain(ids: list, block: int, n_blocks: int) -> list[bytes]:
    """The names of the first n_blocks blocks of ids: each hashes its parent's name and its tokens."""
    names, parent = [], b""
    for i in range(n_blocks):
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(np.asarray(ids[i * block:(i + 1) * block], dtype=np.int64).tobytes())
        parent = h.digest()
        names.append(parent)
    return names


class PromptCache:
    """Blocks of prompt prefixes in LRU order, within `capacity` bytes (see the module)."""

    def __init__(self, block: int, capacity: int):
        self.block, self.capacity = int(block), int(capacity)
        self.blocks: OrderedDict[bytes, Block] = OrderedDict()
        self.nbytes = 0
        self.counters = Counter()

    def lookup(self, ids: list, limit: int) -> list[Block]:
        """The cached blocks that start ids, at most `limit` tokens of them, in order (each
        becomes the most recently used)."""
        self.counters.add("lookups")
        found = []
        names = chain(ids, self.block, limit // self.block)
        for i, name in enumerate(names):
            blk = self.blocks.get(name)
            if blk is None or blk.tokens != tuple(ids[i * self.block:(i + 1) * self.block]):
                break
            found.append(blk)
        self._touch(names[:len(found)])
        if found:
            self.counters.add("hits")
            self.counters.add("reused_tokens", len(found) * self.block)
        return found

    def restore(self, blocks: list[Block], caches: list) -> int:
        """Empty caches (one per layer) start from the blocks (keys and values of them all, the
        last one's recurrent states); returns the positions they now hold."""
        n = len(blocks) * self.block
        if not blocks:
            return 0
        for layer, cache in enumerate(caches):
            if isinstance(cache, RecurrentCache):
                cache.state, cache.conv = blocks[-1].layers[layer]
            else:
                cache.append(mx.concatenate([b.layers[layer][0] for b in blocks], axis=2),
                             mx.concatenate([b.layers[layer][1] for b in blocks], axis=2), 0)
            cache.offset = n
        return n

    def insert(self, ids: list, end: int, caches: list) -> None:
        """The block of ids ending at position `end` (a multiple of the block), just prefilled
        into caches, is kept (copied) unless it is already; older blocks go to make room."""
        names = chain(ids, self.block, end // self.block)
        name = names[-1]
        if name in self.blocks:
            self._touch(names)
            return
        start = end - self.block
        layers = [snapshot(c, start, end) for c in caches]
        arrays = [a for pair in layers for a in pair if a is not None]
        nbytes = sum(a.nbytes for a in arrays)
        if nbytes > self.capacity:
            return
        self._evict(self.capacity - nbytes)
        mx.eval(arrays)
        self.blocks[name] = Block(tuple(ids[start:end]), layers, nbytes)
        self.nbytes += nbytes
        self.counters.add("inserted_blocks")
        self._touch(names)

    def _touch(self, names: list) -> None:
        """A chain of blocks was used: each becomes more recent than its descendants, so eviction
        takes a prefix's last blocks before its first (a block is reachable while its parent is)."""
        for name in reversed(names):
            if name in self.blocks:
                self.blocks.move_to_end(name)

    def _evict(self, room: int) -> None:
        """Least recently used blocks go until at most `room` bytes are held."""
        while self.blocks and self.nbytes > room:
            _, blk = self.blocks.popitem(last=False)
            self.nbytes -= blk.nbytes
            self.counters.add("evicted_blocks")

    def stats(self) -> dict:
        c = self.counters
        return {"block_tokens": self.block, "capacity_bytes": self.capacity, "bytes": self.nbytes,
                "blocks": len(self.blocks), **{k: int(c.get(k)) for k in
                ("lookups", "hits", "reused_tokens", "inserted_blocks", "evicted_blocks")}}
