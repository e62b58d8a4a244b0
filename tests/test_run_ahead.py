"""Running ahead (workers/slot_experts.py `begin_ahead`, runtime/models/decoder.py `_run_ahead`):
a one-token pass computes a partially resident MoE layer on the experts resident when it is built
and reads its routing back one such layer later; a layer that chose a missing expert is computed
again and the attention after it taken back. What is kept must be what the plain loop computes,
bit for bit, at every budget, whether a layer was kept or computed again."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from deltafin.runtime.config import Config
from deltafin.runtime.models.caches import KVCache, SlidingKVCache
from deltafin.runtime.store import Store
from deltafin.workers.passes import ExpertProvider
from conftest import greedy_alone  # noqa: E402

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79]
EVERY = 1e9  # bench.ahead_waste that runs every partial layer ahead


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Store:
    from deltafin.tools import convert
    from deltafin.tools.synth import tiny
    root = tmp_path_factory.mktemp("ahead")
    src = tiny("qwen3_moe", root / "hf", layers=4, experts=8, top_k=2, seed=5)
    assert convert.main([str(src), str(root / "store"), "--no-progress"]) == 0
    return Store(root / "store")


def _decode(store, n_slots: int, run_ahead: bool, steps: int = 24, launch_first: bool = False,
            depth: int = 1, weigh_misses: bool = True, launch: str = "layer", copies: bool | str = "auto",
            foresight: bool = True, check_each: bool = False, waste: float = 1.0, waits: bool = False):
    """Greedy logits in-process (the compute, its router and loader), and the provider's counters."""
    from deltafin.tools.inprocess import local_router
    from deltafin.workers.engine import Compute
    cfg = Config().to_dict()
    cfg["bench"]["run_ahead"] = run_ahead
    cfg["bench"]["launch_first"] = launch_first
    cfg["bench"]["ahead_depth"] = depth
    cfg["bench"]["ahead_launch"] = launch
    cfg["bench"]["device_copies"] = copies
    cfg["bench"]["foresight"] = foresight
    cfg["bench"]["check_each"] = check_each
    cfg["bench"]["ahead_waste"] = waste
    cfg["bench"]["device_waits"] = waits
    cfg["cache"]["weigh_misses"] = weigh_misses
    src, staging, loader = local_router(store, cfg, n_slots=n_slots)
    try:
        c = Compute(store, cfg, src, staging, store.max_record_bytes)
        c.preload()
        out = greedy_alone(c, PROMPT, steps)
        c.experts.counters.add("driver_copies", int(c.experts.tier.copies is not None))
        c.experts.counters.add("waits_on", int(c.experts.lookups is not None))
        sent = c.experts.source.messages
        c.experts.counters.add("hints_sent", sent.get("hint") + sent.get("folded_hint"))
        return out, c.experts.counters
    finally:
        loader.close()


@pytest.mark.parametrize("launch_first,depth,launch", [(False, 1, "layer"), (True, 1, "layer"), (False, 2, "layer"),
                                                      (True, 4, "layer"), (False, 1, "pass")])
def test_a_layer_kept_or_computed_again_gives_the_all_resident_logits(store, launch_first, depth, launch):
    """launch_first: a layer is launched before the layers that ran ahead before it are checked
    (a miss then forgets the layers launched on its output), or after (the default); depth: how
    many stay unchecked after a layer's step (4: every layer of this model, checked at the pass's
    end); launch "pass": nothing launched per layer, every layer checked at the pass's end."""
    ref, _ = _decode(store, len(store.records), run_ahead=True)  # all resident: nothing runs ahead
    kept = missed = forgotten = 0
    for n_slots in (4, 8, 16):  # 2, 4 and 8 of a layer's 8 experts (one group of 4 layers)
        got, counters = _decode(store, n_slots, run_ahead=True, launch_first=launch_first, depth=depth,
                                launch=launch)
        for s, (a, b) in enumerate(zip(ref, got)):
            assert np.array_equal(a, b), (n_slots, s, float(np.abs(a - b).max()))
        ran, miss = counters.get("ran_ahead"), counters.get("ahead_missed")
        assert ran > 0
        kept += ran - miss
        missed += miss
        forgotten += counters.get("ahead_forgotten")
    # both ways were taken: layers kept as computed ahead and layers computed again after a rewind
    assert kept > 0 and missed > 0, (kept, missed)
    # checked before the next is launched, no layer ever runs on a missed one's output
    assert (forgotten > 0) == (launch_first or depth > 1 or launch == "pass"), forgotten


@pytest.mark.skipif(not mx.cuda.is_available(), reason="the driver's copies are MLX CUDA's")
def test_driver_copies_in_one_process_give_the_all_resident_logits(store):
    """bench.device_copies: streaming pools in device memory, filled by the driver out of the
    pinned staging. Several tiers made and let go in one process, each over a new staging pool
    (often mapped where the last one was): each decode's logits equal all resident, bit for bit.
    Found on an H100 before DriverCopies held its pinned staging: from the second tier on, the
    copies came from the driver's stale pages of the first (docs/probes/ahead_race.py)."""
    ref, _ = _decode(store, len(store.records), run_ahead=True)
    for launch in ("layer", "pass"):
        for n_slots in (4, 8, 16, 8):
            got, counters = _decode(store, n_slots, run_ahead=True, launch=launch, copies=True)
            assert counters.get("driver_copies") == 1
            for s, (a, b) in enumerate(zip(ref, got)):
                assert np.array_equal(a, b), (launch, n_slots, s, float(np.abs(a - b).max()))


@pytest.mark.skipif(not mx.cuda.is_available(), reason="the device's lookups are a CUDA kernel")
def test_the_device_waiting_for_a_missing_expert_gives_the_all_resident_logits(store):
    """bench.device_waits: a pass run ahead looks each streaming layer's experts up on the device,
    which waits for the host to read a missing one (workers/device_waits.py). At 2, 4 and 8 of a
    layer's 8 experts, with the driver's copies: the logits equal all resident, bit for bit; the
    device waited (needs sent from its requests) and nothing was computed again."""
    ref, _ = _decode(store, len(store.records), run_ahead=True)
    waited = 0
    for n_slots in (4, 8, 16, 8):
        got, counters = _decode(store, n_slots, run_ahead=True, launch="pass", waits=True)
        assert counters.get("waits_on") == 1
        for s, (a, b) in enumerate(zip(ref, got)):
            assert np.array_equal(a, b), (n_slots, s, float(np.abs(a - b).max()))
        assert counters.get("ahead_missed") == 0 and counters.get("ran_ahead") > 0
        waited += counters.get("device_waits")
    assert waited > 0


def test_the_device_waits_only_on_mlx_cuda(store):
    """Asked for where there is no CUDA kernel (this CPU), the setting leaves the pass as it was:
    no device lookups, the same logits as all resident."""
    if mx.cuda.is_available():
        pytest.skip("on MLX CUDA the device's lookups run (the test above)")
    ref, _ = _decode(store, len(store.records), run_ahead=True)
    got, counters = _decode(store, 8, run_ahead=True, launch="pass", waits=True)
    assert counters.get("waits_on") == 0 and counters.get("device_waits") == 0
    assert all(np.array_equal(a, b) for a, b in zip(ref, got))


def test_a_pass_launched_at_once_reads_back_the_layers_that_miss_most(store):
    """ahead_launch "pass": a miss found at the pass's end forgets every layer built after it, so a
    layer whose miss share times the layers after it reaches bench.ahead_waste reads back instead:
    fewer layers computed in vain than running every layer ahead, the same logits."""
    ruled, counted = _decode(store, 8, run_ahead=True, launch="pass")
    blind, blind_counted = _decode(store, 8, run_ahead=True, launch="pass", waste=EVERY)
    assert all(np.array_equal(a, b) for a, b in zip(ruled, blind))
    assert counted.get("ahead_forgotten") < blind_counted.get("ahead_forgotten"), \
        (counted.get("ahead_forgotten"), blind_counted.get("ahead_forgotten"))
    assert counted.get("ran_ahead") < blind_counted.get("ran_ahead")


def test_a_miss_foretells_the_misses_of_the_layers_built_after_it(store):
    """bench.foresight: the layers a miss forgets chose their experts on a wrong input, mostly the
    right ones; where they chose a missing expert they read their routing back when computed
    again instead of running ahead into a second miss. Fewer misses found at the pass's end and
    fewer layers computed in vain than without it, the all-resident logits either way."""
    ref, _ = _decode(store, len(store.records), run_ahead=True)
    totals = {}
    for foresight in (True, False):
        seen = totals[foresight] = {"foreseen": 0, "ahead_missed": 0, "ahead_forgotten": 0}
        for n_slots in (4, 8):
            got, counters = _decode(store, n_slots, run_ahead=True, launch="pass", foresight=foresight,
                                    waste=EVERY)
            for s, (a, b) in enumerate(zip(ref, got)):
                assert np.array_equal(a, b), (foresight, n_slots, s, float(np.abs(a - b).max()))
            for k in seen:
                seen[k] += counters.get(k)
    assert totals[True]["foreseen"] > 0 and totals[False]["foreseen"] == 0, totals
    assert totals[True]["ahead_missed"] < totals[False]["ahead_missed"], totals
    assert totals[True]["ahead_forgotten"] < totals[False]["ahead_forgotten"], totals


def _served(store, n_slots: int, early_passes: bool, steps: int = 24, temperature: float = 0.0,
            waste: float = EVERY):
    """Tokens through compute's scheduler (`Compute.generate`; greedy, or sampled with seed 7),
    each with its logprob and top 4, the pass run ahead at once, in-process; the scheduler's and
    the provider's counters."""
    from deltafin.protocol import messages as M
    from deltafin.tools.inprocess import local_router
    from deltafin.workers.engine import Compute
    cfg = Config().to_dict()
    cfg["bench"].update(run_ahead=True, ahead_launch="pass", early_passes=early_passes, ahead_waste=waste)
    src, staging, loader = local_router(store, cfg, n_slots=n_slots)
    try:
        c = Compute(store, cfg, src, staging, store.max_record_bytes)
        c.preload()
        done = c.generate(M.Generate(id=1, token_ids=PROMPT, max_tokens=steps, logprobs=4,
                                     temperature=temperature, seed=7))
        return done.token_ids, done.logprobs, c.scheduler.stats(), c.experts.counters
    finally:
        loader.close()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_streaming_pass_launched_before_the_last_token_is_read_gives_its_logprobs(store, temperature):
    """bench.early_passes: where experts stream, the next token's pass is launched once this one's
    routing is checked, before its token is read (the fills the new pass asks for may overwrite
    slots this one's tail still reads: they settle it first). Every token and logprob (top 4)
    those of all resident, bit for bit, at 2 and 4 of a layer's 8 experts, greedy and sampled
    (seeded), with misses found at the pass's end and layers computed again (every layer run
    ahead)."""
    ref, ref_lp, ref_stats, _ = _served(store, len(store.records), early_passes=False,
                                        temperature=temperature)
    assert ref_stats["early_steps"] > 0  # all resident: launched early anyway
    for n_slots in (4, 8):
        got, lp, stats, counters = _served(store, n_slots, early_passes=True, temperature=temperature)
        assert got == ref and lp == ref_lp, n_slots
        assert stats["early_steps"] >= len(ref) - 2, stats  # every step but the first and the last
        assert counters.get("ahead_missed") > 0 and counters.get("ahead_forgotten") > 0
        # each pass that missed is counted once, with the time from its first miss to its end
        assert 0 < counters.get("missed_passes") <= counters.get("ahead_missed"), counters.snapshot()
        assert counters.get("miss_s") > 0
        # of that time, what went to each kind of wait: a missed pass drains at least once more
        parts = [counters.get(f"miss_{k}_s") for k in ExpertProvider.WAITS]
        assert min(parts) >= 0 and counters.get("miss_sync_s") > 0 and sum(parts) <= counters.get("miss_s"), parts
        _, _, plain, _ = _served(store, n_slots, early_passes=False)
        assert plain["early_steps"] == 0, plain


@pytest.mark.parametrize("launch", ["pass", "layer"])
def test_layers_checked_one_by_one_give_the_all_resident_logits_and_foresee(store, launch):
    """bench.check_each: the layers pending are launched apart and each checked once the device
    has it; after a miss the routing of the layers it forgot is read back once its need is out.
    Logits equal all resident, bit for bit, at 2 and 4 of a layer's 8 experts, with misses and
    experts foreseen (against what is resident once the miss's need is served, so not always
    those of checking them in one drain)."""
    ref, _ = _decode(store, len(store.records), run_ahead=True)
    for n_slots in (4, 8):
        for each in (True, False):
            got, counters = _decode(store, n_slots, run_ahead=True, launch=launch, launch_first=True,
                                    depth=8, check_each=each, waste=EVERY)
            for s, (a, b) in enumerate(zip(ref, got)):
                assert np.array_equal(a, b), (each, n_slots, s, float(np.abs(a - b).max()))
            assert counters.get("ahead_missed") > 0 and counters.get("foreseen") > 0, (each, n_slots)


def test_every_partial_layer_still_sends_its_lookahead(store):
    """A layer that ran ahead sends its gate lookahead when it is checked, and the layer being
    called then keeps its own: as many hints as reading each layer back sends."""
    # 6 of a layer's 8 experts: most layers are kept, so most checks come with a layer's own lookahead
    # Probability alone chooses the victims: weighed, the victims follow the hints, which the two
    # orders send at different times, so a layer may be whole (it wants no lookahead) at different
    # steps (here 3 against 7 such calls: 72 against 70 hints).
    _, plain = _decode(store, 24, run_ahead=False, weigh_misses=False)
    _, ahead = _decode(store, 24, run_ahead=True, weigh_misses=False)
    assert ahead.get("ran_ahead") > 0
    assert ahead.get("hints_sent") == plain.get("hints_sent") > 0


def test_off_it_reads_every_partial_layer_back_first(store):
    got, counters = _decode(store, 8, run_ahead=False, steps=6)
    assert counters.get("ran_ahead") == 0 and counters.get("gate_syncs") > 0


def test_a_model_whose_caches_cannot_rewind_never_runs_ahead(tiny_stores):
    """Qwen3-Next's linear-attention layers keep a recurrent state, which a pass cannot take back:
    its passes read every partial layer back as before."""
    store = Store(tiny_stores("qwen3_next"))
    got, counters = _decode(store, max(2, len(store.records) // 4), run_ahead=True, steps=4)
    assert counters.get("ran_ahead") == 0 and counters.get("gate_syncs") > 0


def test_a_key_value_cache_rewinds_to_write_the_same_positions_again():
    c = KVCache()
    k = mx.arange(2 * 3 * 4, dtype=mx.float32).reshape(1, 2, 3, 4)
    c.update_and_fetch(k, k)
    first, _ = c.update_and_fetch(k[:, :, :1] + 100, k[:, :, :1])
    c.rewind(1)
    assert c.offset == 3
    again, _ = c.update_and_fetch(k[:, :, :1] + 100, k[:, :, :1])
    assert c.offset == 4 and np.array_equal(np.array(first), np.array(again))
    with pytest.raises(TypeError, match="cannot take a pass back"):
        SlidingKVCache(4).rewind(1)


@pytest.mark.parametrize("setting,gpu,streams,environ,expected", [
    ("auto", True, True, {}, "0"),     # the default where experts stream: kernels launched one by one
    ("auto", True, False, {}, None),   # ... and where every expert is resident: MLX's default, graphs
    (True, True, True, {}, None),      # graphs asked for
    (False, True, False, {}, "0"),     # one by one asked for
    (False, False, True, {}, None),    # the CPU backend has no graphs: the environment is left alone
    ("auto", True, True, {"MLX_USE_CUDA_GRAPHS": "1"}, None),  # a value the user set wins
])
def test_compute_runs_mlx_cuda_graphs_as_configured(setting, gpu, streams, environ, expected):
    """bench.cuda_graphs: what compute's process sets MLX_USE_CUDA_GRAPHS to before its first kernel."""
    from deltafin.runtime.config import BenchConfig
    from deltafin.workers.pipeline import cuda_graphs_env
    assert cuda_graphs_env(BenchConfig(cuda_graphs=setting), gpu, streams, environ) == expected


@pytest.mark.parametrize("toml,gpu,expected", [
    ("", True, 2.0),                  # "auto": a GPU's host has cores to spare
    ("", False, 0.0),                 # ... a CPU's cores compute
    ("spin_ms = 1", False, 1.0),      # a number as given (a TOML integer too)
    ("spin_ms = 0.0", True, 0.0),
])
def test_workers_spin_as_configured(tmp_path, toml, gpu, expected):
    """bench.spin_ms: how long the workers poll without sleeping after a message, as the
    supervisor resolves it for the workers (AttachPool)."""
    from deltafin.runtime.config import load_config
    from deltafin.workers.pipeline import resolved_spin_ms
    path = tmp_path / "c.toml"
    path.write_text("[bench]\n" + toml + "\n")
    assert resolved_spin_ms(load_config(path).bench, gpu) == expected


def test_cuda_graphs_setting_is_checked():
    from deltafin.runtime.config import ConfigError, load_config
    with pytest.raises(ConfigError, match="bench.cuda_graphs"):
        load_config(None, overrides={"bench.cuda_graphs": "sometimes"})


@pytest.mark.parametrize("setting,gpu,device_pools,expected", [
    ("auto", True, False, True),    # a GPU: streaming pools in device memory, filled by the driver
    ("auto", False, False, False),  # the CPU backend: host writes, nothing to place
    (False, True, False, False),    # deltafin-host-pools: host memory, numpy writes
    (True, True, True, False),      # deltafin-device-pools fills through MLX: no host writes to copy
])
def test_device_copies_resolve_per_backend(setting, gpu, device_pools, expected):
    """bench.device_copies: whether compute's streaming pools live in device memory, filled by the
    CUDA driver's copies (workers/resident.py DriverCopies)."""
    from deltafin.runtime.config import BenchConfig
    from deltafin.workers.pipeline import Pipeline
    bench = BenchConfig(device_copies=setting, device_pools=device_pools)
    assert Pipeline.resolve(bench, gpu=gpu, standin=False).device_copies is expected


def test_device_copies_setting_is_checked():
    from deltafin.runtime.config import ConfigError, load_config
    with pytest.raises(ConfigError, match="bench.device_copies"):
        load_config(None, overrides={"bench.device_copies": "maybe"})


def _generate_with(store, tmp_path, bench: str, n_slots: int):
    """Real processes: 32 greedy tokens with [bench] settings `bench` (TOML lines) at n_slots
    resident slots; (tokens, compute's pipeline stats, the router's stats)."""
    from deltafin.client import Client
    from deltafin.tools.run import running_supervisor
    cfg = tmp_path / f"bench-{abs(hash((bench, n_slots)))}.toml"
    cfg.write_text(f"[bench]\n{bench}")
    with running_supervisor(store.path, "4GiB", ["--config", str(cfg), "--max-slots", str(n_slots)]) as (ep, _):
        with Client(ep, timeout=120) as c:
            tokens = c.generate(PROMPT, max_tokens=32).token_ids
            workers = c.stats()["workers"]
    return tokens, workers["compute"]["pipeline"], workers["router"]


def _off_and_on(store, tmp_path, setting: str, more: str = "", n_slots: int = 8):
    """Real supervisors running ahead: every expert resident with `setting` on, then n_slots
    without it and with it; (tokens, compute's pipeline stats, the router's stats) of each."""
    def run(n: int, on: bool):
        return _generate_with(store, tmp_path, f"run_ahead = true\n{more}{setting} = {str(on).lower()}\n", n)
    return run(len(store.records), True), run(n_slots, False), run(n_slots, True)


def test_next_token_leases_are_read_used_and_change_no_token(store, tmp_path):
    """bench.next_leases, real processes (leases need the router's process): at a pass's end each
    partial layer's runner-up, where missing, is leased for the next token. At 8 of the 32
    experts (2 of a layer's 8) some are read (more of the router's sure reads than without them),
    some used by the passes after, and every token equals that of all resident and of the same
    budget without them."""
    (ref, _, _), (plain, _, plain_router), (got, pipeline, router) = _off_and_on(store, tmp_path, "next_leases")
    assert got == ref == plain
    assert pipeline["resolved"]["next_leases"] is True
    assert pipeline["next_leases"] > 0 and pipeline["next_used"] > 0, pipeline
    # sure reads come from foresight too: the leases add to them
    assert router["foreseen_reads"] > plain_router["foreseen_reads"], (router, plain_router)


@pytest.mark.skipif(not mx.cuda.is_available(), reason="the device's lookups are a CUDA kernel")
def test_the_device_waiting_for_a_missing_expert_changes_no_token(store, tmp_path):
    """bench.device_waits with real processes (the device's requests answered by needs to the
    router's process, their fills copied by the driver while the device waits): at 8 of the 32
    experts every token equals that of all resident and of the same budget without it."""
    (ref, _, _), (plain, _, _), (got, pipeline, _) = _off_and_on(store, tmp_path, "device_waits")
    assert got == ref == plain
    assert pipeline["resolved"]["device_waits"] is True
    assert pipeline["device_waits"] > 0 and pipeline["ahead_missed"] == 0, pipeline


def test_needs_answered_early_change_no_token(store, tmp_path):
    """bench.defer_needs, real processes (the early answer is the router's process's): a layer of
    a pass run ahead that reads its routing back and misses experts gets their slots at once, the
    rest of the pass is built while they are read, and nothing is evaluated before they land. The
    GPU's one call per layer (layer_pieces false) on this CPU, at 8 of the 32 experts: needs are
    answered early, and every token equals that of all resident and of the same budget without."""
    (ref, _, _), (plain, plain_pipeline, plain_router), (got, pipeline, router) = \
        _off_and_on(store, tmp_path, "defer_needs", "layer_pieces = false\n")
    assert got == ref == plain
    # what misses cost, in compute's stats: passes that missed and the time after their first miss
    assert 0 < pipeline["missed_passes"] <= pipeline["ahead_missed"] and pipeline["miss_ms"] > 0, pipeline
    split = pipeline["miss_split_ms"]
    assert set(split) == set(ExpertProvider.WAITS) and split["sync"] > 0 and sum(split.values()) <= pipeline["miss_ms"], pipeline
    assert pipeline["resolved"]["defer_needs"] is True and pipeline["resolved"]["hits_first"] is False
    assert plain_pipeline["deferred_needs"] == 0 and plain_router.get("early_answers", 0) == 0
    assert pipeline["deferred_needs"] > 0 and router["early_answers"] == pipeline["deferred_needs"], (pipeline, router)
