"""The ``kvstore.v1.Admin`` servicer: operators' calls, each audited (who, what, target, result).

Thin: every method decodes its request, calls :class:`~kvstore.service_admin.AdminPlane`
through :meth:`RpcRunner.run` (which requires the admin role and writes the audit entry), and
encodes the result. Reading the audit log and Stats are admin-only; only their refused attempts
are recorded (an outcome entry: UNAUTHENTICATED as principal ``?``, PERMISSION_DENIED), not the
reads themselves (reading the log must not grow it). A change's entry records what was done beyond its target (``detail``):
the role and namespaces a principal is created with, the grants and the policy before -> after.
ReadAudit and ListSessions answer with the entries that fit under the server's message limit
(and the caller's ``max_bytes``), their ``more`` set when entries follow. ListTenants shows the
principals marked as being deleted too (``deleting``): a deletion in progress, or one left
unfinished, was invisible (the principal gone from the list while its data was still there).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from kvstore.audit import DETAIL_CHARS, AuditEntry, AuditLog, Recorder, bounded
from kvstore.auth import ModelPolicy, Principal, Role, TenantPolicy
from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.service_admin import (
    AdminPlane,
    create_detail,
    grant_detail,
    model_policy_detail,
    policy_detail,
    session_detail,
)
from kvstore.service_convert import spec_from_pb
from kvstore.service_rpc import RpcRunner
from kvstore.store_admin import SessionInfo
from proto.kvstore.v1 import admin_pb2 as apb
from proto.kvstore.v1 import admin_pb2_grpc
from proto.kvstore.v1 import kvstore_pb2 as pb

_ROLE_PB = {Role.TENANT: apb.ROLE_TENANT, Role.PUBLISHER: apb.ROLE_PUBLISHER, Role.ADMIN: apb.ROLE_ADMIN}
_ROLE_FROM_PB = {v: k for k, v in _ROLE_PB.items()} | {apb.ROLE_UNSPECIFIED: Role.TENANT}
#: the smallest ``max_bytes`` a ReadAudit may give: room for any one (bounded) entry
MIN_AUDIT_PAGE_BYTES = 64 * 1024
#: room kept in a ReadAudit response for its ``more`` field
_RESPONSE_SLACK = 16


class AdminServicer(admin_pb2_grpc.AdminServicer):
    def __init__(self, plane: AdminPlane, rpc: RpcRunner) -> None:
        self.plane, self.rpc = plane, rpc

    def _run(self, name: str, action: str, target: str, context, fn: Callable[[Principal], Any],
             *, changes: bool = True, detail: str = "", audit: Recorder | None = None) -> Any:
        audit = audit or Recorder(self.plane.audit, action, target, detail, changes=changes)
        return self.rpc.run(f"Admin.{name}", context, fn, audit=audit)

    def CreateTenant(self, request, context):
        # NOTE: an unknown role value (a newer client's, or a mistake) created a full tenant
        role = _ROLE_FROM_PB.get(request.role)
        namespaces = list(request.namespaces)

        def call(p: Principal) -> apb.TenantToken:
            if role is None:
                known = ", ".join(f"{apb.Role.Name(v)}={v}" for v in sorted(_ROLE_FROM_PB))
                raise InvalidArgument(f"role: unknown value {request.role} (known: {known})")
            return apb.TenantToken(name=request.name, token=self.plane.create_tenant(request.name, role, namespaces))
        return self._run("CreateTenant", "tenant.create", request.name, context, call,
                         detail=create_detail(role if role is not None else str(request.role), namespaces))

    def RotateToken(self, request, context):
        return self._run("RotateToken", "tenant.rotate", request.name, context, lambda p: apb.TenantToken(
            name=request.name, token=self.plane.rotate(request.name)))

    def DeleteTenant(self, request, context):
        # NOTE: the response and the outcome's entry say how many blocks went (the count was
        # dropped: a deletion of millions of blocks answered as one of none did)
        audit = Recorder(self.plane.audit, "tenant.delete", request.name)

        def call(p: Principal) -> apb.DeleteTenantResponse:
            blocks = self.plane.delete_tenant(request.name)
            audit.detail = f"blocks={blocks}"  # the outcome's entry
            return apb.DeleteTenantResponse(blocks=blocks)
        return self._run("DeleteTenant", "tenant.delete", "", context, call, audit=audit)

    def ListTenants(self, request, context):
        # NOTE: the principals marked as being deleted were left out: a deletion in progress, or
        # one a failed step left unfinished (its data still there), showed as done
        def call(p: Principal) -> apb.ListTenantsResponse:
            live, deleting = self.plane.registry.list_all()
            tenants = [_tenant_pb(t) for t in live] + [_tenant_pb(t, deleting=True) for t in deleting.values()]
            return apb.ListTenantsResponse(tenants=sorted(tenants, key=lambda t: t.name))
        return self._run("ListTenants", "tenant.list", "", context, call, changes=False)

    def Grant(self, request, context):
        action = "namespace.revoke" if request.revoke else "namespace.grant"
        audit = Recorder(self.plane.audit, action, f"{request.tenant} {request.namespace}")

        def call(p: Principal) -> apb.TenantInfo:
            after, before = self.plane.grant(request.tenant, request.namespace, revoke=request.revoke)
            audit.detail = grant_detail(before, after.namespaces)  # the outcome's entry
            return _tenant_pb(after)
        return self._run("Grant", action, "", context, call, audit=audit)

    def GetPolicy(self, request, context):
        return self._run("GetPolicy", "policy.get", request.name, context,
                         lambda p: _policy_pb(request.name, self.plane.get_policy(request.name)), changes=False)

    def SetPolicy(self, request, context):
        policy = TenantPolicy(ttl_s=request.ttl_s if request.HasField("ttl_s") else None,
                              quota_bytes=dict(request.quota_bytes), priority=request.priority)
        audit = Recorder(self.plane.audit, "policy.set", request.tenant, f"-> {policy_detail(policy)}")

        def call(p: Principal) -> apb.TenantPolicy:
            after, before = self.plane.set_policy(request.tenant, policy)  # NOTE: before read with it, not ahead
            audit.detail = f"{policy_detail(before)} -> {policy_detail(after)}"  # the outcome's entry
            return _policy_pb(request.tenant, after)
        return self._run("SetPolicy", "policy.set", "", context, call, audit=audit)

    def GetModelPolicy(self, request, context):
        return self._run("GetModelPolicy", "model.policy.get", request.fingerprint.hex(), context,
                         lambda p: _model_policy_pb(request.fingerprint, self.plane.get_model_policy(request.fingerprint)),
                         changes=False)

    def SetModelPolicy(self, request, context):
        # NOTE: audited as policy.set is: the policy before -> after, read with the change
        policy = ModelPolicy(ttl_s=request.ttl_s if request.HasField("ttl_s") else None)
        audit = Recorder(self.plane.audit, "model.policy.set", request.fingerprint.hex(),
                         f"-> {model_policy_detail(policy)}")

        def call(p: Principal) -> apb.ModelPolicy:
            after, before = self.plane.set_model_policy(request.fingerprint, policy)
            audit.detail = f"{model_policy_detail(before)} -> {model_policy_detail(after)}"  # the outcome's entry
            return _model_policy_pb(request.fingerprint, after)
        return self._run("SetModelPolicy", "model.policy.set", "", context, call, audit=audit)

    def PurgeModel(self, request, context):
        # NOTE: the entry names the fingerprint purged and the model it was computed from (it
        # said only the model's name: which revision went was not on record) and, at the end,
        # how many blocks went
        audit = Recorder(self.plane.audit, "model.purge", request.fingerprint.hex() or request.spec.model)
        if not request.fingerprint:
            try:
                spec = spec_from_pb(request.spec, request.HasField("spec"))
                audit.target = spec.fingerprint.hex()
                audit.detail = f"model={spec.model} revision={spec.revision}"
            except KVStoreError:
                pass  # the call raises it again, once authenticated

        def call(p: Principal) -> apb.PurgeModelResponse:
            fp = request.fingerprint or (spec_from_pb(request.spec, request.HasField("spec")).fingerprint)
            blocks = self.plane.purge_model(fp)
            audit.detail = f"{audit.detail} blocks={blocks}".lstrip()  # the outcome's entry
            return apb.PurgeModelResponse(blocks=blocks)
        return self._run("PurgeModel", "model.purge", "", context, call, audit=audit)

    def _budget(self, max_bytes: int) -> int:
        """The bytes a paged response (ReadAudit, ListSessions) may fill: the caller's
        ``max_bytes`` (0: the server's message limit), at most that limit, less the room kept
        for its ``more`` field."""
        if 0 < max_bytes < MIN_AUDIT_PAGE_BYTES:
            raise InvalidArgument(f"max_bytes must be 0 (the server's message limit) or at least "
                                  f"{MIN_AUDIT_PAGE_BYTES}, got {max_bytes}")
        return min(max_bytes or self.plane.max_message_bytes, self.plane.max_message_bytes) - _RESPONSE_SLACK

    def ReadAudit(self, request, context):
        def call(p: Principal) -> apb.ReadAuditResponse:
            left = self._budget(request.max_bytes)
            out: list[apb.AuditEntry] = []

            def fits(e: AuditEntry) -> bool:
                nonlocal left
                msg = _audit_pb(e)
                cost = _entry_cost(msg)
                if cost > left:
                    return False
                left -= cost
                out.append(msg)
                return True

            _, more = self.plane.audit.page(request.since_seq, request.limit or 1000, fits)
            return apb.ReadAuditResponse(entries=out, more=more)
        return self._run("ReadAudit", "audit.read", "", context, call,
                         audit=RefusalsOnly(self.plane.audit, "audit.read"))

    def ListSessions(self, request, context):
        def call(p: Principal) -> apb.ListSessionsResponse:
            left = self._budget(request.max_bytes)
            out: list[apb.SessionInfo] = []
            for info in self.plane.sessions(request.tenant, (request.after_tenant, request.after_session_id)):
                msg = _session_pb(info)
                cost = _entry_cost(msg)
                # the first always: a session whose id alone passes the budget is not skipped
                if out and cost > left:
                    return apb.ListSessionsResponse(sessions=out, more=True)
                left -= cost
                out.append(msg)
            return apb.ListSessionsResponse(sessions=out, more=False)
        return self._run("ListSessions", "session.list", request.tenant, context, call, changes=False)

    def CloseSession(self, request, context):
        audit = Recorder(self.plane.audit, "session.close", f"{request.tenant} {request.session_id}")

        def call(p: Principal) -> apb.SessionInfo:
            info = self.plane.close_session(request.tenant, request.session_id)
            audit.detail = session_detail(info)  # the outcome's entry: what the close released
            return _session_pb(info)
        return self._run("CloseSession", "session.close", "", context, call, audit=audit)

    def ListModels(self, request, context):
        def call(p: Principal) -> apb.ListModelsResponse:
            return apb.ListModelsResponse(models=[
                apb.ModelInfo(fingerprint=m.fingerprint, model=m.model, revision=m.revision, dtype=m.dtype,
                              block_tokens=m.block_tokens, blocks=m.blocks, bytes=m.nbytes, tenants=m.tenants)
                for m in self.plane.store.models()])
        return self._run("ListModels", "model.list", "", context, call,
                         audit=RefusalsOnly(self.plane.audit, "model.list"))

    def Stats(self, request, context):
        return self._run("Stats", "stats.read", "", context, lambda p: pb.StatsResponse(
            json=json.dumps(self.plane.store.stats(), default=str, sort_keys=True)),
            audit=RefusalsOnly(self.plane.audit, "stats.read"))


class RefusalsOnly(Recorder):
    """The record of an admin read that is not audited (reading the audit log must not grow
    it): only a refused attempt is written, as its outcome entry. (These reads bypassed the
    Recorder, so a tenant probing them left no trace, while a refused change was recorded.)"""

    REFUSED = frozenset({"UNAUTHENTICATED", "PERMISSION_DENIED"})

    def __init__(self, log: AuditLog, action: str) -> None:
        super().__init__(log, action, "", changes=False)

    def end(self, principal: str, result: str) -> AuditEntry | None:  # type: ignore[override]
        return super().end(principal, result) if result in self.REFUSED else None


def _audit_pb(e: AuditEntry) -> apb.AuditEntry:
    """An entry as ReadAudit sends it; its strings bounded again (entries written before they
    were bounded at append time may hold megabytes)."""
    return apb.AuditEntry(seq=e.seq, time=e.time, principal=bounded(e.principal), action=bounded(e.action),
                          target=bounded(e.target), result=bounded(e.result),
                          detail=bounded(e.detail, DETAIL_CHARS), ref=e.ref)


def _varint_len(n: int) -> int:
    return max(1, (n.bit_length() + 6) // 7)


def _entry_cost(msg: Any) -> int:
    """What one entry of a repeated field adds to a response: its tag, its length, itself."""
    size = msg.ByteSize()
    return 1 + _varint_len(size) + size


def _tenant_pb(p: Principal, *, deleting: bool = False) -> apb.TenantInfo:
    return apb.TenantInfo(name=p.name, role=_ROLE_PB[p.role], namespaces=list(p.namespaces), created=p.created,
                          deleting=deleting)


def _session_pb(s: SessionInfo) -> apb.SessionInfo:
    return apb.SessionInfo(tenant=s.tenant, session_id=s.session,
                           state=pb.SessionState.Value(f"SESSION_STATE_{s.state.name}"), blocks=s.blocks,
                           bytes=s.nbytes, pinned_blocks=s.pinned_blocks, pinned_bytes=s.pinned_bytes, idle_s=s.idle_s,
                           only_pinned_blocks=s.only_pinned_blocks, only_pinned_bytes=s.only_pinned_bytes)


def _policy_pb(name: str, policy: TenantPolicy) -> apb.TenantPolicy:
    msg = apb.TenantPolicy(tenant=name, quota_bytes=policy.quota_bytes, priority=policy.priority)
    if policy.ttl_s is not None:
        msg.ttl_s = policy.ttl_s
    return msg


def _model_policy_pb(fingerprint: bytes, policy: ModelPolicy) -> apb.ModelPolicy:
    msg = apb.ModelPolicy(fingerprint=fingerprint)
    if policy.ttl_s is not None:
        msg.ttl_s = policy.ttl_s
    return msg
