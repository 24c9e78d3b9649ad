"""DeadlineHeap: which resident blocks have passed their TTL deadline, without a scan.

Every block with a deadline gets one entry when it enters the index. A deadline only ever
moves later (a put of a stored prefix extends it, never shortens it), so an entry's deadline
is never later than its block's: when an entry comes due, :meth:`DeadlineHeap.due` checks
the block's current deadline and either reports it expired or files it again at its new
deadline. Entries of blocks that left the index are dropped when they come due, and the heap
is rebuilt from the live blocks once stale entries outnumber them, so memory stays
proportional to the index.

Callers serialise access (the Store's lock).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable

from kvstore.block import BlockMeta
from kvstore.errors import InvalidArgument

#: rebuild when the heap holds more than this many entries beyond twice the live blocks
_SLACK = 1024


class DeadlineHeap:
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, BlockMeta]] = []
        self._seq = itertools.count()  # ties: BlockMeta does not order
        self._stale = False

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, meta: BlockMeta, live: int) -> None:
        """File ``meta`` (if it has a deadline); ``live``: blocks in the index now, which bounds
        the heap (stale entries are compacted away past ``2 * live + _SLACK``)."""
        if meta.ttl_deadline is not None:
            heapq.heappush(self._heap, (meta.ttl_deadline, next(self._seq), meta))
            if len(self._heap) > 2 * live + _SLACK:
                self._stale = True

    def due(self, now: float, is_live: Callable[[BlockMeta], bool]) -> list[BlockMeta]:
        """Blocks whose deadline is ``<= now`` (``now >= deadline`` is expired), popped;
        entries of blocks no longer live (``is_live``) are discarded, extended ones refiled."""
        heap = self._heap
        out: list[BlockMeta] = []
        while heap and heap[0][0] <= now:
            _, _, meta = heapq.heappop(heap)
            if not is_live(meta) or meta.ttl_deadline is None:
                continue
            if meta.ttl_deadline <= now:
                out.append(meta)
            else:
                heapq.heappush(heap, (meta.ttl_deadline, next(self._seq), meta))
        return out

    def rebuild(self, metas: Iterable[BlockMeta]) -> None:
        """Refile exactly the blocks ``metas`` that have a deadline (drops stale entries)."""
        self._heap = [(m.ttl_deadline, next(self._seq), m) for m in metas if m.ttl_deadline is not None]
        heapq.heapify(self._heap)
        self._stale = False

    @property
    def needs_rebuild(self) -> bool:
        """Stale entries outnumber the live blocks: :meth:`rebuild` before the next :meth:`due`."""
        return self._stale


#: the longest TTL taken, seconds (about 31 years): longer is spelled None (no TTL). NOTE: any
#: finite TTL was taken; 1e306 s overflowed the remote tier's milliseconds (an OverflowError out
#: of a policy set, half applied) and 1e20 s was refused by Redis (PX past int64), after which
#: the tenant's remote writes failed uncounted
MAX_TTL_S = 1e9


def check_ttl(ttl_s: float | None, what: str = "ttl_s") -> float | None:
    """``ttl_s`` as a float, None kept (no TTL); InvalidArgument unless a number > 0 and at most
    :data:`MAX_TTL_S` (NaN passed a ``<= 0`` check, and an infinite TTL is spelled None)."""
    if ttl_s is None:
        return None
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not 0 < ttl_s <= MAX_TTL_S:
        raise InvalidArgument(f"{what} must be a finite number of seconds > 0 and at most {MAX_TTL_S:.0f} "
                              f"(unset it for no TTL), got {ttl_s!r}")
    return float(ttl_s)
