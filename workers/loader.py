"""The loader: direct reads of expert records into shared-memory slots. It never decides what to read.

`Loader.read` is the whole job for one order (plain, testable in-process); the process wrapper
keeps `threads` reads in flight (preadv releases the GIL) and announces each filled slot to the
router with the order's generation.
"""
from __future__ import annotations

import threading
import time

from deltafin.protocol import messages as M
from deltafin.runtime.directio import DirectFile
from deltafin.runtime.metrics import Counter, Latency
from deltafin.runtime.store import Store, StoreError


class Loader:
    def __init__(self, store: Store, pool_buf: memoryview, slot_bytes: int, verify: bool = True):
        self.store, self.pool, self.slot_bytes, self.verify = store, pool_buf, slot_bytes, verify
        self._files: dict[str, DirectFile] = {}
        self._lock = threading.Lock()
        self.counters = Counter()
        self.read_latency = Latency()
        self.busy_s = 0.0

    def _file(self, name: str) -> DirectFile:
        with self._lock:
            f = self._files.get(name)
            if f is None:
                f = self._files[name] = DirectFile(self.store.path / name)
            return f

    def read(self, order: M.Read) -> M.Loaded | M.LoadFailed:
        t0 = time.perf_counter()
        try:
            rec = self.store.record(order.layer, order.expert)
            if rec.read_nbytes > self.slot_bytes:
                raise StoreError(f"record of {rec.read_nbytes} bytes exceeds the slot size")
            start = order.slot * self.slot_bytes
            slot = self.pool[start:start + self.slot_bytes]
            f = self._file(rec.file)
            files = {rec.file: f}
            self.store.read_record(rec, slot, files=files, verify=self.verify)
        except (StoreError, OSError, KeyError) as e:
            self.counters.add("failures")
            return M.LoadFailed(slot=order.slot, generation=order.generation, layer=order.layer,
                                expert=order.expert, error=f"loader: {e}")
        dt = time.perf_counter() - t0
        with self._lock:
            self.read_latency.add(dt)
            self.counters.add("reads")
            self.counters.add("bytes", rec.nbytes)
            self.busy_s += dt
        return M.Loaded(slot=order.slot, generation=order.generation, layer=order.layer,
                        expert=order.expert, read_us=int(dt * 1e6), nbytes=rec.nbytes)

    def stats(self) -> dict:
        c = self.counters.snapshot()
        return {**c, "read": self.read_latency.summary(),
                "direct_io": all(f.direct for f in self._files.values()) if self._files else None,
                "ssd_gbps": (c.get("bytes", 0) / self.busy_s / 1e9) if self.busy_s else None}

    def close(self) -> None:
        for f in self._files.values():
            f.close()


def run_loader_process(run_dir: str) -> None:
    import queue

    import zmq

    from deltafin.runtime.sockets import make_socket, recv
    from deltafin.workers.common import WorkerProcess

    class LoaderProcess(WorkerProcess):
        role = "loader"

        def setup(self):
            self.store = Store(self.run["store"])
            self.data = self.connect_data_plane()
            self.poller.register(self.data, zmq.POLLIN)
            # Finished reads come back through an inproc socket so only this thread sends.
            self.done_pull = make_socket(self.ctx, zmq.PULL)
            self.done_pull.bind("inproc://loader-done")
            self.poller.register(self.done_pull, zmq.POLLIN)
            self.orders: queue.Queue = queue.Queue()
            self.loader: Loader | None = None
            self.threads: list[threading.Thread] = []

        def on_pool(self, msg):
            self.loader = Loader(self.store, self.pool.buf, msg.slot_bytes,
                                 verify=self.config["loader"]["verify_checksums"])
            for _ in range(self.config["loader"]["threads"]):
                t = threading.Thread(target=self.read_loop, daemon=True)
                t.start()
                self.threads.append(t)

        def read_loop(self):
            push = make_socket(self.ctx, zmq.PUSH)
            push.connect("inproc://loader-done")
            try:
                while True:
                    order = self.orders.get()
                    if order is None:
                        return
                    push.send(M.encode(self.loader.read(order)))
            finally:
                push.close(0)

        def on_socket(self, sock):
            if sock is self.data:
                msg = recv(self.data)
                if isinstance(msg, M.Read):
                    self.orders.put(msg)
            else:
                self.data.send(self.done_pull.recv())

        def stats(self):
            return {**(self.loader.stats() if self.loader else {}), "queued": self.orders.qsize()}

        def teardown(self):
            for _ in self.threads:
                self.orders.put(None)
            for t in self.threads:
                t.join(timeout=5)
            if self.loader:
                self.loader.close()

    LoaderProcess(run_dir).serve()


if __name__ == "__main__":
    import sys
    run_loader_process(sys.argv[1])
