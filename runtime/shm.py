"""POSIX shared memory for the expert slot pool, and the run directories that record it.

multiprocessing.shared_memory registers every attach with the resource tracker, which unlinks
segments it believes it owns when a worker exits (before Python 3.13 that cannot be turned off).
So segments are opened with shm_open directly: only the supervisor creates and unlinks them.
Each run records its segments in RUNS/<run-id>/run.json; a later start sweeps runs whose
supervisor is dead (SIGKILL skips every cleanup path).
"""
from __future__ import annotations

import json
import mmap
import os
import secrets
import shutil
import stat
import tempfile
import time
from pathlib import Path

import _posixshmem

from deltafin.runtime.config import format_size
from deltafin.runtime.security import check_ipc_length

SEGMENT_PREFIX = "dfn"  # macOS allows 30 characters per segment name
SHM_DIR = "/dev/shm"
LONGEST_SOCKET = "metrics-in"  # the longest of a run's socket names (control, data, metrics, client)  # where Linux keeps POSIX shared memory (a tmpfs of its own size)


class SharedMemoryFull(RuntimeError):
    """The shared-memory filesystem has no room for a segment."""


def check_room(size: int, directory: str = SHM_DIR) -> None:
    """Refuses a segment the shared-memory filesystem cannot hold: its pages are only taken at
    first touch, so a full one shows later as a failure (EFAULT, SIGBUS) of every request.
    Where no such directory exists (macOS) there is nothing to check."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return
    free = st.f_bavail * st.f_frsize
    if size > free:
        raise SharedMemoryFull(f"the slot pool's staging segment needs {format_size(size)} "
                               f"({size} bytes) of shared memory, but {directory} has "
                               f"{format_size(free)} free of {format_size(st.f_blocks * st.f_frsize)}; "
                               f"free space there (stale segments, other programs) or enlarge it "
                               f"(mount -o remount,size=... {directory}), or lower the memory budget")


def runs_root() -> Path:
    return Path(os.environ.get("DELTAFIN_RUN_ROOT") or tempfile.gettempdir()) / f"deltafin-{os.getuid()}"


class Segment:
    """A named shared-memory segment mapped into this process."""

    def __init__(self, name: str, size: int, create: bool):
        self.name, self.size = name, size
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = _posixshmem.shm_open("/" + name, flags, mode=0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self.map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.buf = memoryview(self.map)

    @classmethod
    def create(cls, name: str, size: int) -> "Segment":
        return cls(name, size, create=True)

    @classmethod
    def attach(cls, name: str, size: int) -> "Segment":
        return cls(name, size, create=False)

    def close(self) -> None:
        if self.map is not None:
            self.buf.release()
            try:
                self.map.close()
            except BufferError:  # a numpy view still points into it; the OS unmaps at exit
                pass
            self.map = None


def unlink(name: str) -> bool:
    try:
        _posixshmem.shm_unlink("/" + name)
        return True
    except FileNotFoundError:
        return False


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunDir:
    """A private (0700) directory per run: sockets, run.json with the pid and segment names."""

    def __init__(self, root: Path | None = None):
        self.root = root or runs_root()
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = os.lstat(self.root)
        # The root sits in a shared temporary directory: one made by another user (or a link)
        # would let that user reach our sockets, so it is refused rather than used.
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            raise PermissionError(f"{self.root} is not a directory of this user; remove it or set "
                                  f"DELTAFIN_RUN_ROOT to a private directory")
        os.chmod(self.root, 0o700)
        self.run_id = secrets.token_hex(4)
        self.path = self.root / self.run_id
        check_ipc_length(self._socket(LONGEST_SOCKET))  # before anything is made
        self.path.mkdir(mode=0o700)
        self.segments: list[str] = []
        self.files: list[str] = []  # socket files outside the directory (a user-given ipc endpoint)
        self._write()

    def _write(self) -> None:
        tmp = self.path / "run.json.tmp"
        tmp.write_text(json.dumps({"pid": os.getpid(), "segments": self.segments, "files": self.files}))
        os.replace(tmp, self.path / "run.json")

    def record_file(self, path) -> None:
        """A socket file this run creates elsewhere: recorded before it exists, so a start after a
        crash removes it (only if it is still a socket)."""
        self.files.append(str(path))
        self._write()

    def drop_segment(self, segment: Segment) -> None:
        """Unmaps and unlinks one segment of this run (a worker restart replaces the pool)."""
        segment.close()
        unlink(segment.name)
        if segment.name in self.segments:
            self.segments.remove(segment.name)
            self._write()

    def segment_name(self, what: str) -> str:
        return f"{SEGMENT_PREFIX}{self.run_id}{what}"[:30]

    def create_segment(self, what: str, size: int) -> Segment:
        check_room(size)
        name = self.segment_name(what)
        self.segments.append(name)
        self._write()  # recorded before it exists, so a crash in between still gets swept
        return Segment.create(name, size)

    def _socket(self, what: str) -> Path:
        return self.path / f"{what}.ipc"

    def endpoint(self, what: str) -> str:
        return f"ipc://{self._socket(what)}"

    def cleanup(self) -> None:
        for name in self.segments:
            unlink(name)
        shutil.rmtree(self.path, ignore_errors=True)


FRESH_RUN_S = 60.0  # a run directory younger than this without run.json is still being made

def sweep_stale_runs(root: Path | None = None) -> list[str]:
    """Unlinks the segments and socket files and removes the directories of runs whose
    supervisor is gone. A socket file a live run records (the same path reused) stays."""
    root = root or runs_root()
    swept = []
    if not root.exists():
        return swept
    runs = []
    for run in root.iterdir():
        try:
            info = json.loads((run / "run.json").read_text())
        except (OSError, json.JSONDecodeError):
            info = None
        if info is None:
            # A directory another supervisor made an instant ago has no run.json yet (two trees
            # starting together, e.g. the ranks of one mlx.launch): only an old one is stale.
            try:
                if time.time() - run.stat().st_mtime < FRESH_RUN_S:
                    continue
            except OSError:
                continue
        runs.append((run, info, info is not None and pid_alive(int(info.get("pid", 0)))))
    live_files = {f for _, info, alive in runs if alive for f in info.get("files", [])}
    for run, info, alive in runs:
        if alive:
            continue
        for name in (info or {}).get("segments", []):
            if unlink(name):
                swept.append(name)
        for path in (info or {}).get("files", []):
            try:
                if path not in live_files and stat.S_ISSOCK(os.lstat(path).st_mode):
                    os.unlink(path)
            except OSError:
                pass
        shutil.rmtree(run, ignore_errors=True)
    return swept
