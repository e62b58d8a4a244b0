"""A partially resident layer's experts looked up on the device, which waits for a missing one
(MLX CUDA; `bench.device_waits`).

A pass run ahead (`SlotExperts._run_ahead`) maps each layer's chosen experts to resident slots on
the device, with no read-back between layers. Without this, a missing expert's rows go to slot 0,
the miss is found when the pass's routing is read back at its end, and the layers after it are
built and computed again once the need's read has landed (issue 28: about 6.5 ms per such pass on
an H100). Here the map is a table in pinned host memory that the device reads as the pass runs: a
small kernel per layer looks its experts up and, where one is missing, posts the layer's experts
in the same page and waits (bounded by `limit_s`) until the host has made them resident and
written their slots. The host, waiting for the pass (`SlotExperts._drain`), sees the request,
sends the layer's need at once, applies its fills and publishes the table; the kernel goes on.
Nothing is computed twice, and the slots the device reads are the ones all-resident decoding
would use for those experts (`switch_glu` on the same pools): the same result, bit for bit.

The page (int32 words): REQ names the last request, pass number x 256 + layer (an index into the
tier's layers), written last; COUNT its expert count and IDS.. its experts (every expert the row
chose, so the need pins the resident ones as well); ERR names a request that timed out; DONE the
last pass whose end marker ran; TABLE.. the published expert -> slot map, -1 where missing.

Safety of the table. The device reads an entry when a layer's lookup runs; the host writes a slot
number only once that slot's copies are done (`publish`, after the driver's copies are waited for)
and marks an evicted expert -1 before anything is copied into its slot (`drop`). While a kernel
waits, every kernel before it in the stream has finished and none after it has started, so a fill
can write any slot not pinned by the need (the waiting layer's own experts are)."""
from __future__ import annotations

import ctypes
import mmap
import time

import mlx.core as mx
import numpy as np

REQ, ERR, DONE, COUNT, IDS, TABLE = 0, 1, 2, 3, 4, 64
MAX_K = TABLE - IDS  # the most experts a row may choose
SEQ_WRAP = 1 << 22  # pass numbers 1..SEQ_WRAP, so number x 256 + layer fits an int32

_HEADER = """
#define REQ {REQ}
#define ERR {ERR}
#define DONE {DONE}
#define COUNT {COUNT}
#define IDS {IDS}
#define TABLE {TABLE}
__device__ inline unsigned long long df_now() {{
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}}
"""

_LOOKUP = """
    if (threadIdx.x == 0) {
        volatile int* h = reinterpret_cast<volatile int*>(addr[0]);
        const int layer = meta[0], n_experts = meta[1], k = meta[2], seq = pass_no[0];
        const unsigned long long limit = (unsigned long long)meta[3] * 1000000ULL;
        const int base = TABLE + layer * n_experts;
        const unsigned long long t0 = df_now();
        int asked = 0;
        for (int i = 0; i < k; ++i) {
            int s = h[base + ids[i]];
            while (s < 0) {
                if (!asked) {
                    for (int j = 0; j < k; ++j) h[IDS + j] = ids[j];
                    h[COUNT] = k;
                    __threadfence_system();
                    h[REQ] = seq * 256 + layer;
                    __threadfence_system();
                    asked = 1;
                }
                if (df_now() - t0 > limit) {
                    h[ERR] = seq * 256 + layer;
                    __threadfence_system();
                    s = 0;
                    break;
                }
                __nanosleep(256);
                s = h[base + ids[i]];
            }
            slots[i] = (unsigned int)s;
        }
    }
"""

_DONE = """
    if (threadIdx.x == 0) {
        volatile int* h = reinterpret_cast<volatile int*>(addr[0]);
        out[0] = y[0];
        __threadfence_system();
        h[DONE] = pass_no[0];
        __threadfence_system();
    }
"""


class DeviceWaitTimeout(RuntimeError):
    """A lookup waited past its limit (the host never wrote a slot), or the host waited past its
    own for a pass to end."""


class RequestPage:
    """The host's side of the handshake on a page of int32 words (module docstring): the table it
    publishes, the requests it reads and answers, the end marker it waits for. The page is plain
    host memory here; `DeviceWaits` registers it for the device and adds the kernels."""

    def __init__(self, layers: list[int], n_experts: int, limit_s: float = 2.0):
        if len(layers) > 256:
            raise ValueError("device_waits: more than 256 MoE layers")
        self.size = -(-(TABLE + len(layers) * n_experts) * 4 // mmap.PAGESIZE) * mmap.PAGESIZE
        self.limit_s = float(limit_s)
        self.layers = list(layers)
        self.index = {layer: i for i, layer in enumerate(layers)}
        self.n_experts = n_experts
        self._buf = mmap.mmap(-1, self.size)
        self.page = np.frombuffer(self._buf, dtype=np.int32)
        self.page[:] = 0
        self.table = self.page[TABLE:TABLE + len(layers) * n_experts].reshape(len(layers), n_experts)
        self.table[:] = -1
        self.seq = 0  # the pass's number (the page's words hold the last seen)
        self.served = 0  # the last request answered
        self.requests = self.timeouts = 0
        self.published = -1  # the tier's `changes` when last published

    def begin(self) -> None:
        """A new pass: its requests and end marker carry a new number."""
        self.seq = self.seq % SEQ_WRAP + 1

    def request(self) -> tuple[int, int, list[int]] | None:
        """This pass's latest request, where not answered yet: (its tag, the layer, the experts);
        else None. Its words are written before its tag, and no other comes before it is answered."""
        tag = int(self.page[REQ])
        if tag == self.served or tag // 256 != self.seq:
            return None
        k = int(self.page[COUNT])
        return tag, self.layers[tag % 256], [int(e) for e in self.page[IDS:IDS + k]]

    def answered(self, tag: int) -> None:
        """The request `tag` is answered (its experts resident, the table published); the device
        may have posted the next one already."""
        self.served = tag
        self.requests += 1

    def finished(self) -> bool:
        """Whether the pass's end marker has run; raises where a lookup of it timed out."""
        if int(self.page[ERR]) // 256 == self.seq:
            self.timeouts += 1
            raise DeviceWaitTimeout(f"a layer's lookup waited more than {self.limit_s} s for the host")
        return int(self.page[DONE]) == self.seq

    def publish(self, tier) -> None:
        """The table from the tier's residency map (`ResidentTier.slot_of`), where it changed since
        last published; the copies of every fill applied must be done."""
        if tier.changes == self.published:
            return
        for layer, i in self.index.items():
            self.table[i] = tier.slot_of[layer]
        self.published = tier.changes

    def drop(self, layer: int, expert: int) -> None:
        """An evicted expert, marked missing before anything is written into its slot."""
        self.table[self.index[layer], expert] = -1

    def abandon(self) -> None:
        """The host gives the pass up (an error while serving it): every missing entry points at
        slot 0, so any lookup still waiting goes on (the pass's output is dropped), and its end
        marker is waited for a little. The next pass publishes the true table again."""
        self.table[self.table < 0] = 0
        self.published = -1  # published again before the next pass
        t_end = time.perf_counter() + 5.0
        while int(self.page[DONE]) != self.seq and int(self.page[ERR]) // 256 != self.seq \
                and time.perf_counter() < t_end:
            time.sleep(0.001)

    def wait(self, serve, timeout_s: float) -> None:
        """Polls until the pass's end marker has run, answering each request with serve(layer,
        experts) (which must leave the experts resident and the table published)."""
        t_end = time.perf_counter() + timeout_s
        while not self.finished():
            req = self.request()
            if req is not None:
                serve(req[1], req[2])
                self.answered(req[0])
                continue
            if time.perf_counter() > t_end:
                raise DeviceWaitTimeout(f"the pass did not end within {timeout_s} s")
            time.sleep(0)


class DeviceWaits(RequestPage):
    """The page pinned and mapped for the device, and its two kernels. One per tier (its layers
    in `store.moe_layers` order, `index`)."""

    def __init__(self, cu, layers: list[int], n_experts: int, limit_s: float = 2.0):
        super().__init__(layers, n_experts, limit_s)
        self.cu = cu
        size = self.size
        cu.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        r = cu.cuMemHostRegister_v2(self.page.ctypes.data, size, 0x1 | 0x2)  # portable, mapped
        if r != 0:
            raise OSError(f"cuMemHostRegister refused (CUresult {r})")
        self._registered = True
        dptr = ctypes.c_uint64()
        cu.cuMemHostGetDevicePointer_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
        r = cu.cuMemHostGetDevicePointer_v2(ctypes.byref(dptr), self.page.ctypes.data, 0)
        if r != 0:
            self.close()
            raise OSError(f"cuMemHostGetDevicePointer refused (CUresult {r})")
        self.addr = mx.array(np.array([dptr.value], dtype=np.uint64))
        header = _HEADER.format(REQ=REQ, ERR=ERR, DONE=DONE, COUNT=COUNT, IDS=IDS, TABLE=TABLE)
        self._lookup = mx.fast.cuda_kernel(name="deltafin_lookup_wait", input_names=["ids", "addr", "meta", "pass_no"],
                                           output_names=["slots"], source=_LOOKUP, header=header)
        self._done = mx.fast.cuda_kernel(name="deltafin_pass_done", input_names=["y", "addr", "pass_no"],
                                         output_names=["out"], source=_DONE, header=header)
        self._metas: dict[tuple, mx.array] = {}  # (layer, k, limit_s) -> the lookup's fixed arguments
        self._pass_no = mx.array(np.zeros(1, dtype=np.int32))

    @classmethod
    def open(cls, layers: list[int], n_experts: int, top_k: int = 1, limit_s: float = 2.0) -> "DeviceWaits | None":
        """On MLX CUDA with custom kernels, for rows of at most MAX_K experts; None elsewhere."""
        from deltafin.workers.resident import _cuda_driver, is_metal
        if mx.default_device() != mx.gpu or is_metal() or not hasattr(mx.fast, "cuda_kernel") or top_k > MAX_K:
            return None
        drv = _cuda_driver()
        return None if drv is None else cls(drv[0], layers, n_experts, limit_s)

    def close(self) -> None:
        if getattr(self, "_registered", False):
            self.cu.cuMemHostUnregister(self.page.ctypes.data)
            self._registered = False

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def begin(self) -> None:
        """A new pass: its number, also as the one small array its kernels read."""
        super().begin()
        self._pass_no = mx.array(np.array([self.seq], dtype=np.int32))

    def _meta(self, layer: int, k: int) -> mx.array:
        """The layer's fixed arguments (its index, the experts per layer, k, the limit in ms), made once."""
        key = (layer, k, self.limit_s)
        made = self._metas.get(key)
        if made is None:
            made = self._metas[key] = mx.array(np.array(
                [self.index[layer], self.n_experts, k, max(1, int(self.limit_s * 1000))], dtype=np.int32))
        return made

    def slots(self, layer: int, ids) -> mx.array:
        """ids [..., k] (one row's chosen experts) -> their slots, uint32, the same shape: looked
        up when the device reaches the layer, waiting for the host where one is missing."""
        k = ids.shape[-1]
        out = self._lookup(inputs=[ids.reshape(-1).astype(mx.int32), self.addr, self._meta(layer, k), self._pass_no],
                           output_shapes=[(k,)], output_dtypes=[mx.uint32], grid=(32, 1, 1),
                           threadgroup=(32, 1, 1))[0]
        return out.reshape(ids.shape)

    def marker(self, y) -> mx.array:
        """A tiny kernel behind y that writes the pass's number into the page once y is done."""
        return self._done(inputs=[y.reshape(-1), self.addr, self._pass_no], output_shapes=[(1,)],
                          output_dtypes=[y.dtype], grid=(32, 1, 1), threadgroup=(32, 1, 1))[0]
