"""Pure placement decisions over block metadata (DESIGN.md §4).

``policy`` never touches bytes or tensors: it sees :class:`kvstore.block.BlockMeta` records and
returns decisions. The Store owns the metadata and the mechanism; a policy only ranks and decides.
"""

from policy.base import POLICIES, EvictionPolicy, make_policy

__all__ = ["POLICIES", "EvictionPolicy", "make_policy"]
