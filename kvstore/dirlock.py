"""One Store per directory: an exclusive ``flock`` on ``<store dir>/lock`` while it is open.

Two Stores on one directory (two ``kvstore serve`` given the same data directory, or an engine
opening a path a sidecar already serves) would each index, evict and write the same LMDB
environment, auth file and audit log without seeing the other's changes: blocks one deletes
the other still serves, a tenant deleted on one keeps its token on the other. The second one
is refused with FailedPrecondition naming the holder's pid instead.

The lock is the kernel's: it goes with the process (a crashed or killed server holds nothing),
and it is per open file, so a second Store in the same process is refused too.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from kvstore.errors import FailedPrecondition

LOCK_NAME = "lock"


class DirLock:
    """The exclusive lock of a store directory; :meth:`release` (idempotent) gives it back."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / LOCK_NAME
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise FailedPrecondition(
                f"the store directory {directory} is in use by another kvstore Store (pid {holder}): "
                f"one Store per directory; give this one its own path") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
