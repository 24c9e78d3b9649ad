"""ExtentAllocator: first-fit allocation of contiguous byte ranges inside a fixed arena.

Pure bookkeeping (no tensors), so property tests run anywhere. Guarantees:

* allocated extents never overlap and lie inside ``[0, capacity)``;
* ``used`` is the sum of allocated lengths and never exceeds ``capacity``;
* ``free(offset)`` returns exactly the extent that ``alloc`` gave, and adjacent free ranges are
  coalesced, so a pool of equal-sized blocks never fragments.

Sizes are rounded up to ``alignment`` bytes. ``alloc`` returns ``None`` when no free range is
large enough (an expected outcome, not an error); a size that is not a positive whole number
is a caller's bug, refused (InvalidArgument) before it touches the free list.
"""

from __future__ import annotations

import bisect
import operator

from kvstore.errors import InvalidArgument


class ExtentAllocator:
    def __init__(self, capacity: int, alignment: int = 256) -> None:
        if capacity < 0 or alignment <= 0:
            raise ValueError("capacity must be >= 0 and alignment > 0")
        self.capacity = capacity - capacity % alignment
        self.alignment = alignment
        # free ranges as two parallel sorted lists: starts and lengths
        self._starts: list[int] = [0] if self.capacity else []
        self._lens: list[int] = [self.capacity] if self.capacity else []
        self._allocated: dict[int, int] = {}  # offset -> rounded length
        self.used = 0

    def rounded(self, nbytes: int) -> int:
        a = self.alignment
        return max(a, (nbytes + a - 1) // a * a)

    def alloc(self, nbytes: int) -> int | None:
        try:
            whole = operator.index(nbytes)
        except TypeError:
            whole = 0
        if whole <= 0 or isinstance(nbytes, bool):
            # NOTE: a float size left float offsets in the free list (every later slice of the
            # arena failed); a negative or zero one was rounded up to one aligned extent
            raise InvalidArgument(f"an extent is a positive whole number of bytes, got {nbytes!r}")
        size = self.rounded(whole)
        for i, length in enumerate(self._lens):
            if length >= size:
                start = self._starts[i]
                if length == size:
                    del self._starts[i]
                    del self._lens[i]
                else:
                    self._starts[i] = start + size
                    self._lens[i] = length - size
                self._allocated[start] = size
                self.used += size
                return start
        return None

    def free(self, offset: int) -> None:
        size = self._allocated.pop(offset)  # KeyError on a double free: a bug, let it surface
        self.used -= size
        i = bisect.bisect_left(self._starts, offset)
        # coalesce with the following range
        if i < len(self._starts) and self._starts[i] == offset + size:
            size += self._lens[i]
            del self._starts[i]
            del self._lens[i]
        # coalesce with the preceding range
        if i > 0 and self._starts[i - 1] + self._lens[i - 1] == offset:
            self._lens[i - 1] += size
        else:
            self._starts.insert(i, offset)
            self._lens.insert(i, size)

    def can_fit(self, nbytes: int) -> bool:
        size = self.rounded(nbytes)
        for length in self._lens:  # NOTE: a plain loop: any(<genexpr>) costs ~1 us more
            if length >= size:
                return True
        return False

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used

    def extents(self) -> list[tuple[int, int]]:
        """Allocated (offset, length) pairs, sorted; for tests and diagnostics."""
        return sorted(self._allocated.items())
