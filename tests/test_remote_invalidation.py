"""A delete (or model purge) on one server reaches the local copies the other servers sharing
its Redis hold: the deletions stream of tiers/remote_invalidate.py.

Before, ``Store.delete`` on server A removed the blocks from A's local tiers and from Redis, but
server B's local copies (HBM/DRAM/NVMe) stayed: B served them, and when it evicted them from its
last local tier it demoted them to Redis again, so A and every replica read the "deleted" blocks
again. Each test waits on a condition (with a timeout), never on a sleep that assumes a speed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pydantic
import pytest
import redis
import torch
from conftest import MASTER, FakeClock, make_kv, tokens, wait_until

from kvstore.codec import tenant_hash
from kvstore.config import StoreConfig
from kvstore.errors import InvalidArgument
from kvstore.spec import ModelSpec
from kvstore.store import Store
from tiers.base import BlockRef
from tiers.remote import RemoteTier
from tiers.remote_config import RemoteConfig
from tiers.remote_invalidate import (
    ENTRY_KEYS,
    Malformed,
    Unauthenticated,
    derive_deletions_key,
    entry_mac,
    parse_entry,
)

SPEC = ModelSpec(model="m", revision="r1", num_layers=2, num_kv_heads=2, head_dim=8,
                 dtype="float16", block_tokens=4)
OTHER = ModelSpec(model="m", revision="r2", num_layers=2, num_kv_heads=2, head_dim=8,
                  dtype="float16", block_tokens=4)


def wait_for(cond: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
    assert wait_until(cond, timeout), f"timed out waiting for {what or cond}"


def counter(s: Store, name: str) -> int:
    return s.stats()["counters"].get(name, 0)


def applied(s: Store, n: int = 1) -> Callable[[], bool]:
    return lambda: counter(s, "remote_deletions_applied") >= n


def in_redis(s: Store, tenant: str, spec: ModelSpec, keys: list[bytes]) -> int:
    t = s._remote
    return sum(t._client.exists(t.redis_key(BlockRef(tenant, k, spec))) for k in keys)


def shared_chain(a: Store, b: Store, n: int = 3, tenant: str = "acme") -> tuple[list[bytes], torch.Tensor]:
    """A chain put on A (written through to Redis) and read by B (promoted into B's HBM)."""
    keys = a.block_keys(tenant, SPEC, tokens(n, SPEC))
    kv = make_kv(SPEC, n)
    a.put(tenant, SPEC, keys, kv)
    a.flush()
    assert torch.equal(b.get(tenant, SPEC, keys), kv)
    assert b.lookup(tenant, SPEC, keys).tiers == ["hbm"] * n
    return keys, kv


def test_a_delete_on_one_server_drops_the_other_servers_local_copy(servers) -> None:
    a, b = servers("a"), servers("b")
    keys, _ = shared_chain(a, b)
    assert a.delete("acme", [keys[0]]) == 3
    wait_for(applied(b), what="B applying A's deletion")
    assert b.lookup("acme", SPEC, keys).num_blocks == 0
    assert b.get("acme", SPEC, keys).shape[0] == 0
    c = b.stats()["counters"]
    assert c["deleted_elsewhere"] == 3 and c["remote_deletions_blocks_dropped"] == 3
    assert counter(a, "remote_deletions_published") == 1
    assert counter(a, "remote_deletions_applied") == 0  # its own entry: skipped


def test_b_never_spills_a_deleted_block_to_redis_again(servers) -> None:
    """B's copies would leave its only tier (HBM) for Redis when it makes room: on the old code
    A (and everyone) read the deleted blocks from there again."""
    a = servers("a")
    b = servers("b", hbm=4, remote_write="demote")
    keys, _ = shared_chain(a, b, n=3)
    assert a.delete("acme", [keys[0]]) == 3
    wait_for(applied(b), what="B applying A's deletion")
    # force B's eviction: its HBM holds 4 blocks, another tenant puts 4
    other = b.block_keys("globex", SPEC, tokens(4, SPEC, start=100))
    b.put("globex", SPEC, other, make_kv(SPEC, 4, seed=3))
    b.put("globex", SPEC, b.block_keys("globex", SPEC, tokens(4, SPEC, start=900)), make_kv(SPEC, 4, seed=4))
    assert counter(b, "remote_queue_submitted") >= 4  # globex's blocks went to Redis: B evicts
    b.flush()
    assert in_redis(a, "acme", SPEC, keys) == 0
    assert a.lookup("acme", SPEC, keys).num_blocks == 0


def test_a_demotion_queued_on_b_before_the_delete_is_not_written_after_it(servers) -> None:
    """B's writer is busy with another block while B's copy of a deleted block waits in its
    queue; the deletion lands in Redis, then B's writer reaches the copy: on the old code it
    wrote it back."""
    a = servers("a")
    b = servers("b", hbm=3, remote_write="demote")
    keys, _ = shared_chain(a, b, n=3)
    tier = b._remote
    real = tier._put_with
    gate, busy = threading.Event(), threading.Event()

    def stalled(scratch: Any, ref: BlockRef, *args: Any) -> Any:
        if ref.tenant == "globex":
            busy.set()
            gate.wait(10)
        return real(scratch, ref, *args)

    tier._put_with = stalled  # type: ignore[method-assign]
    try:
        blocker = BlockRef("globex", bytes(32), SPEC)
        assert tier.submit(blocker, make_kv(SPEC, 1).view(torch.uint8).numpy().reshape(-1))
        wait_for(busy.is_set, what="B's writer busy")
        # B makes room for initech: acme's three blocks are queued behind globex's
        b.put("initech", SPEC, b.block_keys("initech", SPEC, tokens(3, SPEC, start=100)),
              make_kv(SPEC, 3, seed=3))
        assert b.lookup("acme", SPEC, keys).tiers == ["remote"] * 3  # left B's only tier for its queue
        assert b._remote.metrics()["queue_blocks"] == 3
        assert a.delete("acme", [keys[0]]) == 3
        wait_for(applied(b), what="B applying A's deletion")
    finally:
        gate.set()
    b.flush()
    assert counter(b, "remote_deletions_demotions_cancelled") >= 3
    assert in_redis(a, "acme", SPEC, keys) == 0
    assert a.lookup("acme", SPEC, keys).num_blocks == 0


def test_subtree_blocks_only_b_held_are_dropped_too(servers) -> None:
    a = servers("a")
    b = servers("b", remote_write="demote")
    keys, _ = shared_chain(a, b, n=2)
    # B continues the chain: two blocks only B holds (demote: not in Redis)
    more = b.block_keys("acme", SPEC, tokens(4, SPEC))[2:]
    b.put("acme", SPEC, more, make_kv(SPEC, 2, seed=5), parent=keys[1])
    b.flush()
    assert in_redis(b, "acme", SPEC, more) == 0
    assert b.lookup("acme", SPEC, keys + more).num_blocks == 4
    assert a.delete("acme", [keys[0]]) == 2  # A finds only what Redis has
    wait_for(applied(b), what="B applying A's deletion")
    assert b.lookup("acme", SPEC, more, parent=keys[1]).num_blocks == 0
    assert counter(b, "deleted_elsewhere") == 4


def test_purge_model_reaches_the_other_servers(servers) -> None:
    a, b = servers("a"), servers("b", remote_write="demote")
    keys, _ = shared_chain(a, b)
    kept = b.block_keys("acme", OTHER, tokens(2, OTHER))
    kv = make_kv(OTHER, 2, seed=7)
    b.put("acme", OTHER, kept, kv)  # another model, on B only
    assert a.purge_model(SPEC.fingerprint) == 3
    wait_for(applied(b), what="B applying A's purge")
    assert b.lookup("acme", SPEC, keys).num_blocks == 0
    assert torch.equal(b.get("acme", OTHER, kept), kv)
    assert counter(b, "deleted_elsewhere") == 3


def test_another_tenants_blocks_with_the_same_keys_are_untouched(servers) -> None:
    a, b = servers("a"), servers("b", remote_write="demote")
    keys, _ = shared_chain(a, b)
    kv = make_kv(SPEC, 3, seed=11)
    b.put("globex", SPEC, keys, kv)  # the same keys, another tenant (its own namespace)
    assert a.delete("acme", [keys[0]]) == 3
    wait_for(applied(b), what="B applying A's deletion")
    assert b.lookup("acme", SPEC, keys).num_blocks == 0
    assert b.lookup("globex", SPEC, keys).tiers == ["hbm"] * 3
    assert torch.equal(b.get("globex", SPEC, keys), kv)
    assert counter(b, "deleted_elsewhere") == 3


def test_a_servers_own_entry_is_not_applied_again(servers) -> None:
    a, b = servers("a"), servers("b")
    keys, kv = shared_chain(a, b)
    assert a.delete("acme", [keys[0]]) == 3
    a.put("acme", SPEC, keys, kv)  # put again at once: its own entry must not take it away
    wait_for(applied(b), what="B applying A's deletion")
    wait_for(lambda: counter(a, "remote_deletions_own") >= 1, what="A reading its own entry")
    assert counter(a, "remote_deletions_applied") == 0
    assert counter(a, "deleted_elsewhere") == 0
    assert counter(a, "deleted") == 3  # its own delete, once
    assert torch.equal(a.get("acme", SPEC, keys), kv)


def test_a_server_that_was_down_applies_the_deletions_made_meanwhile(tmp_path: Path, redis_ns) -> None:
    """B's NVMe copies survive its restart; the position it keeps in its directory makes it
    read the deletions made while it was down (from the stream's end, it would keep them)."""
    url, ns = redis_ns
    n = SPEC.block_nbytes
    clock = FakeClock()

    def open_store(name: str) -> Store:
        cfg = StoreConfig(path=tmp_path / name, hbm_bytes=8 * n, dram_bytes=0, nvme_bytes=32 * n,
                          master_key=MASTER, remote=RemoteConfig(urls=[url], namespace=ns),
                          remote_write="through")
        return Store.open(cfg, clock=clock)

    a, b = open_store("a"), open_store("b")
    try:
        keys, _ = shared_chain(a, b)
        assert b.flush() == 3  # committed to B's NVMe
        b.close()
        assert a.delete("acme", [keys[0]]) == 3
        b = open_store("b")
        assert applied(b)(), "the deletion made while B was down was not applied at its open"
        assert b.lookup("acme", SPEC, keys).num_blocks == 0
    finally:
        a.close()
        b.close()


@pytest.fixture
def paused_pair(private_redis, tmp_path: Path) -> Iterator[tuple[Store, Store, Any]]:
    n = SPEC.block_nbytes
    remote = RemoteConfig(urls=[private_redis.url], namespace="inv", op_timeout_s=0.3,
                          connect_timeout_s=0.3, deletions_block_s=0.2, breaker_base_s=0.05,
                          breaker_cap_s=0.2, retries=0)
    opened = [Store.open(StoreConfig(path=tmp_path / name, hbm_bytes=8 * n, dram_bytes=0, nvme_bytes=0,
                                     master_key=MASTER, remote=remote, remote_write="through"))
              for name in ("a", "b")]
    yield opened[0], opened[1], private_redis
    private_redis.resume()
    for s in opened:
        s.close()


def test_a_paused_redis_stalls_nothing_and_close_is_prompt(paused_pair) -> None:
    a, b, r = paused_pair
    keys, kv = shared_chain(a, b)
    r.pause()
    wait_for(lambda: counter(b, "remote_deletions_read_errors") >= 2, what="B's reader failing")
    t0 = time.monotonic()
    assert torch.equal(b.get("acme", SPEC, keys), kv)  # local: the reader holds nothing up
    assert time.monotonic() - t0 < 1.0
    r.resume()
    assert a.delete("acme", [keys[0]]) == 3
    wait_for(applied(b), what="B's reader back after Redis answered again")
    assert b.lookup("acme", SPEC, keys).num_blocks == 0
    r.pause()
    t0 = time.monotonic()
    b.close()
    assert time.monotonic() - t0 < 1.5, "close waited for a read blocked on the paused Redis"


def test_the_stream_is_trimmed_and_its_config_checked(private_redis) -> None:
    for bad in ({"deletions_maxlen": 0}, {"deletions_maxlen": 99}, {"deletions_maxlen": True},
                {"deletions_block_s": 0}, {"deletions_block_s": float("inf")}):
        with pytest.raises(pydantic.ValidationError):
            RemoteConfig(urls=[private_redis.url], **bad)
        with pytest.raises(InvalidArgument):
            RemoteConfig.build(urls=[private_redis.url], **bad)
    cfg = RemoteConfig(urls=[private_redis.url], namespace="trim", deletions_maxlen=100)
    t = RemoteTier.open(cfg, MASTER)
    try:
        for i in range(350):
            t.purge_model(i.to_bytes(16, "big"))
        raw = private_redis.raw()
        assert counter_of(t, "deletions_published") == 350
        assert 100 <= raw.xlen("trim:deletions") < 350  # MAXLEN ~: whole nodes of entries go
    finally:
        t.close()
    off = RemoteTier.open(cfg.model_copy(update={"share_deletions": False, "namespace": "off"}), MASTER)
    try:
        off.purge_model(bytes(16))
        assert private_redis.raw().exists("off:deletions") == 0
    finally:
        off.close()


def counter_of(t: RemoteTier, name: str) -> int:
    return t.metrics().get(name, 0)


def test_a_publish_that_fails_is_counted_and_the_delete_stands(private_redis, tmp_path: Path) -> None:
    """A user that may not XADD: the deletion itself succeeds (counted, logged)."""
    raw: redis.Redis = private_redis.raw()
    raw.execute_command("ACL", "SETUSER", "noxadd", "on", ">pw", "~*", "&*", "+@all", "-xadd")
    n = SPEC.block_nbytes
    remote = RemoteConfig(urls=[private_redis.url], namespace="pub", username="noxadd", password="pw")
    s = Store.open(StoreConfig(path=tmp_path / "s", hbm_bytes=8 * n, dram_bytes=0, nvme_bytes=0,
                               master_key=MASTER, remote=remote, remote_write="through"))
    try:
        keys = s.block_keys("acme", SPEC, tokens(2, SPEC))
        s.put("acme", SPEC, keys, make_kv(SPEC, 2))
        s.flush()
        assert s.delete("acme", [keys[0]]) == 2
        assert counter(s, "remote_deletions_publish_failed") == 1
        assert counter(s, "remote_deletions_published") == 0
        assert in_redis(s, "acme", SPEC, keys) == 0
    finally:
        s.close()


# -- authenticated entries, tenant deletions -------------------------------------------------------
# Anyone who can write to the Redis (another application sharing it, a compromised client) could
# XADD entries that made every server drop any tenant's local blocks, or every block of a model:
# the entries were not authenticated. And drop_tenant was not published: the other servers went
# on serving the dropped tenant's local copies.
def raw_stream(servers) -> tuple[redis.Redis, str]:
    return redis.Redis.from_url(servers.url), f"{servers.ns}:deletions"


def entry(ns: str, mac: bool = True, **fields: bytes) -> dict[bytes, bytes]:
    """Fields of a stream entry (``mac``: signed with the key of the servers' master key)."""
    f = {b"v": b"2", b"origin": b"f" * 32, b"kind": b"subtree", b"tenant": b"", b"fps": b"", b"keys": b""}
    f.update({k.encode(): v for k, v in fields.items()})
    if mac:
        f[b"mac"] = entry_mac(derive_deletions_key(MASTER, ns), f)
    return f


def acme_hex(tenant: str = "acme") -> bytes:
    return tenant_hash(tenant).hex().encode()


def read_past(a: Store, b: Store) -> None:
    """Wait until B has read every entry in the stream now: A deletes a block of its own and
    B applies that entry (the stream is read in order)."""
    n = counter(b, "remote_deletions_applied")
    key = a.block_keys("zz-barrier", SPEC, tokens(1, SPEC, start=7000 + n))
    a.put("zz-barrier", SPEC, key, make_kv(SPEC, 1))
    assert a.delete("zz-barrier", key) == 1
    wait_for(applied(b, n + 1), what="B reading past the entries written before")


def test_forged_entries_drop_nothing_and_are_counted(servers) -> None:
    a, b = servers("a"), servers("b")
    keys, kv = shared_chain(a, b)
    r, stream = raw_stream(servers)
    doomed = {"kind": b"subtree", "tenant": acme_hex(), "fps": SPEC.fingerprint, "keys": b"".join(keys)}
    r.xadd(stream, {"v": b"1", "origin": b"e" * 32, **doomed})  # the format before: no MAC
    r.xadd(stream, entry(servers.ns, mac=False, **doomed))  # no MAC
    r.xadd(stream, {**entry(servers.ns, mac=False, **doomed), b"mac": bytes(32)})  # a wrong one
    r.xadd(stream, entry(servers.ns, mac=False, kind=b"model", fps=SPEC.fingerprint) | {b"mac": b"x"})
    read_past(a, b)
    assert b.lookup("acme", SPEC, keys).tiers == ["hbm"] * 3
    assert torch.equal(b.get("acme", SPEC, keys), kv)
    assert counter(b, "remote_deletions_unauthenticated") == 4
    assert counter(b, "remote_deletions_applied") == 1  # read_past's
    assert counter(b, "deleted_elsewhere") == 0
    wait_for(lambda: counter(a, "remote_deletions_unauthenticated") >= 4, what="A refusing them too")


def test_an_authentic_entry_with_another_key_list_is_refused(servers) -> None:
    """An entry A really published (its MAC is genuine), with its key list (and tenant) replaced
    by another tenant's blocks: the MAC covers every field, so it no longer verifies."""
    a, b = servers("a"), servers("b")
    keys, kv = shared_chain(a, b)
    other, _ = shared_chain(a, b, n=1, tenant="globex")
    assert a.delete("globex", other) == 1
    wait_for(applied(b), what="B applying A's genuine deletion")
    r, stream = raw_stream(servers)
    (_, genuine), = r.xrevrange(stream, count=1)
    assert genuine[b"keys"] == other[0] and b"mac" in genuine
    r.xadd(stream, {**genuine, b"keys": b"".join(keys)})  # same tenant field, other keys
    r.xadd(stream, {**genuine, b"tenant": acme_hex(), b"keys": b"".join(keys)})
    r.xadd(stream, {**genuine, b"tenant": acme_hex()})
    read_past(a, b)
    assert b.lookup("acme", SPEC, keys).tiers == ["hbm"] * 3
    assert torch.equal(b.get("acme", SPEC, keys), kv)
    assert counter(b, "remote_deletions_unauthenticated") == 3
    assert counter(b, "remote_deletions_applied") == 2  # the genuine one and read_past's


def test_an_entry_from_a_server_with_another_master_key_is_refused(servers) -> None:
    """A tier with another master key (unencrypted, so its keyring's check does not stop it at
    open) shares the namespace: its model purge deletes in Redis, but B keeps its local copies."""
    a, b = servers("a"), servers("b")
    keys, kv = shared_chain(a, b)
    cfg = RemoteConfig(urls=[servers.url], namespace=servers.ns, encrypt=False)
    stranger = RemoteTier.open(cfg, bytes(range(32, 64)))
    try:
        stranger.purge_model(SPEC.fingerprint)
        assert counter_of(stranger, "deletions_published") == 1
    finally:
        stranger.close()
    read_past(a, b)
    assert b.lookup("acme", SPEC, keys).tiers == ["hbm"] * 3
    assert torch.equal(b.get("acme", SPEC, keys), kv)
    assert counter(b, "remote_deletions_unauthenticated") == 1
    assert counter(b, "remote_deletions_applied") == 1  # read_past's
    # the same key derived in another namespace does not verify either
    assert derive_deletions_key(MASTER, servers.ns) != derive_deletions_key(MASTER, servers.ns + "x")


def test_drop_tenant_on_a_drops_bs_local_copies_of_that_tenant_only(servers) -> None:
    a, b = servers("a"), servers("b", remote_write="demote")
    keys, _ = shared_chain(a, b)
    mine = b.block_keys("acme", SPEC, tokens(2, SPEC, start=500))
    b.put("acme", SPEC, mine, make_kv(SPEC, 2, seed=2))  # only B holds these (demote: not in Redis)
    kept = b.block_keys("globex", SPEC, tokens(3, SPEC))
    kv = make_kv(SPEC, 3, seed=9)
    b.put("globex", SPEC, kept, kv)
    b.open_session("acme", "s1")
    b.set_tenant_policy("acme", ttl_s=600.0)
    assert b._remote._keyring.cached("acme") is not None  # read acme's blocks: its key is cached
    assert a.drop_tenant("acme") == 3
    wait_for(applied(b), what="B applying A's tenant deletion")
    assert b.lookup("acme", SPEC, keys).num_blocks == 0
    assert b.lookup("acme", SPEC, mine).num_blocks == 0
    assert b.get("acme", SPEC, keys).shape[0] == 0
    assert counter(b, "deleted_elsewhere") == 5 and counter(b, "remote_deletions_blocks_dropped") == 5
    assert b.lookup("globex", SPEC, kept).tiers == ["hbm"] * 3  # another tenant: untouched
    assert torch.equal(b.get("globex", SPEC, kept), kv)
    assert b.session_state("acme", "s1").name == "ACTIVE"  # only its blocks go
    assert b._remote._keyring.cached("acme") is None  # read from Redis next time (destroyed)
    assert counter(a, "remote_deletions_published") == 1
    # a tenant B holds no block of: nothing happens there
    a.drop_tenant("initech")
    wait_for(applied(b, 2), what="B applying the second tenant deletion")
    assert counter(b, "deleted_elsewhere") == 5
    assert b.lookup("globex", SPEC, kept).tiers == ["hbm"] * 3


def test_malformed_entries_are_counted_and_skipped_and_the_reader_goes_on(servers) -> None:
    """Entries with a MAC but not of this format (an extra field, more keys than an entry holds,
    an unknown kind, a tenant that is not a hash, a model purge without a model) and fields that
    are not bytes at all: counted, never applied, and the reader keeps reading."""
    a, b = servers("a"), servers("b")
    keys, kv = shared_chain(a, b)
    r, stream = raw_stream(servers)
    ns, acme = servers.ns, acme_hex()
    too_many = b"".join(keys) + bytes(32) * ENTRY_KEYS
    bad = [entry(ns, kind=b"subtree", tenant=acme, keys=b"".join(keys)) | {b"x": b"1"},
           entry(ns, v=b"1", kind=b"subtree", tenant=acme, keys=too_many),
           entry(ns, tenant=acme, keys=b"".join(keys), fps=bytes(17)),
           entry(ns, kind=b"everything", tenant=acme, keys=b"".join(keys)),
           entry(ns, kind=b"subtree", tenant=b"acme", keys=b"".join(keys)),
           entry(ns, kind=b"model"),
           entry(ns, kind=b"tenant", tenant=acme, keys=keys[0])]
    for f in bad:
        r.xadd(stream, f)
    read_past(a, b)
    assert b.lookup("acme", SPEC, keys).tiers == ["hbm"] * 3
    assert torch.equal(b.get("acme", SPEC, keys), kv)
    assert counter(b, "remote_deletions_malformed") == len(bad)
    assert counter(b, "remote_deletions_applied") == 1  # read_past's
    # fields of types Redis does not return: Malformed (which the reader counts), nothing else
    for fields in (None, [(b"v", b"2")], {b"v": 2, b"mac": b"x"}, {"kind": "model", b"mac": b"x"},
                   {**bad[0], b"y": b"2"}):
        with pytest.raises(Malformed):
            parse_entry("1-1", fields, derive_deletions_key(MASTER, ns))
    with pytest.raises(Unauthenticated):
        parse_entry("1-1", {b"v": b"2"}, derive_deletions_key(MASTER, ns))
    assert a.delete("acme", [keys[0]]) == 3  # the reader is still there
    wait_for(applied(b, 2), what="B applying a genuine deletion after them")
    assert b.lookup("acme", SPEC, keys).num_blocks == 0
