"""Compile bench.device_waits' two CUDA kernels (workers/device_waits.py) with NVRTC, without a GPU.

  pip install nvidia-cuda-nvrtc-cu12        # in any venv; it carries libnvrtc.so.12
  python docs/probes/nvrtc_check.py PATH/TO/libnvrtc.so.12 [ARCH]   # ARCH: compute_90 (H100/H200)

Each kernel is wrapped as MLX's `mx.fast.cuda_kernel` wraps a source (its header, then a
`__global__` function whose parameters are the inputs as const pointers and the outputs as
pointers, in namespace mlx::core::cu), with the types MLX gives int32, uint64, uint32 and
bfloat16 arrays declared here instead of MLX's device headers. A compile error shows here before a
device call is spent on it; whether the kernels behave is for docs/probes/spin_wait.py on a GPU.
"""
from __future__ import annotations

import ctypes
import sys

from deltafin.workers import device_waits as D

PRELUDE = ("typedef int int32_t; typedef unsigned int uint32_t; typedef unsigned long long uint64_t;\n"
           "struct __nv_bfloat16 { unsigned short x; };\n")


def wrapped(name: str, params: str, body: str) -> str:
    header = D._HEADER.format(REQ=D.REQ, ERR=D.ERR, DONE=D.DONE, COUNT=D.COUNT, IDS=D.IDS, TABLE=D.TABLE)
    return (PRELUDE + header + "namespace mlx { namespace core { namespace cu {\n"
            f"__global__ void {name}({params}) {{\n{body}\n}}\n}}}}}}\n")


def main() -> int:
    lib = ctypes.CDLL(sys.argv[1])
    arch = sys.argv[2] if len(sys.argv) > 2 else "compute_90"
    kernels = {
        "deltafin_lookup_wait": ("const int32_t* ids, const uint64_t* addr, const int32_t* meta, const int32_t* pass_no, "
                                 "uint32_t* slots",
                                 D._LOOKUP),
        "deltafin_pass_done": ("const __nv_bfloat16* y, const uint64_t* addr, const int32_t* pass_no, "
                               "__nv_bfloat16* out", D._DONE),
    }
    failed = 0
    for name, (params, body) in kernels.items():
        prog = ctypes.c_void_p()
        code = wrapped(name, params, body).encode()
        if lib.nvrtcCreateProgram(ctypes.byref(prog), code, f"{name}.cu".encode(), 0, None, None) != 0:
            raise RuntimeError("nvrtcCreateProgram failed")
        opts = [f"--gpu-architecture={arch}".encode(), b"-default-device"]
        r = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        print(f"{name}: {'compiled' if r == 0 else f'FAILED (nvrtcResult {r})'} for {arch}",
              log.value.decode().strip())
        failed += r != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
