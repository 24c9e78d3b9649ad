"""kernels.copy: host_copy is bit-exact at every source/destination page offset, in pieces or not;
host arenas start where copies to and from common buffers stay out of the slow window."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import copy as kcopy
from kernels.copy import (
    ALIAS_PIECE,
    ALIAS_WINDOW,
    PAGE_BYTES,
    copy_blocks,
    copy_bytes,
    host_copy,
)
from kvstore.block import Tier
from kvstore.spec import ModelSpec
from tiers.base import BlockRef
from tiers.memory import HOST_ARENA_PAGE_OFFSET, MemoryTier

SPEC = ModelSpec(model="m", revision="r", num_layers=2, num_kv_heads=2, head_dim=64,
                 dtype="float16", block_tokens=16)


def _at(raw: np.ndarray, page_offset: int, n: int) -> np.ndarray:
    start = (page_offset - raw.__array_interface__["data"][0]) % PAGE_BYTES
    return raw[start : start + n]


@settings(max_examples=40, deadline=None)
@given(delta=st.integers(0, PAGE_BYTES - 1), extra=st.integers(0, 3 * ALIAS_PIECE))
def test_host_copy_is_bit_exact_at_any_offset(delta: int, extra: int) -> None:
    n = ALIAS_PIECE // 2 + extra  # below, at and past the piece size
    rng = np.random.default_rng(delta + extra)
    src = _at(rng.integers(0, 256, n + 2 * PAGE_BYTES, dtype=np.uint8), 0, n)
    dst = _at(np.zeros(n + 2 * PAGE_BYTES, np.uint8), delta, n)
    host_copy(dst, src)
    assert np.array_equal(dst, src)


def test_copies_inside_the_window_go_in_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = np.copyto

    def counting(d: np.ndarray, s: np.ndarray) -> None:
        calls.append(d.shape[0])
        real(d, s)

    monkeypatch.setattr(kcopy.np, "copyto", counting)
    monkeypatch.setenv("KVSTORE_ALIAS_COPY", "on")  # pieces whatever this machine measures
    n = 2 * ALIAS_PIECE + 5
    src = _at(np.arange(n + 2 * PAGE_BYTES, dtype=np.uint64).astype(np.uint8), 0, n)
    for delta, pieces in ((64, [ALIAS_PIECE, ALIAS_PIECE, 5]), (ALIAS_WINDOW, [n]), (0, [n])):
        calls.clear()
        dst = _at(np.zeros(n + 2 * PAGE_BYTES, np.uint8), delta, n)
        copy_bytes(dst, src)
        assert calls == pieces, delta
        assert np.array_equal(dst, src)


@pytest.mark.parametrize("buffer_page_offset", [0, 16, 64])
def test_host_arena_slots_keep_common_buffers_out_of_the_window(buffer_page_offset: int) -> None:
    tier = MemoryTier(Tier.DRAM, 8 * SPEC.block_nbytes, torch.device("cpu"))
    for i in range(3):
        ref = BlockRef("t", bytes([i]) * 32, SPEC)
        assert tier.put(ref, np.full(SPEC.block_nbytes, i, np.uint8))
        slot_off = tier.host_bytes(ref).__array_interface__["data"][0] % PAGE_BYTES
        assert slot_off == HOST_ARENA_PAGE_OFFSET
        for delta in ((buffer_page_offset - slot_off) % PAGE_BYTES,  # get: slot -> buffer
                      (slot_off - buffer_page_offset) % PAGE_BYTES):  # put: buffer -> slot
            assert not 0 < delta < ALIAS_WINDOW


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_copy_blocks_copies_every_pair_whatever_the_threads(threads: int) -> None:
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(threads)
    srcs = [rng.integers(0, 256, 4096 + 17 * i, dtype=np.uint8) for i in range(7)]
    dsts = [np.zeros_like(s) for s in srcs]
    with ThreadPoolExecutor(2) as pool:
        copy_blocks(list(zip(dsts, srcs)), pool, threads)
    assert all(np.array_equal(d, s) for d, s in zip(dsts, srcs))
    copy_blocks([], pool=None, threads=threads)  # nothing to do is fine


def test_copy_blocks_raises_a_parts_error_after_every_part_finished() -> None:
    from concurrent.futures import ThreadPoolExecutor

    good = [(np.zeros(64, np.uint8), np.ones(64, np.uint8)) for _ in range(4)]
    bad = (np.zeros(64, np.uint8), np.ones(65, np.uint8))  # lengths differ
    pairs = [good[0], good[1], bad, good[2], good[3]]  # contiguous parts: 0-2 here, 3-4 on the pool
    with ThreadPoolExecutor(1) as pool, pytest.raises(ValueError, match="length mismatch"):
        copy_blocks(pairs, pool, 2)
    assert all(d.all() for d, _ in good)  # the pool's part ran to the end, and the caller's up to its error


def test_a_read_only_source_goes_to_a_device_without_a_host_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """A frame's payload (a view of read-only ``bytes``) copied into a device slot is handed to
    torch as it is: no copy of it first, and no warning. ``meta`` stands in for the device."""
    import warnings

    payload = bytes(range(256)) * 16
    src = memoryview(payload)
    seen: list[np.ndarray] = []
    real = torch.from_numpy

    def spy(a: np.ndarray) -> torch.Tensor:
        seen.append(a)
        return real(a)

    monkeypatch.setattr(torch, "from_numpy", spy)
    dst = torch.empty(len(payload), dtype=torch.uint8, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        copy_bytes(dst, src)
    assert len(seen) == 1 and np.shares_memory(seen[0], np.frombuffer(payload, dtype=np.uint8))
    with pytest.raises(ValueError, match="length mismatch"):
        copy_bytes(dst[:-1], src)
