"""vLLM connector (session 18 fixes): a worker with no registered caches reports its loads
failed. Driven with the stand-ins of tests/test_integration_vllm.py against a live sidecar."""

from __future__ import annotations

from typing import Any

import test_integration_vllm as base
from test_integration_vllm import BS, Request, kv_caches, prompt

# the fixtures of tests/test_integration_vllm.py (the connector on its stand-ins, a sidecar, engines)
kvv, sidecar, engine = base.kvv, base.sidecar, base.engine


def test_a_worker_without_registered_caches_reports_its_load_failed(engine: Any) -> None:
    """_scatter writes the registered layers only: with none registered a load wrote nothing and
    was reported successful, so vLLM ran attention over whatever the engine blocks held."""
    src = engine()
    src.register([kv_caches(seed=1)])
    p = prompt(3)
    src.run(Request("a", p), [1, 2, 3, 4])
    eng = engine(src.extra["kvstore_token"])
    eng.caches = [kv_caches()]  # the engine's caches, never registered with the worker
    ext, errors, _ = eng.run(Request("b", p), [5, 6, 7, 8])
    assert ext == 3 * BS
    assert errors == [{5, 6, 7}]  # reported to vLLM, which recomputes them
    assert eng.workers[0].counts.failed_loads == 3
    assert all(int(c[5:8].count_nonzero()) == 0 for c in eng.caches[0].values())  # nothing written
