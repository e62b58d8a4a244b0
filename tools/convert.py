"""deltafin-convert: Hugging Face or mlx-lm checkpoints -> deltafin expert store; --verify a store.

Streams one expert at a time (or one expert's slice of a stacked tensor), so peak memory does
not grow with the model. Float experts are quantized with mx.quantize itself in the chosen mode
(affine 2-8 bit, mxfp4, nvfp4, mxfp8, or an mlx-lm mixed recipe), so the bytes are exactly what
MLX would produce; mlx-lm quantized experts are copied untouched, each projection with the mode
mlx-lm's config gives it; FP8 checkpoints (tools/fp8.py) are dequantized block by block first.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from deltafin.runtime import archinfo, quantmodes
from deltafin.runtime.cli import Help
from deltafin.runtime.dtypes import FLOAT_DTYPES
from deltafin.runtime.store import TOKENIZER_FILES, Store, StoreError, StoreWriter
from deltafin.runtime.tensorfile import TensorFileError, TensorRef, index_checkpoint
from deltafin.tools import fp8

EXTRA_TOKENIZER_FILES = ("vocab.json", "merges.txt", "added_tokens.json")
DENSE_BAND_ROWS = 1024  # dense tensors are copied this many rows at a time


# transformers' GptOss keeps fused experts transposed, [E, in, out], with gate and up interleaved
# along gate_up_proj's output axis (gate the even columns, up the odd), biases beside them
INTERLEAVED_FUSED = ("gpt_oss",)
# OpenAI's gpt-oss checkpoints keep the experts in mxfp4 (config quantization_config.quant_method),
# as _blocks and _scales beside gate_up_proj and down_proj; MLX's mxfp4 is the same bytes
OPENAI_MXFP4 = quantmodes.spec(4, 32, "mxfp4")
OPENAI_MXFP4_PARTS = ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales")


class ConvertError(Exception):
    pass


@dataclass
class ExpertSource:
    """Where the three projections of one (layer, expert) come from."""
    kind: str                       # "per_expert" | "stacked" | "stacked_quantized" | "fused" | "fused_mxfp4"
    refs: dict = field(default_factory=dict)
    index: int = 0                  # position along the stacked axis


def to_mx(arr: np.ndarray, dtype: str):
    import mlx.core as mx
    a = mx.array(arr)
    return a.view(mx.bfloat16) if dtype == "bfloat16" else a


def to_np(a) -> np.ndarray:
    import mlx.core as mx
    return np.array(a.view(mx.uint16)) if a.dtype == mx.bfloat16 else np.array(a)


def quantize(w: np.ndarray, dtype: str, q: dict) -> dict:
    """{"weight", "scales"[, "biases"]} of mx.quantize(w) with spec q, as numpy."""
    import mlx.core as mx
    parts = mx.quantize(to_mx(w, dtype), group_size=q["group_size"], bits=q["bits"], mode=q["mode"])
    return dict(zip(("weight", "scales", "biases"), (to_np(a) for a in parts)))


def mxfp4_words(blocks: np.ndarray) -> np.ndarray:
    """OpenAI's mxfp4 blocks [out, G, 16] uint8 (two E2M1 codes a byte, the low nibble first) as
    MLX's mxfp4 weight [out, G * 4] uint32: the same bytes, eight codes a little-endian word with
    the first in the low bits."""
    b = np.ascontiguousarray(blocks)
    return b.view("<u4").reshape(b.shape[0], -1)


def mlx_spec(qconfig: dict, path: str, refs: dict, in_dims: int) -> dict | None:
    """The spec mlx-lm loads module `path` with: its config entry where there is one, else
    inferred from the saved tensors (refs: "weight", "scales"); None where it stays float."""
    o = quantmodes.override(qconfig, path)
    if o is not None:
        return o or None
    if "scales" not in refs:
        return None
    return quantmodes.infer(refs["weight"].shape[-1], refs["scales"].shape[-1], in_dims,
                            refs["scales"].dtype)


class Converter:
    def __init__(self, src, out, bits: int | None = None, group_size: int | None = None,
                 force: bool = False, progress: bool = True, mode: str = "affine",
                 recipe: str | None = None):
        """bits/group_size/mode: how float experts are quantized (None: the mode's defaults);
        recipe: an mlx-lm mixed recipe (mixed_3_6, ...) choosing bits per layer and projection."""
        self.src, self.out = Path(src), Path(out)
        self.force, self.progress, self.recipe = force, progress, recipe
        try:
            d_bits, d_group = quantmodes.defaults(mode)
            self.spec = quantmodes.spec(bits or d_bits, group_size or d_group, mode)
            if recipe:
                if mode != "affine":
                    raise quantmodes.QuantError(f"recipe {recipe} is affine; it takes no --mode {mode}")
                quantmodes.recipe_spec(recipe, 0, 1, "down_proj", self.spec["group_size"])
        except quantmodes.QuantError as e:
            raise ConvertError(str(e)) from None
        self.bits, self.group_size = self.spec["bits"], self.spec["group_size"]
        cfg_path = self.src / "config.json"
        if not cfg_path.exists():
            raise ConvertError(f"{self.src}: no config.json (is this a Hugging Face or mlx-lm checkpoint?)")
        # a multimodal checkpoint's language model only (archinfo.text_model, text_name)
        try:
            self.config = archinfo.text_model(json.loads(cfg_path.read_text()))
        except (ValueError, OSError) as e:
            raise ConvertError(f"{cfg_path}: unreadable config ({e})") from None
        try:
            self.info = archinfo.arch_for(self.config)
            archinfo.check_config(self.config)
        except (archinfo.UnsupportedArchitecture, archinfo.ConfigMismatch) as e:
            raise ConvertError(str(e)) from None
        self.n_layers = int(self.config["num_hidden_layers"])
        self.moe_layers = archinfo.moe_layers(self.config)
        self.n_experts = archinfo.n_experts(self.config)
        qc = self.config.get("quantization")
        self.mlx_quant = self._renamed(qc) if isinstance(qc, dict) and "bits" in qc else None
        self.activation = self.info.activation(self.config)
        try:
            self.fp8 = fp8.block_size(self.config)
            self.refs = self._renamed(index_checkpoint(self.src))
        except (TensorFileError, fp8.Fp8Error) as e:
            raise ConvertError(str(e)) from None
        hf_quant = self.config.get("quantization_config")
        self.openai_mxfp4 = isinstance(hf_quant, dict) and hf_quant.get("quant_method") == "mxfp4"
        if (self.mlx_quant or self.openai_mxfp4) and (bits or group_size or mode != "affine" or recipe):
            by = "mlx-lm" if self.mlx_quant else "OpenAI (mxfp4)"
            raise ConvertError(f"{self.src} is already quantized by {by}; its experts are copied "
                               f"as they are (leave out --bits, --group-size, --mode, --quant-predicate)")

    def _renamed(self, by_name: dict) -> dict:
        """Tensors or quantization overrides of the language model (archinfo.text_name: none of a
        vision tower or a multi-token-prediction head) under the names the family's model reads
        (archinfo.store_name: Kimi's Hugging Face layout)."""
        out = {}
        for name, value in by_name.items():
            text = archinfo.text_name(name)
            if text is None:
                continue
            new = archinfo.store_name(self.info, text)
            if new in out:
                raise ConvertError(f"{name} and another tensor both map to {new}")
            out[new] = value
        return out

    # -- planning: find every expert and check shapes before a byte is written --------------
    def plan(self) -> tuple[dict, list[str]]:
        per = archinfo.expert_pattern(self.info)
        stacked = archinfo.stacked_pattern(self.info)
        fused = archinfo.fused_pattern(self.info)
        sources: dict[tuple, ExpertSource] = {}
        dense = []
        for name, ref in self.refs.items():
            if m := per.match(name):
                layer, e, proj = int(m[1]), int(m[2]), self.info.proj_names[m[3]]
                src = sources.setdefault((layer, e), ExpertSource("per_expert", index=e))
                src.refs[proj] = ref
            elif m := stacked.match(name):
                layer, proj, part = int(m[1]), m[2], m[3]
                for e in range(ref.shape[0]):
                    src = sources.setdefault((layer, e), ExpertSource("stacked", index=e))
                    if part in ("scales", "biases"):  # beside the weight: mlx-lm quantized experts
                        src.kind = "stacked_quantized"
                    src.refs[f"{proj}.{part}"] = ref
            elif m := fused.match(name):
                layer = int(m[1])
                for e in range(ref.shape[0]):
                    src = sources.setdefault((layer, e), ExpertSource("fused", index=e))
                    if m[3] in ("_blocks", "_scales"):
                        src.kind = "fused_mxfp4"
                    src.refs[m[2] + (m[3] or "")] = ref
            elif not (self.fp8 and name.endswith(fp8.SCALE_SUFFIX)):  # scales go with their weight
                dense.append(name)
        # Multi-token-prediction layers (DeepSeek-V3 layer 61) are not part of the decoder.
        dense = [n for n in dense if _layer_of(n) is None or _layer_of(n) < self.n_layers]
        sources = {k: v for k, v in sources.items() if k[0] < self.n_layers}
        problems = []
        for layer in self.moe_layers:
            for e in range(self.n_experts):
                src = sources.get((layer, e))
                if src is None:
                    problems.append(f"layer {layer} expert {e}: no expert tensors found")
                    continue
                problems += self._check(layer, e, src)
        extra = sorted(set(sources) - {(l, e) for l in self.moe_layers for e in range(self.n_experts)})
        if extra:
            problems.append(f"expert tensors for (layer, expert) {extra[:4]} that the config does "
                            f"not route to (moe layers {self.moe_layers}, {self.n_experts} experts)")
        if problems:
            more = f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""
            raise ConvertError("cannot convert:\n  " + "\n  ".join(problems[:10]) + more)
        return sources, dense

    def _check(self, layer: int, e: int, src: ExpertSource) -> list[str]:
        where = f"layer {layer} expert {e}"
        need = {"per_expert": archinfo.PROJS, "stacked": [f"{p}.weight" for p in archinfo.PROJS],
                "stacked_quantized": [f"{p}.weight" for p in archinfo.PROJS],
                "fused": ["gate_up_proj", "down_proj"], "fused_mxfp4": OPENAI_MXFP4_PARTS}[src.kind]
        missing = [n for n in need if n not in src.refs]
        if missing:
            return [f"{where}: missing tensors {missing}"]
        if src.kind == "stacked_quantized":
            return self._check_quantized(where, layer, src)
        if src.kind == "fused_mxfp4":
            return self._check_mxfp4(where, src)
        transposed = src.kind == "fused" and self.info.model_type in INTERLEAVED_FUSED
        for name, ref in src.refs.items():
            if ref.dtype == fp8.FP8 and self.fp8:
                try:
                    fp8.scale_of(self.refs, ref)
                except fp8.Fp8Error as e:
                    return [f"{where}: {e}"]
            elif ref.dtype not in FLOAT_DTYPES:
                return [f"{where}: {ref.name} has dtype {ref.dtype}; expected float16/bfloat16/float32"
                        + ("" if self.fp8 else " (float8 weights need the config's FP8 quantization_config)")]
            if name.endswith("bias"):
                continue
            in_dim = ref.shape[-2] if transposed else ref.shape[-1]
            if in_dim % self.group_size:
                return [f"{where}: {ref.name} shape {list(ref.shape)} does not fit group size "
                        f"{self.group_size} (input dimension {in_dim} is not a multiple)"]
        return []

    def _check_quantized(self, where: str, layer: int, src: ExpertSource) -> list[str]:
        """mlx-lm quantized experts: each projection's spec resolves and its tensors are there."""
        problems = []
        for proj in archinfo.PROJS:
            if self._expert_path(layer, proj) + ".global_scale" in self.refs:
                problems.append(f"{where}: {proj} has an nvfp4 global scale, which deltafin does not read")
                continue
            try:
                q = self._mlx_spec(layer, proj, src)
            except quantmodes.QuantError as e:
                problems.append(f"{where}: {proj}: {e}")
                continue
            need = ("weight",) if q is None else \
                ("weight", "scales", "biases") if quantmodes.has_biases(q) else ("weight", "scales")
            have = tuple(k for k in ("weight", "scales", "biases") if f"{proj}.{k}" in src.refs)
            if have != need:
                problems.append(f"{where}: {proj} quantized {q} needs {list(need)}, the checkpoint "
                                f"has {list(have)}")
        return problems

    def _check_mxfp4(self, where: str, src: ExpertSource) -> list[str]:
        """OpenAI's mxfp4 experts: the config says mxfp4, blocks [E, out, G, 16] and scales
        [E, out, G] are uint8, gate_up_proj has an even number of rows (gate and up interleaved)."""
        if not self.openai_mxfp4:
            return [f"{where}: mxfp4 _blocks/_scales experts need quantization_config.quant_method "
                    f"'mxfp4' in config.json"]
        for proj in ("gate_up_proj", "down_proj"):
            blocks, scales = src.refs[f"{proj}_blocks"], src.refs[f"{proj}_scales"]
            if blocks.dtype != "uint8" or scales.dtype != "uint8":
                return [f"{where}: {proj}_blocks and _scales are {blocks.dtype} and {scales.dtype}, not uint8"]
            if len(blocks.shape) != 4 or blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
                return [f"{where}: {proj}_blocks {list(blocks.shape)} and _scales {list(scales.shape)} are not "
                        f"mxfp4 blocks [E, out, G, 16] with scales [E, out, G]"]
        if src.refs["gate_up_proj_blocks"].shape[1] % 2:
            return [f"{where}: gate_up_proj has an odd number of rows; gate and up alternate"]
        return []

    def _expert_path(self, layer: int, proj: str) -> str:
        return f"model.layers.{layer}.{self.info.block}.{self.info.stacked}.{proj}"

    def _mlx_spec(self, layer: int, proj: str, src: ExpertSource) -> dict | None:
        """The spec mlx-lm gives expert projection `proj` of `layer` (None: float)."""
        w = {p: src.refs[f"{p}.weight"] for p in archinfo.PROJS}
        # a projection's input width: gate/up read the hidden state, which down writes, and back
        in_dims = w["gate_proj"].shape[-2] if proj == "down_proj" else w["down_proj"].shape[-2]
        parts = {k: src.refs[f"{proj}.{k}"] for k in ("weight", "scales") if f"{proj}.{k}" in src.refs}
        return mlx_spec(self.mlx_quant, self._expert_path(layer, proj), parts, in_dims)

    def _float_spec(self, layer: int, proj: str) -> dict:
        """How a float expert projection is quantized: the recipe's choice, else the one spec."""
        if self.recipe:
            return quantmodes.recipe_spec(self.recipe, layer, self.n_layers, proj, self.group_size)
        return self.spec

    # -- one record ------------------------------------------------------------------------
    def record(self, layer: int, src: ExpertSource) -> tuple[dict, dict]:
        tensors: dict[str, np.ndarray] = {}
        quant = {}
        if src.kind == "stacked_quantized":
            for proj in archinfo.PROJS:
                quant[proj] = self._mlx_spec(layer, proj, src)  # None: mlx-lm left it float
                for part in ("weight", "scales", "biases"):
                    if f"{proj}.{part}" in src.refs:
                        tensors[f"{proj}.{part}"] = src.refs[f"{proj}.{part}"].read_slice0(src.index)
            return {**tensors, **self._expert_biases(src)}, quant
        if src.kind == "fused_mxfp4":
            return {**self._mxfp4_projs(src), **self._expert_biases(src)}, {p: OPENAI_MXFP4 for p in archinfo.PROJS}
        for proj, (w, dtype) in self._float_projs(src).items():
            quant[proj] = self._float_spec(layer, proj)
            tensors.update({f"{proj}.{k}": a for k, a in quantize(w, dtype, quant[proj]).items()})
        return {**tensors, **self._expert_biases(src)}, quant

    def _mxfp4_projs(self, src: ExpertSource) -> dict:
        """OpenAI's mxfp4 expert as MLX's, byte for byte: gate and up the even and odd rows of
        gate_up_proj (as mlx-lm's gpt_oss sanitize splits them)."""
        gate_up, down = ({k: src.refs[f"{p}_{k}"].read_slice0(src.index) for k in ("blocks", "scales")}
                         for p in ("gate_up_proj", "down_proj"))
        out = {}
        for proj, part, rows in (("gate_proj", gate_up, slice(0, None, 2)), ("up_proj", gate_up, slice(1, None, 2)),
                                 ("down_proj", down, slice(None))):
            out[f"{proj}.weight"] = mxfp4_words(part["blocks"][rows])
            out[f"{proj}.scales"] = np.ascontiguousarray(part["scales"][rows])
        return out

    def _expert_biases(self, src: ExpertSource) -> dict:
        """The expert's own output biases, `{proj}.bias` [out], as stored (gpt-oss)."""
        if src.kind not in ("fused", "fused_mxfp4"):
            return {n: src.refs[n].read_slice0(src.index) for n in (f"{p}.bias" for p in archinfo.PROJS)
                    if n in src.refs}
        out = {}
        if "gate_up_proj_bias" in src.refs:
            gu = src.refs["gate_up_proj_bias"].read_slice0(src.index)
            out["gate_proj.bias"], out["up_proj.bias"] = (np.ascontiguousarray(gu[0::2]),
                                                          np.ascontiguousarray(gu[1::2]))
        if "down_proj_bias" in src.refs:
            out["down_proj.bias"] = src.refs["down_proj_bias"].read_slice0(src.index)
        return out

    def _read_float(self, ref: TensorRef) -> tuple[np.ndarray, str]:
        """One expert's float weight, FP8 dequantized to bfloat16."""
        if ref.dtype == fp8.FP8:
            return fp8.dequantize(ref, fp8.scale_of(self.refs, ref)), "bfloat16"
        return ref.read(), ref.dtype

    def _float_projs(self, src: ExpertSource) -> dict:
        if src.kind == "per_expert":
            return {p: self._read_float(src.refs[p]) for p in archinfo.PROJS}
        if src.kind == "stacked":
            return {p: (src.refs[f"{p}.weight"].read_slice0(src.index), src.refs[f"{p}.weight"].dtype)
                    for p in archinfo.PROJS}
        gu_ref, down_ref = src.refs["gate_up_proj"], src.refs["down_proj"]
        gu = gu_ref.read_slice0(src.index)
        if self.info.model_type in INTERLEAVED_FUSED:
            return {"gate_proj": (np.ascontiguousarray(gu[:, 0::2].T), gu_ref.dtype),
                    "up_proj": (np.ascontiguousarray(gu[:, 1::2].T), gu_ref.dtype),
                    "down_proj": (np.ascontiguousarray(down_ref.read_slice0(src.index).T), down_ref.dtype)}
        half = gu.shape[0] // 2
        return {"gate_proj": (np.ascontiguousarray(gu[:half]), gu_ref.dtype),
                "up_proj": (np.ascontiguousarray(gu[half:]), gu_ref.dtype),
                "down_proj": (down_ref.read_slice0(src.index), down_ref.dtype)}

    # -- the whole run -----------------------------------------------------------------------
    def run(self) -> Path:
        sources, dense = self.plan()
        q = OPENAI_MXFP4 if self.openai_mxfp4 else self.spec
        if self.mlx_quant:
            try:
                q = quantmodes.from_entry(self.mlx_quant)
            except quantmodes.QuantError as e:
                raise ConvertError(f"config.json quantization: {e}") from None
        try:
            writer = StoreWriter(self.out, self.config, q["bits"], q["group_size"], mode=q["mode"],
                                 dense_quantization=self.mlx_quant, force=self.force,
                                 extra={"recipe": self.recipe} if self.recipe else None)
        except StoreError as e:
            raise ConvertError(str(e)) from None
        bar = progress_bar(len(sources) + len(dense), "convert", self.progress)
        try:
            with writer:
                for (layer, e) in sorted(sources):
                    tensors, quant = self.record(layer, sources[(layer, e)])
                    if self.activation is not None:
                        quant["activation"] = self.activation
                    writer.add_expert(layer, e, tensors, quant)
                    bar.update(1)
                for name in sorted(dense):
                    self._add_dense(writer, name, self.refs[name])
                    bar.update(1)
                for fname in TOKENIZER_FILES + EXTRA_TOKENIZER_FILES:
                    if (self.src / fname).exists():
                        writer.add_tokenizer_file(self.src / fname)
                return writer.finish()
        finally:
            bar.close()


    def _add_dense(self, writer: StoreWriter, name: str, ref: TensorRef) -> None:
        """Copies one dense tensor band by band under its name in the store (the language
        model's, as the family's model reads it); FP8 ones dequantized to bfloat16."""
        if ref.dtype == fp8.FP8 and self.fp8:
            try:
                bands = fp8.dequantized_bands(ref, fp8.scale_of(self.refs, ref))
            except fp8.Fp8Error as e:
                raise ConvertError(str(e)) from None
            writer.add_dense(name, "bfloat16", ref.shape, bands)
        else:
            writer.add_dense(name, ref.dtype, ref.shape, (band for _, band in ref.bands(DENSE_BAND_ROWS)))


def _layer_of(name: str) -> int | None:
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit():
        return int(parts[2])
    return None


def progress_bar(total: int, desc: str, enabled: bool, unit: str = "tensor", **kw):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit=unit, disable=not enabled, file=sys.stderr,
                dynamic_ncols=True, **kw)


def verify(path, progress: bool = True) -> list[str]:
    store = Store(path)
    bar = progress_bar(store.expert_bytes_total, "verify", progress, unit="B", unit_scale=True)
    try:
        return [msg for _, msg in store.verify(progress=bar.update)]
    finally:
        bar.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(formatter_class=Help, prog="deltafin-convert",
                                description="Convert a Hugging Face or mlx-lm MoE checkpoint into a "
                                            "deltafin expert store, or verify a store.")
    p.add_argument("paths", nargs="+", metavar="SRC OUT", help="SRC OUT to convert; OUT with --verify")
    p.add_argument("--mode", default="affine", choices=quantmodes.MODES,
                   help="how float experts are quantized (mlx-lm's --q-mode; default affine)")
    p.add_argument("--bits", type=int, default=None, choices=quantmodes.AFFINE_BITS,
                   help="affine bits (default 4; mxfp4/nvfp4 4, mxfp8 8)")
    p.add_argument("--group-size", type=int, default=None, choices=(16, 32, 64, 128),
                   help="affine 32/64/128 (default 64); mxfp4/mxfp8 32, nvfp4 16")
    p.add_argument("--quant-predicate", default=None, choices=tuple(quantmodes.RECIPES),
                   help="mlx-lm's mixed recipe: per layer and projection bits (affine)")
    p.add_argument("--verify", action="store_true", help="re-read every record and check checksums")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p.add_argument("--no-progress", action="store_true", help="print no progress lines")
    a = p.parse_args(argv)
    try:
        if a.verify:
            if len(a.paths) != 1:
                p.error("--verify takes one store path")
            problems = verify(a.paths[0], progress=not a.no_progress)
            for msg in problems:
                print(f"BAD {msg}", file=sys.stderr)
            if problems:
                print(f"{a.paths[0]}: {len(problems)} problem(s)", file=sys.stderr)
                return 1
            store = Store(a.paths[0])
            print(f"OK {a.paths[0]}: {len(store.records)} expert records, "
                  f"{store.expert_bytes_total / 2**20:.1f} MiB, checksums match")
            return 0
        if len(a.paths) != 2:
            p.error("convert takes SRC and OUT")
        out = Converter(a.paths[0], a.paths[1], a.bits, a.group_size, a.force,
                        progress=not a.no_progress, mode=a.mode, recipe=a.quant_predicate).run()
        store = Store(out)
        how = store.manifest.get("recipe") or f"{store.mode} {store.bits}-bit group {store.group_size}"
        print(f"wrote {out}: {store.manifest['architecture']}, {len(store.records)} expert records "
              f"({store.expert_bytes_total / 2**20:.1f} MiB), {how}")
        return 0
    except (ConvertError, StoreError, TensorFileError, archinfo.UnsupportedArchitecture) as e:
        print(f"deltafin-convert: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
