"""vLLM connector (session 18 fixes): with TP > 1, blocks a healthy rank stored over another
rank's failed load are deleted however vLLM ends the request (preempted then resumed, aborted),
not only at its rerun; a worker with no registered caches reports its loads failed. Driven with
the stand-ins of tests/test_integration_vllm.py against a live sidecar."""

from __future__ import annotations

import types
from typing import Any

import test_integration_vllm as base
from test_integration_vllm import BS, Engine, Request, kv_caches, prompt, same_blocks, sched_output
from test_vllm_fixes15 import Evicted, cached_output, evicted, recompute, stored

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


def connector_output(eng: Engine, errors: list[set[int]]) -> None:
    """What vLLM does after a step: every worker's failed blocks to the scheduler connector.
    NOTE: vLLM's base class has ``update_connector_output`` as a no-op; the stand-in base lacks it."""
    update = getattr(eng.sched, "update_connector_output", lambda output: None)
    update(types.SimpleNamespace(invalid_block_ids=set().union(*errors)))


def failed_on_rank1(kvv: Any, engine: Any, sidecar: Any) -> Evicted:
    """tp=2, request ``b`` offered q's 3 stored blocks, of which rank 1 lost blocks 1 and 2
    before the load: rank 0 loaded its own and stored blocks 3 and 4, computed in that step over
    rank 1's stale KV (engine blocks 10..15); vLLM is told."""
    ev = evicted(kvv, engine, sidecar, slice(1, 3), tp=2, rank=1)
    _, errors = ev.eng.step(sched_output([("b", [10, 11, 12, 13, 14, 15], ev.ext)], {"b": len(ev.q) - ev.ext}))
    assert errors == [set(), {11, 12}]
    assert stored(sidecar, ev, 0, 3, 2) == 2
    connector_output(ev.eng, errors)
    return ev


def test_tp2_a_request_preempted_before_its_rerun_deletes_the_blocks_computed_over_the_failed_load(
        kvv: Any, engine: Any, sidecar: Any) -> None:
    """vLLM rolled the request back, then preempted it: it came back as resumed (no rollback
    seen), its fresh lookup kept the blocks counted sent, nothing was deleted or saved again, and
    once rank 1 had blocks 3 and 4 every engine loaded rank 0's, computed over the failed load."""
    ev = failed_on_rank1(kvv, engine, sidecar)
    req = Request("b", ev.q)
    ext, _ = ev.eng.sched.get_num_new_matched_tokens(req, 0)  # back from the waiting queue
    assert stored(sidecar, ev, 0, 3, 2) == 0  # deleted before the lookup could count them
    assert ext == BS  # block 0: rank 1 lacks blocks 1 and 2
    ev.eng.sched.update_state_after_alloc(req, None, ext)
    ids = [20, 21, 22, 23, 24, 25]
    for rank, caches in enumerate(ev.eng.caches):
        recompute(caches, ids[1:], seed=11 + rank)  # the rerun's KV
    out = sched_output([], {"b": len(ev.q) - ext})
    out.scheduled_cached_reqs = types.SimpleNamespace(req_ids=["b"], resumed_req_ids={"b"}, new_block_ids=[(ids,)],
                                                      num_computed_tokens=[ext])
    _, errors = ev.eng.step(out)
    assert errors == [set(), set()]
    ev.eng.sched.request_finished(req, ids)
    sources = ev.eng.caches
    ev.eng.register([kv_caches(), kv_caches()])
    fresh = [26, 27, 28, 29, 30, 31]
    ext, errors, _ = ev.eng.run(Request("c", ev.q), fresh)
    assert ext == 5 * BS and errors == [set(), set()]
    for src, dst in zip(sources, ev.eng.caches, strict=True):
        assert same_blocks(src, ids[3:5], dst, fresh[3:5])  # the rerun's blocks 3 and 4, on every rank


def test_tp2_a_request_aborted_before_its_rerun_deletes_the_blocks_computed_over_the_failed_load(
        kvv: Any, engine: Any, sidecar: Any) -> None:
    """Only FINISHED_ERROR deleted them: aborted (or finished otherwise) before vLLM reran it,
    rank 0 kept blocks 3 and 4, a hit once another request stored them on rank 1."""
    ev = failed_on_rank1(kvv, engine, sidecar)
    req = Request("b", ev.q)
    req.status = types.SimpleNamespace(name="FINISHED_ABORTED")  # type: ignore[attr-defined]
    ev.eng.sched.request_finished(req, [10, 11, 12, 13, 14, 15])
    assert stored(sidecar, ev, 0, 3, 2) == 0
    assert stored(sidecar, ev, 0, 0, 3) == 3  # the blocks it loaded are kept


def test_tp2_after_the_rerun_resaved_them_the_finish_deletes_nothing(kvv: Any, engine: Any, sidecar: Any) -> None:
    """The rollback deletes the blocks and saves them again; the request's record of the failed
    load goes with it, so its finish keeps the blocks the rerun stored."""
    ev = failed_on_rank1(kvv, engine, sidecar)
    ids = [10, 11, 12, 13, 14, 15]
    recompute(ev.eng.caches[0], ids[3:], seed=9)
    recompute(ev.eng.caches[1], ids[1:], seed=10)
    ev.eng.step(cached_output("b", BS, len(ev.q) - BS))  # vLLM's rerun from block 1
    req = Request("b", ev.q)
    req.status = types.SimpleNamespace(name="FINISHED_STOPPED")  # type: ignore[attr-defined]
    ev.eng.sched.request_finished(req, ids)
    assert stored(sidecar, ev, 0, 0, 5) == 5 and stored(sidecar, ev, 1, 0, 5) == 5


def test_loaded_tokens_are_the_tokens_sent_to_be_loaded_a_failed_load_included(kvv: Any, engine: Any,
                                                                                 sidecar: Any) -> None:
    """The report's ``loaded_tokens`` is what the scheduler handed the workers to load, as
    ``sent_blocks`` is for saves: a load that failed (vLLM recomputed its tokens) stays counted;
    the workers count what failed."""
    ev = evicted(kvv, engine, sidecar, slice(1, 3))
    _, errors = ev.eng.step(sched_output([("b", [10, 11, 12, 13, 14, 15], ev.ext)], {"b": len(ev.q) - ev.ext}))
    assert errors == [{11, 12}]
    report = ev.eng.sched.request_finished(Request("b", ev.q), [10, 11, 12, 13, 14, 15])[1]
    assert report is not None and report["kvstore"]["loaded_tokens"] == 3 * BS
    assert ev.eng.workers[0].counts.failed_loads == 2
