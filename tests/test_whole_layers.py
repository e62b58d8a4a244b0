"""Whole layers (cache.whole_layers, runtime/tiers.py): where the slots hold most experts, the
first layers of a layout get a slot group of their own, read in whole and never evicted, so they
never read their routing back; the other layers share the rest. The split's arithmetic, the same
layers derived from the slot counts everywhere, and in-process runs that give the all-resident
logits bit for bit with read-backs only on the shared layers (the whole layers launched as soon
as they are built, bench.eager_layers)."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from deltafin.runtime import tiers
from deltafin.runtime.config import Config
from deltafin.runtime.store import Store
from conftest import greedy_alone  # noqa: E402

LAYERS, EXPERTS = 4, 8


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Store:
    from deltafin.tools import convert
    from deltafin.tools.synth import tiny
    root = tmp_path_factory.mktemp("whole")
    src = tiny("mixtral", root / "hf", layers=LAYERS, experts=EXPERTS, top_k=2, seed=5)
    assert convert.main([str(src), str(root / "store"), "--no-progress"]) == 0
    return Store(root / "store")


def test_the_split_keeps_all_but_one_layers_worth_whole(store):
    (g,) = tiers.group_sizes(store)
    w = g + tiers.WHOLE
    # 28 of 32 experts: 3 layers' worth, one left to share (with the remainder)
    assert tiers.whole_layers(store, {g: 28}, True, gpu=False) == {w: 16, g: 12}
    assert tiers.whole_layers(store, {g: 28}, "auto", gpu=True) == {w: 16, g: 12}
    assert tiers.whole_layers(store, {g: 28}, "auto", gpu=False) == {g: 28}   # auto: GPU only
    assert tiers.whole_layers(store, {g: 20}, "auto", gpu=True) == {g: 20}    # below 75%
    assert tiers.whole_layers(store, {g: 20}, True, gpu=False) == {w: 8, g: 12}
    assert tiers.whole_layers(store, {g: 15}, True, gpu=False) == {g: 15}     # not one layer to spare
    assert tiers.whole_layers(store, {g: 32}, True, gpu=True) == {g: 32}      # all resident already
    assert tiers.whole_layers(store, {g: 28}, False, gpu=True) == {g: 28}
    with pytest.raises(ValueError, match="whole_layers"):
        tiers.whole_layers(store, {g: 28}, "yes", gpu=True)
    # every process derives the same layers from the counts: the first ones of the layout
    groups = tiers.layer_groups(store, {w: 16, g: 12})
    assert [groups[layer] for layer in store.moe_layers] == [w, w, g, g]
    assert tiers.group_sizes(store, {w: 16, g: 12}) == {w: 16, g: 16}
    assert tiers.layer_groups(store) == dict.fromkeys(store.moe_layers, g)


def _generate(store, whole, n_slots: int, steps: int = 12):
    """Greedy logits of one prompt decoded in-process (a prefill and `steps` passes), the compute,
    its gate read-backs and the router."""
    from deltafin.tools.inprocess import local_router
    from deltafin.workers.engine import Compute
    cfg = Config().to_dict()
    cfg["cache"]["whole_layers"] = whole
    # whole layers launched as soon as built where a shared layer reads back later (on the CPU
    # "auto" leaves it off): the same logits either way
    cfg["bench"]["eager_layers"] = bool(whole)
    src, staging, loader = local_router(store, cfg, n_slots=n_slots)
    try:
        c = Compute(store, cfg, src, staging, store.max_record_bytes)
        c.preload()
        syncs0 = c.experts.counters.get("gate_syncs")
        out = greedy_alone(c, [3, 14, 15, 92, 65, 35], steps)
        return out, c, c.experts.counters.get("gate_syncs") - syncs0, src.router
    finally:
        loader.close()


def test_whole_layers_give_the_all_resident_logits_and_read_back_only_the_shared_layers(store):
    ref, _, ref_syncs, _ = _generate(store, False, 0)
    assert ref_syncs == 0
    got, c, syncs, router = _generate(store, True, 20)
    for a, b in zip(ref, got):
        np.testing.assert_array_equal(a, b)
    tier = c.experts.tier
    whole = [layer for layer, g in tier.group_of.items() if g.endswith(tiers.WHOLE)]
    assert whole == store.moe_layers[:1]
    assert all(tier.full(layer) for layer in whole)            # read in at start, and kept
    shared = len(store.moe_layers) - len(whole)
    assert 0 < syncs <= 13 * shared, syncs                     # read-backs on the shared layers only
    # the shared layers' group evicts (the whole layers stayed full above)
    assert router.stats().get("evictions", 0) > 0
    # without the split the same slots read routing back on more layers
    _, _, plain_syncs, _ = _generate(store, False, 20)
    assert plain_syncs > syncs, (plain_syncs, syncs)


def test_settings_take_true_false_or_auto(tmp_path):
    from deltafin.runtime.config import ConfigError, load_config
    assert load_config().cache.whole_layers == "auto" and load_config().bench.eager_layers == "auto"
    for section, key in (("cache", "whole_layers"), ("bench", "eager_layers")):
        for value in ("true", "false", '"auto"'):
            (tmp_path / "ok.toml").write_text(f"[{section}]\n{key} = {value}\n")
            load_config(tmp_path / "ok.toml")
        (tmp_path / "bad.toml").write_text(f'[{section}]\n{key} = "yes"\n')
        with pytest.raises(ConfigError, match=key):
            load_config(tmp_path / "bad.toml")


def test_distributed_ranks_keep_no_whole_layers(store, tmp_path):
    """A rank holds only its share of each layer's experts, so whole layers stay off there even
    where asked; the ranks still serve."""
    from deltafin.client import Client
    from test_distributed import PROMPT, ranks  # noqa: E402
    cfg = tmp_path / "whole.toml"
    cfg.write_text("[cache]\nwhole_layers = true\n")
    with ranks(store.path, tmp_path, 2, ["--max-slots", "24", "--config", str(cfg)]) as rs:
        with Client(rs[0][0], timeout=60) as c:
            assert len(c.generate(PROMPT, max_tokens=4).token_ids) == 4
        for ep, _, _ in rs:
            with Client(ep, timeout=60) as c:
                groups = c.stats()["memory"]["resident_groups"]
                assert not any(g.endswith(tiers.WHOLE) for g in groups), groups


def test_only_streaming_groups_are_placed_in_host_memory(store):
    """The pools of a group that streams (fewer slots than its
    experts) go to host memory on MLX CUDA; a group held whole (the whole tier, or whole layers)
    stays in device memory, where kernels read it faster. Elsewhere nothing is placed, but the
    tier still asks only for the streaming groups."""
    from deltafin.workers.resident import ResidentTier, is_metal
    (g,) = tiers.group_sizes(store)
    w = g + tiers.WHOLE
    full = ResidentTier(store, mx.float32, {g: LAYERS * EXPERTS}, host_writes=True, on_host="streaming")
    assert full.placement == {"placed": False, "why": "not asked"}
    split = ResidentTier(store, mx.float32, {w: 16, g: 12}, host_writes=True, on_host="streaming")
    if mx.default_device() == mx.gpu and not is_metal():
        assert split.placement["placed"] and split.placement["groups"] == [g], split.placement
    else:
        assert not split.placement["placed"] and split.placement["why"] != "not asked"
