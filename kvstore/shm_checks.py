"""What the server attaches at all: the checks a client's region passes before it is mapped.

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
* its header must hold :data:`~kvstore.shm.MAGIC` and a nonce that is not all zeros (checked with a read
  of the header, before anything is mapped);
* the caller must send that nonce (the registry compares it): proof that it can read the
  region, which a caller that only knows the name from ``/dev/shm`` cannot give. The server
  echoes the nonce, which shows the client both sides see the same memory (a same-named region
  on another host or in another container would not match);
* a region registered by one principal is refused to every other, even with the right nonce
  or under another name of the same file (the registry; a caller of the same uid can read any
  region of that uid).

The checks, in the order :mod:`kvstore.shm_attach` makes them: :data:`NAME_RE` /
:data:`MEMFD_RE` on the name, :func:`check_file` on the opened file, :func:`check_memfd` on a
memfd's seals and file system, :func:`read_header` on its header.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import re
import stat

from kvstore.errors import InvalidArgument, PermissionDenied
from kvstore.shm import HEADER_BYTES, HEADER_USED, valid_header

# Both end in ``\Z``, not ``$`` (which also matches before a trailing newline), so that the
# ``.match`` of their callers takes the whole name: ``"kvs_x\n"`` is not a region's name.
#: a ``/dev/shm`` segment's name
NAME_RE = re.compile(r"^kvs_[A-Za-z0-9_-]{1,196}\Z")
#: a memfd region's name: ``kvs_<hex>@<pid>:<fd>`` (the base name, the pid, the fd)
MEMFD_RE = re.compile(r"^(kvs_[0-9a-f]{8,64})@([1-9][0-9]{0,9}):([0-9]{1,10})\Z")
_TMPFS_MAGIC = 0x01021994


def own_file(st: os.stat_result) -> bool:
    """Whether ``st`` is a regular file of this process's (effective) uid."""
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()


def check_file(fd: int, name: str, size: int) -> os.stat_result:
    """The stat of region ``name`` (open as ``fd``): PermissionDenied unless it is a regular file
    of the server's uid, InvalidArgument when it is shorter than ``size`` usable bytes."""
    st = os.fstat(fd)
    if not own_file(st):
        raise PermissionDenied(f"region {name!r} belongs to another user: run the client as the "
                               "server's user")
    if st.st_size < size + HEADER_BYTES:
        raise InvalidArgument(f"region {name!r} is {st.st_size} bytes, smaller than declared {size}")
    return st


def check_memfd(fd: int, name: str, st: os.stat_result) -> None:
    """PermissionDenied unless memfd region ``name`` is sealed against shrinking and on tmpfs
    (where its page faults cannot SIGBUS)."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = 0
    if not seals & fcntl.F_SEAL_SHRINK:
        raise PermissionDenied(f"memfd region {name!r} is not sealed against shrinking (F_SEAL_SHRINK)")
    if not _on_tmpfs(fd, st):
        raise PermissionDenied(f"memfd region {name!r} is not on tmpfs (hugetlbfs memfds are refused)")


def read_header(fd: int, name: str) -> bytes:
    """The header of region ``name`` (its first :data:`~kvstore.shm.HEADER_USED` bytes);
    PermissionDenied unless it is a kvstore region's (:func:`~kvstore.shm.valid_header`)."""
    header = os.pread(fd, HEADER_USED, 0)
    if not valid_header(header):
        raise PermissionDenied(f"{name!r} is not a region kvstore's client created (no kvstore "
                               "header): register the region your client created")
    return header


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
