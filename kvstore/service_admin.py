"""The admin plane on Python values: operator actions over the auth registry and the Store.

:class:`AdminPlane` knows nothing of gRPC; the Admin servicer authenticates the caller, requires
the admin role and audits every call (who, what, target, result) around these methods. The
``*_detail`` functions word what an entry records of a change beyond its target: the role and
namespaces a principal was created with, the grants and the policy before and after.

A tenant's deletion is crash-safe and resumable (:meth:`AdminPlane.delete_tenant`): the
principal is marked as being deleted first (saved), then its data and key go, then the
principal; :meth:`AdminPlane.finish_deletions` (at every start) and :meth:`AdminPlane.create_tenant`
(of that name) finish a deletion left marked, and audit it.

Admin calls that race on one name are ordered by the plane (:attr:`AdminPlane._lock`, held only
over steps that do not wait on the remote tier): a deletion running in this process is not run a
second time, nor overtaken by a ``tenant add`` of the name (FAILED_PRECONDITION: it is still being
deleted); a policy is put in force and saved under the lock, and a deletion is marked under it, so
the Store enforces what ``policy get`` shows.

:meth:`AdminPlane.sessions` and :meth:`AdminPlane.close_session` show and end the open sessions
(an engine that died leaves its session pinning HBM until the idle expiry closes it).

:meth:`AdminPlane.set_model_policy` sets a model fingerprint's TTL as :meth:`AdminPlane.set_policy`
sets a tenant's: in force for what comes, saved in the principals file, then enforced on the
stored blocks (every tenant's of the model); :meth:`AdminPlane.apply_policies` re-applies both
kinds at a start.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kvstore.audit import AuditLog
from kvstore.auth import (
    SHARED_PREFIX,
    AuthRegistry,
    ModelPolicy,
    Principal,
    Role,
    TenantPolicy,
    check_name,
    check_shared,
)
from kvstore.block import Tier
from kvstore.errors import FailedPrecondition, InvalidArgument, KVStoreError, NotFound
from kvstore.expiry import check_ttl
from kvstore.service_resources import RegionTable
from kvstore.spec import check_fingerprint
from kvstore.store_admin import SessionInfo

log = logging.getLogger(__name__)

#: the principal the audit log names for what the server does itself (a deletion it finishes)
SERVER_PRINCIPAL = "kvstore serve"


class AdminPlane:
    """Operator actions; each raises typed errors from kvstore.errors."""

    def __init__(self, store: Any, registry: AuthRegistry, audit: AuditLog,
                 regions: RegionTable | None = None, metrics: Any = None,
                 max_message_bytes: int = 4 << 20) -> None:
        self.store, self.registry, self.audit = store, registry, audit
        self.regions = regions
        self.metrics = metrics  # ServiceMetrics: a deleted tenant's series go with it
        #: the server's gRPC message limit: the audit log is read in responses under it
        self.max_message_bytes = max_message_bytes
        # NOTE: one lock for the plane (admin calls are rare): held over a policy's apply and
        # save, over a deletion's mark and over a create; never over a deletion's data part (the
        # remote tier's SCAN of the whole keyspace), which the names in _running order instead
        self._lock = threading.Lock()
        #: the names whose deletion runs now in this process (a tenant delete, or a create
        #: finishing a deletion left over), under _lock
        self._running: set[str] = set()

    def create_tenant(self, name: str, role: Role, namespaces: list[str]) -> str:
        """Create a principal; returns its token (shown once). A deletion of the name left
        unfinished (a step failed) is finished first: the new principal must not find the
        deleted one's blocks or data key; when it cannot be finished, nothing is created.

        FailedPrecondition while a deletion of the name runs in this process: it is refused at
        once, not waited for (a deletion can run for minutes, the remote tier's SCAN having no
        bound, and a bounded wait would hold an admin worker to fail the same way). (It was
        taken for one left over and run a second time, the tenant created, and the running
        deletion then removed the new tenant's blocks and data key, counting them as its own.)"""
        with self._lock:
            self._not_running(name)
            if name not in self.registry.deleting():
                return self.registry.create(name, role, namespaces)
            self._running.add(name)  # a deletion left over: this call finishes it
        try:
            self._finish(name, "before tenant.create of the same name")
            return self.registry.create(name, role, namespaces)
        finally:
            with self._lock:
                self._running.discard(name)

    def _not_running(self, name: str) -> None:
        """FailedPrecondition when a deletion of ``name`` runs now in this process (under _lock)."""
        if name in self._running:
            raise FailedPrecondition(f"{name!r} is being deleted: its deletion is still running (tenant list shows "
                                     "it deleting until it ends); try again once it has ended")

    @contextmanager
    def _deleting(self, name: str) -> Iterator[None]:
        """Run a deletion of ``name`` as the only one (FailedPrecondition when one runs already)."""
        with self._lock:
            self._not_running(name)
            self._running.add(name)
        try:
            yield
        finally:
            with self._lock:
                self._running.discard(name)

    def finish_deletions(self) -> list[str]:
        """Finish every deletion left marked (the server stopped, or a step failed, part-way):
        the data and data key go, then the principal; each audited. Called at start, before
        the server serves. One that fails again is logged and left marked (its token stays
        refused; the next start, ``tenant delete`` or ``tenant add`` of the name retries it).
        Returns the names finished."""
        done = []
        for name in self.registry.deleting():
            try:
                with self._deleting(name):
                    self._finish(name, "at start: the server stopped during its deletion")
                done.append(name)
            except KVStoreError as exc:
                log.warning("the deletion of %r could not be finished (%s); it is retried at the next start, "
                            "or by deleting it again", name, exc)
        return done

    def _finish(self, name: str, why: str) -> None:
        """Finish the marked deletion of ``name`` and append its audit entry (OK, or the
        error's code before it is raised again)."""
        try:
            self._delete_marked(name)
        except KVStoreError as exc:
            self._record(name, exc.code, f"not finished {why}: {exc}")
            raise
        finally:
            if self.metrics is not None:
                self.metrics.forget_tenant(name)
        self._record(name, "OK", f"finished {why}")

    def _record(self, name: str, result: str, detail: str) -> None:
        try:
            self.audit.append(SERVER_PRINCIPAL, "tenant.delete", name, result, detail)
        except KVStoreError as exc:  # the deletion is done (or not) either way
            log.warning("the audit entry of the deletion of %r could not be written: %s", name, exc)

    def grant(self, tenant: str, namespace: str, *, revoke: bool = False) -> tuple[Principal, tuple[str, ...]]:
        """Grant (or revoke) a shared namespace; returns the principal as it now is and the
        namespaces it had before."""
        before = self.registry.get(tenant).namespaces
        return self.registry.grant(tenant, namespace, revoke=revoke), before

    def rotate(self, name: str) -> str:
        return self.registry.rotate(name)

    def delete_tenant(self, name: str) -> int:
        """Remove a principal (its token stops working) and, for a tenant or a shared namespace,
        destroy its data key and blocks on every tier; returns how many blocks were removed
        (the operator's only sign that a long deletion did its work).

        A principal is first marked as being deleted, saved (:meth:`AuthRegistry.begin_delete`:
        its token is refused from then on, and a put authenticated before fails its commit),
        then a tenant's blocks and data key go (a put reserved before fails on the Store's drop
        epoch), then the principal. When a step fails (a full disk, the remote tier down) or
        the server stops between them, the mark stays: running the deletion again, creating a
        tenant of the name, or the next start finishes it. (The principal was removed before
        the data was gone for good, and its data dropped again after: a crash in between left
        the blocks put meanwhile and the data key, with no principal, and a tenant created
        later under the name read them.) A name whose principal is gone but whose data key or
        blocks are left here (a deletion that failed half-way in an earlier version) is cleaned
        up: else a tenant created later under that name would read them. That clean-up is
        local only, and a name with no principal and nothing left here is NotFound with no
        effect: the servers sharing a remote tier share tenants by name, and this server's
        registry says nothing of theirs (a mistyped name, or a tenant of another sidecar, had
        its tombstone written, its shared data key and blocks destroyed and its drop published
        to every server, answered NotFound here)."""
        try:
            return self._delete_tenant(name)
        finally:
            if self.metrics is not None:  # after the data: a lookup meanwhile counted under the name
                self.metrics.forget_tenant(name)

    def _delete_tenant(self, name: str) -> int:
        if name.startswith(SHARED_PREFIX):
            check_shared(name)  # NOTE: "shared:BAD NAME/.." answered OK
            # a publisher's put running meanwhile fails ABORTED (retry), not UNAUTHENTICATED
            n = self.store.drop_tenant(name, namespace_stays=True)
            # the namespace stays (its publishers and grants do): so does the operator's policy
            # for it, which drop_tenant had taken out of the Store while `policy get` showed it.
            # NOTE: read and applied under the lock: a policy set meanwhile is in force after
            with self._lock:
                policy = self.registry.policies().get(name)
                if policy is not None:
                    self._apply(name, policy)
            return n
        check_name(name)
        with self._deleting(name):
            if name not in self.registry.deleting():
                try:
                    self.registry.get(name)
                except NotFound:
                    keyring = getattr(self.store, "keyring", None)
                    had_key = keyring is not None and name in keyring.tenants()
                    # NOTE: local only: the remote tier's copies may be another server's tenant
                    if (n := self.store.drop_tenant(name, local_only=True)) or had_key:
                        return n
                    raise
            with self._lock:  # NOTE: not between a policy's apply and its save (set_policy)
                self.registry.begin_delete(name)  # saved: from here on the deletion is finished, whatever stops it
            return self._delete_marked(name)

    def _delete_marked(self, name: str) -> int:
        """The steps after the mark: regions, blocks and data key, then the principal; returns
        the blocks removed."""
        principal = self.registry.deleting()[name]
        n = 0
        if self.regions is not None:
            # NOTE: a principal created later under the same name must not reach the memory
            # of the deleted one's clients through their region ids
            self.regions.drop_owner(name)
        if principal.role is Role.TENANT:
            # NOTE: once: no put of the tenant commits after the mark (its auth epoch check),
            # and one reserved before fails on the drop epoch this advances
            n = self.store.drop_tenant(name)
        self.registry.end_delete(name)
        return n

    def _policy_holder(self, namespace: str) -> None:
        """NotFound for a tenant that does not exist, InvalidArgument for a principal that holds
        no blocks of its own (admin, publisher): policies are a tenant's or a shared
        namespace's. (``policy get`` of a mistyped name showed an empty policy.)

        A shared namespace is one that some principal publishes or is granted, or that has a
        policy already (which can then still be read and replaced after its last principal
        went); any other is NotFound, as a mistyped tenant is. (Well formed was enough: a
        policy set on ``shared:dosc`` was recorded, binding nothing, and answered OK.)"""
        if namespace.startswith(SHARED_PREFIX):
            check_shared(namespace)
            if namespace not in self.registry.policies() and \
                    not any(namespace in p.namespaces for p in self.registry.list()):
                raise NotFound(f"no principal publishes or is granted {namespace!r}: create its "
                               "publisher (tenant add --role publisher) first")
            return
        role = self.registry.get(namespace).role
        if role is not Role.TENANT:
            raise InvalidArgument(f"{namespace!r} is a {role.value}: policies are set on tenants and on "
                                  f"shared namespaces ({SHARED_PREFIX}NAME)")

    def get_policy(self, namespace: str) -> TenantPolicy:
        self._policy_holder(namespace)
        return self.registry.policy(namespace)

    def _apply(self, namespace: str, policy: TenantPolicy, *, absent_tiers: str = "skip",
               enforce: bool = True) -> None:
        """Put a recorded policy in force in the Store (which checks every value). A quota on a
        tier this server does not have is skipped with a warning (a policy saved before a
        config change took the tier away still loads), or refused with ``absent_tiers="refuse"``
        (a new policy: it was accepted, saved and shown as if it applied)."""
        self.store.set_tenant_policy(namespace, policy.ttl_s, dict(policy.quota_bytes) or None,
                                     priority=policy.priority, absent_tiers=absent_tiers, enforce=enforce)

    def set_policy(self, namespace: str, policy: TenantPolicy) -> tuple[TenantPolicy, TenantPolicy]:
        """Put ``policy`` in force in the Store and save it; returns it as saved and the policy it
        replaced (read under the same lock: the audit entry's ``before -> after``).

        Under the plane's lock from the check to the save: two overlapping calls left the Store
        enforcing one policy while the registry (``policy get``, the next start) held the other,
        and a tenant deleted between the apply and the save had the old policy put back in the
        Store by the rollback (its deletion had just removed it), inherited by a tenant created
        again under the name until a restart. A deletion is marked under the lock too, so the
        save cannot meet it half-way."""
        with self._lock:
            self._policy_holder(namespace)
            quota = quota_by_tier(policy.quota_bytes)
            policy = TenantPolicy(ttl_s=policy.ttl_s, quota_bytes=quota, priority=policy.priority)
            before = self.registry.policies().get(namespace) or TenantPolicy()
            # NOTE: the Store checks and applies it before it is saved: a value the Store refused
            # after the save (a NaN TTL) stayed in the principals file, and the next start failed.
            # What cannot be undone (stored blocks' deadlines capped, blocks demoted to fit a
            # quota) waits for the save: a set whose save failed had cut every block's lifetime
            self._apply(namespace, policy, absent_tiers="refuse", enforce=False)
            try:
                self.registry.set_policy(namespace, policy)
            except KVStoreError:
                self._apply(namespace, before, enforce=False)  # as it was
                raise
            self.store.enforce_tenant_policy(namespace)
        return policy, before

    def get_model_policy(self, fingerprint: bytes) -> ModelPolicy:
        """The recorded policy of a model fingerprint (an empty one when it has none)."""
        check_fingerprint(fingerprint)
        return self.registry.model_policy(fingerprint)

    def set_model_policy(self, fingerprint: bytes, policy: ModelPolicy) -> tuple[ModelPolicy, ModelPolicy]:
        """Put a model's policy (its TTL; None: none) in force in the Store, save it, then cap
        the model's stored blocks, as :meth:`set_policy` does a tenant's; returns it as saved and
        the policy it replaced. Any well-formed fingerprint is taken, stored here or not (a
        model whose blocks are only in the remote tier, or not put yet)."""
        check_fingerprint(fingerprint)
        policy = ModelPolicy(ttl_s=check_ttl(policy.ttl_s))
        with self._lock:
            before = self.registry.model_policy(fingerprint)
            # NOTE: no stored block's deadline is cut before the save succeeded (see set_policy)
            self.store.set_model_ttl(fingerprint, policy.ttl_s, enforce=False)
            try:
                self.registry.set_model_policy(fingerprint, policy)
            except KVStoreError:
                self.store.set_model_ttl(fingerprint, before.ttl_s, enforce=False)  # as it was
                raise
            self.store.enforce_model_ttl(fingerprint)
        return policy, before

    def apply_policies(self) -> None:
        """Re-apply the recorded policies (tenants' and models') to a freshly opened Store."""
        for ns, policy in self.registry.policies().items():
            try:
                self._apply(ns, policy)
            except InvalidArgument as exc:
                raise InvalidArgument(f"the policy of {ns!r} in {self.registry.path} is not valid ({exc}): "
                                      f"correct it there") from None
        for fp, mpolicy in self.registry.model_policies().items():
            try:
                self.store.set_model_ttl(fp, mpolicy.ttl_s)
            except InvalidArgument as exc:
                raise InvalidArgument(f"the policy of model {fp.hex()} in {self.registry.path} is not valid "
                                      f"({exc}): correct it there") from None

    def sessions(self, tenant: str = "", after: tuple[str, str] = ("", "")) -> Iterator[SessionInfo]:
        """The open sessions (of ``tenant``; "" for every one) after ``after`` in (tenant,
        session id) order, each read when reached (one closed meanwhile is left out): a page
        reads only the sessions it returns."""
        for t, sid in self.store.session_ids(tenant or None):
            if (t, sid) > after and (info := self.store.session_info(t, sid)) is not None:
                yield info

    def close_session(self, tenant: str, session: str) -> SessionInfo:
        """Close a session of ``tenant`` (its namespace); the session as it was just before."""
        if not session:
            raise InvalidArgument("session_id is required")
        return self.store.end_session(tenant, session)

    def purge_model(self, fingerprint: bytes) -> int:
        check_fingerprint(fingerprint)
        return int(self.store.purge_model(fingerprint))


def quota_by_tier(quota_bytes: Any) -> dict[str, int]:
    """``quota_bytes`` keyed by tier label (``{"HBM": 1}`` -> ``{"hbm": 1}``); InvalidArgument
    naming the tier when two spellings name one tier. (They were folded into one dict here,
    before the Store could refuse the duplicate: one value was kept silently, which one
    depending on the order of the request's map.)"""
    return {t.label: int(v) for t, v in Tier.each_once(sorted(quota_bytes.items())).items()}


def _names(namespaces: Any) -> str:
    return "[" + ", ".join(namespaces) + "]"


def create_detail(role: Role | str, namespaces: list[str]) -> str:
    """The audit detail of ``tenant.create``: ``role=tenant namespaces=[shared:a]`` (``role``
    as sent when it names no role: the call is refused, and recorded)."""
    return f"role={role.value if isinstance(role, Role) else role} namespaces={_names(namespaces)}"


def grant_detail(before: tuple[str, ...], after: tuple[str, ...]) -> str:
    """The audit detail of a grant or revoke that was made: ``namespaces [a] -> [a, b]``."""
    return f"namespaces {_names(before)} -> {_names(after)}"


def session_detail(info: SessionInfo) -> str:
    """The audit detail of ``session.close``: ``state=active blocks=3 bytes=196608 pinned=3
    freed=2 idle_s=12.0``, the session as it was closed (``freed``: the pins only it held)."""
    return (f"state={info.state.value} blocks={info.blocks} bytes={info.nbytes} pinned={info.pinned_blocks} "
            f"freed={info.only_pinned_blocks} idle_s={info.idle_s:.1f}")


def policy_detail(policy: TenantPolicy) -> str:
    """``ttl_s=30.0 quota={hbm=1048576} priority=0``, one policy as the audit log words it."""
    quota = ", ".join(f"{t}={v}" for t, v in sorted(policy.quota_bytes.items()))
    return f"ttl_s={policy.ttl_s} quota={{{quota}}} priority={policy.priority}"


def model_policy_detail(policy: ModelPolicy) -> str:
    """``ttl_s=30.0``, a model's policy as the audit log words it (``ttl_s=None``: none)."""
    return f"ttl_s={policy.ttl_s}"
