"""The prompt cache: the KV of prompt prefixes kept across requests, so a shared prefix is
prefilled once.

A prompt is cut into blocks of `block` tokens (the prefill chunk, compute.prefill_chunk: a
sequence's prefill passes are exactly its blocks, so a sequence starting from cached blocks
computes its remaining chunks over the same rows, with the same keys before them, as a fresh
prefill does: its logits are bit-identical). Each block is named by a hash chain (the block's
tokens and its parent's name), so a block stands for the whole prefix it ends. An entry holds
every layer's keys and values of its block's positions, copied out of the sequence that
prefilled it and never written again; a sequence starting from cached blocks copies them into
its own cache, so requests decoding together share a prefix without sharing buffers.

Entries live in memory only (nothing is written to disk), within compute.prompt_cache_bytes (a
share of the memory budget, runtime/budget.py reserves it beside the KV reserve, so the cache
never takes an expert slot's room); the least recently used blocks go first when a new one does
not fit.

Families with a sliding window or a recurrent state are excluded (runtime/layerkinds.py `prefix_unsupported`): their caches
at a block boundary are not the positions' keys and values alone (a window drops positions, a
recurrent state sums all of them), so reusing a prefix would need a per-boundary snapshot of
that state.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from deltafin.runtime.metrics import Counter


@dataclass(eq=False)
class Block:
    """One cached block: its tokens, and every layer's keys and values of its positions."""
    tokens: tuple
    keys: list
    values: list
    nbytes: int


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
        """Empty caches (one per layer) start from the blocks' keys and values; returns the
        positions they now hold."""
        n = len(blocks) * self.block
        if not blocks:
            return 0
        for layer, cache in enumerate(caches):
            keys = mx.concatenate([b.keys[layer] for b in blocks], axis=2)
            values = mx.concatenate([b.values[layer] for b in blocks], axis=2)
            cache.append(keys, values, 0)
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
        keys = [mx.contiguous(c.keys[..., start:end, :]) for c in caches]
        values = [mx.contiguous(c.values[..., start:end, :]) for c in caches]
        nbytes = sum(a.nbytes for a in keys) + sum(a.nbytes for a in values)
        if nbytes > self.capacity:
            return
        self._evict(self.capacity - nbytes)
        mx.eval(keys, values)
        self.blocks[name] = Block(tuple(ids[start:end]), keys, values, nbytes)
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
