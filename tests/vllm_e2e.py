"""End-to-end check of the vLLM KV connector (kvstore.integrations.vllm) against real vLLM.

Run with a Python that has vLLM (``.ci/vllm_step.sh`` builds one)::

    python tests/vllm_e2e.py [--keep DIR]

Starts a kvstore sidecar in this process, builds a tiny random Llama (``load_format="dummy"``
from a config-only directory, no tokenizer: prompts are token ids), and runs one prompt:

1. cold: nothing cached anywhere; the connector saves the prompt's full blocks to kvstore;
2. warm: vLLM's own prefix cache hit (the reference);
3. after ``llm.reset_prefix_cache()``: the blocks are loaded from kvstore.

Checks: the blocks are in kvstore after run 1; run 3's ``num_cached_tokens`` equals run 2's
(the external hit) and the connector reports loading them; run 3's sampled tokens and logprobs
are bit-identical to run 2's; a control prompt with another first block changes the
logprobs (the KV matters). Prints one line ``KVSTORE_VLLM_E2E {json}``; exit code 0 only if every check passes.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BLOCK = 32  # vLLM CPU attention needs a multiple of 32
LAYERS, HEADS, KV_HEADS, HEAD_DIM, HIDDEN, VOCAB = 2, 4, 2, 64, 256, 512
MODEL_ID = "kvstore-test/tiny-llama"
RESULT_MARKER = "KVSTORE_VLLM_E2E"


def write_model(path: Path) -> None:
    """A config-only Llama directory (weights come from load_format="dummy")."""
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": 2 * HIDDEN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "vocab_size": VOCAB,
        "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float32",
        "bos_token_id": 1, "eos_token_id": 2,
    }
    (path / "config.json").write_text(json.dumps(config))


def init_weights(model: Any) -> int:
    """Re-initialise the dummy weights (vLLM's are uniform in +-1e-3, which makes the output
    blind to the KV cache) with a seeded scaled normal; runs inside the worker."""
    import torch

    g = torch.Generator().manual_seed(1234)
    n = 0
    for _, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        with torch.no_grad():
            if p.dim() == 1:
                p.fill_(1.0)  # RMSNorm scales
            else:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype) * (2.0 / p.shape[-1] ** 0.5))
        n += 1
    # the CPU build pre-packs linear weights after loading: pack the new ones again
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    for module in model.modules():
        if hasattr(module, "cpu_linear") and getattr(module, "weight", None) is not None:
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
    return n


def check_cpu_layout() -> dict[str, bool]:
    """Write known K/V with vLLM's own CPU cache kernel (as its CPU attention backend calls it) and
    report which reading of a block recovers them (the connector relies only on the K|V split)."""
    import torch
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    nb, ntok = 4, 40
    cache = torch.zeros(nb, KV_HEADS, BLOCK, 2 * HEAD_DIM)
    g = torch.Generator().manual_seed(7)
    key = torch.randn(ntok, KV_HEADS, HEAD_DIM, generator=g)
    value = torch.randn(ntok, KV_HEADS, HEAD_DIM, generator=g)
    slots = torch.tensor([2 * BLOCK + t for t in range(BLOCK)] + [BLOCK + t for t in range(ntok - BLOCK)])
    key_cache, value_cache = cache.view(nb, KV_HEADS, 2 * BLOCK, HEAD_DIM).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots,
                                   _get_attn_isa(torch.float32, BLOCK, HEAD_DIM))
    canon = cache.view(nb, KV_HEADS, 2, BLOCK, HEAD_DIM).permute(0, 2, 3, 1, 4)
    got_k = canon[slots // BLOCK, 0, slots % BLOCK]
    got_v = canon[slots // BLOCK, 1, slots % BLOCK]
    # kernels.paged's CPU_FUSED reading (K | V halves of the last axis of [nb, H, bs, 2D])
    fused_k = cache.permute(0, 2, 1, 3)[slots // BLOCK, slots % BLOCK, :, :HEAD_DIM]
    # the "vec" kernels' order: K slab dim-major [D, bs], V slab token-major [bs, D]
    slab = cache.view(nb, KV_HEADS, 2, BLOCK * HEAD_DIM)
    vec_k = slab[:, :, 0].view(nb, KV_HEADS, HEAD_DIM, BLOCK).permute(0, 3, 1, 2)[slots // BLOCK, slots % BLOCK]
    vec_v = slab[:, :, 1].view(nb, KV_HEADS, BLOCK, HEAD_DIM).permute(0, 2, 1, 3)[slots // BLOCK, slots % BLOCK]
    # the connector's own path: the raw cache in the layout it picks for this ISA -> gather, and back
    from kernels.paged import PagedLayout, gather_layer, scatter_layer
    from kvstore.integrations.vllm import _K_DIM_MAJOR_ISAS

    isa = _get_attn_isa(torch.float32, BLOCK, HEAD_DIM)
    layout = PagedLayout.CPU_SPLIT_KDIM if str(isa) in _K_DIM_MAJOR_ISAS else PagedLayout.CPU_SPLIT
    table = [2, 1]
    out = torch.empty(2, 2, KV_HEADS, BLOCK, HEAD_DIM)
    gather_layer(cache, table, layout, out)
    want = torch.zeros(2, 2, KV_HEADS, BLOCK, HEAD_DIM)  # block 2 = tokens 0..31, block 1 = 32..39
    want[0, 0], want[0, 1] = key[:BLOCK].transpose(0, 1), value[:BLOCK].transpose(0, 1)
    want[1, 0, :, : ntok - BLOCK], want[1, 1, :, : ntok - BLOCK] = key[BLOCK:].transpose(0, 1), value[BLOCK:].transpose(0, 1)
    back = torch.zeros_like(cache)
    scatter_layer(out, back, table, layout)
    return {"isa": _get_attn_isa(torch.float32, BLOCK, HEAD_DIM),
            "connector_reads_canonical": bool(torch.equal(out, want)),
            "connector_writes_kernel_order": bool(torch.equal(back, cache)),
            "kv_slabs_split_as_connector_assumes": bool(torch.equal(got_v, value) or torch.equal(vec_v, value)),
            "token_major_kv": bool(torch.equal(got_k, key) and torch.equal(got_v, value)),
            "vec_dim_major_k": bool(torch.equal(vec_k, key) and torch.equal(vec_v, value)),
            "paged_cpu_fused_matches_kernel": bool(torch.equal(fused_k, key))}


def start_sidecar(data_dir: Path) -> tuple[Any, str, str]:
    """An in-process sidecar on a free loopback port; returns (server, target, tenant token)."""
    from kvstore import server_config
    from kvstore.admin_client import AdminClient
    from kvstore.server import bootstrap, create_server

    cfg = server_config.build({
        "listen": "127.0.0.1:0", "metrics": {"enabled": False}, "expire_interval_s": 0, "audit_fsync": False,
        "store": {"hbm_bytes": 32 << 20, "dram_bytes": 64 << 20, "nvme_bytes": 256 << 20, "durable": False},
    }, data_dir=data_dir)
    admin_token = bootstrap(cfg)
    server, port = create_server(cfg)
    server.start()
    target = f"127.0.0.1:{port}"
    with AdminClient(target, admin_token) as admin:
        token = admin.create_tenant("vllm")
    return server, target, token


def run_once(llm: Any, prompt: list[int], params: Any) -> dict[str, Any]:
    t0 = time.perf_counter()
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    comp = out.outputs[0]
    logprobs = [{int(tok): lp.logprob for tok, lp in step.items()} for step in (comp.logprobs or [])]
    return {"tokens": list(comp.token_ids), "logprobs": logprobs, "num_cached_tokens": out.num_cached_tokens,
            "kv_transfer_params": out.kv_transfer_params, "seconds": round(time.perf_counter() - t0, 3)}


def main() -> int:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # the sidecar's gRPC threads live here
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # for llm.apply_model(init_weights)
    root = Path(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[1] == "--keep" else Path(tempfile.mkdtemp(prefix="kvstore-vllm-"))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    result: dict[str, Any] = {"checks": {}}
    t_start = time.perf_counter()
    server, target, token = start_sidecar(root / "sidecar")

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from kvstore.client import Client
    from kvstore.integrations.vllm import make_spec

    result["vllm"] = vllm.__version__
    result["cpu_layout"] = check_cpu_layout()
    model_dir = root / "model"
    write_model(model_dir)
    ktc = KVTransferConfig(
        kv_connector="KVStoreConnector", kv_connector_module_path="kvstore.integrations.vllm", kv_role="kv_both",
        kv_connector_extra_config={"kvstore_target": target, "kvstore_token": token, "kvstore_model": MODEL_ID},
    )
    t0 = time.perf_counter()
    llm = LLM(model=str(model_dir), load_format="dummy", skip_tokenizer_init=True, dtype="float32",
              enable_prefix_caching=True, block_size=BLOCK, max_model_len=512, max_num_seqs=4,
              enforce_eager=True, seed=0, kv_transfer_config=ktc)
    result["engine_start_s"] = round(time.perf_counter() - t0, 1)
    # by reference from an importable module (workers get this process's sys.path)
    from vllm_e2e import init_weights as init_by_ref

    result["reinitialised_params"] = llm.apply_model(init_by_ref)

    full_blocks = 3
    prompt = [(i * 7919 + 13) % (VOCAB - 3) + 3 for i in range(full_blocks * BLOCK + 7)]
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=5, detokenize=False)

    cold = run_once(llm, prompt, params)
    spec = make_spec(MODEL_ID, num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype="float32",
                     block_size=BLOCK, layout="vllm" if result["cpu_layout"]["isa"] == "vec"
                     else f"vllm-cpu-{result['cpu_layout']['isa']}")
    with Client(target, token) as kv:
        stored = kv.lookup(spec, token_ids=prompt[: full_blocks * BLOCK]).num_blocks
    warm = run_once(llm, prompt, params)
    reset = llm.reset_prefix_cache()
    external = run_once(llm, prompt, params)
    # control: the same tail after another first block must change the output (the KV matters)
    other = run_once(llm, [(t + 1) % VOCAB for t in prompt[:BLOCK]] + prompt[BLOCK:], params)
    result["runs"] = {"cold": cold, "vllm_prefix_hit": warm, "kvstore_hit": external, "other_prefix": other}
    result["stored_blocks"] = stored

    hit_tokens = full_blocks * BLOCK
    loaded = ((external["kv_transfer_params"] or {}).get("kvstore") or {}).get("loaded_tokens")
    c = result["checks"]
    c["cpu_cache_kv_split"] = result["cpu_layout"]["kv_slabs_split_as_connector_assumes"]
    if result["cpu_layout"]["isa"] == "vec":  # the ISA the connector converts to canonical blocks
        c["cpu_blocks_canonical"] = result["cpu_layout"]["connector_reads_canonical"]
        c["cpu_blocks_written_back_in_kernel_order"] = result["cpu_layout"]["connector_writes_kernel_order"]
    c["cold_run_had_no_cache_hit"] = cold["num_cached_tokens"] == 0
    c["blocks_saved_to_kvstore"] = stored == full_blocks
    c["vllm_prefix_hit"] = warm["num_cached_tokens"] == hit_tokens
    c["reset_prefix_cache"] = bool(reset)
    c["external_hit_in_num_cached_tokens"] = external["num_cached_tokens"] == hit_tokens
    c["connector_loaded_tokens"] = loaded == hit_tokens
    c["output_depends_on_prefix_kv"] = other["logprobs"] != warm["logprobs"]
    c["tokens_identical"] = external["tokens"] == warm["tokens"]
    c["logprobs_bit_identical"] = (
        len(external["logprobs"]) == len(warm["logprobs"]) > 0
        and all(e == w for e, w in zip(external["logprobs"], warm["logprobs"], strict=True))
    )
    # informational: vLLM's cache-hit path vs a full prefill (different kernels' split, may differ)
    result["cold_vs_hit_logprobs_identical"] = cold["logprobs"] == warm["logprobs"]
    result["ok"] = all(c.values())
    result["total_s"] = round(time.perf_counter() - t_start, 1)
    del llm
    server.stop(0)
    # one line with a marker: vLLM logs to stdout too
    print(RESULT_MARKER, json.dumps(result, default=str), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
