"""vLLM connector: caches on a device (GPU engines), pipeline-parallel stages, requests that may
not read a prefix cache, kv_role, and plain --kv-cache-dtype names. Driven with the stand-ins of
tests/test_integration_vllm.py against a live sidecar.

There is no GPU here: a device cache is a tensor on torch's ``meta`` device (it has a shape, a
dtype and a device other than the CPU, and no data), and the copies between device and host go
through the connector's ``_to_host`` / ``_to_device``, which the device tests record. The CUDA
path itself (pinned buffers, stream synchronisation) is not run by these tests.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field
from typing import Any

import pytest
import test_integration_vllm as base
import torch
from test_integration_vllm import BS, LAYERS, Engine, Request, VllmConfig, kv_caches, prompt, same_blocks, sched_output

# the fixtures of tests/test_integration_vllm.py (the connector on its stand-ins, a sidecar, engines)
kvv, sidecar, engine = base.kvv, base.sidecar, base.engine

META = torch.device("meta")


# == caches on a device ==========================================================================
@dataclass
class Moves:
    """What crossed between the device and the host."""

    to_host: list[tuple[torch.device, torch.device, bool]] = field(default_factory=list)  # src, dst, dst contiguous
    to_device: list[tuple[torch.device, torch.device]] = field(default_factory=list)  # blocks' device, target


@pytest.fixture
def moves(kvv: Any, monkeypatch: pytest.MonkeyPatch) -> Moves:
    """Record the connector's device <-> host copies. A meta tensor holds no data: the host side
    of a copy out of it is filled with zeros (the KV stored for a device cache here is zeros)."""
    rec = Moves()
    to_device = getattr(kvv, "_to_device", None)

    def host(src: torch.Tensor, dst: torch.Tensor) -> None:
        rec.to_host.append((src.device, dst.device, dst.is_contiguous()))
        dst.zero_()

    def device(blocks: torch.Tensor, target: torch.device) -> torch.Tensor:
        rec.to_device.append((blocks.device, target))
        assert to_device is not None
        return to_device(blocks, target)

    monkeypatch.setattr(kvv, "_to_host", host, raising=False)
    monkeypatch.setattr(kvv, "_to_device", device, raising=False)
    return rec


def on_meta(caches: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: cache.to(META) for name, cache in caches.items()}


def test_caches_on_a_device_save_through_host_copies(engine: Any, moves: Moves) -> None:
    """A GPU engine's first save raised InvalidArgument (store blocks on cpu, cache on cuda:0)
    inside the forward pass: the staging buffers were CPU tensors given to the device kernels."""
    eng = engine()
    eng.register([on_meta(kv_caches(seed=1))])
    ext, errors, report = eng.run(Request("a", prompt(3)), [1, 2, 3, 4])
    assert ext == 0 and errors == [set()]
    assert report == {"kvstore": {"loaded_tokens": 0, "sent_blocks": 3}}
    assert eng.workers[0].counts.stored_blocks == 3
    # each layer gathered on the device, then copied into its own contiguous host slab
    assert moves.to_host == [(META, torch.device("cpu"), True)] * LAYERS


def test_caches_on_a_device_load_through_a_host_to_device_copy(engine: Any, moves: Moves) -> None:
    cpu = engine()
    cpu.register([kv_caches(seed=2)])
    p = prompt(3)
    cpu.run(Request("a", p), [1, 2, 3, 4])
    gpu = engine(cpu.extra["kvstore_token"])
    gpu.register([on_meta(kv_caches())])
    ext, errors, report = gpu.run(Request("b", p), [5, 6, 7, 8])
    assert ext == 3 * BS and errors == [set()]
    assert report is not None and report["kvstore"]["loaded_tokens"] == 3 * BS
    assert moves.to_device == [(torch.device("cpu"), META)] * LAYERS  # one layer at a time (loads18)


def test_a_device_cache_resends_a_lost_chain_through_the_host(kvv: Any, engine: Any, sidecar: Any,
                                                               moves: Moves) -> None:
    """The re-save from the root (the stored parent went away) gathered into a CPU buffer too."""
    eng = engine()
    eng.register([on_meta(kv_caches(seed=6))])
    short = prompt(2)
    eng.run(Request("a", short), [1, 2, 3])
    long = short[: 2 * BS] + prompt(2)
    req = Request("b", long)
    assert eng.sched.get_num_new_matched_tokens(req, 0) == (2 * BS, False)
    eng.sched.update_state_after_alloc(req, None, 0)
    moves.to_host.clear()
    with sidecar.client(eng.extra["kvstore_token"]) as client:
        spec = kvv.spec_for(VllmConfig(eng.extra), eng.extra)
        assert client.delete(client.block_keys(spec, short[: 2 * BS])) == 2
        eng.step(sched_output([("b", [4, 5, 6, 7, 8], 0)], {"b": len(long)}))
        assert client.lookup(spec, token_ids=long[: 4 * BS]).num_blocks == 4
    counts = eng.workers[0].counts
    assert (counts.stored_blocks, counts.resent_blocks, counts.failed_blocks) == (2 + 2, 2, 0)
    # the save's layers, then the chain's head's, one layer at a time too (resend18)
    assert moves.to_host == [(META, torch.device("cpu"), True)] * (2 * LAYERS)


def test_cpu_caches_move_no_bytes_through_the_device_copies(engine: Any, moves: Moves) -> None:
    eng = engine()
    eng.register([kv_caches(seed=3)])
    p = prompt(2)
    eng.run(Request("a", p), [1, 2, 3])
    src = eng.caches[0]
    eng.register([kv_caches()])
    ext, _, _ = eng.run(Request("b", p), [4, 5, 6])
    assert ext == 2 * BS and same_blocks(src, [1, 2], eng.caches[0], [4, 5])
    assert moves.to_host == [] and moves.to_device == [(torch.device("cpu"), torch.device("cpu"))] * LAYERS


# == pipeline parallelism ========================================================================
_PP_RANK = [0]  # what the stand-in get_pp_group().rank_in_group answers


@dataclass
class PPModelConfig(base.ModelConfig):
    """vLLM's ModelConfig for ``total`` layers split over the stages as ``split`` says; the
    stage comes from ``parallel_config.rank`` (ranks laid out PP x TP), as in vLLM."""

    split: tuple[int, ...] = (0, 2, 4)

    def get_layers_start_end_indices(self, pc: Any) -> tuple[int, int]:
        stage = (pc.rank // pc.tensor_parallel_size) % pc.pipeline_parallel_size
        return self.split[stage], self.split[stage + 1]

    def get_num_layers(self, pc: Any) -> int:
        start, end = self.get_layers_start_end_indices(pc)
        return end - start


@dataclass
class PPConfig(VllmConfig):
    pp: int = 2
    rank: int = 0
    split: tuple[int, ...] = (0, 2, 4)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.model_config = PPModelConfig(split=self.split)
        self.parallel_config = types.SimpleNamespace(tensor_parallel_size=self.tp, pipeline_parallel_size=self.pp,
                                                     world_size=self.tp * self.pp, rank=self.rank)


@pytest.fixture
def pp_group(kvv: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.modules["vllm.distributed.parallel_state"], "get_pp_group",
                        lambda: types.SimpleNamespace(rank_in_group=_PP_RANK[0]), raising=False)


def pp_engine(kvv: Any, sidecar: Any, tp: int, split: tuple[int, ...]) -> Engine:
    """A scheduler and one worker per (stage, TP rank), stage-major, as vLLM lays them out."""
    token = sidecar.admin().create_tenant(f"vllm-pp-{next(base._TENANTS)}")
    eng = Engine(kvv, sidecar, token)
    eng.close()
    extra, pp = eng.extra, len(split) - 1
    eng.sched = kvv.KVStoreConnector(PPConfig(dict(extra), tp, pp=pp, split=split), base._Role.SCHEDULER)
    eng.workers = []
    for stage in range(pp):
        for rank in range(tp):
            base._TP_RANK[0], _PP_RANK[0] = rank, stage
            cfg = PPConfig(dict(extra), tp, pp=pp, rank=stage * tp + rank, split=split)
            eng.workers.append(kvv.KVStoreConnector(cfg, base._Role.WORKER))
    base._TP_RANK[0] = _PP_RANK[0] = 0
    return eng


def stage_caches(split: tuple[int, ...], tp: int, seed: int | None) -> list[dict[str, torch.Tensor]]:
    """Each worker's caches, named by the model's layer numbers (stage 1 of 4 layers: 2 and 3)."""
    out = []
    for stage in range(len(split) - 1):
        for rank in range(tp):
            layers = list(kv_caches(None if seed is None else seed + 10 * stage + rank).values())  # LAYERS >= a stage's
            out.append({f"model.layers.{i}.self_attn.attn": layers[i - split[stage]]
                        for i in range(split[stage], split[stage + 1])})
    return out


@pytest.mark.parametrize(("tp", "split"), [(1, (0, 2, 4)), (2, (0, 2, 4)), (1, (0, 2, 3))],
                         ids=["pp2", "pp2-tp2", "pp2-uneven"])
def test_pipeline_stages_store_and_load_their_own_layers(kvv: Any, sidecar: Any, pp_group: None, tp: int,
                                                         split: tuple[int, ...]) -> None:
    """Every stage's worker had TP rank 0 and the spec no stage: equal stages shared one
    fingerprint and keys (stage 1 loaded stage 0's layers), uneven ones had their puts refused."""
    eng = pp_engine(kvv, sidecar, tp, split)
    try:
        specs = [w._spec for w in eng.workers]
        assert len({s.fingerprint for s in specs}) == len(specs)
        assert [s.num_layers for s in specs] == [split[i // tp + 1] - split[i // tp] for i in range(len(specs))]
        eng.register(stage_caches(split, tp, seed=1))
        p = prompt(3)
        _, errors, _ = eng.run(Request("a", p), [1, 2, 3, 4])
        assert errors == [set()] * len(specs)
        assert [w.counts.stored_blocks for w in eng.workers] == [3] * len(specs)
        sources = eng.caches
        eng.register(stage_caches(split, tp, seed=None))
        ext, errors, _ = eng.run(Request("b", p), [5, 6, 7, 8])
        assert ext == 3 * BS and errors == [set()] * len(specs)
        for src, dst in zip(sources, eng.caches, strict=True):
            assert same_blocks(src, [1, 2, 3], dst, [5, 6, 7])
    finally:
        eng.close()


def test_a_lookup_with_pipeline_stages_hits_only_what_every_stage_has(kvv: Any, sidecar: Any,
                                                                      pp_group: None) -> None:
    split = (0, 2, 4)
    eng = pp_engine(kvv, sidecar, 1, split)
    try:
        eng.register(stage_caches(split, 1, seed=4))
        p = prompt(3)
        eng.run(Request("a", p), [1, 2, 3, 4])
        with sidecar.client(eng.extra["kvstore_token"]) as client:  # stage 1 loses its last block
            stage1 = eng.workers[1]._spec
            assert client.delete(client.block_keys(stage1, p[: 3 * BS])[2:]) == 1
        assert eng.offered(Request("b", p)) == 2 * BS
    finally:
        eng.close()


def test_one_pipeline_stage_keeps_the_spec_it_had(kvv: Any) -> None:
    """Without pipeline parallelism the fingerprint is unchanged: stored blocks stay hits."""
    extra: dict[str, Any] = {}
    plain = kvv.spec_for(VllmConfig(extra), extra)
    one = PPConfig(extra, pp=1, split=(0, LAYERS))
    assert kvv.spec_for(one, extra) == plain and plain.layout == "vllm"


# == requests that may not read a prefix cache ===================================================
@dataclass
class SkipRequest(Request):
    """A request vLLM marks ``skip_reading_prefix_cache`` (prompt_logprobs, or set by the user)."""

    skip_reading_prefix_cache: bool = False


def test_a_request_that_skips_reading_the_prefix_cache_loads_nothing_and_is_saved(engine: Any) -> None:
    """vLLM asks the connector for every request and schedules what it answers: a
    prompt_logprobs request got its stored prefix loaded, and logprobs for the rest only."""
    eng = engine()
    eng.register([kv_caches(seed=1)])
    p = prompt(3)
    eng.run(SkipRequest("a", p), [1, 2, 3, 4])
    q = p[: 3 * BS] + prompt(2)
    ext, errors, report = eng.run(SkipRequest("b", q, skip_reading_prefix_cache=True), [5, 6, 7, 8, 9, 10])
    assert ext == 0 and errors == [set()]
    assert report == {"kvstore": {"loaded_tokens": 0, "sent_blocks": 2}}  # the 2 blocks not stored yet
    assert eng.offered(SkipRequest("c", q)) == 5 * BS


# == kv_role =====================================================================================
def role_engine(kvv: Any, sidecar: Any, token: str, kv_role: str) -> Engine:
    eng = Engine(kvv, sidecar, token)
    eng.close()

    def cfg() -> VllmConfig:
        c = VllmConfig(dict(eng.extra))
        c.kv_transfer_config = types.SimpleNamespace(kv_connector_extra_config=dict(eng.extra), kv_role=kv_role)
        return c

    eng.sched = kvv.KVStoreConnector(cfg(), base._Role.SCHEDULER)
    eng.workers = [kvv.KVStoreConnector(cfg(), base._Role.WORKER)]
    return eng


def test_a_kv_consumer_loads_and_never_saves(kvv: Any, engine: Any, sidecar: Any) -> None:
    writer = engine()
    writer.register([kv_caches(seed=1)])
    p = prompt(3)
    writer.run(Request("a", p), [1, 2, 3, 4])
    consumer = role_engine(kvv, sidecar, writer.extra["kvstore_token"], "kv_consumer")
    try:
        consumer.register([kv_caches()])
        q = p[: 3 * BS] + prompt(2)
        ext, errors, report = consumer.run(Request("b", q), [5, 6, 7, 8, 9, 10])
        assert ext == 3 * BS and errors == [set()]
        assert same_blocks(writer.caches[0], [1, 2, 3], consumer.caches[0], [5, 6, 7])
        assert report == {"kvstore": {"loaded_tokens": 3 * BS, "sent_blocks": 0}}
        assert consumer.workers[0].counts.stored_blocks == 0
        assert writer.offered(Request("c", q)) == 3 * BS  # its own 2 blocks were not stored
    finally:
        consumer.close()


def test_a_kv_producer_saves_and_never_loads(kvv: Any, engine: Any, sidecar: Any) -> None:
    reader = engine()
    producer = role_engine(kvv, sidecar, reader.extra["kvstore_token"], "kv_producer")
    try:
        producer.register([kv_caches(seed=2)])
        p = prompt(3)
        producer.run(Request("a", p), [1, 2, 3, 4])
        assert producer.workers[0].counts.stored_blocks == 3
        assert producer.offered(Request("b", p)) == 0
        assert reader.offered(Request("c", p)) == 3 * BS
    finally:
        producer.close()


def test_kv_both_and_no_role_load_and_save(kvv: Any, engine: Any, sidecar: Any) -> None:
    both = role_engine(kvv, sidecar, engine().extra["kvstore_token"], "kv_both")
    try:
        both.register([kv_caches(seed=3)])
        p = prompt(2)
        both.run(Request("a", p), [1, 2, 3])
        assert both.workers[0].counts.stored_blocks == 2 and both.offered(Request("b", p)) == 2 * BS
    finally:
        both.close()


# == --kv-cache-dtype ============================================================================
@pytest.mark.parametrize(("cache_dtype", "model_dtype"), [("bfloat16", torch.float16), ("bfloat16", torch.bfloat16),
                                                           ("float16", torch.float16)])
def test_a_plain_kv_cache_dtype_is_the_spec_dtype(kvv: Any, cache_dtype: str, model_dtype: torch.dtype) -> None:
    cfg = VllmConfig({}, cache_dtype=cache_dtype, model_config=base.ModelConfig(dtype=model_dtype))
    assert kvv.spec_for(cfg, {}).dtype == cache_dtype


def test_a_bfloat16_kv_cache_round_trips(engine: Any) -> None:
    """An engine started with --kv-cache-dtype bfloat16 was refused at startup."""
    eng = engine(cache_dtype="bfloat16")
    eng.register([kv_caches(seed=5, dtype=torch.bfloat16)])
    p = prompt(2)
    eng.run(Request("a", p), [1, 2, 3])
    src = eng.caches[0]
    eng.register([kv_caches(dtype=torch.bfloat16)])
    ext, errors, _ = eng.run(Request("b", p), [4, 5, 6])
    assert ext == 2 * BS and errors == [set()]
    assert same_blocks(src, [1, 2], eng.caches[0], [4, 5])

