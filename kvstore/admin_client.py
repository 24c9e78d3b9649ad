"""Client of the sidecar's Admin service (operators' plane): tenants, policies, purge, audit,
sessions.

::

    from kvstore.admin_client import AdminClient
    with AdminClient("127.0.0.1:50551", admin_token) as admin:
        token = admin.create_tenant("acme")

Every call needs an admin token; errors come back as kvstore's typed exceptions.

A deletion (:meth:`AdminClient.delete_tenant`, :meth:`AdminClient.purge_model`) goes on at the
server when the call's deadline passes (``timeout``, 30 s by default): DEADLINE_EXCEEDED says
only that the answer did not come in time, not that nothing was deleted. For such calls give
``timeout=None`` (no deadline), as the ``kvstore`` CLI does.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Self

from kvstore.client import Client, ClientTLS, check_text, spec_to_pb
from kvstore.errors import InvalidArgument
from kvstore.spec import ModelSpec
from proto.kvstore.v1 import admin_pb2 as apb
from proto.kvstore.v1 import kvstore_pb2 as pb

_ROLES = ("tenant", "publisher", "admin")
#: the entries an audit read returns when it is given no limit (the server's default too)
AUDIT_LIMIT = 1000


def _in_range(what: str, value: int, lo: int, hi: int) -> None:
    """InvalidArgument naming ``what`` unless ``value`` is an int in [lo, hi] (protobuf would
    raise a bare ValueError while building the request)."""
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise InvalidArgument(f"{what} must be an integer in [{lo}, {hi}], got {value!r}")


class AdminClient:
    """The Admin service (operators' plane); every call needs an admin token."""

    def __init__(self, target: str, token: str, *, timeout: float | None = 30.0, tls: ClientTLS | None = None,
                 max_message_bytes: int = 4 << 20) -> None:
        # NOTE: the Admin service streams nothing: chunk_bytes only has to be valid (a limit too
        # small for it was reported as a bad chunk_bytes the caller never gave)
        if not isinstance(max_message_bytes, int) or max_message_bytes < 64 * 1024:
            raise InvalidArgument(f"max_message_bytes={max_message_bytes!r} must be at least 64 KiB "
                                  f"(an audit page holds entries of up to that size)")
        self._inner = Client(target, token, local=False, timeout=timeout, tls=tls, max_message_bytes=max_message_bytes,
                             chunk_bytes=max(1, min(max_message_bytes - 1024, 1 << 20)))
        self._stub = self._inner._admin
        self._max_message_bytes = max_message_bytes

    def _call(self, name: str, request: Any) -> Any:
        return self._inner._call(getattr(self._stub, name), request)

    def create_tenant(self, name: str, role: str = "tenant", namespaces: Sequence[str] = ()) -> str:
        if role not in _ROLES:
            raise InvalidArgument(f"role must be one of {', '.join(_ROLES)}, got {role!r}")
        r = self._call("CreateTenant", apb.CreateTenantRequest(
            name=check_text("tenant name", name), role=apb.Role.Value(f"ROLE_{role.upper()}"),
            namespaces=[check_text("namespace", ns) for ns in namespaces]))
        return r.token

    def rotate_token(self, name: str) -> str:
        return self._call("RotateToken", apb.TenantName(name=check_text("tenant name", name))).token

    def delete_tenant(self, name: str) -> int:
        """Delete a principal (and a tenant's or shared namespace's blocks); returns how many
        blocks were removed."""
        return self._call("DeleteTenant", apb.TenantName(name=check_text("tenant name", name))).blocks

    def list_tenants(self) -> list[dict[str, Any]]:
        r = self._call("ListTenants", apb.ListTenantsRequest())
        return [{"name": t.name, "role": apb.Role.Name(t.role)[5:].lower(), "namespaces": list(t.namespaces),
                 "created": t.created, "deleting": t.deleting} for t in r.tenants]

    def grant(self, tenant: str, namespace: str, *, revoke: bool = False) -> None:
        self._call("Grant", apb.GrantRequest(tenant=check_text("tenant name", tenant),
                                             namespace=check_text("namespace", namespace), revoke=revoke))

    def get_policy(self, tenant: str) -> dict[str, Any]:
        return _policy_dict(self._call("GetPolicy", apb.TenantName(name=check_text("tenant name", tenant))))

    def set_policy(self, tenant: str, *, ttl_s: float | None = None, quota_bytes: dict[str, int] | None = None,
                   priority: int = 0) -> dict[str, Any]:
        _in_range("priority", priority, -(1 << 31), (1 << 31) - 1)
        for tier, size in (quota_bytes or {}).items():
            _in_range(f"the quota for {tier}", size, 0, (1 << 64) - 1)
        msg = apb.TenantPolicy(tenant=check_text("tenant name", tenant), quota_bytes=quota_bytes or {},
                               priority=priority)
        if ttl_s is not None:
            msg.ttl_s = ttl_s
        return _policy_dict(self._call("SetPolicy", msg))

    def purge_model(self, spec_or_fingerprint: ModelSpec | bytes) -> int:
        if isinstance(spec_or_fingerprint, ModelSpec):
            req = apb.PurgeModelRequest(spec=spec_to_pb(spec_or_fingerprint))
        else:
            req = apb.PurgeModelRequest(fingerprint=bytes(spec_or_fingerprint))
        return self._call("PurgeModel", req).blocks

    def get_model_policy(self, fingerprint: bytes | str) -> dict[str, Any]:
        """The policy of a model fingerprint (bytes, or its hex as ``list_models`` gives it):
        ``{"fingerprint": hex, "ttl_s": seconds or None}``."""
        return _model_policy_dict(self._call("GetModelPolicy", apb.ModelPolicyRequest(
            fingerprint=_fingerprint(fingerprint))))

    def set_model_policy(self, fingerprint: bytes | str, *, ttl_s: float | None = None) -> dict[str, Any]:
        """Set (``ttl_s=None``: remove) a model's TTL: every block of the model, every tenant's,
        is capped at once at now + TTL and gets at most that at each put; returns the policy
        in force, as :meth:`get_model_policy`. Audited as ``model.policy.set``."""
        msg = apb.ModelPolicy(fingerprint=_fingerprint(fingerprint))
        if ttl_s is not None:
            msg.ttl_s = ttl_s
        return _model_policy_dict(self._call("SetModelPolicy", msg))

    def list_models(self) -> list[dict[str, Any]]:
        """The models with blocks on the server, most bytes first: each one's ``fingerprint``
        (hex, what :meth:`purge_model` and ``kvstore model purge`` take), the spec's ``model``,
        ``revision``, ``dtype`` and ``block_tokens``, and its ``blocks``, ``bytes`` and
        ``tenants`` (namespaces holding them)."""
        r = self._call("ListModels", apb.ListModelsRequest())
        return [{"fingerprint": m.fingerprint.hex(), "model": m.model, "revision": m.revision, "dtype": m.dtype,
                 "block_tokens": m.block_tokens, "blocks": m.blocks, "bytes": m.bytes, "tenants": m.tenants}
                for m in r.models]

    def audit(self, since_seq: int = 0, limit: int = 0) -> list[dict[str, Any]]:
        """Entries after ``since_seq``, oldest first: ``limit`` of them (0: the server's default
        of 1000), or fewer when the log ends, in as many calls as their size takes."""
        return self.audit_read(since_seq, limit)[0]

    def audit_read(self, since_seq: int = 0, limit: int = 0) -> tuple[list[dict[str, Any]], bool]:
        """:meth:`audit`, and whether entries follow the last one returned (``limit`` cut them)."""
        _in_range("since_seq", since_seq, 0, (1 << 64) - 1)
        _in_range("limit", limit, 0, (1 << 32) - 1)
        want = limit or AUDIT_LIMIT
        out: list[dict[str, Any]] = []
        while True:
            entries, more = self.audit_page(since_seq, want - len(out))
            out += entries
            if not more or not entries or len(out) >= want:
                return out, more
            since_seq = entries[-1]["seq"]

    def audit_latest(self, limit: int = 0) -> list[dict[str, Any]]:
        """The newest ``limit`` entries (0: 1000), oldest first, as ``tail`` shows a file's end.
        Entries are numbered from 1 up, so ``entries[0]["seq"] - 1`` came before them.

        ReadAudit reads forward from a seq; the last seq is found first by :meth:`last_audit_seq`
        (a few one-entry calls), then the entries before it are read. (``kvstore audit`` read the
        oldest 1000 entries, so on a log longer than that the newest actions were not shown.)"""
        _in_range("limit", limit, 0, (1 << 32) - 1)
        want = limit or AUDIT_LIMIT
        return self.audit(max(0, self.last_audit_seq() - want), want)

    def last_audit_seq(self) -> int:
        """The seq of the last entry of the audit log (0: it is empty), found by one-entry
        ReadAudit calls: doubling the step past what is known to exist, then bisecting (about
        2·log2(seq) calls; each reads from the server's index, not the whole log)."""
        known, end = 0, None  # an entry ``known`` exists (0: none needed); none follows ``end``
        step = AUDIT_LIMIT
        while end is None or known < end:
            probe = known + step if end is None else (known + end) // 2
            entries, more = self.audit_page(probe, 1)
            if not entries:
                if probe == known:
                    return known
                end = probe
                continue
            known = entries[0]["seq"]
            if not more:
                return known
            if end is None:
                step *= 2
        return known

    def audit_page(self, since_seq: int = 0, limit: int = 0) -> tuple[list[dict[str, Any]], bool]:
        """One ReadAudit: the entries after ``since_seq`` that fit one response (at most
        ``limit``, 0: the server's default), and whether more follow."""
        _in_range("since_seq", since_seq, 0, (1 << 64) - 1)
        _in_range("limit", limit, 0, (1 << 32) - 1)
        r = self._call("ReadAudit", apb.ReadAuditRequest(since_seq=since_seq, limit=limit,
                                                         max_bytes=min(self._max_message_bytes, (1 << 32) - 1)))
        return [{"seq": e.seq, "time": e.time, "principal": e.principal, "action": e.action,
                 "target": e.target, "result": e.result, "detail": e.detail, "ref": e.ref}
                for e in r.entries], r.more

    def list_sessions(self, tenant: str = "") -> list[dict[str, Any]]:
        """The open sessions (of ``tenant``, a tenant or shared namespace; "" for every one) in
        (tenant, session id) order, in as many calls as their size takes."""
        if tenant:
            check_text("tenant name", tenant)
        out: list[dict[str, Any]] = []
        after = ("", "")
        while True:
            r = self._call("ListSessions", apb.ListSessionsRequest(
                tenant=tenant, after_tenant=after[0], after_session_id=after[1],
                max_bytes=min(self._max_message_bytes, (1 << 32) - 1)))
            out += [_session_dict(s) for s in r.sessions]
            if not r.more or not r.sessions:
                return out
            after = (r.sessions[-1].tenant, r.sessions[-1].session_id)

    def close_session(self, tenant: str, session_id: str) -> dict[str, Any]:
        """Close a session of ``tenant`` (its namespace) as its engine would (its blocks
        unpinned, kept as prefix cache); returns the session as it was just before. NotFound
        when no such session is open."""
        return _session_dict(self._call("CloseSession", apb.CloseSessionRequest(
            tenant=check_text("tenant name", tenant), session_id=check_text("session id", session_id))))

    def stats(self) -> dict[str, Any]:
        return json.loads(self._call("Stats", pb.StatsRequest()).json)

    def close(self) -> None:
        self._inner.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _session_dict(msg: apb.SessionInfo) -> dict[str, Any]:
    return {"tenant": msg.tenant, "session_id": msg.session_id, "state": pb.SessionState.Name(msg.state)[14:].lower(),
            "blocks": msg.blocks, "bytes": msg.bytes, "pinned_blocks": msg.pinned_blocks,
            "pinned_bytes": msg.pinned_bytes, "idle_s": msg.idle_s, "only_pinned_blocks": msg.only_pinned_blocks,
            "only_pinned_bytes": msg.only_pinned_bytes}


def _policy_dict(msg: apb.TenantPolicy) -> dict[str, Any]:
    return {"tenant": msg.tenant, "ttl_s": msg.ttl_s if msg.HasField("ttl_s") else None,
            "quota_bytes": dict(msg.quota_bytes), "priority": msg.priority}


def _fingerprint(fingerprint: bytes | str) -> bytes:
    """A fingerprint given as bytes or as hex; InvalidArgument naming it when the hex is bad
    (the server checks the length)."""
    if isinstance(fingerprint, str):
        try:
            return bytes.fromhex(fingerprint)
        except ValueError:
            raise InvalidArgument(f"fingerprint must be hex digits (as list_models shows it), got {fingerprint!r}") from None
    return bytes(fingerprint)


def _model_policy_dict(msg: apb.ModelPolicy) -> dict[str, Any]:
    return {"fingerprint": msg.fingerprint.hex(), "ttl_s": msg.ttl_s if msg.HasField("ttl_s") else None}
