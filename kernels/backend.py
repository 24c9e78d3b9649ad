"""Which implementation a kernel call runs: the torch reference or a Triton kernel.

Primitives::

    triton_available() -> bool                 # triton imports (cached; never raises)
    use_triton(backend, *tensors) -> bool      # resolve a call's ``backend`` argument

``backend`` (a :data:`Backend`) is ``"auto"`` (the default of every public kernel call),
``"torch"`` or ``"triton"``:

* ``"auto"``: Triton when every tensor is on CUDA and triton imports, else torch. CPU tensors
  always take the torch path (the Triton kernels only pay off on a GPU).
* ``"torch"``: the reference, on any device.
* ``"triton"``: the Triton kernel, or :class:`kvstore.errors.InvalidArgument` when triton does
  not import or a tensor is on CPU without ``TRITON_INTERPRET=1`` (Triton's interpreter, which
  runs kernels on CPU tensors through numpy; the tests use it).

NOTE: nothing here imports triton at module import time; the ``kernels.triton_*`` modules (which
do) are imported only by a call that resolved to Triton.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Literal

import torch

from kernels.errors import InvalidArgument

Backend = Literal["auto", "torch", "triton"]


@functools.cache
def triton_available() -> bool:
    """True when the ``triton`` package imports (checked once per process)."""
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        import triton  # noqa: F401
    except ImportError:  # a broken install counts as absent; "auto" then uses torch
        return False
    return True


def interpreting() -> bool:
    """True when Triton kernels defined from now on run in Triton's CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(backend: Backend, *tensors: torch.Tensor) -> bool:
    """Resolve ``backend`` for a call on ``tensors`` (see the module docstring)."""
    on_cuda = all(t.device.type == "cuda" for t in tensors)
    if backend == "torch":
        return False
    if backend == "auto":
        return on_cuda and triton_available()
    if backend != "triton":
        raise InvalidArgument(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    if not triton_available():
        raise InvalidArgument("backend='triton' but triton does not import (pip install kvstore[triton])")
    if not on_cuda and not interpreting():
        raise InvalidArgument("backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 on CPU)")
    return True


__all__ = ["Backend", "interpreting", "triton_available", "use_triton"]
