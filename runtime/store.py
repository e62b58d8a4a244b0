"""The expert store: one aligned, checksummed record per (layer, expert) plus the dense weights.

Layout of a store directory (docs/STORE.md is the normative description):
  manifest.json          format version, config, quantization, tokenizer files, expert records
  experts-LLL.bin        records of MoE layer LLL, each starting on a 16 KiB boundary
  dense.safetensors      every tensor that is not a routed expert
  tokenizer/             tokenizer files copied from the source checkpoint
Writers build in OUT.partial-<pid> and rename at the end, so a store that exists is complete.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

try:  # ISA-L's CRC-32 (a dependency): the same checksum, 3-8x faster than zlib's, which matters
    # where the loader checks every record it reads and a miss waits for the check; zlib's where
    # isal has no build for the platform
    from isal.isal_zlib import crc32
except ImportError:
    from zlib import crc32

from deltafin.runtime import archinfo, quantmodes
from deltafin.runtime.directio import DirectFile, aligned_buffer, round_up
from deltafin.runtime.tensorfile import NAME_TO_NP, SafetensorsSpool

FORMAT = "deltafin-store"
VERSION = 2            # 2: every quant entry names its mode (docs/STORE.md)
READABLE = (1, 2)      # version 1 stores are all affine: read with mode "affine" filled in
ALIGN = 16384          # record start alignment: Apple SSD page, also fine for Linux O_DIRECT
TENSOR_ALIGN = 64      # tensors inside a record start on 64 bytes for aligned numpy/MLX views
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja", "tokenizer.model")
# per projection: the weight (packed codes or float), its scales and biases, and the expert's own
# output bias where the family has one (gpt-oss)
RECORD_TENSORS = tuple(f"{p}.{k}" for p in archinfo.PROJS for k in ("weight", "scales", "biases", "bias"))


class StoreError(Exception):
    """A store that is missing, corrupt, truncated or of an unknown version."""


def is_checkpoint(path) -> bool:
    """A Hugging Face or mlx-lm checkpoint directory: a config.json beside safetensors weights."""
    path = Path(path)
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def checksum(data) -> str:
    return f"{crc32(data) & 0xFFFFFFFF:08x}"


def truncated_error(rec, got: int) -> StoreError:
    """A record read came back short: the one message for every reader (store, loader)."""
    return StoreError(f"layer {rec.layer} expert {rec.expert}: {rec.file} is truncated "
                      f"(record at {rec.offset} needs {rec.nbytes} bytes, {got} present)")


def checksum_error(rec) -> StoreError:
    """A record's bytes do not match its checksum: the one message for every reader."""
    return StoreError(f"layer {rec.layer} expert {rec.expert}: checksum mismatch in "
                      f"{rec.file} at offset {rec.offset}")


@dataclass(frozen=True)
class ExpertRecord:
    layer: int
    expert: int
    file: str
    offset: int
    nbytes: int
    checksum: str
    layout: str

    @property
    def read_nbytes(self) -> int:
        """Bytes a direct read fetches: the record rounded up to the store alignment."""
        return round_up(self.nbytes, ALIGN)


def record_layout(tensors: dict[str, np.ndarray], quant: dict) -> dict:
    """Byte layout of one record: canonical tensor order, each on a 64-byte boundary.
    quant: per projection {"bits", "group_size", "mode"}, or None for a projection stored as a
    float weight alone (mlx-lm leaves projections unquantized when their input dimension does not
    fit the group size); biases only where the mode has them."""
    entries, pos = [], 0
    for name in RECORD_TENSORS:
        if name not in tensors:
            continue
        arr = tensors[name]
        dtype = "bfloat16" if arr.dtype == np.uint16 else arr.dtype.name  # bf16 travels as raw uint16
        entries.append({"name": name, "dtype": dtype, "shape": list(arr.shape),
                        "offset": pos, "nbytes": arr.nbytes})
        pos = round_up(pos + arr.nbytes, TENSOR_ALIGN)
    return {"tensors": entries, "quant": quant, "nbytes": entries[-1]["offset"] + entries[-1]["nbytes"]}


def views_from_buffer(buf, layout: dict) -> dict[str, np.ndarray]:
    """numpy views of a record's tensors inside buf (no copy). bfloat16 comes back as uint16."""
    out = {}
    for t in layout["tensors"]:
        arr = np.frombuffer(buf, dtype=NAME_TO_NP[t["dtype"]], count=math.prod(t["shape"]),
                            offset=t["offset"])
        out[t["name"]] = arr.reshape(t["shape"])
    return out


def _parts(q: dict | None) -> tuple:
    """The tensors a projection with spec q (None: float) is stored as."""
    if q is None:
        return ("weight",)
    return ("weight", "scales", "biases") if quantmodes.has_biases(q) else ("weight", "scales")


def check_layouts(layouts: dict, version: int) -> None:
    """Every layout's quant entries are specs MLX defines and its tensors are the ones they
    need (beside them, an "activation" names the experts' gated activation where it is not
    SwiGLU); version 1 entries (all affine, no "mode") get mode "affine". Raises StoreError."""
    for lid, layout in layouts.items():
        names = {t["name"] for t in layout["tensors"]}
        for t in layout["tensors"]:
            if t["dtype"] not in NAME_TO_NP:
                raise StoreError(f"layout {lid} {t['name']}: unknown dtype {t['dtype']!r}")
        for proj, q in layout["quant"].items():
            where = f"layout {lid} {proj}"
            if proj not in archinfo.PROJS:
                if proj != "activation" or not isinstance(q, dict) or not isinstance(q.get("name"), str):
                    raise StoreError(f"{where}: unknown quantization entry {proj!r}: {q!r}")
                continue
            if q is not None:
                if version == 1:
                    q.setdefault("mode", "affine")
                try:
                    layout["quant"][proj] = q = quantmodes.spec(q["bits"], q["group_size"], q["mode"])
                except (quantmodes.QuantError, KeyError, TypeError) as e:
                    raise StoreError(f"{where}: corrupt quantization entry {q!r} ({e})") from None
            need = {f"{proj}.{k}" for k in _parts(q)}
            have = {n for n in names if n.split(".")[0] == proj and n.rsplit(".", 1)[-1] in
                    ("weight", "scales", "biases")}
            if need != have:
                raise StoreError(f"{where}: quantization {q} needs tensors {sorted(need)}, the "
                                 f"record has {sorted(have)}")
            if q is not None:
                _check_shapes(where, q, {t["name"].rsplit(".", 1)[-1]: t for t in layout["tensors"]
                                         if t["name"] in need})


def _check_shapes(where: str, q: dict, parts: dict) -> None:
    """The packed weight and its scales fit q: as many groups as the packed width holds, scales
    in uint8 for the microscaling modes and in a float dtype for affine."""
    w, scales = parts["weight"], parts["scales"]
    in_dims = w["shape"][-1] * 32 // q["bits"]
    if w["dtype"] != "uint32" or scales["shape"][-1] * q["group_size"] != in_dims:
        raise StoreError(f"{where}: tensors {w['dtype']} {w['shape']} and scales {scales['shape']} "
                         f"do not fit {q['bits']} bits at group {q['group_size']}")
    if (scales["dtype"] == "uint8") == quantmodes.has_biases(q):
        raise StoreError(f"{where}: {q['mode']} scales cannot be {scales['dtype']}")


class StoreWriter:
    """Builds a store; the caller adds every expert record, dense tensor and tokenizer file.
    Used as a context manager: leaving the block by an exception removes the partial store, and
    `finish` (called inside the block) moves the complete one into place."""

    def __init__(self, out_dir, config: dict, bits: int, group_size: int,
                 dense_quantization: dict | None = None, force: bool = False, extra: dict | None = None,
                 mode: str = "affine"):
        self.out = Path(out_dir)
        if self.out.exists() and any(self.out.iterdir()) and not force:
            raise StoreError(f"{self.out} exists and is not empty (use --force to replace it)")
        self.info = archinfo.arch_for(config)
        self.config = config
        self.tmp = self.out.parent / f"{self.out.name}.partial-{os.getpid()}"
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True)
        (self.tmp / "tokenizer").mkdir()
        try:
            self.quantization = quantmodes.spec(bits, group_size, mode)
        except quantmodes.QuantError as e:
            raise StoreError(str(e)) from None
        self.dense_quantization = dense_quantization
        self.extra = extra or {}
        self._files: dict[int, object] = {}
        self._pos: dict[int, int] = {}
        self._layouts: dict[str, dict] = {}
        self._layout_ids: dict[str, str] = {}
        self._layer_layout: dict[int, tuple[int, str]] = {}  # layer -> (its first expert, layout id)
        self._records: list[dict] = []
        self._tokenizer: list[str] = []
        self._dense = SafetensorsSpool(self.tmp / "dense.safetensors")
        self._dense_names: set[str] = set()

    def _layer_file(self, layer: int):
        if layer not in self._files:
            self._files[layer] = open(self.tmp / f"experts-{layer:03d}.bin", "wb")
            self._pos[layer] = 0
        return self._files[layer]

    def add_expert(self, layer: int, expert: int, tensors: dict[str, np.ndarray],
                   quant: dict | None = None) -> None:
        """tensors: the canonical arrays, already quantized (bfloat16 scales as uint16 raw), plus the
        per-expert output biases of a family that has them. quant: per projection a spec
        (quantmodes.spec) or None (float); default: the store's."""
        quant = quant or {p: dict(self.quantization) for p in archinfo.PROJS}
        try:  # each projection's spec, checked; other entries (the experts' activation) as given
            quant = {p: q if p not in archinfo.PROJS or q is None else
                     quantmodes.spec(q["bits"], q["group_size"], q["mode"]) for p, q in quant.items()}
        except (quantmodes.QuantError, KeyError) as e:
            raise StoreError(f"layer {layer} expert {expert}: bad quantization {e}") from None
        missing = [f"{p}.{k}" for p in archinfo.PROJS for k in _parts(quant.get(p))
                   if f"{p}.{k}" not in tensors]
        if missing:
            raise StoreError(f"layer {layer} expert {expert}: record lacks {missing}")
        layout = record_layout(tensors, quant)
        key = json.dumps(layout, sort_keys=True)
        if key not in self._layout_ids:
            self._layout_ids[key] = f"L{len(self._layout_ids)}"
            self._layouts[self._layout_ids[key]] = layout
        first = self._layer_layout.setdefault(layer, (expert, self._layout_ids[key]))
        if first[1] != self._layout_ids[key]:  # the runtime computes a layer's experts alike
            theirs = {t["name"]: (t["dtype"], t["shape"]) for t in self._layouts[first[1]]["tensors"]}
            ours = {t["name"]: (t["dtype"], t["shape"]) for t in layout["tensors"]}
            diff = sorted(n for n in theirs.keys() | ours.keys() if theirs.get(n) != ours.get(n))
            raise StoreError(f"layer {layer} expert {expert}: {', '.join(f'{n} {ours.get(n)}' for n in diff)} "
                             f"where expert {first[0]} has {', '.join(f'{n} {theirs.get(n)}' for n in diff)} "
                             f"(one layer's experts share one shape and quantization)")
        record = bytearray(round_up(layout["nbytes"], ALIGN))
        for t in layout["tensors"]:
            raw = np.ascontiguousarray(tensors[t["name"]]).view(np.uint8).reshape(-1)
            record[t["offset"]:t["offset"] + t["nbytes"]] = raw.data
        f = self._layer_file(layer)
        offset = self._pos[layer]
        f.write(record)
        self._pos[layer] += len(record)
        self._records.append({"layer": layer, "expert": expert, "file": f"experts-{layer:03d}.bin",
                              "offset": offset, "nbytes": layout["nbytes"],
                              "checksum": checksum(memoryview(record)[:layout["nbytes"]]),
                              "layout": self._layout_ids[key]})

    def add_dense(self, name: str, dtype: str, shape, data) -> None:
        self._dense.add(name, dtype, shape, data)
        self._dense_names.add(name)

    def add_tokenizer_file(self, path) -> None:
        path = Path(path)
        shutil.copyfile(path, self.tmp / "tokenizer" / path.name)
        self._tokenizer.append(path.name)

    def finish(self) -> Path:
        for f in self._files.values():
            f.flush()
            os.fsync(f.fileno())
            f.close()
        self._dense.finish()
        self._records.sort(key=lambda r: (r["layer"], r["expert"]))
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "architecture": self.info.model_type,
            "config": self.config,
            "quantization": self.quantization,
            "dense_quantization": self.dense_quantization,
            "dense_files": ["dense.safetensors"],
            "tokenizer": {"dir": "tokenizer", "files": sorted(self._tokenizer)},
            "alignment": ALIGN,
            "checksum": "crc32",
            "model": {"num_hidden_layers": int(self.config["num_hidden_layers"]),
                      "moe_layers": archinfo.moe_layers(self.config),
                      "n_experts": archinfo.n_experts(self.config),
                      "top_k": archinfo.top_k(self.config)},
            **self.extra,
            "layouts": self._layouts,
            "experts": self._records,
        }
        with open(self.tmp / "manifest.json", "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        if self.out.exists():
            shutil.rmtree(self.out)
        os.rename(self.tmp, self.out)
        return self.out

    def abort(self) -> None:
        for f in self._files.values():
            f.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> "StoreWriter":
        return self

    def __exit__(self, kind, _value, _tb) -> None:
        if kind is not None:
            self.abort()


class Store:
    """A store opened for reading: manifest, record table, direct reads, verification."""

    def __init__(self, path):
        self.path = Path(path)
        mpath = self.path / "manifest.json"
        if not mpath.exists():
            if is_checkpoint(self.path):
                raise StoreError(f"{self.path}: this is a checkpoint, not a deltafin store: run "
                                 f"`deltafin-convert {self.path} OUT` (or `deltafin chat {self.path}`)")
            raise StoreError(f"{self.path}: not a deltafin store (no manifest.json)")
        try:
            m = json.loads(mpath.read_text())
        except json.JSONDecodeError as e:
            raise StoreError(f"{mpath}: corrupt manifest: {e}") from None
        if m.get("format") != FORMAT:
            raise StoreError(f"{mpath}: not a deltafin store manifest")
        if m.get("version") not in READABLE:
            raise StoreError(f"{mpath}: store format version {m.get('version')} is not supported "
                             f"(this deltafin reads versions {READABLE}); re-run deltafin-convert")
        self.manifest = m
        try:
            self.config = m["config"]
            self.layouts = m["layouts"]
            self.records = {(r["layer"], r["expert"]): ExpertRecord(**r) for r in m["experts"]}
            self.moe_layers = list(m["model"]["moe_layers"])
            self.n_experts = int(m["model"]["n_experts"])
            self.top_k = int(m["model"]["top_k"])
            self.bits = int(m["quantization"]["bits"])
            self.group_size = int(m["quantization"]["group_size"])
            self.mode = m["quantization"].setdefault("mode", "affine")
            m["tokenizer"]["files"], m["dense_files"]
            check_layouts(self.layouts, m["version"])
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise StoreError(f"{mpath}: corrupt manifest ({type(e).__name__}: {e})") from None
        except StoreError as e:
            raise StoreError(f"{mpath}: {e}") from None
        try:
            archinfo.check_config(self.config)
        except archinfo.ConfigMismatch as e:
            raise StoreError(f"{mpath}: {e}") from None
        self._check_model(mpath, m["model"])

    def _check_model(self, mpath: Path, model: dict) -> None:
        """The manifest's model section agrees with its config (the writer takes one from the
        other) and with the record table: every MoE layer has one record per expert and no
        record lies outside them. Raises StoreError naming the first disagreement."""
        try:
            said = {"num_hidden_layers": int(self.config["num_hidden_layers"]),
                    "n_experts": archinfo.n_experts(self.config), "top_k": archinfo.top_k(self.config)}
            has = {"num_hidden_layers": int(model["num_hidden_layers"]), "n_experts": self.n_experts,
                   "top_k": self.top_k}
        except (KeyError, TypeError, ValueError) as e:
            raise StoreError(f"{mpath}: corrupt manifest ({type(e).__name__}: {e})") from None
        except archinfo.UnsupportedArchitecture:
            return  # the model's builder names it
        for key, value in has.items():
            if said[key] != value:
                raise StoreError(f"{mpath}: the manifest's model says {key} {value}, its config "
                                 f"{said[key]} (edited or corrupt; re-run deltafin-convert)")
        layers = set(self.moe_layers)
        for layer in self.moe_layers:
            for e in range(self.n_experts):
                if (layer, e) not in self.records:
                    raise StoreError(f"{mpath}: no record for layer {layer} expert {e}")
        for layer, e in self.records:
            if layer not in layers or not 0 <= e < self.n_experts:
                raise StoreError(f"{mpath}: a record for layer {layer} expert {e}, outside the "
                                 f"model's MoE layers and its {self.n_experts} experts")

    def check_files(self) -> None:
        """Cheap start-up check that the files are the ones the manifest describes: sizes and
        headers only, no data read (the loader checks every record's CRC-32 when it reads it).
        Raises StoreError naming the first thing wrong."""
        from deltafin.runtime.tensorfile import TensorFileError, read_header
        for name in self.manifest.get("dense_files", []):
            path = self.path / name
            if not path.is_file():
                raise StoreError(f"{self.path}: dense weight file {name} is missing")
            try:
                refs = read_header(path)  # also refuses a tensor that ends past the end of the file
            except (OSError, TensorFileError, KeyError, TypeError, ValueError) as e:
                raise StoreError(f"{path}: unreadable dense weights: {e}") from None
            self._check_vocab(refs)
        for fname in self.manifest["tokenizer"]["files"]:
            if not (self.tokenizer_dir / fname).is_file():
                raise StoreError(f"{self.path}: tokenizer file {fname} is missing")
        by_file: dict[str, list[ExpertRecord]] = {}
        for rec in self.records.values():
            by_file.setdefault(rec.file, []).append(rec)
        for fname, recs in sorted(by_file.items()):
            path = self.path / fname
            if Path(fname).is_absolute() or ".." in Path(fname).parts:
                raise StoreError(f"{self.path}: manifest names expert file {fname!r} outside the store")
            try:
                size = path.stat().st_size
            except OSError:
                raise StoreError(f"{self.path}: expert file {fname} is missing") from None
            end = 0
            for rec in sorted(recs, key=lambda r: r.offset):
                where = f"{fname}: layer {rec.layer} expert {rec.expert}"
                if self._size_disagrees(rec):
                    raise StoreError(f"{where}: the record's layout {rec.layout!r} does not match "
                                     f"its {rec.nbytes} bytes in the manifest")
                if rec.offset % ALIGN or rec.offset < end:
                    raise StoreError(f"{where}: offset {rec.offset} is not {ALIGN}-aligned or "
                                     f"overlaps the record before it")
                if rec.offset + rec.nbytes > size:
                    raise StoreError(f"{where}: the record needs bytes {rec.offset}..{rec.offset + rec.nbytes} "
                                     f"but the file has {size} bytes (truncated, or not this "
                                     f"manifest's file)")
                end = rec.offset + rec.nbytes

    def _size_disagrees(self, rec: ExpertRecord) -> bool:
        """The record's bytes in the manifest are not its layout's (or none, or its layout unknown)."""
        layout = self.layouts.get(rec.layout)
        return rec.nbytes <= 0 or layout is None or layout.get("nbytes") != rec.nbytes

    def _check_vocab(self, refs: dict) -> None:
        """A token id the config allows (vocab_size) has a row in the embedding: a larger
        vocab_size would let a request index past it."""
        rows = [r.shape[0] for name, r in refs.items() if name.endswith("embed_tokens.weight") and r.shape]
        vocab = self.config.get("vocab_size")
        if rows and isinstance(vocab, int) and vocab > min(rows):  # every embedding (a draft head's too)
            raise StoreError(f"{self.path}: config vocab_size {vocab} exceeds the embedding's "
                             f"{min(rows)} rows (edited or corrupt; re-run deltafin-convert)")

    def record(self, layer: int, expert: int) -> ExpertRecord:
        return self.records[(layer, expert)]

    def layout(self, layer: int, expert: int = 0) -> dict:
        return self.layouts[self.records[(layer, expert)].layout]

    @property
    def max_record_bytes(self) -> int:
        return max(r.read_nbytes for r in self.records.values())

    @property
    def expert_bytes_total(self) -> int:
        return sum(r.nbytes for r in self.records.values())

    @property
    def tokenizer_dir(self) -> Path:
        return self.path / self.manifest["tokenizer"]["dir"]

    def read_record(self, rec: ExpertRecord, buf=None, files: dict | None = None,
                    verify: bool = True) -> memoryview:
        """Direct read of one record into buf (aligned, >= rec.read_nbytes)."""
        buf = buf if buf is not None else aligned_buffer(rec.read_nbytes)
        own = files is None
        files = {} if own else files
        try:
            f = files.get(rec.file)
            if f is None:
                f = files[rec.file] = DirectFile(self.path / rec.file)
            got = f.read_into(memoryview(buf), rec.offset, rec.nbytes)
        finally:
            if own:
                for f in files.values():
                    f.close()
        if got < rec.nbytes:
            raise truncated_error(rec, got)
        view = memoryview(buf)[:rec.nbytes]
        if verify and checksum(view) != rec.checksum:
            raise checksum_error(rec)
        return view

    def read_expert(self, layer: int, expert: int) -> dict[str, np.ndarray]:
        rec = self.record(layer, expert)
        view = self.read_record(rec)
        return {k: v.copy() for k, v in views_from_buffer(view, self.layouts[rec.layout]).items()}

    def dense_weights(self) -> dict:
        import mlx.core as mx
        weights = {}
        for name in self.manifest["dense_files"]:
            path = self.path / name
            if not path.exists():
                raise StoreError(f"{self.path}: dense weight file {name} is missing")
            try:
                weights.update(mx.load(str(path)))
            except Exception as e:  # mlx raises plain exceptions for corrupt files
                raise StoreError(f"{path}: cannot load dense weights: {e}") from None
        return weights

    def verify(self, progress=None):
        """Yields (record or None, message) for every problem found; reads every byte once."""
        from deltafin.runtime.tensorfile import TensorFileError, read_header
        for name in self.manifest["dense_files"]:
            try:
                read_header(self.path / name)
            except (OSError, TensorFileError) as e:
                yield None, f"dense weights: {e}"
        for fname in self.manifest["tokenizer"]["files"]:
            path = self.tokenizer_dir / fname
            if not path.exists():
                yield None, f"tokenizer file {fname} is missing"
            elif fname.endswith(".json"):
                try:
                    json.loads(path.read_bytes())
                except (ValueError, OSError) as e:
                    yield None, f"tokenizer file {fname} is corrupt: {e}"
        buf = aligned_buffer(max(self.max_record_bytes, ALIGN))  # a record's nbytes may be corrupt (<= 0)
        files: dict = {}
        try:
            for rec in sorted(self.records.values(), key=lambda r: (r.file, r.offset)):
                if rec.offset % ALIGN:
                    yield rec, (f"layer {rec.layer} expert {rec.expert}: offset {rec.offset} "
                                f"is not {ALIGN}-byte aligned")
                    continue
                if self._size_disagrees(rec):
                    said = (self.layouts.get(rec.layout) or {}).get("nbytes", "nothing")
                    yield rec, (f"layer {rec.layer} expert {rec.expert}: {rec.nbytes} bytes in the "
                                f"manifest, its layout {rec.layout!r} says {said}")
                    continue
                try:
                    self.read_record(rec, buf, files)
                except (StoreError, OSError) as e:
                    yield rec, str(e)
                if progress:
                    progress(rec.nbytes)
        finally:
            for f in files.values():
                f.close()
