"""The loader's chunked reads: a record read as block-sized pieces by several threads, checked
chunk by chunk, and demand reads ahead of prefetch reads."""
from __future__ import annotations

import mmap
import random
import shutil
import threading

import pytest

from deltafin.protocol import messages as M
from deltafin.runtime.store import Store
from deltafin.workers import loader as loader_mod
from deltafin.workers.loader import Loader, ReadQueue


def _pool(store: Store, n_slots: int):
    return mmap.mmap(-1, n_slots * store.max_record_bytes)


def _expected(store, layer, e) -> bytes:
    return bytes(store.read_record(store.record(layer, e)))


@pytest.fixture
def store(tiny_stores):
    s = Store(tiny_stores("olmoe"))
    assert s.record(s.moe_layers[0], 0).nbytes > 3 * 4096  # several chunks of one block
    return s


def test_chunked_read_equals_the_whole_record_in_any_chunk_order(store):
    """Chunks completed in any order: the job completes exactly once, on the last chunk, with
    the record's bytes and a verified checksum."""
    layer = store.moe_layers[0]
    pool = _pool(store, 2)
    loader = Loader(store, memoryview(pool), store.max_record_bytes, chunk_bytes=4096)
    rng = random.Random(3)
    for e in range(4):
        job = loader.job(M.Read(slot=e % 2, generation=e, layer=layer, expert=e))
        order = list(range(len(job.chunks)))
        rng.shuffle(order)
        answers = [loader.read_chunk(job, i) for i in order]
        assert all(a is None for a in answers[:-1]), "a job answered before its last chunk"
        got = answers[-1]
        assert isinstance(got, M.Loaded) and got.nbytes == store.record(layer, e).nbytes
        start = (e % 2) * store.max_record_bytes
        assert bytes(pool[start:start + got.nbytes]) == _expected(store, layer, e)
    assert loader.stats()["reads"] == 4 and loader.stats()["chunk_reads"] > 4 * 3
    loader.close()


def test_threads_reading_chunks_of_many_records_at_once(store):
    """Four threads take chunks of six orders from one ReadQueue (the loader process's shape):
    every record lands whole and verified, each answered once."""
    layer = store.moe_layers[-1]
    pool = _pool(store, 6)
    loader = Loader(store, memoryview(pool), store.max_record_bytes, chunk_bytes=4096)
    q = ReadQueue()
    answers, lock = [], threading.Lock()

    def reader():
        while True:
            got = q.get(timeout=0.2)
            if got is None:
                if q.closed or not len(q):
                    return
                continue
            a = loader.read_chunk(*got)
            if a is not None:
                with lock:
                    answers.append(a)
    for e in range(6):
        q.put(loader.job(M.Read(slot=e, generation=1, layer=layer, expert=e, prefetch=e % 2 == 1)))
    threads = [threading.Thread(target=reader) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    assert sorted(a.expert for a in answers) == list(range(6))
    for a in answers:
        assert isinstance(a, M.Loaded)
        start = a.slot * store.max_record_bytes
        assert bytes(pool[start:start + a.nbytes]) == _expected(store, layer, a.expert)
    s = loader.stats()
    assert s["demand_reads"] == 3 and s["prefetch_reads"] == 3 and 0 < s["disk_busy_share"] <= 1.0
    loader.close()


def test_a_corrupt_chunk_fails_the_record_once_after_every_chunk(tmp_path, store):
    """A damaged byte in the record's last chunk: the checksum chunk by chunk catches it; the
    failure is answered once, only when no chunk is still being written."""
    shutil.copytree(store.path, tmp_path / "s")
    s = Store(tmp_path / "s")
    layer = s.moe_layers[0]
    rec = s.record(layer, 1)
    with open(s.path / rec.file, "r+b") as f:
        f.seek(rec.offset + rec.nbytes - 3)
        f.write(b"\x5a")
    pool = _pool(s, 1)
    loader = Loader(s, memoryview(pool), s.max_record_bytes, chunk_bytes=4096)
    job = loader.job(M.Read(slot=0, generation=1, layer=layer, expert=1))
    n = len(job.chunks)
    answers = [loader.read_chunk(job, i) for i in [n - 1, *range(n - 1)]]
    assert all(a is None for a in answers[:-1])
    assert isinstance(answers[-1], M.LoadFailed) and "checksum mismatch" in answers[-1].error
    ok = loader.read(M.Read(slot=0, generation=2, layer=layer, expert=0))
    assert isinstance(ok, M.Loaded)
    loader.close()


def test_demand_chunks_go_before_prefetch_chunks(store):
    layer = store.moe_layers[0]
    pool = _pool(store, 3)
    loader = Loader(store, memoryview(pool), store.max_record_bytes, chunk_bytes=4096)
    q = ReadQueue()
    pre = loader.job(M.Read(slot=0, generation=1, layer=layer, expert=0, prefetch=True))
    d1 = loader.job(M.Read(slot=1, generation=1, layer=layer, expert=1))
    d2 = loader.job(M.Read(slot=2, generation=1, layer=layer, expert=2))
    q.put(pre)
    q.put(d1)
    q.put(d2)
    taken = [q.get(timeout=0.1) for _ in range(len(q))]
    kinds = [job for job, _ in taken]
    n1, n2 = len(d1.chunks), len(d2.chunks)
    assert kinds == [d1] * n1 + [d2] * n2 + [pre] * len(pre.chunks)
    assert [i for _, i in taken[:n1]] == list(range(n1))  # a record's chunks in file order
    assert q.get(timeout=0.01) is None
    q.close()
    assert q.get(timeout=5) is None and q.closed
    loader.close()


def test_ahead_reads_yield_the_disk_to_a_demand_read_in_flight(store):
    """bench.ahead_piece_bytes: a prefetch or lease read goes in pieces of that size (a demand read
    whole), and while a demand chunk is being read no prefetch piece is handed out; once it is
    done they go out again, and a thread waiting for one gets it. Records land whole and verified
    either way."""
    layer = store.moe_layers[0]
    pool = _pool(store, 2)
    loader = Loader(store, memoryview(pool), store.max_record_bytes, chunk_bytes=0, ahead_piece_bytes=4096)
    pre = loader.job(M.Read(slot=0, generation=1, layer=layer, expert=0, prefetch=True))
    dem = loader.job(M.Read(slot=1, generation=1, layer=layer, expert=1))
    assert len(pre.chunks) > 3 and len(dem.chunks) == 1
    q = ReadQueue(yield_ahead=True)
    q.put(pre)
    first = q.get(timeout=0.1)
    assert first == (pre, 0)  # nothing on demand: ahead pieces go out
    q.put(dem)
    got = q.get(timeout=0.1)
    assert got == (dem, 0)
    assert q.get(timeout=0.05) is None  # the demand read has the disk: no ahead piece starts
    waiter = []
    t = threading.Thread(target=lambda: waiter.append(q.get(timeout=5.0)))
    t.start()
    answer = loader.read_chunk(*got)
    q.done(dem)  # read: the waiting thread takes the next ahead piece at once
    t.join(timeout=2.0)
    assert waiter == [(pre, 1)]
    assert isinstance(answer, M.Loaded)
    assert bytes(pool[store.max_record_bytes:store.max_record_bytes + answer.nbytes]) == _expected(store, layer, 1)
    answers = [loader.read_chunk(pre, i) for i in range(len(pre.chunks))]
    assert isinstance(answers[-1], M.Loaded) and bytes(pool[:answers[-1].nbytes]) == _expected(store, layer, 0)
    plain = ReadQueue()  # without yield_ahead a demand read in flight holds nothing back
    plain.put(loader.job(M.Read(slot=1, generation=2, layer=layer, expert=1)))
    plain.put(loader.job(M.Read(slot=0, generation=2, layer=layer, expert=0, prefetch=True)))
    assert not plain.get(timeout=0.1)[0].order.prefetch and plain.get(timeout=0.1)[0].order.prefetch
    q.close()
    plain.close()
    loader.close()


def test_demand_reads_in_pieces_ahead_reads_whole_behind_them(store, monkeypatch):
    """bench.demand_pieces: a demand read goes in that many block-aligned pieces (none under
    MIN_PIECE: a record below it stays whole), a prefetch or lease read whole, and the loader's
    queue holds ahead reads back while a demand read is in flight. Four threads read the pieces
    of demand and ahead orders mixed: every record lands whole and verified, answered once."""
    layer = store.moe_layers[0]
    nbytes = store.record(layer, 0).nbytes
    pool = _pool(store, 6)
    loader = Loader(store, memoryview(pool), store.max_record_bytes, demand_pieces=4)
    assert loader.yields and len(loader.job(M.Read(slot=0, generation=1, layer=layer, expert=0)).chunks) == 1
    monkeypatch.setattr(loader_mod, "MIN_PIECE", 4096)
    dem = loader.job(M.Read(slot=0, generation=1, layer=layer, expert=0))
    pre = loader.job(M.Read(slot=1, generation=1, layer=layer, expert=1, prefetch=True))
    assert len(dem.chunks) == 4 and sum(n for _, n in dem.chunks) == nbytes
    assert all(o % 4096 == 0 for o, _ in dem.chunks) and len(pre.chunks) == 1
    chunked = Loader(store, memoryview(pool), store.max_record_bytes, chunk_bytes=4096, demand_pieces=4)
    assert len(chunked.job(M.Read(slot=0, generation=1, layer=layer, expert=0)).chunks) == -(-nbytes // 4096)
    assert not chunked.yields
    chunked.close()
    assert not Loader(store, memoryview(pool), store.max_record_bytes, demand_pieces=1).yields
    q = ReadQueue(yield_ahead=loader.yields)
    q.put(dem)
    q.put(pre)
    got = [q.get(timeout=0.1) for _ in range(4)]
    assert [j for j, _ in got] == [dem] * 4 and q.get(timeout=0.05) is None  # the ahead read waits
    answers = [loader.read_chunk(*g) for g in got]
    for g in got:
        q.done(g[0])
    assert answers[:3] == [None] * 3 and isinstance(answers[3], M.Loaded)
    assert q.get(timeout=0.5) == (pre, 0)
    assert isinstance(loader.read_chunk(pre, 0), M.Loaded)
    done, lock = [], threading.Lock()

    def reader():
        while (g := q.get(timeout=0.2)) is not None:
            a = loader.read_chunk(*g)
            q.done(g[0])
            if a is not None:
                with lock:
                    done.append(a)
    for e in range(4):  # demand and ahead orders alternating
        q.put(loader.job(M.Read(slot=2 + e, generation=e, layer=layer, expert=e, prefetch=bool(e % 2))))
    threads = [threading.Thread(target=reader) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert sorted(a.expert for a in done) == [0, 1, 2, 3] and all(isinstance(a, M.Loaded) for a in done)
    for a in done:
        start = a.slot * store.max_record_bytes
        assert bytes(pool[start:start + a.nbytes]) == _expected(store, layer, a.expert)
    q.close()
    loader.close()


def test_whole_record_reads_without_chunking(store):
    layer = store.moe_layers[0]
    pool = _pool(store, 1)
    loader = Loader(store, memoryview(pool), store.max_record_bytes, chunk_bytes=0)
    job = loader.job(M.Read(slot=0, generation=1, layer=layer, expert=3))
    assert len(job.chunks) == 1
    got = loader.read_chunk(job, 0)
    assert isinstance(got, M.Loaded) and bytes(pool[:got.nbytes]) == _expected(store, layer, 3)
    loader.close()


def test_a_short_read_fails_the_record_only_after_its_other_chunks(tmp_path, store):
    """The file ends inside the record's last chunk: that chunk fails first, but the failure is
    answered only once every other chunk (still writing into the slot) is done."""
    shutil.copytree(store.path, tmp_path / "s")
    s = Store(tmp_path / "s")
    layer = s.moe_layers[0]
    rec = s.record(layer, 2)
    pool = _pool(s, 1)
    loader = Loader(s, memoryview(pool), s.max_record_bytes, chunk_bytes=4096)
    job = loader.job(M.Read(slot=0, generation=1, layer=layer, expert=2))
    with open(s.path / rec.file, "r+b") as f:
        f.truncate(rec.offset + rec.nbytes - 100)
    n = len(job.chunks)
    assert loader.read_chunk(job, n - 1) is None and job.error and "truncated" in job.error
    answers = [loader.read_chunk(job, i) for i in range(n - 1)]
    assert all(a is None for a in answers[:-1])
    assert isinstance(answers[-1], M.LoadFailed) and "truncated" in answers[-1].error
    loader.close()


def test_the_router_marks_prefetch_reads_and_the_loader_serves_demand_first(store):
    """End to end in-process: the router's prefetch reads carry `prefetch`, its demand reads do
    not; queued together, the next need's demand read leaves the loader's queue first although
    the prefetch reads were ordered before it."""
    from deltafin.workers.router import Router
    router = Router(8, "predictive", n_staging=6, moe_layers=[0, 1], n_experts=8,
                    prefetch={"threshold": 0.0, "min_precision": 0.0})
    out = router.need(1, 0, [0, 1])
    demand = [m for _, m in out if isinstance(m, M.Read)]
    assert demand and not any(m.prefetch for m in demand)
    after = []
    for m in demand:
        after += router.loaded(M.Loaded(slot=m.slot, generation=m.generation, layer=m.layer,
                                        expert=m.expert, read_us=1, nbytes=10))
    pf = [m for _, m in after if isinstance(m, M.Read)]
    assert pf and all(m.prefetch for m in pf)
    for _, m in after:
        if isinstance(m, M.Fill):
            router.filled(M.Filled(staging=m.staging, generation=m.generation))
    missed = [e for e in range(8) if e not in {m.expert for m in pf}][:1]
    nxt = [m for _, m in router.need(2, 1, missed) if isinstance(m, M.Read)]
    assert len(nxt) == 1 and not nxt[0].prefetch
    pool = _pool(store, 6)
    loader = Loader(store, memoryview(pool), store.max_record_bytes)
    q = ReadQueue()
    layer = store.moe_layers[0]  # the store's own layer ids; the slots and kinds are the router's
    for m in pf + nxt:
        q.put(loader.job(M.Read(slot=m.slot, generation=m.generation, layer=layer, expert=m.expert,
                                prefetch=m.prefetch)))
    first, _ = q.get(timeout=0.1)
    assert first.order.slot == nxt[0].slot and not first.order.prefetch
    q.close()
    loader.close()
