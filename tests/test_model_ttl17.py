"""A model fingerprint's TTL (``Store.set_model_ttl``, Admin SetModelPolicy, ``kvstore model policy``).

DESIGN.md §4 has TTLs per tenant and per model; only the tenant's existed. An operator rolling a
model out could purge the old model's blocks at once (``model purge``), not age them out while
the new model's cache warms. Now a model's TTL caps at once every stored block of the model,
every tenant's, in every tier (index, NVMe record, copies in Redis of any server), and a put,
re-put or promotion gives one of its blocks at most now + the lesser of its tenant's TTL and its
model's; removing or raising it extends nothing. It is saved in the principals file, applied again
at a start, and audited as ``model.policy.set`` (before -> after).
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from conftest import make_kv, tokens
from service_harness import SPEC, fresh_tokens, random_kv, restart, start
from typer.testing import CliRunner

from kvstore.cli_serve import admin_app
from kvstore.errors import InvalidArgument
from kvstore.spec import ModelSpec


def _present(s, tenant: str, spec: ModelSpec, keys: list[bytes]) -> int:
    return s.lookup(tenant, spec, keys).num_blocks


# -- the Store ------------------------------------------------------------------------------------
@pytest.mark.parametrize("hbm_blocks", [0, 2, 8])
def test_a_model_ttl_caps_every_tenants_blocks_of_that_model_only(open_store, spec, clock, tmp_path, hbm_blocks):
    """Blocks of the old model (tenants a and b) and of the new one, put without a TTL, in HBM,
    DRAM and NVMe; the old model's TTL is set to 10 s: 10 s later every block of the old model
    is gone, every tenant's, across a restart that sets no policy (the NVMe records carry the
    cap); the new model's blocks stay."""
    new = replace(spec, revision="r2")
    path = tmp_path / "s"
    s = open_store(spec, hbm_blocks=hbm_blocks, dram_blocks=1, nvme_blocks=32, path=path, durable=True)
    old_a = s.block_keys("a", spec, tokens(4, spec))
    old_b = s.block_keys("b", spec, tokens(3, spec, start=100))
    new_a = s.block_keys("a", new, tokens(3, new))
    s.put("a", spec, old_a, make_kv(spec, 4))
    s.put("b", spec, old_b, make_kv(spec, 3, seed=1))
    s.put("a", new, new_a, make_kv(new, 3, seed=2))
    s.set_model_ttl(spec.fingerprint, 10.0)
    assert s.model_ttl(spec.fingerprint) == 10.0 and s.model_ttl(new.fingerprint) is None
    s.close()
    s = open_store(spec, hbm_blocks=hbm_blocks, dram_blocks=1, nvme_blocks=32, path=path, durable=True)
    clock.advance(9.0)
    assert (_present(s, "a", spec, old_a), _present(s, "b", spec, old_b)) == (4, 3)  # not before its time
    clock.advance(1.0)
    assert (_present(s, "a", spec, old_a), _present(s, "b", spec, old_b)) == (0, 0)  # were 4 and 3 for ever
    clock.advance(30 * 86400.0)
    assert _present(s, "a", new, new_a) == 3  # another model's blocks keep theirs


def test_a_put_after_gets_at_most_the_model_ttl_and_the_lesser_with_the_tenants(open_store, spec, clock):
    s = open_store(spec)
    s.set_model_ttl(spec.fingerprint, 20.0)
    long_ = s.block_keys("a", spec, tokens(1, spec))
    none_ = s.block_keys("a", spec, tokens(1, spec, start=100))
    s.put("a", spec, long_, make_kv(spec, 1), ttl_s=100.0)  # the model's TTL bounds the put's own
    s.put("a", spec, none_, make_kv(spec, 1))  # and is the default of a put that gives none
    s.set_tenant_policy("b", ttl_s=5.0)
    tb = s.block_keys("b", spec, tokens(1, spec))
    s.put("b", spec, tb, make_kv(spec, 1))  # the tenant's is less: it wins
    clock.advance(4.0)
    s.put("a", spec, long_, make_kv(spec, 1), ttl_s=100.0)  # a re-put: now + 20 at most
    clock.advance(1.0)
    assert _present(s, "b", spec, tb) == 0
    clock.advance(14.0)  # t = 19
    assert (_present(s, "a", spec, long_), _present(s, "a", spec, none_)) == (1, 1)
    clock.advance(1.0)  # t = 20
    assert _present(s, "a", spec, none_) == 0
    assert _present(s, "a", spec, long_) == 1  # re-put at 4: until 24
    clock.advance(4.0)
    assert _present(s, "a", spec, long_) == 0  # was 104


def test_a_reput_of_a_block_without_a_deadline_is_capped_by_the_model_ttl(open_store, spec, clock):
    """The later of none and now + TTL is none: a re-put must still leave now + TTL at most (a
    block kept without a deadline: put before the TTL, which was put in force without touching
    the stored blocks, as the Admin plane does before its save)."""
    s = open_store(spec)
    keys = s.block_keys("a", spec, tokens(2, spec))
    s.put("a", spec, keys, make_kv(spec, 2))
    s.set_model_ttl(spec.fingerprint, 10.0, enforce=False)
    s.put("a", spec, keys, make_kv(spec, 2))
    clock.advance(10.0)
    assert _present(s, "a", spec, keys) == 0


def test_raising_or_removing_a_model_ttl_extends_nothing(open_store, spec, clock):
    s = open_store(spec)
    keys = s.block_keys("a", spec, tokens(2, spec))
    s.put("a", spec, keys, make_kv(spec, 2))
    s.set_model_ttl(spec.fingerprint, 10.0)
    s.set_model_ttl(spec.fingerprint, 50.0)
    s.set_model_ttl(spec.fingerprint, None)
    assert s.model_ttl(spec.fingerprint) is None
    clock.advance(10.0)
    assert _present(s, "a", spec, keys) == 0


def test_bad_input_is_refused_naming_the_field(open_store, spec):
    s = open_store(spec)
    for fp in (b"", b"x" * 15, spec.fingerprint.hex()):
        with pytest.raises(InvalidArgument, match="fingerprint"):
            s.set_model_ttl(fp, 10.0)  # type: ignore[arg-type]
    for ttl in (0.0, -1.0, float("nan"), float("inf"), 1e10, True):
        with pytest.raises(InvalidArgument, match="ttl_s"):
            s.set_model_ttl(spec.fingerprint, ttl)
    assert s.model_ttl(spec.fingerprint) is None


# -- the remote tier ------------------------------------------------------------------------------
def test_remote_copies_of_the_model_are_capped_and_a_promotion_too(servers, spec):
    """Server A sets the old model's TTL: the copies B wrote of it (two tenants) are capped in
    Redis, the new model's copies are not: a third server misses the old ones after the cap,
    not the new ones. A copy B writes later without a TTL is capped when A promotes it."""
    a, b = servers("a"), servers("b")
    clock = servers.clock
    new = replace(spec, revision="r2")
    tk = b.block_keys("t", spec, tokens(2, spec))
    b.put("t", spec, tk, make_kv(spec, 2))
    uk = b.block_keys("u", spec, tokens(1, spec, start=500))
    b.put("u", spec, uk, make_kv(spec, 1))
    nk = b.block_keys("t", new, tokens(2, new, start=900))
    b.put("t", new, nk, make_kv(new, 2))
    b.flush()
    a.set_model_ttl(spec.fingerprint, 10.0)
    a.flush()  # the writer capped them
    assert a._remote.metrics()["ttl_capped"] == 3
    later = b.block_keys("t", spec, tokens(1, spec, start=1300))
    b.put("t", spec, later, make_kv(spec, 1))  # after the cap: no deadline in Redis
    b.flush()
    assert a.get("t", spec, later).shape[0] == 1  # promoted into A, capped at now + 10
    a.flush()  # and its copy's deadline moved in Redis
    c = servers("c")
    clock.advance(9.0)
    assert (c.lookup("t", spec, tk).num_blocks, c.lookup("u", spec, uk).num_blocks) == (2, 1)
    clock.advance(1.0)
    assert (c.lookup("t", spec, tk).num_blocks, c.lookup("u", spec, uk).num_blocks) == (0, 0)
    assert c.lookup("t", spec, later).num_blocks == 0 and a.lookup("t", spec, later).num_blocks == 0
    assert c.lookup("t", new, nk).num_blocks == 2


# -- the service, the CLI -------------------------------------------------------------------------
@pytest.fixture
def sidecar(tmp_path):
    sc = start(tmp_path)
    yield sc
    sc.stop()


def _cli(sc, *args: str):
    return CliRunner().invoke(admin_app, [*args, "--target", sc.target, "--token", sc.admin_token],
                              env={"COLUMNS": "200"})


def test_set_model_policy_caps_audits_and_survives_a_restart(sidecar):
    old, new = SPEC, replace(SPEC, revision="r2")
    a, b = sidecar.tenant("a", local=False), sidecar.tenant("b", local=False)
    ka, kb = a.block_keys(old, fresh_tokens(2)), b.block_keys(old, fresh_tokens(1))
    kn = a.block_keys(new, fresh_tokens(2))
    a.put(old, ka, random_kv(2))
    b.put(old, kb, random_kv(1))
    a.put(new, kn, random_kv(2))
    admin = sidecar.admin()
    assert admin.get_model_policy(old.fingerprint) == {"fingerprint": old.fingerprint.hex(), "ttl_s": None}
    assert admin.set_model_policy(old.fingerprint.hex(), ttl_s=30.0) == {
        "fingerprint": old.fingerprint.hex(), "ttl_s": 30.0}
    entries = [e for e in admin.audit() if e["action"] == "model.policy.set"]
    assert [(e["target"], e["result"], e["detail"]) for e in entries][-1] == (
        old.fingerprint.hex(), "OK", "ttl_s=None -> ttl_s=30.0")

    sc = restart(sidecar)
    try:
        admin = sc.admin()
        assert admin.get_model_policy(old.fingerprint)["ttl_s"] == 30.0
        a2 = sc.client(a._metadata[0][1].split()[-1], local=False)
        k2 = a2.block_keys(old, fresh_tokens(1))
        sc.clock.now += 10.0
        a2.put(old, k2, random_kv(1), ttl_s=1000.0)  # put after the restart: 30 s at most
        sc.clock.now += 20.0  # 30 s after the set
        assert a2.lookup(old, ka).num_blocks == 0
        assert a2.lookup(old, k2).num_blocks == 1
        assert a2.lookup(new, kn).num_blocks == 2  # another model's blocks stay
        sc.clock.now += 10.0
        assert a2.lookup(old, k2).num_blocks == 0  # was 1000 s
        admin.set_model_policy(old.fingerprint)  # removed
        assert admin.get_model_policy(old.fingerprint)["ttl_s"] is None
        entries = [e for e in admin.audit() if e["action"] == "model.policy.set"]
        assert entries[-1]["detail"] == "ttl_s=30.0 -> ttl_s=None"
    finally:
        sc.stop()


def test_the_cli_sets_shows_and_clears_a_model_ttl(sidecar):
    fp = SPEC.fingerprint.hex()
    result = _cli(sidecar, "model", "policy", fp)
    assert result.exit_code == 0, result.output
    assert result.stdout == f"model {fp}: ttl none\n"
    result = _cli(sidecar, "model", "policy", fp, "--ttl", "3600")
    assert result.exit_code == 0, result.output
    assert result.stdout == f"model {fp}: ttl 3600 s (1 h 00 min)\n"
    assert json.loads(_cli(sidecar, "model", "policy", fp, "--json").stdout) == {"fingerprint": fp, "ttl_s": 3600.0}
    result = _cli(sidecar, "model", "policy", fp, "--clear")
    assert result.exit_code == 0, result.output
    assert result.stdout == f"model {fp}: ttl none\n"
    assert _cli(sidecar, "model", "policy", fp, "--ttl", "5", "--clear").exit_code != 0
    result = _cli(sidecar, "model", "policy", "abc")
    assert result.exit_code != 0 and "FINGERPRINT" in result.output
    result = _cli(sidecar, "model", "policy", fp, "--ttl", "-1")
    assert result.exit_code == 1 and "ttl_s" in result.output


def test_a_bad_fingerprint_or_ttl_is_refused_over_the_api(sidecar):
    admin = sidecar.admin()
    with pytest.raises(InvalidArgument, match="fingerprint must be 16 bytes"):
        admin.set_model_policy(b"abc", ttl_s=10.0)
    with pytest.raises(InvalidArgument, match="fingerprint must be 16 bytes"):
        admin.get_model_policy(b"")
    with pytest.raises(InvalidArgument, match="fingerprint must be hex"):
        admin.set_model_policy("zz", ttl_s=10.0)
    with pytest.raises(InvalidArgument, match="ttl_s"):
        admin.set_model_policy(SPEC.fingerprint, ttl_s=2e9)
    assert admin.get_model_policy(SPEC.fingerprint)["ttl_s"] is None  # nothing saved
