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
  once; other tensors are staged through the region (one more copy on the client).
* **in-band streams** otherwise: blocks in chunks of ``chunk_bytes`` with an xxh3 checksum each.

Errors come back as the same typed exceptions the Store raises (see :mod:`kvstore.status`).
A client is thread-safe.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import torch

from kvstore.block import Tier
from kvstore.errors import InvalidArgument, IntegrityError, KVStoreError
from kvstore.keys import KEY_BYTES
from kvstore.shm import HEADER_BYTES, ShmRegion, is_local_target
from kvstore.spec import ModelSpec
from kvstore.status import from_rpc_error
from proto.kvstore.v1 import admin_pb2 as apb
from proto.kvstore.v1 import admin_pb2_grpc
from proto.kvstore.v1 import kvstore_pb2 as pb
from proto.kvstore.v1 import kvstore_pb2_grpc
from tiers.arena import ExtentAllocator

MiB = 1 << 20


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


def spec_to_pb(spec: ModelSpec) -> pb.ModelSpec:
    return pb.ModelSpec(**{f.name: getattr(spec, f.name) for f in pb.ModelSpec.DESCRIPTOR.fields})


_TIER_NAMES = {int(t) + 1: t.label for t in Tier}


def _tier_name(value: int) -> str:
    return _TIER_NAMES[value]


def _flat_bytes(kv: Any, n: int, nbytes: int) -> np.ndarray:
    """A [n, nbytes] uint8 numpy view of a CPU tensor/array/buffer (copies only if non-contiguous)."""
    if isinstance(kv, torch.Tensor):
        t = kv.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        arr = t.contiguous().view(torch.uint8).numpy()
    else:
        arr = np.ascontiguousarray(np.asarray(kv)).view(np.uint8)
    arr = arr.reshape(-1)
    if arr.size != n * nbytes:
        raise InvalidArgument(f"{arr.size} bytes for {n} blocks of {nbytes}")
    return arr.reshape(n, nbytes)


class _LocalPlane:
    """The client's shared-memory region, registered with the server, and its slot allocator."""

    def __init__(self, region: ShmRegion, region_id: int) -> None:
        self.region = region
        self.region_id = region_id
        self.arena = np.frombuffer(region.view(0, region.usable), dtype=np.uint8)
        self.base = self.arena.ctypes.data
        self.alloc = ExtentAllocator(region.usable, alignment=4096)
        self.lock = threading.Lock()

    def offsets_of(self, arr: np.ndarray) -> int | None:
        """Offset of a contiguous array inside the region, or None when it lives elsewhere."""
        addr = arr.ctypes.data
        if self.base <= addr and addr + arr.nbytes <= self.base + self.arena.size:
            return addr - self.base
        return None

    def reserve(self, nbytes: int) -> int | None:
        with self.lock:
            return self.alloc.alloc(nbytes)

    def release(self, offset: int) -> None:
        with self.lock:
            self.alloc.free(offset)

    def close(self) -> None:
        del self.arena
        self.region.close()


class Client:
    """A connection to a kvstore sidecar; see the module docstring."""

    def __init__(self, target: str, token: str, *, local: bool | None = None,
                 region_bytes: int = 256 * MiB, chunk_bytes: int = 4 * MiB - 4096,
                 max_message_bytes: int = 4 * MiB, timeout: float | None = 60.0,
                 tls: ClientTLS | None = None, options: Sequence[tuple[str, Any]] = ()) -> None:
        self.target = target
        self.timeout = timeout
        self.chunk_bytes = chunk_bytes
        self._metadata = (("authorization", f"Bearer {token}"),)
        opts = [("grpc.max_receive_message_length", max_message_bytes),
                ("grpc.max_send_message_length", max_message_bytes), *options]
        if tls is not None:
            read = lambda p: Path(p).read_bytes() if p else None  # noqa: E731
            creds = grpc.ssl_channel_credentials(read(tls.root_cert_file), read(tls.key_file), read(tls.cert_file))
            if tls.server_name:
                opts.append(("grpc.ssl_target_name_override", tls.server_name))
            self._channel = grpc.secure_channel(target, creds, options=opts)
        else:
            self._channel = grpc.insecure_channel(target, options=opts)
        self._kv = kvstore_pb2_grpc.KVStoreStub(self._channel)
        self._admin = admin_pb2_grpc.AdminStub(self._channel)
        self._local: _LocalPlane | None = None
        auto = local is None
        if auto:
            local = is_local_target(target)
        if local:
            # an explicit local=True must succeed; automatic detection falls back to streams
            self._local = self._register(region_bytes, required=not auto)

    # -- plumbing -----------------------------------------------------------------------------
    def _call(self, method: Any, request: Any) -> Any:
        try:
            return method(request, metadata=self._metadata, timeout=self.timeout)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    def _register(self, size: int, required: bool) -> _LocalPlane | None:
        region = ShmRegion.create(size)
        try:
            resp = self._call(self._kv.RegisterRegion, pb.RegisterRegionRequest(
                kind=pb.REGION_KIND_POSIX_SHM, name=region.name, size=region.usable, nonce=region.nonce))
            if resp.nonce != region.nonce:
                raise KVStoreError("the server mapped a different region (not on this host)")
        except KVStoreError:
            region.close()
            if required:
                raise
            return None
        return _LocalPlane(region, resp.region_id)

    @property
    def uses_shared_memory(self) -> bool:
        return self._local is not None

    @staticmethod
    def _target(spec: ModelSpec, keys: Sequence[bytes] | None, token_ids: Any, namespace: str) -> pb.Target:
        t = pb.Target(spec=spec_to_pb(spec), namespace=namespace)
        if token_ids is not None:
            ids = np.asarray(token_ids.cpu() if isinstance(token_ids, torch.Tensor) else token_ids, dtype=np.int64)
            t.tokens.ids.extend(ids.tolist())
        else:
            t.keys = b"".join(bytes(k) for k in keys or ())
        return t

    # -- keys and lookup ----------------------------------------------------------------------
    def whoami(self) -> dict[str, Any]:
        r = self._call(self._kv.WhoAmI, pb.WhoAmIRequest())
        return {"principal": r.principal, "role": r.role, "readable": list(r.readable), "writable": list(r.writable)}

    def block_keys(self, spec: ModelSpec, token_ids: Any, extra_keys: Sequence[Sequence[bytes] | None] | None = None,
                   *, namespace: str = "") -> list[bytes]:
        """Chained keys of every full block, computed by the server in the caller's namespace."""
        req = pb.BlockKeysRequest(spec=spec_to_pb(spec), namespace=namespace)
        req.tokens.ids.extend(np.asarray(token_ids, dtype=np.int64).tolist())
        for extra in extra_keys or ():
            req.tokens.extra.add(items=[e.encode() if isinstance(e, str) else bytes(e) for e in extra or ()])
        packed = self._call(self._kv.BlockKeys, req).keys
        return [packed[i : i + KEY_BYTES] for i in range(0, len(packed), KEY_BYTES)]

    def lookup(self, spec: ModelSpec, keys: Sequence[bytes] | None = None, *, token_ids: Any = None,
               namespace: str = "") -> LookupResult:
        r = self._call(self._kv.Lookup, pb.LookupRequest(target=self._target(spec, keys, token_ids, namespace)))
        computed = [r.keys[i : i + KEY_BYTES] for i in range(0, len(r.keys), KEY_BYTES)] if r.keys else None
        return LookupResult(r.num_blocks, [_tier_name(t) for t in r.tiers], computed)

    # -- put ----------------------------------------------------------------------------------
    def put(self, spec: ModelSpec, keys: Sequence[bytes], kv: Any, *, session: str | None = None,
            ttl_s: float | None = None, namespace: str = "") -> None:
        """Store ``kv`` ([len(keys), 2, L, H, T, D] of the spec's dtype) under the key chain."""
        if isinstance(kv, torch.Tensor):
            want = (len(keys), *spec.block_shape)
            if tuple(kv.shape) != want:
                raise InvalidArgument(f"kv has shape {tuple(kv.shape)}, expected {want}")
            if kv.dtype != spec.torch_dtype:
                raise InvalidArgument(f"kv has dtype {kv.dtype}, spec says {spec.torch_dtype}")
        self.put_bytes(spec, keys, _flat_bytes(kv, len(keys), spec.block_nbytes), session=session,
                       ttl_s=ttl_s, namespace=namespace)

    def put_bytes(self, spec: ModelSpec, keys: Sequence[bytes], blocks: np.ndarray | Sequence[Any], *,
                  session: str | None = None, ttl_s: float | None = None, namespace: str = "") -> None:
        """Like :meth:`put`, blocks as a [n, block_nbytes] uint8 array or n buffers."""
        nbytes = spec.block_nbytes
        rows = blocks if isinstance(blocks, np.ndarray) and blocks.ndim == 2 else \
            [np.frombuffer(b, dtype=np.uint8) for b in blocks]
        if len(rows) != len(keys):
            raise InvalidArgument(f"{len(rows)} blocks for {len(keys)} keys")
        if self._local is not None:
            self._put_local(spec, list(keys), rows, session, ttl_s, namespace)
        else:
            self._put_stream(spec, list(keys), rows, session, ttl_s, namespace)

    def _put_stream(self, spec: ModelSpec, keys: list[bytes], rows: Any, session: str | None,
                    ttl_s: float | None, namespace: str) -> None:
        header = pb.PutHeader(target=self._target(spec, keys, None, namespace), session=session or "")
        if ttl_s is not None:
            header.ttl_s = ttl_s
        nbytes, step = spec.block_nbytes, self.chunk_bytes
        import xxhash

        def messages() -> Iterator[pb.PutChunk]:
            yield pb.PutChunk(header=header)
            for i, row in enumerate(rows):
                view = memoryview(row)
                for off in range(0, nbytes, step):
                    data = bytes(view[off : off + step])
                    yield pb.PutChunk(chunk=pb.BlockChunk(block=i, offset=off, data=data,
                                                          xxh3=xxhash.xxh3_64_intdigest(data)))

        self._call(self._kv.Put, messages())

    def _put_local(self, spec: ModelSpec, keys: list[bytes], rows: Any, session: str | None,
                   ttl_s: float | None, namespace: str) -> None:
        lp = self._local
        assert lp is not None
        nbytes = spec.block_nbytes
        inside = isinstance(rows, np.ndarray) and lp.offsets_of(rows) is not None
        if inside:
            base = lp.offsets_of(rows)
            self._put_slots(spec, keys, [base + i * nbytes for i in range(len(keys))], session, ttl_s, namespace)
            return
        # staged: one more copy into the region. A chain cannot be split across calls (each
        # call's first key is a root), so a request larger than the free region goes in-band.
        off = lp.reserve(nbytes * len(keys))
        if off is None:
            self._put_stream(spec, keys, rows, session, ttl_s, namespace)
            return
        try:
            for j in range(len(keys)):
                np.copyto(lp.arena[off + j * nbytes : off + (j + 1) * nbytes], rows[j])
            self._put_slots(spec, keys, [off + j * nbytes for j in range(len(keys))], session, ttl_s, namespace)
        finally:
            lp.release(off)

    def _put_slots(self, spec: ModelSpec, keys: list[bytes], offsets: list[int], session: str | None,
                   ttl_s: float | None, namespace: str) -> None:
        assert self._local is not None
        req = pb.PutLocalRequest(target=self._target(spec, keys, None, namespace), region_id=self._local.region_id,
                                 offsets=offsets, session=session or "")
        if ttl_s is not None:
            req.ttl_s = ttl_s
        self._call(self._kv.PutLocal, req)

    # -- get ----------------------------------------------------------------------------------
    def get(self, spec: ModelSpec, keys: Sequence[bytes], *, namespace: str = "") -> torch.Tensor:
        """The blocks of the longest available prefix: ``[n, 2, L, H, T, D]``, n <= len(keys)."""
        out = torch.empty((len(keys), *spec.block_shape), dtype=spec.torch_dtype)
        n = self.get_into(spec, keys, out, namespace=namespace)
        return out[:n]

    def get_into(self, spec: ModelSpec, keys: Sequence[bytes], out: Any, *, namespace: str = "") -> int:
        """Copy the longest available prefix into ``out`` (a CPU tensor/array of len(keys) blocks);
        returns how many leading blocks were written."""
        keys = list(keys)
        rows = _flat_bytes(out, len(keys), spec.block_nbytes)
        if not keys:
            return 0
        if self._local is not None:
            return self._get_local(spec, keys, rows, namespace)
        return self._get_stream(spec, keys, rows, namespace)

    def _get_stream(self, spec: ModelSpec, keys: list[bytes], rows: np.ndarray, namespace: str) -> int:
        import xxhash

        req = pb.GetRequest(target=self._target(spec, keys, None, namespace), chunk_bytes=self.chunk_bytes)
        try:
            stream = self._kv.Get(req, metadata=self._metadata, timeout=self.timeout)
            header = next(stream).header
            n = header.num_blocks
            for msg in stream:
                c = msg.chunk
                data = c.data
                if xxhash.xxh3_64_intdigest(data) != c.xxh3:
                    raise IntegrityError(f"checksum mismatch in block {c.block} at offset {c.offset}")
                if c.block >= n or c.offset + len(data) > spec.block_nbytes:
                    raise IntegrityError("the server sent a chunk outside the blocks it announced")
                rows[c.block, c.offset : c.offset + len(data)] = np.frombuffer(data, dtype=np.uint8)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
        return n

    def _get_local(self, spec: ModelSpec, keys: list[bytes], rows: np.ndarray, namespace: str) -> int:
        lp = self._local
        assert lp is not None
        nbytes = spec.block_nbytes
        base = lp.offsets_of(rows)
        if base is not None:
            return self._get_slots(spec, keys, [base + i * nbytes for i in range(len(keys))], namespace)
        off = lp.reserve(nbytes * len(keys))
        if off is None:  # larger than the free region: in-band (see _put_local)
            return self._get_stream(spec, keys, rows, namespace)
        try:
            got = self._get_slots(spec, keys, [off + j * nbytes for j in range(len(keys))], namespace)
            if got:
                np.copyto(rows[:got], lp.arena[off : off + got * nbytes].reshape(got, nbytes))
        finally:
            lp.release(off)
        return got

    def _get_slots(self, spec: ModelSpec, keys: list[bytes], offsets: list[int], namespace: str) -> int:
        assert self._local is not None
        req = pb.GetLocalRequest(target=self._target(spec, keys, None, namespace), region_id=self._local.region_id,
                                 offsets=offsets)
        return self._call(self._kv.GetLocal, req).num_blocks

    # -- sessions, prefetch, delete, stats -----------------------------------------------------
    def open_session(self, session_id: str) -> None:
        self._call(self._kv.OpenSession, pb.SessionRequest(session_id=session_id))

    def pause_session(self, session_id: str) -> None:
        self._call(self._kv.PauseSession, pb.SessionRequest(session_id=session_id))

    def resume_session(self, session_id: str) -> None:
        self._call(self._kv.ResumeSession, pb.SessionRequest(session_id=session_id))

    def close_session(self, session_id: str) -> None:
        self._call(self._kv.CloseSession, pb.SessionRequest(session_id=session_id))

    def prefetch(self, spec: ModelSpec, keys: Sequence[bytes], tier: str | Tier = "hbm", *,
                 namespace: str = "") -> int:
        req = pb.PrefetchRequest(target=self._target(spec, keys, None, namespace), tier=int(Tier.parse(tier)) + 1)
        return self._call(self._kv.Prefetch, req).blocks

    def delete(self, keys: Sequence[bytes], *, namespace: str = "") -> int:
        return self._call(self._kv.Delete, pb.DeleteRequest(namespace=namespace, keys=b"".join(keys))).deleted

    def stats(self) -> dict[str, Any]:
        return json.loads(self._call(self._kv.Stats, pb.StatsRequest()).json)

    # -- lifecycle ----------------------------------------------------------------------------
    def local_blocks(self, spec: ModelSpec, n: int) -> LocalBlocks:
        """A [n, 2, L, H, T, D] tensor inside the shared region: put/get on it copy once."""
        if self._local is None:
            raise InvalidArgument("no shared-memory region: the server is not local")
        return LocalBlocks(self._local, spec, n)

    def close(self) -> None:
        if self._local is not None:
            try:
                self._call(self._kv.UnregisterRegion, pb.UnregisterRegionRequest(region_id=self._local.region_id))
            except KVStoreError:
                pass  # NOTE: the server may already be gone; the region is unlinked below anyway
            self._local.close()
            self._local = None
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LocalBlocks:
    """Blocks allocated in the client's shared region; ``tensor`` is the view to fill or read.
    Call :meth:`free` (or use as a context manager) to give the slots back."""

    def __init__(self, plane: _LocalPlane, spec: ModelSpec, n: int) -> None:
        self._plane = plane
        nbytes = spec.block_nbytes * n
        off = plane.reserve(nbytes)
        if off is None:
            raise InvalidArgument(f"{nbytes} bytes do not fit in the free part of the shared region")
        self.offset = off
        flat = torch.from_numpy(plane.arena[off : off + nbytes])
        self.tensor = flat.view(spec.torch_dtype).view(n, *spec.block_shape)

    def free(self) -> None:
        if self.offset >= 0:
            self.tensor = None  # type: ignore[assignment]
            self._plane.release(self.offset)
            self.offset = -1

    def __enter__(self) -> LocalBlocks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()


class AdminClient:
    """The Admin service (operators' plane); every call needs an admin token."""

    def __init__(self, target: str, token: str, *, timeout: float | None = 30.0, tls: ClientTLS | None = None) -> None:
        self._inner = Client(target, token, local=False, timeout=timeout, tls=tls)
        self._stub = self._inner._admin

    def _call(self, name: str, request: Any) -> Any:
        return self._inner._call(getattr(self._stub, name), request)

    def create_tenant(self, name: str, role: str = "tenant", namespaces: Sequence[str] = ()) -> str:
        r = self._call("CreateTenant", apb.CreateTenantRequest(
            name=name, role=apb.Role.Value(f"ROLE_{role.upper()}"), namespaces=list(namespaces)))
        return r.token

    def rotate_token(self, name: str) -> str:
        return self._call("RotateToken", apb.TenantName(name=name)).token

    def delete_tenant(self, name: str) -> None:
        self._call("DeleteTenant", apb.TenantName(name=name))

    def list_tenants(self) -> list[dict[str, Any]]:
        r = self._call("ListTenants", apb.ListTenantsRequest())
        return [{"name": t.name, "role": apb.Role.Name(t.role)[5:].lower(), "namespaces": list(t.namespaces),
                 "created": t.created} for t in r.tenants]

    def grant(self, tenant: str, namespace: str, *, revoke: bool = False) -> None:
        self._call("Grant", apb.GrantRequest(tenant=tenant, namespace=namespace, revoke=revoke))

    def get_policy(self, tenant: str) -> dict[str, Any]:
        return _policy_dict(self._call("GetPolicy", apb.TenantName(name=tenant)))

    def set_policy(self, tenant: str, *, ttl_s: float | None = None, quota_bytes: dict[str, int] | None = None,
                   priority: int = 0) -> dict[str, Any]:
        msg = apb.TenantPolicy(tenant=tenant, quota_bytes=quota_bytes or {}, priority=priority)
        if ttl_s is not None:
            msg.ttl_s = ttl_s
        return _policy_dict(self._call("SetPolicy", msg))

    def purge_model(self, spec_or_fingerprint: ModelSpec | bytes) -> int:
        if isinstance(spec_or_fingerprint, ModelSpec):
            req = apb.PurgeModelRequest(spec=spec_to_pb(spec_or_fingerprint))
        else:
            req = apb.PurgeModelRequest(fingerprint=bytes(spec_or_fingerprint))
        return self._call("PurgeModel", req).blocks

    def audit(self, since_seq: int = 0, limit: int = 0) -> list[dict[str, Any]]:
        r = self._call("ReadAudit", apb.ReadAuditRequest(since_seq=since_seq, limit=limit))
        return [{"seq": e.seq, "time": e.time, "principal": e.principal, "action": e.action,
                 "target": e.target, "result": e.result, "detail": e.detail} for e in r.entries]

    def stats(self) -> dict[str, Any]:
        return json.loads(self._call("Stats", pb.StatsRequest()).json)

    def close(self) -> None:
        self._inner.close()

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _policy_dict(msg: apb.TenantPolicy) -> dict[str, Any]:
    return {"tenant": msg.tenant, "ttl_s": msg.ttl_s if msg.HasField("ttl_s") else None,
            "quota_bytes": dict(msg.quota_bytes), "priority": msg.priority}
