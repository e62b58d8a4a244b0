"""The loader: direct reads of expert records into shared-memory slots. It never decides what to read.

Demand reads go before prefetch reads: `ReadQueue` hands out every queued demand read before any
prefetch read (`Read.prefetch`), first come first served within each class.

With `chunk_bytes` > 0 (bench.chunk_bytes) a record is split into block-aligned pieces that all `threads` read at
once, and its CRC-32 advances chunk by chunk as they land (in file order, by whichever thread
finished the next one), so a record is done shortly after its last byte arrives. Measured on the
development machine (docs/benchmarks-history.md, Speed II second pass): its ~1 GB/s virtual disk gives
the same bandwidth at queue depth 1 as at 8; 1 MiB chunks halve a record's read time but slow
compute's copies out of staging more, so chunk_bytes is 0 by default (demand reads alone go in
pieces, below).

With `demand_pieces` > 1 (bench.demand_pieces, 4 by default) and no `chunk_bytes`, a demand read
(a miss compute waits for) is split into that many pieces (none under MIN_PIECE), read by the
threads at once, and prefetch and lease reads, whole, yield the disk to it: `ReadQueue` starts none
while a demand read is in flight. A miss's wait is its read: on the H200 (issue 28's store, 25%) a
demand read's p50 fell from 2.8-3.7 to 1.4-1.9 ms and tokens per second rose 1.07x over 6 pairs.

With `ahead_piece_bytes` > 0 (bench.ahead_piece_bytes) prefetch and lease reads are read in pieces
of that size, yielding as above, so a miss's read shares the disk only with the pieces already
started.

`Loader.read` is the whole job for one order in the calling thread (plain, testable in-process);
the process wrapper keeps `threads` reads in flight (preadv and the CRC release the GIL) and
announces each filled slot to the router with the order's generation.
"""
from __future__ import annotations

import threading
import time
from collections import deque

import zmq

from deltafin.protocol import messages as M
from deltafin.runtime.directio import BLOCK, DirectFile, round_up
from deltafin.runtime import metrics
from deltafin.runtime.metrics import Counter, Latency
from deltafin.runtime.sockets import make_socket, recv
from deltafin.runtime.store import Store, StoreError, checksum_error, crc32, truncated_error
from deltafin.workers.common import WorkerProcess

# a demand read's smallest piece (the H200's disk: 256 KiB reads at depth 4 kept 94% of whole records' rate)
MIN_PIECE = 256 << 10


class ReadJob:
    """One order being read as chunks, possibly by several threads at once.

    Each chunk's thread calls `chunk_done`; the checksum advances over the chunks in file order
    (one thread at a time, outside the lock, so reads of later chunks overlap it). The thread whose
    call completes the job (every chunk read and checked, or every chunk accounted for after an
    error) gets True and sends the answer; every other call gets False."""

    def __init__(self, order: M.Read, rec, slot: memoryview, file: DirectFile, chunk_bytes: int,
                 verify: bool):
        self.order, self.rec, self.slot, self.file, self.verify = order, rec, slot, file, verify
        step = round_up(chunk_bytes, BLOCK) if chunk_bytes > 0 else round_up(rec.nbytes, BLOCK)
        self.chunks = [(o, min(step, rec.nbytes - o)) for o in range(0, max(rec.nbytes, 1), step)]
        self.done = [False] * len(self.chunks)
        self.error: str | None = None
        self.crc, self.crc_next, self.crc_busy, self.reported = 0, 0, False, False
        self.t_queued = time.perf_counter()
        self.t_start: float | None = None
        self._lock = threading.Lock()

    def read_chunk(self, i: int) -> bool:
        """Reads chunk i (unless the job already failed); True if this call completed the job."""
        with self._lock:
            if self.t_start is None:
                self.t_start = time.perf_counter()
            failed = self.error is not None
        error = None
        if not failed:
            off, n = self.chunks[i]
            try:
                got = self.file.read_into(self.slot[off:off + round_up(n, BLOCK)], self.rec.offset + off, n)
                if got < n:
                    error = str(truncated_error(self.rec, off + got))
            except OSError as e:
                error = f"{self.rec.file}: {e}"
        return self._chunk_done(i, error)

    def _chunk_done(self, i: int, error: str | None) -> bool:
        with self._lock:
            self.done[i] = True
            if error and self.error is None:
                self.error = error
            if self.crc_busy:  # the thread checking the checksum takes this chunk too
                return False
            self.crc_busy = True
        while True:
            with self._lock:
                n = len(self.chunks)
                if self.error is not None or self.crc_next == n:
                    self.crc_busy = False
                    if self.error is None and self.verify and f"{self.crc & 0xFFFFFFFF:08x}" != self.rec.checksum:
                        self.error = str(checksum_error(self.rec))
                    # a failed job ends only once no thread still writes into its slot
                    finished = not self.reported and all(self.done)
                    self.reported |= finished
                    return finished
                if not self.done[self.crc_next]:
                    self.crc_busy = False
                    return False
                off, m = self.chunks[self.crc_next]
            if self.verify:
                self.crc = crc32(self.slot[off:off + m], self.crc)
            with self._lock:
                self.crc_next += 1


class Loader:
    """Reads orders into the staging pool. `chunk_bytes`: the piece of a record one read takes
    (0: demand reads in `demand_pieces`, others whole); `ahead_piece_bytes`: the piece a prefetch
    or lease read takes instead (0: whole, or chunk_bytes). `yields`: ahead reads wait while a
    demand read is in flight (`ReadQueue.yield_ahead`)."""

    def __init__(self, store: Store, pool_buf: memoryview, slot_bytes: int, verify: bool = True,
                 chunk_bytes: int = 0, ahead_piece_bytes: int = 0, demand_pieces: int = 1):
        self.store, self.pool, self.slot_bytes, self.verify = store, pool_buf, slot_bytes, verify
        self.chunk_bytes, self.ahead_piece_bytes, self.demand_pieces = chunk_bytes, ahead_piece_bytes, demand_pieces
        self._files: dict[str, DirectFile] = {}
        self._lock = threading.Lock()
        self.counters = Counter()
        self.read_latency = Latency()     # first chunk started -> record read and checked
        self.queue_latency = Latency()    # order received -> its first chunk started
        self.demand_latency = Latency()   # read_latency of demand reads alone (not prefetch or lease)
        self.busy_s = 0.0                 # time with at least one read in flight (disk busy)
        self.depth_s = 0.0                # integral of reads in flight over time (mean queue depth)
        self._active, self._busy_since, self._first, self._changed = 0, 0.0, None, 0.0

    def _file(self, name: str) -> DirectFile:
        with self._lock:
            f = self._files.get(name)
            if f is None:
                f = self._files[name] = DirectFile(self.store.path / name)
            return f

    def job(self, order: M.Read) -> ReadJob | M.LoadFailed:
        """The order as chunks to read, or its failure (unknown record, record too large)."""
        try:
            rec = self.store.record(order.layer, order.expert)
            if rec.read_nbytes > self.slot_bytes:
                raise StoreError(f"record of {rec.read_nbytes} bytes exceeds the slot size")
            start = order.slot * self.slot_bytes
            f = self._file(rec.file)
        except (StoreError, OSError, KeyError) as e:
            return self._failed(order, f"loader: {e}")
        return ReadJob(order, rec, self.pool[start:start + self.slot_bytes], f, self.piece(order, rec.nbytes),
                       self.verify)

    @property
    def yields(self) -> bool:
        return self.ahead_piece_bytes > 0 or (self.demand_pieces > 1 and not self.chunk_bytes)

    def piece(self, order: M.Read, nbytes: int) -> int:
        """The bytes one read of this order's record takes (0: the record in one read)."""
        if order.prefetch and self.ahead_piece_bytes:
            return self.ahead_piece_bytes
        if self.chunk_bytes or order.prefetch or self.demand_pieces < 2:
            return self.chunk_bytes
        return max(-(-nbytes // self.demand_pieces), MIN_PIECE)

    def read_chunk(self, job: ReadJob, i: int) -> M.Loaded | M.LoadFailed | None:
        """Reads one chunk; the answer to send if that completed the job, else None."""
        t0 = time.perf_counter()
        with self._lock:
            if self._first is None:
                self._first = t0
            if self._active == 0:
                self._busy_since = t0
            self.depth_s += self._active * (t0 - self._changed)
            self._active, self._changed = self._active + 1, t0
        try:
            finished = job.read_chunk(i)
        finally:
            with self._lock:
                t1 = time.perf_counter()
                self.depth_s += self._active * (t1 - self._changed)
                self._active, self._changed = self._active - 1, t1
                self.counters.add("chunk_reads")
                if self._active == 0:
                    self.busy_s += t1 - self._busy_since
        return self._answer(job) if finished else None

    def _answer(self, job: ReadJob) -> M.Loaded | M.LoadFailed:
        order = job.order
        if job.error is not None:
            return self._failed(order, f"loader: {job.error}")
        now = time.perf_counter()
        with self._lock:
            self.read_latency.add(now - job.t_start)
            if not order.prefetch:
                self.demand_latency.add(now - job.t_start)
            self.queue_latency.add(job.t_start - job.t_queued)
            self.counters.add("reads")
            self.counters.add("prefetch_reads" if order.prefetch else "demand_reads")
            self.counters.add("bytes", job.rec.nbytes)
        return M.Loaded(slot=order.slot, generation=order.generation, layer=order.layer,
                        expert=order.expert, read_us=int((now - job.t_start) * 1e6), nbytes=job.rec.nbytes)

    def _failed(self, order: M.Read, error: str) -> M.LoadFailed:
        self.counters.add("failures")
        return M.LoadFailed(slot=order.slot, generation=order.generation, layer=order.layer,
                            expert=order.expert, error=error)

    def read(self, order: M.Read) -> M.Loaded | M.LoadFailed:
        """One order read whole in the calling thread, chunk after chunk."""
        job = self.job(order)
        if isinstance(job, M.LoadFailed):
            return job
        answer = None
        for i in range(len(job.chunks)):
            answer = self.read_chunk(job, i) or answer
        return answer

    def stats(self) -> dict:
        c = self.counters.snapshot()
        wall = (time.perf_counter() - self._first) if self._first is not None else 0.0
        return {**c, "read": self.read_latency.summary(), "queue_wait": self.queue_latency.summary(),
                "demand_read": self.demand_latency.summary(),
                "chunk_bytes": self.chunk_bytes, "ahead_piece_bytes": self.ahead_piece_bytes,
                "demand_pieces": self.demand_pieces,
                "direct_io": all(f.direct for f in self._files.values()) if self._files else None,
                # bytes over the time some read was in flight: the disk's rate while it was used
                "ssd_gbps": metrics.ssd_gbps(c.get("bytes", 0), self.busy_s),
                "disk_busy_s": self.busy_s,
                "disk_busy_share": (self.busy_s / wall) if wall else None,
                "mean_in_flight": (self.depth_s / self.busy_s) if self.busy_s else None}

    def close(self) -> None:
        for f in self._files.values():
            f.close()


class ReadQueue:
    """Reads (chunks; one per record when not chunked) waiting for a reader thread: all demand
    chunks before any prefetch chunk, in arrival order within each class (a record's chunks stay
    together, so it finishes as soon as it can). yield_ahead: no prefetch chunk is handed out while
    a demand chunk is being read (each taken chunk is given back with `done`)."""

    def __init__(self, yield_ahead: bool = False):
        self._demand: deque = deque()
        self._prefetch: deque = deque()
        self._cv = threading.Condition()
        self._closed = False
        self.yield_ahead = yield_ahead
        self._demand_reading = 0  # demand chunks handed out and not yet done

    def put(self, job: ReadJob) -> None:
        with self._cv:
            q = self._prefetch if job.order.prefetch else self._demand
            q.extend((job, i) for i in range(len(job.chunks)))
            self._cv.notify(len(job.chunks))

    def get(self, timeout: float) -> tuple[ReadJob, int] | None:
        """The next chunk; None when closed or nothing came within timeout."""
        with self._cv:
            if not self._closed and not self._ready():
                self._cv.wait(timeout)
            if self._closed or not self._ready():
                return None
            if self._demand:
                if self.yield_ahead:  # counted only where ahead chunks wait for it
                    self._demand_reading += 1
                return self._demand.popleft()
            return self._prefetch.popleft()

    def _ready(self) -> bool:
        """A chunk may be handed out now (the condition's lock held)."""
        return bool(self._demand) or (bool(self._prefetch) and not self._demand_reading)

    def done(self, job: ReadJob) -> None:
        """A chunk `get` handed out was read: once no demand chunk is being read, prefetch chunks
        go out again."""
        if job.order.prefetch or not self.yield_ahead:
            return
        with self._cv:
            self._demand_reading -= 1
            if not self._demand_reading:
                self._cv.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def __len__(self) -> int:
        with self._cv:
            return len(self._demand) + len(self._prefetch)


class LoaderProcess(WorkerProcess):
    """The loader's worker: read orders from the data plane go to `loader.threads` reader threads
    (`ReadQueue`); their answers come back through an inproc socket, so only this thread sends.
    One handler per socket (`on_socket`)."""

    role = "loader"

    def setup(self):
        self.store = Store(self.run["store"])
        self.data = self.connect_data_plane()
        self.poller.register(self.data, zmq.POLLIN)
        self.done_pull = make_socket(self.ctx, zmq.PULL)
        self.done_pull.bind("inproc://loader-done")
        self.poller.register(self.done_pull, zmq.POLLIN)
        self.orders = ReadQueue()
        self.loader: Loader | None = None
        self.threads: list[threading.Thread] = []
        self.handlers = {self.data: self.on_order, self.done_pull: self.on_done}

    def on_pool(self, msg):
        cfg = self.config.loader
        self.loader = Loader(self.store, self.pool.buf, msg.slot_bytes, verify=cfg.verify_checksums,
                             chunk_bytes=int(self.config.bench.chunk_bytes),
                             ahead_piece_bytes=self.config.bench.ahead_piece_bytes,
                             demand_pieces=min(self.config.bench.demand_pieces, cfg.threads))  # read at once
        self.orders.yield_ahead = self.loader.yields  # before any read is queued
        for _ in range(cfg.threads):
            t = threading.Thread(target=self.read_loop, daemon=True)
            t.start()
            self.threads.append(t)

    def read_loop(self):
        push = make_socket(self.ctx, zmq.PUSH)
        push.connect("inproc://loader-done")
        try:
            while not self.orders.closed:
                got = self.orders.get(timeout=1.0)
                if got is None:
                    continue
                try:
                    answer = self.loader.read_chunk(*got)
                finally:
                    self.orders.done(got[0])
                if answer is not None:
                    push.send(M.encode(answer))
        finally:
            push.close(0)

    def on_socket(self, sock):
        self.handlers[sock]()

    def on_order(self):
        """A read order from the router: queued for the readers (or refused at once)."""
        msg = recv(self.data)
        if not isinstance(msg, M.Read):
            return
        job = self.loader.job(msg)
        if isinstance(job, M.LoadFailed):
            self.data.send(M.encode(job))
        else:
            self.orders.put(job)

    def on_done(self):
        """A reader's answer (loaded, load_failed), passed on to the router as it is."""
        self.data.send(self.done_pull.recv())

    def stats(self):
        return {**(self.loader.stats() if self.loader else {}), "queued": len(self.orders)}

    def teardown(self):
        self.orders.close()
        for t in self.threads:
            t.join(timeout=5)
        if self.loader:
            self.loader.close()


if __name__ == "__main__":
    import sys
    LoaderProcess(sys.argv[1]).serve()
