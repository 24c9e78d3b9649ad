"""ModelSpec: everything that makes two KV blocks interchangeable, and its fingerprint.

Block layout (one block = K and V of ``block_tokens`` tokens, all layers of one model shard)::

    [2, num_layers, num_kv_heads, block_tokens, head_dim]

The fingerprint is a stable hash of a canonical JSON encoding of every field, identical in
every process and across restarts; blocks of different fingerprints never mix.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from kvstore.errors import InvalidArgument

#: dtype names accepted in a spec -> (torch attribute name, itemsize). "float8" means e4m3fn.
#: The ``fnuz`` variants are AMD's (MI300: vLLM's "fp8" KV cache on ROCm): the same byte means
#: another number there (no negative zero, exponent bias one more), so they are dtypes of
#: their own, never keyed as e4m3fn/e5m2.
DTYPES: dict[str, tuple[str, int]] = {
    "float16": ("float16", 2),
    "bfloat16": ("bfloat16", 2),
    "float32": ("float32", 4),
    "float8": ("float8_e4m3fn", 1),
    "float8_e4m3fn": ("float8_e4m3fn", 1),
    "float8_e5m2": ("float8_e5m2", 1),
    "float8_e4m3fnuz": ("float8_e4m3fnuz", 1),
    "float8_e5m2fnuz": ("float8_e5m2fnuz", 1),
}

FINGERPRINT_BYTES = 16


def check_fingerprint(fingerprint: Any) -> bytes:
    """``fingerprint`` when it is the ``FINGERPRINT_BYTES`` bytes of a ``ModelSpec.fingerprint``,
    else InvalidArgument naming the field (the Store and the Admin plane both check with it)."""
    if not isinstance(fingerprint, bytes) or len(fingerprint) != FINGERPRINT_BYTES:
        got = f"{len(fingerprint)} bytes" if isinstance(fingerprint, bytes) else type(fingerprint).__name__
        raise InvalidArgument(f"fingerprint must be {FINGERPRINT_BYTES} bytes (ModelSpec.fingerprint, as "
                              f"`kvstore model list` shows it), got {got}")
    return fingerprint


#: the largest block a spec may describe (K and V of all layers of block_tokens tokens)
MAX_BLOCK_BYTES = 16 << 30

@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Identity and shape of one model shard's KV cache.

    Attributes:
        model: model id (e.g. ``"meta-llama/Llama-3.1-8B"``).
        revision: weights revision; a new revision is a new fingerprint.
        num_layers: attention layers in this shard.
        num_kv_heads: KV heads in this shard (after TP split); 1 for MLA latent caches.
        head_dim: head dimension (or the MLA latent dimension).
        dtype: KV dtype name, one of :data:`DTYPES`.
        block_tokens: tokens per block.
        tokenizer_hash: hash of the tokenizer; different tokenizers never share blocks.
        layout: free-form engine layout tag (e.g. ``"nhd"``); part of the fingerprint.
        rope_scaling: position/RoPE scaling description; part of the fingerprint.
        adapter: LoRA adapter id, or ``""``.
        tp_rank / tp_size: tensor-parallel rank and world size of this shard.
        num_params: parameter count (for the recompute cost model); 0 = unknown.
        hidden_size: model hidden size (for the cost model); 0 = unknown.
    """

    model: str
    revision: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float16"
    block_tokens: int = 16
    tokenizer_hash: str = ""
    layout: str = "kv_lhtd"
    rope_scaling: str = ""
    adapter: str = ""
    tp_rank: int = 0
    tp_size: int = 1
    num_params: int = 0
    hidden_size: int = 0
    _fingerprint: bytes = field(init=False, repr=False, compare=False, default=b"")
    _nbytes: int = field(init=False, repr=False, compare=False, default=0)

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise InvalidArgument("ModelSpec.model must be a non-empty string")
        if not isinstance(self.revision, str):
            raise InvalidArgument("ModelSpec.revision must be a string")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_tokens", "tp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InvalidArgument(f"ModelSpec.{name} must be a positive int, got {value!r}")
        for name in ("tp_rank", "num_params", "hidden_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidArgument(f"ModelSpec.{name} must be a non-negative int, got {value!r}")
        if self.tp_rank >= self.tp_size:
            raise InvalidArgument(f"ModelSpec.tp_rank {self.tp_rank} must be < tp_size {self.tp_size}")
        if self.dtype not in DTYPES:
            raise InvalidArgument(
                f"ModelSpec.dtype {self.dtype!r} is not supported; use one of {sorted(DTYPES)}"
            )
        fp = hashlib.blake2b(self.canonical(), digest_size=FINGERPRINT_BYTES,
                             person=b"kvstore-spec-v1").digest()
        object.__setattr__(self, "_fingerprint", fp)
        # NOTE: read on every block of every put/get: computed once, like the fingerprint
        object.__setattr__(self, "_nbytes", 2 * self.num_layers * self.num_kv_heads
                           * self.block_tokens * self.head_dim * DTYPES[self.dtype][1])
        if self._nbytes > MAX_BLOCK_BYTES:  # NOTE: a typo (block_tokens=1<<40) was taken as a spec
            raise InvalidArgument(f"a block of this ModelSpec would be {self._nbytes} bytes, more than "
                                  f"{MAX_BLOCK_BYTES} (16 GiB): check num_layers, num_kv_heads, head_dim "
                                  f"and block_tokens")

    # -- identity ---------------------------------------------------------------------------
    def canonical(self) -> bytes:
        """Canonical encoding: sorted-key JSON of every field, with the dtype normalised."""
        fields = self.to_dict()
        fields["dtype"] = DTYPES[self.dtype][0]
        return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()

    @property
    def fingerprint(self) -> bytes:
        """16-byte stable hash of :meth:`canonical` (computed once, at construction)."""
        return self._fingerprint

    # -- shape ------------------------------------------------------------------------------
    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (2, self.num_layers, self.num_kv_heads, self.block_tokens, self.head_dim)

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype][1]

    @property
    def block_nbytes(self) -> int:
        return self._nbytes

    @property
    def torch_dtype(self) -> Any:
        import torch  # local: the data model itself does not need torch

        return getattr(torch, DTYPES[self.dtype][0])

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelSpec:
        known = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = set(data) - known
        if unknown:
            raise InvalidArgument(f"unknown ModelSpec fields: {sorted(unknown)}")
        try:
            return cls(**data)
        except TypeError as exc:
            raise InvalidArgument(f"bad ModelSpec: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}


def check_spec(spec: Any) -> ModelSpec:
    """``spec``, or InvalidArgument when it is not a ModelSpec (a model name, None: the Store
    and the Client both check it first; it failed later as an AttributeError)."""
    if not isinstance(spec, ModelSpec):
        raise InvalidArgument(f"spec must be a ModelSpec, got {type(spec).__name__}")
    return spec
