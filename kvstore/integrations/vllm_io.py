"""How the vLLM connector's blocks move between vLLM's paged KV caches and host memory: the
engine caches' layout and dtype, the host staging buffers, and the device steps (the copies
between a cache's device and the host) with the one way their failures are caught.

Importing this module does not import vLLM. The connector is :mod:`kvstore.integrations.vllm`;
it calls the device steps (:func:`_host_empty`, :func:`_to_host`, :func:`_host_ready`,
:func:`_to_device`) through its own module's names.

* **Blocks.** One kvstore block = one vLLM block (``block_tokens`` = vLLM's ``block_size``), all
  layers of one worker's shard, shaped ``[2, L, H, T, D]``. Each layer's cache is moved as vLLM
  allocated it by :mod:`kernels.paged`, in its layout (:func:`cache_layout`: ``BLOCKS_FIRST``/
  ``KV_FIRST`` on GPU; on CPU ``CPU_SPLIT``: ``[nb, H, bs, 2D]`` written as a K slab then a V slab
  per block and head, or ``CPU_SPLIT_KDIM`` for the ``vec`` ISA, whose K slab is dim-major: the
  kernel reads it as ``[D, bs]``, so stored blocks are canonical with no transposing pass). Caches
  must hold the spec's dtype (:func:`typed_cache`); fp8 caches, which vLLM allocates as ``uint8``,
  are viewed as the spec's fp8 dtype (same bytes).
* **Staging.** A cache on a device (GPU) is gathered on the device, one layer at a time (a save's
  blocks, and a chain sent again from its root), each layer into a device buffer of its own and
  copied to its own slab of a host staging buffer (page-locked with CUDA; the copies are
  asynchronous and waited for before the client reads them). Loaded blocks go host -> device one
  layer at a time too, each layer's copy scattered (and freed) before the next is made. So a move
  holds one layer of its blocks on the device, never all ``L``. CPU caches are gathered into and
  scattered from the host buffers directly.
* **Device steps.** They run inside vLLM's forward pass: one that fails with a RuntimeError
  (``torch.OutOfMemoryError`` is one, as are CUDA's errors) raises :class:`_DeviceStepFailed`
  (:func:`_device_step`), which fails that save or that load, never the engine step. The
  kernels' typed errors (a shape or a block table that does not fit) are not caught: they are
  bugs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from kernels.paged import PagedLayout
from kvstore.errors import DTypeMismatch, ShapeMismatch
from kvstore.spec import ModelSpec

__all__ = ["Transfer", "cache_layout", "typed_cache"]


@dataclass(slots=True)
class Transfer:
    """Blocks of one request to move this step: the prompt's blocks ``start..len(block_ids)``.

    ``keys[r][i]``: rank r's (PP stage x TP rank, see :mod:`kvstore.integrations.vllm`) key of the prompt's
    block i, for every block up to the last one moved (the ones before ``start`` are the chain
    the moved blocks continue from, which a save sends again if the store lost it);
    ``block_ids[i]``: the engine block holding block i;
    ``adapter``: the request's spec adapter (:func:`request_adapter`)."""

    req_id: str
    keys: list[list[bytes]]
    start: int
    block_ids: list[int]
    adapter: str = ""


def _host_empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host buffer for blocks moving to or from ``device``: page-locked for a CUDA device (so
    the copies are asynchronous DMA), plain memory otherwise."""
    return torch.empty(shape, dtype=dtype, pin_memory=device.type == "cuda")


def _to_host(src: torch.Tensor, dst: torch.Tensor) -> None:
    """Start copying ``src`` (on the cache's device) into the host tensor ``dst``, on the
    device's current stream; the bytes are there once :func:`_host_ready` returns."""
    dst.copy_(src, non_blocking=True)


def _host_ready(device: torch.device) -> None:
    """Wait for the copies :func:`_to_host` started on ``device`` (nothing to wait for on the CPU).

    NOTE: the whole current stream (the copies were queued on it after the layers' attention):
    called once per step, from wait_for_save at the end of the forward pass, or for a chain
    sent again from its root."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    elif device.type not in ("cpu", "meta"):
        torch.accelerator.synchronize(device)


def _to_device(blocks: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Blocks the client returned (host memory) on the cache's device, as is on the CPU. The
    copy and the scatter after it run in order on the device's current stream."""
    return blocks if blocks.device == device else blocks.to(device, non_blocking=True)


class _DeviceStepFailed(Exception):
    """A device step of a save or a load failed (see :func:`_device_step`); it never leaves
    the connector's hooks: the save is dropped, the load reported failed."""


@contextlib.contextmanager
def _device_step(what: str) -> Iterator[None]:
    """Run a move between the cache's device and the host, raising :class:`_DeviceStepFailed`
    for a RuntimeError in it (``torch.OutOfMemoryError`` for a pinned or device buffer, a CUDA
    error of a copy or of the wait for it).

    NOTE: these run inside vLLM's forward pass, where an exception ends the engine; a sidecar
    that fails gives misses, and so does a buffer that cannot be had. Only RuntimeError: the
    kernels' typed errors (KVStoreError) are bugs, and stay raised."""
    try:
        yield
    except RuntimeError as exc:
        raise _DeviceStepFailed(f"{what} failed: {type(exc).__name__}: {exc}") from exc


@dataclass(slots=True)
class _Stage:
    """One save's blocks on their way from the caches to the sidecar.

    On the CPU ``host`` is ``[n, 2, L, H, T, D]`` and each layer is gathered straight into it
    (no other copy). For a cache on a device it is ``[L, n, 2, H, T, D]`` on the host (pinned
    with CUDA): each layer is gathered on the device into a buffer of that layer's blocks only
    (device memory for one layer, not the whole save) and copied into its own contiguous slab."""

    t: Transfer
    host: torch.Tensor
    on_device: bool
    seen: set[int] = field(default_factory=set)
    failed: _DeviceStepFailed | None = None  # a device step of this save failed: it is not put

    @property
    def n(self) -> int:
        return self.host.shape[1] if self.on_device else self.host.shape[0]

    def blocks(self) -> torch.Tensor:
        """The blocks as the client takes them, ``[n, 2, L, H, T, D]``."""
        return self.host.permute(1, 2, 0, 3, 4, 5) if self.on_device else self.host


def typed_cache(spec: ModelSpec, name: str, cache: torch.Tensor) -> torch.Tensor:
    """Layer ``name``'s ``cache`` as the spec's dtype: as is, or an fp8 cache vLLM allocated as
    ``uint8`` viewed as the spec's fp8 dtype (the same bytes)."""
    want = spec.torch_dtype
    if cache.dtype == want:
        return cache
    if cache.dtype == torch.uint8 and spec.itemsize == 1:
        return cache.view(want)
    raise DTypeMismatch(f"kvstore connector: layer {name} caches {cache.dtype}, the spec says {want} "
                        f"(kv_cache_dtype {spec.dtype!r})")


def cache_layout(spec: ModelSpec, k_dim_major: bool, cache: torch.Tensor) -> PagedLayout:
    """The paged layout of one layer's ``cache`` (``k_dim_major``: the CPU ``vec`` ISA's K order)."""
    s, bs = spec, spec.block_tokens
    h, d = s.num_kv_heads, s.head_dim
    if cache.dim() == 4 and tuple(cache.shape[1:]) == (h, bs, 2 * d):
        # vLLM CPU: [nb, H, bs, 2D] written as [nb, H, 2, bs, D] (K slab | V slab); the
        # ``vec`` ISA keeps K dim-major, which the kernel turns canonical as it gathers
        return PagedLayout.CPU_SPLIT_KDIM if k_dim_major else PagedLayout.CPU_SPLIT
    if cache.dim() == 5 and tuple(cache.shape[1:]) == (2, bs, h, d):
        return PagedLayout.BLOCKS_FIRST
    if cache.dim() == 5 and cache.shape[0] == 2 and tuple(cache.shape[2:]) == (bs, h, d):
        return PagedLayout.KV_FIRST
    raise ShapeMismatch(f"kvstore connector: unknown KV cache layout {tuple(cache.shape)} "
                        f"(block_size {bs}, {h} heads, head_dim {d})")
