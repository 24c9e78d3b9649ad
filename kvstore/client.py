"""Client of the kvstore sidecar, with the Store's verbs.

::

    from kvstore.client import Client
    with Client("127.0.0.1:50551", token) as kv:
        keys = kv.block_keys(spec, token_ids)
        kv.put(spec, keys, tensor)              # [n, 2, L, H, T, D] of spec.dtype
        hit = kv.lookup(spec, keys)              # LookupResult(num_blocks, tiers)
        blocks = kv.get(spec, keys)              # bit-exact, the longest available prefix

Data planes, chosen automatically:

* **shared memory** when the target is on this host (``unix:`` or a loopback address) and the
  server can map the client's region (proved by a nonce). Put/Get then carry keys and offsets
  only and the server copies between the region and its tiers. Buffers from
  :meth:`Client.local_blocks` already live in the region: put/get on them move the bytes exactly
  once; other tensors are staged through the region (one more copy on the client). A client
  that could not reach its server when it started (an engine up before its sidecar) uses
  streams and registers the region at a later put or get, once the server answers. With
  ``register="at_first_use"`` the constructor makes no call at all: the region is registered
  by the first put or get, within that call's timeout (an engine builds its client outside
  its circuit breaker, and a sidecar that accepts connections but never answers held the
  constructor for a whole timeout).
* **in-band streams** otherwise: blocks in frames of at most ``chunk_bytes`` of payload with an
  xxh3 checksum each (:mod:`kvstore.frames`: the payload is copied once per side, never parsed
  out of a protobuf field). Blocks smaller than a frame share frames, both ways (grpc pays a
  fixed cost per message).

Long chains: every verb takes ``parent=`` (the stored block ``keys[0]`` continues from), as the
Store does. The client uses it itself when a staged get does not fit the free part of the
shared region: it reads the chain in pieces that fit, each continuing from the previous piece's
last key (a miss ends the prefix). An in-band get does the same in pieces of at most the
server's ``limits.max_stream_bytes``: each Get asks for the rest (``GetRequest.partial``), the
server serves what fits that limit and says when it stopped there rather than at a miss (a Get
asking for more was refused, however little of it was stored, and the client learned the limit
from the refusal's text; it still does against a server that predates ``partial``). A staged
put that does not fit goes in-band as one stream
instead, so that a put is all or nothing on either plane (in pieces, a failed later piece left
the earlier ones stored); the stream's limits then apply (``limits.max_blocks_per_stream``,
``max_stream_bytes``): put a bigger one from :meth:`Client.local_blocks`, or in calls of your
own with ``parent=``.

Pages keyed by the engine itself (each block a root of its own, no parent links: SGLang's
HiCache pages) move many to a call: :meth:`Client.lookup_roots` (each key's tier, or None),
``put``/``put_bytes(roots=True)`` (all or nothing, as a chain's put) and
:meth:`Client.get_roots_into` (each key that is stored, and which were), one RPC each where a
call per key cost one RPC per page (``Target.roots``). The client asks the server once, before
its first call with roots, whether it takes them (``WhoAmIResponse.supports_roots``), and refuses
them (FailedPrecondition) against one that predates them, which would treat the keys as a chain.

Timeouts: ``timeout`` bounds each verb as a whole (``close`` aside), however many RPCs a put
or get makes: a registration of the region, pieces of a long chain, fences of calls in doubt
(these may add up to :data:`HELD_FENCE_WAIT_S` before the call and as much after it). A put
or get that registered the region again first waited two timeouts against a hung sidecar.

Errors come back as the same typed exceptions the Store raises (see :mod:`kvstore.status`).
A client is thread-safe.

Like a Store, a client keeps freed large buffers in its process by default
(:func:`kvstore.memtune.retain_freed_memory`): every in-band frame and every grpc message is a
block-sized allocation, and glibc would otherwise map and fault its pages afresh each time
(``python bench/stream_breakdown.py`` with and without it in the client process, two runs
each: in-band put / bare grpcio stream 0.49, 0.49 -> 0.56, 0.59). ``retain_freed_memory=False``
leaves the process's allocator alone.
"""

from __future__ import annotations

import json
import math
import os
import re
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Self

import grpc
import numpy as np
import torch

from kernels.copy import copy_bytes, host_copy
from kvstore import memtune
from kvstore.block import SessionState, Tier
from kvstore.block_buffers import block_views, kv_blocks
from kvstore.client_shm import LocalBlocks, LocalPlane
from kvstore.errors import (
    FailedPrecondition,
    IntegrityError,
    InvalidArgument,
    KVStoreError,
    ResourceExhausted,
    ShapeMismatch,
    UnknownRegion,
)
from kvstore.expiry import check_ttl
from kvstore.frames import Frame, block_frames, decoder, encode, scatter, write_into
from kvstore.keys import KEY_BYTES, ExtraKeys, as_token_array, check_extra_keys, check_keys, extra_items
from kvstore.service_convert import spec_to_pb, tier_names
from kvstore.shm import ShmRegion, is_local_target
from kvstore.spec import ModelSpec, check_spec
from kvstore.status import from_rpc_error
from kvstore.store_reserve import _parent, check_roots
from kvstore.validation import check_text
from proto.kvstore.v1 import admin_pb2_grpc, kvstore_pb2_grpc
from proto.kvstore.v1 import kvstore_pb2 as pb
from tiers.memory import holding_data

MiB = 1 << 20
#: payload bytes per in-band stream message (see :class:`Client`). 2 MiB, not the largest
#: that fits grpc's default 4 MiB message: moving 64 MiB through a sidecar in frames of 1.5, 2,
#: 3 and 4 MiB (scratch A/B in one process, 8 interleaved rounds, medians, 2026-11-30) gave
#: put 2.45 / 2.42 / 2.24 / 1.97 GB/s and get 2.50 / 2.45 / 2.20 / 1.91 with 2 MiB blocks, and
#: put 1.97 / 2.19 / 1.92 / 1.68 with 256 KiB blocks packed several to a frame.
DEFAULT_CHUNK_BYTES = 2 * MiB
#: seconds before a client whose region could not be registered (the server unreachable) tries
#: again, from its next put or get
REGISTER_RETRY_S = 5.0
#: status codes that mean the server could not be reached or did not answer in time
_UNREACHABLE = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED"})
#: how long a call waits for the server's fence of an earlier call in doubt
HELD_FENCE_WAIT_S = 0.05
#: seconds a shared-memory call that failed in doubt (its deadline passed, the server went
#: quiet) waits more for the server's fence before it settles its slots. NOTE: it waited a whole
#: ``timeout`` more: a hung sidecar held a call for twice the timeout the caller gave
FENCE_AFTER_ERROR_S = 1.0


#: what a Get refused for its size names (kvstore.service_streams), and how it states the limit
_STREAM_LIMIT = "limits.max_stream_bytes"
_STREAM_LIMIT_RE = re.compile(r"limits\.max_stream_bytes=(\d+)")


class _InBand(Exception):
    """The region is not registered (the server dropped it and would not take it back: the
    principal's other regions are busy): the call goes in-band instead."""
#: outcomes of a call that the server may not have seen the end of: it may still be running
_IN_DOUBT = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED", "UNKNOWN"})


def _in_doubt(exc: BaseException) -> bool:
    """Whether the server may still be running the call that raised ``exc``: no answer came
    back from it (a status it sent means its handler has returned)."""
    return not isinstance(exc, KVStoreError) or exc.code in _IN_DOUBT


@dataclass(frozen=True, slots=True)
class LookupResult:
    """Longest usable prefix: ``num_blocks`` blocks; ``tiers[i]`` the tier name of block i;
    ``keys`` the block keys when the lookup sent token ids."""

    num_blocks: int
    tiers: list[str]
    keys: list[bytes] | None = None


@dataclass(frozen=True, slots=True)
class ClientTLS:
    """TLS for the channel; ``cert_file``/``key_file`` add a client certificate (mTLS)."""

    root_cert_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    server_name: str | None = None


__all__ = ["Client", "ClientTLS", "LocalBlocks", "LookupResult", "check_text", "spec_to_pb"]

_METHOD = f"/{pb.DESCRIPTOR.services_by_name['KVStore'].full_name}/"


def _pack(keys: Sequence[bytes]) -> bytes:
    """The keys concatenated, each checked to be one key."""
    if type(keys) is list:
        # NOTE: join checks the types as it goes (bytes-like only), so only the lengths are
        # left to count: 8,192 keys in about 0.26 ms instead of check_keys' 0.3 ms plus a join
        try:
            packed = b"".join(keys)
        except TypeError:
            packed = b""
        if len(packed) == KEY_BYTES * len(keys) and list(map(len, keys)).count(KEY_BYTES) == len(keys):
            return packed
    return b"".join(check_keys(keys))


def _as_tensor(arr: np.ndarray, spec: ModelSpec) -> torch.Tensor:
    """``arr`` as a CPU tensor (its values: a non-native byte order converted, a negative
    stride copied), for the shape and dtype checks a tensor gets; InvalidArgument when torch
    has no such dtype."""
    if not arr.dtype.isnative:
        arr = arr.astype(arr.dtype.newbyteorder("="))
    try:
        return torch.from_numpy(np.ascontiguousarray(arr))
    except (TypeError, ValueError):
        raise InvalidArgument(f"kv is a numpy array of dtype {arr.dtype}, which torch cannot take; the "
                              f"spec says {spec.torch_dtype} (raw bytes: put_bytes)") from None


def _flat_bytes(kv: Any, n: int, nbytes: int, what: str = "kv") -> np.ndarray:
    """A [n, nbytes] uint8 numpy view of a CPU tensor/array/buffer (copies only if non-contiguous)."""
    if isinstance(kv, torch.Tensor):
        given = kv.detach()
    elif isinstance(kv, np.ndarray):
        given = kv
    else:  # NOTE: a view through the buffer protocol; np.asarray would copy a list (get_into then
        # wrote into the copy) and turn bytes into one string scalar
        try:
            given = np.frombuffer(kv, dtype=np.uint8)
        except (TypeError, ValueError, BufferError):
            raise InvalidArgument(f"{what} must be a tensor, an array or a buffer of bytes, got "
                                  f"{type(kv).__name__} (one buffer per block: a list or tuple)") from None
    size = given.numel() * given.element_size() if isinstance(given, torch.Tensor) else given.nbytes
    if size != n * nbytes:  # NOTE: checked before any copy
        raise InvalidArgument(f"{what} holds {size} bytes ({given.dtype}, shape {tuple(given.shape)}); "
                              f"{n} blocks of this spec are {n * nbytes} ({nbytes} each)")
    if isinstance(given, torch.Tensor):
        arr = given.cpu().contiguous().view(torch.uint8).numpy()
    else:
        arr = np.ascontiguousarray(given).view(np.uint8)
    return arr.reshape(n, nbytes)


def _check_call(spec: Any, parent: Any, roots: Any = False) -> None:
    """The Store's checks of a verb's ``spec``, ``parent`` and ``roots`` (InvalidArgument),
    before the client uses them: a str spec failed as AttributeError, a str or int parent as
    TypeError from protobuf."""
    check_spec(spec)
    check_roots(roots, _parent(parent))


def _overlapping(t: torch.Tensor) -> bool:
    """Whether elements of ``t`` may share memory (an ``expand()``ed view: a stride 0): its
    dimensions by stride, each must step past everything the smaller ones span."""
    span = 0
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape, strict=True) if sz > 1):
        if stride <= span:
            return True
        span += stride * (size - 1)
    return False


def _host_staging(out: Any) -> Any:
    """None when ``out`` can be written in place as host bytes (a contiguous CPU tensor or
    array); else a contiguous host copy of it to receive into, copied back afterwards."""
    if isinstance(out, torch.Tensor):
        if out.device.type == "cpu" and out.is_contiguous():
            return None
        return out.detach().to("cpu", memory_format=torch.contiguous_format, copy=True)
    if isinstance(out, np.ndarray):
        if not out.flags.writeable:
            raise InvalidArgument("out is read-only")
        return None if out.flags.c_contiguous else np.ascontiguousarray(out)
    try:
        writable = np.frombuffer(out, dtype=np.uint8).flags.writeable
    except (TypeError, ValueError, BufferError):
        return None  # not a buffer: _flat_bytes says so
    if not writable:
        raise InvalidArgument(f"out is read-only ({type(out).__name__})")
    return None


def _receiving_rows(out: Any, spec: ModelSpec, n: int) -> tuple[Any, np.ndarray]:
    """``(host, rows)`` of a get's ``out`` (a tensor, array or buffer of ``n`` blocks): ``rows``
    the [n, block_nbytes] uint8 view to receive into, ``host`` a host copy of ``out`` that
    ``rows`` views (copy it back afterwards: :func:`_copy_back`), or None when they view ``out``."""
    if isinstance(out, torch.Tensor):
        holding_data(out, "out", writable=True)  # NOTE: a negated view failed in a byte view
        if not out.is_contiguous() and _overlapping(out):
            # NOTE: torch refused the copy back into it only after the whole fetch
            raise ShapeMismatch(f"out has elements that share memory (an expand()ed view: shape "
                                f"{tuple(out.shape)}, strides {out.stride()}); pass a tensor that "
                                f"can hold every block, e.g. .clone()")
    host = _host_staging(out)
    return host, _flat_bytes(out if host is None else host, n, spec.block_nbytes, "out")


def _copy_back(out: Any, host: Any) -> None:
    if isinstance(out, torch.Tensor):
        out.copy_(host)
    else:
        np.copyto(out, host)


def _close_plane_in(pid: int, plane: LocalPlane) -> None:
    """Unlink and unmap ``plane``'s region, in the process that created it only: a child of
    fork() that exits (or closes its inherited Client) must not unlink its parent's region,
    which the server would then drop, failing every later shared-memory call of the parent."""
    if os.getpid() == pid:
        plane.close()


def _bearer_token(token: str) -> str:
    """``token`` without surrounding whitespace (a token read from a file keeps its newline).
    An empty token, or one holding anything but visible ASCII -> InvalidArgument here: grpc
    would refuse it only at the first call, as an opaque INTERNAL error."""
    t = token.strip() if isinstance(token, str) else ""
    if not t:
        raise InvalidArgument("the token is empty: pass the one `kvstore serve` (admin) or "
                              "`kvstore tenant add` printed")
    bad = next((i for i, ch in enumerate(t) if not "!" <= ch <= "~"), None)
    if bad is not None:
        raise InvalidArgument(f"the token holds {t[bad]!r} at position {bad}: tokens are visible "
                              "ASCII without spaces")
    return t


@dataclass(frozen=True, slots=True)
class _Put:
    """What one put call asked for (shared by its pieces)."""

    spec: ModelSpec
    keys: list[bytes]
    session: str
    ttl_s: float | None
    namespace: str
    roots: bool = False


class Client:
    """A connection to a kvstore sidecar; see the module docstring."""

    def __init__(self, target: str, token: str, *, local: bool | None = None,
                 region_bytes: int = 256 * MiB, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 max_message_bytes: int = 4 * MiB, timeout: float | None = 60.0,
                 tls: ClientTLS | None = None, options: Sequence[tuple[str, Any]] = (),
                 retain_freed_memory: bool = True, register: Literal["at_start", "at_first_use"] = "at_start") -> None:
        bearer = _bearer_token(token)
        if register not in ("at_start", "at_first_use"):
            raise InvalidArgument(f"register must be 'at_start' or 'at_first_use', got {register!r}")
        if not isinstance(target, str) or not target.strip():
            # NOTE: grpc failed later, as UNKNOWN "Failed to create channel"
            raise InvalidArgument(f"target must name the server (host:port or unix:/path), got {target!r}")
        if retain_freed_memory:
            memtune.retain_freed_memory()
        self.target = target
        self.timeout = timeout
        if not 0 < chunk_bytes <= max_message_bytes - 1024:
            raise InvalidArgument(f"chunk_bytes={chunk_bytes} must be positive and leave 1 KiB of "
                                  f"max_message_bytes={max_message_bytes} for framing")
        self.chunk_bytes = chunk_bytes
        self._metadata = (("authorization", f"Bearer {bearer}"),)
        opts = [("grpc.max_receive_message_length", max_message_bytes),
                ("grpc.max_send_message_length", max_message_bytes), *options]
        if tls is not None:
            read = lambda p: Path(p).read_bytes() if p else None
            creds = grpc.ssl_channel_credentials(read(tls.root_cert_file), read(tls.key_file), read(tls.cert_file))
            if tls.server_name:
                opts.append(("grpc.ssl_target_name_override", tls.server_name))
            self._channel = grpc.secure_channel(target, creds, options=opts)
        else:
            self._channel = grpc.insecure_channel(target, options=opts)
        self._kv = kvstore_pb2_grpc.KVStoreStub(self._channel)
        # Put/Get move raw frames (kvstore.frames), not protobuf-serialized messages
        self._put_frames = self._channel.stream_unary(
            _METHOD + "Put", request_serializer=None, response_deserializer=pb.PutResponse.FromString,
            _registered_method=True)
        self._get_frames = self._channel.unary_stream(
            _METHOD + "Get", request_serializer=pb.GetRequest.SerializeToString,
            response_deserializer=decoder(pb.GetFrame), _registered_method=True)
        self._admin = admin_pb2_grpc.AdminStub(self._channel)
        self._local: LocalPlane | None = None
        self._unlink: weakref.finalize | None = None
        self._pid = os.getpid()
        self._closed = False
        self._region_bytes = region_bytes
        self._register_lock = threading.Lock()
        self._retry_register_at: float | None = None  # monotonic time of the next attempt
        self._register_required = False  # a registration at first use raises when it fails
        # limits.max_stream_bytes of a server that predates GetRequest.partial, once a refusal stated it
        self._stream_cap: int | None = None
        self._roots_ok = False  # the server said it takes Target.roots (see _require_roots)
        auto = local is None
        if auto:
            local = is_local_target(target)
        if local and register == "at_first_use":
            # NOTE: no call here: an engine builds its client outside its guard, and a sidecar
            # that accepts connections but never answers held it for a whole timeout
            self._register_required = not auto
            self._retry_register_at = -math.inf
        elif local:
            # an explicit local=True must succeed; automatic detection falls back to streams
            self._register(required=not auto)

    # -- plumbing -----------------------------------------------------------------------------
    def _usable(self) -> None:
        """FailedPrecondition for a closed client, or one inherited through fork(): its channel
        and its shared-memory region belong to the parent (two processes handing out the same
        slots of one region stored and served each other's bytes)."""
        if self._closed:
            raise FailedPrecondition("this Client is closed")
        if os.getpid() != self._pid:
            raise FailedPrecondition(f"this Client was created in process {self._pid}, before a fork(): "
                                     f"create a new Client in process {os.getpid()}")

    def _call(self, method: Any, request: Any, timeout: float | None = None) -> Any:
        """``method(request)``; ``timeout``: what is left of the caller's (default: the client's)."""
        self._usable()
        try:
            return method(request, metadata=self._metadata, timeout=self.timeout if timeout is None else timeout)
        except (grpc.RpcError, ValueError) as err:
            raise self._failure(err) from None

    def _failure(self, err: grpc.RpcError | ValueError) -> KVStoreError:
        """The typed error of a call that failed with ``err``. One that :meth:`close` cut short
        (grpc cancels the calls in flight, "Channel closed!", and refuses one that starts as it
        closes with ValueError) is FailedPrecondition, as a call made after close is. Why: a
        call under way on another thread got a bare KVStoreError CANCELLED, or ValueError."""
        if isinstance(err, grpc.RpcError):
            exc = from_rpc_error(err)
            if not (self._closed and exc.code in _IN_DOUBT):
                return exc
        elif not self._closed:
            raise err  # NOTE: not grpc's refusal of a closed channel: a bug, let it surface
        return FailedPrecondition("this Client is closed (it closed while this call was under way)")

    def _deadline(self) -> float | None:
        """The monotonic time a public call that makes several RPCs must end by (None: no timeout)."""
        return None if self.timeout is None else time.monotonic() + self.timeout

    @staticmethod
    def _left(deadline: float | None) -> float | None:
        """Seconds left until ``deadline`` for the next RPC of a call (a past one: the smallest
        wait, so grpc answers DEADLINE_EXCEEDED)."""
        return None if deadline is None else max(1e-3, deadline - time.monotonic())

    def _register(self, required: bool, deadline: float | None = None) -> None:
        """Create the shared-memory region and register it: a sealed memfd, else (a server that
        cannot open it: another pid namespace, an older server) a ``/dev/shm`` segment, whose
        pages are reserved as it is made (a ``/dev/shm`` too small for it is an error here, not
        a SIGBUS later). When the server cannot be reached (down, not started yet, not
        answering) and ``required`` is false, the client goes on with streams and tries again
        :data:`REGISTER_RETRY_S` later, from its next put or get: an engine may start before its
        sidecar does. Any other failure leaves it on streams (``required``: raised). ``deadline``:
        the calling put's or get's, which the registration shares (None: the client's timeout)."""
        failure: KVStoreError | None = None
        for memfd in (True, False):
            try:
                region = ShmRegion.create(self._region_bytes, memfd=memfd)
            except KVStoreError as exc:
                failure = exc
                continue
            try:
                region_id = self._register_region(region, self._left(deadline))
            except KVStoreError as exc:
                region.close()
                failure = exc
                if exc.code in _UNREACHABLE or exc.code == "RESOURCE_EXHAUSTED":
                    break  # NOTE: the other kind of region would fare no better
                continue
            self._retry_register_at = None
            self._local = LocalPlane(region, region_id)
            # a client never closed still unlinks its region when collected or at exit (else the
            # resource tracker does, warning of a leak); the server drops regions of clients
            # that are gone
            self._unlink = weakref.finalize(self, _close_plane_in, self._pid, self._local)
            return
        assert failure is not None
        if required:
            raise failure
        transient = failure.code in _UNREACHABLE
        self._retry_register_at = time.monotonic() + REGISTER_RETRY_S if transient else None

    def _plane(self, deadline: float | None = None) -> LocalPlane | None:
        """The shared-memory plane, registered now (within the calling put's or get's
        ``deadline``) if it is registered at first use, or an earlier attempt could not reach
        the server and its retry time has come; None: streams."""
        self._usable()  # NOTE: before the caller copies anything into the region
        due = self._retry_register_at
        if self._local is None and due is not None and time.monotonic() >= due:
            with self._register_lock:
                due = self._retry_register_at
                if self._local is None and due is not None and time.monotonic() >= due:
                    self._register(required=self._register_required, deadline=deadline)
        lp = self._local
        if lp is not None and not lp.region_id:  # dropped by the server, not taken back (_InBand)
            if due is None or time.monotonic() < due:
                return None
            with lp.lock:
                if not lp.region_id:
                    try:
                        lp.region_id = self._register_region(lp.region, self._left(deadline))
                        self._retry_register_at = None
                    except KVStoreError:
                        self._retry_register_at = time.monotonic() + REGISTER_RETRY_S
                        return None
        return lp

    def _register_region(self, region: ShmRegion, timeout: float | None = None) -> int:
        """Register ``region`` with the server; its id there. ``timeout``: what is left of the
        calling put's or get's (default: the client's)."""
        resp = self._call(self._kv.RegisterRegion, pb.RegisterRegionRequest(
            kind=pb.REGION_KIND_POSIX_SHM, name=region.name, size=region.usable, nonce=region.nonce), timeout)
        if resp.nonce != region.nonce:
            raise KVStoreError("the server mapped a different region (not on this host)")
        return resp.region_id

    def _call_local(self, method: Any, request: Any, staged: int | None = None,
                    deadline: float | None = None) -> Any:
        """A PutLocal/GetLocal ``request`` on this client's region, ending by ``deadline``
        (None: each RPC gets the client's timeout). A server that restarted has forgotten the
        region (UnknownRegion, answered before it touched anything): the region is registered
        again and the call made once more, within the same deadline.

        When the call fails, its slots are settled here: ``staged`` (the offset of slots this
        client reserved for the call) is given back once the server is known to be done with
        them, else held (:class:`LocalPlane`). Why: a call that ended without the server's
        answer may still be copying there; its slots were given back at once, and another
        call that reused them stored or read the wrong bytes, with no error. For slots that
        are the caller's own (:class:`LocalBlocks`), the error says they may still be in use."""
        lp = self._local
        assert lp is not None
        request.region_id = lp.region_id
        request.seq = lp.next_seq()
        try:
            try:
                return self._call(method, request, self._left(deadline))
            except UnknownRegion:
                with lp.lock:
                    if lp.region_id == request.region_id:  # NOTE: another thread may have done it
                        try:
                            lp.region_id = self._register_region(lp.region, self._left(deadline))
                        except ResourceExhausted:
                            # NOTE: every later put and get failed RESOURCE_EXHAUSTED while the
                            # principal's other regions were busy: they go in-band until a
                            # retry, REGISTER_RETRY_S later, registers the region again
                            lp.region_id = 0
                            self._retry_register_at = time.monotonic() + REGISTER_RETRY_S
                    if not lp.region_id:
                        raise _InBand from None
                    request.region_id = lp.region_id
                return self._call(method, request, self._left(deadline))
        except _InBand:
            if staged is not None:
                lp.release(staged)  # the server never saw this call
            raise
        except BaseException as exc:
            # NOTE: within what is left of the deadline (at least HELD_FENCE_WAIT_S): past it, a
            # hung sidecar held the call FENCE_AFTER_ERROR_S more; slots not known free are held
            wait = FENCE_AFTER_ERROR_S if deadline is None else \
                min(FENCE_AFTER_ERROR_S, max(HELD_FENCE_WAIT_S, deadline - time.monotonic()))
            # NOTE: a call cut short by close() is FailedPrecondition, but still in doubt
            doubt = _in_doubt(exc) or self._closed
            over = not doubt or self._fence(request.region_id, request.seq, wait_s=wait)
            if staged is not None:
                if over:
                    lp.release(staged)
                else:
                    lp.hold(staged, request.region_id, request.seq)
            elif not over and isinstance(exc, KVStoreError):
                note = "the server may still be copying from or into these shared-memory blocks: do not reuse them yet"
                exc.args = (f"{exc}; {note}",)
            raise

    def _fence(self, region_id: int, seq: int, wait_s: float | None = None) -> bool:
        """True once the server says call ``seq`` on region ``region_id`` is over and will not
        start (or no longer knows the region: a restarted server runs no call of before);
        waiting at most ``wait_s`` (None: the client's timeout)."""
        if self._closed or os.getpid() != self._pid:
            return False  # NOTE: no exception here: this runs while another one is raised
        req = pb.FenceRegionRequest(region_id=region_id, seq=seq)
        try:
            self._kv.FenceRegion(req, metadata=self._metadata, timeout=self.timeout if wait_s is None else wait_s)
        except grpc.RpcError as err:
            return isinstance(from_rpc_error(err), UnknownRegion)
        return True

    def _settle_held(self, lp: LocalPlane) -> None:
        """Give back the slots of earlier calls in doubt that the server has finished (asked
        without waiting long: this runs before a call). NOTE: HELD_FENCE_WAIT_S for all of
        them together, not each: against a hung sidecar every call in doubt is held, and a
        call waited for each one's fence before it started."""
        until = time.monotonic() + HELD_FENCE_WAIT_S

        def fence(region_id: int, seq: int) -> bool:
            left = until - time.monotonic()
            return left > 0 and self._fence(region_id, seq, wait_s=left)

        lp.settle_held(fence)

    @property
    def uses_shared_memory(self) -> bool:
        return self._local is not None

    @staticmethod
    def _target(t: pb.Target, spec: ModelSpec, keys: Sequence[bytes] | None, token_ids: Any,
                namespace: str, parent: bytes | None = None, roots: bool = False) -> None:
        """Fill the request's own ``target`` in place (NOTE: ``Request(target=t)`` would copy
        the packed keys once more: 256 KiB for a 128K-token prompt)."""
        t.spec.CopyFrom(spec_to_pb(spec))
        t.namespace = check_text("namespace", namespace)
        t.parent = parent or b""
        t.roots = roots
        if token_ids is not None:
            ids = as_token_array(token_ids)
            t.tokens.ids.extend(ids.tolist())
        else:
            t.keys = _pack(keys or ())

    def _require_roots(self, deadline: float | None = None) -> None:
        """FailedPrecondition unless the server takes ``Target.roots``, which it says in
        ``WhoAmIResponse.supports_roots``: asked before this client's first call with roots
        (within the calling verb's ``deadline``), then known (a server without it is asked
        again at the next call: it may have been upgraded meanwhile).

        NOTE: a server that predates the field ignores it and treats the keys as a chain: it
        stored a put of roots as a chain and answered a lookup of that batch all present (a
        chain of n keys answers n tier codes, so the length check below passed); a lookup of
        one page alone, or a get, then failed. Checked before the first roots call instead."""
        if self._roots_ok:
            return
        r = self._call(self._kv.WhoAmI, pb.WhoAmIRequest(), self._left(deadline))
        if not r.supports_roots:
            raise FailedPrecondition(f"the kvstore server at {self.target} does not support independent root "
                                     f"keys (Target.roots): it predates them; upgrade it, or use one call per key")
        self._roots_ok = True

    # -- keys and lookup ----------------------------------------------------------------------
    def whoami(self) -> dict[str, Any]:
        r = self._call(self._kv.WhoAmI, pb.WhoAmIRequest())
        return {"principal": r.principal, "role": r.role, "readable": list(r.readable), "writable": list(r.writable)}

    def block_keys(self, spec: ModelSpec, token_ids: Any, extra_keys: Sequence[ExtraKeys | None] | None = None,
                   *, namespace: str = "") -> list[bytes]:
        """Chained keys of every full block, computed by the server in the caller's namespace;
        ``extra_keys`` as :func:`kvstore.keys.block_keys` takes them (one entry per full block:
        None, one bytes/str item or a sequence of them), giving the Store's keys."""
        check_spec(spec)
        req = pb.BlockKeysRequest(spec=spec_to_pb(spec), namespace=check_text("namespace", namespace))
        req.tokens.ids.extend(as_token_array(token_ids).tolist())
        # NOTE: normalised as the Store's keys are (kvstore.keys): a bare str or bytes entry was
        # iterated, per character ("img-A" keyed as ["i", "m", "g", "-", "A"]) or per int (into
        # zero bytes), and int items were taken
        check_extra_keys(extra_keys)
        for extra in extra_keys if extra_keys is not None else ():
            req.tokens.extra.add(items=extra_items(extra))
        packed = self._call(self._kv.BlockKeys, req).keys
        return [packed[i : i + KEY_BYTES] for i in range(0, len(packed), KEY_BYTES)]

    def lookup(self, spec: ModelSpec, keys: Sequence[bytes] | None = None, *, token_ids: Any = None,
               namespace: str = "", parent: bytes | None = None) -> LookupResult:
        """Longest usable prefix of ``keys`` (or of the keys of ``token_ids``, returned too)."""
        _check_call(spec, parent)
        if keys is not None and token_ids is not None:  # NOTE: keys were silently ignored
            raise InvalidArgument("give keys or token_ids, not both")
        req = pb.LookupRequest()
        self._target(req.target, spec, keys, token_ids, namespace, parent)
        r = self._call(self._kv.Lookup, req)
        computed = [r.keys[i : i + KEY_BYTES] for i in range(0, len(r.keys), KEY_BYTES)] if r.keys else None
        return LookupResult(r.num_blocks, tier_names(r.tier_codes), computed)

    def lookup_roots(self, spec: ModelSpec, keys: Sequence[bytes], *, namespace: str = "") -> list[str | None]:
        """The tier name of each of ``keys`` as an independent root block (a one-block prefix:
        stored with ``put(roots=True)``, or as the first block of a chain), None where it is
        absent; one RPC for all of them (``Target.roots``), answering what :meth:`lookup` of
        each key alone would. No keys: no RPC."""
        check_spec(spec)
        keys = check_keys(keys)
        if not keys:
            self._usable()
            return []
        self._require_roots()
        req = pb.LookupRequest()
        self._target(req.target, spec, keys, None, namespace, roots=True)
        codes = self._call(self._kv.Lookup, req).tier_codes
        if len(codes) != len(keys):
            raise FailedPrecondition("the server answered a lookup of roots as a chain: it predates "
                                     "Target.roots (upgrade it, or look keys up one per call)")
        return [name or None for name in tier_names(codes)]

    # -- put ----------------------------------------------------------------------------------
    def put(self, spec: ModelSpec, keys: Sequence[bytes], kv: Any, *, session: str | None = None,
            ttl_s: float | None = None, namespace: str = "", parent: bytes | None = None,
            roots: bool = False) -> None:
        """Store ``kv`` ([len(keys), 2, L, H, T, D] of the spec's dtype: a tensor or a numpy
        array, whose shape and dtype are checked; a uint8 [len(keys), block_nbytes] array or any
        other buffer of the blocks' bytes is taken as raw bytes, checked only for its size)
        under the key chain; ``parent``: the stored block ``keys[0]`` continues from. All or
        nothing; a DEADLINE_EXCEEDED that came while the server committed may leave the put
        stored whole (puts are idempotent: retry). ``roots``: the keys are independent root
        blocks, not a chain (no ``parent``; see :meth:`lookup_roots`), stored in one call."""
        _check_call(spec, parent, roots)
        keys = check_keys(keys)
        if isinstance(kv, np.ndarray) and not (kv.dtype == np.uint8 and kv.shape == (len(keys), spec.block_nbytes)):
            # NOTE: its shape and dtype went unchecked (a wrong layout of the right byte count
            # was stored; a big-endian array, its bytes as they lay). A uint8 [n, block_nbytes]
            # array is the blocks' raw bytes, as put_bytes takes them.
            kv = _as_tensor(kv, spec)
        if isinstance(kv, torch.Tensor):
            # NOTE: the Store's checks (ShapeMismatch, DTypeMismatch: the base InvalidArgument
            # here), and a lazily negated view resolved (its bytes failed in a byte view)
            kv = kv_blocks(spec, kv, len(keys))
        rows = _flat_bytes(kv, len(keys), spec.block_nbytes)
        if not keys:
            # NOTE: as Store.put: nothing to store, nothing asked (the server checked the session,
            # namespace and parent of an in-band one, the shared-memory plane did not)
            self._usable()
            return
        self.put_bytes(spec, keys, rows, session=session, ttl_s=ttl_s, namespace=namespace, parent=parent,
                       roots=roots)

    def put_bytes(self, spec: ModelSpec, keys: Sequence[bytes], blocks: np.ndarray | Sequence[Any], *,
                  session: str | None = None, ttl_s: float | None = None, namespace: str = "",
                  parent: bytes | None = None, roots: bool = False) -> None:
        """Like :meth:`put`, blocks as a [n, block_nbytes] uint8 array or n buffers. A put of
        no blocks stores nothing; as :meth:`kvstore.Store.put_bytes`, it still fails on an unknown
        session, an unstored parent or a namespace the caller may not write (:meth:`put`
        of none returns at once, as Store.put does). ``roots``: as :meth:`put`."""
        _check_call(spec, parent, roots)
        keys = check_keys(keys)
        nbytes = spec.block_nbytes
        rows: Any
        if isinstance(blocks, np.ndarray):
            if blocks.dtype != np.uint8 or blocks.shape != (len(keys), nbytes):
                raise ShapeMismatch(f"blocks is a {blocks.dtype} array of shape {blocks.shape}; "
                                    f"{len(keys)} blocks of this spec are uint8 [{len(keys)}, {nbytes}]")
            rows = np.ascontiguousarray(blocks)
        else:
            rows = [v.cpu().numpy() if isinstance(v, torch.Tensor) else v
                    for v in block_views(spec, blocks, len(keys), "buffer")]
        put = _Put(spec, keys, check_text("session", session or ""), check_ttl(ttl_s),
                   check_text("namespace", namespace), roots)
        # NOTE: one deadline for the whole put, a registration of the region included
        deadline = self._deadline()
        if roots:
            self._require_roots(deadline)
        if not keys:
            # NOTE: as Store.put_bytes, the server checks the session, namespace and parent of a
            # put of no blocks, on either plane (the shared-memory one returned quietly)
            self._put_stream(put, rows, parent)
            return
        lp = self._plane(deadline)
        if lp is not None:
            try:
                with lp.in_use():
                    self._put_local(put, rows, parent, deadline)
                return
            except _InBand:
                pass
        self._put_stream(put, rows, parent, deadline)

    def _put_stream(self, put: _Put, rows: Any, parent: bytes | None, deadline: float | None = None) -> None:
        header = pb.PutHeader(session=put.session)
        self._target(header.target, put.spec, put.keys, None, put.namespace, parent, put.roots)
        if put.ttl_s is not None:
            header.ttl_s = put.ttl_s

        def frames() -> Iterator[bytes]:
            yield encode(pb.PutFrame(header=header))
            yield from block_frames(pb.PutFrame, rows, put.spec.block_nbytes, self.chunk_bytes)

        self._call(self._put_frames, frames(), self._left(deadline))

    def _put_local(self, put: _Put, rows: Any, parent: bytes | None, deadline: float | None = None) -> None:
        lp = self._local
        assert lp is not None
        nbytes = put.spec.block_nbytes
        base = lp.offsets_of(rows) if isinstance(rows, np.ndarray) else None
        if base is not None:  # already in the region: the server copies it once
            self._put_slots(put, put.keys, [base + i * nbytes for i in range(len(put.keys))], parent,
                            deadline=deadline)
            return
        # staged through the region (one more copy), in one call
        if not put.keys:
            return
        self._settle_held(lp)
        off = lp.reserve(len(put.keys) * nbytes)
        if off is None:
            # NOTE: such a put was sent in pieces that fit the region's free part, each its own
            # commit: when a later piece failed (no room left in HBM for a session's blocks, a
            # quota), the earlier ones stayed stored, and pinned with session=, after the call
            # raised. Undoing them is no cure: a delete would also drop blocks stored before
            # this put (puts of existing keys dedupe), maybe read by other clients meanwhile. A
            # Put stream is all or nothing, so the whole put goes in-band (slower, not wrong;
            # bounded by the stream limits, where pieces were not: see the module docstring).
            self._put_stream(put, rows, parent, deadline)
            return
        try:
            for j in range(len(put.keys)):
                host_copy(lp.arena[off + j * nbytes : off + (j + 1) * nbytes], rows[j])
        except BaseException:
            lp.release(off)
            raise
        self._put_slots(put, put.keys, [off + j * nbytes for j in range(len(put.keys))], parent, staged=off,
                        deadline=deadline)
        lp.release(off)

    def _put_slots(self, put: _Put, keys: list[bytes], offsets: list[int], parent: bytes | None,
                   staged: int | None = None, deadline: float | None = None) -> None:
        try:
            req = pb.PutLocalRequest(offsets=offsets, session=put.session)
            self._target(req.target, put.spec, keys, None, put.namespace, parent, put.roots)
            if put.ttl_s is not None:
                req.ttl_s = put.ttl_s
        except BaseException:
            if staged is not None:
                self._local.release(staged)  # type: ignore[union-attr]
            raise
        self._call_local(self._kv.PutLocal, req, staged, deadline)

    # -- get ----------------------------------------------------------------------------------
    def get(self, spec: ModelSpec, keys: Sequence[bytes], *, namespace: str = "",
            parent: bytes | None = None) -> torch.Tensor:
        """The blocks of the longest available prefix: ``[n, 2, L, H, T, D]``, n <= len(keys)."""
        _check_call(spec, parent)
        keys = check_keys(keys)
        out = torch.empty((len(keys), *spec.block_shape), dtype=spec.torch_dtype)
        n = self.get_into(spec, keys, out, namespace=namespace, parent=parent)
        return out[:n]

    def get_into(self, spec: ModelSpec, keys: Sequence[bytes], out: Any, *, namespace: str = "",
                 parent: bytes | None = None) -> int:
        """Copy the longest available prefix into ``out`` (a tensor on any device, an array or a
        writable buffer holding len(keys) blocks' bytes, whatever its dtype; or a list of one
        buffer per block, as :meth:`kvstore.Store.get_into` takes); returns how many leading
        blocks were written. A device tensor or a
        non-contiguous ``out`` is filled through a host copy (the blocks past the prefix keep
        their values). An ``out`` whose elements share memory (an ``expand()``ed view) is
        ShapeMismatch, as a non-contiguous ``out`` of Store.get is, before anything is read."""
        _check_call(spec, parent)
        keys = check_keys(keys)
        if isinstance(out, (list, tuple)):  # one buffer per block, as Store.get_into takes
            views = block_views(spec, out, len(keys), "output buffer", writable=True)
            staged = np.empty((len(keys), spec.block_nbytes), dtype=np.uint8)
            n = self.get_into(spec, keys, staged, namespace=namespace, parent=parent)
            for i in range(n):
                copy_bytes(views[i], staged[i])
            return n
        host, rows = _receiving_rows(out, spec, len(keys))
        if not keys:
            return 0
        # NOTE: one deadline for the whole get, a registration of the region included: the
        # registration and the get had a whole timeout each (a hung sidecar held a get twice it)
        deadline = self._deadline()
        lp = self._plane(deadline)
        n = None
        if lp is not None:
            try:
                with lp.in_use():
                    n = self._get_local(spec, keys, rows, namespace, parent, deadline)
            except _InBand:
                pass  # refused at its first piece (a later one goes on in-band from there)
        if n is None:
            n = self._get_stream(spec, keys, rows, namespace, parent, self._left(deadline))
        if host is not None and n:
            _copy_back(out, host)
        return n

    def get_roots_into(self, spec: ModelSpec, keys: Sequence[bytes], out: Any, *,
                       namespace: str = "") -> list[bool]:
        """Copy each of ``keys`` stored as an independent root block (see :meth:`lookup_roots`)
        into its place in ``out`` (as :meth:`get_into` takes it: len(keys) blocks' bytes, or a
        list of one buffer per key); whether each key was. The place of a miss keeps its
        bytes. One RPC for all of them (``Target.roots``; more only past the server's
        ``limits.max_stream_bytes`` in-band, or the free part of the shared region when ``out``
        is not in it), serving what :meth:`get_into` of each key alone would."""
        check_spec(spec)
        keys = check_keys(keys)
        if isinstance(out, (list, tuple)):  # one buffer per block, as Store.get_roots_into takes
            views = block_views(spec, out, len(keys), "output buffer", writable=True)
            staged = np.empty((len(keys), spec.block_nbytes), dtype=np.uint8)
            present = self.get_roots_into(spec, keys, staged, namespace=namespace)
            for i, hit in enumerate(present):
                if hit:
                    copy_bytes(views[i], staged[i])
            return present
        host, rows = _receiving_rows(out, spec, len(keys))
        if not keys:
            self._usable()
            return []
        deadline = self._deadline()
        self._require_roots(deadline)
        lp = self._plane(deadline)
        present = None
        if lp is not None:
            try:
                with lp.in_use():
                    present = self._get_roots_local(spec, keys, rows, namespace, deadline)
            except _InBand:
                pass
        if present is None:
            present = self._get_roots_stream(spec, keys, rows, namespace, deadline)
        if host is not None and any(present):
            _copy_back(out, host)
        return present

    def _get_roots_stream(self, spec: ModelSpec, keys: list[bytes], rows: np.ndarray, namespace: str,
                          deadline: float | None) -> list[bool]:
        """An in-band get of roots, in pieces within one deadline: a piece the server cut at its
        ``limits.max_stream_bytes`` (``GetHeader.limited``) goes on from the first key it did not
        answer."""
        nbytes = spec.block_nbytes
        present: list[bool] = []
        while len(present) < len(keys):
            start = len(present)
            req = pb.GetRequest(chunk_bytes=self.chunk_bytes, pack_blocks=True, partial=True)
            self._target(req.target, spec, keys[start:], None, namespace, roots=True)
            stream = None
            self._usable()
            try:
                stream = self._get_frames(req, metadata=self._metadata, timeout=self._left(deadline))
                first: Frame = next(stream)
                if first.error or not first.meta.HasField("header"):
                    raise IntegrityError(first.error or "the Get stream did not start with its header")
                head = first.meta.header
                got = [bool(b) for b in head.present]
                served = [start + i for i, hit in enumerate(got) if hit]
                if not got:
                    raise FailedPrecondition("the server answered a get of roots as a chain: it predates "
                                             "Target.roots (upgrade it, or get keys one per call)")
                if (head.num_blocks != len(served) or start + len(got) > len(keys) or head.block_nbytes != nbytes
                        or (start + len(got) < len(keys) and not head.limited)):
                    raise IntegrityError("the server announced blocks this request did not ask for")
                scatter(stream, len(served), nbytes, lambda j, at=served: rows[at[j]], write_into, IntegrityError)
            except (grpc.RpcError, ValueError) as err:
                raise self._failure(err) from None
            finally:
                if stream is not None:
                    stream.cancel()
            present += got
        return present

    def _get_roots_local(self, spec: ModelSpec, keys: list[bytes], rows: np.ndarray, namespace: str,
                         deadline: float | None) -> list[bool]:
        """A get of roots through the shared region: straight into ``rows`` when they live
        there, else staged through its free part in pieces (roots need no order between them);
        a piece that finds no room goes in-band."""
        lp = self._local
        assert lp is not None
        nbytes = spec.block_nbytes
        base = lp.offsets_of(rows)
        if base is not None:
            return self._get_roots_slots(spec, keys, [base + i * nbytes for i in range(len(keys))], namespace,
                                         None, deadline)
        self._settle_held(lp)
        present: list[bool] = []
        while len(present) < len(keys):
            got = len(present)
            off, count = lp.reserve_blocks(len(keys) - got, nbytes)
            if not count:
                return present + self._get_roots_stream(spec, keys[got:], rows[got:], namespace, deadline)
            try:
                hits = self._get_roots_slots(spec, keys[got : got + count], [off + j * nbytes for j in range(count)],
                                             namespace, off, deadline)
            except _InBand:  # the rest in-band, from here (see _get_local)
                return present + self._get_roots_stream(spec, keys[got:], rows[got:], namespace, deadline)
            try:
                for j, hit in enumerate(hits):
                    if hit:
                        host_copy(rows[got + j], lp.arena[off + j * nbytes : off + (j + 1) * nbytes])
            finally:
                lp.release(off)
            present += hits
        return present

    def _get_roots_slots(self, spec: ModelSpec, keys: list[bytes], offsets: list[int], namespace: str,
                         staged: int | None, deadline: float | None) -> list[bool]:
        try:
            req = pb.GetLocalRequest(offsets=offsets)
            self._target(req.target, spec, keys, None, namespace, roots=True)
        except BaseException:
            if staged is not None:
                self._local.release(staged)  # type: ignore[union-attr]
            raise
        present = self._call_local(self._kv.GetLocal, req, staged, deadline).present
        if len(present) != len(keys):
            if staged is not None:
                self._local.release(staged)  # type: ignore[union-attr]
            raise FailedPrecondition("the server answered a get of roots as a chain: it predates "
                                     "Target.roots (upgrade it, or get keys one per call)")
        return [bool(b) for b in present]

    def _get_stream(self, spec: ModelSpec, keys: list[bytes], rows: np.ndarray, namespace: str,
                    parent: bytes | None, timeout: float | None = None) -> int:
        """An in-band get, in pieces within one deadline: the server serves at most its
        ``limits.max_stream_bytes`` per Get (``GetRequest.partial``) and says when it stopped
        there (``GetHeader.limited``) rather than at a miss; the next piece continues from the
        last key served. Why: a Get stream asking for more bytes than that limit was refused
        (RESOURCE_EXHAUSTED) however few of them were stored, where the Store and the
        shared-memory plane return the stored prefix.

        A server that predates ``partial`` still refuses: its refusal states the limit
        (``limits.max_stream_bytes=N``), which the client keeps for its later gets (one refused
        call per client, not per get); a refusal that does not state it halves the piece until
        the server takes it."""
        deadline = time.monotonic() + timeout if timeout is not None else self._deadline()
        nbytes = spec.block_nbytes
        got = 0
        while got < len(keys):
            cap = self._stream_cap
            count = len(keys) - got if cap is None else min(len(keys) - got, max(1, cap // nbytes))
            try:
                k, limited = self._get_piece(spec, keys[got : got + count], rows[got : got + count], namespace,
                                             parent, self._left(deadline), len(keys) - got - count)
            except ResourceExhausted as exc:
                if count == 1 or _STREAM_LIMIT not in str(exc):
                    raise
                stated = _STREAM_LIMIT_RE.search(str(exc))
                limit = int(stated.group(1)) if stated else (count // 2) * nbytes
                self._stream_cap = min(limit, (count - 1) * nbytes)  # NOTE: always fewer blocks than refused
                continue
            got += k
            if k < count and not limited:  # a miss ends the prefix
                break
            if not k:  # NOTE: a server that cut a piece to nothing would loop for ever
                raise IntegrityError("the server served no block of a Get it said it had cut at its limit")
            parent = keys[got - 1]
        return got

    def _get_piece(self, spec: ModelSpec, keys: list[bytes], rows: np.ndarray, namespace: str,
                   parent: bytes | None, timeout: float | None, keys_after: int = 0) -> tuple[int, bool]:
        """One Get stream of ``keys`` into ``rows``: how many leading blocks it wrote, and
        whether the server stopped at its stream limit (more may follow) rather than a miss.
        ``keys_after``: keys of the get after these, left to later pieces (the server counts
        them as misses when the prefix ends within these, as one get of them all would)."""
        req = pb.GetRequest(chunk_bytes=self.chunk_bytes, pack_blocks=True, partial=True, keys_after=keys_after)
        self._target(req.target, spec, keys, None, namespace, parent)
        nbytes = spec.block_nbytes
        stream = None
        self._usable()
        try:
            stream = self._get_frames(req, metadata=self._metadata, timeout=timeout)
            first: Frame = next(stream)
            if first.error or not first.meta.HasField("header"):
                raise IntegrityError(first.error or "the Get stream did not start with its header")
            n = first.meta.header.num_blocks
            if n > len(keys) or first.meta.header.block_nbytes != nbytes:
                raise IntegrityError("the server announced blocks this request did not ask for")
            # frames packed across blocks, or one block each from a server that predates
            # pack_blocks; either way straight into the rows (one copy)
            scatter(stream, n, nbytes, rows.__getitem__, write_into, IntegrityError)
        except (grpc.RpcError, ValueError) as err:
            raise self._failure(err) from None
        finally:
            if stream is not None:
                stream.cancel()  # no-op once the stream completed; stops it on an error
        return n, first.meta.header.limited

    def _get_local(self, spec: ModelSpec, keys: list[bytes], rows: np.ndarray, namespace: str,
                   parent: bytes | None, deadline: float | None = None) -> int:
        lp = self._local
        assert lp is not None
        nbytes = spec.block_nbytes
        base = lp.offsets_of(rows)
        if base is not None:
            return self._get_slots(spec, keys, [base + i * nbytes for i in range(len(keys))], namespace, parent,
                                   deadline=deadline)
        # staged through the region, in pieces that fit its free part (each continues from the
        # previous piece's last key; a get may end short, so pieces need no atomicity)
        self._settle_held(lp)
        got = 0
        # NOTE: one deadline for the whole get (the caller's): each piece had the client's whole timeout
        while got < len(keys):
            off, count = lp.reserve_blocks(len(keys) - got, nbytes)
            if not count:
                return got + self._get_stream(spec, keys[got:], rows[got:], namespace, parent, self._left(deadline))
            try:
                k = self._get_slots(spec, keys[got : got + count], [off + j * nbytes for j in range(count)],
                                    namespace, parent, staged=off, deadline=deadline,
                                    keys_after=len(keys) - got - count)
            except _InBand:
                # NOTE: the rest in-band, from here: the stream read every key again, and the
                # pieces already served were counted twice (hits, misses)
                return got + self._get_stream(spec, keys[got:], rows[got:], namespace, parent, self._left(deadline))
            try:
                for j in range(k):
                    host_copy(rows[got + j], lp.arena[off + j * nbytes : off + (j + 1) * nbytes])
            finally:
                lp.release(off)
            got += k
            if k < count:  # a miss ends the prefix
                break
            parent = keys[got - 1]
        return got

    def _get_slots(self, spec: ModelSpec, keys: list[bytes], offsets: list[int], namespace: str,
                   parent: bytes | None, staged: int | None = None, deadline: float | None = None,
                   keys_after: int = 0) -> int:
        try:
            req = pb.GetLocalRequest(offsets=offsets, keys_after=keys_after)
            self._target(req.target, spec, keys, None, namespace, parent)
        except BaseException:
            if staged is not None:
                self._local.release(staged)  # type: ignore[union-attr]
            raise
        return self._call_local(self._kv.GetLocal, req, staged, deadline).num_blocks

    # -- sessions, prefetch, delete, stats -----------------------------------------------------
    def _session(self, method: Any, session_id: str, namespace: str) -> SessionState | None:
        """A session verb on ``session_id`` in ``namespace`` ("" the caller's own; a publisher
        of several namespaces names the one its puts with ``session=`` name); the session's
        state after it, as the server read it (None from a server that does not say).

        NOTE: every verb returned None: the state the server answers (a re-open of a PAUSED
        session that could not resume stays PAUSED) was thrown away. The Store's pause and
        resume return how many blocks moved; the service does not answer that count, so here
        they return the state too."""
        r = self._call(method, pb.SessionRequest(session_id=check_text("session_id", session_id),
                                                 namespace=check_text("namespace", namespace)))
        name = pb.SessionState.Name(r.state).removeprefix("SESSION_STATE_")
        return SessionState[name] if name in SessionState.__members__ else None

    def open_session(self, session_id: str, *, namespace: str = "") -> SessionState | None:
        """Open a session (re-opening a paused one resumes it, as :meth:`resume_session`);
        its state after the call, as :meth:`kvstore.Store.open_session` returns it."""
        return self._session(self._kv.OpenSession, session_id, namespace)

    def pause_session(self, session_id: str, *, namespace: str = "") -> SessionState | None:
        """Pause a session (its blocks unpinned, kept in DRAM); its state after the call."""
        return self._session(self._kv.PauseSession, session_id, namespace)

    def resume_session(self, session_id: str, *, namespace: str = "") -> SessionState | None:
        """Resume a paused session (its blocks pinned in HBM again); its state after the call."""
        return self._session(self._kv.ResumeSession, session_id, namespace)

    def close_session(self, session_id: str, *, namespace: str = "") -> SessionState | None:
        """Close a session (its blocks unpinned, kept as prefix cache); CLOSED."""
        return self._session(self._kv.CloseSession, session_id, namespace)

    def prefetch(self, spec: ModelSpec, keys: Sequence[bytes], tier: str | Tier = "hbm", *,
                 namespace: str = "", parent: bytes | None = None) -> int:
        _check_call(spec, parent)
        req = pb.PrefetchRequest(tier=int(Tier.parse(tier)) + 1)
        self._target(req.target, spec, keys, None, namespace, parent)
        return self._call(self._kv.Prefetch, req).blocks

    def delete(self, keys: Sequence[bytes], *, namespace: str = "") -> int:
        return self._call(self._kv.Delete, pb.DeleteRequest(namespace=check_text("namespace", namespace),
                                                             keys=_pack(keys))).deleted

    def stats(self) -> dict[str, Any]:
        return json.loads(self._call(self._kv.Stats, pb.StatsRequest()).json)

    # -- lifecycle ----------------------------------------------------------------------------
    def local_blocks(self, spec: ModelSpec, n: int) -> LocalBlocks:
        """A [n, 2, L, H, T, D] tensor inside the shared region: put/get on it copy once."""
        check_spec(spec)
        plane = self._plane()
        if plane is None:
            raise InvalidArgument("no shared-memory region: the server is not local, or could not "
                                  "be reached when the client registered one")
        return LocalBlocks(plane, spec, n)

    def close(self) -> None:
        """Unregister and unlink the shared region and close the channel; calls after it raise
        FailedPrecondition. In a child of fork() it only marks this inherited copy closed: the
        region and the channel are the parent's."""
        self._retry_register_at = None
        if self._closed:
            return
        self._closed = True
        if os.getpid() != self._pid:
            return
        if self._local is not None:
            # NOTE: calls under way on other threads end first (bounded by their timeout)
            self._local.wait_idle(self.timeout)
            try:
                self._kv.UnregisterRegion(pb.UnregisterRegionRequest(region_id=self._local.region_id),
                                          metadata=self._metadata, timeout=self.timeout)
            except grpc.RpcError:
                pass  # NOTE: the server may already be gone; the region is unlinked below anyway
            assert self._unlink is not None
            self._unlink()
            self._local = None
        self._channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
