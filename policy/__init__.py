"""Pure placement decisions over block metadata (DESIGN.md §4).

``policy`` never touches bytes or tensors: it sees :class:`kvstore.block.BlockMeta` records and
returns decisions. The Store owns the metadata and the mechanism; a policy only ranks and decides.
"""

from policy.base import EvictionPolicy, make_policy, POLICIES

__all__ = ["EvictionPolicy", "make_policy", "POLICIES"]
