"""A get read in pieces counts its hits and misses as one Store.get of every key does: the
service's Get cut at ``limits.max_stream_bytes`` (GetRequest.partial) and a client's staged
GetLocal pieces counted only the keys of the piece where the prefix ended (40 keys asked, 5
stored, pieces of 8: misses +3 where Store.get counts 35), so the hit ratio operators compute
was inflated. The keys after a piece (past the server's cut, or left by the client to later
requests: ``keys_after``) are misses too when the prefix ends within it. Roots are counted once
per key."""

from __future__ import annotations

import hashlib
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from conftest import make_kv, tokens
from service_harness import SPEC, fresh_tokens, random_kv, start

from kvstore.errors import InvalidArgument
from kvstore.keys import KEY_BYTES
from kvstore.service_convert import spec_to_pb
from proto.kvstore.v1 import kvstore_pb2 as pb
from proto.kvstore.v1 import kvstore_pb2_grpc

NB = SPEC.block_nbytes


def _roots(n: int, tag: str) -> list[bytes]:
    return [hashlib.blake2b(f"{tag}/page-{i}".encode(), digest_size=KEY_BYTES).digest() for i in range(n)]


def _counts(store) -> tuple[int, int]:
    s = store.stats()
    return s["hits"], s["misses"]


def _delta(store, before: tuple[int, int]) -> tuple[int, int]:
    hits, misses = _counts(store)
    return hits - before[0], misses - before[1]


@pytest.fixture
def cut_sidecar(tmp_path: Path):
    """A sidecar serving at most 8 blocks per Get stream."""
    sc = start(tmp_path, limits={"max_stream_bytes": 8 * NB},
               store={"hbm_bytes": 64 * NB, "dram_bytes": 64 * NB, "nvme_bytes": 256 * NB})
    yield sc
    sc.stop()


# -- Store ---------------------------------------------------------------------------------------
def test_lease_pieces_count_what_one_get_of_every_key_counts(open_store, spec):
    s = open_store(spec, hbm_blocks=64, dram_blocks=0, nvme_blocks=64)
    keys = s.block_keys("a", spec, tokens(40, spec))
    s.put("a", spec, keys[:20], make_kv(spec, 20))
    stage = lambda _: np.empty(spec.block_nbytes, np.uint8)

    before = _counts(s)
    assert s.get("a", spec, keys).shape[0] == 20
    want = _delta(s, before)
    assert want == (20, 20)

    before = _counts(s)
    parent = None
    for start_at in range(0, 40, 8):  # pieces of 8, each told how many keys follow it
        with s.lease_prefix("a", spec, keys[start_at : start_at + 8], stage, parent=parent,
                            keys_after=40 - start_at - 8) as lease:
            n = len(lease.views)
        if n < 8:
            break
        parent = keys[start_at + 7]
    assert _delta(s, before) == want  # was (20, 4): the 16 keys after the piece went uncounted

    with pytest.raises(InvalidArgument, match="keys_after"):
        s.lease_prefix("a", spec, keys[:1], stage, keys_after=-1)


def test_lease_piece_with_a_remote_continuation_counts_the_keys_after_it(servers):
    """The remote continuation counts them too (Store.lease_prefix through _remote_continue)."""
    from test_roots18 import SPEC_REMOTE as spec

    a, b = servers("a"), servers("b")
    keys = a.block_keys("acme", spec, tokens(40, spec))
    a.put("acme", spec, keys[:5], make_kv(spec, 5))
    a.flush()  # written through to Redis
    before = _counts(b)
    with b.lease_prefix("acme", spec, keys[:8], lambda _: np.empty(spec.block_nbytes, np.uint8),
                        keys_after=32) as lease:
        assert len(lease.views) == 5  # all remote
    assert _delta(b, before) == (5, 35)


# -- service, in-band stream ---------------------------------------------------------------------
@pytest.mark.parametrize("stored", [5, 20], ids=["ends-in-first-piece", "ends-in-third-piece"])
def test_a_get_cut_at_the_stream_limit_counts_every_key_not_served(cut_sidecar, stored: int):
    a = cut_sidecar.tenant("a", local=False)
    keys = a.block_keys(SPEC, fresh_tokens(40))
    kv = random_kv(stored)
    for at in range(0, stored, 8):  # puts within the stream limit too
        a.put(SPEC, keys[at : min(at + 8, stored)], kv[at : at + 8], parent=keys[at - 1] if at else None)
    store = cut_sidecar.server.store
    before = _counts(store)
    got = a.get(SPEC, keys)
    assert torch.equal(got, kv)
    assert _delta(store, before) == (stored, 40 - stored)  # was misses +3 / +4


def test_get_request_keys_after_counts_the_keys_a_client_left_to_later_requests(cut_sidecar):
    """A client that splits a get itself says how many keys follow (GetRequest.keys_after); an
    older client (0) is counted as before."""
    token = cut_sidecar.admin().create_tenant("raw")
    c = cut_sidecar.client(token, local=False)
    keys = c.block_keys(SPEC, fresh_tokens(8))
    c.put(SPEC, keys[:3], random_kv(3))
    store = cut_sidecar.server.store
    channel = grpc.insecure_channel(cut_sidecar.target)
    try:
        stub = kvstore_pb2_grpc.KVStoreStub(channel)
        md = (("authorization", f"Bearer {token}"),)
        target = pb.Target(spec=spec_to_pb(SPEC), keys=b"".join(keys[:4]))
        for after, misses in ((32, 33), (0, 1)):
            before = _counts(store)
            list(stub.Get(pb.GetRequest(target=target, partial=True, keys_after=after), metadata=md))
            assert _delta(store, before) == (3, misses)
        # at most limits.max_keys_per_call: a client cannot add misses beyond what one call could ask for
        before = _counts(store)
        list(stub.Get(pb.GetRequest(target=target, partial=True, keys_after=2**32 - 1), metadata=md))
        assert _delta(store, before)[1] == 1 + 65536
    finally:
        channel.close()


# -- service, shared memory -----------------------------------------------------------------------
def test_a_get_staged_through_the_region_in_pieces_counts_every_key_not_served(tmp_path: Path):
    """The region's free part holds 8 blocks: a 40-key get into a buffer outside it goes in
    GetLocal pieces of 8, each saying how many keys follow it."""
    sc = start(tmp_path, store={"hbm_bytes": 64 * NB, "dram_bytes": 64 * NB, "nvme_bytes": 256 * NB})
    try:
        a = sc.tenant("a", local=True, region_bytes=8 * NB)
        assert a.uses_shared_memory
        keys = a.block_keys(SPEC, fresh_tokens(40))
        kv = random_kv(20)
        a.put(SPEC, keys[:20], kv)
        store = sc.server.store
        for asked, stored in ((keys, 20), (keys[15:], 5)):
            before = _counts(store)
            out = torch.zeros((len(asked), *SPEC.block_shape), dtype=SPEC.torch_dtype)
            parent = keys[14] if stored == 5 else None
            assert a.get_into(SPEC, asked, out, parent=parent) == stored
            assert _delta(store, before) == (stored, len(asked) - stored)  # was misses +4 / +3
        assert torch.equal(out[:5], kv[15:])
    finally:
        sc.stop()


# -- roots ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("local", [False, True], ids=["stream", "shm"])
def test_a_get_of_roots_in_pieces_counts_each_absent_key_once(tmp_path: Path, local: bool):
    sc = start(tmp_path, limits={"max_stream_bytes": 8 * NB},
               store={"hbm_bytes": 64 * NB, "dram_bytes": 64 * NB, "nvme_bytes": 256 * NB})
    try:
        a = sc.tenant("a", local=local, region_bytes=8 * NB)
        keys = _roots(40, f"pieces-{local}")
        hits = [0, 7, 8, 21, 39]
        a.put(SPEC, [keys[i] for i in hits], random_kv(5), roots=True)
        store = sc.server.store
        before = _counts(store)
        out = torch.zeros((40, *SPEC.block_shape), dtype=SPEC.torch_dtype)
        present = a.get_roots_into(SPEC, keys, out)
        assert [i for i, p in enumerate(present) if p] == hits
        assert _delta(store, before) == (5, 35)
    finally:
        sc.stop()


@pytest.mark.parametrize("roots", [False, True], ids=["chain", "roots"])
def test_a_get_whose_region_is_lost_between_pieces_goes_on_in_band_counting_each_key_once(
        tmp_path: Path, monkeypatch, roots: bool):
    """The server forgets the region before the second GetLocal piece and the client cannot
    register it again: the get went in-band for every key again, so the first piece's keys were
    served and counted twice; it goes on in-band from the piece refused."""
    from kvstore import service_data
    from kvstore.client import Client
    from kvstore.errors import ResourceExhausted

    sc = start(tmp_path, store={"hbm_bytes": 64 * NB, "dram_bytes": 64 * NB, "nvme_bytes": 256 * NB})
    try:
        a = sc.tenant("a", local=True, region_bytes=8 * NB)
        assert a.uses_shared_memory
        if roots:
            keys = _roots(40, "lost-region")
            hits = [0, 3, 9, 17, 30]
            a.put(SPEC, [keys[i] for i in hits], random_kv(5), roots=True)
        else:
            keys = a.block_keys(SPEC, fresh_tokens(40))
            hits = list(range(20))
            a.put(SPEC, keys[:20], random_kv(20))
        real = service_data.DataPlane.get_local
        pieces: list[int] = []

        def lose_the_region_at_the_second_piece(plane, p, b, region_id, *args, **kw):
            pieces.append(len(b.keys))
            if len(pieces) == 2:
                plane.regions.unregister(p.name, region_id)
            return real(plane, p, b, region_id, *args, **kw)

        def refused(self, *args, **kw):
            raise ResourceExhausted("the principal's regions are all in use")

        monkeypatch.setattr(service_data.DataPlane, "get_local", lose_the_region_at_the_second_piece)
        monkeypatch.setattr(Client, "_register_region", refused)
        store = sc.server.store
        before = _counts(store)
        out = torch.zeros((40, *SPEC.block_shape), dtype=SPEC.torch_dtype)
        if roots:
            assert [i for i, p in enumerate(a.get_roots_into(SPEC, keys, out)) if p] == hits
        else:
            assert a.get_into(SPEC, keys, out) == 20
        assert len(pieces) == 2  # the first piece served through the region, the second refused
        assert _delta(store, before) == (len(hits), 40 - len(hits))  # was 8 hits more (chain)
        assert a._local is not None and a._local.region_id == 0  # it went in-band
    finally:
        sc.stop()
