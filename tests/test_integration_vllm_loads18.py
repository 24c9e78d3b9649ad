"""vLLM connector: a load moves one layer of its blocks to the device at a time.

The loaded blocks ``[n, 2, L, H, T, D]`` went to the cache's device in one copy, all layers at
once, before the scatter: the device held ``L`` layers' worth of every load (on a GPU engine,
memory the KV cache sizing never counted), where one layer's is enough. Driven with the
stand-ins of tests/test_integration_vllm.py against a live sidecar.

The connector's copy to the device (``_to_device``) is wrapped so each call returns a new
tensor (as a copy to a GPU does) whose bytes count as staged until it is freed: the peak is the
most device staging memory a load held at once. There is no GPU here: the CPU path is the same
code with the copy a view, and a cache on torch's ``meta`` device stands in for a GPU's.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import pytest
import test_integration_vllm as base
import torch
from test_integration_vllm import BS, HEAD_DIM, KV_HEADS, Engine, Request, kv_caches, prompt, same_blocks, sched_output

# the fixtures of tests/test_integration_vllm.py (the connector on its stand-ins, a sidecar, engines)
kvv, sidecar, engine = base.kvv, base.sidecar, base.engine

LAYERS = 4  # more than the base module's 2: all layers at once is then 4x one layer


@dataclass
class Staged:
    """Bytes the connector's copies to the device hold at once."""

    calls: list[tuple[int, ...]] = field(default_factory=list)  # shape of each copy
    live: int = 0
    peak: int = 0
    fail: set[int] = field(default_factory=set)  # calls (0: the first) that raise, as a CUDA OOM does

    def free(self, nbytes: int) -> None:
        self.live -= nbytes


@pytest.fixture
def staged(kvv: Any, monkeypatch: pytest.MonkeyPatch) -> Staged:
    rec = Staged()
    monkeypatch.setattr(base, "LAYERS", LAYERS)  # the stand-in model's layers (ModelConfig reads it)

    def to_device(blocks: torch.Tensor, device: torch.device) -> torch.Tensor:
        call = len(rec.calls)
        rec.calls.append(tuple(blocks.shape))
        if call in rec.fail:
            raise torch.OutOfMemoryError(f"CUDA out of memory (stand-in: copy {call} to the device)")
        out = blocks.to(device, copy=True)  # a buffer of its own, as on a GPU
        nbytes = out.numel() * out.element_size()
        rec.live += nbytes
        rec.peak = max(rec.peak, rec.live)
        weakref.finalize(out, rec.free, nbytes)
        return out

    monkeypatch.setattr(kvv, "_to_device", to_device)
    return rec


def layer_bytes(n: int) -> int:
    """One layer of ``n`` loaded blocks (float16)."""
    return n * 2 * KV_HEADS * BS * HEAD_DIM * 2


def saved(engine: Any, seed: int, blocks: int) -> tuple[Engine, list[int], dict[str, torch.Tensor]]:
    """An engine that stored a prompt of ``blocks`` full blocks from engine blocks 1..blocks; its caches."""
    eng = engine()
    eng.register([kv_caches(seed=seed)])
    p = prompt(blocks)
    eng.run(Request("src", p), list(range(1, blocks + 2)))
    assert eng.workers[0].counts.stored_blocks == blocks
    return eng, p, eng.caches[0]


def test_a_load_copies_one_layer_at_a_time_to_the_device_bit_exact(engine: Any, staged: Staged) -> None:
    src_eng, p, src = saved(engine, seed=11, blocks=6)
    eng = engine(src_eng.extra["kvstore_token"])
    eng.register([kv_caches()])
    staged.calls.clear()
    ext, errors, report = eng.run(Request("b", p), [20, 21, 22, 23, 24, 25, 26])
    assert ext == 6 * BS and errors == [set()]
    assert report is not None and report["kvstore"]["loaded_tokens"] == 6 * BS
    assert same_blocks(src, [1, 2, 3, 4, 5, 6], eng.caches[0], [20, 21, 22, 23, 24, 25])
    # one copy per layer, each of that layer's 6 blocks; never more than one held at once
    assert staged.calls == [(6, 2, KV_HEADS, BS, HEAD_DIM)] * LAYERS
    assert staged.peak == layer_bytes(6)
    assert staged.live == 0


def test_two_loads_in_one_step_hold_one_layer_of_one_load_at_a_time(engine: Any, staged: Staged) -> None:
    src_eng = engine()
    src_eng.register([kv_caches(seed=12)])
    p, q = prompt(3), prompt(2)
    src_eng.run(Request("s1", p), [1, 2, 3, 4])
    src_eng.run(Request("s2", q), [5, 6, 7])
    src = src_eng.caches[0]
    eng = engine(src_eng.extra["kvstore_token"])
    eng.register([kv_caches()])
    staged.calls.clear()
    for req in (Request("a", p), Request("b", q)):
        ext, _ = eng.sched.get_num_new_matched_tokens(req, 0)
        eng.sched.update_state_after_alloc(req, None, ext)
    _, errors = eng.step(sched_output([("a", [10, 11, 12, 13], 3 * BS), ("b", [14, 15, 16], 2 * BS)],
                                      {"a": 1, "b": 1}))
    assert errors == [set()]
    assert same_blocks(src, [1, 2, 3, 5, 6], eng.caches[0], [10, 11, 12, 14, 15])
    assert staged.calls == [(3, 2, KV_HEADS, BS, HEAD_DIM)] * LAYERS + [(2, 2, KV_HEADS, BS, HEAD_DIM)] * LAYERS
    assert staged.peak == layer_bytes(3)
    assert staged.live == 0


def test_a_copy_failing_after_some_layers_fails_the_whole_load(kvv: Any, engine: Any, staged: Staged) -> None:
    """The last layer's copy fails (CUDA out of memory) after the earlier layers were scattered:
    every block of the load is reported to vLLM (it recomputes them), none stored over them."""
    src_eng, p, _ = saved(engine, seed=14, blocks=3)
    eng = engine(src_eng.extra["kvstore_token"])
    eng.register([{name: cache.to("meta") for name, cache in kv_caches().items()}])
    staged.calls.clear()
    staged.fail = {LAYERS - 1}
    q = p[: 3 * BS] + prompt(2)
    req = Request("b", q)
    ext, _ = eng.sched.get_num_new_matched_tokens(req, 0)
    assert ext == 3 * BS
    eng.sched.update_state_after_alloc(req, None, ext)
    ids = [10, 11, 12, 13, 14, 15]
    _, errors = eng.step(sched_output([("b", ids, ext)], {"b": len(q) - ext}))
    assert errors == [{10, 11, 12}]
    assert len(staged.calls) == LAYERS
    assert eng.workers[0].counts.failed_loads == 3
    assert eng.workers[0].counts.stored_blocks == 0  # blocks 3 and 4 were computed over the failed ones
    assert staged.live == 0


#: vLLM's cache shapes per layout, and the axis of the block index
LAYOUTS = {
    "blocks_first": ((base.NUM_BLOCKS, 2, BS, KV_HEADS, HEAD_DIM), 0),
    "kv_first": ((2, base.NUM_BLOCKS, BS, KV_HEADS, HEAD_DIM), 1),
    "cpu_split": ((base.NUM_BLOCKS, KV_HEADS, BS, 2 * HEAD_DIM), 0),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_each_cache_layout_loads_bit_exact_one_layer_at_a_time(engine: Any, staged: Staged, layout: str) -> None:
    shape, axis = LAYOUTS[layout]
    g = torch.Generator().manual_seed(16)
    src = {f"model.layers.{i}.self_attn.attn": torch.randn(shape, generator=g).to(torch.float16)
           for i in range(LAYERS)}
    src_eng = engine()
    src_eng.register([src])
    p = prompt(3)
    src_eng.run(Request("s", p), [1, 2, 3, 4])
    eng = engine(src_eng.extra["kvstore_token"])
    dst = {name: torch.zeros_like(cache) for name, cache in src.items()}
    eng.register([dst])
    staged.calls.clear()
    ext, errors, _ = eng.run(Request("b", p), [9, 8, 7, 6])
    assert ext == 3 * BS and errors == [set()]
    for name, cache in src.items():
        for i, j in zip([1, 2, 3], [9, 8, 7], strict=True):
            assert torch.equal(cache.select(axis, i).view(torch.uint8), dst[name].select(axis, j).view(torch.uint8))
    assert staged.calls == [(3, 2, KV_HEADS, BS, HEAD_DIM)] * LAYERS
    assert staged.peak == layer_bytes(3)
