"""Byte-shuffle kernel: exact round trip, plane layout, argument checks."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.shuffle import shuffle_into, unshuffle_into, unshuffle_planes_into
from kvstore.errors import InvalidArgument


@settings(max_examples=60, deadline=None)
@given(itemsize=st.sampled_from([1, 2, 3, 4, 8]), items=st.integers(0, 3000), seed=st.integers(0, 2**32 - 1))
def test_shuffle_round_trip_and_plane_layout(itemsize: int, items: int, seed: int) -> None:
    src = np.random.default_rng(seed).integers(0, 256, items * itemsize, dtype=np.uint8)
    shuffled = np.empty_like(src)
    shuffle_into(src, itemsize, shuffled)
    for j in range(itemsize):  # plane j = byte j of every item, in item order
        assert np.array_equal(shuffled[j * items : (j + 1) * items], src[j::itemsize])
    back = np.full_like(src, 0xAA)
    unshuffle_into(shuffled, itemsize, back)
    assert np.array_equal(back, src)


def test_shuffle_crosses_internal_slices_exactly() -> None:
    # larger than one internal slice (2**17 items) and not a multiple of it
    items = (1 << 17) * 2 + 12345
    for itemsize in (2, 4):
        src = np.random.default_rng(itemsize).integers(0, 256, items * itemsize, dtype=np.uint8)
        mid, back = np.empty_like(src), np.empty_like(src)
        shuffle_into(src, itemsize, mid)
        assert np.array_equal(mid[:items], src[0::itemsize])
        assert np.array_equal(mid[-items:], src[itemsize - 1 :: itemsize])
        unshuffle_into(mid, itemsize, back)
        assert np.array_equal(back, src)


def test_fp16_high_plane_is_sign_and_exponent() -> None:
    values = np.array([1.0, -2.0, 0.5, 65504.0], dtype=np.float16)
    src = values.view(np.uint8).copy()
    out = np.empty_like(src)
    shuffle_into(src, 2, out)
    assert list(out[4:]) == [int(v) >> 8 for v in values.view(np.uint16)]
    assert list(out[:4]) == [int(v) & 0xFF for v in values.view(np.uint16)]


def test_unshuffle_planes_from_separate_buffers() -> None:
    src = np.arange(64, dtype=np.uint8)
    lo, hi = src[0::2].copy(), src[1::2].copy()
    out = np.empty(64, dtype=np.uint8)
    unshuffle_planes_into([lo, hi], out)
    assert np.array_equal(out, src)


@pytest.mark.parametrize(
    "src,itemsize,out",
    [
        (np.zeros(7, np.uint8), 2, np.zeros(7, np.uint8)),  # not a multiple of itemsize
        (np.zeros(8, np.uint8), 2, np.zeros(6, np.uint8)),  # lengths differ
        (np.zeros(8, np.uint16), 2, np.zeros(8, np.uint8)),  # wrong dtype
        (np.zeros((2, 4), np.uint8), 2, np.zeros(8, np.uint8)),  # not 1-D
        (np.zeros(16, np.uint8)[::2], 2, np.zeros(8, np.uint8)),  # not contiguous
        (np.zeros(8, np.uint8), 0, np.zeros(8, np.uint8)),  # bad itemsize
    ],
)
def test_shuffle_rejects_bad_arguments(src: np.ndarray, itemsize: int, out: np.ndarray) -> None:
    with pytest.raises(InvalidArgument):
        shuffle_into(src, itemsize, out)
    with pytest.raises(InvalidArgument):
        unshuffle_into(src, itemsize, out)


def test_shuffle_rejects_overlapping_output() -> None:
    buf = np.zeros(16, np.uint8)
    with pytest.raises(InvalidArgument, match="overlap"):
        shuffle_into(buf, 2, buf)
