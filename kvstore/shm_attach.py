"""The server's handle on a client's shared-memory region.

* :func:`attach_region` — a client's region of a kind (``posix_shm``; ``cuda_ipc`` is the seam),
  :func:`attach_posix` — a ``posix_shm`` region by its name: only one that passes
  :mod:`kvstore.shm_checks`, before anything is mapped.
* :class:`AttachedRegion` — what they return: :meth:`~AttachedRegion.read_into` (PutLocal) and
  :meth:`~AttachedRegion.write_from` (GetLocal) copy between slots and host buffers; a
  :class:`Region` is what the service asks of one.
* CUDA seam: a device region would implement the same :class:`Region` protocol around a CUDA IPC
  memory handle (``torch.cuda`` / ``cudaIpcOpenMemHandle``); :func:`attach_region` is where that
  kind is dispatched. Not served yet.

No client action and no shortage of ``/dev/shm`` can crash the server (SIGBUS)
---------------------------------------------------------------------------------

A process touching a page of a shared mapping that its file no longer has (the file was
truncated) or that tmpfs cannot back (``/dev/shm`` full: docker's default is 64 MiB, less than a
client's default 256 MiB region) dies with SIGBUS. The server used to copy through a mapping of
every client region: a tenant that ftruncate()d its own region, or a get larger than what was
left of a small ``/dev/shm``, killed the sidecar and every tenant's memory-tier blocks with it.
Now the server maps a region only when neither can happen, and otherwise never touches it
through a mapping:

* **memfd regions** (the default): the client creates a memfd (no ``/dev/shm`` space, no name
  to leak), seals it against shrinking (``F_SEAL_SHRINK``, ``F_SEAL_GROW``, ``F_SEAL_SEAL``) and
  registers it as ``kvs_<hex>@<pid>:<fd>``; the server opens ``/proc/<pid>/fd/<fd>`` (same host,
  same pid namespace, a process of its own user) and maps it only if it is a tmpfs memfd
  (not hugetlbfs, whose faults can SIGBUS) carrying ``F_SEAL_SHRINK``. Such a file can never
  become shorter, and the kernel's internal tmpfs has no size limit (a page it cannot back is an
  out-of-memory, never a SIGBUS), so plain memcpy is safe: one copy at memcpy speed.
* **/dev/shm segments** (``kvs_<hex>``: the fallback where the server cannot open the memfd,
  e.g. another pid namespace, and clients of older versions): the server keeps the segment's fd
  open and copies with ``os.preadv``/``os.pwritev`` into/out of the tier's own buffer (still
  one copy, done by the kernel, which reports a missing page as an error instead of a signal).
  A region found shorter than registered is FAILED_PRECONDITION naming it, a page tmpfs cannot
* Client side, :meth:`kvstore.shm.ShmRegion.create` reserves a segment's pages up front (see
  :mod:`kvstore.shm`).

Regions of clients that are gone: :meth:`AttachedRegion.alive` and
:meth:`AttachedRegion.unlink_if_gone`, by the rules of :mod:`kvstore.shm_sweep`.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from kernels.copy import host_copy
from kvstore.errors import FailedPrecondition, InvalidArgument, PermissionDenied, ResourceExhausted
from kvstore.shm import (
    HEADER_BYTES,
    NAME_PREFIX,
    SHM_DIR,
    check_slot,
    header_nonce,
    header_owner,
    open_segment,
    segment_exists,
    unlink_segment,
)
from kvstore.shm_checks import MEMFD_RE, NAME_RE, check_file, check_memfd, read_header
from kvstore.shm_owner import proc_stat

#: iovecs per preadv/pwritev call (Linux's IOV_MAX)
_IOV_MAX = 1024


class Region(Protocol):
    """The server's view of a registered region (see :class:`AttachedRegion`)."""

    kind: str
    name: str
    size: int

    def check(self, offset: int, length: int) -> None: ...

    def host_view(self, offset: int, length: int) -> np.ndarray | None: ...

    def read_into(self, pairs: Sequence[tuple[int, np.ndarray]]) -> None: ...

    def write_from(self, pairs: Sequence[tuple[int, np.ndarray]]) -> None: ...

    def alive(self) -> bool: ...

    def close(self) -> None: ...


class AttachedRegion:
    """The server's handle on a client's region: :meth:`read_into` (PutLocal) and
    :meth:`write_from` (GetLocal) copy between slots and host buffers, without ever letting a
    missing page turn into SIGBUS (module docstring). ``size`` counts the usable bytes
    registered; ``ident`` is the file's (st_dev, st_ino); ``owner`` its creator, if named."""

    kind = "posix_shm"

    def __init__(self, name: str, size: int, header: bytes, st: os.stat_result) -> None:
        self.name = name
        self.size = self.usable = size
        self.nonce = header_nonce(header)
        self.owner = header_owner(header)
        self.ident = (st.st_dev, st.st_ino)

    def check(self, offset: int, length: int) -> None:
        """InvalidArgument unless ``[offset, offset+length)`` lies in the usable bytes."""
        check_slot(offset, length, self.size)

    def host_view(self, offset: int, length: int) -> np.ndarray | None:
        """The slot's bytes as a flat uint8 array mapped in this process, where touching them
        cannot SIGBUS; None: copy with :meth:`read_into`/:meth:`write_from` only."""
        return None

    def read_into(self, pairs: Sequence[tuple[int, np.ndarray]]) -> None:
        """Copy the slot at each ``offset`` into its flat uint8 host array (of the slot's length)."""
        raise NotImplementedError

    def write_from(self, pairs: Sequence[tuple[int, np.ndarray]]) -> None:
        """Copy each flat uint8 host array into the slot at its ``offset``."""
        raise NotImplementedError

    def gone(self) -> bool:
        """Whether the region's client is known to be gone (its creator; its name)."""
        return self.owner is not None and self.owner.gone()

    def alive(self) -> bool:
        return not self.gone()

    def unlink_if_gone(self) -> bool:
        """Unlink the region's name if its creator is known gone and the name is still this
        file (a segment); True when it did."""
        return False

    def close(self) -> None:
        raise NotImplementedError


class _SegmentRegion(AttachedRegion):
    """A ``/dev/shm`` segment, never mapped here: copies go through its fd (preadv/pwritev)."""

    def __init__(self, name: str, size: int, header: bytes, st: os.stat_result, fd: int) -> None:
        super().__init__(name, size, header, st)
        self._fd = fd
        self._lock = threading.Lock()

    def read_into(self, pairs: Sequence[tuple[int, np.ndarray]]) -> None:
        self._io(pairs, write=False)

    def write_from(self, pairs: Sequence[tuple[int, np.ndarray]]) -> None:
        self._io(pairs, write=True)

    def _io(self, pairs: Sequence[tuple[int, np.ndarray]], write: bool) -> None:
        if not pairs:
            return
        end = HEADER_BYTES + max(off + buf.nbytes for off, buf in pairs)
        try:
            actual = os.fstat(self._fd).st_size
        except OSError as exc:
            raise FailedPrecondition(f"shared-memory region {self.name!r}: {exc.strerror or exc}") from None
        if actual < end:  # NOTE: a write would grow it back; a read would come back short
            raise self._truncated(actual)
        # slots next to each other go in one call (several iovecs)
        start, end, run = 0, 0, []
        for off, buf in sorted(pairs, key=lambda p: p[0]):
            self.check(off, buf.nbytes)
            if run and off == end and len(run) < _IOV_MAX:
                run.append(buf)
            else:
                if run:
                    self._transfer(start, run, write)
                start, run = off, [buf]
            end = off + buf.nbytes
        self._transfer(start, run, write)

    def _transfer(self, offset: int, bufs: list[np.ndarray], write: bool) -> None:
        pos = HEADER_BYTES + offset
        views = [memoryview(b).cast("B") for b in bufs]
        i = 0
        while i < len(views):
            batch = views[i : i + _IOV_MAX]
            try:
                n = os.pwritev(self._fd, batch, pos) if write else os.preadv(self._fd, batch, pos)
            except OSError as exc:
                raise self._error(exc, write) from None
            if n <= 0:
                if write:
                    raise ResourceExhausted(f"shared-memory region {self.name!r}: nothing more could be "
                                            "written into it", resource=SHM_DIR)
                raise self._truncated(pos)
            pos += n
            while n and i < len(views):
                if n >= len(views[i]):
                    n -= len(views[i])
                    i += 1
                else:
                    views[i] = views[i][n:]
                    n = 0

    def _truncated(self, actual: int) -> FailedPrecondition:
        return FailedPrecondition(
            f"shared-memory region {self.name!r} ends at byte {actual}, before the slots of this call: "
            "it was truncated after it was registered; register a new region")

    def _error(self, exc: OSError, write: bool) -> Exception:
        what = exc.strerror or str(exc)
        if exc.errno in (errno.ENOSPC, errno.ENOMEM):
            return ResourceExhausted(
                f"shared-memory region {self.name!r}: {SHM_DIR} cannot back its pages ({what}); the "
                "client should reserve them when it creates the region, or use a larger /dev/shm",
                resource=SHM_DIR)
        return FailedPrecondition(f"cannot {'write into' if write else 'read'} shared-memory region "
                                  f"{self.name!r}: {what}")

    def gone(self) -> bool:
        return not segment_exists(self.name) or super().gone()

    def unlink_if_gone(self) -> bool:
        if self.owner is None or not self.owner.gone():
            return False
        return unlink_segment(self.name, self.ident)

    def close(self) -> None:
        with self._lock:
            fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)


class _MemfdRegion(AttachedRegion):
    """A sealed memfd (it can never shrink, its pages never run out of tmpfs space): mapped,
    copied with memcpy."""

    def __init__(self, name: str, size: int, header: bytes, st: os.stat_result, mm: mmap.mmap,
                 pid: int, fdnum: int = -1) -> None:
        super().__init__(name, size, header, st)
        self._mm = mm
        self._arr = np.frombuffer(mm, dtype=np.uint8)
        self._pid = pid
        self._fdnum = fdnum

    def host_view(self, offset: int, length: int) -> np.ndarray | None:
        self.check(offset, length)
        start = HEADER_BYTES + offset
        return self._arr[start : start + length]

    def read_into(self, pairs: Sequence[tuple[int, np.ndarray]]) -> None:
        for off, dst in pairs:
            host_copy(dst, self.host_view(off, dst.nbytes))

    def write_from(self, pairs: Sequence[tuple[int, np.ndarray]]) -> None:
        for off, src in pairs:
            host_copy(self.host_view(off, src.nbytes), src)

    def gone(self) -> bool:
        # NOTE: its creator holds the memfd; once that process is gone only this mapping does
        if self.owner is None:
            if proc_stat(self._pid) is None:
                return True
        elif super().gone():
            return True
        return self._fdnum >= 0 and not self._still_held()

    def _still_held(self) -> bool:
        """Whether the creator still holds the memfd at the fd it registered. NOTE: a Client
        dropped without close() in a process that lives on closed its fd and unmapped it, but
        the creator's pid lived: the region counted as alive and this mapping kept every page
        it had touched until the process exited."""
        try:
            st = os.stat(f"/proc/{self._pid}/fd/{self._fdnum}")
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self.ident

    def close(self) -> None:
        arr, self._arr = self._arr, None
        del arr
        try:
            self._mm.close()
        except BufferError:
            pass  # NOTE: an array of it still lives (an error's traceback): freed with it


def attach_posix(name: str, size: int) -> AttachedRegion:
    """The server's handle on a client's region of ``size`` usable bytes (it never owns it):
    only a region kvstore's client created, owned by this process's uid (see the module
    docstring); anything else -> PermissionDenied, before it is mapped. The caller still
    compares the :attr:`~AttachedRegion.nonce` with the one its client sent."""
    if not isinstance(name, str) or not name or "/" in name or "\0" in name or len(name) > 200:
        raise InvalidArgument(f"bad shared-memory name {name!r}")
    if size <= 0:
        raise InvalidArgument(f"region size {size} must be positive")
    m = MEMFD_RE.match(name)
    if m is not None:
        return _attach_memfd(name, m.group(1), int(m.group(2)), int(m.group(3)), size)
    if not NAME_RE.match(name):
        raise PermissionDenied(f"{name!r} is not a kvstore region (their names are {NAME_PREFIX} and "
                               "letters, digits, _ or -): register the region kvstore's client created")
    return _attach_segment(name, size)


def _attach_segment(name: str, size: int) -> AttachedRegion:
    try:
        fd = open_segment(name, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise FailedPrecondition(f"shared-memory region {name!r} is not on this host") from None
    except OSError as exc:
        raise FailedPrecondition(f"cannot open shared-memory region {name!r}: {exc}") from None
    try:
        st = check_file(fd, name, size)
        header = read_header(fd, name)
    except BaseException:
        os.close(fd)
        raise
    return _SegmentRegion(name, size, header, st, fd)


def _attach_memfd(name: str, base: str, pid: int, fdnum: int, size: int) -> AttachedRegion:
    path = f"/proc/{pid}/fd/{fdnum}"
    try:
        if os.stat(f"/proc/{pid}").st_uid != os.geteuid():
            raise PermissionDenied(f"region {name!r} belongs to another user's process: run the client "
                                   "as the server's user")
        # NOTE: read before it is opened: only a memfd of that name is ever opened (not a device)
        if os.readlink(path) not in (f"/memfd:{base} (deleted)", f"/memfd:{base}"):
            raise PermissionDenied(f"{name!r} does not name a kvstore memfd region in process {pid}")
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise FailedPrecondition(f"memfd region {name!r} is not on this host (no such process or fd in "
                                 "this pid namespace)") from None
    except OSError as exc:
        raise FailedPrecondition(f"cannot open memfd region {name!r}: {exc.strerror or exc}") from None
    try:
        st = check_file(fd, name, size)
        check_memfd(fd, name, st)
        header = read_header(fd, name)
        owner = header_owner(header)
        if owner is not None and owner.pid != pid:
            raise PermissionDenied(f"memfd region {name!r} was created by another process than {pid}")
        try:
            mm = mmap.mmap(fd, size + HEADER_BYTES)
        except OSError as exc:
            raise FailedPrecondition(f"cannot map memfd region {name!r}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    return _MemfdRegion(name, size, header, st, mm, pid, fdnum)


def attach_region(kind: str, name: str, size: int, cuda_ipc_handle: bytes = b"") -> Region:
    """Server side: a client's region of ``kind`` (``posix_shm``; ``cuda_ipc`` is the seam)."""
    if kind == "posix_shm":
        return attach_posix(name, size)
    if kind == "cuda_ipc":
        raise FailedPrecondition("CUDA IPC regions are not served by this build; use posix_shm")
    raise InvalidArgument(f"unknown region kind {kind!r}")
