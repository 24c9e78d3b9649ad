"""HF transformers adapter: prefix KV of a ``DynamicCache`` saved to and restored from kvstore.

Needs ``transformers`` (``pip install 'kvstore[hf]'``); works on 4.5x and 5.x.

Primitives and what each guarantees:

* :func:`spec_from_config` — a :class:`~kvstore.spec.ModelSpec` from a model config: layers, KV
  heads, head dim, dtype, RoPE parameters. Refuses caches the block layout cannot hold (sliding
  window / hybrid attention, MLA) with ``InvalidArgument``.
* :class:`PrefixCache.save` — writes every *full* block of a prompt's KV (the tokens the cache
  holds, in units of ``spec.block_tokens``) under the chained block keys of the token prefix.
  Blocks already stored are not sent again. The KV is copied bit for bit (same dtype, no cast).
* :class:`PrefixCache.restore` — the longest stored prefix of a new prompt as a fresh
  ``DynamicCache``, bit-identical to what was saved, always leaving at least one prompt token
  uncached (so the model computes the logits of the last prompt token). A miss gives no cache.
* :class:`PrefixCache.generate` — restore, ``model.generate`` on the whole prompt (only the
  uncached suffix is prefilled), then save the new full blocks. A store that fails or does not
  answer (any error but a bad argument) costs the reuse, not the generation: the restore is a
  miss and the save is skipped, each logged. ``save`` and ``restore`` called directly raise.
  Calls the store cannot serve exactly are generated without it (no restore, no save; the
  reason in ``Generation.bypassed``, logged once at info): an ``attention_mask`` with a zero
  (padding or holes: blocks are keyed by token ids alone, and KV computed under one mask is not
  the KV of another), and beam search or several return sequences (the cache holds one row
  per beam or sequence, and row 0 need not be the sequence returned). A cache must not change
  what ``model.generate`` returns, so these are not refused either.

NOTE: keys are stored after RoPE, so a block is only valid at its position after exactly its
prefix: the block key is the *chained* key over the full token prefix (``block_keys`` of the
whole prompt), never a key of the block's own tokens.

NOTE: transformers API differences handled here: per-layer tensors are
``cache.layers[i].keys/.values`` from 4.54 on (``cache.key_cache[i]`` before); the forward
argument ``past_key_values`` became ``cache`` in 5.x (detected from the forward signature, as is
the output attribute); ``cache.update(k, v, layer_idx)`` builds a cache on every version. The
adapter never crops a cache (cropping to 0 tokens breaks some versions): it builds new ones.

Targets: anything with the :class:`KVTarget` verbs — :class:`kvstore.client.Client` as is, or an
in-process :class:`~kvstore.store.Store` bound to a tenant with :class:`TenantStore`.
"""

from __future__ import annotations

import inspect
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

try:
    import transformers
    from transformers import DynamicCache
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("kvstore.integrations.hf needs transformers: pip install 'kvstore[hf]'") from exc
from packaging.version import Version

from kvstore.errors import DTypeMismatch, InvalidArgument, KVStoreError, NotFound, ShapeMismatch
from kvstore.keys import as_token_array
from kvstore.spec import DTYPES, ModelSpec

log = logging.getLogger(__name__)

#: transformers 4.54 moved per-layer tensors from ``key_cache[i]`` to ``layers[i].keys``.
_LAYERED_CACHE = Version(transformers.__version__).release >= (4, 54)


# -- targets ----------------------------------------------------------------------------------
class _Hit(Protocol):
    num_blocks: int
    tiers: list[str]


class KVTarget(Protocol):
    """The verbs the adapter uses; :class:`kvstore.client.Client` has them as is."""

    def block_keys(self, spec: ModelSpec, token_ids: Any) -> list[bytes]: ...

    def lookup(self, spec: ModelSpec, keys: Sequence[bytes], *, parent: bytes | None = None) -> _Hit: ...

    def put(self, spec: ModelSpec, keys: Sequence[bytes], kv: Any, *,
            parent: bytes | None = None) -> None: ...

    def get(self, spec: ModelSpec, keys: Sequence[bytes], *, parent: bytes | None = None) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class TenantStore:
    """An in-process :class:`~kvstore.store.Store` seen as one tenant's :class:`KVTarget`."""

    store: Any
    tenant: str

    def block_keys(self, spec: ModelSpec, token_ids: Any) -> list[bytes]:
        return self.store.block_keys(self.tenant, spec, token_ids)

    def lookup(self, spec: ModelSpec, keys: Sequence[bytes], *, parent: bytes | None = None) -> _Hit:
        return self.store.lookup(self.tenant, spec, keys, parent=parent)

    def put(self, spec: ModelSpec, keys: Sequence[bytes], kv: Any, *, parent: bytes | None = None) -> None:
        self.store.put(self.tenant, spec, keys, kv, parent=parent)

    def get(self, spec: ModelSpec, keys: Sequence[bytes], *, parent: bytes | None = None) -> torch.Tensor:
        return self.store.get(self.tenant, spec, keys, parent=parent)


# -- spec -------------------------------------------------------------------------------------
def _dtype_name(dtype: Any) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise InvalidArgument(f"KV dtype {dtype!r} is not supported; use one of {sorted(DTYPES)}")
    return name


def _rope_description(cfg: Any) -> str:
    """Canonical JSON of the RoPE parameters (5.x ``rope_parameters``; 4.x theta + scaling)."""
    params = getattr(cfg, "rope_parameters", None)
    if params is None:
        params = {"rope_theta": getattr(cfg, "rope_theta", None),
                  "rope_scaling": getattr(cfg, "rope_scaling", None)}
    return json.dumps(params, sort_keys=True, default=str, separators=(",", ":"))


def _check_full_attention(cfg: Any) -> None:
    kinds = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    # NOTE: Mistral and Phi-3 configs say sliding-window attention with ``sliding_window`` alone
    # (no layer_types, no use_sliding_window); Qwen2 sets a window and use_sliding_window=False
    window = getattr(cfg, "sliding_window", None)
    if window and getattr(cfg, "use_sliding_window", True):
        kinds.add("sliding_attention")
    if kinds != {"full_attention"} or getattr(cfg, "use_sliding_window", False):
        raise InvalidArgument(f"only full-attention models are supported, got layer types "
                              f"{sorted(kinds)} (sliding-window caches drop old tokens)")
    if getattr(cfg, "kv_lora_rank", None):
        raise InvalidArgument("MLA (latent KV) caches are not supported by the HF adapter")


def spec_from_config(model_config: Any, dtype: Any, block_tokens: int = 16, *,
                     model: str | None = None, revision: str = "", tokenizer_hash: str = "",
                     adapter: str = "", num_params: int = 0) -> ModelSpec:
    """The :class:`ModelSpec` of a transformers model's KV cache.

    ``dtype``: the KV dtype (a ``torch.dtype`` or a name such as ``"float16"``): the dtype the
    model computes in, since blocks are stored without casting. ``model``: a stable model id
    (default: the config's ``name_or_path`` — pass one explicitly when the model was loaded
    from a local path; a model built from a config alone has none, and is refused without
    one). Give ``revision`` and ``tokenizer_hash`` so that other weights or tokenizers never
    share blocks."""
    cfg = model_config.get_text_config()
    _check_full_attention(cfg)
    heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    dtype_name = _dtype_name(dtype)
    name = model or getattr(model_config, "name_or_path", "")
    if not name:
        # NOTE: fell back to model_type: every config-built llama was "llama", and one model's
        # generate() restored another's KV (same fingerprint, other weights)
        raise InvalidArgument("spec_from_config: the model config has no name_or_path (a model "
                              "built from a config): pass model= a stable id of these weights")
    return ModelSpec(model=name, revision=revision, num_layers=int(cfg.num_hidden_layers),
                     num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype_name,
                     block_tokens=block_tokens, tokenizer_hash=tokenizer_hash,
                     rope_scaling=_rope_description(cfg), adapter=adapter,
                     num_params=num_params, hidden_size=int(cfg.hidden_size))


# -- transformers version differences -----------------------------------------------------------
def layer_kv(cache: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[batch, kv_heads, tokens, head_dim]`` of one layer of a cache."""
    if _LAYERED_CACHE:
        entry = cache.layers[layer]
        return entry.keys, entry.values
    return cache.key_cache[layer], cache.value_cache[layer]


def cache_argument(model: Any) -> str:
    """The name of the forward/generate argument taking the cache (``cache`` from 5.x)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def output_cache(output: Any) -> Any:
    """The cache of a model output (``.cache`` from 5.x, ``.past_key_values`` before)."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


def forward(model: Any, input_ids: torch.Tensor, cache: Any | None) -> Any:
    """``model(input_ids, cache)`` under ``no_grad`` with the cache argument of this version;
    ``cache`` (extended in place) may be None, then a fresh ``DynamicCache`` is used."""
    cache = DynamicCache() if cache is None else cache
    with torch.no_grad():
        return model(input_ids=input_ids, use_cache=True, **{cache_argument(model): cache})


# -- blocks <-> cache -------------------------------------------------------------------------
def blocks_from_cache(cache: Any, spec: ModelSpec, start: int, stop: int, *,
                      device: str | torch.device = "cpu") -> torch.Tensor:
    """Blocks ``start..stop`` of a batch-1 cache as ``[n, 2, L, H, T, D]`` on ``device`` (a copy)."""
    L, H, T, D = spec.num_layers, spec.num_kv_heads, spec.block_tokens, spec.head_dim
    if len(cache) != L:
        raise ShapeMismatch(f"the cache has {len(cache)} layers, the spec {L}")
    n = stop - start
    out = torch.empty((n, 2, L, H, T, D), dtype=spec.torch_dtype, device=device)
    for layer in range(L):
        for j, t in enumerate(layer_kv(cache, layer)):
            if t.dtype != spec.torch_dtype:
                raise DTypeMismatch(f"the cache holds {t.dtype}, the spec says {spec.torch_dtype}")
            if t.shape[0] != 1 or t.shape[1] != H or t.shape[3] != D or t.shape[2] < stop * T:
                raise ShapeMismatch(f"layer {layer} has shape {tuple(t.shape)}, expected "
                                    f"[1, {H}, >= {stop * T}, {D}]")
            seg = t[0, :, start * T : stop * T, :].reshape(H, n, T, D)
            out[:, j, layer].copy_(seg.transpose(0, 1))
    return out


def cache_from_blocks(kv: torch.Tensor, spec: ModelSpec, *,
                      device: str | torch.device | None = None) -> Any:
    """A new batch-1 ``DynamicCache`` holding blocks ``[n, 2, L, H, T, D]`` (n >= 1), bit-exact."""
    n = kv.shape[0]
    if n < 1 or tuple(kv.shape[1:]) != spec.block_shape:
        raise ShapeMismatch(f"kv has shape {tuple(kv.shape)}, expected [n >= 1, {spec.block_shape}]")
    H, T, D = spec.num_kv_heads, spec.block_tokens, spec.head_dim
    kv = kv.to(device) if device is not None else kv
    cache = DynamicCache()
    for layer in range(spec.num_layers):
        k = kv[:, 0, layer].transpose(0, 1).reshape(1, H, n * T, D)
        v = kv[:, 1, layer].transpose(0, 1).reshape(1, H, n * T, D)
        cache.update(k, v, layer)
    return cache


# -- the adapter ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Saved:
    """``num_blocks`` full blocks of the prompt are stored; ``new_blocks`` of them were sent now."""

    num_blocks: int
    new_blocks: int


@dataclass(frozen=True, slots=True)
class Restored:
    """``cache`` holds the KV of the first ``num_tokens`` prompt tokens (None on a miss);
    ``tiers[i]`` is the tier block i came from."""

    cache: Any | None
    num_tokens: int
    tiers: list[str]


@dataclass(frozen=True, slots=True)
class Generation:
    """``sequences`` as ``model.generate`` returns them; ``reused_tokens`` came from the store;
    ``cache`` holds the KV of the sequence (all but its last token), to continue from;
    ``bypassed`` says why the store was not used for this call ("" when it was)."""

    sequences: torch.Tensor
    reused_tokens: int
    saved: Saved
    cache: Any
    bypassed: str = ""


def _token_list(token_ids: Any) -> list[int]:
    """The prompt's token ids: one sequence, or a batch of one ([1, n]: tensor, array or nested
    list). NOTE: each was passed through ``int()``: float ids were truncated and string ids
    parsed (a prompt served the KV of other tokens), and a batch gave a raw TypeError."""
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.detach().cpu().numpy()
    try:
        arr = np.asarray(token_ids)
    except ValueError:  # ragged nesting
        raise InvalidArgument("token_ids must be one sequence of integers (or a batch of one)") from None
    if arr.ndim == 2:
        if arr.shape[0] != 1:
            raise InvalidArgument(f"only batch size 1 is supported, got {arr.shape[0]}")
        arr = arr[0]
    return as_token_array(arr).tolist()


def _bypass_reason(model: Any, generate_kwargs: dict[str, Any]) -> str:
    """Why ``generate`` with these arguments must not restore or save ("" when it may); see
    the module docstring. Decided before generating, so that a finished generation is never
    lost to a save that cannot take its cache."""
    mask = generate_kwargs.get("attention_mask")
    if mask is not None and bool((torch.as_tensor(mask) == 0).any()):
        return "attention_mask has zeros (padding or holes)"
    config = generate_kwargs.get("generation_config") or getattr(model, "generation_config", None)
    for name in ("num_beams", "num_return_sequences"):
        value = generate_kwargs.get(name, getattr(config, name, 1))
        if value is not None and value > 1:
            return f"{name}={value} (one cache row per beam or sequence)"
    return ""


class PrefixCache:
    """Save and restore prompt-prefix KV of one model through a :class:`KVTarget`.

    ``device``: where restored caches live (the model's device). ``stage_device``: where blocks
    are assembled for ``put`` (``"cpu"`` suits both the Store and the gRPC client)."""

    def __init__(self, target: KVTarget, spec: ModelSpec, *, device: str | torch.device | None = None,
                 stage_device: str | torch.device = "cpu") -> None:
        self.target = target
        self.spec = spec
        self.device = device
        self.stage_device = stage_device
        self._bypasses_logged: set[str] = set()

    def save(self, token_ids: Any, cache: Any) -> Saved:
        """Store every full block of ``token_ids`` that ``cache`` holds (batch 1).

        ``cache`` must hold the KV of ``token_ids``' first ``cache.get_seq_length()`` tokens."""
        tokens = _token_list(token_ids)
        if not callable(getattr(cache, "get_seq_length", None)):  # NOTE: None gave an AttributeError
            raise InvalidArgument(f"cache must be a transformers Cache (model outputs' past_key_values), "
                                  f"got {type(cache).__name__}")
        T = self.spec.block_tokens
        total = min(len(tokens), cache.get_seq_length()) // T
        if total == 0:
            return Saved(0, 0)
        keys = self.target.block_keys(self.spec, tokens[: total * T])
        have = min(self.target.lookup(self.spec, keys).num_blocks, total)
        if have == total:
            return Saved(total, 0)
        kv = blocks_from_cache(cache, self.spec, have, total, device=self.stage_device)
        try:
            self.target.put(self.spec, keys[have:], kv, parent=keys[have - 1] if have else None)
        except NotFound:  # the stored prefix went away since the lookup: send the whole chain
            kv = blocks_from_cache(cache, self.spec, 0, total, device=self.stage_device)
            self.target.put(self.spec, keys, kv)
            have = 0
        return Saved(total, total - have)

    def restore(self, token_ids: Any, *, device: str | torch.device | None = None) -> Restored:
        """The longest stored prefix of ``token_ids`` as a new cache, leaving >= 1 token uncached;
        on ``device`` (default: the adapter's ``device``, else where the target returns blocks)."""
        tokens = _token_list(token_ids)
        T = self.spec.block_tokens
        usable = max(len(tokens) - 1, 0) // T  # NOTE: the last prompt token is always computed
        if usable == 0:
            return Restored(None, 0, [])
        keys = self.target.block_keys(self.spec, tokens[: usable * T])
        hit = self.target.lookup(self.spec, keys)
        if hit.num_blocks == 0:
            return Restored(None, 0, [])
        kv = self.target.get(self.spec, keys[: hit.num_blocks])
        n = int(kv.shape[0])  # may be shorter than the lookup said (evicted in between)
        if n == 0:
            return Restored(None, 0, [])
        return Restored(cache_from_blocks(kv, self.spec, device=device or self.device), n * T,
                        list(hit.tiers[:n]))

    def generate(self, model: Any, input_ids: torch.Tensor, *, save: bool = True,
                 **generate_kwargs: Any) -> Generation:
        """Restore the prompt's stored prefix, ``model.generate`` from it (batch 1), and save
        the full blocks of the whole sequence (prompt and generated tokens) if ``save``.

        With a padded ``attention_mask`` or several beams or return sequences this is plain
        ``model.generate``: no restore, no save (``Generation.bypassed`` says why)."""
        bypassed = _bypass_reason(model, generate_kwargs)
        if bypassed:
            if bypassed not in self._bypasses_logged:
                self._bypasses_logged.add(bypassed)
                log.info("kvstore not used by generate (no restore, no save): %s", bypassed)
            restored = Restored(None, 0, [])
        else:
            try:
                restored = self.restore(input_ids, device=self.device or model.device)
            except InvalidArgument:
                raise
            except KVStoreError as exc:
                log.warning("kvstore restore failed, prefilling the whole prompt: %s", exc)
                restored = Restored(None, 0, [])
        cache = restored.cache if restored.cache is not None else DynamicCache()
        kwargs = {cache_argument(model): cache, "use_cache": True, **generate_kwargs}
        with torch.no_grad():
            out = model.generate(input_ids, return_dict_in_generate=True, **kwargs)
        sequences, cache = out.sequences, output_cache(out)
        saved = Saved(0, 0)
        if save and not bypassed:
            try:
                saved = self.save(sequences, cache)
            except InvalidArgument:
                raise
            except KVStoreError as exc:
                log.warning("kvstore save failed, the blocks of this sequence are not stored: %s", exc)
        return Generation(sequences, restored.num_tokens, saved, cache, bypassed)
