"""The ``kvstore.v1.KVStore`` servicer: decode, call one plain function, encode.

Each method hands :meth:`RpcRunner.run` a function of the authenticated principal that calls
:class:`~kvstore.service_data.DataPlane` (or :mod:`kvstore.service_streams` for Put/Get). Put
and Get exchange raw frames (see :data:`FRAME_CODECS` and :mod:`kvstore.frames`); register
the servicer with :func:`add_kvstore_servicer`, which installs those codecs.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import grpc

from kvstore.audit import Recorder
from kvstore.auth import Principal, Role
from kvstore.block import SessionState
from kvstore.errors import InvalidArgument, PermissionDenied
from kvstore.frames import Frame, decoder
from kvstore.service_convert import spec_from_pb, tier_codes, tier_from_pb, tier_to_pb
from kvstore.service_data import DataPlane
from kvstore.service_rpc import Codec, RpcRunner, add_service, parser
from kvstore.service_streams import get_stream, put_stream
from proto.kvstore.v1 import kvstore_pb2 as pb
from proto.kvstore.v1 import kvstore_pb2_grpc

SERVICE = pb.DESCRIPTOR.services_by_name["KVStore"]
#: Put requests arrive as PutFrame frames; Get responses leave as already-encoded frames
FRAME_CODECS: dict[str, Codec] = {
    "Put": (decoder(pb.PutFrame), pb.PutResponse.SerializeToString),
    "Get": (parser(pb.GetRequest), None),
}
_REGION_KINDS = {pb.REGION_KIND_POSIX_SHM: "posix_shm", pb.REGION_KIND_CUDA_IPC: "cuda_ipc"}
_SESSION_STATES = {SessionState.ACTIVE: pb.SESSION_STATE_ACTIVE, SessionState.PAUSED: pb.SESSION_STATE_PAUSED,
                   SessionState.RESUMED: pb.SESSION_STATE_RESUMED, SessionState.CLOSED: pb.SESSION_STATE_CLOSED}


def add_kvstore_servicer(servicer: KVStoreServicer, server: grpc.Server) -> None:
    add_service(server, SERVICE, servicer, FRAME_CODECS)


class KVStoreServicer(kvstore_pb2_grpc.KVStoreServicer):
    def __init__(self, plane: DataPlane, rpc: RpcRunner) -> None:
        self.plane, self.rpc = plane, rpc
        if plane.auth is None:
            # NOTE: the registry that authenticates a call also re-validates it before its put
            # commits: a stream opened before a rotation, deletion or revocation stores nothing
            plane.auth = rpc.registry

    def WhoAmI(self, request, context):
        return self.rpc.run("WhoAmI", context, lambda p: pb.WhoAmIResponse(
            principal=p.name, role=p.role.value, readable=sorted(p.readable), writable=sorted(p.writable),
            supports_roots=True))

    def BlockKeys(self, request, context):
        def call(p: Principal) -> pb.BlockKeysResponse:
            spec = spec_from_pb(request.spec, request.HasField("spec"))
            extra = [list(e.items) for e in request.tokens.extra]
            _, keys = self.plane.keys_for(p, spec, request.namespace, list(request.tokens.ids), extra)
            return pb.BlockKeysResponse(keys=b"".join(keys))
        return self.rpc.run("BlockKeys", context, call)

    def Lookup(self, request, context):
        def call(p: Principal) -> pb.LookupResponse:
            b = self.plane.resolve(p, request.target, packed=True)
            n, tiers = self.plane.lookup(b)
            # roots: one byte per key, TIER_UNSPECIFIED where it is absent
            codes = bytes(tier_to_pb(t) if t else pb.TIER_UNSPECIFIED for t in tiers) if b.roots \
                else tier_codes(tiers)
            return pb.LookupResponse(num_blocks=n, tier_codes=codes,
                                     keys=b"".join(b.keys) if b.computed else b"")
        return self.rpc.run("Lookup", context, call)

    def Put(self, request_iterator: Iterator[Frame], context):
        # NOTE: the registry re-validates the principal as the stream runs and at its commit:
        # a stream opened before a token rotation, deletion or revocation stores nothing
        return self.rpc.run("Put", context, lambda p: pb.PutResponse(
            blocks_written=put_stream(self.plane, p, request_iterator, context.is_active)))

    def Get(self, request, context):
        # the header is produced inside run(): errors abort before any data is sent; an error
        # while sending (the caller's right to read gone meanwhile) aborts the stream. relay
        # sends the header and the data and records the call's status and latency at the end
        start = time.perf_counter()
        frames = self.rpc.run("Get", context, lambda p: get_stream(self.plane, p, request), stream=True)
        yield from self.rpc.relay("Get", context, frames, start)

    def RegisterRegion(self, request, context):
        def call(p: Principal) -> pb.RegisterRegionResponse:
            if p.role is Role.ADMIN:
                raise PermissionDenied("admin tokens have no data-plane access")
            kind = _REGION_KINDS.get(request.kind)
            if kind is None:  # NOTE: an unknown kind (a newer client's) was called missing
                raise InvalidArgument("region kind is required" if not request.kind else
                                      f"unknown region kind {request.kind} (known: "
                                      + ", ".join(f"{v} = {k}" for v, k in sorted(_REGION_KINDS.items())) + ")")
            rid, region = self.plane.regions.register(p.name, kind, request.name, request.size,
                                                      request.cuda_ipc_handle, request.nonce)
            return pb.RegisterRegionResponse(region_id=rid, nonce=getattr(region, "nonce", b""))
        return self.rpc.run("RegisterRegion", context, call)

    def UnregisterRegion(self, request, context):
        def call(p: Principal) -> pb.UnregisterRegionResponse:
            self.plane.regions.unregister(p.name, request.region_id)
            return pb.UnregisterRegionResponse()
        return self.rpc.run("UnregisterRegion", context, call)

    def PutLocal(self, request, context):
        def call(p: Principal) -> pb.PutResponse:
            b = self.plane.resolve(p, request.target, write=True)
            b.active = context.is_active  # NOTE: as the Put stream: no commit after a deadline/cancel
            ttl = request.ttl_s if request.HasField("ttl_s") else None
            n = self.plane.put_local(p, b, request.region_id, request.offsets, request.session, ttl, request.seq)
            return pb.PutResponse(blocks_written=n)
        return self.rpc.run("PutLocal", context, call)

    def GetLocal(self, request, context):
        def call(p: Principal) -> pb.GetLocalResponse:
            b = self.plane.resolve(p, request.target)
            n, present = self.plane.get_local(p, b, request.region_id, request.offsets, request.seq,
                                              request.keys_after)
            return pb.GetLocalResponse(num_blocks=n, present=bytes(present) if present is not None else b"")
        return self.rpc.run("GetLocal", context, call)

    def FenceRegion(self, request, context):
        def call(p: Principal) -> pb.FenceRegionResponse:
            self.plane.fence(p, request.region_id, request.seq, context.time_remaining())
            return pb.FenceRegionResponse()
        return self.rpc.run("FenceRegion", context, call)

    def _session(self, verb: str, request, context):
        def call(p: Principal) -> pb.SessionResponse:
            # NOTE: the answer was the state the verb's name implies (re-opening a PAUSED session
            # answered ACTIVE while it stayed paused); it is the session's real state after the call
            state = self.plane.session(p, verb, request.session_id, request.namespace)
            return pb.SessionResponse(session_id=request.session_id, state=_SESSION_STATES[state])
        return self.rpc.run(f"{verb.capitalize()}Session", context, call)

    def OpenSession(self, request, context):
        return self._session("open", request, context)

    def PauseSession(self, request, context):
        return self._session("pause", request, context)

    def ResumeSession(self, request, context):
        return self._session("resume", request, context)

    def CloseSession(self, request, context):
        return self._session("close", request, context)

    def Prefetch(self, request, context):
        def call(p: Principal) -> pb.PrefetchResponse:
            b = self.plane.resolve(p, request.target)
            return pb.PrefetchResponse(blocks=self.plane.prefetch(b, tier_from_pb(request.tier)))
        return self.rpc.run("Prefetch", context, call)

    def Delete(self, request, context):
        # NOTE: a deletion records itself (DataPlane.delete); an unauthenticated attempt is
        # recorded here, as an Admin call's is
        refused = Recorder(self.plane.audit, "blocks.delete", request.namespace or "?", changes=False)
        return self.rpc.run("Delete", context, lambda p: pb.DeleteResponse(
            deleted=self.plane.delete(p, request.namespace, request.keys)), refused=refused)

    def Stats(self, request, context):
        return self.rpc.run("Stats", context, lambda p: pb.StatsResponse(
            json=json.dumps(self.plane.stats(p), default=str, sort_keys=True)))
