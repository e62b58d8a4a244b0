"""compute's resident expert tier: the experts it computes with, in MLX memory it owns.

Per group of layers sharing a record layout (runtime/tiers.py), one MLX array per record tensor
holds every resident slot, [n_slots, ...] (packed weights as stored, float tensors in compute's
dtype). `mx.gather_qmm` runs on these pools directly with slot numbers as `rhs_indices`, so
nothing is stacked or copied per use; a slot is written once per load (`fill`), from the
shared-memory staging slot the loader read into. `pool[s] = new` reuses the pool's buffer (MLX
donates it) when nothing still pending reads the pool: fills happen while compute waits for a
need, after the gate's read-back evaluated every earlier use, so a fill copies one expert, not the
pool (measured, tests/test_resident.py).

compute is the only writer of its residency map (`slot_of`): it applies every fill itself, in its
own thread, so the map and the pools never disagree, and a hit needs no question to the router.
"""
from __future__ import annotations

import threading
import time

import mlx.core as mx
import numpy as np

from deltafin.runtime.models.switch import pool_dtype
from deltafin.runtime.store import Store, views_from_buffer
from deltafin.runtime.tiers import layer_groups, layout_of


def probe_host_writes() -> dict:
    """Can this process write an MLX array's memory from the host and have the device see it?
    The MLX CPU backend: host memory. MLX CUDA: its arrays are managed memory, addressable from
    the host (measured on an H200: a 4.9 MB fill 3.4 -> 2.4 ms, the device's page migration
    instead of a copy into a new array and a device-side update). {"host_writes": bool, "why": str}."""
    a = mx.zeros((2, 1024), dtype=mx.uint32)
    mx.eval(a)
    try:
        view = np.frombuffer(memoryview(a), dtype=np.uint32).reshape(2, 1024)
        view[1, :] = 7
    except (TypeError, ValueError, BufferError) as e:
        return {"host_writes": False, "why": f"no writable host view of an MLX array: {e}"}
    seen = int(mx.sum(a[1]).item())
    del view
    if seen != 7 * 1024:
        return {"host_writes": False, "why": "the device did not see a host write"}
    return {"host_writes": True, "why": f"{mx.default_device()} sees host writes to its arrays"}


_CU_ADVISE_PREFERRED_LOCATION, _CU_ADVISE_ACCESSED_BY, _CU_DEVICE_CPU = 3, 5, -1
_CU_STREAM_NON_BLOCKING = 1
_driver: list = []  # [(libcuda, device, primary context)] once opened, [None] where there is none


def _cuda_driver():
    """(libcuda, device ordinal 0, its primary context) through ctypes, the primary context (the
    one MLX's runtime calls use) made current in this thread; None where the driver is not there."""
    if not _driver:
        import ctypes
        try:
            cu = ctypes.CDLL("libcuda.so.1")
            dev, ctx = ctypes.c_int(), ctypes.c_void_p()
            ok = (cu.cuInit(0) == 0 and cu.cuDeviceGet(ctypes.byref(dev), 0) == 0
                  and cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0
                  and cu.cuCtxSetCurrent(ctx) == 0)
            cu.cuMemAdvise.argtypes = [ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
            cu.cuMemPrefetchAsync.argtypes = [ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
            cu.cuMemcpyHtoDAsync_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
            cu.cuStreamSynchronize.argtypes = [ctypes.c_void_p]
            cu.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
            cu.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
            cu.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
            _driver.append((cu, dev.value, ctx) if ok else None)
        except (OSError, AttributeError):
            _driver.append(None)
    return _driver[0]


def is_metal() -> bool:
    metal = getattr(mx, "metal", None)
    return bool(metal is not None and metal.is_available())


def _address(a) -> int:
    """Where an MLX array's memory starts (MLX CUDA: its managed memory's address, the same on
    the host and the device; taking it touches no page)."""
    return np.frombuffer(memoryview(a), dtype=np.uint8).ctypes.data


def place_on_host(arrays: list) -> dict:
    """MLX CUDA keeps arrays in managed memory, whose pages migrate to wherever they were last
    touched: a fill written from the host pulls a pool's pages to the host, and the next kernel
    reading them faults them back to the GPU. Advised to live in host memory with the GPU mapping
    them (cuMemAdvise: preferred location the CPU, accessed by the GPU), a host write never
    faults and the GPU reads the resident experts over the bus instead of migrating pages.
    Measured on the lent H200 (docs/BENCHMARKS.md): a token of 26 layers x 6 experts 68 -> 25 ms
    and 100 fills 257 -> 191 ms. Only where experts stream: a tier holding every expert reads
    them faster from device memory. {"placed": bool, "why": str}."""
    if mx.default_device() != mx.gpu or is_metal():
        return {"placed": False, "why": f"{mx.default_device()}: not MLX CUDA (nothing to place)"}
    drv = _cuda_driver()
    if drv is None:
        return {"placed": False, "why": "the CUDA driver (libcuda.so.1) could not be opened"}
    cu, dev, _ = drv
    for a in arrays:
        ptr = _address(a)
        for advice, where in ((_CU_ADVISE_PREFERRED_LOCATION, _CU_DEVICE_CPU), (_CU_ADVISE_ACCESSED_BY, dev)):
            r = cu.cuMemAdvise(ptr, a.nbytes, advice, where)
            if r != 0:
                return {"placed": False, "why": f"cuMemAdvise refused (CUresult {r})"}
    return {"placed": True, "where": "host", "why": "pools in host memory, mapped for the GPU (cuMemAdvise)"}


class DriverCopies:
    """Pools in device memory, filled by the CUDA driver's copies (MLX CUDA). MLX's managed pools
    are advised to live in device memory (preferred location the GPU, prefetched there), so the
    GPU reads resident experts from its own memory instead of over the bus, and a fill is a copy
    by the driver from the record's bytes into the slot's rows, on a stream of its own, waited for
    before the fill returns: as a host write, it is done when `fill` returns and touches nothing
    but its slot (the caller settles the graphs that may read it first, as for host writes), and
    no host access ever pulls the pools' pages back. The staging segment the records come from
    is pinned (`pin`, cuMemHostRegister) so the copies go straight from it by DMA. Measured on the
    lent H100 and H200 (docs/BENCHMARKS.md, docs/probes/pool_place.py): 8 layers x 4 experts of
    the issue-28 store per token 0.94-1.10 ms against 1.83-1.97 ms from host memory (DeepSeek-V2-
    Lite-sized experts 0.65 against 3.42 ms), a fill 0.14-0.18 ms from the pinned buffer against
    0.52-2.29 ms written with numpy into host memory."""

    def __init__(self, drv):
        import ctypes
        self.cu, self.dev, self.ctx = drv
        self.stream = ctypes.c_void_p()
        self._current()
        if self.cu.cuStreamCreate(ctypes.byref(self.stream), _CU_STREAM_NON_BLOCKING) != 0:
            raise OSError("cuStreamCreate refused")
        self.pinned: np.ndarray | None = None  # the registered staging's bytes, kept mapped while registered
        self.pin_error: int | None = None  # the CUresult of a refused registration
        self.keep: list = []  # converted sources until their copies are done
        self.queued = 0  # copies queued since the last wait
        self._thread = threading.get_ident()  # where the context was made current last

    @classmethod
    def open(cls) -> "DriverCopies | None":
        """The driver's copies on MLX CUDA; None elsewhere, or where the driver does not open."""
        if mx.default_device() != mx.gpu or is_metal():
            return None
        drv = _cuda_driver()
        try:
            return cls(drv) if drv is not None else None
        except OSError:
            return None

    def _current(self) -> None:
        # the primary context current in the calling thread (fills run in compute's thread, the
        # tier is made where the pool is attached)
        if self.cu.cuCtxSetCurrent(self.ctx) != 0:
            raise OSError("cuCtxSetCurrent refused")
        self._thread = threading.get_ident()

    def place(self, arrays: list) -> dict:
        """Advises the arrays' memory to live on the device and moves it there now."""
        self._current()
        for a in arrays:
            ptr = _address(a)
            r = self.cu.cuMemAdvise(ptr, a.nbytes, _CU_ADVISE_PREFERRED_LOCATION, self.dev)
            if r == 0:
                r = self.cu.cuMemPrefetchAsync(ptr, a.nbytes, self.dev, self.stream)
            if r != 0:
                return {"placed": False, "why": f"cuMemAdvise / cuMemPrefetchAsync refused (CUresult {r})"}
        self.wait()
        return {"placed": True, "where": "device", "why": "pools in device memory, filled by the driver's copies"}

    def pin(self, buf) -> bool:
        """Registers the staging segment's memory with the driver (page-locked), so the copies
        from it need no bounce buffer; the one registered before is let go. The buffer is held
        while registered: memory unmapped under a registration (an in-process staging pool let
        go without `unpin`) left the driver's stale pages at that address, and the next buffer
        mapped there was refused registration and copied from them (other experts, other
        logits: docs/probes/ahead_race.py on an H100). False where refused (`pin_error` says
        why; the copies still work, from pageable memory)."""
        view = np.frombuffer(buf, dtype=np.uint8)
        if self.pinned is not None and (self.pinned.ctypes.data, self.pinned.nbytes) == (view.ctypes.data, view.nbytes):
            return True
        self.unpin()
        self._current()
        r = self.cu.cuMemHostRegister_v2(view.ctypes.data, view.nbytes, 0) if view.nbytes else None
        if r == 0:
            self.pinned = view
        self.pin_error = None if r == 0 else r
        return self.pinned is not None

    def unpin(self) -> None:
        """Lets the staging segment go (before it is unmapped), its copies done first."""
        if self.pinned is not None:
            self._current()
            if self.queued:
                self.wait()
            self.cu.cuMemHostUnregister(self.pinned.ctypes.data)
            self.pinned = None

    def __del__(self):
        # a tier let go without detach (in-process use): the registration ends before the
        # buffer it holds can be unmapped
        try:
            self.unpin()
        except Exception:
            pass

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        """Queues a copy of nbytes from host address src (the pinned staging) to device address
        dst: a tensor stored as the pool holds it, its addresses worked out by the caller (no
        numpy view or conversion per tensor: a record is 9 such copies)."""
        if threading.get_ident() != self._thread:
            self._current()
        r = self.cu.cuMemcpyHtoDAsync_v2(dst, src, nbytes, self.stream)
        if r != 0:
            raise OSError(f"cuMemcpyHtoDAsync refused (CUresult {r})")
        self.queued += 1

    def write(self, dst: np.ndarray, src: np.ndarray, how: str) -> None:
        """Queues the copy of one tensor's record bytes into a slot's row (dst: that row of the
        pool's bytes, never touched on the host)."""
        if how != "bytes":  # bf16 -> f32: the shift on the host
            src = np.left_shift(src, 16, dtype=np.uint32)
        src = np.ascontiguousarray(src)
        self.keep.append(src)  # a converted source lives until its copy is done
        if src.nbytes != dst.nbytes:
            raise ValueError(f"a record's tensor of {src.nbytes} bytes for a slot row of {dst.nbytes}")
        self.copy(dst.ctypes.data, src.ctypes.data, dst.nbytes)

    def wait(self) -> None:
        """Waits for the copies queued (one record's; with `ResidentTier.defer_copies`, those of
        the fills about to be acknowledged)."""
        if threading.get_ident() != self._thread:
            self._current()
        r = self.cu.cuStreamSynchronize(self.stream)
        self.keep.clear()
        self.queued = 0
        if r != 0:
            raise OSError(f"cuStreamSynchronize refused (CUresult {r})")


def host_write(stored: str, held) -> str | None:
    """How a stored tensor can be written straight into a pool's host memory: "bytes" (same
    encoding), "bf16>f32" (bfloat16 is the upper half of a float32: a shift, exact), or None (a
    conversion numpy cannot do exactly: the pool is written through MLX)."""
    if getattr(mx, stored) == held:  # the same encoding (packed codes, uint8 scales, floats)
        return "bytes"
    if stored == "bfloat16" and held == mx.float32:
        return "bf16>f32"
    return None


class ResidentTier:
    """Pools of resident experts per group, and which (layer, expert) each slot holds.

    host_writes (default: where `probe_host_writes` finds the pools' memory writable from the
    host: the CPU backend, and MLX CUDA's managed memory): a fill writes a record's tensors
    straight into the pools' memory with numpy, one copy out of shared memory and no MLX graph,
    instead of a copy into a new MLX array and a second one into the pool when the next graph
    runs. The caller must have evaluated every pending graph
    that reads the pools before a fill (`SlotExperts.apply` does: MLX graphs are lazy, and an
    unevaluated one would read the new contents). The pools are then never replaced, so their
    numpy views stay valid. on_host: the pools are placed in host memory where the backend
    offers it (`place_on_host`: MLX CUDA): True every group's, "streaming" those of the groups
    with fewer slots than experts (a group held whole, such as whole layers, is read faster from
    device memory and is written only while it is preloaded). copies: those same groups' pools
    in device memory instead, filled by the driver's copies (`DriverCopies`; MLX CUDA only, where
    the driver opens; otherwise on_host as asked)."""

    def __init__(self, store: Store, dtype, slots: dict[str, int], host_writes: bool | None = None,
                 on_host: bool | str = False, copies: bool = False):
        self.store, self.dtype = store, dtype
        self.group_of = layer_groups(store, slots)
        missing = set(self.group_of.values()) - set(slots)
        if missing:
            raise ValueError(f"no resident slots for record layout(s) {sorted(missing)}")
        self.n_slots = {g: int(n) for g, n in slots.items() if g in set(self.group_of.values())}
        self.layouts = {g: store.layouts[layout_of(g)] for g in self.n_slots}
        self.pools: dict[str, dict[str, mx.array]] = {}
        for g, n in self.n_slots.items():
            self.pools[g] = {t["name"]: mx.zeros((n, *t["shape"]), dtype=self._dtype(t))
                             for t in self.layouts[g]["tensors"]}
            mx.eval(list(self.pools[g].values()))  # committed now, so the budget's measurement sees it
        if host_writes is None:
            host_writes = probe_host_writes()["host_writes"]
        # group -> tensor name -> (how, the pool's memory as bytes [n_slots, slot bytes])
        self.host: dict[str, dict[str, tuple]] = {g: {} for g in self.n_slots}
        if host_writes:
            for g, layout in self.layouts.items():
                for t in layout["tensors"]:
                    how = host_write(t["dtype"], self.pools[g][t["name"]].dtype)
                    if how is not None:
                        pool = self.pools[g][t["name"]]
                        raw = np.frombuffer(memoryview(pool), dtype=np.uint8).reshape(pool.shape[0], -1)
                        self.host[g][t["name"]] = (how, raw)
        self.group_experts = {g: store.n_experts * list(self.group_of.values()).count(g) for g in self.n_slots}
        # on_host: where fills write in place and experts stream, the pools live in host memory
        # (place_on_host; MLX CUDA only, a no-op elsewhere)
        hosted = [g for g in self.n_slots if on_host is True or
                  (on_host == "streaming" and self.streams(g))]
        self.placement = {"placed": False, "why": "not asked"}
        self.copies: DriverCopies | None = None  # where the driver fills the pools (`copied` groups)
        self.copied: set[str] = set()
        arrays = [a for g in hosted for a in self.pools[g].values()]
        if hosted and host_writes and copies:
            self.copies = DriverCopies.open()  # None where not MLX CUDA or no driver
            if self.copies is not None:
                self.placement = self.copies.place(arrays)
                if self.placement["placed"]:
                    self.copied = set(hosted)
                else:
                    self.copies = None
        if hosted and host_writes and self.copies is None:
            self.placement = place_on_host(arrays)
        # tensor name -> (its pool's address, a slot's bytes, the tensor's offset in a record) of
        # those a fill writes as stored (`copy_plan`)
        self.rows: dict[str, dict[str, tuple]] = {g: {} for g in self.n_slots}
        for g in self.n_slots:
            for t in self.layouts[g]["tensors"]:
                how, raw = self.host[g].get(t["name"], (None, None))
                if how == "bytes":
                    if t["nbytes"] != raw.shape[1]:
                        raise ValueError(f"{t['name']}: {t['nbytes']} bytes stored for a slot row of {raw.shape[1]}")
                    self.rows[g][t["name"]] = (raw.ctypes.data, raw.shape[1], t["offset"])
        if self.placement["placed"]:
            self.placement["groups"] = hosted
        # read by the metrics thread too: a plain int, not the MLX arrays
        self.nbytes = sum(a.nbytes for pools in self.pools.values() for a in pools.values())
        self.held: dict[str, list] = {g: [None] * n for g, n in self.n_slots.items()}
        # the layer whose expert each slot held last (kept when the slot is emptied): the graphs
        # that may still read a slot are that layer's
        self.last_layer: dict[str, list] = {g: [None] * n for g, n in self.n_slots.items()}
        self.slot_of = {layer: np.full(store.n_experts, -1, dtype=np.int64) for layer in self.group_of}
        self.count = dict.fromkeys(self.group_of, 0)
        self.n_full = 0  # layers with every expert resident (all_full asks once per layer)
        self._tables: dict[int, tuple] = {}  # layer -> (expert->slot on the device, the map it was made from)
        self._in_order: dict[int, dict[str, mx.array]] = {}  # layer -> its pools' rows in expert order
        self.fills = 0
        self.fill_bytes = 0
        self.fill_s = 0.0
        self.pending_writes = 0  # fills written through MLX that no graph has evaluated yet
        # bench.batch_copies: a fill's copies addressed straight from `rows` (no numpy per
        # tensor) and left queued when `fill` returns: the caller waits for them (`settle_copies`)
        # before the record's staging slot is given back and before any graph reads the pools
        # (SlotExperts.attach: at the acknowledgement)
        self.defer_copies = False
        # bench.device_waits: told of each expert dropped, before anything is written into its slot
        # (the device's table marks it missing at once; workers/device_waits.py)
        self.on_drop = None
        self.changes = 0  # fills and drops so far (what the residency map was published at, device_waits)

    def streams(self, g: str) -> bool:
        """Whether group g has fewer resident slots than experts (its experts come and go)."""
        return self.n_slots[g] < self.group_experts[g]

    def _dtype(self, t: dict):
        return pool_dtype(t["dtype"], self.dtype)

    def quant(self, layer: int) -> dict:
        return self.layouts[self.group_of[layer]]["quant"]

    def weights(self, layer: int) -> dict:
        """The pools of the layer's group: {tensor name: [n_slots, ...]} for gather_qmm."""
        return self.pools[self.group_of[layer]]

    def full(self, layer: int) -> bool:
        """Every expert of the layer is resident: its routing needs no look on the CPU."""
        return self.count[layer] == self.store.n_experts

    def all_full(self) -> bool:
        return self.n_full == len(self.group_of)

    def missing(self, layer: int, experts) -> list[int]:
        where = self.slot_of[layer]
        return [int(e) for e in experts if where[e] < 0]

    def slots(self, layer: int, ids: np.ndarray) -> np.ndarray:
        """Resident slot of each expert id (all must be resident)."""
        return self.slot_of[layer][ids]

    def device_table(self, layer: int) -> mx.array:
        """expert -> slot of a full layer as a device array, so the gate's ids index it in the
        graph without coming back to the CPU."""
        return self.ahead_table(layer)[0]

    def ahead_table(self, layer: int) -> tuple[mx.array, np.ndarray]:
        """expert -> slot of the layer as a device array, a missing expert at slot 0 (where a layer
        not all resident runs ahead, its rows are computed on whatever slot 0 holds and never
        kept), and the residency map it was made from (-1: missing), to check a layer's routing
        against once read back (SlotExperts._run_ahead). Rebuilt after the layer's residency
        changes."""
        made = self._tables.get(layer)
        if made is None:
            where = self.slot_of[layer].copy()
            made = self._tables[layer] = (mx.array(np.maximum(where, 0).astype(np.uint32)), where)
        return made

    def expert_weights(self, layer: int) -> dict[str, mx.array] | None:
        """{tensor name: [n_experts, ...]} of a layer whose rows in its group's pools are in expert
        order, so the gate's ids index them as they are, as mlx-lm indexes its stacked experts:
        no expert->slot gather per layer and token. Views sharing the pools' memory (a contiguous
        slice is not copied), made when the whole group became resident (nothing of it can be
        evicted then, so no fill needs the pools' buffers alone). None otherwise."""
        return self._in_order.get(layer)

    def _arrange(self, g: str) -> list:
        """Views in expert order of each layer of group g, where all of g is resident and the
        layer's slots are consecutive in expert order (as a preload fills them). Returns them,
        still to evaluate."""
        layers = [layer for layer, gg in self.group_of.items() if gg == g]
        if not all(self.full(layer) for layer in layers):
            return []
        made, n = [], self.store.n_experts
        for layer in layers:
            where = self.slot_of[layer]
            if (where == where[0] + np.arange(n)).all():
                a = int(where[0])
                self._in_order[layer] = {k: pool[a:a + n] for k, pool in self.pools[g].items()}
                made.extend(self._in_order[layer].values())
        return made

    def _unarrange(self, g: str) -> None:
        """Drops group g's views before its pools change: a pool another array still shares
        cannot be updated in place (MLX would copy all of it for one slot)."""
        for layer in [layer for layer in self._in_order if self.group_of[layer] == g]:
            del self._in_order[layer]

    def fill(self, layer: int, expert: int, slot: int, record) -> None:
        """Copies one record (bytes of the staging slot) into resident slot `slot` of the layer's
        group. The copy out of shared memory happens here (mx.array copies at once), so the
        staging slot can be reused as soon as this returns; the writes into the pools are left
        to the next graph that reads them (no evaluation, no device sync per fill: on the H200 a
        fill took ~2 ms, most of it waiting for the device). They still donate the pools' buffers,
        as nothing else holds a pool between a fill and that graph. Tensors in `host` (the CPU
        backend) are instead written into the pools' memory here, at once."""
        t0 = time.perf_counter()
        g = self.group_of[layer]
        self.drop(layer, slot)  # drops the group's views first
        moved = self.slot_of[layer][expert]
        if moved >= 0:  # the router read it again into another slot: the old one is free now
            self.drop(layer, int(moved))
        layout = self.layouts[g]
        pools = self.pools[g]
        host = self.host[g]
        copies = self.copies if g in self.copied else None
        done = ()
        if copies is not None and self.defer_copies:  # by the driver, straight from the addresses
            for dst, src, n in self.copy_plan(g, slot, record):
                copies.copy(dst, src, n)
            done = self.rows[g]
        # numpy views of what is left (none where the driver copied it all; a short record fails here)
        views = views_from_buffer(record, layout) if len(done) < len(layout["tensors"]) else None
        for t in layout["tensors"]:
            if t["name"] in done:
                continue
            if t["name"] in host:  # straight into the pool's memory: the one copy
                how, raw = host[t["name"]]
                src = views[t["name"]].reshape(-1)
                if copies is not None:  # by the driver (widened on the host first)
                    copies.write(raw[slot], src.view(np.uint8) if how == "bytes" else src, how)
                elif how == "bytes":
                    np.copyto(raw[slot], src.view(np.uint8))
                else:
                    np.left_shift(src, 16, out=raw[slot].view(np.uint32), dtype=np.uint32)
                continue
            a = mx.array(views[t["name"]])  # the one copy out of shared memory
            if t["dtype"] == "bfloat16":
                a = a.view(mx.bfloat16)
            if a.dtype != pools[t["name"]].dtype:
                a = a.astype(pools[t["name"]].dtype)
            pools[t["name"]][slot] = a  # MLX reuses the pool's buffer: no pending reader holds it
            self.pending_writes += 1
        if copies is not None and not self.defer_copies:
            copies.wait()
        self.held[g][slot] = (layer, expert)
        self.last_layer[g][slot] = layer
        self.slot_of[layer][expert] = slot
        self.changes += 1
        self.count[layer] += 1
        self.n_full += self.full(layer)
        self._tables.pop(layer, None)
        self._arrange(g)
        self.fills += 1
        self.fill_bytes += layout["nbytes"]
        self.fill_s += time.perf_counter() - t0

    def copy_plan(self, g: str, slot: int, record) -> list[tuple[int, int, int]]:
        """(destination, source, bytes) of each tensor of a record (a buffer in memory that stays
        put: the staging segment) that group g's pools hold as stored, for slot `slot`: the copies
        a fill queues with `DriverCopies.copy` (bench.batch_copies)."""
        buf = np.frombuffer(record, dtype=np.uint8)
        if buf.nbytes < self.layouts[g]["nbytes"]:
            raise ValueError(f"a record of {buf.nbytes} bytes for a layout of {self.layouts[g]['nbytes']}")
        base = buf.ctypes.data
        return [(pool + slot * row, base + offset, row) for pool, row, offset in self.rows[g].values()]

    def settle_copies(self) -> None:
        """Waits for the driver's copies that fills left queued (`defer_copies`)."""
        if self.copies is not None and self.copies.queued:
            t0 = time.perf_counter()
            self.copies.wait()
            self.fill_s += time.perf_counter() - t0

    def settle_writes(self) -> None:
        """Evaluates the fills written through MLX where no graph will read the pools soon (the
        stand-in computes nothing; a preload fills many layers while idle): otherwise each write
        stays pending, holding its record's copy, and they pile up (the stand-in's compute was
        killed by the memory cap). One evaluation per need, not per fill."""
        if self.pending_writes:
            mx.eval([a for pools in self.pools.values() for a in pools.values()])
            self.pending_writes = 0

    def drop(self, layer: int, slot: int) -> None:
        """Forgets what slot `slot` of the layer's group holds (evicted, or its read failed)."""
        g = self.group_of[layer]
        self._unarrange(g)
        old = self.held[g][slot]
        if old is not None:
            self.held[g][slot] = None
            self.slot_of[old[0]][old[1]] = -1
            self.changes += 1
            if self.on_drop is not None:
                self.on_drop(*old)
            self.n_full -= self.full(old[0])
            self.count[old[0]] -= 1
            self._tables.pop(old[0], None)

    def holds(self, layer: int, expert: int, slot: int) -> bool:
        return self.held[self.group_of[layer]][slot] == (layer, expert)
