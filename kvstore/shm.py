"""Memory regions shared between a client and the server on the same host: the client's region
and the header format both sides read.

The local data plane: a client registers a region once; afterwards Put/Get carry keys and
(offset) descriptors only, and the server copies block bytes straight between the region and
its tiers (one copy).

* :class:`ShmRegion` — the client's region (:meth:`ShmRegion.create`): a sealed memfd by
  default, or a POSIX shared-memory segment in ``/dev/shm`` (``multiprocessing.shared_memory``).
  The creator (client) owns it: it unlinks a segment, closes a memfd.
* The first :data:`HEADER_BYTES` of a region are its header: :data:`MAGIC` at byte 0, a random,
  never all-zero nonce of :data:`NONCE_BYTES` at :data:`NONCE_OFFSET`, and its creator
  (:class:`~kvstore.shm_owner.Owner`) at :data:`OWNER_OFFSET`, written by
  :meth:`ShmRegion.create`; :func:`valid_header`, :func:`header_nonce` and :func:`header_owner`
  read it. Block slots start at :data:`HEADER_BYTES`.
* :func:`segment_exists`, :func:`unlink_segment` — a ``/dev/shm`` segment by its name.
* The server side: :mod:`kvstore.shm_attach` (its handle on a client's region,
  :func:`~kvstore.shm_attach.attach_region`, and why no client action can SIGBUS it),
  :mod:`kvstore.shm_checks` (what it attaches at all), :mod:`kvstore.shm_sweep` (regions of
  clients that are gone) and :mod:`kvstore.shm_owner` (who created a region).

Client side, :meth:`ShmRegion.create` reserves a segment's pages up front (``posix_fallocate``):
a ``/dev/shm`` too small for it fails there, RESOURCE_EXHAUSTED saying so, and the client uses
streams, instead of the client (writing) or the server (reading or writing) dying later on a page
tmpfs could not back. A memfd region takes no ``/dev/shm`` space, and is sealed against shrinking
and growing (``F_SEAL_SHRINK``, ``F_SEAL_GROW``, ``F_SEAL_SEAL``).

Regions are not thread-safe by themselves; the client allocates slots under its own lock and
the server only touches the slots named in one call (the registry keeps a region open while a
call uses it).
"""

from __future__ import annotations

import _posixshmem  # CPython's POSIX shm_open (what multiprocessing.shared_memory uses)
import errno
import fcntl
import ipaddress
import mmap
import os
import secrets
from collections.abc import Callable
from multiprocessing import shared_memory

from kvstore.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from kvstore.shm_owner import Owner

HEADER_BYTES = 4096
NONCE_BYTES = 16
#: at byte 0 of every region kvstore's client creates; a segment without it is never mapped
MAGIC = b"KVSTORE-REGION-v1"
NONCE_OFFSET = 32
#: where the header names the region's creator (:class:`Owner`); zeros: not named (older clients)
OWNER_OFFSET = 64
#: the bytes of a header that hold anything (magic, nonce, owner): what the server reads of it
HEADER_USED = OWNER_OFFSET + Owner.SIZE
NAME_PREFIX = "kvs_"
SHM_DIR = "/dev/shm"


# -- the header --------------------------------------------------------------------------------
def header_nonce(header: bytes | memoryview) -> bytes:
    """The nonce a region's header holds."""
    return bytes(header[NONCE_OFFSET : NONCE_OFFSET + NONCE_BYTES])


def header_owner(header: bytes | memoryview) -> Owner | None:
    """The creator a region's header names; None when it names none."""
    return Owner.unpack(header[OWNER_OFFSET : OWNER_OFFSET + Owner.SIZE])


def valid_header(header: bytes) -> bool:
    """Whether ``header`` (the first bytes of a segment) is a kvstore region's: :data:`MAGIC`
    and a nonce that is not all zeros."""
    nonce = header_nonce(header)
    return header[: len(MAGIC)] == MAGIC and len(nonce) == NONCE_BYTES and any(nonce)


def check_slot(offset: int, length: int, usable: int) -> None:
    """InvalidArgument unless ``[offset, offset+length)`` lies in a region's ``usable`` bytes."""
    if offset < 0 or length < 0 or offset + length > usable:
        raise InvalidArgument(f"slot [{offset}, {offset + length}) is outside the region's {usable} "
                              "usable bytes")


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
            buf[OWNER_OFFSET : OWNER_OFFSET + Owner.SIZE] = Owner.current().pack()
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
            fd = open_segment(shm.name, os.O_RDWR)
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


    @property
    def nonce(self) -> bytes:
        return header_nonce(self._buf)

    @property
    def usable(self) -> int:
        return self.size - HEADER_BYTES

    def view(self, offset: int, length: int) -> memoryview:
        """Bytes ``[offset, offset+length)`` of the usable area; InvalidArgument when out of range."""
        check_slot(offset, length, self.usable)
        start = HEADER_BYTES + offset
        return self._buf[start : start + length]

    def alive(self) -> bool:
        """Whether the region still exists: a memfd until it is closed; a segment while its
        name exists (its creator unlinks it on close, and Python's resource tracker does when the
        creator dies on its own)."""
        if self.memfd:
            return not self._closed
        return segment_exists(self.name)

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

# -- segments by name --------------------------------------------------------------------------
def open_segment(name: str, flags: int) -> int:
    """``shm_open`` of the ``/dev/shm`` segment ``name`` (mode 0600): its fd, or the OSError."""
    return _posixshmem.shm_open("/" + name.lstrip("/"), flags, mode=0o600)


def segment_exists(name: str) -> bool:
    try:
        fd = open_segment(name, os.O_RDONLY)
    except FileNotFoundError:
        return False
    except OSError:
        return True  # cannot tell (e.g. permissions): keep it
    os.close(fd)
    return True


def unlink_segment(name: str, ident: tuple[int, int] | None) -> bool:
    """Unlink segment ``name`` if it is still the file ``ident`` (None: whatever it is)."""
    try:
        fd = open_segment(name, os.O_RDONLY)
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



def is_local_target(target: str) -> bool:
    """True when a gRPC target names this host: ``unix:`` paths and loopback hosts, also in
    grpc's URI forms (``dns:///localhost:P``, ``dns://resolver/127.0.0.1:P``,
    ``ipv4:127.0.0.1:P``, ``ipv6:[::1]:P``: every address of a list loopback) and in any case
    (``LOCALHOST:P``). NOTE: those forms got the in-band plane, silently; a false positive costs
    nothing but a refused registration (the region's nonce proves the server mapped it)."""
    t = target.strip()
    scheme, sep, rest = t.partition(":")
    scheme = scheme.lower() if sep else ""
    if scheme in ("unix", "unix-abstract"):
        return True
    if scheme == "dns":
        if rest.startswith("//"):  # dns://[authority]/host:port: the authority names a resolver
            rest = rest[2:].partition("/")[2]
        hosts = [rest]
    elif scheme in ("ipv4", "ipv6"):
        hosts = rest.split(",")
    else:
        hosts = [t]
    return all(_is_loopback(h) for h in hosts)


def _is_loopback(hostport: str) -> bool:
    """Whether ``host[:port]`` (``[v6]:port``, a bare v6 address) is this host's loopback."""
    hostport = hostport.strip()
    if hostport.startswith("["):
        host = hostport[1:].partition("]")[0]
    elif hostport.count(":") > 1:
        host = hostport  # a bare IPv6 address, no port
    else:
        host = hostport.partition(":")[0]
    host = host.lower().rstrip(".")
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
