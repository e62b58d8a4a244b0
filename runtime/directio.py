"""Reads that bypass the OS page cache: the runtime owns its expert cache.

Linux: O_DIRECT (buffer, offset and length aligned to the block size). macOS: F_NOCACHE.
Filesystems that refuse O_DIRECT (tmpfs) fall back to buffered reads; `direct` tells which.
"""
from __future__ import annotations

import errno
import fcntl
import mmap
import os
import sys

BLOCK = 4096
F_NOCACHE = 48  # macOS fcntl command


def round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


class DirectFile:
    def __init__(self, path, allow_buffered_fallback: bool = True):
        self.path = str(path)
        self.direct = False
        flags = os.O_RDONLY
        if sys.platform.startswith("linux") and hasattr(os, "O_DIRECT"):
            try:
                self.fd = os.open(self.path, flags | os.O_DIRECT)
                self.direct = True
            except OSError as e:
                if e.errno != errno.EINVAL or not allow_buffered_fallback:
                    raise
                self.fd = os.open(self.path, flags)
        else:
            self.fd = os.open(self.path, flags)
            if sys.platform == "darwin":
                fcntl.fcntl(self.fd, F_NOCACHE, 1)
                self.direct = True
        self.size = os.fstat(self.fd).st_size

    def read_into(self, buf: memoryview, offset: int, nbytes: int) -> int:
        """Reads nbytes at offset into buf (page aligned, at least round_up(nbytes, BLOCK) long).

        Returns the bytes of real data read; a short count means the file is truncated.
        """
        length = min(round_up(nbytes, BLOCK), len(buf))
        if offset % BLOCK:
            raise ValueError(f"unaligned direct read offset {offset}")
        done = 0
        while done < length:
            got = os.preadv(self.fd, [buf[done:length]], offset + done)
            if got == 0:
                break
            done += got
        return min(done, nbytes)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """A page-aligned anonymous buffer for direct reads outside shared memory."""
    return mmap.mmap(-1, round_up(max(nbytes, 1), BLOCK))
