"""kvstore.integrations.hf against real transformers models (random-init, built from configs).

Each check runs for Llama, Qwen2 and Qwen3, through the in-process Store and through the gRPC
client of a sidecar on port 0. The last test loads the real SmolLM2-135M (GGUF fixture); it skips
only when the package registry is unreachable. Skips everything when transformers is missing.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed: pip install 'kvstore[hf]'")

import service_harness
from transformers import (
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from kvstore.config import StoreConfig
from kvstore.errors import DTypeMismatch, InvalidArgument
from kvstore.integrations.hf import (
    PrefixCache,
    TenantStore,
    blocks_from_cache,
    forward,
    layer_kv,
    output_cache,
    spec_from_config,
)
from kvstore.store import Store

BLOCK = 8
VOCAB = 256
TINY = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512}
MODELS = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 16}),
}


def _build(name: str) -> Any:
    config_cls, model_cls, extra = MODELS[name]
    torch.manual_seed(1234)
    return model_cls(config_cls(**TINY, **extra)).eval()


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request: pytest.FixtureRequest) -> Any:
    return _build(request.param)


@pytest.fixture(params=["store", "grpc"])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    if request.param == "store":
        store = Store.open(StoreConfig(path=tmp_path / "store", hbm_bytes=8 << 20, dram_bytes=8 << 20,
                                       nvme_bytes=64 << 20, master_key=bytes(range(32)), durable=False))
        yield TenantStore(store, "tenant-a")
        store.close()
    else:
        sidecar = service_harness.start(tmp_path / "sidecar")
        yield sidecar.tenant("tenant-a")
        sidecar.stop()


def _prompt(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (1, n), generator=g)


def _live_cache(model: Any, ids: torch.Tensor) -> Any:
    return output_cache(forward(model, ids, DynamicCache()))


def _adapter(model: Any, target: Any) -> PrefixCache:
    spec = spec_from_config(model.config, model.dtype, BLOCK, model=model.config.model_type)
    return PrefixCache(target, spec)


def test_restored_kv_is_bit_identical_to_what_was_stored(model: Any, target: Any) -> None:
    prompt = _prompt(5 * BLOCK + 3, seed=1)
    live = _live_cache(model, prompt)
    pc = _adapter(model, target)

    assert pc.save(prompt, live).num_blocks == 5
    stored = target.get(pc.spec, target.block_keys(pc.spec, prompt[0, : 5 * BLOCK].tolist()))
    assert torch.equal(stored, blocks_from_cache(live, pc.spec, 0, 5))

    restored = pc.restore(torch.cat([prompt, _prompt(4, seed=2)], dim=1))
    assert restored.num_tokens == 5 * BLOCK and len(restored.tiers) == 5
    assert restored.cache.get_seq_length() == 5 * BLOCK
    for layer in range(pc.spec.num_layers):
        for got, want in zip(layer_kv(restored.cache, layer), layer_kv(live, layer)):
            assert got.dtype == want.dtype
            assert torch.equal(got, want[:, :, : 5 * BLOCK])


def test_logits_after_restore_equal_a_live_cache_of_the_same_prefix(model: Any, target: Any) -> None:
    prompt = _prompt(4 * BLOCK + 5, seed=3)
    pc = _adapter(model, target)
    pc.save(prompt, _live_cache(model, prompt))

    restored = pc.restore(prompt)
    n = restored.num_tokens
    assert n == 4 * BLOCK
    live = _live_cache(model, prompt[:, :n])
    want = forward(model, prompt[:, n:], live).logits
    got = forward(model, prompt[:, n:], restored.cache).logits
    assert torch.equal(got, want)


def test_greedy_tokens_equal_a_full_recompute(model: Any, target: Any) -> None:
    system = _prompt(3 * BLOCK + 2, seed=4)
    turn1 = torch.cat([system, _prompt(5, seed=5)], dim=1)
    pc = _adapter(model, target)
    first = pc.generate(model, turn1, max_new_tokens=6, do_sample=False)
    assert first.reused_tokens == 0 and first.saved.new_blocks == first.saved.num_blocks > 0

    turn2 = torch.cat([first.sequences, _prompt(7, seed=6)], dim=1)
    second = pc.generate(model, turn2, max_new_tokens=8, do_sample=False)
    reference = model.generate(turn2, max_new_tokens=8, do_sample=False)
    assert second.reused_tokens == first.saved.num_blocks * BLOCK
    assert torch.equal(second.sequences, reference)


def test_at_least_one_prompt_token_is_left_uncached(model: Any, target: Any) -> None:
    prompt = _prompt(3 * BLOCK, seed=7)  # exactly three full blocks, all stored
    pc = _adapter(model, target)
    assert pc.save(prompt, _live_cache(model, prompt)).num_blocks == 3
    assert pc.restore(prompt).num_tokens == 2 * BLOCK
    assert pc.restore(prompt[:, : BLOCK + 1]).num_tokens == BLOCK
    short = pc.restore(prompt[:, :BLOCK])  # one block: restoring it would leave nothing to compute
    assert short.cache is None and short.num_tokens == 0


def test_save_sends_only_blocks_not_stored_yet(model: Any, target: Any) -> None:
    prompt = _prompt(6 * BLOCK + 1, seed=8)
    live = _live_cache(model, prompt)
    pc = _adapter(model, target)
    assert (pc.save(prompt[:, : 2 * BLOCK], live).new_blocks, pc.save(prompt, live).new_blocks) == (2, 4)
    again = pc.save(prompt, live)
    assert (again.num_blocks, again.new_blocks) == (6, 0)


def test_same_tokens_at_another_position_are_a_miss(model: Any, target: Any) -> None:
    # keys are stored after RoPE: a block is only valid after exactly its prefix
    prompt = _prompt(3 * BLOCK + 1, seed=9)
    pc = _adapter(model, target)
    pc.save(prompt, _live_cache(model, prompt))
    shifted = torch.cat([_prompt(BLOCK, seed=10), prompt], dim=1)
    assert pc.restore(shifted).cache is None
    changed = prompt.clone()
    changed[0, 0] = (changed[0, 0] + 1) % VOCAB
    assert pc.restore(changed).num_tokens == 0


def test_spec_from_config_describes_the_cache(model: Any) -> None:
    spec = spec_from_config(model.config, torch.float32, BLOCK, model="tiny", revision="r1")
    cache = _live_cache(model, _prompt(BLOCK, seed=11))
    k, _ = layer_kv(cache, 0)
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (len(cache), k.shape[1], k.shape[3])
    assert (spec.dtype, spec.block_tokens, spec.hidden_size) == ("float32", BLOCK, 64)
    assert "10000" in spec.rope_scaling
    other = spec_from_config(model.config, "float32", BLOCK, model="tiny", revision="r2")
    assert other.fingerprint != spec.fingerprint


def test_a_config_built_model_needs_an_explicit_id() -> None:
    # two models of one architecture with other weights got one fingerprint ("llama")
    with pytest.raises(InvalidArgument, match="pass model="):
        spec_from_config(LlamaConfig(**TINY), torch.float32, BLOCK)
    a = spec_from_config(LlamaConfig(**TINY), torch.float32, BLOCK, model="mine-a")
    b = spec_from_config(LlamaConfig(**TINY), torch.float32, BLOCK, model="mine-b")
    assert a.fingerprint != b.fingerprint
    cfg = LlamaConfig(**TINY)
    cfg.name_or_path = "org/model"
    assert spec_from_config(cfg, torch.float32, BLOCK).model == "org/model"


def test_unsupported_caches_are_refused() -> None:
    sliding = Qwen2Config(**TINY, use_sliding_window=True, sliding_window=16, max_window_layers=0)
    with pytest.raises(InvalidArgument, match="full-attention"):
        spec_from_config(sliding, torch.float32, BLOCK)
    # Mistral (and Phi-3) say sliding-window attention with sliding_window alone: it was taken
    # for full attention, and saving the cache generate() builds failed with a ShapeMismatch
    from transformers import MistralConfig

    with pytest.raises(InvalidArgument, match="full-attention"):
        spec_from_config(MistralConfig(**TINY, sliding_window=16), torch.float32, BLOCK)
    spec_from_config(MistralConfig(**TINY, sliding_window=None), torch.float32, BLOCK, model="t")  # full
    spec_from_config(Qwen2Config(**TINY, sliding_window=16, use_sliding_window=False), torch.float32, BLOCK,
                     model="t")
    with pytest.raises(InvalidArgument, match="dtype"):
        spec_from_config(LlamaConfig(**TINY), torch.int8, BLOCK)
    model = _build("llama")
    cache = _live_cache(model, _prompt(2 * BLOCK, seed=12))
    with pytest.raises(DTypeMismatch):
        blocks_from_cache(cache, spec_from_config(model.config, torch.float16, BLOCK, model="t"), 0, 2)


# -- the real model -----------------------------------------------------------------------------
def test_smollm2_two_turn_chat_reuses_turn_one_and_decodes_the_same(tmp_path: Path) -> None:
    pytest.importorskip("gguf", reason="gguf is not installed: pip install 'kvstore[hf]'")
    pytest.importorskip("accelerate", reason="accelerate is not installed: pip install 'kvstore[hf]'")
    from kvstore.integrations.smollm2 import ModelUnavailable, chat_ids, ensure_smollm2, load_smollm2

    try:
        files = ensure_smollm2()
    except ModelUnavailable as exc:
        pytest.skip(str(exc))
    model, tokenizer = load_smollm2(files)
    store = Store.open(StoreConfig(path=tmp_path / "store", hbm_bytes=64 << 20, dram_bytes=64 << 20,
                                   nvme_bytes=256 << 20, master_key=bytes(range(32)), durable=False))
    try:
        pc = PrefixCache(TenantStore(store, "chat"),
                         spec_from_config(model.config, model.dtype, 16, model="SmolLM2-135M-Instruct-Q4_1"))
        messages = [{"role": "system", "content": "You are a terse assistant."},
                    {"role": "user", "content": "Name three primary colours."}]
        turn1 = chat_ids(tokenizer, messages)
        first = pc.generate(model, turn1, max_new_tokens=12, do_sample=False)
        answer = tokenizer.decode(first.sequences[0, turn1.shape[1]:], skip_special_tokens=True)
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And two more?"}]
        turn2 = chat_ids(tokenizer, messages)

        restored = pc.restore(turn2)
        n = restored.num_tokens
        assert n >= (turn1.shape[1] // 16) * 16 > 0
        # the blocks came from turn 1's prefill and decode steps: compare with what was stored
        for layer in range(pc.spec.num_layers):
            for got, want in zip(layer_kv(restored.cache, layer), layer_kv(first.cache, layer)):
                assert torch.equal(got, want[:, :, :n])

        second = pc.generate(model, turn2, max_new_tokens=12, do_sample=False)
        reference = model.generate(turn2, max_new_tokens=12, do_sample=False)
        assert second.reused_tokens == restored.num_tokens
        assert torch.equal(second.sequences, reference)
    finally:
        store.close()


def test_generate_goes_on_when_the_store_fails(caplog: pytest.LogCaptureFixture) -> None:
    """A store that does not answer costs generate its reuse, not its output: the restore is a
    miss, the save is skipped, both logged; the tokens equal a plain model.generate."""
    from kvstore.errors import Unavailable

    class Down:
        def block_keys(self, spec: Any, token_ids: Any) -> list[bytes]:
            raise Unavailable("failed to connect to all addresses")

        lookup = put = get = block_keys

    model = _build("llama")
    pc = _adapter(model, Down())
    prompt = _prompt(3 * BLOCK + 2, seed=11)
    with caplog.at_level("WARNING", logger="kvstore.integrations.hf"):
        out = pc.generate(model, prompt, max_new_tokens=4, do_sample=False)
    assert out.reused_tokens == 0 and out.saved.num_blocks == 0
    assert torch.equal(out.sequences, model.generate(prompt, max_new_tokens=4, do_sample=False))
    assert "restore failed" in caplog.text and "save failed" in caplog.text
    with pytest.raises(Unavailable):  # called directly, the primitives still raise
        pc.restore(prompt)
