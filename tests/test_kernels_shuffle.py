"""kernels.shuffle_tensor (torch reference path): same bytes as kernels.shuffle, exact inverse."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.shuffle import shuffle_into
from kernels.shuffle_tensor import shuffle_tensor, unshuffle_tensor
from kvstore.errors import InvalidArgument

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA not available"))]  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_shuffle_tensor_matches_numpy_planes(device, dtype):
    x = torch.randn(4, 33).to(dtype)
    itemsize = x.element_size()
    want = np.empty(x.numel() * itemsize, dtype=np.uint8)
    shuffle_into(x.view(torch.uint8).reshape(-1).numpy(), itemsize, want)
    planes = shuffle_tensor(x.to(device), itemsize, backend="torch")
    assert planes.device.type == device and planes.dtype == torch.uint8
    assert planes.cpu().numpy().tobytes() == want.tobytes()
    back = unshuffle_tensor(planes, itemsize, backend="torch")
    assert torch.equal(back.view(dtype).view(x.shape).cpu().view(torch.uint8), x.view(torch.uint8))


@settings(max_examples=30, deadline=None)
@given(itemsize=st.integers(1, 8), items=st.integers(0, 300), seed=st.integers(0, 2**16))
def test_shuffle_tensor_roundtrip_property(itemsize, items, seed):
    src = torch.randint(0, 256, (items * itemsize,), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(seed))
    want = np.empty(src.numel(), dtype=np.uint8)
    shuffle_into(src.numpy(), itemsize, want)
    out = torch.empty_like(src)
    assert shuffle_tensor(src, itemsize, out) is out
    assert out.numpy().tobytes() == want.tobytes()
    assert torch.equal(unshuffle_tensor(out, itemsize), src)


def test_shuffle_tensor_rejects_misuse():
    buf = torch.zeros(12, dtype=torch.uint8)
    with pytest.raises(InvalidArgument):
        shuffle_tensor(buf, 5)  # 12 is not a multiple of 5
    with pytest.raises(InvalidArgument):
        shuffle_tensor(buf, 0)
    with pytest.raises(InvalidArgument):
        shuffle_tensor(torch.zeros(4, 6, dtype=torch.float16)[:, ::2], 2)  # not contiguous
    with pytest.raises(InvalidArgument):
        shuffle_tensor(buf, 2, torch.zeros(10, dtype=torch.uint8))  # wrong length
    with pytest.raises(InvalidArgument):
        shuffle_tensor(buf, 2, torch.zeros(12, dtype=torch.int8))  # wrong dtype
    with pytest.raises(InvalidArgument):
        shuffle_tensor(buf, 2, buf)  # in place
    big = torch.zeros(24, dtype=torch.uint8)
    shuffle_tensor(big[:12], 2, big[12:])  # two halves of one buffer do not overlap
    with pytest.raises(InvalidArgument):
        shuffle_tensor(big[:12], 2, big[6:18])
