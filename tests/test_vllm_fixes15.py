"""vLLM connector: no block computed over a failed load is ever stored, and the saves resume
once vLLM recomputed from the first failed block; a request whose lookup failed is saved once
the sidecar answers again. Driven with the stand-ins of tests/test_integration_vllm.py."""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

import pytest
import test_integration_vllm as base
import torch
from test_integration_vllm import BS, Engine, Request, VllmConfig, kv_caches, prompt, same_blocks, sched_output

from kvstore.errors import Unavailable

# the fixtures of tests/test_integration_vllm.py (the connector on its stand-ins, a sidecar, engines)
kvv, sidecar, engine = base.kvv, base.sidecar, base.engine


def cached_output(req_id: str, computed: int, tokens: int) -> Any:
    """A ``SchedulerOutput`` that runs ``tokens`` more of a running request from ``computed``."""
    out = sched_output([], {req_id: tokens})
    out.scheduled_cached_reqs = types.SimpleNamespace(req_ids=[req_id], resumed_req_ids=set(), new_block_ids=[None],
                                                      num_computed_tokens=[computed])
    return out


@dataclass
class Evicted:
    """Request ``b`` (prompt ``q``: ``p``'s 3 stored blocks, then 2 more) offered 3 blocks, of
    which ``evict`` went away (on rank ``rank``) before its load, in engine blocks 10..15."""

    eng: Engine
    q: list[int]
    keys: list[list[bytes]]  # per rank, q's 5 keys
    specs: list[Any]
    ext: int


def evicted(kvv: Any, engine: Any, sidecar: Any, evict: slice, *, tp: int = 1, rank: int = 0) -> Evicted:
    eng = engine(tp=tp)
    eng.register([kv_caches(seed=1 + r) for r in range(tp)])
    p = prompt(3)
    eng.run(Request("a", p), [1, 2, 3, 4])
    eng.register([kv_caches(seed=90 + r) for r in range(tp)])  # b's blocks hold stale memory
    q = p[: 3 * BS] + prompt(2)
    ext, _ = eng.sched.get_num_new_matched_tokens(Request("b", q), 0)
    assert ext == 3 * BS
    eng.sched.update_state_after_alloc(Request("b", q), None, ext)
    specs = [kvv.spec_for(VllmConfig(eng.extra, tp=tp), eng.extra, tp_rank=r) for r in range(tp)]
    with sidecar.client(eng.extra["kvstore_token"]) as c:
        keys = [c.block_keys(s, q[: 5 * BS]) for s in specs]
        assert c.delete(keys[rank][evict]) == len(keys[rank][evict])
    return Evicted(eng, q, keys, specs, ext)


def stored(sidecar: Any, ev: Evicted, rank: int, first: int, n: int) -> int:
    """How many of q's blocks ``first..first+n`` rank ``rank`` has stored (chained on ``first-1``)."""
    with sidecar.client(ev.eng.extra["kvstore_token"]) as c:
        keys = ev.keys[rank]
        return c.get(ev.specs[rank], keys[first : first + n], parent=keys[first - 1] if first else None).shape[0]


def recompute(caches: dict[str, torch.Tensor], blocks: list[int], seed: int) -> None:
    """What vLLM's rerun writes into ``blocks`` (other values than the step over the failed load)."""
    fresh = kv_caches(seed=seed)
    for name, cache in caches.items():
        cache[blocks] = fresh[name][blocks]


def test_a_failed_load_leaves_no_block_of_stale_memory_stored(kvv: Any, engine: Any, sidecar: Any) -> None:
    """Blocks 1 and 2 went before the load: the save of blocks 3+ (chained on the gone block 2)
    sent the chain again from its root, storing engine blocks 11 and 12, never loaded, as the
    prompt's blocks 1 and 2; a later request loaded that memory as a clean hit."""
    ev = evicted(kvv, engine, sidecar, slice(1, 3))
    _, errors = ev.eng.step(sched_output([("b", [10, 11, 12, 13, 14, 15], ev.ext)], {"b": len(ev.q) - ev.ext}))
    assert errors == [{11, 12}]
    counts = ev.eng.workers[0].counts
    assert (counts.stored_blocks, counts.resent_blocks, counts.failed_blocks) == (3, 0, 2)  # 3: request a's
    assert stored(sidecar, ev, 0, 1, 4) == 0
    assert ev.eng.offered(Request("c", ev.q[: 3 * BS] + [7])) == BS  # block 0 only: a miss, not garbage


def test_blocks_computed_over_a_failed_load_are_not_saved_under_a_parent_still_stored(
        kvv: Any, engine: Any, sidecar: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The load itself failed (a timeout, the breaker open), the 3 blocks still stored: blocks 3
    and 4, computed over the engine's stale blocks 10..12, were saved chained on block 2."""
    ev = evicted(kvv, engine, sidecar, slice(0, 0))
    client = ev.eng.workers[0]._client()

    def timed_out(*args: Any, **kwargs: Any) -> Any:
        raise Unavailable("deadline exceeded")

    monkeypatch.setattr(client, "get", timed_out)
    _, errors = ev.eng.step(sched_output([("b", [10, 11, 12, 13, 14, 15], ev.ext)], {"b": len(ev.q) - ev.ext}))
    assert errors == [{10, 11, 12}]
    assert stored(sidecar, ev, 0, 0, 3) == 3 and stored(sidecar, ev, 0, 3, 2) == 0
    assert ev.eng.workers[0].counts.failed_blocks == 2


def test_after_vllm_recomputes_from_the_failed_block_the_save_resumes_there(kvv: Any, engine: Any,
                                                                            sidecar: Any) -> None:
    """vLLM reruns the request from the first failed block (num_computed_tokens cut back to
    it): the saves start again there, with the recomputed KV, so the prompt is stored whole."""
    ev = evicted(kvv, engine, sidecar, slice(1, 3))
    ids = [10, 11, 12, 13, 14, 15]
    ev.eng.step(sched_output([("b", ids, ev.ext)], {"b": len(ev.q) - ev.ext}))
    caches = ev.eng.caches[0]
    recompute(caches, [11, 12, 13, 14, 15], seed=7)
    _, errors = ev.eng.step(cached_output("b", BS, len(ev.q) - BS))
    assert errors == [set()]
    assert stored(sidecar, ev, 0, 0, 5) == 5
    ev.eng.register([kv_caches()])
    ext, errors, _ = ev.eng.run(Request("c", ev.q), [20, 21, 22, 23, 24, 25])
    assert ext == 5 * BS and errors == [set()]
    assert same_blocks(caches, ids[:5], ev.eng.caches[0], [20, 21, 22, 23, 24])


def test_a_save_planned_before_vllm_rolled_back_is_dropped_then_resumed(kvv: Any, engine: Any,
                                                                        sidecar: Any) -> None:
    """Chunked prefill, the next chunk scheduled before the failed load's rollback was seen (as
    async scheduling does): its save chains on blocks computed over the failed load and is
    dropped, never sent again from the root with the stale blocks; the rollback resumes it."""
    ev = evicted(kvv, engine, sidecar, slice(1, 3))
    ids = [10, 11, 12, 13, 14, 15]
    ev.eng.step(sched_output([("b", ids, ev.ext)], {"b": BS}))  # computes block 3
    ev.eng.step(cached_output("b", 4 * BS, BS))  # computes block 4: no rollback seen yet
    counts = ev.eng.workers[0].counts
    assert (counts.stored_blocks, counts.resent_blocks, counts.failed_blocks) == (3, 0, 2)
    assert stored(sidecar, ev, 0, 1, 4) == 0
    caches = ev.eng.caches[0]
    recompute(caches, [11, 12, 13, 14, 15], seed=8)
    ev.eng.step(cached_output("b", BS, len(ev.q) - BS))  # vLLM's rerun from block 1
    assert stored(sidecar, ev, 0, 0, 5) == 5
    ev.eng.register([kv_caches()])
    ext, _, _ = ev.eng.run(Request("c", ev.q), [20, 21, 22, 23, 24, 25])
    assert ext == 5 * BS and same_blocks(caches, ids[:5], ev.eng.caches[0], [20, 21, 22, 23, 24])


def test_tp2_blocks_a_healthy_rank_computed_over_another_ranks_failed_load_are_replaced(
        kvv: Any, engine: Any, sidecar: Any) -> None:
    """Rank 1's blocks 1 and 2 went: rank 0 loaded its own and stored blocks 3 and 4 computed in
    that step (over rank 1's stale KV, through the reduced hidden state); a put keeps what a key
    holds, so the recomputed blocks never replaced them. They are deleted before the resave."""
    ev = evicted(kvv, engine, sidecar, slice(1, 3), tp=2, rank=1)
    ids = [10, 11, 12, 13, 14, 15]
    _, errors = ev.eng.step(sched_output([("b", ids, ev.ext)], {"b": len(ev.q) - ev.ext}))
    assert errors == [set(), {11, 12}]
    recompute(ev.eng.caches[0], [13, 14, 15], seed=9)
    recompute(ev.eng.caches[1], [11, 12, 13, 14, 15], seed=10)
    ev.eng.step(cached_output("b", BS, len(ev.q) - BS))
    sources = ev.eng.caches
    ev.eng.register([kv_caches(), kv_caches()])
    ext, errors, _ = ev.eng.run(Request("c", ev.q), [20, 21, 22, 23, 24, 25])
    assert ext == 5 * BS and errors == [set(), set()]
    for src, dst in zip(sources, ev.eng.caches, strict=True):
        assert same_blocks(src, ids[:5], dst, [20, 21, 22, 23, 24])


def test_tp2_a_request_failed_for_its_load_leaves_no_block_computed_over_it(kvv: Any, engine: Any,
                                                                              sidecar: Any) -> None:
    """kv_load_failure_policy="fail": vLLM ends the request (FINISHED_ERROR) with no rollback;
    rank 0's blocks of that step are deleted when it finishes."""
    ev = evicted(kvv, engine, sidecar, slice(1, 3), tp=2, rank=1)
    ev.eng.step(sched_output([("b", [10, 11, 12, 13, 14, 15], ev.ext)], {"b": len(ev.q) - ev.ext}))
    assert stored(sidecar, ev, 0, 3, 2) == 2  # stored by rank 0 in that step
    req = Request("b", ev.q)
    req.status = types.SimpleNamespace(name="FINISHED_ERROR")  # type: ignore[attr-defined]
    ev.eng.sched.request_finished(req, [10, 11, 12, 13, 14, 15])
    assert stored(sidecar, ev, 0, 3, 2) == 0
    assert stored(sidecar, ev, 0, 0, 3) == 3  # the blocks it loaded are kept


def test_a_request_whose_lookup_failed_is_saved_once_the_sidecar_answers(engine: Any,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed lookup (sidecar restarting, a timeout, the breaker open) left no record of the
    request, so none of its blocks was ever saved. Its keys are looked up again as it runs."""
    eng = engine()
    eng.register([kv_caches(seed=3)])
    p = prompt(4)
    req = Request("a", p)

    def down(*args: Any, **kwargs: Any) -> Any:
        raise Unavailable("sidecar restarting")

    monkeypatch.setattr(eng.sched, "_lookup", down)
    ext, _ = eng.sched.get_num_new_matched_tokens(req, 0)
    assert ext == 0
    eng.sched.update_state_after_alloc(req, None, 0)
    eng.step(sched_output([("a", [1, 2, 3, 4, 5], 0)], {"a": 2 * BS}))  # still down: nothing saved
    assert eng.workers[0].counts.stored_blocks == 0
    monkeypatch.undo()
    eng.step(cached_output("a", 2 * BS, len(p) - 2 * BS))  # back: the whole prompt from its root
    report = eng.sched.request_finished(req, [1, 2, 3, 4, 5])[1]
    assert report == {"kvstore": {"loaded_tokens": 0, "sent_blocks": 4}}
    assert eng.workers[0].counts.stored_blocks == 4
    src = eng.caches[0]
    eng.register([kv_caches()])
    ext, errors, _ = eng.run(Request("b", p), [6, 7, 8, 9, 10])
    assert ext == 4 * BS and errors == [set()] and same_blocks(src, [1, 2, 3, 4], eng.caches[0], [6, 7, 8, 9, 10][:4])
