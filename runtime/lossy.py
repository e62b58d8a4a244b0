"""Opt-in lossy modes ([lossy] in configs/default.toml): what each one changes, and its name.

"off" is the runtime's default and changes nothing: every answer is the whole model's, bit for
bit. "cache_aware" reroutes a token from a routed expert that is not resident to a resident
expert of the same layer whose gate logit is within a margin of it, so the missing expert is not
read (`reroute`). Every stats reply, the monitor, the `welcome` message and the HTTP responses'
`system_fingerprint` carry the setting's name (`setting`, `fingerprint`), so lossy output is
never taken for exact. numpy only: compute calls it with the ids and logits it read back.
"""
from __future__ import annotations

import math

import numpy as np

MODES = ("off", "cache_aware")


def name(cfg) -> str:
    """The setting in one word: "exact", or the mode with its numbers."""
    if cfg.mode == "off":
        return "exact"
    return f"{cfg.mode}(margin={cfg.margin:g},max_share={cfg.max_share:g})"


def setting(cfg) -> dict:
    """What stats replies carry under `lossy`: the mode, its numbers and its name."""
    return {"mode": cfg.mode, "exact": cfg.mode == "off", "margin": cfg.margin,
            "max_share": cfg.max_share, "name": name(cfg)}


def fingerprint(setting_name: str) -> str:
    """The HTTP responses' `system_fingerprint` for a setting's name: fp_deltafin_exact, or
    fp_deltafin_cache_aware_m0.1_s0.5."""
    text = setting_name.replace("(margin=", "_m").replace(",max_share=", "_s").rstrip(")")
    return "fp_deltafin_" + "".join(ch if ch.isalnum() or ch in "._" else "_" for ch in text)


def max_swaps(max_share: float, top_k: int) -> int:
    """How many of a token's top_k experts may be replaced at most."""
    return math.floor(max_share * top_k + 1e-9)


def reroute(ids: np.ndarray, logits: np.ndarray, resident: np.ndarray, margin: float,
            max_share: float) -> tuple[np.ndarray, int]:
    """Cache-aware routing of one layer: ids [n, k] (the gate's top-k per token), logits [n, E]
    (the gate's), resident [E] bool. A token's routed expert e that is not resident is replaced
    by a resident expert r not among the token's experts where logit[r] >= logit[e] - margin x
    (max - min of the token's logits); at most max_swaps(max_share, k) per token, the lowest-
    scored missing experts first, each by the best-scored resident expert left. A missing expert
    that another row of the pass keeps is read anyway: its rows keep it too (a pass of many rows,
    a prefill chunk or a batch, saves only the experts no row keeps). Returns the new ids (a copy
    where anything changed) and the number of replacements."""
    n, k = ids.shape
    cap = max_swaps(max_share, k)
    missing = ~resident[ids]
    if cap == 0 or not missing.any() or not resident.any():
        return ids, 0
    out, swaps = ids.copy(), 0
    order = np.argsort(-logits, axis=-1, kind="stable")  # experts best first, per token
    for t in np.flatnonzero(missing.any(axis=1)):
        z = logits[t]
        slack = margin * float(z.max() - z.min())
        taken = set(out[t].tolist())
        pool = [int(e) for e in order[t] if resident[e] and int(e) not in taken]
        cols = sorted(np.flatnonzero(missing[t]).tolist(), key=lambda j: z[out[t, j]])
        for j in cols[:cap]:
            if not pool or z[pool[0]] < z[out[t, j]] - slack:
                break  # the best resident one is too far below; the stronger ones need more
            out[t, j] = pool.pop(0)
            swaps += 1
    read_anyway = ids[~resident[ids] & (out == ids)]
    undo = (out != ids) & np.isin(ids, read_anyway)
    out[undo] = ids[undo]
    return out, swaps - int(undo.sum())
