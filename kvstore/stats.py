"""Counters: named monotonic counts kept by the Store (under its lock) and a drainable
event queue for exporters, so metrics never reach into the Store's internals."""

from __future__ import annotations

from collections import Counter, deque
from typing import Any


class Counters:
    def __init__(self, max_events: int = 10_000) -> None:
        self._counts: Counter[str] = Counter()
        self._events: deque[tuple[str, int]] = deque(maxlen=max_events)

    def add(self, name: str, n: int = 1) -> None:
        if n:
            self._counts[name] += n
            self._events.append((name, n))

    def get(self, name: str) -> int:
        return self._counts.get(name, 0)

    def snapshot(self) -> dict[str, Any]:
        return dict(self._counts)

    def take_events(self) -> list[tuple[str, int]]:
        """Drain the (name, increment) events recorded since the last call."""
        out = list(self._events)
        self._events.clear()
        return out
