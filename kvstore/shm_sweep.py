"""Regions of clients that are gone: the rules, and :func:`sweep_dead_segments`.

Who created a region: :class:`~kvstore.shm_owner.Owner`; what drops a dead registered region:
the server's :class:`~kvstore.service_resources.RegionTable` (with
:meth:`~kvstore.shm_attach.AttachedRegion.alive` and
:meth:`~kvstore.shm_attach.AttachedRegion.unlink_if_gone`).

A client killed with its whole process group (``docker kill``, an OOM kill, a pod deleted)
takes Python's resource tracker with it, so its ``/dev/shm`` segment was never unlinked: the
server, which judged a region by its name existing, kept it registered, the tenant ran into
``max_regions_per_principal`` for good, and the segments held memory even across server
restarts. The rules now:

* every region's header names its creator: pid, start time (``/proc/<pid>/stat``), pid
  namespace and boot id (:class:`~kvstore.shm_owner.Owner`);
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
"""

from __future__ import annotations

import os

from kvstore.shm import HEADER_USED, SHM_DIR, header_owner, unlink_segment, valid_header
from kvstore.shm_checks import NAME_RE, own_file


def sweep_dead_segments(directory: str = SHM_DIR) -> list[str]:
    """Unlink the ``kvs_`` segments of this process's user whose header names a creator known to
    be gone (:meth:`~kvstore.shm_owner.Owner.gone`): what clients killed with their resource tracker left behind.
    The names unlinked. A segment without a kvstore header, of another user, or whose creator
    cannot be judged (another boot or pid namespace) is left alone."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    swept = []
    for name in names:
        if not NAME_RE.match(name):
            continue
        try:
            fd = os.open(os.path.join(directory, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not own_file(st):
                continue
            header = os.pread(fd, HEADER_USED, 0)
        except OSError:
            continue
        finally:
            os.close(fd)
        if not valid_header(header):
            continue
        owner = header_owner(header)
        if owner is not None and owner.gone() and unlink_segment(name, (st.st_dev, st.st_ino)):
            swept.append(name)
    return swept
