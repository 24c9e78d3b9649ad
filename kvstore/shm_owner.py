"""The creator of a shared-memory region, as its header names it, and whether it is gone.

* :class:`Owner` — pid, start time (``/proc/<pid>/stat``), pid namespace and boot id of the
  process that created a region; :meth:`Owner.pack` / :meth:`Owner.unpack` are its
  :data:`Owner.SIZE` bytes in a region's header (at :data:`kvstore.shm.OWNER_OFFSET`).
* :meth:`Owner.gone` is True only when that process is *known* gone: same boot and pid
  namespace as this process (else it cannot tell, and the creator counts as alive), and no
  process of that pid with that start time is running (a zombie counts as gone). Why the server
  asks: :mod:`kvstore.shm_sweep`.
"""

from __future__ import annotations

import os
import struct
import uuid
from dataclasses import dataclass
from typing import ClassVar

_PACKED = struct.Struct("<QQQ16s")  # pid, start time (clock ticks after boot), pid namespace inode, boot id


@dataclass(frozen=True, slots=True)
class Owner:
    """The process that created a region, as its header records it."""

    #: bytes of a packed owner in a region's header
    SIZE: ClassVar[int] = _PACKED.size

    pid: int
    start: int  # clock ticks after boot (field 22 of /proc/<pid>/stat)
    pidns: int  # inode of /proc/self/ns/pid
    boot: bytes  # /proc/sys/kernel/random/boot_id, 16 bytes

    def pack(self) -> bytes:
        return _PACKED.pack(self.pid, self.start, self.pidns, self.boot)

    @classmethod
    def unpack(cls, raw: bytes) -> Owner | None:
        """The owner a header names; None when it names none (zeros: an older client)."""
        if len(raw) < _PACKED.size:
            return None
        pid, start, pidns, boot = _PACKED.unpack_from(raw)
        if not pid:
            return None
        return cls(pid, start, pidns, boot)

    @classmethod
    def current(cls) -> Owner:
        """This process (fields it cannot read are zeros: then nobody can judge it gone)."""
        local = _local()
        stat_ = proc_stat(os.getpid()) if local.proc_ok else None
        return cls(os.getpid(), stat_[1] if stat_ else 0, local.pidns, local.boot)

    def gone(self) -> bool:
        """True only when this process is known to be gone: it ran on this boot, in this pid
        namespace (and this process's ``/proc`` is of that namespace), and no process of its pid
        and start time runs now (a zombie is gone). False when that cannot be told."""
        local = _local()
        if not (self.start and self.pidns and any(self.boot) and local.proc_ok
                and self.pidns == local.pidns and self.boot == local.boot):
            return False
        found = proc_stat(self.pid)
        if found is None:
            return True
        state, start = found
        return start != self.start or state in "ZX"


@dataclass(frozen=True, slots=True)
class _Local:
    pid: int
    pidns: int
    boot: bytes
    proc_ok: bool  # /proc is this process's pid namespace's


_local_cache: _Local | None = None


def _local() -> _Local:
    global _local_cache
    cached = _local_cache
    if cached is not None and cached.pid == os.getpid():
        return cached
    try:
        pidns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        pidns = 0
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = uuid.UUID(f.read().strip()).bytes
    except (OSError, ValueError):
        boot = bytes(16)
    try:
        proc_ok = os.readlink("/proc/self") == str(os.getpid())
    except OSError:
        proc_ok = False
    _local_cache = cached = _Local(os.getpid(), pidns, boot, proc_ok)
    return cached


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, start time) of process ``pid`` from ``/proc``; None when there is none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError:
        return ("?", -1)  # NOTE: exists but unreadable: never taken for gone (start never matches 0)
    rest = raw[raw.rfind(b")") + 2 :].split()  # the name may hold spaces and parentheses
    try:
        return rest[0].decode(), int(rest[19])
    except (IndexError, ValueError):
        return ("?", -1)
