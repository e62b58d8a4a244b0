"""A hard memory cap for one benchmark contender's process tree: a Linux memory cgroup (v1 or v2).

The contender's first process joins the cgroup before it execs (`enter`, a preexec_fn), so every
process it starts is capped with it. The kernel's own peak counter (page cache included) and OOM
events are read back afterwards. Where no cgroup can be made (macOS, no root) the cap is reported
as not enforced rather than pretended.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

V1 = Path("/sys/fs/cgroup/memory")
V2 = Path("/sys/fs/cgroup")


class MemoryCap:
    def __init__(self, limit_bytes: int, name: str):
        self.limit = int(limit_bytes)
        self.path: Path | None = None
        self.version = None
        self.why_not = None
        if not sys.platform.startswith("linux"):
            self.why_not = f"no memory cgroups on {sys.platform}: the cap is not enforced"
            return
        try:
            if (V1 / "memory.limit_in_bytes").exists():
                self.version, self.path = 1, V1 / name
                self.path.mkdir(exist_ok=True)
                self._write("memory.limit_in_bytes", self.limit)
                if (self.path / "memory.memsw.limit_in_bytes").exists():
                    self._write("memory.memsw.limit_in_bytes", self.limit)
            elif (V2 / "cgroup.controllers").exists() and "memory" in (V2 / "cgroup.controllers").read_text():
                self.version, self.path = 2, V2 / name
                self.path.mkdir(exist_ok=True)
                self._write("memory.max", self.limit)
                self._write("memory.swap.max", 0)
            else:
                self.why_not = "no memory cgroup controller found: the cap is not enforced"
        except OSError as e:
            self.path = None
            self.why_not = f"cannot create a memory cgroup ({e}): the cap is not enforced"

    @property
    def enforced(self) -> bool:
        return self.path is not None

    def _write(self, name: str, value) -> None:
        (self.path / name).write_text(str(value))

    def _read(self, name: str) -> str | None:
        try:
            return (self.path / name).read_text()
        except (OSError, TypeError):
            return None

    def enter(self) -> None:
        """preexec_fn: the child joins the cgroup before exec."""
        if self.path is not None:
            (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def reset_peak(self) -> None:
        if self.version == 1:
            try:
                self._write("memory.max_usage_in_bytes", 0)
            except OSError:
                pass

    def peak_bytes(self) -> int | None:
        text = self._read("memory.max_usage_in_bytes" if self.version == 1 else "memory.peak")
        return int(text) if text and text.strip().isdigit() else None

    def oom_kills(self) -> int:
        if self.version == 1:
            text = self._read("memory.oom_control") or ""
            for line in text.splitlines():
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
            return 0
        text = self._read("memory.events") or ""
        for line in text.splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0

    def pids(self) -> list[int]:
        text = self._read("cgroup.procs") or ""
        return [int(x) for x in text.split()]

    def describe(self) -> dict:
        return {"limit_bytes": self.limit, "enforced": self.enforced,
                "mechanism": f"cgroup v{self.version}" if self.enforced else None, "why_not": self.why_not}

    def remove(self) -> None:
        """Kills what is left inside, then removes the cgroup."""
        if self.path is None:
            return
        for pid in self.pids():
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        try:
            self.path.rmdir()
        except OSError:
            pass
        self.path = None
