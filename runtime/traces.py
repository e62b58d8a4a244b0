"""Routing traces: which experts each token used at each MoE layer (docs/TRACES.md).

A trace is a numpy archive (.npz) with three arrays:
  ids      [tokens, moe_layers, top_k]  expert ids; uint8 when the model has <= 256 experts, else uint16
  lengths  [requests]                   tokens of each prompt/request, in order (they sum to tokens)
  names    [requests]                   a name per prompt/request (str)
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np


class TraceError(ValueError):
    """A trace file that is missing, unreadable or not in the format of docs/TRACES.md."""


def ids_dtype(n_experts: int) -> np.dtype:
    return np.dtype(np.uint8 if n_experts <= 256 else np.uint16)


@dataclass
class Trace:
    ids: np.ndarray      # [tokens, moe_layers, top_k]
    lengths: np.ndarray  # [requests] int64
    names: np.ndarray    # [requests] str

    @property
    def tokens(self) -> int:
        return self.ids.shape[0]

    @property
    def n_layers(self) -> int:
        return self.ids.shape[1]

    @property
    def top_k(self) -> int:
        return self.ids.shape[2]

    @property
    def n_experts(self) -> int:
        """Smallest expert count the ids allow (max id + 1); the model may have more."""
        return int(self.ids.max()) + 1 if self.ids.size else 0

    def head(self, n: int) -> "Trace":
        """The first n tokens (the requests they reach, the last one cut to fit)."""
        ends = np.cumsum(self.lengths)
        keep = int(np.searchsorted(ends, n)) + 1 if n < self.tokens else len(self.lengths)
        lengths = self.lengths[:keep].copy()
        if keep and n < self.tokens:
            lengths[-1] -= int(ends[keep - 1]) - n
        return Trace(self.ids[:n], lengths, self.names[:keep])

    def requests(self):
        """(name, ids of its tokens) per request, in order."""
        start = 0
        for name, n in zip(self.names, self.lengths):
            yield str(name), self.ids[start:start + n]
            start += n


def check_trace(ids, lengths, names, where: str = "trace") -> Trace:
    ids, lengths, names = np.asarray(ids), np.asarray(lengths), np.asarray(names)
    if ids.ndim != 3:
        raise TraceError(f"{where}: ids must be [tokens, moe_layers, top_k], got shape {ids.shape}")
    if ids.dtype not in (np.uint8, np.uint16):
        raise TraceError(f"{where}: ids must be uint8 or uint16, got {ids.dtype}")
    if lengths.ndim != 1 or (lengths.size and not np.issubdtype(lengths.dtype, np.integer)):
        raise TraceError(f"{where}: lengths must be a 1-D integer array")
    if (lengths < 0).any() or int(lengths.sum()) != ids.shape[0]:
        raise TraceError(f"{where}: lengths sum to {int(lengths.sum())} but ids has {ids.shape[0]} tokens")
    if names.shape != lengths.shape or (names.size and names.dtype.kind != "U"):
        raise TraceError(f"{where}: names must be one str per entry of lengths ({lengths.size}), "
                         f"got {names.dtype} {names.shape}")
    return Trace(ids, lengths.astype(np.int64), names)


def load_trace(path) -> Trace:
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as data:
            missing = {"ids", "lengths", "names"} - set(data.files)
            if missing:
                raise TraceError(f"{path}: not a routing trace, missing {sorted(missing)} "
                                 f"(has {sorted(data.files)}; see docs/TRACES.md)")
            ids, lengths, names = data["ids"], data["lengths"], data["names"]
    except TraceError:
        raise
    except (OSError, ValueError, EOFError) as e:  # missing file, not an npz, object arrays
        raise TraceError(f"{path}: cannot read a routing trace: {e}") from None
    return check_trace(ids, lengths, names, str(path))


def save_trace(path, ids, lengths, names) -> Path:
    """Writes a trace atomically: a temporary file in the same directory, then os.replace."""
    path = Path(path)
    trace = check_trace(ids, lengths, names, str(path))
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:  # a file object, so numpy adds no .npz to the name
            np.savez_compressed(f, ids=trace.ids, lengths=trace.lengths, names=trace.names.astype(str))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


class TraceRecorder:
    """Collects the routing of a real run: `append` the top-k ids of every token of each forward
    pass ([n, moe_layers, top_k]), `end_request(name)` after each request, then `save`."""

    def __init__(self, n_experts: int | None = None):
        self.dtype = ids_dtype(n_experts) if n_experts else None
        self.chunks: list[np.ndarray] = []
        self.lengths: list[int] = []
        self.names: list[str] = []
        self.open_tokens = 0  # tokens appended since the last end_request
        self.shape: tuple[int, int] | None = None

    def append(self, ids_rows) -> None:
        rows = np.asarray(ids_rows)
        if rows.ndim != 3:
            raise TraceError(f"recorder: rows must be [n, moe_layers, top_k], got shape {rows.shape}")
        if self.shape is None:
            self.shape = rows.shape[1:]
        elif rows.shape[1:] != self.shape:
            raise TraceError(f"recorder: rows of shape {rows.shape[1:]} after {self.shape}")
        if rows.size and (rows.min() < 0 or (self.dtype is not None and rows.max() > np.iinfo(self.dtype).max)):
            raise TraceError("recorder: expert id out of range")
        self.chunks.append(rows.copy())  # the caller may reuse its buffer
        self.open_tokens += rows.shape[0]

    def end_request(self, name: str) -> None:
        self.lengths.append(self.open_tokens)
        self.names.append(str(name))
        self.open_tokens = 0

    @property
    def tokens(self) -> int:
        return sum(len(c) for c in self.chunks)

    def trace(self) -> Trace:
        """Everything recorded so far; tokens of an unfinished request count as one more entry."""
        lengths, names = list(self.lengths), list(self.names)
        if self.open_tokens:
            lengths.append(self.open_tokens)
            names.append("(unfinished)")
        k = self.shape or (0, 0)
        ids = np.concatenate(self.chunks) if self.chunks else np.zeros((0, *k), dtype=np.int64)
        dtype = self.dtype or ids_dtype(int(ids.max()) + 1 if ids.size else 1)
        return check_trace(ids.astype(dtype), np.array(lengths, dtype=np.int64),
                           np.array(names, dtype=str), "recorder")

    def save(self, path) -> Path:
        t = self.trace()
        return save_trace(path, t.ids, t.lengths, t.names)
