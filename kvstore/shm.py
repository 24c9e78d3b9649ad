"""Memory regions shared between a client and the server on the same host.

The local data plane: a client registers a region once; afterwards Put/Get carry keys and
(offset) descriptors only, and the server copies block bytes straight between the region and
its tiers (one copy).

* :class:`ShmRegion` — POSIX shared memory (``multiprocessing.shared_memory``). The creator
  (client) owns and unlinks it; the server attaches without taking ownership.
* The first :data:`HEADER_BYTES` of a region are its header: :data:`MAGIC` at byte 0 and a
  random, never all-zero nonce of :data:`NONCE_BYTES` at :data:`NONCE_OFFSET`, written by
  :meth:`ShmRegion.create`. Block slots start at :data:`HEADER_BYTES`.

What the server attaches (:meth:`ShmRegion.attach`, :class:`kvstore.service_resources.RegionTable`):
the server reads and writes a registered region on the caller's behalf (Put reads it, Get
writes it), so it maps only a region that kvstore's client created, for a caller that can read
it. Before, any POSIX segment in ``/dev/shm`` whose first 16 bytes equalled the nonce sent was
mapped: a foreign program's segment with a zeroed head passed with a zero nonce, and a tenant
could then read and overwrite that program's memory through slot offsets. Now:

* the name must be ``kvs_`` + letters, digits, ``_`` or ``-`` (what ``create`` makes): other
  segments are refused before they are opened (PERMISSION_DENIED);
* the segment must belong to the server's own uid. Decision: a region is created with mode
  0600, so a client running as another user could never be opened by a non-root server
  anyway; the check adds that a server running as root does not map segments of other users
  (which it could open). Clients of a sidecar run as the sidecar's user;
* its header must hold :data:`MAGIC` and a nonce that is not all zeros (checked with a read
  of the header, before the segment is mapped);
* the caller must send that nonce (the registry compares it): proof that it can read the
  region, which a caller that only knows the name from ``/dev/shm`` cannot give. The server
  echoes the nonce, which shows the client both sides see the same memory (a same-named region
  on another host or in another container would not match);
* a region registered by one principal is refused to every other, even with the right nonce
  (the registry; a caller of the same uid can read any region of that uid).
* CUDA seam: a device region would implement the same :class:`Region` protocol around a CUDA IPC
  memory handle (``torch.cuda`` / ``cudaIpcOpenMemHandle``) and return device tensors from
  ``view``; :func:`attach_region` is where that kind is dispatched. Not served yet.

Regions are not thread-safe by themselves; the client allocates slots under its own lock and
the server only touches the slots named in one call.
"""

from __future__ import annotations

import _posixshmem  # CPython's POSIX shm_open (what multiprocessing.shared_memory uses)
import mmap
import os
import re
import secrets
import stat
from collections.abc import Callable
from multiprocessing import shared_memory
from typing import Protocol

from kvstore.errors import FailedPrecondition, InvalidArgument, PermissionDenied

HEADER_BYTES = 4096
NONCE_BYTES = 16
#: at byte 0 of every region kvstore's client creates; a segment without it is never mapped
MAGIC = b"KVSTORE-REGION-v1"
NONCE_OFFSET = 32
NAME_PREFIX = "kvs_"
_NAME_RE = re.compile(r"^kvs_[A-Za-z0-9_-]{1,196}$")


class Region(Protocol):
    kind: str
    name: str
    size: int

    def view(self, offset: int, length: int) -> memoryview: ...

    def alive(self) -> bool: ...

    def close(self) -> None: ...


class ShmRegion:
    """A POSIX shared-memory region. ``size`` counts mapped bytes, header included."""

    kind = "posix_shm"

    def __init__(self, name: str, buf: memoryview, closer: Callable[[], None],
                 unlinker: Callable[[], None] | None) -> None:
        self.name = name
        self.size = len(buf)
        self._buf = buf
        self._closer = closer
        self._unlinker = unlinker

    @classmethod
    def create(cls, size: int) -> ShmRegion:
        """Create a fresh region of ``size`` usable bytes (plus the header) and write its header:
        :data:`MAGIC` and a random nonce (never all zeros)."""
        if size <= 0:
            raise InvalidArgument("region size must be positive")
        name = f"{NAME_PREFIX}{secrets.token_hex(12)}"
        shm = shared_memory.SharedMemory(name=name, create=True, size=size + HEADER_BYTES)
        region = cls(shm.name, shm.buf, shm.close, shm.unlink)
        nonce = bytes(NONCE_BYTES)
        while not any(nonce):
            nonce = secrets.token_bytes(NONCE_BYTES)
        shm.buf[NONCE_OFFSET : NONCE_OFFSET + NONCE_BYTES] = nonce
        shm.buf[: len(MAGIC)] = MAGIC
        return region

    @classmethod
    def attach(cls, name: str, size: int) -> ShmRegion:
        """Map an existing region without owning it (the creator unlinks it): only a region
        kvstore's client created, owned by this process's uid (see the module docstring);
        anything else -> PermissionDenied, before it is mapped. The caller still compares the
        :attr:`nonce` with the one its client sent.

        NOTE: maps with shm_open + mmap rather than ``SharedMemory``: before Python 3.13 that
        class registers even an attached segment with the resource tracker, which would unlink
        the client's region when the server exits.
        """
        if not isinstance(name, str) or not name or "/" in name or "\0" in name or len(name) > 200:
            raise InvalidArgument(f"bad shared-memory name {name!r}")
        if not _NAME_RE.match(name):
            raise PermissionDenied(f"{name!r} is not a kvstore region (their names are {NAME_PREFIX} and "
                                   "letters, digits, _ or -): register the region kvstore's client created")
        try:
            fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
        except FileNotFoundError:
            raise FailedPrecondition(f"shared-memory region {name!r} is not on this host") from None
        except OSError as exc:
            raise FailedPrecondition(f"cannot open shared-memory region {name!r}: {exc}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                raise PermissionDenied(f"region {name!r} belongs to another user: run the client as the "
                                       "server's user")
            actual = st.st_size
            if actual < size + HEADER_BYTES:
                raise InvalidArgument(f"region {name!r} is {actual} bytes, smaller than declared {size}")
            header = os.pread(fd, NONCE_OFFSET + NONCE_BYTES, 0)
            if not _valid_header(header):
                raise PermissionDenied(f"{name!r} is not a region kvstore's client created (no kvstore "
                                       "header): register the region your client created")
            mm = mmap.mmap(fd, actual)
        finally:
            os.close(fd)
        return cls(name, memoryview(mm), mm.close, None)

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
        """Whether the region's name still exists. Its creator unlinks it on close, and Python's
        resource tracker does when the creator dies without closing (even on SIGKILL), so a
        region of a client that is gone is not alive; the server drops such regions."""
        try:
            fd = _posixshmem.shm_open("/" + self.name.lstrip("/"), os.O_RDONLY, mode=0o600)
        except FileNotFoundError:
            return False
        except OSError:
            return True  # cannot tell (e.g. permissions): keep it
        os.close(fd)
        return True

    def close(self) -> None:
        """Unlink (owner only) and unmap. A view still exported keeps the mapping alive until it
        is released; the name is gone either way."""
        if self._unlinker is not None:
            try:
                self._unlinker()
            except FileNotFoundError:
                pass
            self._unlinker = None
        self._buf.release()
        try:
            self._closer()
        except BufferError:
            pass  # NOTE: a caller still holds a view; the mapping is freed when it is collected


def _valid_header(header: bytes) -> bool:
    """Whether ``header`` (the first bytes of a segment) is a kvstore region's: :data:`MAGIC`
    and a nonce that is not all zeros."""
    nonce = header[NONCE_OFFSET : NONCE_OFFSET + NONCE_BYTES]
    return header[: len(MAGIC)] == MAGIC and len(nonce) == NONCE_BYTES and any(nonce)


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
    """Server side: map a client's region of ``kind`` (``posix_shm``; ``cuda_ipc`` is the seam)."""
    if kind == "posix_shm":
        return ShmRegion.attach(name, size)
    if kind == "cuda_ipc":
        raise FailedPrecondition("CUDA IPC regions are not served by this build; use posix_shm")
    raise InvalidArgument(f"unknown region kind {kind!r}")
