"""The two expert tiers, as numbers (no MLX here: the supervisor and the budget import this).

Staging tier: POSIX shared memory, a small ring of slots the loader reads records into (one
record each, `store.max_record_bytes`). Resident tier: the experts compute uses, one MLX array per
record tensor per *group* of layers that share a record layout, [n_slots, ...] (workers/resident.py,
`ResidentTier`). A resident expert is copied in once per load and never again per use.

A group is a record layout: every MoE layer of a store usually has the same one, so there is one
group; a store whose layers differ (other shapes or bits) gets one group per layout, and the
resident slots are split among them in proportion to their expert counts.

Whole layers (`whole_layers`, cache.whole_layers): a layout's slots may be split once more, into a
group that holds the first layers of the layout whole (named LAYOUT+whole: read in at start, never
evicted, so those layers never read their routing back) and the layout's own group, which the
other layers share the rest. The budget still counts slots per layout; the split is made where
the pool is handed to the workers, and every process derives the same layers from the slot counts
(`layer_groups(store, resident)`).
"""
from __future__ import annotations

from deltafin.runtime.dtypes import ITEMSIZE
from deltafin.runtime.store import Store, StoreError


WHOLE = "+whole"  # suffix of a group of whole layers
# cache.whole_layers = "auto" keeps whole layers where the slots hold at least this share of a
# layout's experts: there a dynamic cache's extra hits are few, while each whole layer saves a GPU
# one gate read-back (a sync) per pass.
WHOLE_MIN_SHARE = 0.75


def layout_of(group: str) -> str:
    """The record layout of a resident group."""
    return group[:-len(WHOLE)] if group.endswith(WHOLE) else group


def layer_groups(store: Store, resident: dict | None = None) -> dict[int, str]:
    """MoE layer -> its group: the layout id its records share, or LAYOUT+whole for the first
    layers of a layout that `resident` (slots per group) keeps whole."""
    groups = {}
    for layer in store.moe_layers:
        ids = {store.record(layer, e).layout for e in range(store.n_experts)}
        if len(ids) != 1:
            raise StoreError(f"layer {layer}: its experts have {len(ids)} record layouts; one layer "
                             f"must share one layout")
        groups[layer] = ids.pop()
    for g, n in (resident or {}).items():
        if g.endswith(WHOLE):
            layers = [layer for layer in store.moe_layers if groups[layer] == layout_of(g)]
            for layer in layers[:n // store.n_experts]:
                groups[layer] = g
    return groups


def whole_layers(store: Store, resident: dict[str, int], setting, gpu: bool) -> dict[str, int]:
    """Resident slots per layout -> the same slots with whole layers kept apart (module docstring).

    setting: cache.whole_layers, true, false or "auto" (on a GPU, where a layout's slots hold at
    least WHOLE_MIN_SHARE of its experts). A layout keeps whole all its layers but one layer's worth
    of slots (and the remainder), which the other layers share: a layer's union of experts always
    fits there, so no layer is computed in chunks. Nothing changes where every expert is resident
    already or not even one layer could be kept whole."""
    if setting not in (True, False, "auto"):
        raise ValueError(f"cache.whole_layers = {setting!r}: use true, false or \"auto\"")
    if setting is False or (setting == "auto" and not gpu):
        return dict(resident)
    sizes, n_exp = group_sizes(store), store.n_experts
    out = {}
    for g, n in resident.items():
        whole = n // n_exp - 1
        if g.endswith(WHOLE) or n >= sizes[g] or whole < 1 or (setting == "auto" and n < WHOLE_MIN_SHARE * sizes[g]):
            out[g] = n
            continue
        out[g + WHOLE] = whole * n_exp
        out[g] = n - whole * n_exp
    return out


def group_sizes(store: Store, resident: dict | None = None) -> dict[str, int]:
    """group -> how many experts (layer x expert) it has."""
    sizes: dict[str, int] = {}
    for g in layer_groups(store, resident).values():
        sizes[g] = sizes.get(g, 0) + store.n_experts
    return sizes


def resident_bytes(layout: dict, itemsize: int | None) -> int:
    """Bytes one expert of this layout takes in the resident tier: packed weights as stored, float
    tensors in the compute dtype (itemsize; None: as stored)."""
    total = 0
    for t in layout["tensors"]:
        if t["dtype"] in ITEMSIZE and itemsize:
            total += t["nbytes"] // ITEMSIZE[t["dtype"]] * itemsize
        else:
            total += t["nbytes"]
    return total


def group_resident_bytes(store: Store, itemsize: int | None) -> dict[str, int]:
    return {g: resident_bytes(store.layouts[g], itemsize) for g in group_sizes(store)}


def staging_slots(store: Store, loader_threads: int, configured: int = 0) -> int:
    """Staging ring size: `configured`, else room for one token's experts of a layer twice over
    and for every loader thread twice over (reads in flight while compute copies the last ones)."""
    n = configured or max(2 * store.top_k, 2 * loader_threads)
    return max(1, min(n, len(store.records)))


def split_resident(sizes: dict[str, int], per_expert: dict[str, int], room: int, cap: int = 0) -> dict[str, int]:
    """Resident slots per group for `room` bytes (sizes: experts per group, per_expert: bytes of one
    resident expert per group): every group gets the same share of its experts (at most all of
    them), so no record layout is starved; `cap` bounds the total (0: none)."""
    need = sum(sizes[g] * per_expert[g] for g in sizes)
    share = min(1.0, max(0, room) / need) if need else 0.0
    if cap:
        share = min(share, cap / sum(sizes.values()))
    out = {g: min(sizes[g], int(share * sizes[g])) for g in sizes}
    # rounding down may leave room for one more slot in a group: give it, largest group first
    left = room - sum(out[g] * per_expert[g] for g in out)
    for g in sorted(sizes, key=sizes.get, reverse=True):
        if out[g] < sizes[g] and per_expert[g] <= left and (not cap or sum(out.values()) < cap):
            out[g] += 1
            left -= per_expert[g]
    return out
