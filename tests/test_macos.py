"""macOS readiness, simulated on Linux (no Mac has run deltafin): each branch the runtime takes
on macOS, driven by patching sys.platform or the probe it relies on. docs/ARCHITECTURE.md,
"macOS checklist", says which items only a real Mac can verify."""
from __future__ import annotations

import builtins
import ctypes
import os
import re
from collections import namedtuple
from pathlib import Path

import numpy as np
import psutil
import pytest

from deltafin.runtime import directio, heap, procmem, security, shm, telemetry
from deltafin.workers import common, engine, resident

MiB = 1 << 20
# psutil's memory_full_info on macOS: no pss field
MacMem = namedtuple("MacMem", "rss vms pfaults pageins uss")
ROOT = Path(__file__).resolve().parents[1]


class FakeProcess:
    """A process mapping a 64 MiB shared segment (in its RSS, not its USS)."""

    def __init__(self, pid: int, own: int):
        self.pid, self.own = pid, own

    def memory_full_info(self):
        return MacMem(rss=self.own + 64 * MiB, vms=0, pfaults=0, pageins=0, uss=self.own)

    def cpu_percent(self, _interval):
        return 0.0


class FakeLibproc:
    """libproc's proc_pid_rusage, filling rusage_info_v2's phys_footprint."""

    def __init__(self, footprints: dict):
        self.footprints = footprints

    def proc_pid_rusage(self, pid, flavor, info):
        assert flavor == procmem.RUSAGE_INFO_V2
        info.contents[procmem.FOOTPRINT_FIELD] = self.footprints[pid]
        return 0


@pytest.fixture
def mac(monkeypatch):
    """Three processes of a tree on a simulated Mac: USS 10, 20, 30 MiB; compute's footprint
    (its Metal buffers) 50 MiB above its USS."""
    procs = {1: FakeProcess(1, 10 * MiB), 2: FakeProcess(2, 20 * MiB), 3: FakeProcess(3, 30 * MiB)}
    monkeypatch.setattr(procmem.sys, "platform", "darwin")
    monkeypatch.setattr(procmem.psutil, "Process", lambda pid: procs[pid])
    lib = FakeLibproc({1: 8 * MiB, 2: 20 * MiB, 3: 80 * MiB})
    monkeypatch.setattr(procmem.ctypes, "CDLL", lambda path: lib)
    return procs


def test_macos_counts_a_shared_segment_once(mac):
    """RSS would count the 64 MiB segment three times (252 MiB); the tree counts each process's
    own memory (the larger of USS and footprint) and the segment once: 10 + 20 + 80 + 64."""
    assert procmem.tree_memory([1, 2, 3], shared_bytes=64 * MiB) == (10 + 20 + 80 + 64) * MiB
    one = procmem.measure(mac[3])
    assert one == {"rss": 94 * MiB, "pss": None, "uss": 30 * MiB, "own": 80 * MiB, "private": True}
    # the sampler behind stats and the monitor: the same figures, and the same total
    sampled = telemetry.ProcessSampler().sample({"supervisor": 1, "router": 2, "compute": 3})
    assert procmem.tree_total(sampled.values(), 64 * MiB) == (10 + 20 + 80 + 64) * MiB


def test_macos_without_libproc_counts_uss(mac, monkeypatch):
    def no_libproc(path):
        raise OSError("no libproc")
    monkeypatch.setattr(procmem.ctypes, "CDLL", no_libproc)
    assert procmem.footprint(3) is None
    assert procmem.tree_memory([1, 2, 3], shared_bytes=64 * MiB) == (10 + 20 + 30 + 64) * MiB


def test_linux_counts_pss_and_no_segment_on_top():
    me = procmem.measure(psutil.Process(os.getpid()))
    assert me["pss"] is not None and me["own"] == me["pss"] and not me["private"]
    assert procmem.tree_total([me], shared_bytes=64 * MiB) == me["pss"]  # PSS holds its share
    assert procmem.footprint(os.getpid()) is None  # not macOS: no libproc call


def test_footprint_reads_rusage_info_v2_layout():
    """phys_footprint is the 10th 64-bit word of struct rusage_info_v2: uuid (2 words),
    user_time, system_time, pkg_idle_wkups, interrupt_wkups, pageins, wired_size,
    resident_size, phys_footprint (<sys/resource.h>)."""
    fields = ["uuid0", "uuid1", "user_time", "system_time", "pkg_idle_wkups", "interrupt_wkups",
              "pageins", "wired_size", "resident_size", "phys_footprint"]
    assert fields.index("phys_footprint") == procmem.FOOTPRINT_FIELD


def test_shared_memory_names_fit_macos():
    """macOS takes 31 characters with the leading slash (PSHMNAMLEN)."""
    run = shm.RunDir.__new__(shm.RunDir)
    run.run_id = "f" * 8
    names = [run.segment_name(f"staging{g}") for g in (1, 10, 999_999)]
    assert all(len("/" + n) <= 31 for n in names) and len(set(names)) == 3


def test_ipc_paths_over_the_macos_limit_are_refused_there(tmp_path, monkeypatch):
    # a run root whose longest socket path is 105 bytes: fine on Linux, over macOS's 103
    base = f"{tmp_path}/"
    tail = f"/deltafin-{os.getuid()}/{'0' * 8}/{shm.LONGEST_SOCKET}.ipc"
    root = Path(base + "r" * (105 - len(base) - len(tail)))
    assert len(str(root) + tail) == 105
    monkeypatch.setenv("DELTAFIN_RUN_ROOT", str(root))
    run = shm.RunDir()
    run.cleanup()
    monkeypatch.setattr(security.sys, "platform", "darwin")
    with pytest.raises(security.SecurityError, match="105 bytes; this OS takes at most 103"):
        shm.RunDir()


def test_macos_reads_with_f_nocache(tmp_path, monkeypatch):
    path = tmp_path / "records.bin"
    data = np.arange(4096, dtype=np.uint32).tobytes()
    path.write_bytes(data)
    calls = []
    real_open = os.open
    monkeypatch.setattr(directio.sys, "platform", "darwin")
    monkeypatch.setattr(directio.fcntl, "fcntl", lambda fd, cmd, arg: calls.append((cmd, arg)))
    monkeypatch.setattr(directio.os, "open", lambda p, flags: (opened.append(flags), real_open(p, flags))[1])
    opened: list = []
    with directio.DirectFile(path) as f:
        buf = directio.aligned_buffer(len(data))
        assert f.read_into(memoryview(buf), 0, len(data)) == len(data)
        assert bytes(buf[:len(data)]) == data
    assert f.direct and calls == [(48, 1)]  # F_NOCACHE on, from <sys/fcntl.h>
    assert not opened[0] & getattr(os, "O_DIRECT", 0)


def test_macos_checks_no_dev_shm(monkeypatch):
    def no_dir(path):
        raise FileNotFoundError(path)
    monkeypatch.setattr(shm.os, "statvfs", no_dir)
    shm.check_room(1 << 40)  # nothing to check where there is no /dev/shm: no error


def test_workers_die_with_the_supervisor_without_prctl(monkeypatch):
    """macOS has no PR_SET_PDEATHSIG: the parent-watch thread alone ends a worker."""
    monkeypatch.setattr(common.sys, "platform", "darwin")
    monkeypatch.setattr(ctypes, "CDLL", lambda *a, **k: pytest.fail("prctl called on macOS"))
    watched = []
    monkeypatch.setattr(common, "watch_parent", watched.append)
    common.die_with_parent(1234)
    assert watched == [1234]


def test_nothing_on_the_serving_path_needs_proc_or_cgroup(monkeypatch):
    """/proc/self/io (a stats figure) and /proc/self/statm (the heap trim's growth) are optional;
    /proc and cgroup appear nowhere else in the runtime but the benchmark's Linux-only page-cache
    drop."""
    real_open = builtins.open

    def no_proc(path, *a, **k):
        if str(path).startswith("/proc"):
            raise FileNotFoundError(path)
        return real_open(path, *a, **k)
    monkeypatch.setattr(builtins, "open", no_proc)
    assert engine.disk_read_bytes() is None
    assert procmem.cow_shared([os.getpid()]) == 0  # the copy-on-write room: none where /proc is not
    assert heap.resident_bytes() is None and heap.HeapTrim().maybe() == 0  # no trim, no error
    users = {p.relative_to(ROOT).as_posix() for d in ("runtime", "workers", "protocol")
             for p in (ROOT / d).rglob("*.py") if re.search(r"/proc/|cgroup", p.read_text())}
    assert users == {"runtime/diskprobe.py", "runtime/heap.py", "runtime/procmem.py", "workers/engine.py"}, users


def test_the_zero_copy_probe_falls_back(monkeypatch):
    """Where MLX's memory cannot be written from the host (or the device does not see it), the
    resident tier is filled through MLX instead (host_writes False, tests/test_resident.py)."""
    def refuse(*a, **k):
        raise BufferError("not host memory")
    monkeypatch.setattr(resident.np, "frombuffer", refuse)
    got = resident.probe_host_writes()
    assert not got["host_writes"] and "no writable host view" in got["why"]
    monkeypatch.undo()
    real = np.frombuffer
    copy = lambda buf, dtype: np.array(real(buf, dtype=dtype))  # writes miss the array
    monkeypatch.setattr(resident.np, "frombuffer", copy)
    got = resident.probe_host_writes()
    assert not got["host_writes"] and "did not see" in got["why"], got
