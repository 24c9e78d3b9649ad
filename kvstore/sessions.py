"""Session records (DESIGN.md §5): which blocks a session holds and in which state.

The table is bookkeeping only; the Store applies the state changes (pins, demotion, prefetch).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from kvstore.block import BlockMeta, SessionState
from kvstore.errors import NotFound, ResourceExhausted


@dataclass(slots=True)
class Session:
    sid: str
    state: SessionState
    keys: dict[bytes, None] = field(default_factory=dict)  # insertion-ordered set

    @property
    def pinning(self) -> bool:
        """ACTIVE and RESUMED sessions pin their blocks."""
        return self.state in (SessionState.ACTIVE, SessionState.RESUMED)


class SessionTable:
    def __init__(self) -> None:
        self._by_id: dict[tuple[str, str], Session] = {}
        self._count: dict[str, int] = {}  # sessions per tenant

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[tuple[str, str]]:
        return iter(list(self._by_id))

    def get(self, tenant: str, sid: str) -> Session:
        sess = self._by_id.get((tenant, sid))
        if sess is None:
            raise NotFound(f"unknown session {sid!r} of tenant {tenant!r}")
        return sess

    def open(self, tenant: str, sid: str, limit: int | None = None) -> Session:
        """The session, created ACTIVE when new; an existing one is returned in whatever state
        it is (the Store resumes a PAUSED one: :meth:`kvstore.store.Store.open_session`); a new
        one past ``limit`` sessions of the tenant -> ResourceExhausted."""
        sess = self._by_id.get((tenant, sid))
        if sess is not None:
            return sess
        n = self._count.get(tenant, 0)
        if limit is not None and n >= limit:
            raise ResourceExhausted(f"tenant {tenant!r} has {n} open sessions, the most allowed "
                                    f"(limits.max_sessions_per_tenant): close some first",
                                    resource="limits.max_sessions_per_tenant")
        sess = self._by_id[(tenant, sid)] = Session(sid, SessionState.ACTIVE)
        self._count[tenant] = n + 1
        return sess

    def remove(self, tenant: str, sid: str) -> None:
        del self._by_id[(tenant, sid)]
        self._count[tenant] -= 1
        if not self._count[tenant]:
            del self._count[tenant]

    def drop_tenant(self, tenant: str) -> None:
        for k in [k for k in self._by_id if k[0] == tenant]:
            del self._by_id[k]
        self._count.pop(tenant, None)

    def forget_block(self, meta: BlockMeta) -> None:
        """A block left the store: no session lists it any more."""
        for sid in meta.sessions:
            sess = self._by_id.get((meta.tenant, sid))
            if sess is not None:
                sess.keys.pop(meta.key, None)
