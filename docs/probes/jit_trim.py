"""Whether the memory a first run's kernel compilation leaves in compute's process is the C heap's
free space (which glibc's malloc_trim gives back) or still in use: the runtime's Compute in one
process (router and loader in-process, tools/inprocess.py) at SHARE of the store's experts.

  MLX_PTX_CACHE_DIR=$(mktemp -d) python docs/probes/jit_trim.py STORE [SHARE]

Prints this process's PSS and glibc's heap (mallinfo2: in use, free) after the model's load, its
warm-up pass, a 16-token request, malloc_trim(0), and a second request. Run it with an empty
kernel cache (MLX CUDA compiles every kernel: a fresh machine's first run), then with the same
directory again (the kernels found).
"""
from __future__ import annotations

import ctypes
import dataclasses
import os
import sys

from deltafin.protocol import messages as M
from deltafin.runtime.config import load_config
from deltafin.runtime.store import Store
from deltafin.tools.inprocess import local_router
from deltafin.tools.treesampler import TreeSampler
from deltafin.workers.engine import Compute

PROMPT = [1, 504, 3458, 314, 260, 6123, 4876, 47, 198]


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


LIBC = ctypes.CDLL("libc.so.6")
LIBC.mallinfo2.restype = MallInfo2


def show(what: str) -> None:
    m = LIBC.mallinfo2()
    mib = 2 ** 20
    print(f"{what:28s} PSS {TreeSampler._pss(os.getpid()) / mib:8.1f} MiB   heap in use "
          f"{(m.uordblks + m.hblkhd) / mib:8.1f} MiB, free in the heap {m.fordblks / mib:8.1f} MiB "
          f"(mmapped blocks {m.hblkhd / mib:.1f})", flush=True)


def main() -> None:
    store = Store(sys.argv[1])
    share = float(sys.argv[2]) if len(sys.argv) > 2 else 0.25
    print("MLX_PTX_CACHE_DIR", os.environ.get("MLX_PTX_CACHE_DIR"),
          "entries", len(os.listdir(os.environ["MLX_PTX_CACHE_DIR"])) if os.environ.get("MLX_PTX_CACHE_DIR") else "-")
    c = load_config(None)
    c = dataclasses.replace(c, cache=dataclasses.replace(c.cache, max_slots=int(len(store.records) * share)))
    src, staging, _ = local_router(store, c)
    comp = Compute(store, c, src, staging, store.max_record_bytes)
    show("loaded")
    comp.warm_up()
    show("warm-up pass")
    req = M.Generate(id=1, token_ids=PROMPT, max_tokens=16, stream=False)
    comp.generate(req)
    show("16 tokens")
    LIBC.malloc_trim(0)
    show("malloc_trim(0)")
    comp.generate(dataclasses.replace(req, id=2))
    show("16 tokens again")


if __name__ == "__main__":
    main()
