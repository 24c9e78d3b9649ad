"""Recompute and restore costs of one KV block (DESIGN.md §4, issue 3).

Primitives:

* :class:`CostModelConfig` — rates (effective FLOP/s, bandwidth of every tier back to HBM) and
  the model sizes used when a :class:`~kvstore.spec.ModelSpec` leaves them at 0. Bounds are
  checked at construction; a bad value raises :class:`~kvstore.errors.InvalidArgument`.
* :class:`CostModel` — for one ModelSpec: prefill FLOPs of a block of ``n`` tokens at block
  position ``i`` (``depth``, 0 for a block without parent)::

      flops = 2·P·n + 4·L·d·n·(i·B + n/2)

  (P parameters, L layers, d hidden size, B tokens per block): the linear part plus the
  attention part, which grows with the block's position. Recompute time = flops / FLOP/s.
  Restore time = block bytes / bandwidth of the tier it comes back from (0 from HBM).
  ``saving(...)`` = recompute − restore, floored at 0 (an engine recomputes rather than restore
  a block that is slower to fetch than to compute).

Everything here is pure arithmetic over metadata; nothing touches bytes or tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvstore.block import Tier
from kvstore.errors import InvalidArgument
from kvstore.spec import ModelSpec

GB = 1e9


def _check_range(name: str, value: float, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument(f"CostModelConfig.{name} must be a number, got {value!r}")
    if not (low < value <= high):
        raise InvalidArgument(f"CostModelConfig.{name} must be in ({low:g}, {high:g}], got {value!r}")


@dataclass(frozen=True, slots=True)
class CostModelConfig:
    """Rates and fallback model sizes of the cost model."""

    flops_per_s: float = 400e12
    """Effective prefill throughput of the accelerator, FLOP/s (0, 1e18]."""
    dram_gbps: float = 25.0
    """DRAM → HBM restore bandwidth, GB/s (10^9 bytes/s), (0, 1e4]."""
    nvme_gbps: float = 5.0
    """NVMe → HBM restore bandwidth, GB/s, (0, 1e4]."""
    remote_gbps: float = 1.25
    """Remote (Redis/Valkey) → HBM restore bandwidth, GB/s, (0, 1e4]."""
    num_params: int = 8_000_000_000
    """Parameter count used when the ModelSpec's ``num_params`` is 0, (0, 1e14]."""
    hidden_size: int = 4096
    """Hidden size used when the ModelSpec's ``hidden_size`` is 0, (0, 1e6]."""

    def __post_init__(self) -> None:
        _check_range("flops_per_s", self.flops_per_s, 0.0, 1e18)
        for name in ("dram_gbps", "nvme_gbps", "remote_gbps"):
            _check_range(name, getattr(self, name), 0.0, 1e4)
        for name, high in (("num_params", 1e14), ("hidden_size", 1e6)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise InvalidArgument(f"CostModelConfig.{name} must be an int, got {value!r}")
            _check_range(name, value, 0, high)

    def bandwidth(self, tier: Tier) -> float:
        """Bytes/s from ``tier`` back to HBM; ``inf`` for HBM itself."""
        if tier == Tier.HBM:
            return float("inf")
        if tier == Tier.DRAM:
            return self.dram_gbps * GB
        if tier == Tier.NVME:
            return self.nvme_gbps * GB
        return self.remote_gbps * GB


class CostModel:
    """Costs of the blocks of one ModelSpec under one :class:`CostModelConfig`."""

    __slots__ = ("_bw", "config", "hidden_size", "num_params", "spec")

    def __init__(self, spec: ModelSpec, config: CostModelConfig | None = None) -> None:
        self.spec = spec
        self.config = config or CostModelConfig()
        self.num_params = spec.num_params or self.config.num_params
        self.hidden_size = spec.hidden_size or self.config.hidden_size
        self._bw = {tier: self.config.bandwidth(tier) for tier in Tier}

    @property
    def block_nbytes(self) -> int:
        return self.spec.block_nbytes

    def recompute_flops(self, tokens: int, depth: int) -> float:
        """Prefill FLOPs of a block of ``tokens`` tokens at block position ``depth`` (0-based)."""
        if tokens < 0 or depth < 0:
            raise InvalidArgument(f"tokens and depth must be >= 0, got {tokens}, {depth}")
        n = float(tokens)
        linear = 2.0 * self.num_params * n
        attention = 4.0 * self.spec.num_layers * self.hidden_size * n * (
            depth * self.spec.block_tokens + n / 2.0
        )
        return linear + attention

    def recompute_seconds(self, tokens: int, depth: int) -> float:
        return self.recompute_flops(tokens, depth) / self.config.flops_per_s

    def restore_seconds(self, nbytes: int, tier: Tier) -> float:
        """Seconds to bring ``nbytes`` back to HBM from ``tier`` (0 when already in HBM)."""
        return nbytes / self._bw[tier]

    def saving(self, tokens: int, depth: int, nbytes: int, tier: Tier) -> float:
        """Seconds saved by a hit in ``tier`` instead of recomputing; never negative."""
        return max(0.0, self.recompute_seconds(tokens, depth) - self.restore_seconds(nbytes, tier))


class CostModels:
    """One :class:`CostModel` per fingerprint, found through the Store's spec lookup.

    A block whose fingerprint the lookup does not know is costed with a Llama-3-8B-like
    fallback spec whose block size is the block's own token count.
    """

    __slots__ = ("_by_fp", "_fallback", "_lookup", "config")

    def __init__(self, spec_lookup: Callable[[bytes], ModelSpec | None] | None,
                 config: CostModelConfig | None = None) -> None:
        self._lookup = spec_lookup
        self.config = config or CostModelConfig()
        self._by_fp: dict[bytes, CostModel | None] = {}
        self._fallback: dict[int, CostModel] = {}

    def get(self, fingerprint: bytes, block_tokens: int) -> CostModel:
        model = self._by_fp.get(fingerprint)
        if model is None and fingerprint not in self._by_fp:
            spec = self._lookup(fingerprint) if self._lookup is not None else None
            model = CostModel(spec, self.config) if spec is not None else None
            self._by_fp[fingerprint] = model
        if model is not None:
            return model
        bt = max(1, block_tokens)
        fb = self._fallback.get(bt)
        if fb is None:
            spec = ModelSpec(model="unknown", revision="", num_layers=32, num_kv_heads=8,
                             head_dim=128, block_tokens=bt)
            fb = self._fallback[bt] = CostModel(spec, self.config)
        return fb
