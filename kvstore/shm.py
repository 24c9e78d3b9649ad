"""Memory regions shared between a client and the server on the same host.

The local data plane: a client registers a region once; afterwards Put/Get carry keys and
(offset) descriptors only, and the server copies block bytes straight between the region and
its tiers (one copy).

* :class:`ShmRegion` — the client's region (:meth:`ShmRegion.create`): a sealed memfd by
  default, or a POSIX shared-memory segment in ``/dev/shm`` (``multiprocessing.shared_memory``).
  The creator (client) owns it: it unlinks a segment, closes a memfd.
* :class:`AttachedRegion` — the server's handle on a client's region
  (:meth:`ShmRegion.attach`, :func:`attach_region`).
* The first :data:`HEADER_BYTES` of a region are its header: :data:`MAGIC` at byte 0, a random,
  never all-zero nonce of :data:`NONCE_BYTES` at :data:`NONCE_OFFSET`, and its creator
  (:class:`Owner`) at :data:`OWNER_OFFSET`, written by :meth:`ShmRegion.create`. Block slots
  start at :data:`HEADER_BYTES`.

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
  back RESOURCE_EXHAUSTED naming it, for that one call.
* Client side, :meth:`ShmRegion.create` reserves a segment's pages up front
  (``posix_fallocate``): a ``/dev/shm`` too small for it fails there, RESOURCE_EXHAUSTED saying
  so, and the client uses streams, instead of the client (writing) or the server (reading or
  writing) dying later on a page tmpfs could not back.

Regions of clients that are gone (``Owner``; the server's :class:`~kvstore.service_resources.RegionTable`)
---------------------------------------------------------------------------------------------------------

A client killed with its whole process group (``docker kill``, an OOM kill, a pod deleted)
takes Python's resource tracker with it, so its ``/dev/shm`` segment was never unlinked: the
server, which judged a region by its name existing, kept it registered, the tenant ran into
``max_regions_per_principal`` for good, and the segments held memory even across server
restarts. The rules now:

* every region's header names its creator: pid, start time (``/proc/<pid>/stat``), pid
  namespace and boot id (:class:`Owner`);
* a region is **dead** when its ``/dev/shm`` name is gone, or when its creator is *known* gone:
  same boot and pid namespace as the server (else it cannot tell, and the region counts as
  alive), and no process of that pid with that start time is running (a zombie counts as
  gone). The server drops a dead region, and unlinks a dead creator's segment (only if the name
  is still that very file). A memfd region is freed once its creator and the server let go;
* at ``max_regions_per_principal`` a new registration drops the principal's least recently
  used region that no call is using and that has been idle for ``region_idle_evict_s`` (never
  unlinked: a live client whose region was dropped is told UNKNOWN region at its next call and
  registers it again, transparently);
* at start the server unlinks the ``kvs_`` segments of its own user whose creator is known to
  be gone (:func:`sweep_dead_segments`).

What the server attaches at all
-------------------------------

The server reads and writes a registered region on the caller's behalf (Put reads it, Get
writes it), so it takes only a region that kvstore's client created, for a caller that can
read it. Before, any POSIX segment in ``/dev/shm`` whose first 16 bytes equalled the nonce sent
was mapped: a foreign program's segment with a zeroed head passed with a zero nonce, and a
tenant could then read and overwrite that program's memory through slot offsets. Now:

* the name must be ``kvs_`` + letters, digits, ``_`` or ``-`` (a segment), or ``kvs_<hex>@<pid>:<fd>``
  (a memfd, whose link in ``/proc`` must read ``/memfd:kvs_<hex>``); anything else is refused
  before it is opened (PERMISSION_DENIED);
* the file (and for a memfd, the process holding it) must belong to the server's own uid.
  Decision: a region is created with mode 0600, so a client running as another user could never
  be opened by a non-root server anyway; the check adds that a server running as root does not
  map segments of other users (which it could open). Clients of a sidecar run as the sidecar's user;
* its header must hold :data:`MAGIC` and a nonce that is not all zeros (checked with a read
  of the header, before anything is mapped);
* the caller must send that nonce (the registry compares it): proof that it can read the
  region, which a caller that only knows the name from ``/dev/shm`` cannot give. The server
  echoes the nonce, which shows the client both sides see the same memory (a same-named region
  on another host or in another container would not match);
* a region registered by one principal is refused to every other, even with the right nonce
  or under another name of the same file (the registry; a caller of the same uid can read any
  region of that uid).
* CUDA seam: a device region would implement the same :class:`Region` protocol around a CUDA IPC
  memory handle (``torch.cuda`` / ``cudaIpcOpenMemHandle``); :func:`attach_region` is where that
  kind is dispatched. Not served yet.

Regions are not thread-safe by themselves; the client allocates slots under its own lock and
the server only touches the slots named in one call (the registry keeps a region open while a
call uses it).
"""

from __future__ import annotations

import _posixshmem  # CPython's POSIX shm_open (what multiprocessing.shared_memory uses)
import ctypes
import errno
import fcntl
import mmap
import os
import re
import secrets
import stat
import struct
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Protocol

import numpy as np

from kernels.copy import host_copy
from kvstore.errors import FailedPrecondition, InvalidArgument, PermissionDenied, ResourceExhausted

HEADER_BYTES = 4096
NONCE_BYTES = 16
#: at byte 0 of every region kvstore's client creates; a segment without it is never mapped
MAGIC = b"KVSTORE-REGION-v1"
NONCE_OFFSET = 32
#: where the header names the region's creator (:class:`Owner`); zeros: not named (older clients)
OWNER_OFFSET = 64
NAME_PREFIX = "kvs_"
SHM_DIR = "/dev/shm"
_NAME_RE = re.compile(r"^kvs_[A-Za-z0-9_-]{1,196}$")
_MEMFD_RE = re.compile(r"^(kvs_[0-9a-f]{8,64})@([1-9][0-9]{0,9}):([0-9]{1,10})$")
_OWNER = struct.Struct("<QQQ16s")  # pid, start time (clock ticks after boot), pid namespace inode, boot id
_TMPFS_MAGIC = 0x01021994
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


# -- creators ----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Owner:
    """The process that created a region, as its header records it."""

    pid: int
    start: int  # clock ticks after boot (field 22 of /proc/<pid>/stat)
    pidns: int  # inode of /proc/self/ns/pid
    boot: bytes  # /proc/sys/kernel/random/boot_id, 16 bytes

    def pack(self) -> bytes:
        return _OWNER.pack(self.pid, self.start, self.pidns, self.boot)

    @classmethod
    def unpack(cls, raw: bytes) -> Owner | None:
        """The owner a header names; None when it names none (zeros: an older client)."""
        if len(raw) < _OWNER.size:
            return None
        pid, start, pidns, boot = _OWNER.unpack_from(raw)
        if not pid:
            return None
        return cls(pid, start, pidns, boot)

    @classmethod
    def current(cls) -> Owner:
        """This process (fields it cannot read are zeros: then nobody can judge it gone)."""
        local = _local()
        stat_ = _proc_stat(os.getpid()) if local.proc_ok else None
        return cls(os.getpid(), stat_[1] if stat_ else 0, local.pidns, local.boot)

    def gone(self) -> bool:
        """True only when this process is known to be gone: it ran on this boot, in this pid
        namespace (and this process's ``/proc`` is of that namespace), and no process of its pid
        and start time runs now (a zombie is gone). False when that cannot be told."""
        local = _local()
        if not (self.start and self.pidns and any(self.boot) and local.proc_ok
                and self.pidns == local.pidns and self.boot == local.boot):
            return False
        found = _proc_stat(self.pid)
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


def _proc_stat(pid: int) -> tuple[str, int] | None:
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


# -- the client's region -------------------------------------------------------------------------
class ShmRegion:
    """The client's region (a memfd or a ``/dev/shm`` segment). ``size`` counts mapped bytes,
    header included."""

    kind = "posix_shm"

    def __init__(self, name: str, buf: memoryview, closer: Callable[[], None],
                 unlinker: Callable[[], None] | None, *, memfd: bool = False) -> None:
        self.name = name
        self.size = len(buf)
        self.memfd = memfd
        self._buf = buf
        self._closer = closer
        self._unlinker = unlinker
        self._closed = False

    @classmethod
    def create(cls, size: int, *, memfd: bool = False) -> ShmRegion:
        """Create a fresh region of ``size`` usable bytes (plus the header) and write its header:
        :data:`MAGIC`, a random nonce (never all zeros) and this process as its :class:`Owner`.

        ``memfd``: a sealed memfd (no ``/dev/shm`` space; FailedPrecondition where there are
        none). Else a ``/dev/shm`` segment whose pages are reserved now: ResourceExhausted when
        ``/dev/shm`` cannot hold it (see the module docstring)."""
        if size <= 0:
            raise InvalidArgument("region size must be positive")
        total = size + HEADER_BYTES
        base = f"{NAME_PREFIX}{secrets.token_hex(12)}"
        region = cls._create_memfd(base, total) if memfd else cls._create_segment(base, total)
        try:
            nonce = bytes(NONCE_BYTES)
            while not any(nonce):
                nonce = secrets.token_bytes(NONCE_BYTES)
            buf = region._buf
            buf[NONCE_OFFSET : NONCE_OFFSET + NONCE_BYTES] = nonce
            buf[OWNER_OFFSET : OWNER_OFFSET + _OWNER.size] = Owner.current().pack()
            buf[: len(MAGIC)] = MAGIC  # NOTE: last: a half-made header is not a region's
        except BaseException:
            region.close()
            raise
        return region

    @classmethod
    def _create_memfd(cls, base: str, total: int) -> ShmRegion:
        try:
            fd = os.memfd_create(base, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except (AttributeError, OSError) as exc:
            raise FailedPrecondition(f"cannot create a memfd region: {exc}") from None
        try:
            os.ftruncate(fd, total)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            mm = mmap.mmap(fd, total)
        except OSError as exc:
            os.close(fd)
            raise FailedPrecondition(f"cannot create a memfd region of {total} bytes: {exc}") from None

        def closer() -> None:
            try:
                mm.close()
            finally:
                os.close(fd)

        return cls(f"{base}@{os.getpid()}:{fd}", memoryview(mm), closer, None, memfd=True)

    @classmethod
    def _create_segment(cls, base: str, total: int) -> ShmRegion:
        shm = shared_memory.SharedMemory(name=base, create=True, size=total)
        try:
            fd = _posixshmem.shm_open("/" + shm.name, os.O_RDWR, mode=0o600)
            try:
                os.posix_fallocate(fd, 0, total)  # NOTE: every page backed now, or an error now
            finally:
                os.close(fd)
        except OSError as exc:
            shm.close()
            shm.unlink()
            if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                free = _free_bytes(SHM_DIR)
                raise ResourceExhausted(
                    f"{SHM_DIR} has room for {free} more bytes, not a {total}-byte shared-memory region: "
                    "give the Client a smaller region_bytes, or the container a larger /dev/shm "
                    "(docker run --shm-size)", resource=SHM_DIR) from None
            raise FailedPrecondition(f"cannot reserve a {total}-byte shared-memory region in {SHM_DIR}: "
                                     f"{exc.strerror or exc}") from None
        return cls(shm.name, shm.buf, shm.close, shm.unlink)

    @classmethod
    def attach(cls, name: str, size: int) -> AttachedRegion:
        """The server's handle on a client's region of ``size`` usable bytes (it never owns it):
        only a region kvstore's client created, owned by this process's uid (see the module
        docstring); anything else -> PermissionDenied, before it is mapped. The caller still
        compares the :attr:`~AttachedRegion.nonce` with the one its client sent."""
        if not isinstance(name, str) or not name or "/" in name or "\0" in name or len(name) > 200:
            raise InvalidArgument(f"bad shared-memory name {name!r}")
        if size <= 0:
            raise InvalidArgument(f"region size {size} must be positive")
        m = _MEMFD_RE.match(name)
        if m is not None:
            return _attach_memfd(name, m.group(1), int(m.group(2)), int(m.group(3)), size)
        if not _NAME_RE.match(name):
            raise PermissionDenied(f"{name!r} is not a kvstore region (their names are {NAME_PREFIX} and "
                                   "letters, digits, _ or -): register the region kvstore's client created")
        return _attach_segment(name, size)

    @property
    def nonce(self) -> bytes:
        return bytes(self._buf[NONCE_OFFSET : NONCE_OFFSET + NONCE_BYTES])

    @property
    def usable(self) -> int:
        return self.size - HEADER_BYTES

    def view(self, offset: int, length: int) -> memoryview:
        """Bytes ``[offset, offset+length)`` of the usable area; InvalidArgument when out of range."""
        if offset < 0 or length < 0 or offset + length > self.usable:
            raise InvalidArgument(
                f"slot [{offset}, {offset + length}) is outside the region's {self.usable} usable bytes"
            )
        start = HEADER_BYTES + offset
        return self._buf[start : start + length]

    def alive(self) -> bool:
        """Whether the region still exists: a memfd until it is closed; a segment while its
        name exists (its creator unlinks it on close, and Python's resource tracker does when the
        creator dies on its own)."""
        if self.memfd:
            return not self._closed
        return _segment_exists(self.name)

    def close(self) -> None:
        """Unlink (owner only) and unmap. A view still exported keeps the mapping alive until it
        is released; the name is gone either way."""
        if self._unlinker is not None:
            try:
                self._unlinker()
            except FileNotFoundError:
                pass
            self._unlinker = None
        if self._closed:
            return
        self._closed = True
        self._buf.release()
        try:
            self._closer()
        except BufferError:
            pass  # NOTE: a caller still holds a view; the mapping is freed when it is collected


# -- the server's handle -----------------------------------------------------------------------
class AttachedRegion:
    """The server's handle on a client's region: :meth:`read_into` (PutLocal) and
    :meth:`write_from` (GetLocal) copy between slots and host buffers, without ever letting a
    missing page turn into SIGBUS (module docstring). ``size`` counts the usable bytes
    registered; ``ident`` is the file's (st_dev, st_ino); ``owner`` its creator, if named."""

    kind = "posix_shm"

    def __init__(self, name: str, size: int, header: bytes, st: os.stat_result) -> None:
        self.name = name
        self.size = self.usable = size
        self.nonce = bytes(header[NONCE_OFFSET : NONCE_OFFSET + NONCE_BYTES])
        self.owner = Owner.unpack(header[OWNER_OFFSET : OWNER_OFFSET + _OWNER.size])
        self.ident = (st.st_dev, st.st_ino)

    def check(self, offset: int, length: int) -> None:
        """InvalidArgument unless ``[offset, offset+length)`` lies in the usable bytes."""
        if offset < 0 or length < 0 or offset + length > self.size:
            raise InvalidArgument(f"slot [{offset}, {offset + length}) is outside the region's {self.size} "
                                  "usable bytes")

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
        return not _segment_exists(self.name) or super().gone()

    def unlink_if_gone(self) -> bool:
        if self.owner is None or not self.owner.gone():
            return False
        return _unlink_segment(self.name, self.ident)

    def close(self) -> None:
        with self._lock:
            fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)


class _MemfdRegion(AttachedRegion):
    """A sealed memfd (it can never shrink, its pages never run out of tmpfs space): mapped,
    copied with memcpy."""

    def __init__(self, name: str, size: int, header: bytes, st: os.stat_result, mm: mmap.mmap,
                 pid: int) -> None:
        super().__init__(name, size, header, st)
        self._mm = mm
        self._arr = np.frombuffer(mm, dtype=np.uint8)
        self._pid = pid

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
            return _proc_stat(self._pid) is None
        return super().gone()

    def close(self) -> None:
        arr, self._arr = self._arr, None
        del arr
        try:
            self._mm.close()
        except BufferError:
            pass  # NOTE: an array of it still lives (an error's traceback): freed with it


def _read_header(fd: int, name: str) -> bytes:
    header = os.pread(fd, OWNER_OFFSET + _OWNER.size, 0)
    if not _valid_header(header):
        raise PermissionDenied(f"{name!r} is not a region kvstore's client created (no kvstore "
                               "header): register the region your client created")
    return header


def _check_file(fd: int, name: str, size: int) -> os.stat_result:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        raise PermissionDenied(f"region {name!r} belongs to another user: run the client as the "
                               "server's user")
    if st.st_size < size + HEADER_BYTES:
        raise InvalidArgument(f"region {name!r} is {st.st_size} bytes, smaller than declared {size}")
    return st


def _attach_segment(name: str, size: int) -> AttachedRegion:
    try:
        fd = _posixshmem.shm_open("/" + name, os.O_RDWR | getattr(os, "O_CLOEXEC", 0), mode=0o600)
    except FileNotFoundError:
        raise FailedPrecondition(f"shared-memory region {name!r} is not on this host") from None
    except OSError as exc:
        raise FailedPrecondition(f"cannot open shared-memory region {name!r}: {exc}") from None
    try:
        st = _check_file(fd, name, size)
        header = _read_header(fd, name)
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
        st = _check_file(fd, name, size)
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:
            seals = 0
        if not seals & fcntl.F_SEAL_SHRINK:
            raise PermissionDenied(f"memfd region {name!r} is not sealed against shrinking (F_SEAL_SHRINK)")
        if not _on_tmpfs(fd, st):
            raise PermissionDenied(f"memfd region {name!r} is not on tmpfs (hugetlbfs memfds are refused)")
        header = _read_header(fd, name)
        owner = Owner.unpack(header[OWNER_OFFSET : OWNER_OFFSET + _OWNER.size])
        if owner is not None and owner.pid != pid:
            raise PermissionDenied(f"memfd region {name!r} was created by another process than {pid}")
        try:
            mm = mmap.mmap(fd, size + HEADER_BYTES)
        except OSError as exc:
            raise FailedPrecondition(f"cannot map memfd region {name!r}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    return _MemfdRegion(name, size, header, st, mm, pid)


def _on_tmpfs(fd: int, st: os.stat_result) -> bool:
    """Whether ``fd`` is on tmpfs (fstatfs), where a memfd's page faults cannot SIGBUS."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        buf = ctypes.create_string_buffer(256)  # struct statfs; f_type first
        if libc.fstatfs(fd, buf) == 0:
            return ctypes.c_long.from_buffer(buf).value == _TMPFS_MAGIC
    except (OSError, AttributeError):
        pass
    return st.st_blksize == mmap.PAGESIZE  # NOTE: hugetlbfs reports its huge page size


def _valid_header(header: bytes) -> bool:
    """Whether ``header`` (the first bytes of a segment) is a kvstore region's: :data:`MAGIC`
    and a nonce that is not all zeros."""
    nonce = header[NONCE_OFFSET : NONCE_OFFSET + NONCE_BYTES]
    return header[: len(MAGIC)] == MAGIC and len(nonce) == NONCE_BYTES and any(nonce)


def _segment_exists(name: str) -> bool:
    try:
        fd = _posixshmem.shm_open("/" + name.lstrip("/"), os.O_RDONLY, mode=0o600)
    except FileNotFoundError:
        return False
    except OSError:
        return True  # cannot tell (e.g. permissions): keep it
    os.close(fd)
    return True


def _unlink_segment(name: str, ident: tuple[int, int] | None) -> bool:
    """Unlink segment ``name`` if it is still the file ``ident`` (None: whatever it is)."""
    try:
        fd = _posixshmem.shm_open("/" + name, os.O_RDONLY, mode=0o600)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    if ident is not None and (st.st_dev, st.st_ino) != ident:
        return False
    try:
        _posixshmem.shm_unlink("/" + name)
    except OSError:
        return False
    return True


def _free_bytes(path: str) -> int:
    try:
        sv = os.statvfs(path)
    except OSError:
        return 0
    return sv.f_bavail * sv.f_frsize


def sweep_dead_segments(directory: str = SHM_DIR) -> list[str]:
    """Unlink the ``kvs_`` segments of this process's user whose header names a creator known to
    be gone (:meth:`Owner.gone`): what clients killed with their resource tracker left behind.
    The names unlinked. A segment without a kvstore header, of another user, or whose creator
    cannot be judged (another boot or pid namespace) is left alone."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    swept = []
    for name in names:
        if not _NAME_RE.match(name):
            continue
        try:
            fd = os.open(os.path.join(directory, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                continue
            header = os.pread(fd, OWNER_OFFSET + _OWNER.size, 0)
        except OSError:
            continue
        finally:
            os.close(fd)
        if not _valid_header(header):
            continue
        owner = Owner.unpack(header[OWNER_OFFSET:])
        if owner is not None and owner.gone() and _unlink_segment(name, (st.st_dev, st.st_ino)):
            swept.append(name)
    return swept


def is_local_target(target: str) -> bool:
    """True when a gRPC target names this host: ``unix:`` paths and loopback hosts."""
    import ipaddress

    if target.startswith(("unix:", "unix-abstract:")):
        return True
    host = target.rpartition(":")[0] if ":" in target else target
    host = host.strip("[]")
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def attach_region(kind: str, name: str, size: int, cuda_ipc_handle: bytes = b"") -> Region:
    """Server side: a client's region of ``kind`` (``posix_shm``; ``cuda_ipc`` is the seam)."""
    if kind == "posix_shm":
        return ShmRegion.attach(name, size)
    if kind == "cuda_ipc":
        raise FailedPrecondition("CUDA IPC regions are not served by this build; use posix_shm")
    raise InvalidArgument(f"unknown region kind {kind!r}")
