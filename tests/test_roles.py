"""The role classes in-process (no sockets): router policy, loader reads, compute exactness."""
from __future__ import annotations

import mmap

import mlx.core as mx
import numpy as np
import pytest

from deltafin.protocol import messages as M
from deltafin.runtime.models import ResidentExperts
from deltafin.runtime.store import Store
from deltafin.workers.engine import Compute
from deltafin.workers.sources import LocalExpertSource
from deltafin.workers.loader import Loader
from deltafin.workers.router import Router, RouterError

CONFIG = {"compute": {"dtype": "auto", "max_context": 256, "prefill_chunk": 4}}


def _loaded(r: M.Read) -> M.Loaded:
    return M.Loaded(slot=r.slot, generation=r.generation, layer=r.layer, expert=r.expert, read_us=1, nbytes=10)


def _sent(out, kind):
    return [m for _, m in out if isinstance(m, kind)]


def _serve(router: Router, out) -> list:
    """Plays loader and compute for the router's messages until none are left; returns compute's."""
    todo, seen = list(out), []
    while todo:
        to, msg = todo.pop(0)
        if isinstance(msg, M.Read):
            todo += router.loaded(_loaded(msg))
        elif isinstance(msg, M.Fill):
            seen.append(msg)
            todo += router.filled(M.Filled(staging=msg.staging, generation=msg.generation))
        else:
            seen.append(msg)
    return seen


def test_router_lru_pins_and_generations():
    router = Router(n_slots=3, n_staging=2)
    out = router.need(1, layer=0, experts=[5, 6])
    reads = _sent(out, M.Read)
    assert not _sent(out, M.Slots) and [(r.layer, r.expert) for r in reads] == [(0, 5), (0, 6)]
    fill = _sent(router.loaded(_loaded(reads[0])), M.Fill)[0]
    assert (fill.layer, fill.expert, fill.slot, fill.staging) == (0, 5, 0, reads[0].slot)
    got = router.loaded(_loaded(reads[1]))
    reply = _sent(got, M.Slots)[0]
    assert reply.req == 1 and [s[0] for s in reply.slots] == [5, 6] and reply.hits == 0
    for f in _sent(got, M.Fill) + [fill]:
        router.filled(M.Filled(staging=f.staging, generation=f.generation))
    out = router.need(2, layer=1, experts=[1])
    stale = _sent(out, M.Read)[0]
    _serve(router, router.loaded(_loaded(stale)))
    # expert (0,5) is least recently used; a new expert evicts it, not the pinned (1,1)
    out = router.need(3, layer=1, experts=[1, 2])
    reads = _sent(out, M.Read)
    assert not _sent(out, M.Slots) and [(r.layer, r.expert) for r in reads] == [(1, 2)]
    seen = _serve(router, out)
    assert _sent([(None, m) for m in seen], M.Fill)[0].slot == 0  # slot of (0,5), now generation 2
    assert router.loaded(_loaded(stale)) == []  # a late message about another fill is ignored
    assert _sent([(None, m) for m in seen], M.Slots)[0].hits == 1
    with pytest.raises(RouterError, match="needs 4 experts at once"):
        router.need(4, layer=0, experts=[1, 2, 3, 4])
    assert router.stats()["evictions"] == 1


def test_router_queues_reads_for_free_staging_slots():
    """Reads beyond the staging ring wait for a `filled`; each fill names the staging slot it
    frees, so a staging slot is never read into before compute has copied it out."""
    router = Router(n_slots=4, n_staging=1)
    out = router.need(1, layer=0, experts=[0, 1, 2])
    assert len(_sent(out, M.Read)) == 1  # one staging slot: one read in flight
    first = _sent(out, M.Read)[0]
    fill = _sent(router.loaded(_loaded(first)), M.Fill)[0]
    assert fill.staging == first.slot
    nxt = router.filled(M.Filled(staging=fill.staging, generation=fill.generation))
    assert [m.expert for m in _sent(nxt, M.Read)] == [1] and _sent(nxt, M.Read)[0].slot == first.slot
    seen = _serve(router, nxt)
    assert [m.expert for m in seen if isinstance(m, M.Fill)] == [1, 2]
    assert isinstance(seen[-1], M.Slots) and seen[-1].req == 1


def test_used_reports_hits_in_order_and_a_slot_is_refilled_only_after_its_use():
    """compute's uses served without asking reach the policy in order (LRU here), and the
    victim of a miss is never a slot the current need pins."""
    router = Router(n_slots=3, n_staging=3)
    _serve(router, router.need(1, layer=0, experts=[0, 1, 2]))
    router.used([(0, [0]), (0, [2])])  # hits on 0 then 2: expert 1 is now least recently used
    assert router.stats()["hits"] == 2 and router.stats()["uses"] == 5
    seen = _serve(router, router.need(2, layer=0, experts=[0, 3]))
    fill = next(m for m in seen if isinstance(m, M.Fill))
    assert (fill.expert, fill.slot) == (3, 1)  # expert 1's slot, not pinned 0's nor recent 2's
    # every slot is pinned by the need: the pool is too small, never a pinned victim
    with pytest.raises(RouterError, match="needs 4 experts"):
        router.need(3, layer=0, experts=[0, 2, 3, 4])
    router.used([])  # the pins of the last need go
    seen = _serve(router, router.need(4, layer=0, experts=[4]))
    assert next(m for m in seen if isinstance(m, M.Fill)).slot == 2  # expert 2: 0 and 3 were used after it
    router.used([(5, [9])])  # a use the table does not know is counted apart, not as a hit
    assert router.stats()["stray_uses"] == 1


def test_router_load_failure_fails_the_request():
    router = Router(n_slots=2)
    reads = _sent(router.need(7, layer=0, experts=[0]), M.Read)
    out = router.load_failed(M.LoadFailed(slot=reads[0].slot, generation=reads[0].generation,
                                          layer=0, expert=0, error="loader: checksum mismatch"))
    err = _sent(out, M.FillFailed)[0]
    assert err.req == 7 and "checksum mismatch" in err.error and err.slot == 0
    reads = _sent(router.need(8, layer=0, experts=[0]), M.Read)  # read again, not a false hit
    assert len(reads) == 1


def _pool(store: Store, n_slots: int):
    return mmap.mmap(-1, n_slots * store.max_record_bytes)


def _resident(store: Store) -> ResidentExperts:
    layers = {}
    for layer in store.moe_layers:
        per = [store.read_expert(layer, e) for e in range(store.n_experts)]
        layers[layer] = {k: mx.array(np.stack([p[k] for p in per])) for k in per[0]}
    return ResidentExperts(layers, store.bits, store.group_size)


@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3"])
def test_compute_in_process_is_exact_across_pool_sizes(tiny_stores, arch):
    store = Store(tiny_stores(arch))
    ids = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    results = []
    for n_slots in (len(store.records), store.top_k):
        pool = _pool(store, n_slots)
        router, loader = Router(n_slots), Loader(store, memoryview(pool), store.max_record_bytes)
        compute = Compute(store, CONFIG, LocalExpertSource(router, loader), memoryview(pool), store.max_record_bytes)
        results.append((compute.logits(ids), router.stats()))
        gen = compute.generate(M.Generate(id=1, token_ids=ids, max_tokens=6, stream=False))
        results[-1] += (gen.token_ids,)
        loader.close()
    (full, s_full, g_full), (tight, s_tight, g_tight) = results
    np.testing.assert_array_equal(full, tight)
    assert g_full == g_tight
    assert s_tight["evictions"] > 0 and s_full.get("evictions", 0) == 0
    # and it agrees with the all-resident gather_qmm reference
    model = compute.model
    ref = model(mx.array(ids, dtype=mx.int32), model.make_cache(), _resident(store)).astype(mx.float32)
    assert np.abs(np.array(ref) - full).max() <= 1e-3 * np.abs(full).max()  # GPU matmuls round differently


def test_loader_reports_a_corrupt_record(tiny_stores, tmp_path):
    import shutil
    src = Store(tiny_stores("olmoe"))
    shutil.copytree(src.path, tmp_path / "s")
    store = Store(tmp_path / "s")
    rec = store.record(store.moe_layers[0], 1)
    with open(store.path / rec.file, "r+b") as f:
        f.seek(rec.offset + 5)
        f.write(b"\xff\xff")
    pool = _pool(store, 2)
    loader = Loader(store, memoryview(pool), store.max_record_bytes)
    out = loader.read(M.Read(slot=1, generation=1, layer=rec.layer, expert=1))
    assert isinstance(out, M.LoadFailed) and "checksum mismatch" in out.error
    ok = loader.read(M.Read(slot=0, generation=1, layer=rec.layer, expert=0))
    assert isinstance(ok, M.Loaded) and ok.nbytes == store.record(rec.layer, 0).nbytes
    loader.close()


def test_router_keeps_routing_history():
    router = Router(n_slots=4, history=3)
    for req, (layer, experts) in enumerate([(0, [1, 2]), (1, [2, 3]), (0, [1, 3]), (1, [2, 0])]):
        _serve(router, router.need(req, layer, experts))
    assert list(router.recent) == [(1, (2, 3)), (0, (1, 3)), (1, (2, 0))]
    assert router.uses[(0, 1)] == 2 and router.uses[(1, 2)] == 2
    assert router.stats()["distinct_experts_used"] == 6


def test_a_need_that_cannot_be_met_leaves_no_slot_behind():
    """Every slot pinned or loading: the need fails, and the slots it had taken are free again
    (no slot waits forever for a read that was never ordered)."""
    router = Router(n_slots=3, n_staging=3)
    out = router.need(1, layer=0, experts=[0, 1])
    assert len(_sent(out, M.Read)) == 2  # 0 and 1 loading; their reads are in flight
    with pytest.raises(RouterError, match="pinned or loading"):
        router.need(2, layer=0, experts=[5, 6])  # one free slot, then nothing evictable
    assert router.table.where.keys() == {(0, 0), (0, 1)} and len(router.table.free) == 1
    seen = _serve(router, router.need(3, layer=0, experts=[5]))
    assert any(isinstance(m, M.Slots) for m in seen)


def test_a_profiled_worker_names_mlx_evaluations(tmp_path, monkeypatch):
    """DELTAFIN_PROFILE_DIR: the worker's profile lists MLX's eval and async_eval as functions of
    their own (cProfile does not see nanobind's calls), and they still evaluate."""
    import pstats
    from deltafin.workers import common
    monkeypatch.setattr(mx, "eval", mx.eval)  # restored after the test
    monkeypatch.setattr(mx, "async_eval", mx.async_eval)
    monkeypatch.setenv("DELTAFIN_PROFILE_DIR", str(tmp_path))
    profile = common._profiler()
    a = mx.arange(4) * 2
    mx.async_eval(a)
    mx.eval(a)
    profile.disable()
    assert a.tolist() == [0, 2, 4, 6]
    profile.dump_stats(tmp_path / "p.prof")
    names = {fn for (_, _, fn) in pstats.Stats(str(tmp_path / "p.prof")).stats}
    assert {"mlx_eval", "mlx_async_eval"} <= names
