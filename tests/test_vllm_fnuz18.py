"""vLLM's ``fp8``/``fp8_e4m3`` KV cache is keyed as what vLLM's kernels read it as on the
platform: AMD's ``float8_e4m3fnuz`` on MI300/MI325 (``current_platform.fp8_dtype()``), OCP
``float8_e4m3fn`` elsewhere; it was e4m3fn everywhere, so an MI300's blocks shared keys with an
H100's whose same bytes are other numbers."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import test_integration_vllm as base
import torch
from test_integration_vllm import BS, HEAD_DIM, KV_HEADS, LAYERS, NUM_BLOCKS, Request, VllmConfig, prompt, same_blocks

from kvstore.errors import InvalidArgument

kvv, sidecar, engine = base.kvv, base.sidecar, base.engine


@pytest.fixture
def platform(kvv: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The stand-in ``vllm.platforms.current_platform`` (it has no ``fp8_dtype`` by default)."""
    plat = sys.modules["vllm.platforms"].current_platform
    monkeypatch.delattr(plat, "fp8_dtype", raising=False)
    return plat


@pytest.mark.parametrize(("preferred", "cache_dtype", "want"), [
    (None, "fp8", "float8_e4m3fn"), (torch.float8_e4m3fn, "fp8", "float8_e4m3fn"),
    (torch.float8_e4m3fnuz, "fp8", "float8_e4m3fnuz"), (torch.float8_e4m3fnuz, "fp8_e4m3", "float8_e4m3fnuz"),
    (torch.float8_e4m3fnuz, "fp8_e5m2", "float8_e5m2"),  # vLLM reads e5m2 as OCP on every platform
])
def test_spec_dtype_follows_the_platform(kvv: Any, platform: Any, monkeypatch: pytest.MonkeyPatch,
                                         preferred: torch.dtype | None, cache_dtype: str, want: str) -> None:
    if preferred is not None:
        monkeypatch.setattr(platform, "fp8_dtype", lambda: preferred, raising=False)
    spec = kvv.spec_for(VllmConfig({}, cache_dtype=cache_dtype), {})
    assert spec.dtype == want


def test_an_unknown_platform_fp8_is_refused(kvv: Any, platform: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platform, "fp8_dtype", lambda: torch.float8_e5m2fnuz, raising=False)
    with pytest.raises(InvalidArgument, match="fp8 KV dtype"):
        kvv.spec_for(VllmConfig({}, cache_dtype="fp8"), {})


def test_fnuz_and_ocp_engines_do_not_share_blocks(engine: Any, platform: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(18)
    shape = (NUM_BLOCKS, 2, BS, KV_HEADS, HEAD_DIM)
    src = {f"model.layers.{i}.self_attn.attn": torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
           for i in range(LAYERS)}
    p = prompt(2)
    monkeypatch.setattr(platform, "fp8_dtype", lambda: torch.float8_e4m3fnuz, raising=False)
    mi300 = engine(cache_dtype="fp8")
    mi300.register([src])
    _, errors, _ = mi300.run(Request("a", p), [1, 2, 3])
    assert errors == [set()] and mi300.workers[0].counts.stored_blocks == 2
    # the same tenant on an OCP platform: the fnuz blocks are not its blocks
    monkeypatch.setattr(platform, "fp8_dtype", lambda: torch.float8_e4m3fn, raising=False)
    h100 = engine(token=mi300.extra["kvstore_token"], cache_dtype="fp8")
    h100.register([{n: torch.zeros_like(c) for n, c in src.items()}])
    assert h100.sched.get_num_new_matched_tokens(Request("b", p), 0)[0] == 0
    # and back on the fnuz platform they load bit-exact
    monkeypatch.setattr(platform, "fp8_dtype", lambda: torch.float8_e4m3fnuz, raising=False)
    again = engine(token=mi300.extra["kvstore_token"], cache_dtype="fp8")
    again.register([{n: torch.zeros_like(c) for n, c in src.items()}])
    ext, errors, _ = again.run(Request("c", p), [4, 5, 6])
    assert ext == 2 * BS and errors == [set()]
    assert same_blocks(src, [1, 2], again.caches[0], [4, 5])
