"""The role classes in-process (no sockets): router policy, loader reads, compute exactness."""
from __future__ import annotations

import mmap

import mlx.core as mx
import numpy as np
import pytest

from deltafin.protocol import messages as M
from deltafin.runtime.models import ResidentExperts
from deltafin.runtime.store import Store
from deltafin.workers.compute import Compute, LocalExpertSource
from deltafin.workers.loader import Loader
from deltafin.workers.router import Router, RouterError

CONFIG = {"compute": {"dtype": "auto", "max_context": 256, "prefill_chunk": 4}}


def _loaded(r: M.Read) -> M.Loaded:
    return M.Loaded(slot=r.slot, generation=r.generation, layer=r.layer, expert=r.expert, read_us=1, nbytes=10)


def test_router_lru_pins_and_generations():
    router = Router(n_slots=3)
    reads, reply = router.need(1, layer=0, experts=[5, 6])
    assert reply is None and [(r.layer, r.expert) for r in reads] == [(0, 5), (0, 6)]
    assert router.loaded(_loaded(reads[0])) is None
    reply = router.loaded(_loaded(reads[1]))
    assert reply.req == 1 and [s[0] for s in reply.slots] == [5, 6] and reply.hits == 0
    reads, reply = router.need(2, layer=1, experts=[1])
    stale = reads[0]
    router.loaded(_loaded(stale))
    # expert (0,5) is least recently used; a new expert evicts it, not the pinned (1,1)
    reads, reply = router.need(3, layer=1, experts=[1, 2])
    assert reply is None and [(r.layer, r.expert) for r in reads] == [(1, 2)]
    assert reads[0].slot == 0  # slot of (0,5), now generation 2
    assert router.loaded(_loaded(stale)) is None  # a late message about another fill is ignored
    reply = router.loaded(_loaded(reads[0]))
    assert reply.hits == 1
    with pytest.raises(RouterError, match="needs 4 experts at once"):
        router.need(4, layer=0, experts=[1, 2, 3, 4])
    assert router.stats()["evictions"] == 1


def test_router_load_failure_fails_the_request():
    router = Router(n_slots=2)
    reads, _ = router.need(7, layer=0, experts=[0])
    err = router.load_failed(M.LoadFailed(slot=reads[0].slot, generation=reads[0].generation,
                                          layer=0, expert=0, error="loader: checksum mismatch"))
    assert err.id == 7 and err.code == "expert_read_failed"
    reads, _ = router.need(8, layer=0, experts=[0])  # read again, not a false hit
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
        reads, _ = router.need(req, layer, experts)
        for r in reads:
            router.loaded(_loaded(r))
    assert list(router.recent) == [(1, (2, 3)), (0, (1, 3)), (1, (2, 0))]
    assert router.uses[(0, 1)] == 2 and router.uses[(1, 2)] == 2
    assert router.stats()["distinct_experts_used"] == 6
