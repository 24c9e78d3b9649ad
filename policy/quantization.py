"""Which lossy format, if any, a block is stored in on the NVMe (and remote) tier.

A pure decision over metadata: :meth:`QuantizationPolicy.for_block` maps a block's tenant and
model spec to a :class:`~kvstore.quantization.Quantization` or None (lossless); the Store passes
the answer to the codec (``encode_into(..., quant=)``) when it writes the block to NVMe. HBM and
DRAM always hold the exact bytes; a block restored from a quantized NVMe copy holds its
dequantized values from then on.

Default: lossless. Quantization is opt-in, by rules at four levels; the most specific wins:

    1. (tenant, model fingerprint)
    2. tenant            -- a tenant's choice, including an explicit "lossless" (None),
                            overrides a model-wide rule
    3. model fingerprint -- e.g. an operator quantizes every block of one large model
    4. the default       (StoreConfig; None unless configured)

Whatever the rules say, blocks the codec cannot usefully quantize (1-byte dtypes such as fp8
KV, or blocks so short that the scales outweigh the saving) are answered None, so the codec's own
fallback is never relied on for those.

Measured effect (bench/results/kv_accuracy.md, SmolLM2-135M, 16-token blocks): top-1 agreement
98.9 % int8 / 96.8 % fp8 with per-channel keys, perplexity +0.29 % / +0.56 %; the stored block is
~53 % of its fp16 size before compression.

Not thread-safe: the Store owns it and calls it under its lock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvstore.errors import InvalidArgument
from kvstore.quantization import QuantArg, Quantization, as_quantization, worth_it
from kvstore.spec import FINGERPRINT_BYTES, ModelSpec


@dataclass(frozen=True, slots=True)
class QuantRule:
    """One rule: ``tenant`` and/or ``model`` (None = any) -> ``quant`` (None = lossless)."""

    tenant: str | None
    model: bytes | None
    quant: Quantization | None


@dataclass(slots=True)
class QuantizationPolicy:
    """Rules from (tenant, model fingerprint) to a storage format; see the module docstring."""

    default: Quantization | None = None
    """Format of blocks no rule matches; None = lossless."""
    _rules: dict[tuple[str | None, bytes | None], Quantization | None] = field(
        default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.default = as_quantization(self.default)

    @classmethod
    def from_names(cls, default: str = "none", tenants: dict[str, str] | None = None,
                   models: dict[bytes, str] | None = None) -> QuantizationPolicy:
        """Build from format names (``"none"``, ``"int8"``, ``"fp8_e4m3/head"``, ...), as a
        config file or CLI gives them. InvalidArgument for an unknown name."""
        policy = cls(Quantization.parse(default))
        for tenant, name in (tenants or {}).items():
            policy.set(Quantization.parse(name), tenant=tenant)
        for model, name in (models or {}).items():
            policy.set(Quantization.parse(name), model=model)
        return policy

    # -- rules ------------------------------------------------------------------------------
    def set(self, quant: QuantArg, *, tenant: str | None = None, model: bytes | None = None) -> None:
        """Store blocks of ``tenant`` and/or ``model`` (a spec fingerprint) as ``quant`` (None:
        lossless, which also overrides less specific rules). Neither: sets the default."""
        q = as_quantization(quant)
        _check(tenant, model)
        if tenant is None and model is None:
            self.default = q
        else:
            self._rules[(tenant, model)] = q

    def clear(self, *, tenant: str | None = None, model: bytes | None = None) -> bool:
        """Remove the rule for exactly this (tenant, model); True if there was one. Neither:
        resets the default to lossless."""
        _check(tenant, model)
        if tenant is None and model is None:
            had, self.default = self.default is not None, None
            return had
        key = (tenant, model)
        if key not in self._rules:
            return False
        del self._rules[key]
        return True

    def forget_tenant(self, tenant: str) -> int:
        """Drop every rule naming ``tenant`` (when the tenant is deleted); returns how many."""
        return self._forget(lambda t, _m: t == tenant)

    def forget_model(self, model: bytes) -> int:
        """Drop every rule naming ``model`` (when the model is purged); returns how many."""
        return self._forget(lambda _t, m: m == model)

    def rules(self) -> list[QuantRule]:
        """Every rule, most specific first (then by tenant, model) -- for stats and audits."""
        def order(item: tuple[tuple[str | None, bytes | None], Quantization | None]
                  ) -> tuple[int, str, bytes]:
            (t, m), _ = item
            return (_rank(t, m), t or "", m or b"")

        return [QuantRule(t, m, q) for (t, m), q in sorted(self._rules.items(), key=order)]

    # -- decision ---------------------------------------------------------------------------
    def for_block(self, tenant: str, spec: ModelSpec) -> Quantization | None:
        """The format a block of ``tenant`` and ``spec`` is stored in on NVMe (None: lossless)."""
        fp = spec.fingerprint
        rules = self._rules
        for k in ((tenant, fp), (tenant, None), (None, fp)):
            if k in rules:
                q = rules[k]
                break
        else:
            q = self.default
        return q if q is not None and worth_it(spec, q) else None

    def _forget(self, match: Callable[[str | None, bytes | None], bool]) -> int:
        gone = [k for k in self._rules if match(*k)]
        for k in gone:
            del self._rules[k]
        return len(gone)


def _rank(tenant: str | None, model: bytes | None) -> int:
    return 0 if tenant is not None and model is not None else 1 if tenant is not None else 2


def _check(tenant: str | None, model: bytes | None) -> None:
    if tenant is not None and (not isinstance(tenant, str) or not tenant):
        raise InvalidArgument("tenant must be a non-empty string")
    if model is not None and (not isinstance(model, bytes) or len(model) != FINGERPRINT_BYTES):
        raise InvalidArgument(f"model must be a {FINGERPRINT_BYTES}-byte spec fingerprint")


__all__ = ["QuantRule", "QuantizationPolicy"]
