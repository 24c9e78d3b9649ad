"""What makes the vLLM connector's blocks interchangeable: the block spec of each worker's shard
(model identity, KV dtype, layout tag, pipeline stage, LoRA adapter, fp8 scales), and what the
connector refuses because it could not key or store it correctly.

Plain functions of vLLM's config objects; importing this module does not import vLLM
(:func:`cpu_isa` imports it when called). The connector is :mod:`kvstore.integrations.vllm`.

* **Identity.** :func:`spec_for` gives one worker's spec: the model id (``kvstore_model``, else
  vLLM's served model name), ``kvstore_revision`` (else vLLM's ``--revision``), the KV dtype
  (``--kv-cache-dtype``: ``auto`` is the model's dtype, ``fp8*`` an fp8 dtype: e4m3 as the
  platform's kernels read it, AMD's fnuz on MI300 (:func:`fp8_e4m3`), or a plain
  ``bfloat16``/``float16``), the block size, heads and head dim, and the TP rank and size. A rank
  is a worker: TP rank ``r`` of pipeline stage ``s``; a stage's spec holds its own layers and has
  the stage and its layer range in its layout tag (:func:`stage_layers`), so stages never share
  keys (with one stage the spec is as before). A request's LoRA adapter
  (:func:`request_adapter`) is the spec's ``adapter``.
* **CPU layouts.** The layout tag is ``vllm`` for canonical blocks; a CPU attention ISA whose
  in-block order the kernels do not turn canonical keeps the engine's bytes under
  ``vllm-cpu-<isa>`` (:func:`cpu_isa`), so such blocks round-trip exactly but never mix with
  canonical ones.
* **fp8 scales.** fp8 bytes mean something only under the layer's k and v scales:
  :func:`scales_tag` hashes every layer's ``_k_scale``/``_v_scale`` into a layout tag part
  ("" when all are 1.0, vLLM's default, so the fingerprint is unchanged). The connector puts it in
  its worker's spec at registration and sends it to the scheduler in vLLM's handshake.
* **Refused at startup** (:func:`refuse_unsupported`, with a message naming the option): MLA
  models, decode or prefill context parallelism > 1, speculative decoding whose draft model has
  its own KV cache, and fp8 scales computed at run time (``calculate_kv_scales``).
* **Not cached** (:func:`_unkeyable`): requests whose KV depends on more than their token ids
  (multimodal inputs, prompt embeddings).
"""

from __future__ import annotations

import copy
import hashlib
from typing import TYPE_CHECKING, Any

import torch

from kvstore.errors import InvalidArgument
from kvstore.spec import ModelSpec

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["cpu_isa", "fp8_e4m3", "make_spec", "pipeline_stages", "refuse_unsupported", "request_adapter", "scales_tag",
           "spec_for", "stage_layers"]

#: ``--kv-cache-dtype`` fp8 values -> kvstore dtype; "e4m3" is the platform's e4m3 (:func:`fp8_e4m3`)
_FP8 = {"fp8": "e4m3", "fp8_e4m3": "e4m3", "fp8_e5m2": "float8_e5m2"}
_E4M3_NAMES = {torch.float8_e4m3fn: "float8_e4m3fn", torch.float8_e4m3fnuz: "float8_e4m3fnuz"}
#: ``--kv-cache-dtype`` values that name a plain torch dtype (vLLM 0.32 accepts "bfloat16"; some
#: releases also "float16")
_PLAIN = {"bfloat16": "bfloat16", "float16": "float16"}
#: speculative methods whose draft model has attention layers (so KV in the target's blocks), for
#: vLLM releases without ``SpeculativeConfig.uses_draft_kv_cache`` (0.32 has it)
_DRAFT_KV_METHODS = frozenset({"eagle", "eagle3", "mtp", "deepseek_mtp", "draft_model", "dflash", "dspark",
                               "extract_hidden_states"})


def make_spec(model: str, *, num_layers: int, num_kv_heads: int, head_dim: int, dtype: str,
              block_size: int, revision: str = "", tp_rank: int = 0, tp_size: int = 1,
              layout: str = "vllm", adapter: str = "") -> ModelSpec:
    """The block spec the connector uses (also for callers that inspect the store)."""
    return ModelSpec(model=model, revision=revision, num_layers=num_layers, num_kv_heads=num_kv_heads,
                     head_dim=head_dim, dtype=dtype, block_tokens=block_size, layout=layout,
                     adapter=adapter, tp_rank=tp_rank, tp_size=tp_size)


def spec_for(vllm_config: VllmConfig, extra: dict[str, Any], tp_rank: int = 0, adapter: str = "",
             pp_rank: int = 0) -> ModelSpec:
    """Spec of one worker's shard (pipeline stage ``pp_rank``, TP rank ``tp_rank``), from vLLM's
    config (the same in every process); ``adapter``: the request's LoRA adapter
    (:func:`request_adapter`), "" for the base model.

    NOTE: the identity is the model id (``kvstore_model``, else vLLM's served model name) and
    ``kvstore_revision`` (else vLLM's ``--revision``, often ""): two checkpoints served under one
    name share KV unless one of those tells them apart. With pipeline parallelism the stage and
    its layer range are in the layout tag (so in the fingerprint): stages hold different layers
    and never share keys; with one stage the tag is unchanged."""
    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    if cc.cache_dtype == "auto":
        dtype = str(mc.dtype).removeprefix("torch.")
    elif cc.cache_dtype in _FP8:
        dtype = fp8_e4m3() if _FP8[cc.cache_dtype] == "e4m3" else _FP8[cc.cache_dtype]
    elif cc.cache_dtype in _PLAIN:
        dtype = _PLAIN[cc.cache_dtype]
    else:
        raise InvalidArgument(f"kvstore connector: unsupported kv cache dtype {cc.cache_dtype!r}")
    model = str(extra.get("kvstore_model") or mc.served_model_name or mc.model)
    layout = _layout_tag(mc.dtype, cc.block_size, mc.get_head_size(), cc.cache_dtype)
    pp_size = pipeline_stages(vllm_config)
    if pp_size > 1:
        start, end = stage_layers(vllm_config, pp_rank)
        num_layers, layout = end - start, f"{layout};pp={pp_rank}/{pp_size};layers={start}-{end}"
    else:
        num_layers = mc.get_num_layers(pc)
    return make_spec(model, num_layers=num_layers, num_kv_heads=mc.get_num_kv_heads(pc),
                     head_dim=mc.get_head_size(), dtype=dtype, block_size=cc.block_size,
                     revision=str(extra.get("kvstore_revision") or mc.revision or ""),
                     tp_rank=tp_rank, tp_size=pc.tensor_parallel_size, adapter=adapter, layout=layout)


def fp8_e4m3() -> str:
    """The kvstore dtype of vLLM's ``fp8``/``fp8_e4m3`` KV cache on this platform: what vLLM's
    kernels read those bytes as, ``current_platform.fp8_dtype()`` — AMD's ``float8_e4m3fnuz`` on
    MI300/MI325, OCP ``float8_e4m3fn`` elsewhere (and where vLLM's platform does not say).
    NOTE: it was e4m3fn everywhere, so an MI300's blocks were keyed as an H100's, whose same
    bytes are other numbers (1.0 is 0x40 in fnuz, 0x38 in e4m3fn). e5m2 is OCP on every
    platform in vLLM."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return "float8_e4m3fn"
    preferred = getattr(current_platform, "fp8_dtype", None)
    dtype = preferred() if preferred is not None else torch.float8_e4m3fn
    if dtype not in _E4M3_NAMES:
        raise InvalidArgument(f"kvstore connector: vLLM's fp8 KV dtype on this platform is {dtype}, "
                              f"which kvstore does not know")
    return _E4M3_NAMES[dtype]


def refuse_unsupported(vllm_config: VllmConfig) -> None:
    """Refuse, when the connector is built (engine startup), what it cannot store correctly:
    MLA models, context parallelism, speculative decoding with a draft model's KV, and fp8 KV
    scales computed at run time (InvalidArgument naming the option).

    NOTE: each checked against vLLM 0.32's source. MLA caches hold one latent per token, not
    per-head K and V. With decode context parallelism the scheduler's block is ``block_size x
    dcp`` tokens, each rank holding every dcp-th token of it (prefill context parallelism also
    shards a block's tokens): the connector's blocks and keys are ``block_size`` tokens of one
    rank. A draft model (EAGLE, MTP, ``draft_model``) keeps its KV in the target's blocks, and
    vLLM does not recompute it for tokens a connector loaded: the drafts would attend to
    whatever those blocks held before. Scales computed from the first batch
    (``calculate_kv_scales``, in vLLM releases before 0.32) differ from engine to engine, and
    their fp8 bytes decoded under another engine's scales are wrong attention."""
    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    if getattr(mc, "use_mla", False):
        raise InvalidArgument("kvstore connector: MLA models (DeepSeek-V2/V3, Kimi K2, ...) are not supported: their "
                              "KV cache is one compressed latent per token ([blocks, block_size, latent]), not "
                              "per-head K and V; run without kv_transfer_config")
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        size = int(getattr(pc, name, 1) or 1)
        if size > 1:
            raise InvalidArgument(f"kvstore connector: context parallelism ({name}={size}) is not supported: "
                                  f"each rank holds every {size}th token of a block of block_size x {size} "
                                  f"tokens, which the connector's keys and blocks do not describe; set it to 1")
    sc = getattr(vllm_config, "speculative_config", None)
    if sc is not None:
        draft_kv = getattr(sc, "uses_draft_kv_cache", None)
        method = getattr(sc, "method", None)
        if draft_kv() if callable(draft_kv) else method in _DRAFT_KV_METHODS:
            raise InvalidArgument(f"kvstore connector: speculative decoding with a draft model that has its own KV "
                                  f"cache (speculative_config method {method!r}) is not supported: vLLM does not "
                                  f"recompute the draft's KV of the tokens a connector loads; use a method "
                                  f"without one (\"ngram\", \"suffix\") or no speculative_config")
    if getattr(cc, "calculate_kv_scales", False) and cc.cache_dtype in _FP8:
        raise InvalidArgument("kvstore connector: fp8 KV scales computed from the first batch "
                              "(calculate_kv_scales=True) differ from engine to engine, and KV stored under one "
                              "engine's scales is wrong under another's; use the checkpoint's scales "
                              "(calculate_kv_scales=False)")


def pipeline_stages(vllm_config: VllmConfig) -> int:
    """vLLM's pipeline-parallel size (1 without pipeline parallelism)."""
    return int(getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1) or 1)


def stage_layers(vllm_config: VllmConfig, pp_rank: int) -> tuple[int, int]:
    """Layers ``[start, end)`` of pipeline stage ``pp_rank``, as vLLM splits them in any process.

    NOTE: vLLM's ``ModelConfig.get_layers_start_end_indices`` reads the stage from
    ``parallel_config.rank`` (ranks laid out DP x PP x TP: a stage spans ``world_size / pp``
    ranks), which is 0 in the scheduler: it is asked with a copy whose rank is the stage's first.
    A worker checks the answer against its own (:class:`KVStoreConnector`)."""
    pc = vllm_config.parallel_config
    pp_size = pipeline_stages(vllm_config)
    per_stage = max(1, int(getattr(pc, "world_size", 0) or pc.tensor_parallel_size * pp_size) // pp_size)
    stage_pc = copy.copy(pc)
    stage_pc.rank = pp_rank * per_stage
    start, end = vllm_config.model_config.get_layers_start_end_indices(stage_pc)
    return int(start), int(end)


def request_adapter(request: Any) -> str:
    """The spec ``adapter`` of a vLLM request: its LoRA adapter's name (else its id), "" without.

    NOTE: the name, not ``lora_int_id``: vLLM numbers adapters per process, and stored blocks
    outlive the process (NVMe, other engines on the same sidecar)."""
    lora = getattr(request, "lora_request", None)
    if lora is None:
        return ""
    name = getattr(lora, "lora_name", None) or getattr(lora, "name", None)
    return f"lora:{name}" if name else f"lora-id:{getattr(lora, 'lora_int_id', '')}"


def _unkeyable(request: Any) -> bool:
    """Whether the request's KV depends on more than its token ids (multimodal inputs, prompt
    embeddings), across vLLM versions (``mm_features``; ``mm_positions``/``mm_hashes`` before)."""
    return (any(getattr(request, name, None) for name in ("mm_features", "mm_positions", "mm_hashes"))
            or getattr(request, "prompt_embeds", None) is not None)


#: CPU attention ISAs whose block order the connector converts to the canonical one
#: (``vec``: K slab dim-major ``[D, bs]``, V slab token-major ``[bs, D]``; checked by tests/vllm_e2e.py)
_K_DIM_MAJOR_ISAS = frozenset({"vec"})


def cpu_isa(dtype: torch.dtype, block_size: int, head_size: int, cache_dtype: str) -> str | None:
    """The vLLM CPU attention ISA for this cache (None off the CPU build)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return str(_get_attn_isa(dtype, block_size, head_size, cache_dtype))


def _layout_tag(dtype: torch.dtype, block_size: int, head_size: int, cache_dtype: str) -> str:
    """Spec layout tag: ``vllm`` for canonical blocks; ``vllm-cpu-<isa>`` for CPU kernels whose
    in-block order is kept as is (not verified canonical), so those only match each other."""
    isa = cpu_isa(dtype, block_size, head_size, cache_dtype)
    return "vllm" if isa is None or isa in _K_DIM_MAJOR_ISAS else f"vllm-cpu-{isa}"


def scales_tag(spec: ModelSpec, vllm_config: Any, names: list[str]) -> str:
    """The layout tag part of a worker's fp8 KV scales (``spec``: its spec; ``names``: its attention
    layers): "" for a cache that is not fp8 or whose every layer's k and v scale is 1.0 (vLLM's default: the fingerprint is as before),
    else a hash of them all. Read from vLLM's attention layers once the weights are loaded.

    NOTE: fp8 bytes mean something only under their scales: a checkpoint's own scales (the same
    in every engine of that checkpoint) give the same tag, so engines share blocks; another
    checkpoint's, under the same model name, give another fingerprint, so no block of one is
    ever loaded by the other. Scales that cannot be read are refused (scales computed at run
    time are refused when the connector is built, see :func:`refuse_unsupported`)."""
    if spec.itemsize != 1:
        return ""
    layers = getattr(getattr(vllm_config, "compilation_config", None), "static_forward_context", None)
    scales = []
    for name in names:
        layer = (layers or {}).get(name)
        k, v = getattr(layer, "_k_scale", None), getattr(layer, "_v_scale", None)
        if k is None or v is None:
            raise InvalidArgument(f"kvstore connector: cannot read the fp8 KV scales (_k_scale, _v_scale) of "
                                  f"layer {name}: KV stored under other scales could not be told apart")
        scales += [torch.as_tensor(x).detach().to("cpu", torch.float32).reshape(-1) for x in (k, v)]
    flat = torch.cat(scales)
    if bool((flat == 1.0).all()):
        return ""
    return "kv_scales=" + hashlib.blake2b(flat.numpy().tobytes(), digest_size=8).hexdigest()

