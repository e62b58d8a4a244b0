"""MLX's quantization modes as data (no MLX here: the store, budget and converter import this).

A quantized projection is described by {"bits", "group_size", "mode"}:
  affine  2/3/4/5/6/8 bits, group 32/64/128, scales and biases in the weight's float dtype
  mxfp4   4 bits (E2M1), group 32, one E8M0 scale (uint8) per group, no biases
  nvfp4   4 bits (E2M1), group 16, one E4M3 scale (uint8) per group, no biases
  mxfp8   8 bits (E4M3), group 32, one E8M0 scale (uint8) per group, no biases
In mlx-lm's `quantization` config a per-module override without "mode" is affine (MLX's
`to_quantized` default), whatever the top-level mode is.
"""
from __future__ import annotations

AFFINE_BITS = (2, 3, 4, 5, 6, 8)
AFFINE_GROUPS = (32, 64, 128)
# mode -> (bits, group_size) of the microscaling modes: each allows exactly one pair
FLOAT_MODES = {"mxfp4": (4, 32), "nvfp4": (4, 16), "mxfp8": (8, 32)}
MODES = ("affine", *FLOAT_MODES)
# mlx-lm convert's --quant-predicate recipes: name -> (low bits, high bits), affine
RECIPES = {"mixed_2_6": (2, 6), "mixed_3_4": (3, 4), "mixed_3_6": (3, 6), "mixed_4_6": (4, 6)}


class QuantError(ValueError):
    """A quantization mode, bit width or group size MLX does not define."""


def defaults(mode: str) -> tuple[int, int]:
    """(bits, group_size) a mode uses where none is given (mlx-lm's defaults)."""
    check_mode(mode)
    return FLOAT_MODES.get(mode, (4, 64))


def check_mode(mode) -> str:
    if mode not in MODES:
        raise QuantError(f"unknown quantization mode {mode!r} (known: {', '.join(MODES)})")
    return mode


def spec(bits, group_size, mode="affine") -> dict:
    """A checked {"bits", "group_size", "mode"}; QuantError names what MLX would refuse."""
    check_mode(mode)
    try:
        bits, group_size = int(bits), int(group_size)
    except (TypeError, ValueError):
        raise QuantError(f"{mode}: bits {bits!r} and group size {group_size!r} must be integers") from None
    if mode == "affine":
        if bits not in AFFINE_BITS or group_size not in AFFINE_GROUPS:
            raise QuantError(f"affine quantization takes bits {AFFINE_BITS} and group size "
                             f"{AFFINE_GROUPS}, not {bits} bits at group {group_size}")
    elif (bits, group_size) != FLOAT_MODES[mode]:
        raise QuantError(f"{mode} is {FLOAT_MODES[mode][0]} bits at group {FLOAT_MODES[mode][1]}, "
                         f"not {bits} bits at group {group_size}")
    return {"bits": bits, "group_size": group_size, "mode": mode}


def has_biases(q: dict) -> bool:
    """Affine groups carry a bias beside the scale; the microscaling modes do not."""
    return q["mode"] == "affine"


def override(qconfig: dict, path: str) -> dict | None | bool:
    """mlx-lm `quantization` entry for module `path`: a checked spec where the config names the
    path (`from_entry`), False where it says the path stays float, None where it does not name
    the path."""
    o = qconfig.get(path)
    if o is None or o is True:
        return None
    if o is False:
        return False
    if not isinstance(o, dict):
        raise QuantError(f"quantization entry for {path} is {o!r}, not a dict or a bool")
    return from_entry(o)


def from_entry(o: dict) -> dict:
    """The spec of an mlx-lm `quantization` entry: no "mode" means affine, a missing or null
    bits or group size the mode's default (as MLX's to_quantized takes them)."""
    mode = o.get("mode", "affine")
    bits, group = defaults(mode)
    return spec(bits if o.get("bits") is None else o["bits"],
                group if o.get("group_size") is None else o["group_size"], mode)


def infer(packed_cols: int, n_groups: int, in_dims: int, scales_dtype: str) -> dict:
    """The spec a saved tensor was packed with, from its shapes (as mlx-lm infers it for paths its
    config does not name): group size and bits from the input width, the mode from the scales'
    dtype (only affine keeps float scales) and the (bits, group) pair."""
    if in_dims <= 0 or n_groups <= 0 or in_dims % n_groups:
        raise QuantError(f"input width {in_dims} is not a whole number of {n_groups} groups")
    group_size, bits = in_dims // n_groups, packed_cols * 32 // in_dims
    if scales_dtype != "uint8":
        return spec(bits, group_size, "affine")
    for mode, pair in FLOAT_MODES.items():
        if pair == (bits, group_size):
            return spec(bits, group_size, mode)
    raise QuantError(f"cannot infer the quantization mode of {bits} bits at group {group_size} "
                     f"with uint8 scales")


def recipe_spec(recipe: str, layer: int, n_layers: int, proj: str, group_size: int = 64) -> dict:
    """mlx-lm's mixed recipe (`--quant-predicate`) for expert projection `proj` of `layer`:
    down_proj of the first and last eighth of the layers and of every third layer between gets
    the high bits, everything else the low bits (affine)."""
    if recipe not in RECIPES:
        raise QuantError(f"unknown recipe {recipe!r} (known: {', '.join(RECIPES)})")
    low, high = RECIPES[recipe]
    more = (layer < n_layers // 8 or layer >= 7 * n_layers // 8
            or (layer - n_layers // 8) % 3 == 2)
    return spec(high if proj == "down_proj" and more else low, group_size, "affine")
