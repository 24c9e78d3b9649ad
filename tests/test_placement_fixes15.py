"""A refused put or resume moves nothing; a resume keeps the tier order.

* The up-front check of a put (``Store._refuse_what_cannot_fit`` with ``Placement.room_now``)
  counted only the put's new blocks, as if the chain's stored blocks (held by the put while it
  runs; pinned in HBM by a session put) could be evicted for them, and as if NVMe took what the
  memory tiers could not besides them (a block goes to NVMe only with NVMe copies of its
  ancestors, the put's own blocks above it included). Puts that could never fit passed it,
  evicted and demoted other tenants' blocks, then were refused.
* ``Placement.promote`` protected only the chain it was given: an ancestor already in the
  target tier whose children were all below it was a leaf there, and making room for the
  promoted blocks evicted it (a resumed session's block in HBM under a parent in DRAM).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from conftest import MASTER, tokens
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.config import StoreConfig
from kvstore.errors import KVStoreError, ResourceExhausted
from kvstore.spec import ModelSpec
from kvstore.store import Store

SPEC = ModelSpec(model="m", revision="r", num_layers=2, num_kv_heads=2, head_dim=8,
                 dtype="float16", block_tokens=4)
N = SPEC.block_nbytes


def kv(n: int) -> torch.Tensor:
    return torch.randn((n, *SPEC.block_shape)).to(SPEC.torch_dtype)


def toks(base: int, n: int) -> list[int]:
    return list(range(base, base + 4 * n))


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def open_store(tmp_path, clock=None, **kw) -> Store:
    cfg = StoreConfig(path=tmp_path / "s", master_key=MASTER, **kw)
    return Store.open(cfg, clock=clock) if clock is not None else Store.open(cfg)


MOVES = ("evictions", "demotions", "promotions", "nvme_ancestor_copies", "nvme_copies_dropped")


def state(s: Store):
    """Every block's place (tier, NVMe copy, pins) and every move counter."""
    blocks = {(m.tenant, m.key): (m.tier, m.persisted, m.pins, m.paused) for m in s._index}
    c = s.counters.snapshot()
    return blocks, {k: v for k, v in c.items() if k.startswith("moved_") or k in MOVES}


def tier_order_broken(s: Store) -> list[str]:
    bad = []
    for m in s._index:
        p = s._index.get(m.tenant, m.parent)
        if p is not None and p.tier > m.tier:
            bad.append(f"{m.tenant} depth {m.depth} in {m.tier.label} under a parent in {p.tier.label}")
    return bad


def test_resume_under_a_prefix_in_hbm_keeps_it_there(tmp_path):
    """The session's block continues (parent=) a prefix outside the session that sits in HBM;
    resuming it made room in HBM by evicting that prefix (an HBM leaf: its only child was in
    DRAM), and the block landed in HBM under a parent in DRAM."""
    clock = Clock()
    s = open_store(tmp_path, clock, hbm_bytes=4 * N, dram_bytes=8 * N, nvme_bytes=0, policy="lru",
                   high_watermark=1.0, low_watermark=1.0)
    full = s.block_keys("t", SPEC, toks(0, 3))
    s.put("t", SPEC, full[:2], kv(2))  # the prefix, HBM, least recent
    clock.t += 1
    s.open_session("t", "s")
    s.put("t", SPEC, full[2:], kv(1), parent=full[1], session="s")
    s.pause_session("t", "s")  # -> DRAM; the prefix stays in HBM
    for base in (5000, 7000):
        clock.t += 1
        s.put("t", SPEC, s.block_keys("t", SPEC, toks(base, 1)), kv(1))  # HBM full
    assert s.lookup("t", SPEC, full).tiers == ["hbm", "hbm", "dram"]
    clock.t += 1
    assert s.resume_session("t", "s") == 1
    assert tier_order_broken(s) == []
    assert s.lookup("t", SPEC, full).tiers == ["hbm", "hbm", "hbm"]
    s.close()


def test_resume_refused_up_front_when_its_prefix_holds_hbm(tmp_path):
    """The prefix the session continues takes HBM room the resume cannot have (the rest is
    pinned by another session): refused before anything moved."""
    s = open_store(tmp_path, hbm_bytes=4 * N, dram_bytes=8 * N, nvme_bytes=0, policy="lru",
                   high_watermark=1.0, low_watermark=1.0)
    full = s.block_keys("t", SPEC, toks(0, 3))
    s.put("t", SPEC, full[:2], kv(2))
    s.open_session("t", "s")
    s.put("t", SPEC, full[2:], kv(1), parent=full[1], session="s")
    s.pause_session("t", "s")
    s.open_session("o", "p")
    s.put("o", SPEC, s.block_keys("o", SPEC, toks(900, 2)), kv(2), session="p")  # HBM: 2 + 2 pinned
    before = state(s)
    with pytest.raises(ResourceExhausted):
        s.resume_session("t", "s")
    assert state(s) == before
    assert tier_order_broken(s) == []
    s.close()


@pytest.mark.parametrize("path", ["put", "reserve_put"])
def test_session_put_refused_before_demoting_when_its_chain_holds_hbm(tmp_path, path):
    """HBM 4: another tenant's block, the tenant's 2-block prompt (which the session put pins)
    and one free slot; the put adds 3 blocks: 5 in HBM can never be. It demoted the other
    tenant's block first (reserve_put even returned slots)."""
    s = open_store(tmp_path, hbm_bytes=4 * N, dram_bytes=3 * N, nvme_bytes=8 * N, policy="lru")
    other = s.block_keys("other", SPEC, toks(0, 2))
    s.put("other", SPEC, other, kv(2))
    s.open_session("t", "s1")
    s.put("t", SPEC, s.block_keys("t", SPEC, toks(1000, 2)), kv(2))
    full = s.block_keys("t", SPEC, toks(1000, 5))
    before = state(s)
    with pytest.raises(ResourceExhausted):
        if path == "put":
            s.put("t", SPEC, full, kv(5), session="s1")
        else:
            s.reserve_put("t", SPEC, full, session="s1")
    assert state(s) == before
    assert s.lookup("other", SPEC, other).tiers == ["hbm", "dram"]
    s.close()


@pytest.mark.parametrize("path", ["put", "reserve_put"])
def test_session_put_that_fits_with_its_chain_is_accepted(tmp_path, path):
    """The same with 2 new blocks: the prompt and them fill HBM exactly, and the put is taken
    (by reserve_put too: its commit copies the chain, so it reserves no slot that would hold
    HBM room twice)."""
    s = open_store(tmp_path, hbm_bytes=4 * N, dram_bytes=3 * N, nvme_bytes=8 * N, policy="lru")
    other = s.block_keys("other", SPEC, toks(0, 2))
    s.put("other", SPEC, other, kv(2))
    s.open_session("t", "s1")
    data = kv(4)
    s.put("t", SPEC, s.block_keys("t", SPEC, toks(1000, 2)), data[:2])
    full = s.block_keys("t", SPEC, toks(1000, 4))
    if path == "put":
        s.put("t", SPEC, full, data, session="s1")
    else:
        res = s.reserve_put("t", SPEC, full, session="s1")
        rows = data.view(torch.uint8).reshape(4, -1).numpy()
        for i, v in enumerate(res.views):
            if v is not None:
                v[:] = rows[i] if isinstance(v, np.ndarray) else torch.from_numpy(rows[i])
        s.commit_put(res, lambda i: rows[i])
    assert s.lookup("t", SPEC, full).tiers == ["hbm"] * 4
    assert torch.equal(s.get("t", SPEC, full).view(torch.uint8), data.view(torch.uint8))
    s.close()


def test_put_under_a_prefix_in_dram_refused_before_evicting(tmp_path):
    """HBM full of pinned blocks, no NVMe; DRAM 5: another tenant's block and the tenant's
    3-block prompt, which the put continues (parent=) and so holds: 3 new blocks cannot fit.
    The put evicted the other tenant's block, then was refused."""
    s = open_store(tmp_path, hbm_bytes=4 * N, dram_bytes=5 * N, nvme_bytes=0, policy="lru")
    s.open_session("pinner", "s")
    s.put("pinner", SPEC, s.block_keys("pinner", SPEC, toks(0, 4)), kv(4), session="s")
    ok = s.block_keys("other", SPEC, toks(500, 1))
    s.put("other", SPEC, ok, kv(1))
    full = s.block_keys("t", SPEC, toks(1000, 6))
    s.put("t", SPEC, full[:3], kv(3))
    before = state(s)
    with pytest.raises(ResourceExhausted):
        s.put("t", SPEC, full[3:], kv(3), parent=full[2])
    assert state(s) == before
    s.put("t", SPEC, full[3:4], kv(1), parent=full[2])  # one fits (the other tenant's block goes)
    assert s.lookup("t", SPEC, full).tiers == ["dram"] * 4
    s.close()


def test_put_refused_by_its_own_nvme_quota_evicts_nothing(tmp_path):
    """The put's stored prompt is on NVMe (its new blocks go there too) and takes 2 of its 3
    blocks of NVMe quota: 2 new blocks cannot fit. It evicted the tenant's other block first."""
    s = open_store(tmp_path, hbm_bytes=4 * N, dram_bytes=0, nvme_bytes=6 * N, policy="cost",
                   persist_on_close=False)

    def conv(c: int, own: int) -> list[int]:
        return list(range(8)) + [100_000 + 1000 * c + j for j in range(4 * own)]

    s.put("a", SPEC, s.block_keys("a", SPEC, conv(2, 3)), kv(5))
    s.set_tenant_policy("a", quota_bytes={"nvme": 3 * N}, priority=1)
    s.put("c", SPEC, s.block_keys("c", SPEC, conv(0, 1)), kv(3))
    k2 = s.block_keys("a", SPEC, conv(1, 2))
    assert s.lookup("a", SPEC, k2).tiers == ["nvme", "nvme"]
    before = state(s)
    with pytest.raises(ResourceExhausted) as e:
        s.put("a", SPEC, k2, kv(4))
    assert e.value.resource == "quota:a:nvme"
    assert state(s) == before
    s.close()


def test_put_whose_nvme_copies_exceed_its_quota_refused_up_front(tmp_path):
    """HBM pinned, DRAM 3, NVMe 8 (full of another tenant's blocks and copies); tenant b (NVMe
    quota 4 blocks) puts 5: 3 would go to DRAM, 2 to NVMe, which takes them only with copies
    of the 3 above (closure: a block committed without its ancestors is lost at a crash), 5 >
    4. It evicted the other tenant's NVMe blocks and DRAM blocks first. Refused up front now
    (the quota is NVMe usage, copies included; keeping the 2 blocks on NVMe without copies
    would break invariant 6)."""
    s = open_store(tmp_path, hbm_bytes=4 * N, dram_bytes=3 * N, nvme_bytes=8 * N, policy="lru",
                   persist_on_close=False, high_watermark=1.0, low_watermark=1.0)
    s.open_session("c", "s")
    s.put("c", SPEC, s.block_keys("c", SPEC, toks(0, 4)), kv(4), session="s")
    ka = s.block_keys("a", SPEC, toks(500, 8))
    s.put("a", SPEC, ka, kv(8))
    s.set_tenant_policy("b", quota_bytes={"nvme": 4 * N})
    before = state(s)
    with pytest.raises(ResourceExhausted) as e:
        s.put("b", SPEC, s.block_keys("b", SPEC, toks(9000, 5)), kv(5))
    assert e.value.resource == "quota:b:nvme"
    assert state(s) == before
    kb = s.block_keys("b", SPEC, toks(9000, 4))  # 4 fit: 3 above with copies, 1 on NVMe
    s.put("b", SPEC, kb, kv(4))
    assert s.lookup("b", SPEC, kb).num_blocks == 4
    s.close()


# -- property: a refused put, reserve or resume changes no block's place and no move counter --
CONFIGS = [
    {"hbm_bytes": 4 * N, "dram_bytes": 3 * N, "nvme_bytes": 8 * N, "policy": "lru"},
    {"hbm_bytes": 4 * N, "dram_bytes": 4 * N, "nvme_bytes": 0, "policy": "lru"},
    {"hbm_bytes": 4 * N, "dram_bytes": 0, "nvme_bytes": 6 * N, "policy": "cost", "persist_on_close": False},
    {"hbm_bytes": 3 * N, "dram_bytes": 3 * N, "nvme_bytes": 6 * N, "policy": "lru", "persist_on_close": False},
]


def conv_tokens(prompt: int, conv: int, own: int) -> list[int]:
    return [1000 * prompt + j for j in range(8)] + [100_000 + 1000 * conv + j for j in range(4 * own)]


def random_op(s: Store, r: random.Random, clock: Clock) -> list[tuple[str, object]]:
    """One random call as steps (kind, thunk) (a session put opens its session first). Puts, session puts (parent= or not), reserves, session
    verbs, gets and quota changes over 3 tenants sharing 2 prompts."""
    tenant = r.choice("abc")
    keys = s.block_keys(tenant, SPEC, conv_tokens(r.randrange(2), r.randrange(5), r.randrange(4)))
    sid = f"s{r.randrange(2)}"
    kind = r.choices(["put", "put_parent", "sess_put", "reserve", "verb", "get", "quota"],
                     weights=[5, 3, 4, 2, 5, 2, 1])[0]
    if kind == "put":
        return [(kind, lambda: s.put(tenant, SPEC, keys, kv(len(keys))))]
    if kind == "put_parent":
        cut = r.randrange(1, len(keys))
        return [(kind, lambda: s.put(tenant, SPEC, keys[cut:], kv(len(keys) - cut), parent=keys[cut - 1]))]
    if kind == "sess_put":
        cut = r.randrange(0, 2)
        return [("open", lambda: s.open_session(tenant, sid)),
                (kind, lambda: s.put(tenant, SPEC, keys[cut:], kv(len(keys) - cut), session=sid,
                                     parent=keys[cut - 1] if cut else None))]
    if kind == "reserve":
        session = r.choice([None, sid])

        def reserve() -> None:
            rows = kv(len(keys)).view(torch.uint8).reshape(len(keys), -1).numpy()
            res = s.reserve_put(tenant, SPEC, keys, session=session)
            for i, v in enumerate(res.views):
                if v is not None:
                    v[:] = rows[i] if isinstance(v, np.ndarray) else torch.from_numpy(rows[i])
            s.commit_put(res, lambda i: rows[i])
        opened = [("open", lambda: s.open_session(tenant, session))] if session is not None else []
        return [*opened, (kind, reserve)]
    if kind == "verb":
        verb = r.choice(["open", "pause", "pause", "resume", "resume", "close"])
        return [(kind, lambda: s.session_verb(tenant, sid, verb))]
    if kind == "get":
        clock.t += 1
        return [(kind, lambda: s.get(tenant, SPEC, keys))]
    tier = r.choice(["hbm", "dram", "nvme"])
    return [(kind, lambda: s.set_tenant_policy(tenant, quota_bytes={tier: r.randrange(2, 6) * N}))]


@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31), cfg=st.sampled_from(CONFIGS))
def test_refused_calls_move_nothing(tmp_path_factory, seed, cfg):
    r = random.Random(seed)
    clock = Clock()
    s = open_store(tmp_path_factory.mktemp("p"), clock, **cfg)
    try:
        for step in range(40):
            for kind, call in random_op(s, r, clock):
                before = state(s)
                try:
                    call()
                except ResourceExhausted as exc:
                    assert state(s) == before, f"step {step}: refused {kind} moved blocks: {exc}"
                except KVStoreError:
                    pass
                assert tier_order_broken(s) == [], f"step {step}: {kind}"
    finally:
        s.close()


def test_a_session_put_is_refused_up_front_while_another_stream_holds_reserved_slots(open_store, spec):
    """The room check counted pinned, in-flight and protected blocks but not the slots another
    call reserved for blocks still arriving (a Put stream between reserve_put and commit_put):
    a session put passed it, brought its blocks up evicting another tenant's, then was refused."""
    import numpy as np

    from kvstore.errors import ResourceExhausted

    s = open_store(spec, hbm_blocks=4, dram_blocks=16, nvme_blocks=64, policy="lru",
                   high_watermark=1.0, low_watermark=1.0)
    n = spec.block_nbytes
    a = s.block_keys("a", spec, tokens(2, spec))
    s.put_bytes("a", spec, a, [np.full(n, i, np.uint8) for i in range(2)])
    for i in range(4):  # push a's blocks down to DRAM
        s.put_bytes("c", spec, s.block_keys("c", spec, tokens(1, spec, start=100 * (i + 1))), [np.zeros(n, np.uint8)])
    res = s.reserve_put("b", spec, s.block_keys("b", spec, tokens(3, spec, start=900)))  # bytes arriving
    s.open_session("a", "s")
    where = {(m.tenant, m.key): m.tier for m in s._index}
    try:
        with pytest.raises(ResourceExhausted):
            s.put_bytes("a", spec, a, [np.full(n, i, np.uint8) for i in range(2)], session="s")
        assert {(m.tenant, m.key): m.tier for m in s._index} == where
    finally:
        s.abort_put(res)


def test_a_put_larger_than_memory_and_than_nvme_is_refused_as_never_fitting(tmp_path) -> None:
    """A put's blocks fit in the memory tiers or in NVMe, never in their sum (NVMe closure):
    a put of more than either in an empty store was refused by the room check instead, whose
    message blamed pinned or in-flight blocks and told the caller to retry."""
    s = open_store(tmp_path, hbm_bytes=4 * N, dram_bytes=0, nvme_bytes=5 * N)
    with s:
        keys = s.block_keys("t", SPEC, toks(0, 6))
        with pytest.raises(ResourceExhausted, match="can never fit.* at most 5 of them"):
            s.put("t", SPEC, keys, kv(6))
        assert s.lookup("t", SPEC, keys).num_blocks == 0
        s.put("t", SPEC, keys[:5], kv(5))  # the most it holds: four in HBM, all five on NVMe
        assert s.lookup("t", SPEC, keys).num_blocks == 5
    only_memory = open_store(tmp_path / "m", hbm_bytes=2 * N, dram_bytes=2 * N, nvme_bytes=0)
    with only_memory:  # no NVMe: the memory tiers together
        keys = only_memory.block_keys("t", SPEC, toks(0, 5))
        with pytest.raises(ResourceExhausted, match="at most 4 of them"):
            only_memory.put("t", SPEC, keys, kv(5))
        only_memory.put("t", SPEC, keys[:4], kv(4))
