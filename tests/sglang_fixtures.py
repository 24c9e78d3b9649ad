"""Fixtures the SGLang HiCache backend's test modules share (imported as ``sglang_fixtures``):
a sidecar per module, and no failure injection from SGLang's factory."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import service_harness


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A sidecar for the requesting module's tests (module scope: one per module)."""
    sc = service_harness.start(tmp_path_factory.mktemp("sglang"))
    yield sc
    sc.stop()


@pytest.fixture(autouse=True)
def _no_failure_injection(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's factory wraps backends in a random-failure proxy when these are set."""
    monkeypatch.delenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", raising=False)
    monkeypatch.delenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", raising=False)
