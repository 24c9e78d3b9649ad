"""Session records (DESIGN.md §5): which blocks a session holds, in which state, last used when.

The table is bookkeeping only; the Store applies the state changes (pins, demotion, prefetch).

Sessions live in memory only: they do not survive a restart of the store. Their blocks do (those
committed to NVMe come back there, as ordinary blocks: unpinned, in no session), and a session
id the table does not know is NotFound with a message that says so: a client cannot otherwise
tell a session lost to a restart from one it never opened. Persisting sessions is not done:
after a restart the client opens the session again and puts (or re-pins) what it needs.

Idle expiry: every lookup of a session (:meth:`SessionTable.get`, which the session verbs and a
put naming the session go through) and every :meth:`SessionTable.open` is a use and refreshes
its ``last_used``; :meth:`SessionTable.idle` names the sessions unused for too long, which the
Store pauses or closes (``Store.expire``). Why: a client that goes away without closing its
session (a crash, a disconnect) left its blocks pinned in HBM, and its id counted against the
tenant's session limit, for as long as the store ran.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from kvstore.block import BlockMeta, SessionState
from kvstore.errors import NotFound, ResourceExhausted


@dataclass(slots=True)
class Session:
    sid: str
    state: SessionState
    keys: dict[bytes, None] = field(default_factory=dict)  # insertion-ordered set
    last_used: float = 0.0  # the table's clock at its last use (idle expiry)

    @property
    def pinning(self) -> bool:
        """ACTIVE and RESUMED sessions pin their blocks."""
        return self.state in (SessionState.ACTIVE, SessionState.RESUMED)


class SessionTable:
    """The sessions of every tenant; ``clock``: the Store's (injected in tests), which dates
    each session's last use."""

    #: how many ended sessions :meth:`get` can still say how they ended (the oldest forgotten)
    ENDED_KEPT = 4096

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._by_id: dict[tuple[str, str], Session] = {}
        self._count: dict[str, int] = {}  # sessions per tenant
        # how recently ended sessions ended, and when (the table's clock), oldest first
        self._ended: OrderedDict[tuple[str, str], tuple[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[tuple[str, str]]:
        return iter(list(self._by_id))

    def get(self, tenant: str, sid: str) -> Session:
        """The session, its last use refreshed (a lookup is a use: a session verb, a put naming
        it); NotFound when unknown, saying that sessions do not survive a restart."""
        sess = self._by_id.get((tenant, sid))
        if sess is None:
            ended = self.how_ended(tenant, sid)
            if ended is not None:
                # NOTE: an engine whose session an operator or the idle expiry closed was told
                # "sessions do not survive a restart": it went looking for a restart
                raise NotFound(f"session {sid!r} of tenant {tenant!r} {ended}; open it again")
            # NOTE: "unknown session" alone: a client whose session was lost to a restart of
            # the store (the sidecar) could not tell it from one it never opened
            raise NotFound(f"unknown session {sid!r} of tenant {tenant!r} (sessions do not survive "
                           f"a restart of the store; open it again)")
        sess.last_used = self._clock()
        return sess

    def how_ended(self, tenant: str, sid: str) -> str | None:
        """``"was closed by ... N s ago"`` for a session among the last :attr:`ENDED_KEPT`
        ended, else None (never opened, open, or forgotten)."""
        ended = self._ended.get((tenant, sid))
        if ended is None:
            return None
        how, when = ended
        return f"was {how} {max(self._clock() - when, 0.0):.0f} s ago"

    def peek(self, tenant: str, sid: str) -> Session | None:
        """The session, or None when unknown; no use of it (an operator's look, its last use
        left as it was)."""
        return self._by_id.get((tenant, sid))

    def open(self, tenant: str, sid: str, limit: int | None = None) -> Session:
        """The session, created ACTIVE when new; an existing one is returned in whatever state
        it is (the Store resumes a PAUSED one: :meth:`kvstore.store.Store.open_session`); a new
        one past ``limit`` sessions of the tenant -> ResourceExhausted."""
        sess = self._by_id.get((tenant, sid))
        if sess is not None:
            sess.last_used = self._clock()
            return sess
        n = self._count.get(tenant, 0)
        if limit is not None and n >= limit:
            raise ResourceExhausted(f"tenant {tenant!r} has {n} open sessions, the most allowed "
                                    f"(limits.max_sessions_per_tenant): close some first",
                                    resource="limits.max_sessions_per_tenant")
        sess = self._by_id[(tenant, sid)] = Session(sid, SessionState.ACTIVE, last_used=self._clock())
        self._count[tenant] = n + 1
        self._ended.pop((tenant, sid), None)
        return sess

    def idle(self, now: float, pause_after: float, close_after: float
             ) -> tuple[list[tuple[str, Session]], list[tuple[str, Session]]]:
        """``(to_close, to_pause)``: the sessions unused for ``close_after`` seconds or more (any
        state), and the pinning ones (ACTIVE/RESUMED) unused for ``pause_after`` or more that
        are not closed; each as ``(tenant, session)``. 0 turns either off."""
        to_close: list[tuple[str, Session]] = []
        to_pause: list[tuple[str, Session]] = []
        for (tenant, _), sess in self._by_id.items():
            idle = now - sess.last_used
            if close_after and idle >= close_after:
                to_close.append((tenant, sess))
            elif pause_after and idle >= pause_after and sess.pinning:
                to_pause.append((tenant, sess))
        return to_close, to_pause

    def remove(self, tenant: str, sid: str, how: str = "closed") -> None:
        """Forget the session; :meth:`get` says it was ``how`` ("closed by an operator", ...)
        while it is among the last :attr:`ENDED_KEPT` ended."""
        del self._by_id[(tenant, sid)]
        self._count[tenant] -= 1
        if not self._count[tenant]:
            del self._count[tenant]
        self._ended.pop((tenant, sid), None)
        self._ended[(tenant, sid)] = (how, self._clock())
        while len(self._ended) > self.ENDED_KEPT:
            self._ended.popitem(last=False)

    #: how a session ended when an admin dropped its shared namespace's blocks
    NAMESPACE_DROPPED = "ended by an admin drop of the namespace's blocks"

    def drop_tenant(self, tenant: str, *, namespace_stays: bool = False) -> None:
        """End every session of ``tenant``, its blocks gone. A deleted tenant's are forgotten,
        with how its sessions ended (a new tenant of the name learns nothing); with
        ``namespace_stays`` (a shared namespace whose blocks an admin dropped, its publishers
        kept) each is remembered as :attr:`NAMESPACE_DROPPED`.

        NOTE: forgotten there too, a publisher's next verb was told its session did not
        survive a restart of the store, though none happened."""
        if namespace_stays:
            for t, sid in [k for k in self._by_id if k[0] == tenant]:
                self.remove(t, sid, self.NAMESPACE_DROPPED)
            return
        for k in [k for k in self._by_id if k[0] == tenant]:
            del self._by_id[k]
        for k in [k for k in self._ended if k[0] == tenant]:
            del self._ended[k]
        self._count.pop(tenant, None)

    def forget_block(self, meta: BlockMeta) -> None:
        """A block left the store: no session lists it any more."""
        for sid in meta.sessions:
            sess = self._by_id.get((meta.tenant, sid))
            if sess is not None:
                sess.keys.pop(meta.key, None)
