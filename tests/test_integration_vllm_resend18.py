"""vLLM connector: a chain sent again from its root moves one layer at a time through the device.

When a save's stored parent is gone (evicted or expired since the lookup), the worker puts the
whole chain from the prompt's first block: it gathered the chain's head, all layers at once, into
one device buffer ``[n, 2, L, H, T, D]`` (``n``: every block of the prompt before the save, so it
grows with the prompt) and copied it to the host, where a save's own blocks go one layer at a
time. Driven with the stand-ins of tests/test_integration_vllm.py against a live sidecar.

There is no GPU here: a device cache is a tensor on torch's ``meta`` device, and the connector's
copy to the host (``_to_host``) is wrapped to record each device buffer it copies from, counted
as held until it is freed. The CPU path (no device buffer) is checked bit-exact.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import pytest
import test_integration_vllm as base
import torch
from test_integration_vllm import BS, HEAD_DIM, KV_HEADS, Engine, Request, VllmConfig, kv_caches, prompt, sched_output

# the fixtures of tests/test_integration_vllm.py (the connector on its stand-ins, a sidecar, engines)
kvv, sidecar, engine = base.kvv, base.sidecar, base.engine

LAYERS = 4  # more than the base module's 2: all layers at once is then 4x one layer


@dataclass
class Held:
    """Device buffers the connector copied to the host, and how many bytes were held at once."""

    shapes: list[tuple[int, ...]] = field(default_factory=list)
    live: int = 0
    peak: int = 0
    fail: set[int] = field(default_factory=set)  # copies (0: the first) that raise, as a CUDA error does

    def free(self, nbytes: int) -> None:
        self.live -= nbytes


@pytest.fixture
def held(kvv: Any, monkeypatch: pytest.MonkeyPatch) -> Held:
    rec = Held()
    monkeypatch.setattr(base, "LAYERS", LAYERS)  # the stand-in model's layers (ModelConfig reads it)

    def to_host(src: torch.Tensor, dst: torch.Tensor) -> None:
        assert src.device.type == "meta" and dst.device.type == "cpu" and dst.is_contiguous()
        rec.shapes.append(tuple(src.shape))
        if len(rec.shapes) - 1 in rec.fail:
            raise torch.OutOfMemoryError(f"CUDA error (stand-in: copy {len(rec.shapes) - 1} to the host)")
        nbytes = src.numel() * src.element_size()
        rec.live += nbytes
        rec.peak = max(rec.peak, rec.live)
        weakref.finalize(src, rec.free, nbytes)
        dst.fill_(1)  # a meta tensor holds no data: the device cache's KV is ones here

    monkeypatch.setattr(kvv, "_to_host", to_host)
    return rec


def layer_bytes(n: int) -> int:
    """One layer of ``n`` blocks (float16)."""
    return n * 2 * KV_HEADS * BS * HEAD_DIM * 2


def lose_the_stored_prefix(kvv: Any, sidecar: Any, eng: Engine, cached: int) -> tuple[list[int], list[int]]:
    """Store a prompt of ``cached`` blocks, then a longer prompt sharing them arrives and the
    sidecar loses the stored ones: the longer prompt's save must resend its chain from the root.
    Returns the longer prompt and the engine blocks it runs in (vLLM has the shared ones itself)."""
    short = prompt(cached)
    eng.run(Request("a", short), list(range(1, cached + 2)))
    long = short[: cached * BS] + prompt(2)
    req = Request("b", long)
    assert eng.sched.get_num_new_matched_tokens(req, 0) == (cached * BS, False)
    eng.sched.update_state_after_alloc(req, None, 0)
    with sidecar.client(eng.extra["kvstore_token"]) as client:
        spec = kvv.spec_for(VllmConfig(eng.extra), eng.extra)
        assert client.delete(client.block_keys(spec, short[: cached * BS])) == cached
    return long, list(range(1, cached + 1)) + [20, 21, 22]


def stored(kvv: Any, sidecar: Any, eng: Engine, tokens: list[int]) -> torch.Tensor:
    with sidecar.client(eng.extra["kvstore_token"]) as client:
        spec = kvv.spec_for(VllmConfig(eng.extra), eng.extra)
        return client.get(spec, client.block_keys(spec, tokens[: len(tokens) // BS * BS]))


def test_a_resent_chain_holds_one_layer_on_the_device_at_a_time(kvv: Any, engine: Any, sidecar: Any,
                                                                 held: Held) -> None:
    eng = engine()
    eng.register([{name: cache.to("meta") for name, cache in kv_caches().items()}])
    long, ids = lose_the_stored_prefix(kvv, sidecar, eng, cached=5)
    held.shapes.clear()
    eng.step(sched_output([("b", ids, 0)], {"b": len(long)}))
    counts = eng.workers[0].counts
    assert (counts.stored_blocks, counts.resent_blocks, counts.failed_blocks) == (5 + 2, 5, 0)
    # the save's 2 blocks, then the chain's 5, each one layer at a time
    assert held.shapes == [(2, 2, KV_HEADS, BS, HEAD_DIM)] * LAYERS + [(5, 2, KV_HEADS, BS, HEAD_DIM)] * LAYERS
    assert held.peak == layer_bytes(5)
    blocks = stored(kvv, sidecar, eng, long)
    assert blocks.shape[0] == 7 and bool((blocks == 1).all())


def test_a_resent_chain_from_cpu_caches_is_bit_exact(kvv: Any, engine: Any, sidecar: Any, held: Held) -> None:
    eng = engine()
    eng.register([kv_caches(seed=21)])
    long, ids = lose_the_stored_prefix(kvv, sidecar, eng, cached=3)
    eng.step(sched_output([("b", ids, 0)], {"b": len(long)}))
    assert eng.workers[0].counts.resent_blocks == 3
    blocks = stored(kvv, sidecar, eng, long)
    assert blocks.shape[0] == 5
    for layer, cache in enumerate(eng.caches[0].values()):
        for i, b in enumerate(ids[:5]):
            assert torch.equal(blocks[i, :, layer].view(torch.uint8),
                               cache[b].transpose(1, 2).contiguous().view(torch.uint8))  # [2, bs, H, D] -> [2, H, bs, D]
    assert held.shapes == []  # CPU caches: no device buffer, no copy


def test_a_resent_chain_whose_last_layer_fails_to_copy_is_dropped_whole(kvv: Any, engine: Any, sidecar: Any,
                                                                        held: Held) -> None:
    """The copy of the head's last layer fails after the others were copied: nothing of the save
    is put (its host buffer holds a layer no copy wrote), and the engine step goes on."""
    eng = engine()
    eng.register([{name: cache.to("meta") for name, cache in kv_caches().items()}])
    long, ids = lose_the_stored_prefix(kvv, sidecar, eng, cached=3)
    held.shapes.clear()
    held.fail = {2 * LAYERS - 1}  # the save's layers, then the head's: its last
    _, errors = eng.step(sched_output([("b", ids, 0)], {"b": len(long)}))
    assert errors == [set()]
    assert len(held.shapes) == 2 * LAYERS
    counts = eng.workers[0].counts
    assert (counts.stored_blocks, counts.resent_blocks, counts.failed_blocks) == (3, 0, 2)
    assert stored(kvv, sidecar, eng, long).shape[0] == 0
    assert held.live == 0
