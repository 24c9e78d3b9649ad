"""Request validation and conversion between ``kvstore.v1`` messages and Python values.

Pure functions, no gRPC and no Store: each one either returns a validated value or raises
:class:`kvstore.errors.InvalidArgument` with a message naming what is wrong (or the limit).

* specs: :func:`spec_from_pb` / :func:`spec_to_pb`
* keys: :func:`split_keys` (packed 32-byte keys -> list), :func:`parent_from_pb`
* tiers: :func:`tier_codes` (tier names -> one byte per block), :func:`tier_names` (back),
  :func:`tier_from_pb` / :func:`tier_to_pb` (single enum values)
* shared-memory slots: :func:`check_slots`
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from itertools import groupby, pairwise

from kvstore.block import Tier
from kvstore.errors import InvalidArgument
from kvstore.keys import KEY_BYTES, PackedKeys
from kvstore.spec import ModelSpec
from proto.kvstore.v1 import kvstore_pb2 as pb

_SPEC_DEFAULTED = ("dtype", "block_tokens", "layout", "tp_size")
_SPEC_FIELDS = tuple(f.name for f in pb.ModelSpec.DESCRIPTOR.fields)
#: wire value of a tier (the ``Tier`` enum of kvstore.proto): Tier + 1, 0 = unspecified
_CODE_OF = {t.label: int(t) + 1 for t in Tier}
_NAME_OF = {int(t) + 1: t.label for t in Tier}
#: byte -> tier name, for decoding ``tier_codes`` (unknown bytes decode to "")
_NAMES = [_NAME_OF.get(i, "") for i in range(256)]


def spec_from_pb(msg: pb.ModelSpec, present: bool = True) -> ModelSpec:
    """A validated ModelSpec; zero/empty defaulted fields take ModelSpec's defaults."""
    if not present:
        raise InvalidArgument("a model spec is required")
    # NOTE: every call names its spec; building and fingerprinting one costs ~0.1 ms, a tenth
    # of an 8,192-key Lookup, and an engine sends the same few specs over and over
    return _spec_from_wire(msg.SerializeToString(deterministic=True))


@lru_cache(maxsize=256)
def _spec_from_wire(wire: bytes) -> ModelSpec:
    """ModelSpec is immutable: one instance per distinct message (errors are not cached)."""
    msg = pb.ModelSpec.FromString(wire)
    data = {name: getattr(msg, name) for name in _SPEC_FIELDS}
    for name in _SPEC_DEFAULTED:
        if not data[name]:
            del data[name]
    return ModelSpec.from_dict(data)


def spec_to_pb(spec: ModelSpec) -> pb.ModelSpec:
    return pb.ModelSpec(**{name: getattr(spec, name) for name in _SPEC_FIELDS})


def packed_keys(packed: bytes, limit: int) -> PackedKeys:
    """Packed 32-byte keys left packed (a lookup reads only the few it probes); InvalidArgument
    on a ragged buffer or past ``limit``."""
    keys = PackedKeys(packed)
    if len(keys) > limit:
        raise InvalidArgument(f"{len(keys)} keys exceed limits.max_keys_per_call={limit}")
    return keys


def split_keys(packed: bytes, limit: int) -> list[bytes]:
    """Packed 32-byte keys -> list of ``bytes``; InvalidArgument on a ragged buffer or past ``limit``."""
    return packed_keys(packed, limit)[:]


def parent_from_pb(parent: bytes) -> bytes | None:
    """The ``parent`` of a Target: None when empty, else exactly one key."""
    if not parent:
        return None
    if len(parent) != KEY_BYTES:
        raise InvalidArgument(f"parent must be one {KEY_BYTES}-byte key, got {len(parent)} bytes")
    return bytes(parent)


def tier_codes(names: Sequence[str]) -> bytes:
    """Tier names (``"hbm"``...) -> one byte per block (the proto ``Tier`` value)."""
    # NOTE: by runs: along a prefix the tier changes a few times at most (often never), and
    # converting runs costs a fraction of a per-name map for 8,192 blocks (any order works).
    if names and names.count(names[0]) == len(names):
        return bytes((_CODE_OF[names[0]],)) * len(names)
    return b"".join(bytes((_CODE_OF[name],)) * len(list(run)) for name, run in groupby(names))


def tier_names(codes: bytes) -> list[str]:
    """Inverse of :func:`tier_codes` (an unknown byte decodes to ``""``)."""
    if codes and codes.count(codes[:1]) == len(codes):
        return [_NAMES[codes[0]]] * len(codes)
    names: list[str] = []
    for code, run in groupby(codes):
        names += [_NAMES[code]] * len(list(run))
    return names


def tier_to_pb(tier: str | Tier) -> int:
    return int(Tier.parse(tier)) + 1


def tier_from_pb(value: int, default: Tier = Tier.HBM) -> Tier:
    if value == pb.TIER_UNSPECIFIED:
        return default
    try:
        return Tier(value - 1)
    except ValueError:
        raise InvalidArgument(f"unknown tier {value}") from None


def check_slots(offsets: Sequence[int], nbytes: int, n: int) -> None:
    """One offset per key and no two slots of ``nbytes`` overlapping (range is the region's job)."""
    if len(offsets) != n:
        raise InvalidArgument(f"{len(offsets)} offsets for {n} keys: send one per key")
    ordered = sorted(offsets)
    for a, b in pairwise(ordered):
        if b - a < nbytes:
            raise InvalidArgument(f"slots at {a} and {b} overlap (block is {nbytes} bytes)")
