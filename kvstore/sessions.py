"""Session records (DESIGN.md §5): which blocks a session holds and in which state.

The table is bookkeeping only; the Store applies the state changes (pins, demotion, prefetch).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from kvstore.block import BlockMeta, SessionState
from kvstore.errors import NotFound


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

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[tuple[str, str]]:
        return iter(list(self._by_id))

    def get(self, tenant: str, sid: str) -> Session:
        sess = self._by_id.get((tenant, sid))
        if sess is None:
            raise NotFound(f"unknown session {sid!r} of tenant {tenant!r}")
        return sess

    def open(self, tenant: str, sid: str) -> Session:
        """The session, created ACTIVE when new (re-opening is idempotent)."""
        return self._by_id.setdefault((tenant, sid), Session(sid, SessionState.ACTIVE))

    def remove(self, tenant: str, sid: str) -> None:
        del self._by_id[(tenant, sid)]

    def drop_tenant(self, tenant: str) -> None:
        for k in [k for k in self._by_id if k[0] == tenant]:
            del self._by_id[k]

    def forget_block(self, meta: BlockMeta) -> None:
        """A block left the store: no session lists it any more."""
        for sid in meta.sessions:
            sess = self._by_id.get((meta.tenant, sid))
            if sess is not None:
                sess.keys.pop(meta.key, None)
