"""A demotion another server wrote after a deletion, before it read the deletion's entry, is
deleted from Redis again when that server applies the entry (``rewrite_window_s``).

Before, server B's writer could write block K to Redis after server A's delete had unlinked it
and before B's reader applied A's entry (about a millisecond on loopback): K was back in Redis,
served to every server and promoted, though the tenant had deleted it, and B never deleted a
remote copy when it applied an entry. Each test makes that interleaving happen for certain: B's
reader is held before it applies anything while B's writer, held too, writes K after A's
deletion; only then is the entry applied. A third, fresh server C then reads Redis as any
other would.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis
import torch
from conftest import make_kv, tokens, wait_until

from kvstore.spec import ModelSpec
from kvstore.store import Store
from tiers.base import BlockRef

SPEC = ModelSpec(model="m", revision="r1", num_layers=2, num_kv_heads=2, head_dim=8,
                 dtype="float16", block_tokens=4)
OTHER = ModelSpec(model="m", revision="r2", num_layers=2, num_kv_heads=2, head_dim=8,
                  dtype="float16", block_tokens=4)


def counter(s: Store, name: str) -> int:
    return s.stats()["counters"].get(name, 0)


def in_redis(s: Store, tenant: str, spec: ModelSpec, keys: list[bytes]) -> int:
    """How many of the blocks ``keys`` have a value in Redis (an ``EXISTS`` each)."""
    t = s._remote
    assert t is not None
    return sum(t._client.exists(t.redis_key(BlockRef(tenant, k, spec))) for k in keys)


@dataclass
class Held:
    """B's deletions reader and its remote writer, each held by a gate until the test opens it."""

    reader: threading.Event
    writer: threading.Event
    writing: threading.Event  # set once B's writer holds a write back
    read: threading.Event  # set once B's reader holds an entry back


@pytest.fixture
def held(servers: Callable[..., Store]) -> Iterator[Callable[[Store], Held]]:
    """``held(b)``: from now on B's reader holds every entry (before applying any of it) until
    ``reader`` is set, and B's writer holds every write until ``writer`` is set. Both gates
    open at the end of the test, whatever happened."""
    gates: list[Held] = []

    def hold(b: Store) -> Held:
        tier = b._remote
        assert tier is not None
        h = Held(threading.Event(), threading.Event(), threading.Event(), threading.Event())
        take, put_with = tier._take, tier._put_with

        def held_take(*args: Any) -> Any:
            h.read.set()
            assert h.reader.wait(30), "the test never let B's reader go"
            return take(*args)

        def held_put(*args: Any) -> Any:
            h.writing.set()
            assert h.writer.wait(30), "the test never let B's writer go"
            return put_with(*args)

        tier._take = held_take  # type: ignore[method-assign]
        tier._put_with = held_put  # type: ignore[method-assign]
        gates.append(h)
        return h

    yield hold
    for h in gates:
        h.reader.set()
        h.writer.set()


def land_after(a: Store, b: Store, h: Held, delete: Callable[[], int], tenant: str, spec: ModelSpec,
               keys: list[bytes]) -> None:
    """B's queued writes land in Redis after ``delete`` (on A) and before B applies its entry:
    the window this closes. Checks that they did land (the interleaving happened), then lets
    B's reader apply the entry and waits for it."""
    assert h.writing.wait(10), "B's writer never took its queued writes"
    assert delete() > 0
    assert h.read.wait(10), "B's reader never got A's entry"
    assert in_redis(a, tenant, spec, keys) == 0  # A's deletion went
    h.writer.set()
    b.flush()
    assert in_redis(a, tenant, spec, keys) == len(keys), "B's writes did not land after the deletion"
    applied = counter(b, "remote_deletions_applied")
    h.reader.set()
    assert wait_until(lambda: counter(b, "remote_deletions_applied") > applied), "B never applied the entry"


def absent_everywhere(servers: Callable[..., Store], tenant: str, spec: ModelSpec, keys: list[bytes]) -> None:
    """No value of ``keys`` in Redis, and a fresh server reading it serves none of them."""
    c = servers("c")
    assert in_redis(c, tenant, spec, keys) == 0, "B's write after the deletion is still in Redis"
    assert c.get(tenant, spec, keys).shape[0] == 0
    assert c.lookup(tenant, spec, keys).num_blocks == 0


def test_a_block_b_wrote_after_a_delete_is_deleted_when_b_applies_the_entry(servers, held) -> None:
    a, b = servers("a"), servers("b")
    keys = a.block_keys("acme", SPEC, tokens(3, SPEC))
    kv = make_kv(SPEC, 3)
    a.put("acme", SPEC, keys, kv)
    a.flush()
    # what the entry does not cover: another chain of acme, the same tokens of globex, both
    # written by B (before the gates) within the window
    other = b.block_keys("acme", SPEC, tokens(2, SPEC, start=500))
    b.put("acme", SPEC, other, make_kv(SPEC, 2, seed=1))
    globex = b.block_keys("globex", SPEC, tokens(3, SPEC))
    b.put("globex", SPEC, globex, make_kv(SPEC, 3, seed=2))
    b.flush()
    h = held(b)
    b.put("acme", SPEC, keys, kv)  # written through: queued, its write held
    land_after(a, b, h, lambda: a.delete("acme", [keys[0]]), "acme", SPEC, keys)
    absent_everywhere(servers, "acme", SPEC, keys)
    assert b.lookup("acme", SPEC, keys).num_blocks == 0
    assert counter(b, "remote_deletions_rewritten") == 3
    # B published what it deleted again (values were found): the others' copies go too
    assert counter(b, "remote_deletions_published") == 1
    # A applies B's entry, finds nothing of its own to delete again: no echo back
    assert wait_until(lambda: counter(a, "remote_deletions_applied") == 1)
    assert counter(a, "remote_deletions_published") == 1 and counter(a, "remote_deletions_rewritten") == 0
    assert in_redis(a, "acme", SPEC, other) == 2, "a block of the tenant the entry does not cover went"
    assert in_redis(a, "globex", SPEC, globex) == 3, "a block of another tenant with the same tokens went"
    assert torch.equal(servers("d").get("acme", SPEC, other), make_kv(SPEC, 2, seed=1))


def test_a_child_b_wrote_under_a_deleted_block_is_deleted_too(servers, held) -> None:
    """B extends a chain A deletes: the child B writes after the deletion is not in A's entry
    (it was not in Redis when A walked the subtree); B finds it through its local subtree."""
    a, b = servers("a"), servers("b")
    keys = a.block_keys("acme", SPEC, tokens(3, SPEC))
    kv = make_kv(SPEC, 3)
    a.put("acme", SPEC, keys[:2], kv[:2])
    a.flush()
    h = held(b)
    b.put("acme", SPEC, keys, kv)
    land_after(a, b, h, lambda: a.delete("acme", [keys[0]]), "acme", SPEC, keys)
    absent_everywhere(servers, "acme", SPEC, keys)
    assert counter(b, "remote_deletions_rewritten") == 3


def test_a_block_b_wrote_after_a_model_purge_is_deleted_when_b_applies_the_entry(servers, held) -> None:
    a, b = servers("a"), servers("b")
    keys = a.block_keys("acme", SPEC, tokens(2, SPEC))
    kv = make_kv(SPEC, 2)
    a.put("acme", SPEC, keys, kv)
    a.flush()
    kept = b.block_keys("acme", OTHER, tokens(2, OTHER))
    b.put("acme", OTHER, kept, make_kv(OTHER, 2, seed=1))  # another model: not purged
    b.flush()
    h = held(b)
    b.put("acme", SPEC, keys, kv)
    land_after(a, b, h, lambda: a.purge_model(SPEC.fingerprint), "acme", SPEC, keys)
    absent_everywhere(servers, "acme", SPEC, keys)
    assert counter(b, "remote_deletions_rewritten") == 2
    assert in_redis(a, "acme", OTHER, kept) == 2, "a block of another model went"


def test_a_block_b_wrote_after_a_tenant_drop_is_deleted_when_b_applies_the_entry(servers, held) -> None:
    """Unencrypted: nothing checks the tenant's data key with the write, and the tombstone B
    read with its earlier write of the tenant (none), cached ``key_cache_ttl_s``, admits it
    (encrypted, the key's check in the write's round trip takes it back)."""
    plain = {"encrypt": False}
    a, b = servers("a", remote=plain), servers("b", remote=plain)
    keys = a.block_keys("acme", SPEC, tokens(2, SPEC))
    kv = make_kv(SPEC, 2)
    a.put("acme", SPEC, keys, kv)
    a.flush()
    b.put("acme", SPEC, b.block_keys("acme", SPEC, tokens(1, SPEC, start=700)), make_kv(SPEC, 1, seed=3))
    kept = b.block_keys("globex", SPEC, tokens(2, SPEC))
    b.put("globex", SPEC, kept, make_kv(SPEC, 2, seed=1))
    b.flush()
    h = held(b)
    b.put("acme", SPEC, keys, kv)
    land_after(a, b, h, lambda: a.drop_tenant("acme"), "acme", SPEC, keys)
    absent_everywhere(lambda name: servers(name, remote=plain), "acme", SPEC, keys)
    assert counter(b, "remote_deletions_rewritten") == 2
    assert in_redis(a, "globex", SPEC, kept) == 2, "a block of another tenant went"


def test_redis_failing_while_b_deletes_its_rewrites_is_counted_not_raised(servers, held) -> None:
    """The reader goes on (the next entry is applied); the blocks are counted, not deleted."""
    a, b = servers("a"), servers("b")
    keys = a.block_keys("acme", SPEC, tokens(2, SPEC))
    kv = make_kv(SPEC, 2)
    a.put("acme", SPEC, keys, kv)
    a.flush()
    h = held(b)
    tier = b._remote
    assert tier is not None

    def unreachable(*args: Any) -> Any:
        raise redis.exceptions.ConnectionError("Redis went away")

    b.put("acme", SPEC, keys, kv)
    tier._still_there = unreachable  # type: ignore[method-assign]
    land_after(a, b, h, lambda: a.delete("acme", [keys[0]]), "acme", SPEC, keys)
    assert counter(b, "remote_deletions_rewritten_failed") == 2
    assert counter(b, "remote_deletions_apply_errors") == 0
    assert "hbm" not in b.lookup("acme", SPEC, keys).tiers  # the local part was done
    assert in_redis(a, "acme", SPEC, keys) == 2  # what could not be deleted stays (counted)
    more = a.block_keys("acme", SPEC, tokens(1, SPEC, start=300))
    a.put("acme", SPEC, more, make_kv(SPEC, 1))
    a.delete("acme", more)
    assert wait_until(lambda: counter(b, "remote_deletions_applied") == 2), "B's reader stopped"


def test_an_entry_that_finds_nothing_rewritten_deletes_and_publishes_nothing(servers) -> None:
    """B wrote the chain before A's delete (so A deleted it): applying the entry finds B's
    writes recorded, deletes nothing more and publishes nothing (no echo of A's entry)."""
    a, b = servers("a"), servers("b")
    keys = b.block_keys("acme", SPEC, tokens(3, SPEC))
    b.put("acme", SPEC, keys, make_kv(SPEC, 3))
    b.flush()
    assert a.delete("acme", [keys[0]]) == 3
    assert wait_until(lambda: counter(b, "remote_deletions_applied") == 1)
    assert counter(b, "remote_deletions_rewritten") == 0
    assert counter(b, "remote_deletions_published") == 0
    assert counter(a, "remote_deletions_applied") == 0


def test_recent_writes_are_bounded_in_time_and_count() -> None:
    from tiers.remote_writer import RecentWrites  # here: the other tests run on the code before it

    now = [100.0]
    recent = RecentWrites(5.0, 3, lambda: now[0])
    k = [bytes([i]) * 32 for i in range(5)]
    recent.add(BlockRef("acme", k[0], SPEC), None)
    recent.add(BlockRef("acme", k[1], SPEC), k[0])
    assert {w.key for w in recent.under("acme", [k[0]])} == {k[0], k[1]}  # the child too
    assert recent.under("globex", [k[0]]) == []
    now[0] += 5.5  # both older than the window
    recent.add(BlockRef("acme", k[2], SPEC), None)
    assert recent.under("acme", [k[0], k[1]]) == []
    for key in k[3:]:
        recent.add(BlockRef("acme", key, SPEC), None)
    recent.add(BlockRef("acme", k[2], OTHER), None)  # the fourth within the window: the oldest goes
    assert [w.fingerprint for w in recent.under("acme", [k[2]])] == [OTHER.fingerprint]
    recent.forget("acme", [(k[3], SPEC.fingerprint)])
    assert recent.under("acme", [k[3]]) == []
    assert RecentWrites(0.0, 3, lambda: now[0]).tenants() == set()


def test_applying_a_chains_entry_walks_the_local_chain_once(servers) -> None:
    """An entry names every block of the deleted subtree, and B walked the local subtree of
    each one: quadratic in the chain (2,048 blocks: 4.6 s under the Store's lock, every call of
    every tenant waiting). Counted: the children lists B's reader asks its index for."""
    n = 256
    a, b = servers("a", hbm=n + 8), servers("b", hbm=n + 8)
    keys = a.block_keys("acme", SPEC, tokens(n, SPEC))
    kv = make_kv(SPEC, n)
    a.put("acme", SPEC, keys, kv)
    a.flush()
    b.put("acme", SPEC, keys, kv)
    b.flush()
    asked = [0]
    children = b._index.children

    def counted(meta: Any) -> Any:
        if threading.current_thread().name == "kvstore-remote-deletions":
            asked[0] += 1
        return children(meta)

    b._index.children = counted  # type: ignore[method-assign]
    assert a.delete("acme", [keys[0]]) == n
    assert wait_until(lambda: counter(b, "remote_deletions_applied") == 1)
    assert b.lookup("acme", SPEC, keys).num_blocks == 0
    assert asked[0] <= 4 * n, f"{asked[0]} children lists asked for a chain of {n}"
