"""vLLM connector: a device step that fails (CUDA out of memory for the pinned host buffer or the
per-layer device buffer, a failed copy or wait) fails that save or that load, never the engine's
forward pass. A failed save is dropped as a failed put is (counted, nothing stored, the request's
later saves send the chain again from its root); a failed load is reported to vLLM as a block
the sidecar no longer has (vLLM recomputes it, nothing computed over it is stored).

Driven with the stand-ins of tests/test_integration_vllm.py against a live sidecar. There is no
GPU here: a device cache is a tensor on torch's ``meta`` device, and the connector's device
steps (``_host_empty``, ``_to_host``, ``_host_ready``, ``_to_device``) are wrapped to raise
``torch.OutOfMemoryError`` (a RuntimeError, as CUDA's errors are) on the calls a test names.
"""

from __future__ import annotations

import types
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import test_integration_vllm as base
import torch
from test_integration_vllm import BS, LAYERS, Engine, Request, VllmConfig, kv_caches, prompt, sched_output

# the fixtures of tests/test_integration_vllm.py (the connector on its stand-ins, a sidecar, engines)
kvv, sidecar, engine = base.kvv, base.sidecar, base.engine

META = torch.device("meta")


@dataclass
class Device:
    """The connector's device steps on the meta device: ``fail[step]`` holds the calls of that
    step (0: its first) that raise. A meta tensor holds no data: a copy out of it fills the host
    side with ones (the KV a device cache holds here), so stored bytes that are not all ones
    were never copied from the device (uninitialised staging memory)."""

    fail: dict[str, set[int]] = field(default_factory=dict)
    calls: Counter[str] = field(default_factory=Counter)

    def step(self, name: str) -> None:
        n = self.calls[name]
        self.calls[name] += 1
        if n in self.fail.get(name, ()):
            raise torch.OutOfMemoryError(f"CUDA out of memory (stand-in: {name}, call {n})")


@pytest.fixture
def device(kvv: Any, monkeypatch: pytest.MonkeyPatch) -> Device:
    dev = Device()
    host_empty, host_ready, to_device = kvv._host_empty, kvv._host_ready, kvv._to_device

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def step(*args: Any) -> Any:
            dev.step(name)
            return fn(*args)
        return step

    def to_host(src: torch.Tensor, dst: torch.Tensor) -> None:
        dst.fill_(1)

    monkeypatch.setattr(kvv, "_host_empty", wrap("host_empty", host_empty))
    monkeypatch.setattr(kvv, "_to_host", wrap("to_host", to_host))
    monkeypatch.setattr(kvv, "_host_ready", wrap("host_ready", host_ready))
    monkeypatch.setattr(kvv, "_to_device", wrap("to_device", to_device))
    return dev


def on_meta(caches: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: cache.to(META) for name, cache in caches.items()}


def gpu_engine(engine: Any, token: str | None = None) -> Engine:
    eng = engine(token)
    eng.register([on_meta(kv_caches())])
    return eng


def cached_output(req_id: str, computed: int, tokens: int) -> Any:
    """A ``SchedulerOutput`` that runs ``tokens`` more of a running request from ``computed``."""
    out = sched_output([], {req_id: tokens})
    out.scheduled_cached_reqs = types.SimpleNamespace(req_ids=[req_id], resumed_req_ids=set(), new_block_ids=[None],
                                                      num_computed_tokens=[computed])
    return out


def stored(kvv: Any, sidecar: Any, eng: Engine, tokens: list[int]) -> torch.Tensor:
    """The stored blocks of ``tokens``' full blocks, from the first (stops at the first miss)."""
    with sidecar.client(eng.extra["kvstore_token"]) as client:
        spec = kvv.spec_for(VllmConfig(eng.extra), eng.extra)
        return client.get(spec, client.block_keys(spec, tokens[: len(tokens) // BS * BS]))


def counts(eng: Engine) -> tuple[int, int, int]:
    c = eng.workers[0].counts
    return c.stored_blocks, c.resent_blocks, c.failed_blocks


def test_a_pinned_buffer_out_of_memory_drops_the_save_not_the_step(kvv: Any, engine: Any, sidecar: Any,
                                                                   device: Device) -> None:
    """cudaHostAlloc of the save's staging buffer failed: the OutOfMemoryError left wait_for_save
    (the first save_kv_layer, in fact) and took the engine down."""
    eng = gpu_engine(engine)
    device.fail["host_empty"] = {0}
    p = prompt(3)
    ext, errors, report = eng.run(Request("a", p), [1, 2, 3, 4])
    assert ext == 0 and errors == [set()]
    assert report == {"kvstore": {"loaded_tokens": 0, "sent_blocks": 3}}  # sent, not claimed stored
    assert counts(eng) == (0, 0, 3)
    assert stored(kvv, sidecar, eng, p).shape[0] == 0
    # the engine goes on: the next request of that prompt is saved
    eng.run(Request("b", p), [5, 6, 7, 8])
    assert counts(eng) == (3, 0, 3)
    assert bool((stored(kvv, sidecar, eng, p) == 1).all())


def test_a_failed_copy_of_one_layer_drops_that_save_which_resumes_from_its_root(kvv: Any, engine: Any,
                                                                                 sidecar: Any, device: Device) -> None:
    """Two saves in one step; the copy of b's first layer to the host fails: a's blocks are
    stored, none of b's (its host buffer holds no KV), and b's next chunk, chained on a block
    that is not stored, sends b's chain again from its root."""
    eng = gpu_engine(engine)
    pa, pb = prompt(2), prompt(4)
    for req in (Request("a", pa), Request("b", pb)):
        assert eng.sched.get_num_new_matched_tokens(req, 0) == (0, False)
        eng.sched.update_state_after_alloc(req, None, 0)
    device.fail["to_host"] = {1}  # layer 0: a (call 0), b (call 1)
    _, errors = eng.step(sched_output([("a", [1, 2, 3], 0), ("b", [4, 5, 6, 7, 8], 0)],
                                      {"a": len(pa), "b": 2 * BS}))
    assert errors == [set()]
    assert counts(eng) == (2, 0, 2)
    assert stored(kvv, sidecar, eng, pa).shape[0] == 2 and stored(kvv, sidecar, eng, pb).shape[0] == 0
    _, errors = eng.step(cached_output("b", 2 * BS, len(pb) - 2 * BS))
    assert errors == [set()]
    assert counts(eng) == (2 + 2, 2, 2)  # b's blocks 2 and 3, and 0 and 1 sent again
    blocks = stored(kvv, sidecar, eng, pb)
    assert blocks.shape[0] == 4 and bool((blocks == 1).all())  # what the device held, no stale memory


def test_a_failed_wait_for_the_copies_drops_the_steps_saves(kvv: Any, engine: Any, sidecar: Any,
                                                            device: Device) -> None:
    """The stream synchronisation before the client reads the host buffers raised (a failed
    asynchronous copy): no byte of them is put."""
    eng = gpu_engine(engine)
    device.fail["host_ready"] = {0}
    p = prompt(3)
    _, errors, _ = eng.run(Request("a", p), [1, 2, 3, 4])
    assert errors == [set()]
    assert counts(eng) == (0, 0, 3)
    assert stored(kvv, sidecar, eng, p).shape[0] == 0


def test_a_failed_copy_of_a_chain_sent_again_drops_that_save(kvv: Any, engine: Any, sidecar: Any,
                                                             device: Device) -> None:
    """The stored parent went away, so the chain's head is gathered again: its copy to the host
    failed inside _put, where only the sidecar's errors were caught."""
    eng = gpu_engine(engine)
    short = prompt(2)
    eng.run(Request("a", short), [1, 2, 3])
    long = short[: 2 * BS] + prompt(2)
    req = Request("b", long)
    assert eng.sched.get_num_new_matched_tokens(req, 0) == (2 * BS, False)
    eng.sched.update_state_after_alloc(req, None, 0)
    with sidecar.client(eng.extra["kvstore_token"]) as client:
        spec = kvv.spec_for(VllmConfig(eng.extra), eng.extra)
        assert client.delete(client.block_keys(spec, short[: 2 * BS])) == 2
    device.fail["to_host"] = {2 * LAYERS}  # a's layers, b's layers, then the head of b's chain
    _, errors = eng.step(sched_output([("b", [4, 5, 6, 7, 8], 0)], {"b": len(long)}))
    assert errors == [set()]
    assert counts(eng) == (2, 0, 2)
    assert stored(kvv, sidecar, eng, long).shape[0] == 0


def test_a_failed_copy_to_the_device_is_a_failed_load_that_vllm_recomputes(kvv: Any, engine: Any, sidecar: Any,
                                                                            device: Device) -> None:
    """The host -> device copy of loaded blocks raised in start_load_kv. It is a failed load:
    reported to vLLM (which recomputes those blocks), the blocks computed over it not saved,
    and the saves resume from the rerun."""
    cpu = engine()
    cpu.register([kv_caches(seed=4)])
    p = prompt(3)
    cpu.run(Request("a", p), [1, 2, 3, 4])
    eng = gpu_engine(engine, cpu.extra["kvstore_token"])
    q = p[: 3 * BS] + prompt(2)
    req = Request("b", q)
    ext, _ = eng.sched.get_num_new_matched_tokens(req, 0)
    assert ext == 3 * BS
    eng.sched.update_state_after_alloc(req, None, ext)
    device.fail["to_device"] = {0}
    ids = [10, 11, 12, 13, 14, 15]
    _, errors = eng.step(sched_output([("b", ids, ext)], {"b": len(q) - ext}))
    assert errors == [{10, 11, 12}]
    assert eng.workers[0].counts.failed_loads == 3
    assert counts(eng) == (0, 0, 2)  # blocks 3 and 4, computed over blocks that never arrived
    assert stored(kvv, sidecar, eng, q).shape[0] == 3
    # vLLM reruns the request from the first failed block: the saves resume there
    _, errors = eng.step(cached_output("b", 0, len(q)))
    assert errors == [set()]
    blocks = stored(kvv, sidecar, eng, q)
    assert blocks.shape[0] == 5 and bool((blocks[3:] == 1).all())
    assert torch.equal(blocks[:3], stored(kvv, sidecar, cpu, p))  # the first engine's, kept
