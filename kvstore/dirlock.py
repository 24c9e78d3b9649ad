"""One Store per directory: an exclusive ``flock`` on ``<store dir>/lock`` while it is open.

Two Stores on one directory (two ``kvstore serve`` given the same data directory, or an engine
opening a path a sidecar already serves) would each index, evict and write the same LMDB
environment, auth file and audit log without seeing the other's changes: blocks one deletes
the other still serves, a tenant deleted on one keeps its token on the other. The second one
is refused with FailedPrecondition naming the holder's pid instead.

The lock is the kernel's: it goes with the process (a crashed or killed server holds nothing),
and it is per open file, so a second Store in the same process is refused too. A lock file
that cannot be opened (a directory in its place, no permission) is a FailedPrecondition naming
it, not an OSError.
"""

from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path

from kvstore.errors import FailedPrecondition

LOCK_NAME = "lock"

log = logging.getLogger(__name__)


class DirLock:
    """The exclusive lock of a store directory; :meth:`release` (idempotent) gives it back."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / LOCK_NAME
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:  # NOTE: was a raw IsADirectoryError (a directory named lock)
            raise FailedPrecondition(self._cannot_open(exc)) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise FailedPrecondition(
                f"the store directory {directory} is in use by another kvstore Store (pid {holder}): "
                f"one Store per directory; give this one its own path") from None
        except OSError as exc:
            os.close(fd)
            raise FailedPrecondition(f"cannot lock the store's lock file {self.path}: {exc.strerror or exc}") from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as exc:  # the pid is for people only: the lock is held either way
            log.warning("could not write the pid into the lock file %s: %s", self.path, exc)
        self._fd: int | None = fd

    def _cannot_open(self, exc: OSError) -> str:
        """What is wrong with the lock file (or the store directory), for people."""
        if os.path.isdir(self.path):  # (os.path's: an error is False, not raised)
            return (f"the store's lock file {self.path} is a directory: move it away (the Store "
                    f"creates the file)")
        return f"cannot open the store's lock file {self.path}: {exc.strerror or exc}"

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
