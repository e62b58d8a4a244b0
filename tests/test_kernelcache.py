"""The directory MLX keeps its compiled GPU kernels in (runtime/kernelcache.py): the user's cache,
keyed by host and MLX version, handed to the workers the supervisor starts; a variable already
set, "mlx" and a directory that cannot be used leave it as they find it."""
from __future__ import annotations

import os
import socket
import stat

from deltafin.client import Client
from deltafin.runtime.kernelcache import ENV, default_dir, mlx_version, use_kernel_cache
from deltafin.tools.run import running_supervisor


def test_the_default_is_the_users_cache_keyed_by_host_and_mlx_version(tmp_path, monkeypatch):
    monkeypatch.setenv("DELTAFIN_CACHE", str(tmp_path))
    env = {}
    path, warning = use_kernel_cache("", env)
    want = tmp_path / "kernels" / socket.gethostname() / f"mlx-{mlx_version()}"
    assert (path, warning) == (str(want), None) and env == {ENV: str(want)}
    assert default_dir() == want and want.is_dir()
    assert stat.S_IMODE(want.stat().st_mode) == 0o700
    assert mlx_version()[0].isdigit()


def test_a_set_variable_mlx_and_a_given_directory(tmp_path, monkeypatch):
    env = {ENV: "/somewhere/of/mine"}
    assert use_kernel_cache(str(tmp_path / "x"), env) == ("/somewhere/of/mine", None)
    assert env == {ENV: "/somewhere/of/mine"} and not (tmp_path / "x").exists()
    env = {}
    assert use_kernel_cache("mlx", env) == (None, None) and env == {}
    assert use_kernel_cache(str(tmp_path / "y"), env, platform="darwin") == (None, None)  # no MLX CUDA
    assert env == {} and not (tmp_path / "y").exists()
    given = tmp_path / "kernels"
    assert use_kernel_cache(str(given), env) == (str(given), None) and env[ENV] == str(given)
    env = {}
    monkeypatch.chdir(tmp_path)
    assert use_kernel_cache("rel/k", env) == (str(tmp_path / "rel" / "k"), None)  # made absolute


def test_a_directory_that_cannot_be_made_leaves_mlx_its_default_with_a_warning(tmp_path):
    (tmp_path / "file").write_text("in the way")
    env = {}
    path, warning = use_kernel_cache(str(tmp_path / "file" / "kernels"), env)
    assert path is None and env == {}
    assert "cannot be made" in warning and "/tmp" in warning
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        path, warning = use_kernel_cache(str(ro), env)
        assert path is None and env == {} and "not writable" in warning


def test_the_supervisor_hands_the_directory_to_its_workers(tiny_stores, tmp_path, monkeypatch):
    monkeypatch.setenv("DELTAFIN_CACHE", str(tmp_path))
    monkeypatch.delenv(ENV, raising=False)
    with running_supervisor(tiny_stores("mixtral"), "4GiB") as (ep, _):
        with Client(ep, timeout=60) as c:  # what the compute process itself sees (a forked
            seen = c.stats()["workers"]["compute"]["kernel_cache"]  # one's /proc environ does not say)
    assert seen == str(default_dir()) and default_dir().is_dir()
