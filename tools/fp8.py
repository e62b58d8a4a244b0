"""FP8 Hugging Face checkpoints (the DeepSeek-V3 / Kimi-K2 releases): float8_e4m3fn weights, each
with a `weight_scale_inv` of one float per 128x128 block, config "quantization_config":
{"quant_method": "fp8", "weight_block_size": [128, 128]}.

A weight is dequantized to bfloat16 band by band (128 rows, one row of scale blocks, at a time)
with the arithmetic mlx-lm's DeepSeek-V3 `sanitize` uses: the e4m3 value in bfloat16, times its
block's scale (the product in the scale's dtype), rounded to bfloat16. Each element depends only
on its own value and scale, so the bands give exactly the whole-tensor result while memory holds
one band.
"""
from __future__ import annotations

import numpy as np

from deltafin.runtime.tensorfile import TensorRef

BLOCK = 128
SCALE_SUFFIX = "_scale_inv"
FP8 = "float8_e4m3fn"


class Fp8Error(ValueError):
    pass


def block_size(config: dict) -> int | None:
    """BLOCK for an FP8 checkpoint's config, None for any other; Fp8Error for FP8 settings this
    converter does not read (another block size, an activation scheme with static scales)."""
    qc = config.get("quantization_config")
    if not isinstance(qc, dict) or qc.get("quant_method") != "fp8":
        return None
    blocks = list(qc.get("weight_block_size") or ())
    if blocks != [BLOCK, BLOCK]:
        raise Fp8Error(f"FP8 checkpoint with weight_block_size {blocks or None}: only "
                       f"[{BLOCK}, {BLOCK}] blocks are supported")
    return BLOCK


def scale_of(refs: dict, ref: TensorRef) -> TensorRef:
    """The block scales of FP8 weight `ref`, checked against its shape."""
    name = ref.name + SCALE_SUFFIX
    scale = refs.get(name)
    if scale is None:
        raise Fp8Error(f"{ref.name} is float8_e4m3fn but {name} is missing")
    want = tuple(-(-d // BLOCK) for d in ref.shape)
    if len(ref.shape) != 2 or tuple(scale.shape) != want:
        raise Fp8Error(f"{name}: shape {list(scale.shape)} does not give one scale per {BLOCK}x{BLOCK} "
                       f"block of {ref.name} {list(ref.shape)} (expected {list(want)})")
    if scale.dtype not in ("float32", "bfloat16", "float16"):
        raise Fp8Error(f"{name}: dtype {scale.dtype}, expected a float")
    return scale


def _to_mx(arr: np.ndarray, dtype: str):
    import mlx.core as mx
    a = mx.array(arr)
    return a.view(mx.bfloat16) if dtype == "bfloat16" else a


def dequantized_bands(ref: TensorRef, scale: TensorRef):
    """bfloat16 (raw uint16) bands of BLOCK rows of FP8 weight `ref` [m, n]."""
    import mlx.core as mx
    s = _to_mx(scale.read(), scale.dtype)
    n = ref.shape[1]
    pad = -n % BLOCK
    for r0, band in ref.bands(BLOCK):
        w = mx.from_fp8(mx.array(band), dtype=mx.bfloat16)
        rows = w.shape[0]
        if pad:
            w = mx.pad(w, ((0, 0), (0, pad)))
        w = w.reshape(rows, (n + pad) // BLOCK, BLOCK) * s[r0 // BLOCK][None, :, None]
        w = w.reshape(rows, n + pad)[:, :n].astype(mx.bfloat16)
        yield np.array(w.view(mx.uint16))


def dequantize(ref: TensorRef, scale: TensorRef) -> np.ndarray:
    """The whole bfloat16 (raw uint16) weight: one expert's projection, for quantizing."""
    return np.concatenate(list(dequantized_bands(ref, scale)), axis=0)
