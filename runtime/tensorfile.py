"""Safetensors read and write at the byte level, one tensor at a time.

The converter must never hold a whole checkpoint: it reads single tensors (or one expert's slice
of a stacked tensor) with pread and streams dense tensors out through a spool file.
bfloat16 has no numpy dtype, so tensors travel as raw bytes plus a dtype name.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# safetensors code -> (our dtype name, numpy storage dtype)
ST_DTYPES = {
    "F64": ("float64", np.float64),
    "F32": ("float32", np.float32),
    "F16": ("float16", np.float16),
    "BF16": ("bfloat16", np.uint16),
    "I64": ("int64", np.int64),
    "I32": ("int32", np.int32),
    "I16": ("int16", np.int16),
    "I8": ("int8", np.int8),
    "U64": ("uint64", np.uint64),
    "U32": ("uint32", np.uint32),
    "U16": ("uint16", np.uint16),
    "U8": ("uint8", np.uint8),
    "BOOL": ("bool", np.bool_),
    "F8_E4M3": ("float8_e4m3fn", np.uint8),  # raw e4m3 bytes (FP8 checkpoints)
}
NAME_TO_ST = {v[0]: k for k, v in ST_DTYPES.items()}
NAME_TO_NP = {v[0]: v[1] for v in ST_DTYPES.values()}


class TensorFileError(ValueError):
    pass


@dataclass(frozen=True)
class TensorRef:
    """Where one tensor lives: a file, a byte range, its dtype and shape."""
    name: str
    path: Path
    dtype: str
    shape: tuple
    offset: int  # absolute offset of the data in the file
    nbytes: int

    @property
    def itemsize(self) -> int:
        return np.dtype(NAME_TO_NP[self.dtype]).itemsize

    def read(self) -> np.ndarray:
        return _pread_array(self.path, self.offset, self.nbytes, self.dtype, self.shape)

    def read_slice0(self, index: int) -> np.ndarray:
        """Row `index` of the first axis (one expert of a stacked tensor)."""
        inner = self.shape[1:]
        row = int(np.prod(inner, dtype=np.int64)) * self.itemsize
        return _pread_array(self.path, self.offset + index * row, row, self.dtype, inner)

    def bands(self, rows: int):
        """The tensor in bands of at most `rows` rows of its first axis: (first row, array)."""
        inner = self.shape[1:]
        row = int(np.prod(inner, dtype=np.int64)) * self.itemsize
        if not self.shape or row == 0:  # a scalar or an empty tensor: one band
            yield 0, self.read()
            return
        for r0 in range(0, self.shape[0], rows):
            r1 = min(self.shape[0], r0 + rows)
            yield r0, _pread_array(self.path, self.offset + r0 * row, (r1 - r0) * row, self.dtype,
                                   (r1 - r0, *inner))


def _pread_array(path: Path, offset: int, nbytes: int, dtype: str, shape) -> np.ndarray:
    buf = bytearray(nbytes)
    with open(path, "rb", buffering=0) as f:
        got = os.preadv(f.fileno(), [buf], offset)
    if got != nbytes:
        raise TensorFileError(f"{path}: truncated tensor data at offset {offset} "
                              f"(wanted {nbytes} bytes, got {got})")
    return np.frombuffer(buf, dtype=NAME_TO_NP[dtype]).reshape(shape)


def read_header(path: Path) -> dict[str, TensorRef]:
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise TensorFileError(f"{path}: not a safetensors file (too short)")
        (hlen,) = struct.unpack("<Q", raw)
        if hlen > min(size - 8, 100 << 20):
            raise TensorFileError(f"{path}: corrupt safetensors header length {hlen}")
        try:
            header = json.loads(f.read(hlen))
        except json.JSONDecodeError as e:
            raise TensorFileError(f"{path}: corrupt safetensors header: {e}") from None
    base = 8 + hlen
    refs = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in ST_DTYPES:
            raise TensorFileError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        if base + end > size:
            raise TensorFileError(f"{path}: truncated: tensor {name} ends at {base + end}, "
                                  f"file has {size} bytes")
        refs[name] = TensorRef(name, path, ST_DTYPES[info["dtype"]][0], tuple(info["shape"]),
                               base + start, end - start)
    return refs


def index_checkpoint(directory: Path) -> dict[str, TensorRef]:
    """All tensors of a checkpoint directory, single file or sharded with an index."""
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in directory.glob("*.safetensors"))
    if not files:
        raise TensorFileError(f"{directory}: no .safetensors files found")
    refs: dict[str, TensorRef] = {}
    for name in files:
        path = directory / name
        if not path.exists():
            raise TensorFileError(f"{directory}: shard {name} named in the index is missing")
        refs.update(read_header(path))
    return refs


class SafetensorsSpool:
    """Writes a safetensors file tensor by tensor with constant memory.

    Data goes to a spool file as it arrives; finish() writes the header and copies the spool
    behind it (the header must come first but is only known at the end).
    """

    def __init__(self, path: Path, metadata: dict | None = None):
        self.path = Path(path)
        self.metadata = metadata
        self._spool_path = self.path.with_suffix(".spool")
        self._spool = open(self._spool_path, "wb")
        self._header: dict[str, dict] = {}
        self._pos = 0

    def add(self, name: str, dtype: str, shape, data) -> None:
        """data: bytes, an array, or an iterable of arrays written one after another (a tensor
        produced band by band never needs to be whole in memory)."""
        if name in self._header:
            raise TensorFileError(f"duplicate tensor {name}")
        parts = [data] if isinstance(data, (bytes, bytearray, memoryview, np.ndarray)) else data
        start = self._pos
        for part in parts:
            raw = memoryview(np.ascontiguousarray(part).reshape(-1).view(np.uint8)) \
                if isinstance(part, np.ndarray) else memoryview(part)
            self._spool.write(raw)
            self._pos += raw.nbytes
        self._header[name] = {"dtype": NAME_TO_ST[dtype], "shape": list(shape),
                              "data_offsets": [start, self._pos]}

    def finish(self) -> None:
        self._spool.close()
        head = {"__metadata__": self.metadata, **self._header} if self.metadata else self._header
        header = json.dumps(head, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)
        with open(self.path, "wb") as out, open(self._spool_path, "rb") as spool:
            out.write(struct.pack("<Q", len(header)))
            out.write(header)
            shutil.copyfileobj(spool, out, 16 << 20)
        os.unlink(self._spool_path)
