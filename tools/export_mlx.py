"""deltafin-export-mlx: a deltafin store -> an mlx-lm checkpoint of the same weights.

The benchmark's mlx-lm contender must run exactly the bytes deltafin runs, so nothing is
re-quantized: dense tensors are copied byte for byte, and each MoE layer's expert records are
stacked into mlx-lm's `switch_mlp` tensors [E, ...]. Dense names stay as the store has them
(mlx-lm's `sanitize` runs at load time either way, e.g. DeepSeek-V3's kv_b_proj split).

Memory stays at one record plus a copy buffer: every output tensor's place in its shard is known
before a byte is written (shapes come from the manifest), so each record is read once (direct
read, checksum verified) and its tensors are written straight to their rows of the stacked
tensors. Output is built in OUT.partial-<pid> and renamed at the end, as the store writer does.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

from deltafin.runtime import archinfo
from deltafin.runtime.cli import Help
from deltafin.runtime.directio import aligned_buffer
from deltafin.runtime.store import Store, StoreError
from deltafin.runtime.tensorfile import NAME_TO_ST, TensorFileError, TensorRef, read_header

SHARD_BYTES = 5 << 30      # mlx-lm's own shard limit (MAX_FILE_SIZE_GB)
# mlx-lm families whose model always has an lm_head of its own, whatever tie_word_embeddings says:
# a store with a tied head (the MoEfied demo) gets the embedding's bytes written there too.
OWN_HEAD = ("qwen2_moe",)
COPY_CHUNK = 16 << 20      # dense tensors are copied in pieces of this size


class ExportError(Exception):
    pass


@dataclass
class OutTensor:
    """One tensor of the checkpoint and where its bytes come from."""
    name: str
    dtype: str
    shape: tuple
    nbytes: int
    dense: TensorRef | None = None   # copied from the store's dense file
    layer: int = -1                  # or stacked from this layer's records ...
    part: str = ""                   # ... tensor `part` (e.g. "gate_proj.scales") of each
    file: str = ""                   # shard it lands in, and its data offset there
    offset: int = 0


def expert_name(info: archinfo.ArchInfo, layer: int, part: str) -> str:
    """mlx-lm's module path of a stacked expert tensor (mixtral: block_sparse_moe, others: mlp;
    gpt-oss: experts, others: switch_mlp)."""
    return f"model.layers.{layer}.{info.block}.{info.stacked}.{part}"


def quantization_config(store: Store) -> dict:
    """mlx-lm's `quantization`: the dense default, its per-path overrides, and an override for
    every expert projection whose bits, group size or mode differ from that default."""
    dq = store.manifest.get("dense_quantization") or {}
    q = {"group_size": int(dq.get("group_size", store.group_size)),
         "bits": int(dq.get("bits", store.bits)), "mode": dq.get("mode", store.mode)}
    q.update({k: v for k, v in dq.items() if k not in ("group_size", "bits", "mode")})
    info = archinfo.arch_for(store.config)
    if _head_from_embedding(store) and "model.embed_tokens" in q:
        q["lm_head"] = q["model.embed_tokens"]
    for layer in store.moe_layers:
        for proj in archinfo.PROJS:
            pq = store.layout(layer)["quant"][proj]
            # A float projection needs no entry: mlx-lm quantizes only paths that have scales.
            if pq and (pq["bits"], pq["group_size"], pq["mode"]) != (q["bits"], q["group_size"], q["mode"]):
                q[expert_name(info, layer, proj)] = dict(pq)
    return q


def _layer_key(name: str) -> tuple:
    parts = name.split(".")
    layer = int(parts[2]) if len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() else -1
    # embeddings first, then layer by layer, then the final norm and lm_head
    return (0 if layer < 0 and "embed" in name else 2 if layer < 0 else 1, layer, name)


def _head_from_embedding(store: Store) -> bool:
    return archinfo.arch_for(store.config).model_type in OWN_HEAD and \
        bool(store.config.get("tie_word_embeddings"))


def plan(store: Store) -> list[OutTensor]:
    """Every output tensor with its shape, checked before anything is written."""
    info = archinfo.arch_for(store.config)
    out = []
    for fname in store.manifest["dense_files"]:
        try:
            refs = read_header(store.path / fname)
        except (OSError, TensorFileError) as e:
            raise ExportError(f"dense weights: {e}") from None
        out += [OutTensor(n, r.dtype, tuple(r.shape), r.nbytes, dense=r) for n, r in refs.items()]
    if _head_from_embedding(store) and not any(t.name.startswith("lm_head.") for t in out):
        out += [OutTensor("lm_head" + t.name[len("model.embed_tokens"):], t.dtype, t.shape, t.nbytes, dense=t.dense)
                for t in list(out) if t.name.startswith("model.embed_tokens.")]
    if info.model_type == "qwen3_next" and any(t.name.endswith("conv1d.weight") and t.shape[-1] != 1 for t in out):
        raise ExportError("this qwen3_next store holds a Hugging Face checkpoint's linear layers (conv1d "
                          "[channels, 1, kernel], zero-centred norms), which mlx-lm converts only beside "
                          "per-expert tensors; export a store converted from an mlx-lm checkpoint")
    for layer in store.moe_layers:
        layout = store.layout(layer)
        for e in range(store.n_experts):
            if store.record(layer, e).layout != store.record(layer, 0).layout:
                raise ExportError(f"layer {layer}: expert {e} has a different tensor layout from expert 0; "
                                  f"mlx-lm stacks a layer's experts into one tensor per projection")
        for t in layout["tensors"]:
            out.append(OutTensor(expert_name(info, layer, t["name"]), t["dtype"],
                                 (store.n_experts, *t["shape"]), store.n_experts * t["nbytes"],
                                 layer=layer, part=t["name"]))
    names = [t.name for t in out]
    if len(set(names)) != len(names):
        raise ExportError("the store's dense weights already contain stacked switch_mlp experts")
    return sorted(out, key=lambda t: _layer_key(t.name))


def assign_shards(tensors: list[OutTensor], shard_bytes: int) -> list[list[OutTensor]]:
    """Greedy, in order: a shard takes tensors until the next would pass shard_bytes."""
    shards: list[list[OutTensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    n = len(shards)
    for i, shard in enumerate(shards):
        pos = 0
        for t in shard:
            t.file, t.offset = f"model-{i + 1:05d}-of-{n:05d}.safetensors", pos
            pos += t.nbytes
    return shards


def _header(shard: list[OutTensor]) -> bytes:
    head = {"__metadata__": {"format": "mlx"}}
    for t in shard:
        head[t.name] = {"dtype": NAME_TO_ST[t.dtype], "shape": list(t.shape),
                        "data_offsets": [t.offset, t.offset + t.nbytes]}
    raw = json.dumps(head, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)


def _pwrite_all(fd: int, data, pos: int) -> None:
    view = memoryview(data)
    while len(view):
        n = os.pwrite(fd, view, pos)
        view, pos = view[n:], pos + n


class MlxExport:
    """Writes one store as an mlx-lm checkpoint; `run()` returns the output directory."""

    def __init__(self, store_path, out_dir, shard_bytes: int = SHARD_BYTES, force: bool = False,
                 progress: bool = False):
        self.store = Store(store_path)
        self.out = Path(out_dir)
        if self.out.exists() and any(self.out.iterdir()) and not force:
            raise ExportError(f"{self.out} exists and is not empty (use --force to replace it)")
        self.shard_bytes, self.progress = shard_bytes, progress
        self.tmp = self.out.parent / f"{self.out.name}.partial-{os.getpid()}"

    def run(self) -> Path:
        tensors = plan(self.store)
        shards = assign_shards(tensors, self.shard_bytes)
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True)
        fds: dict[str, tuple[int, int]] = {}  # shard file -> (fd, data start)
        try:
            for shard in shards:
                head = _header(shard)
                fd = os.open(self.tmp / shard[0].file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                fds[shard[0].file] = (fd, 8 + len(head))
                _pwrite_all(fd, struct.pack("<Q", len(head)) + head, 0)
                os.ftruncate(fd, 8 + len(head) + sum(t.nbytes for t in shard))
            self._write_tensors(tensors, fds)
            for fd, _ in fds.values():
                os.fsync(fd)
            self._write_meta(tensors)
            if self.out.exists():
                shutil.rmtree(self.out)
            os.rename(self.tmp, self.out)
            return self.out
        finally:
            for fd, _ in fds.values():
                os.close(fd)
            shutil.rmtree(self.tmp, ignore_errors=True)

    def _write_tensors(self, tensors: list[OutTensor], fds: dict) -> None:
        from deltafin.tools.convert import progress_bar
        total = sum(t.nbytes for t in tensors)
        bar = progress_bar(total, "export", self.progress, unit="B", unit_scale=True)
        try:
            buf = bytearray(COPY_CHUNK)
            for t in tensors:
                if t.dense is None:
                    continue
                fd, base = fds[t.file]
                with open(t.dense.path, "rb", buffering=0) as src:
                    for start in range(0, t.nbytes, COPY_CHUNK):
                        n = min(COPY_CHUNK, t.nbytes - start)
                        got = os.preadv(src.fileno(), [memoryview(buf)[:n]], t.dense.offset + start)
                        if got != n:
                            raise ExportError(f"{t.dense.path}: truncated tensor {t.name}")
                        _pwrite_all(fd, memoryview(buf)[:n], base + t.offset + start)
                        bar.update(n)
            by_layer: dict[int, dict[str, OutTensor]] = {}
            for t in tensors:
                if t.dense is None:
                    by_layer.setdefault(t.layer, {})[t.part] = t
            record_buf = aligned_buffer(self.store.max_record_bytes)
            files: dict = {}
            try:
                for layer, parts in by_layer.items():
                    for e in range(self.store.n_experts):
                        rec = self.store.record(layer, e)
                        view = self.store.read_record(rec, record_buf, files)  # checksum verified
                        for t in self.store.layouts[rec.layout]["tensors"]:
                            out = parts[t["name"]]
                            fd, base = fds[out.file]
                            _pwrite_all(fd, view[t["offset"]:t["offset"] + t["nbytes"]],
                                        base + out.offset + e * t["nbytes"])
                        bar.update(rec.nbytes)
            finally:
                for f in files.values():
                    f.close()
        finally:
            bar.close()

    def _write_meta(self, tensors: list[OutTensor]) -> None:
        index = {"metadata": {"total_size": sum(t.nbytes for t in tensors)},
                 "weight_map": {t.name: t.file for t in sorted(tensors, key=lambda t: t.name)}}
        (self.tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        config = dict(self.store.config)
        config.pop("quantization_config", None)
        q = quantization_config(self.store)
        # mlx-lm's save_config writes both keys with the same content
        config["quantization"] = config["quantization_config"] = q
        (self.tmp / "config.json").write_text(json.dumps(dict(sorted(config.items())), indent=2))
        for name in self.store.manifest["tokenizer"]["files"]:
            shutil.copyfile(self.store.tokenizer_dir / name, self.tmp / name)


def export_mlx(store_path, out_dir, shard_bytes: int = SHARD_BYTES, force: bool = False,
               progress: bool = False) -> Path:
    """Writes an mlx-lm checkpoint of the store's weights to out_dir and returns its path."""
    return MlxExport(store_path, out_dir, shard_bytes, force, progress).run()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(formatter_class=Help, prog="deltafin-export-mlx",
                                description="Write an mlx-lm checkpoint (same quantized bytes) from a "
                                            "deltafin store, for running the store's model in mlx-lm.")
    p.add_argument("store")
    p.add_argument("out")
    p.add_argument("--shard-gb", type=float, default=SHARD_BYTES / 2**30,
                   help="largest safetensors shard in GiB (default 5, as mlx-lm)")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p.add_argument("--no-progress", action="store_true", help="print no progress lines")
    a = p.parse_args(argv)
    try:
        out = export_mlx(a.store, a.out, int(a.shard_gb * 2**30), a.force, progress=not a.no_progress)
    except (ExportError, StoreError, archinfo.UnsupportedArchitecture, OSError) as e:
        print(f"deltafin-export-mlx: error: {e}", file=sys.stderr)
        return 2
    index = json.loads((out / "model.safetensors.index.json").read_text())
    print(f"wrote {out}: {len(index['weight_map'])} tensors, {index['metadata']['total_size'] / 2**30:.2f} GiB "
          f"in {len(set(index['weight_map'].values()))} shard(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
