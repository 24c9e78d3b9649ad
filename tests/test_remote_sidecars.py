"""Two kvstore sidecars (gRPC servers) sharing one remote tier (issue 8): a prefix put through
server A is found and served bit-exact by server B, for the same tenant only."""

from __future__ import annotations

from pathlib import Path

import torch
from service_harness import SPEC, fresh_tokens, random_kv, start

from kvstore.keyring import load_master_key


def test_two_sidecars_share_blocks_through_redis(tmp_path: Path, redis_ns) -> None:
    url, ns = redis_ns
    key_file = tmp_path / "shared-master.key"  # both servers hold the same master key
    load_master_key(None, key_file=key_file, create=True, environ={})
    store = {"remote": {"urls": [url], "namespace": ns}, "remote_write": "through",
             "master_key_file": str(key_file)}
    a = start(tmp_path / "a", store=store)
    b = start(tmp_path / "b", store=store)
    try:
        ca, cb = a.tenant("acme"), b.tenant("acme")
        other = b.tenant("globex")
        tokens = fresh_tokens(6)
        keys = ca.block_keys(SPEC, tokens)
        kv = random_kv(len(keys), seed=3)
        ca.put(SPEC, keys, kv)
        a.server.store.flush()  # the write-through queue has reached Redis

        assert cb.block_keys(SPEC, tokens) == keys
        found = cb.lookup(SPEC, keys)
        assert found.num_blocks == len(keys) and set(found.tiers) == {"remote"}
        assert torch.equal(cb.get(SPEC, keys), kv)
        assert cb.lookup(SPEC, keys).tiers[0] != "remote"  # promoted into B's own tiers
        # another tenant of B finds nothing, with its own keys or with acme's
        assert other.lookup(SPEC, other.block_keys(SPEC, tokens)).num_blocks == 0
        assert other.lookup(SPEC, keys).num_blocks == 0
        assert other.get(SPEC, keys).shape[0] == 0
    finally:
        a.stop()
        b.stop()
