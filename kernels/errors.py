"""The root of kvstore's typed errors, and the ones the kernels raise.

They live here, at the bottom of the import order (DESIGN.md §1: ``kernels`` ← the data
model ← ...), so that the kernels raise typed errors without importing ``kvstore``;
:mod:`kvstore.errors` re-exports them beside the rest of the hierarchy, and callers keep
importing them from there.
"""

from __future__ import annotations


class KVStoreError(Exception):
    """Base of all kvstore errors. ``code`` is the gRPC status name it maps to."""

    code = "INTERNAL"


class InvalidArgument(KVStoreError, ValueError):
    """The request is malformed: bad spec, wrong shape/dtype, keys that do not match, ..."""

    code = "INVALID_ARGUMENT"


class ShapeMismatch(InvalidArgument):
    """A tensor's shape does not match what the ModelSpec and key count require."""


class DTypeMismatch(InvalidArgument):
    """A tensor's dtype is not the ModelSpec's KV dtype."""
