"""The in-band Put and Get streams on the server, as plain functions over frames.

* :func:`put_stream` — validates the header frame, reserves a tier slot per new block
  (``Store.reserve_put``), writes every frame's bytes straight into the slots of the blocks it
  spans as it arrives (after checking its xxh3; :func:`receive`: a frame may carry the end of
  one block and the start of the next ones, or, as older clients send, one block's chunk), and
  commits once the whole stream arrived intact; blocks with no slot (already stored, or no
  room above NVMe) go through a reused staging buffer. A cancelled, failed or past-deadline
  Put is aborted: its slots are freed, nothing was visible. With ``plane.auth`` (the registry), the
  caller's right to write is checked again as each block starts and, under
  :meth:`~kvstore.auth.AuthRegistry.holding`, at the commit: a stream opened before its token
  was rotated, its principal deleted or its grant revoked fails and stores nothing.
  NOTE: keeping the received frames until the commit looks cheaper but is not: grpc allocates
  each message afresh, and holding tens of MiB of them makes every call fault in new pages
  (~2 GB/s) where a copy into warm memory runs at ~10 GB/s and lets grpc reuse the freed
  message memory. Writing into the slot is that one copy; staging it first would be a second.
* :func:`get_stream` — takes a read lease on the served prefix (``Store.lease_prefix``: errors
  surface here, before any frame is sent) and returns the header frame plus a generator of data
  frames built straight from the blocks' bytes in their memory tier: one copy, into the frame
  grpc sends. The chunk size is the request's ``chunk_bytes`` kept within [min(64 KiB,
  ``limits.chunk_bytes``), ``limits.chunk_bytes``] (:func:`get_chunk_bytes`: a tiny chunk made
  a frame, with its checksum, per byte). Frames are packed across blocks (each up to the chunk
  size) only when the request sets ``pack_blocks``; otherwise each frame holds part of one block, the layout older clients
  expect. Blocks that must be decoded (NVMe, remote) or live on an accelerator go through
  reused staging buffers. The lease pins the blocks and keeps their memory from being reused
  until the generator ends, is closed (grpc closes it on cancel) or is dropped, so a slow or
  vanished client never reads bytes that changed under it; the Store's lock is not held while
  grpc sends. With ``plane.auth``, the caller's right to read is checked again before each frame: a
  stream whose token was rotated (or grant revoked) meanwhile ends with that error.
  A Get asking for more bytes than ``limits.max_stream_bytes`` is refused (RESOURCE_EXHAUSTED),
  unless the request sets ``partial``: then it serves the leading blocks that fit the limit
  and its header says ``limited`` when the prefix reached that cut (the client asks again from
  the next block). Why: clients learned the limit by parsing the refusal's text. The keys
  past the cut count as misses when the prefix ends before it (with ``keys_after``, the keys
  a client left to later requests), so a Get in pieces counts what one Store.get would.
  A Get of roots (``Target.roots``) serves every key that is stored, the header saying which
  (``present``), the frames carrying the served blocks in key order.

Frames are :mod:`kvstore.frames`; the servicer only authenticates and maps errors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import numpy as np

from kvstore.auth import Principal
from kvstore.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from kvstore.frames import Frame, block_frames, encode, payload_nbytes, scatter, write_into
from kvstore.service_data import Blocks, DataPlane
from kvstore.service_resources import StagingPool
from kvstore.store_lease import ReadLease
from proto.kvstore.v1 import kvstore_pb2 as pb

#: the smallest payload per Get frame: a smaller ``chunk_bytes`` is raised to it (to the server's
#: ``limits.chunk_bytes`` when that is smaller). Every frame costs a checksum, a message and a
#: trip through grpc: at ``chunk_bytes=1`` one 1 MiB block took over 30 s of a worker thread.
MIN_CHUNK_BYTES = 64 * 1024


def get_chunk_bytes(limit: int, requested: int) -> int:
    """The payload per frame of a Get asking for ``requested`` (0 = the server's default):
    ``limit`` (``limits.chunk_bytes``) at most, :data:`MIN_CHUNK_BYTES` (or ``limit``) at least."""
    return max(min(requested or limit, limit), min(MIN_CHUNK_BYTES, limit))


def _check_size(plane: DataPlane, b: Blocks, *, count_blocks: bool = True) -> int:
    """Total payload bytes of ``b``; past a stream limit -> InvalidArgument / ResourceExhausted."""
    limits = plane.limits
    if count_blocks and len(b.keys) > limits.max_blocks_per_stream:
        raise InvalidArgument(f"{len(b.keys)} blocks exceed limits.max_blocks_per_stream={limits.max_blocks_per_stream}")
    total = b.spec.block_nbytes * len(b.keys)
    if total > limits.max_stream_bytes:
        raise ResourceExhausted(f"{total} bytes exceed limits.max_stream_bytes={limits.max_stream_bytes}",
                                resource="limits.max_stream_bytes")
    return total


def put_stream(plane: DataPlane, p: Principal, frames: Iterator[Frame], is_active: Callable[[], bool]) -> int:
    """Receive and commit one Put stream; the number of blocks written. ``plane.auth``
    re-validates ``p`` as each block starts and at the commit."""
    first = next(frames, None)
    if first is not None and first.error:
        raise InvalidArgument(first.error)
    if first is None or not first.meta.HasField("header"):
        raise InvalidArgument("the first Put frame must carry the header")
    if len(first.data):
        raise InvalidArgument("the header frame carries no data")
    header = first.meta.header
    b = plane.resolve(p, header.target, write=True)
    total = _check_size(plane, b)
    nbytes = b.spec.block_nbytes
    auth = plane.auth
    plane.inflight.take(p.name, total)  # NOTE: the caller's budget (it was the target namespace's)
    staged: dict[int, np.ndarray] = {}
    reservation = None
    try:
        reservation = plane.reserve_put(b, p.epoch, header.session)
        slots = reservation.views

        def destination(i: int) -> Any:
            if auth is not None:  # NOTE: fails early; the check that counts is at the commit
                auth.check(p, b.namespace, write=True)
            # a reserved tier slot, else (block already stored, no room above NVMe) staging
            if slots[i] is not None:
                return slots[i]
            staged[i] = plane.staging.take(nbytes)
            return staged[i]

        receive(frames, len(b.keys), nbytes, destination)
        if not is_active():  # cancelled or past its deadline: commit nothing
            raise FailedPrecondition("the Put was cancelled before it completed")
        ttl = header.ttl_s if header.HasField("ttl_s") else None
        n = plane.commit_put(b, reservation, staged.__getitem__, header.session, ttl, p=p)
        reservation = None
        return n
    finally:
        if reservation is not None:
            plane.abort_put(reservation)
        for buf in staged.values():
            plane.staging.give(buf)
        plane.inflight.give(p.name, total)


def receive(frames: Iterator[Frame], n: int, nbytes: int, destination: Callable[[int], Any]) -> None:
    """Write ``n`` blocks of ``nbytes`` from in-order, checksummed data frames, packed across
    blocks or one block per frame, each frame's bytes straight into ``destination(i)`` of every
    block i it spans (a writable buffer, asked for once per block); a bad stream raises
    InvalidArgument (see :func:`kvstore.frames.scatter`)."""
    scatter(frames, n, nbytes, destination, write_into, InvalidArgument)


def get_stream(plane: DataPlane, p: Principal, request: pb.GetRequest) -> Iterator[bytes]:
    """Serve the prefix under a read lease; returns a generator of the header frame, then the
    data frames (packed across blocks when ``request.pack_blocks``), each built straight from
    the blocks' bytes in their tier (one copy). Errors surface here, before any frame is sent.
    The generator holds the lease (and the staging buffers of
    the blocks that had to be decoded or copied off an accelerator) until it ends, is closed
    (grpc closes it on cancel) or is dropped, started or not. ``plane.auth`` re-validates ``p``
    before each data frame (a typed error raised from the generator). A frame counts as sent
    (``plane.sent``) once the consumer asks for the next one (grpc asks once it sent it), and
    the blocks as served (``plane.served``: their prefill tokens) once the last one was."""
    b = plane.resolve(p, request.target)
    nbytes = b.spec.block_nbytes
    fit = plane.limits.max_stream_bytes // max(nbytes, 1)  # whole blocks within the limit
    cut = request.partial and 0 < fit < len(b.keys)
    # the keys of the same get after the ones served here: the client's later requests, and
    # those past the cut (misses too when the prefix ends before it; see Store.lease_prefix)
    after = request.keys_after + (len(b.keys) - fit if cut else 0)
    if cut:  # NOTE: refused before, and clients learned the limit from the refusal's text
        b = replace(b, keys=list(b.keys[:fit]))
    _check_size(plane, b, count_blocks=False)  # bounds what one Get holds (leased or staged)
    chunk = get_chunk_bytes(plane.limits.chunk_bytes, request.chunk_bytes)
    staged: list[np.ndarray] = []

    def stage(_: int) -> np.ndarray:
        staged.append(plane.staging.take(nbytes))
        return staged[-1]

    try:
        lease, present = plane.lease(b, stage, after)
    except BaseException:
        _give_all(plane.staging, staged)
        raise
    served = {id(v) for v in lease.views}
    unused = [buf for buf in staged if id(buf) not in served]  # asked for past the prefix
    staged = [buf for buf in staged if id(buf) in served]
    _give_all(plane.staging, unused)
    n = len(lease.views)
    # limited: the prefix ran to the cut, so it may go on past it (a miss before it ended it);
    # roots: the keys past the cut were not answered
    limited = cut and (present is not None or n == fit)
    header = encode(pb.GetFrame(header=pb.GetHeader(num_blocks=n, block_nbytes=nbytes, limited=limited,
                                                    present=bytes(present) if present is not None else b"")))
    auth = plane.auth
    check = (lambda: auth.check(p, b.namespace)) if auth is not None else None
    frames = _chunks(header, lease, nbytes, chunk, request.pack_blocks, plane.staging, staged, check,
                     sent=lambda k: plane.sent(k, "stream"), done=lambda: plane.served(b.namespace, b.spec, n))
    next(frames)  # NOTE: started, so closing or dropping it runs its finally (an unstarted
    return frames  # generator's never runs: a Get cancelled after its header would leak)


def _chunks(header: bytes, lease: ReadLease, nbytes: int, chunk: int, pack: bool, staging: StagingPool,
            staged: list[np.ndarray], check: Callable[[], None] | None = None, *,
            sent: Callable[[int], None], done: Callable[[], None]) -> Iterator[bytes]:
    """``header``, then the data frames of the leased blocks, ``check()`` before each and
    ``sent(payload bytes)`` after each was taken, ``done()`` after the last; the first value
    (b"") only primes the generator."""
    try:
        yield b""
        yield header
        for frame in block_frames(pb.GetFrame, lease.views, nbytes, chunk, pack=pack):
            if check is not None:
                check()
            yield frame
            sent(payload_nbytes(frame))
        done()
    finally:
        lease.release()
        _give_all(staging, staged)


def _give_all(staging: StagingPool, bufs: list[np.ndarray]) -> None:
    for buf in bufs:
        staging.give(buf)
