"""vLLM connector: fp8 KV scales as part of the model identity, and what it refuses at startup
(speculative decoding with a draft model's KV, context parallelism, MLA, scales computed at run
time). Driven with the stand-ins of tests/test_integration_vllm.py against a live sidecar.

Each refusal is checked where vLLM meets it: when the connector is built (engine startup, every
role) or at ``register_kv_caches`` (before the first forward pass). What the stand-ins model of
vLLM 0.32 (read from its source, not run here): the attention layers in
``compilation_config.static_forward_context`` with ``_k_scale``/``_v_scale``; the handshake
(``get_handshake_metadata`` on each worker, given to the scheduler's
``set_xfer_handshake_metadata_pp_aware`` keyed ``(pp_rank, tp_rank)`` once the caches are
registered); ``SpeculativeConfig.uses_draft_kv_cache``; ``ModelConfig.use_mla``.
"""

from __future__ import annotations

import types
from typing import Any

import pytest
import test_integration_vllm as base
import torch
from test_integration_vllm import BS, HEAD_DIM, KV_HEADS, LAYERS, NUM_BLOCKS, Engine, Request, VllmConfig, prompt

from kvstore.errors import InvalidArgument, ShapeMismatch

kvv, sidecar = base.kvv, base.sidecar

NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def fp8_config(extra: dict[str, Any], scales: tuple[float, float] | None, tp: int = 1) -> VllmConfig:
    """An fp8 engine's config whose attention layers have k and v scales ``scales`` (None: no
    layers vLLM's way, so no scales to read)."""
    cfg = VllmConfig(dict(extra), tp, "fp8")
    cfg.compilation_config.static_forward_context = {} if scales is None else {
        n: types.SimpleNamespace(_k_scale=torch.tensor(scales[0]), _v_scale=torch.tensor(scales[1])) for n in NAMES}
    return cfg


def fp8_engine(kvv: Any, sidecar: Any, token: str, scales: tuple[float, float], *, handshake: bool = True,
               tp: int = 1) -> Engine:
    """A scheduler and ``tp`` workers of an fp8 checkpoint with KV scales ``scales``, started as
    vLLM starts them: caches registered, then every worker's handshake given to the scheduler."""
    eng = Engine(kvv, sidecar, token)
    eng.close()
    eng.sched = kvv.KVStoreConnector(fp8_config(eng.extra, scales, tp), base._Role.SCHEDULER)
    eng.workers = []
    for rank in range(tp):
        base._TP_RANK[0] = rank
        eng.workers.append(kvv.KVStoreConnector(fp8_config(eng.extra, scales, tp), base._Role.WORKER))
    base._TP_RANK[0] = 0
    eng.register([fp8_caches(seed=None) for _ in range(tp)])
    if handshake:
        eng.sched.set_xfer_handshake_metadata_pp_aware({(0, r): w.get_handshake_metadata()
                                                        for r, w in enumerate(eng.workers)})
    return eng


def fp8_caches(seed: int | None) -> dict[str, torch.Tensor]:
    """fp8 caches as vLLM allocates them (``uint8``); zeros without a seed."""
    g = torch.Generator().manual_seed(seed or 0)
    shape = (NUM_BLOCKS, 2, BS, KV_HEADS, HEAD_DIM)
    return {n: (torch.randint(0, 256, shape, generator=g, dtype=torch.uint8) if seed is not None
                else torch.zeros(shape, dtype=torch.uint8)) for n in NAMES}


def tenant(sidecar: Any) -> str:
    return sidecar.admin().create_tenant(f"vllm-more17-{next(base._TENANTS)}")


# == fp8 KV scales ===============================================================================
@pytest.mark.parametrize("handshake", [True, False], ids=["handshake", "no-handshake"])
def test_fp8_kv_written_under_other_scales_is_never_loaded(kvv: Any, sidecar: Any, handshake: bool) -> None:
    """Two checkpoints served under one name, with different fp8 KV scales: the second loaded the
    first one's bytes (offered as a hit, scattered into its cache) and decoded them under its own
    scales, wrong attention without an error. With or without vLLM's handshake, never now."""
    token, p = tenant(sidecar), prompt(3)
    a = fp8_engine(kvv, sidecar, token, (0.5, 0.25), handshake=handshake)
    b = fp8_engine(kvv, sidecar, token, (2.0, 1.0), handshake=handshake)
    try:
        a.register([fp8_caches(seed=1)])
        _, errors, _ = a.run(Request("a", p), [1, 2, 3, 4])
        assert errors == [set()] and a.workers[0].counts.stored_blocks == 3
        ext, errors, report = b.run(Request("b", p), [5, 6, 7, 8])
        assert ext == 0 and errors == [set()]
        assert report is not None and report["kvstore"]["loaded_tokens"] == 0
        assert torch.count_nonzero(torch.stack([c[5:8] for c in b.caches[0].values()])) == 0  # nothing scattered
    finally:
        a.close()
        b.close()


def test_fp8_engines_of_one_checkpoint_share_their_kv(kvv: Any, sidecar: Any) -> None:
    """The common case: every engine of a checkpoint has its scales, so the same tag, and hits."""
    token, p = tenant(sidecar), prompt(3)
    a = fp8_engine(kvv, sidecar, token, (0.5, 0.25), tp=2)
    b = fp8_engine(kvv, sidecar, token, (0.5, 0.25), tp=2)
    try:
        a.register([fp8_caches(seed=2), fp8_caches(seed=3)])
        a.run(Request("a", p), [1, 2, 3, 4])
        ext, errors, _ = b.run(Request("b", p), [5, 6, 7, 8])
        assert ext == 3 * BS and errors == [set(), set()]
        for src, dst in zip(a.caches, b.caches, strict=True):
            assert base.same_blocks(src, [1, 2, 3], dst, [5, 6, 7])
    finally:
        a.close()
        b.close()


def test_unit_fp8_scales_keep_the_fingerprint_without_a_handshake(kvv: Any, sidecar: Any) -> None:
    """vLLM's default scales (1.0, a checkpoint without any) add nothing to the identity: blocks
    stored before scales were part of it still hit, and no handshake is needed."""
    eng = fp8_engine(kvv, sidecar, tenant(sidecar), (1.0, 1.0), handshake=False)
    try:
        assert eng.workers[0].get_handshake_metadata().scales == ""
        assert eng.workers[0]._spec.fingerprint == kvv.spec_for(VllmConfig(eng.extra, 1, "fp8"), eng.extra).fingerprint
        eng.register([fp8_caches(seed=4)])
        p = prompt(2)
        eng.run(Request("a", p), [1, 2, 3])
        assert eng.offered(Request("b", p)) == 2 * BS
    finally:
        eng.close()


def test_fp8_scales_that_cannot_be_read_are_refused_at_registration(kvv: Any, sidecar: Any) -> None:
    worker = kvv.KVStoreConnector(fp8_config(extra(sidecar), None), base._Role.WORKER)
    with pytest.raises(InvalidArgument, match="fp8 KV scales"):
        worker.register_kv_caches(fp8_caches(seed=None))


def test_fp8_scales_computed_at_run_time_are_refused_at_startup(kvv: Any, sidecar: Any) -> None:
    """calculate_kv_scales (vLLM before 0.32) computes the scales from the first batch: every
    engine its own, after the connector could read them."""
    for role in base._Role:
        cfg = fp8_config(extra(sidecar), (1.0, 1.0))
        cfg.cache_config.calculate_kv_scales = True
        with pytest.raises(InvalidArgument, match="calculate_kv_scales"):
            kvv.KVStoreConnector(cfg, role)
    cfg = VllmConfig(extra(sidecar))  # a bf16 cache has no scales: taken
    cfg.cache_config.calculate_kv_scales = True
    kvv.KVStoreConnector(cfg, base._Role.SCHEDULER).shutdown()


# == refused at startup ==========================================================================
def extra(sidecar: Any) -> dict[str, Any]:
    return {"kvstore_target": sidecar.target, "kvstore_token": "unused: nothing is called"}


def refused(kvv: Any, cfg: VllmConfig, match: str) -> None:
    """Building the connector, in every role, raises InvalidArgument matching ``match``."""
    for role in base._Role:
        with pytest.raises(InvalidArgument, match=match):
            kvv.KVStoreConnector(cfg, role)


@pytest.mark.parametrize("method", ["eagle", "eagle3", "mtp", "draft_model"])
def test_speculative_decoding_with_draft_kv_is_refused_at_startup(kvv: Any, sidecar: Any, method: str) -> None:
    """Its draft layers came to register_kv_caches with the target's ("4 KV layers, spec has 2");
    and with only the target's layers loaded, the draft would attend to stale KV."""
    cfg = VllmConfig(extra(sidecar))
    cfg.speculative_config = types.SimpleNamespace(method=method, uses_draft_kv_cache=lambda: True)
    refused(kvv, cfg, f"speculative_config method '{method}'")
    cfg.speculative_config = types.SimpleNamespace(method=method)  # a vLLM without uses_draft_kv_cache
    refused(kvv, cfg, "draft model")


def test_speculative_decoding_without_draft_kv_is_taken(kvv: Any, sidecar: Any) -> None:
    cfg = VllmConfig(extra(sidecar))
    cfg.speculative_config = types.SimpleNamespace(method="ngram", uses_draft_kv_cache=lambda: False)
    for role in base._Role:
        kvv.KVStoreConnector(cfg, role).shutdown()


def test_draft_layers_at_registration_get_a_clear_message(kvv: Any, sidecar: Any) -> None:
    worker = kvv.KVStoreConnector(VllmConfig(extra(sidecar)), base._Role.WORKER)
    caches = base.kv_caches(seed=None)
    caches["model.layers.2.self_attn.attn"] = caches[NAMES[0]].clone()  # an EAGLE head's layer
    with pytest.raises(ShapeMismatch, match="draft model"):
        worker.register_kv_caches(caches)


@pytest.mark.parametrize("name", ["decode_context_parallel_size", "prefill_context_parallel_size"])
def test_context_parallelism_is_refused_at_startup(kvv: Any, sidecar: Any, name: str) -> None:
    """With DCP the scheduler's block is block_size x dcp tokens, each rank holding every dcp-th
    one; the connector keyed and moved block_size-token blocks as if each rank held them all."""
    cfg = VllmConfig(extra(sidecar))
    setattr(cfg.parallel_config, name, 2)
    refused(kvv, cfg, f"context parallelism \\({name}=2\\)")
    setattr(cfg.parallel_config, name, 1)
    kvv.KVStoreConnector(cfg, base._Role.SCHEDULER).shutdown()


def test_mla_models_are_refused_at_startup(kvv: Any, sidecar: Any) -> None:
    cfg = VllmConfig(extra(sidecar))
    cfg.model_config.use_mla = True  # type: ignore[attr-defined]
    refused(kvv, cfg, "MLA models .* not supported")


def test_3d_mla_caches_are_refused_at_registration_with_a_clear_message(kvv: Any, sidecar: Any) -> None:
    worker = kvv.KVStoreConnector(VllmConfig(extra(sidecar)), base._Role.WORKER)
    latent = {n: torch.zeros((NUM_BLOCKS, BS, 576), dtype=torch.float16) for n in NAMES}
    with pytest.raises(ShapeMismatch, match="MLA"):
        worker.register_kv_caches(latent)
