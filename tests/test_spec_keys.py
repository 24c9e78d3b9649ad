import subprocess
import sys

import pytest

from kvstore.errors import InvalidArgument
from kvstore.keys import KEY_BYTES, ROOT_KEY, block_keys
from kvstore.spec import ModelSpec


def base_spec(**kw):
    args = {"model": "m", "revision": "r1", "num_layers": 4, "num_kv_heads": 2, "head_dim": 64,
            "dtype": "float16", "block_tokens": 16}
    args.update(kw)
    return ModelSpec(**args)


def test_fingerprint_is_stable_across_processes():
    code = ("from kvstore.spec import ModelSpec;"
            "print(ModelSpec(model='m', revision='r1', num_layers=4, num_kv_heads=2,"
            " head_dim=64, dtype='float16', block_tokens=16).fingerprint.hex())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == base_spec().fingerprint.hex()


@pytest.mark.parametrize("change", [
    {"revision": "r2"}, {"dtype": "bfloat16"}, {"block_tokens": 32}, {"adapter": "lora-1"},
    {"tp_rank": 1, "tp_size": 2}, {"tokenizer_hash": "abc"}, {"rope_scaling": "yarn:4"},
])
def test_every_field_changes_the_fingerprint(change):
    assert base_spec(**change).fingerprint != base_spec().fingerprint


def test_block_shape_and_bytes():
    s = base_spec()
    assert s.block_shape == (2, 4, 2, 16, 64)
    assert s.block_nbytes == 2 * 4 * 2 * 16 * 64 * 2
    assert base_spec(dtype="float8").block_nbytes == s.block_nbytes // 2


@pytest.mark.parametrize("bad", [
    {"num_layers": 0}, {"head_dim": -1}, {"dtype": "int4"}, {"model": ""},
    {"tp_rank": 2, "tp_size": 2}, {"block_tokens": 1.5},
])
def test_bad_spec_is_rejected_with_a_message(bad):
    with pytest.raises(InvalidArgument) as e:
        base_spec(**bad)
    assert any(k in str(e.value) for k in bad)


def test_spec_round_trips_through_dict():
    s = base_spec(adapter="x")
    assert ModelSpec.from_dict(s.to_dict()) == s
    with pytest.raises(InvalidArgument, match="unknown"):
        ModelSpec.from_dict({**s.to_dict(), "bogus": 1})


def test_keys_are_chained_and_deterministic():
    fp = base_spec().fingerprint
    toks = list(range(50))
    keys = block_keys("t", fp, 16, toks)
    assert len(keys) == 3 and all(len(k) == KEY_BYTES for k in keys)
    assert block_keys("t", fp, 16, toks) == keys
    # a prefix's keys are the prefix of the keys
    assert block_keys("t", fp, 16, toks[:32]) == keys[:2]
    # changing a token in block 0 changes every later key (chained)
    changed = block_keys("t", fp, 16, [999] + toks[1:])
    assert all(a != b for a, b in zip(changed, keys))
    # changing block 2 only changes key 2
    changed = block_keys("t", fp, 16, toks[:40] + [999] + toks[41:])
    assert changed[:2] == keys[:2] and changed[2] != keys[2]


def test_keys_depend_on_namespace_fingerprint_and_extra_keys():
    fp = base_spec().fingerprint
    toks = list(range(32))
    k = block_keys("a", fp, 16, toks)
    assert set(k).isdisjoint(block_keys("b", fp, 16, toks))
    assert set(k).isdisjoint(block_keys("a", base_spec(revision="r2").fingerprint, 16, toks))
    mm = block_keys("a", fp, 16, toks, extra_keys=[None, [b"image-hash"]])
    assert mm[0] == k[0] and mm[1] != k[1]


def test_keys_are_stable_across_processes():
    code = ("from kvstore.keys import block_keys;"
            "print(block_keys('t', b'f'*16, 4, list(range(8)))[1].hex())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == block_keys("t", b"f" * 16, 4, list(range(8)))[1].hex()


def test_token_encoding_does_not_depend_on_input_type():
    import numpy as np
    import torch
    a = block_keys("t", b"f" * 16, 4, list(range(8)))
    assert block_keys("t", b"f" * 16, 4, np.arange(8, dtype=np.int32)) == a
    assert block_keys("t", b"f" * 16, 4, torch.arange(8)) == a


@pytest.mark.parametrize("bad", [[[1, 2], [3, 4]], [-1, 2, 3, 4], [0.5] * 4], ids=["2d", "negative", "float"])
def test_bad_tokens_rejected(bad):
    with pytest.raises(InvalidArgument):
        block_keys("t", b"f" * 16, 2, bad)


def test_token_ids_past_int64_or_not_integers_are_refused_not_wrapped():
    """A uint64 id past 2**63 would wrap to a negative int64, a Python int past 2**64 is an
    object array, a bool array is not ids: each is InvalidArgument with the reason."""
    import numpy as np

    with pytest.raises(InvalidArgument, match="below 2\\*\\*63"):
        block_keys("t", b"f" * 16, 2, np.array([1 << 63, 1], dtype=np.uint64))
    with pytest.raises(InvalidArgument, match="below 2\\*\\*63"):
        block_keys("t", b"f" * 16, 2, [1 << 70, 1])
    with pytest.raises(InvalidArgument, match="integers"):
        block_keys("t", b"f" * 16, 2, [True, False])
    with pytest.raises(InvalidArgument, match="integers"):
        block_keys("t", b"f" * 16, 2, ["1", "2"])
    top = (1 << 63) - 1
    assert block_keys("t", b"f" * 16, 2, np.array([top, 0], dtype=np.uint64)) == block_keys("t", b"f" * 16, 2, [top, 0])


def test_partial_block_gets_no_key_and_root_is_not_a_key():
    keys = block_keys("t", b"f" * 16, 4, list(range(7)))
    assert len(keys) == 1 and keys[0] != ROOT_KEY


def test_golden_values_never_change():
    """NVMe blocks outlive the process and the release: the key function and the fingerprint
    are a storage format. Changing either orphans every stored block."""
    assert block_keys("t", b"f" * 16, 4, list(range(8)))[1].hex() == (
        "7bccfdd89328a99917c600dcb6546a53c2d924d80c502a0423bc6027464ac5d2")
    assert base_spec().fingerprint.hex() == "8ddb616d5e57ae8135657296bdb66ad0"


def test_a_spec_whose_block_is_absurdly_large_is_refused():
    """block_tokens=1 << 40 (a typo) made a spec; every put then failed on it."""
    from kvstore.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="a block of this ModelSpec would be"):
        ModelSpec(model="m", revision="r", num_layers=32, num_kv_heads=8, head_dim=128,
                  dtype="float16", block_tokens=1 << 40)
