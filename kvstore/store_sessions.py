"""Sessions of the Store: pin a session's blocks in HBM, park them in DRAM, unpin them.

A mixin of :class:`kvstore.store.Store`, like :mod:`kvstore.store_reserve`: it uses the Store's
lock, index, session table, placement and chain walk. A session's state decides its blocks'
pins (see DESIGN.md §7):

* ACTIVE/RESUMED pin them in HBM (``Store.put(..., session=)`` lands them there;
  :meth:`SessionPins.resume_session`, or re-opening the session, pins a paused session's blocks
  again and brings them up);
* PAUSED unpins them and demotes them to DRAM, where they are kept (the reuse policy counts
  them as a paused session's blocks); one DRAM has no room for, short of dropping another
  paused block, stays in HBM unpinned and kept (counted ``pause_left_in_hbm``);
* CLOSED unpins them: they stay as shareable prefix cache under the policy.

:meth:`SessionPins.prefetch` brings the usable prefix of any chain up to a tier ahead of use.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvstore.block import BlockMeta, SessionState, Tier
from kvstore.errors import InvalidArgument, NVMeWriteFailed, ResourceExhausted
from kvstore.keys import check_keys
from kvstore.sessions import Session
from kvstore.sizes import format_size
from kvstore.spec import ModelSpec
from kvstore.store_reserve import _parent

log = logging.getLogger(__name__)


class SessionPins:
    """Store methods of sessions and prefetch (see the module docstring)."""

    def _session(self, tenant: str, session: str) -> Session:
        self._check_tenant(tenant)
        return self._sessions.get(tenant, session)

    def _session_blocks(self, tenant: str, sess: Session) -> list[BlockMeta]:
        out = [self._index.get(tenant, k) for k in sess.keys]
        return [m for m in out if m is not None]

    def _session_add(self, sess: Session, meta: BlockMeta) -> None:
        if meta.key in sess.keys:
            return
        sess.keys[meta.key] = None
        meta.sessions.add(sess.sid)
        if sess.state in (SessionState.ACTIVE, SessionState.RESUMED):
            meta.pins += 1
        elif sess.state == SessionState.PAUSED:
            meta.paused += 1

    def _turn(self, tenant: str, session: str, *, pause: bool) -> list[BlockMeta] | None:
        """Move a session's pins to PAUSED (``pause``) or back to RESUMED and return its blocks;
        None when it already is in that state (paused) or not paused (resume). Under the lock."""
        self._check_open()
        sess = self._session(tenant, session)
        if (sess.state == SessionState.PAUSED) == pause:
            return None
        blocks = self._session_blocks(tenant, sess)
        step = 1 if pause else -1
        for m in blocks:
            m.pins -= step
            m.paused += step
        sess.state = SessionState.PAUSED if pause else SessionState.RESUMED
        return blocks

    def open_session(self, tenant: str, session: str, *, max_sessions: int | None = None) -> SessionState:
        """Start (or re-open) a session: blocks put with ``session=`` are pinned in HBM; returns
        its state after the call. Re-opening an ACTIVE/RESUMED session changes nothing;
        re-opening a PAUSED one resumes it (:meth:`resume_session`: all or nothing, and
        ResourceExhausted, the session still paused, when HBM is full of pinned blocks).
        ``max_sessions``: refuse a new one (ResourceExhausted) when the tenant has that many."""
        self._check_tenant(tenant)
        if not isinstance(session, str) or not session:
            raise InvalidArgument("session id must be a non-empty string")
        with self._lock:
            self._check_open()
            sess = self._sessions.open(tenant, session, max_sessions)
            if sess.state == SessionState.PAUSED:
                # NOTE: a paused session was left paused while the service answered ACTIVE: its
                # later puts were not pinned, and the policy evicted them
                with self._batch():
                    self._resume_locked(tenant, session)
            return sess.state

    def session_verb(self, tenant: str, session: str, verb: str, *,
                     max_sessions: int | None = None) -> SessionState:
        """Run ``verb`` (open, pause, resume or close) on the session and return its state
        after the call, read under the same lock (CLOSED once closed); what the service answers.
        Why: a verb's own name is not the state it leaves (resuming an ACTIVE session leaves it
        ACTIVE; a failed re-open leaves it PAUSED)."""
        with self._lock:
            if verb == "open":
                return self.open_session(tenant, session, max_sessions=max_sessions)
            if verb == "close":
                self.close_session(tenant, session)
                return SessionState.CLOSED
            if verb == "pause":
                self.pause_session(tenant, session)
            elif verb == "resume":
                self.resume_session(tenant, session)
            else:
                raise InvalidArgument(f"unknown session verb {verb!r}")
            return self._session(tenant, session).state

    def pause_session(self, tenant: str, session: str) -> int:
        """Unpin the session's blocks and demote them to DRAM (kept); returns blocks moved."""
        with self._lock, self._batch():
            blocks = self._turn(tenant, session, pause=True)
            if blocks is None:
                return 0
            moved = self._park(blocks)
            self._fit_quotas(tenant)
            self._left_in_hbm(tenant, session, blocks)
            return moved

    def _park(self, blocks: list[BlockMeta]) -> int:
        """Demote a paused session's unpinned HBM blocks to DRAM, leaves first (a prefix that an
        HBM branch still needs stays); returns blocks moved. Under the lock.

        Room in DRAM is made as for any block (the tenant's own blocks first when its quota
        binds), except that no paused block is evicted out of the last local tier for it
        (``Placement.keep_paused``): a block that finds no other room stays in HBM, unpinned
        and kept (:meth:`_left_in_hbm` counts it), where HBM's own eviction demotes it later
        if HBM needs the room."""
        moved = 0
        if Tier.HBM in self._mem and Tier.DRAM in self._mem:
            # The session's blocks are protected while it moves them, so making room in
            # DRAM for one never pushes an already-moved one further down.
            idents = [(m.tenant, m.key) for m in blocks]
            self._place.protected.update(idents)
            keep, self._place.keep_paused = self._place.keep_paused, True
            try:
                for m in sorted(blocks, key=lambda m: -m.depth):  # leaves first
                    if m.tier != Tier.HBM or m.pins:
                        continue
                    if any(c.tier == Tier.HBM for c in self._index.children(m)):
                        continue  # a shared prefix another HBM branch still needs
                    moved += self._place.move(m, Tier.DRAM)
            finally:
                self._place.protected.difference_update(idents)
                self._place.keep_paused = keep
        self.counters.add("demotions", moved)  # NOTE: counted in moved_hbm_to_dram only, before
        return moved

    def _left_in_hbm(self, tenant: str, session: str, blocks: list[BlockMeta]) -> int:
        """Count (``pause_left_in_hbm``) and log the blocks of paused ``session`` that stay in
        HBM unpinned; returns how many. Under the lock.

        NOTE: pause_session returns the blocks it moved, and nothing said that the rest had
        stayed in HBM (DRAM full of pinned or paused blocks, or the tenant's DRAM quota full of
        its own): kept and unpinned, so nothing is lost, but not where DESIGN.md §5 puts them."""
        if Tier.HBM not in self._mem:
            return 0
        left = sum(1 for m in blocks
                   if m.tier == Tier.HBM and not m.pins and self._index.get(m.tenant, m.key) is m)
        if left:
            self.counters.add("pause_left_in_hbm", left)
            log.info("session %r of %r paused: %d of its %d blocks stay in hbm, unpinned (no room "
                     "below without evicting kept blocks, or a prefix an hbm branch needs)",
                     session, tenant, left, len(blocks))
        return left

    def resume_session(self, tenant: str, session: str) -> int:
        """Pin the session's blocks again and bring them (with any ancestors they continue
        from) up to the fastest tier; returns blocks moved. All or nothing: when that tier
        cannot take them all (the rest of it is pinned by sessions or in flight, or the
        tenant's quota there binds), the session stays PAUSED and ResourceExhausted says so
        (resource ``quota:TENANT:TIER`` when the quota binds, as a put's refusal); retry when
        room is freed. Checked before anything moves, each block at its own size
        (``Placement.fits_now``): a refused resume evicts nothing. A block that fails its
        integrity check on the way up is dropped with the blocks after it (counted
        ``integrity_failures``; a miss later, as for a get) and the session resumes with the
        rest: the count moved leaves it out."""
        with self._lock, self._batch():
            return self._resume_locked(tenant, session)

    def _resume_locked(self, tenant: str, session: str) -> int:
        """:meth:`resume_session`, under the lock and inside a batch."""
        blocks = self._turn(tenant, session, pause=False)
        if blocks is None:
            return 0
        top = self.tiers[0]
        # NOTE: with the ancestors outside the session in a slower tier (one stopped it all)
        chain = self._up_chain(blocks, top)
        up = [m for m in chain if m.tier > top]
        # NOTE: the room was found out by promoting: a resume refused in the end had evicted,
        # demoted or dropped other tenants' unpinned blocks first, and every retry did again.
        # The session's blocks and all their ancestors are held where they are (promote
        # protects them): an ancestor already in ``top`` (a prefix outside the session) was
        # counted as room, and the resume was refused only after it had moved blocks. NOTE:
        # each block is sized as its own (Placement.fits_now): sized all as the smallest, a
        # session of a target and a draft model passed, evicted, and was refused
        if up and not self._place.fits_now(tenant, [m.nbytes for m in up], top, blocks):
            self._turn(tenant, session, pause=True)  # nothing moved: the pins as they were
            raise self._resume_refusal(tenant, session, top, up, blocks, moved=False)
        moved = self._place.promote(chain, top)
        # NOTE: a block that failed its integrity check on the way up is gone (with its
        # subtree), a miss later as for a get; counted as one that did not fit, it turned the
        # resume into a ResourceExhausted blaming pinned blocks in an empty HBM. promote stops
        # at it, so what else the chain holds is brought up again without it
        while len(kept := [m for m in chain if self._index.get(m.tenant, m.key) is m]) < len(chain):
            chain = kept
            moved += self._place.promote(chain, top)
        if len(kept := [m for m in blocks if self._index.get(m.tenant, m.key) is m]) < len(blocks):
            log.warning("session %r of %r resumed without %d of its blocks, lost to an integrity "
                        "failure", session, tenant, len(blocks) - len(kept))
            blocks = kept
        if any(m.tier != top for m in blocks):
            # NOTE: this returned a smaller count and left pinned blocks in DRAM, silently
            # (the check above is an upper bound: what it let through may still not fit)
            self._turn(tenant, session, pause=True)
            self._park(blocks)
            self._left_in_hbm(tenant, session, blocks)
            raise self._resume_refusal(tenant, session, top, up, blocks, moved=True)
        return moved

    def _beyond_top(self, tenant: str, total: int) -> str | None:
        """Why a session of ``total`` bytes could never be resumed into the top memory tier:
        past its capacity or the tenant's quota there; None when it could. Under the lock."""
        top = self.tiers[0]
        if top not in self._mem:
            return None
        capacity, quota = self._mem[top].capacity, self._quota(tenant, top)
        if total > capacity:
            return f"{format_size(total)}, more than {top.label} holds ({format_size(capacity)})"
        if quota is not None and total > quota:
            return f"{format_size(total)}, more than the tenant's quota {top.label}={format_size(quota)}"
        return None

    def _check_paused_put(self, tenant: str, sess: Session, keys: Sequence[bytes], nbytes: int) -> None:
        """ResourceExhausted when a put of ``keys`` (``nbytes`` each) naming PAUSED ``sess``
        would make the session more than the top tier can ever take. Under the lock.

        NOTE: an ACTIVE session's put is held to the top tier, so to its size; a paused one's is
        placed as any put (0595fa3), and one took a session past it: every resume was refused
        after that, blaming other sessions' pins when none were left."""
        get = self._index.tenant_blocks(tenant).get
        held = sum(m.nbytes for k in sess.keys if (m := get(k)) is not None)
        new = nbytes * len({k for k in keys if k not in sess.keys})
        why = self._beyond_top(tenant, held + new)
        if why is not None:
            raise ResourceExhausted(
                f"session {sess.sid!r} of tenant {tenant!r} is paused, and this put would make it {why}: "
                f"it could never be resumed; put these blocks without the session, or close it",
                resource=self.tiers[0].label)

    def _resume_refusal(self, tenant: str, session: str, top: Tier, up: list[BlockMeta],
                        held: list[BlockMeta], *, moved: bool) -> ResourceExhausted:
        """The error of a refused resume of ``session``, whose blocks ``up`` (and ancestors)
        did not fit in ``top`` (``moved``: they were moved up and back down), ``held`` its
        blocks; made by the put's ``Store._refusal``. Under the lock.

        NOTE: it said how many blocks did not fit, which told a tenant how much of the tier
        other tenants' sessions pinned ("1 of 6", "4 of 6"); and one refused by the tenant's own
        quota (the tier empty) said the tier was full of pinned blocks, uncounted. Now the
        count is left out, and only the tenant's own quota and usage are named when it binds."""
        sizes = [m.nbytes for m in up]
        fits = self._place.fits_now
        bound = (top if up and fits(tenant, sizes, top, held, quotas=False)
                 and not fits(tenant, sizes, top, held) else None)
        beyond = self._beyond_top(tenant, sum(m.nbytes for m in held))
        if beyond is not None:  # NOTE: it blamed other sessions' pins (or told to close the others): no close could help
            why = f"it holds {beyond}: close it (its blocks stay as prefix cache)"
            if bound is not None:
                why += " or raise its quota (kvstore policy set)"
        elif bound is not None:
            quota = self._quota(tenant, bound) or 0
            own = self._place.tenant_usage.get((tenant, bound), 0)
            why = (f"its quota {bound.label}={format_size(quota)} binds (it holds {format_size(own)} "
                   f"there); raise its quota (kvstore policy set) or close its other sessions")
        else:
            why = (f"{top.label} cannot make room for them (the rest of it is pinned by sessions or in "
                   f"flight); resume it once sessions close")
        return self._refusal(tenant, bound, top, (
            f"session {session!r} cannot be resumed: its blocks do not all fit in {top.label} for tenant "
            f"{tenant!r}: {why}; the session stays paused"
            + ("" if moved else ", nothing was moved")))

    def close_session(self, tenant: str, session: str) -> None:
        """Unpin the session's blocks; they stay as shareable prefix cache under policy."""
        self._end_session(tenant, session, "closed")

    def _end_session(self, tenant: str, session: str, how: str) -> None:
        """:meth:`close_session`; a later use of the id is told it was ``how``."""
        with self._lock:
            self._check_open()
            sess = self._session(tenant, session)
            for m in self._session_blocks(tenant, sess):
                if sess.state == SessionState.PAUSED:
                    m.paused -= 1
                else:
                    m.pins -= 1
                m.sessions.discard(session)
            self._sessions.remove(tenant, session, how)
            try:
                with self._batch():
                    self._fit_quotas(tenant)
            except NVMeWriteFailed as exc:  # the session is closed: the demotions are best effort
                log.warning("session %r of %r %s, but %s", session, tenant, how, exc)

    def _fit_quotas(self, tenant: str) -> None:
        """Bring ``tenant`` within its quotas now that pins are gone (under the lock).

        NOTE: a quota lowered under a session's pinned blocks keeps them (set_tenant_policy);
        once they were unpinned nothing applied it: the tenant stayed over its quota until it
        happened to put again (3x its HBM quota in the prober's case). Its own blocks are
        evicted (demoted) now, as set_tenant_policy evicts them."""
        for tier in self.tiers:
            self._place.fit_quota(tenant, tier)

    def session_state(self, tenant: str, session: str) -> SessionState:
        """The session's state: a look, no use of it (its idle timer runs on). NOTE: it was a
        use: an engine that polled the state kept an abandoned session pinned for good."""
        self._check_tenant(tenant)
        with self._lock:
            sess = self._sessions.peek(tenant, session)
            if sess is None:
                self._sessions.get(tenant, session)  # NotFound, saying how it ended if it did
            assert sess is not None
            return sess.state

    def prefetch(self, tenant: str, spec: ModelSpec, keys: Sequence[bytes],
                 tier: str | Tier = "hbm", *, parent: bytes | None = None) -> int:
        """Bring the longest usable prefix up to ``tier`` ahead of use, with the ancestors it
        continues from (``parent`` and up) that lie below ``tier``: no block sits above its
        parent; returns blocks moved, those ancestors included."""
        self._check_tenant(tenant)  # NOTE: a tenant of None or of 10,000 characters returned 0
        self._check_spec(spec)
        t = Tier.parse(tier)
        if t not in self.tiers:
            from kvstore.errors import UnknownTier

            raise UnknownTier(f"tier {t.label!r} is not enabled in this store")
        keys = check_keys(keys)
        with self._lock, self._batch():
            self._check_open()
            chain = self._chain(tenant, spec, keys, self._clock(), _parent(parent))
            # NOTE: only the keys' blocks were promoted: under a parent below ``tier`` (a chain
            # continued with parent= whose start was demoted) the first could not go above it,
            # and nothing moved (0), though the tier had room
            return self._place.promote(self._up_chain(chain, t), t)
