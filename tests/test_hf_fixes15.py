"""HF ``PrefixCache.generate`` calls the store cannot serve exactly run as plain ``model.generate``:
a padded ``attention_mask`` (blocks are keyed by token ids alone: KV computed under another mask
was restored and the output changed), and beam search or several return sequences (the save
raised after the generation had finished, and the output was lost)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed: pip install 'kvstore[hf]'")

from test_integration_hf import BLOCK, _adapter, _build, _prompt

from kvstore.config import StoreConfig
from kvstore.integrations.hf import PrefixCache, Saved, TenantStore
from kvstore.store import Store

GEN = {"max_new_tokens": 6, "pad_token_id": 0}


@pytest.fixture(scope="module")
def model() -> Any:
    return _build("llama")


@pytest.fixture
def pc(model: Any, tmp_path: Path) -> Iterator[PrefixCache]:
    store = Store.open(StoreConfig(path=tmp_path / "store", hbm_bytes=8 << 20, dram_bytes=8 << 20,
                                   nvme_bytes=64 << 20, master_key=bytes(range(32)), durable=False))
    yield _adapter(model, TenantStore(store, "tenant-a"))
    store.close()


def _plain(model: Any, ids: torch.Tensor, **kw: Any) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, **GEN, **kw)


def _stored_blocks(pc: PrefixCache, ids: torch.Tensor) -> int:
    keys = pc.target.block_keys(pc.spec, ids[0].tolist()[: (ids.shape[1] // BLOCK) * BLOCK])
    return pc.target.lookup(pc.spec, keys).num_blocks


@pytest.mark.parametrize("kind", ["holes", "left-padding"])
def test_a_padded_mask_neither_restores_nor_saves(model: Any, pc: PrefixCache, kind: str) -> None:
    ids = _prompt(5 * BLOCK, seed=21)
    full = torch.ones_like(ids)
    mask = full.clone()
    if kind == "holes":
        mask[0, 10:14] = 0
    else:
        mask[0, :6] = 0
    first = pc.generate(model, ids, attention_mask=full, do_sample=False, **GEN)  # KV of the full mask
    assert first.saved.num_blocks > 0

    out = pc.generate(model, ids, attention_mask=mask, do_sample=False, **GEN)
    assert torch.equal(out.sequences, _plain(model, ids, attention_mask=mask, do_sample=False))
    assert out.reused_tokens == 0 and out.saved == Saved(0, 0) and "attention_mask" in out.bypassed

    other = _prompt(4 * BLOCK + 3, seed=22)  # a masked call stores nothing either
    other_mask = torch.ones_like(other)
    other_mask[0, :2] = 0
    pc.generate(model, other, attention_mask=other_mask, do_sample=False, **GEN)
    assert _stored_blocks(pc, other) == 0


def test_an_all_ones_mask_still_reuses(model: Any, pc: PrefixCache) -> None:
    ids = _prompt(5 * BLOCK, seed=23)
    pc.generate(model, ids, do_sample=False, **GEN)
    out = pc.generate(model, ids, attention_mask=torch.ones_like(ids), do_sample=False, **GEN)
    assert torch.equal(out.sequences, _plain(model, ids, attention_mask=torch.ones_like(ids), do_sample=False))
    assert out.reused_tokens > 0 and not out.bypassed


@pytest.mark.parametrize("kw", [{"num_beams": 2, "do_sample": False},
                                {"num_return_sequences": 2, "do_sample": True}], ids=["beams", "samples"])
def test_beams_and_several_sequences_return_the_generation(model: Any, pc: PrefixCache,
                                                           kw: dict[str, Any]) -> None:
    ids = _prompt(5 * BLOCK, seed=24)
    pc.generate(model, ids, do_sample=False, **GEN)  # the prompt's blocks are stored
    torch.manual_seed(5)
    out = pc.generate(model, ids, **kw, **GEN)
    torch.manual_seed(5)
    want = _plain(model, ids, **kw)
    assert out.reused_tokens == 0 and out.saved == Saved(0, 0) and out.bypassed
    assert torch.equal(out.sequences, want)


def test_beams_from_the_generation_config_are_seen_and_logged_once(
        model: Any, pc: PrefixCache, caplog: pytest.LogCaptureFixture) -> None:
    from transformers import GenerationConfig

    ids = _prompt(3 * BLOCK + 1, seed=25)
    config = GenerationConfig(num_beams=2, do_sample=False, **GEN)
    with caplog.at_level("INFO", logger="kvstore.integrations.hf"):
        for _ in range(2):
            out = pc.generate(model, ids, generation_config=config)
            assert "num_beams=2" in out.bypassed and out.saved == Saved(0, 0)
    assert sum("not used by generate" in r.getMessage() for r in caplog.records) == 1
    assert torch.equal(out.sequences, _plain(model, ids, num_beams=2, do_sample=False))
