"""Where MLX keeps the GPU kernels it compiles: a directory that outlives /tmp.

MLX CUDA compiles a kernel with NVRTC the first time a shape needs it and keeps the binary in
`MLX_PTX_CACHE_DIR`, by default /tmp/mlx/VERSION/ptx. Many systems empty /tmp at boot (a tmpfs,
or systemd-tmpfiles), so each reboot paid the compilation again on the first request: on an H100
a time to first token of 43 s cold against 0.55 s warm (docs/BENCHMARKS.md, stop 55). The
supervisor therefore points the variable, for the workers it starts, at a cache directory of the
user's (`runtime.kernel_cache`), unless the variable is set already: after a reboot the first
request's time to first token was 0.67 s with it against 42.07 s with MLX's default (H100, stop
56, docs/probes/cold_start.sh reboot).

The binaries are built for the GPU that compiled them (sm_90a on an H100) under names that do not
say which, so the directory is keyed by host as well as by MLX version: a home directory shared
by machines with different GPUs never hands one of them another's kernels. Only on Linux, where
MLX CUDA runs: Metal and the CPU backend do not read the variable.
"""
from __future__ import annotations

import os
import socket
import sys
from importlib import metadata
from pathlib import Path

from deltafin.runtime.config import cache_dir

ENV = "MLX_PTX_CACHE_DIR"
MLX_OWN = "mlx"  # runtime.kernel_cache: leave the variable to MLX's default


def mlx_version() -> str:
    try:
        return metadata.version("mlx")
    except metadata.PackageNotFoundError:
        return "unknown"


def default_dir() -> Path:
    """kernels/HOST/mlx-VERSION in deltafin's cache ($DELTAFIN_CACHE, else ~/.cache/deltafin)."""
    return cache_dir() / "kernels" / (socket.gethostname() or "localhost") / f"mlx-{mlx_version()}"


def use_kernel_cache(setting: str, environ=os.environ,
                     platform: str = sys.platform) -> tuple[str | None, str | None]:
    """Sets `MLX_PTX_CACHE_DIR` in environ (the processes started after inherit it) from
    runtime.kernel_cache: "" the default directory, "mlx" MLX's own, else that directory. Returns
    (the directory in the variable, None where MLX chooses; a warning or None). A variable set
    already is the user's and stays; a directory that cannot be made or written leaves MLX's
    default, with a warning. Elsewhere than on Linux nothing is set (no MLX CUDA there)."""
    if environ.get(ENV):
        return environ[ENV], None
    if setting == MLX_OWN or not platform.startswith("linux"):
        return None, None
    path = (Path(setting).expanduser() if setting else default_dir()).absolute()  # workers may change directory
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as e:
        return None, f"kernel cache {path} cannot be made ({e.strerror}): MLX keeps its kernels in /tmp"
    if not os.access(path, os.W_OK | os.X_OK):
        return None, f"kernel cache {path} is not writable: MLX keeps its kernels in /tmp"
    environ[ENV] = str(path)
    return str(path), None
