"""Chains split across calls (``parent=``) through both data planes, and the client splitting a
staged get that does not fit its shared-memory region instead of falling back in-band (a staged
put that does not fit goes in-band whole: in pieces, a failed later piece left the earlier ones
stored; see tests/test_shm_put_atomic.py)."""

from __future__ import annotations

import pytest
import torch
from service_harness import SPEC, fresh_tokens, random_kv

from kvstore.errors import InvalidArgument, NotFound

torch.set_num_threads(1)


def _bytes_in(sc, plane: str) -> float:
    return sc.server.metrics_registry.get_sample_value("kvstore_bytes_in_total", {"plane": plane}) or 0.0


def _bytes_out(sc, plane: str) -> float:
    return sc.server.metrics_registry.get_sample_value("kvstore_bytes_out_total", {"plane": plane}) or 0.0


@pytest.mark.parametrize("local", [True, False], ids=["shm", "stream"])
def test_a_chain_put_in_two_calls_reads_back_whole_and_in_parts(sidecar, local):
    c = sidecar.tenant(f"split-{int(local)}", local=local)
    tokens = fresh_tokens(6)
    keys = c.block_keys(SPEC, tokens)
    kv = random_kv(6, seed=11)
    c.put(SPEC, keys[:3], kv[:3])
    c.put(SPEC, keys[3:], kv[3:], parent=keys[2])

    assert c.lookup(SPEC, keys).num_blocks == 6
    assert c.lookup(SPEC, keys[3:], parent=keys[2]).num_blocks == 3
    assert c.lookup(SPEC, keys[3:]).num_blocks == 0  # without its parent the tail is no prefix
    assert torch.equal(c.get(SPEC, keys).view(torch.int16), kv.view(torch.int16))
    tail = c.get(SPEC, keys[3:], parent=keys[2])
    assert torch.equal(tail.view(torch.int16), kv[3:].view(torch.int16))


def test_token_ids_continue_from_the_parent(sidecar):
    c = sidecar.tenant("split-tokens")
    tokens = fresh_tokens(4, tail=0)
    keys = c.block_keys(SPEC, tokens)
    c.put(SPEC, keys, random_kv(4))
    hit = c.lookup(SPEC, token_ids=tokens[2 * SPEC.block_tokens :], parent=keys[1])
    assert hit.num_blocks == 2 and hit.keys == keys[2:]


def test_a_parent_that_is_not_stored_or_malformed_is_refused(sidecar):
    c = sidecar.tenant("split-bad")
    keys = c.block_keys(SPEC, fresh_tokens(3))
    with pytest.raises(NotFound):
        c.put(SPEC, keys[1:], random_kv(2), parent=keys[0])
    with pytest.raises(InvalidArgument, match="parent"):
        c.lookup(SPEC, keys, parent=b"\x01" * 5)


def test_staged_get_larger_than_the_region_moves_in_pieces_through_shared_memory(sidecar):
    nbytes = SPEC.block_nbytes
    c = sidecar.tenant("pieces", local=True, region_bytes=3 * nbytes)
    assert c.uses_shared_memory
    keys = c.block_keys(SPEC, fresh_tokens(10))
    kv = random_kv(10, seed=4)
    c.put(SPEC, keys, kv)  # 10 blocks, more than a 3-block region: in-band, all or nothing
    assert _bytes_in(sidecar, "stream") == 10 * nbytes and _bytes_in(sidecar, "shm") == 0

    assert c.lookup(SPEC, keys).num_blocks == 10
    got = c.get(SPEC, keys)
    assert torch.equal(got.view(torch.int16), kv.view(torch.int16))
    assert _bytes_out(sidecar, "shm") == 10 * nbytes and _bytes_out(sidecar, "stream") == 0


def test_split_get_stops_at_the_first_miss(sidecar):
    c = sidecar.tenant("pieces-miss", local=True, region_bytes=2 * SPEC.block_nbytes)
    keys = c.block_keys(SPEC, fresh_tokens(7))
    kv = random_kv(7, seed=8)
    c.put(SPEC, keys[:5], kv[:5])
    got = c.get(SPEC, keys)
    assert len(got) == 5 and torch.equal(got.view(torch.int16), kv[:5].view(torch.int16))
