"""The routed experts' math, one module for every caller: the models (`switch_glu`,
`ResidentExperts`), compute's resident tier and the distributed ranks (`run_pairs` on chosen
(token, expert) pairs, joined back by `in_token_order`).

Every op mirrors the MLX primitive mlx-lm's SwitchGLU uses, so the logits match mlx-lm on the same
quantized checkpoint. Whether a layer's rows are sorted by expert is decided once per layer, by
the number of (token, expert) pairs (`sorts_pairs`), as mlx-lm decides it.

A layer computed in pieces (chunks of its experts, a rank's share) equals the one call only if each
piece's matmuls take the kernel the one call takes. The MLX CPU backend has one kernel whatever the
row count; MLX CUDA picks by the call's rows (GatherQMM: qmv under 8 rows, the tiled qmm from 8,
each row computed on its own either way), so on a GPU a piece runs with the layer's row count:
padded with copies of its last row, which are dropped (`run_pairs`).
"""
from functools import partial

import mlx.core as mx
import numpy as np

from deltafin.runtime.dtypes import FLOAT_DTYPES
from deltafin.runtime.models.base import situ, swiglu

# mlx-lm sorts the (token, expert) rows by expert once a layer has this many of them
SORT_PAIRS = 64


def sorts_pairs(n_pairs: int) -> bool:
    """Whether a layer with n_pairs (token, expert) pairs runs on rows sorted by expert."""
    return n_pairs >= SORT_PAIRS


def expert_matmul(x, w, name, idx, quant, sorted_indices):
    """One projection of the chosen experts: w holds stacked [E, out, in] tensors (or a pool of
    resident slots), idx selects per row. quant: {"bits", "group_size", "mode"}, or None for a
    float projection (mlx-lm leaves one float when its input does not fit the group size); the
    microscaling modes have no biases. A per-expert output bias `{name}.bias` [E, out] (gpt-oss)
    is added to each row's result."""
    if quant is None:
        y = mx.gather_mm(x, w[f"{name}.weight"].swapaxes(-1, -2), rhs_indices=idx,
                         sorted_indices=sorted_indices)
    else:
        y = mx.gather_qmm(x, w[f"{name}.weight"], w[f"{name}.scales"], w.get(f"{name}.biases"),
                          rhs_indices=idx, transpose=True, group_size=quant["group_size"],
                          bits=quant["bits"], mode=quant["mode"], sorted_indices=sorted_indices)
    bias = w.get(f"{name}.bias")
    return y if bias is None else y + mx.expand_dims(bias[idx], -2)


@partial(mx.compile, shapeless=True)
def swiglu_oai(gate, up):
    """gpt-oss's clamped SwiGLU (alpha 1.702, limit 7, the constants mlx-lm uses whatever the
    config says): the gate clipped from above, the linear part to [-7, 7] and shifted by 1.
    Compiled like mlx-lm's, so the fused kernel rounds the same way."""
    gate = mx.minimum(gate, 7.0)
    up = mx.clip(up, -7.0, 7.0)
    return (up + 1.0) * (gate * mx.sigmoid(1.702 * gate))


def glu_activation(spec: dict | None):
    """The experts' act(gate, up) a record layout's quant names under "activation" (archinfo's
    `ArchInfo.activation`): SwiGLU where it names none."""
    if spec is None:
        return swiglu
    if spec["name"] == "swiglu_oai":
        return swiglu_oai
    if spec["name"] == "situ":
        return situ(spec["beta"], spec["linear_beta"])
    raise ValueError(f"unknown expert activation {spec['name']!r}")


def gather_glu(x, idx, w, quant: dict, sorted_indices: bool):
    """The GLU of the selected experts, the projections in mlx-lm's order. quant: per projection
    name (a record layout's "quant"), and the activation where it is not SwiGLU."""
    up = expert_matmul(x, w, "up_proj", idx, quant["up_proj"], sorted_indices)
    gate = expert_matmul(x, w, "gate_proj", idx, quant["gate_proj"], sorted_indices)
    act = glu_activation(quant.get("activation"))
    return expert_matmul(act(gate, up), w, "down_proj", idx, quant["down_proj"], sorted_indices)


def uniform_quant(w: dict, bits: int, group_size: int, mode: str = "affine",
                  activation: dict | None = None) -> dict:
    """Per-projection quant for stacked tensors with one bits/group_size/mode (float where no
    scales), with the experts' activation where it is not SwiGLU."""
    quant = {p: ({"bits": bits, "group_size": group_size, "mode": mode} if f"{p}.scales" in w else None)
             for p in ("gate_proj", "up_proj", "down_proj")}
    return quant if activation is None else {**quant, "activation": activation}


def pool_dtype(stored: str, dtype):
    """MLX dtype a record tensor is held in: packed codes and uint8 scales as stored, float
    tensors in the compute dtype."""
    return dtype if stored in FLOAT_DTYPES else getattr(mx, stored)


def switch_glu(x, inds, w, quant: dict):
    """Chosen experts' SwiGLU, as mlx-lm's SwitchGLU: x [..., D], inds [..., k] rows of w ->
    [..., k, D] (e.g. [N, D] and [N, k], or the gate's [B, L, D] and [B, L, k]).

    w: stacked [E, out, in] tensors, or resident pools with inds as slot numbers (each row's
    result depends only on its own row and expert, so the slot numbering changes nothing)."""
    x = mx.expand_dims(x, (-2, -3))
    # Sorting rows by expert keeps each expert's weights contiguous when there are many rows.
    do_sort = sorts_pairs(inds.size)
    idx, order = inds, None
    if do_sort:
        flat = inds.flatten()
        order = mx.argsort(flat)
        x, idx = x.flatten(0, -3)[order // inds.shape[-1]], flat[order]
    y = gather_glu(x, idx, w, quant, do_sort)
    if do_sort:
        y = mx.unflatten(y[mx.argsort(order)], 0, inds.shape)
    return y.squeeze(-2)


def rows_pick_kernels() -> bool:
    """Whether the default device's quantized matmuls choose their kernel by row count (a GPU)."""
    return mx.default_device().type == mx.DeviceType.gpu


def run_pairs(x2, k: int, pairs: np.ndarray, slot_ids: np.ndarray, w: dict, quant: dict, layer_rows: int,
              evaluate: bool = True, pad: bool | None = None):
    """The SwiGLU of the (token, expert) pairs `pairs` (flat indices, grouped by expert) on the
    stacked weights `w` at `slot_ids`, evaluated at once (evaluate) so the stack can go before the
    next one. layer_rows: the whole layer's pair count, which decides the sorting (`sorts_pairs`)
    and, where rows pick kernels (pad; default `rows_pick_kernels()`), the rows of every call."""
    sorted_rows, n = sorts_pairs(layer_rows), len(pairs)
    if (rows_pick_kernels() if pad is None else pad) and 0 < n < layer_rows:
        pairs = np.concatenate([pairs, np.full(layer_rows - n, pairs[-1], dtype=pairs.dtype)])
        slot_ids = np.concatenate([slot_ids, np.full(layer_rows - n, slot_ids[-1], dtype=slot_ids.dtype)])
    idx = mx.array(slot_ids.astype(np.uint32))
    rows = x2[mx.array(pairs // k)]
    xs, ix = (rows[:, None, :], idx) if sorted_rows else (rows[:, None, None, :], idx[:, None])
    piece = gather_glu(xs, ix, w, quant, sorted_rows).reshape(len(pairs), x2.shape[-1])
    if len(pairs) > n:
        piece = piece[:n]
    if evaluate:
        mx.eval(piece)
    return piece


def pairs_of(ids1: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Flat (token, k) indices where mask holds, grouped by expert (stable)."""
    pairs = np.nonzero(mask)[0]
    return pairs[np.argsort(ids1[pairs], kind="stable")]


def in_token_order(pieces: list, order: list, lead, k: int, d: int):
    """Concatenated chunk results back in (token, k) order."""
    y = mx.concatenate(pieces, axis=0)
    n = sum(len(o) for o in order)
    inverse = np.empty(n, dtype=np.int64)
    inverse[np.concatenate(order)] = np.arange(n)
    return y[mx.array(inverse)].reshape(*lead, k, d)


class ResidentExperts:
    """ExpertProvider with every expert in memory: {layer: {"gate_proj.weight": [E, ...], ...}}."""

    keeps_shape = True  # x [..., D], inds [..., k] -> [..., k, D] (switch_glu takes any leading shape)

    def __init__(self, per_layer_stacked: dict, bits: int = 4, group_size: int = 64,
                 activation: dict | None = None, mode: str = "affine", quant: dict | None = None):
        """activation: the family's (archinfo.ArchInfo.activation); quant: {layer: per-projection
        quant} where layers differ (mixed recipes; a store's layouts); other layers use
        bits/group_size/mode."""
        self.layers, self.bits, self.group_size, self.mode = per_layer_stacked, bits, group_size, mode
        self.activation, self.quant = activation, quant or {}

    def __call__(self, layer, x, inds):
        w = self.layers[layer]
        quant = self.quant.get(layer) or uniform_quant(w, self.bits, self.group_size, self.mode, self.activation)
        return switch_glu(x, inds, w, quant)
