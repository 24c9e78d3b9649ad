"""kvstore: a tiered KV-cache store for LLM inference.

Public surface::

    from kvstore import Store, StoreConfig, ModelSpec

Names are resolved lazily (PEP 562) so that the data-model modules can be imported by
``tiers`` and ``policy`` without importing the Store (which imports them).
"""

from __future__ import annotations

from typing import Any

__all__ = ["LookupResult", "ModelSpec", "SessionState", "Store", "StoreConfig", "Tier"]
__version__ = "0.1.0"

_LAZY = {
    "Store": "kvstore.store",
    "LookupResult": "kvstore.store",
    "StoreConfig": "kvstore.config",
    "ModelSpec": "kvstore.spec",
    "Tier": "kvstore.block",
    "SessionState": "kvstore.block",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvstore' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
