"""The float dtypes of checkpoints, stores and compute: names and sizes, one table (no MLX here:
the supervisor and the budget import this)."""
from __future__ import annotations

ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
FLOAT_DTYPES = tuple(ITEMSIZE)
ALIASES = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}
NAMES = (*FLOAT_DTYPES, *ALIASES)  # every name a user may give for a float dtype


def canonical(name) -> str | None:
    """A float dtype's name ("bfloat16") from any spelling: an alias ("bf16") or the way MLX prints
    it ("mlx.core.bfloat16"); None for anything else ("auto", "uint32")."""
    short = str(name).rsplit(".", 1)[-1]
    short = ALIASES.get(short, short)
    return short if short in ITEMSIZE else None


def itemsize(name) -> int | None:
    """Bytes per element of a float dtype given by any spelling; None when name is no float dtype."""
    short = canonical(name)
    return ITEMSIZE[short] if short else None
