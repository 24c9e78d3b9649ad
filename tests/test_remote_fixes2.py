"""Remote (Redis/Valkey) tier fixes, second round: deletions that reach every remote descendant
and every model, tenant deletion that fails before it deletes anything, concurrent tenant
deletions, TTL moves that reach the remote copy, data keys of re-created tenants, distinct
deletion counts, and clock skew.

Tests share the Redis on 127.0.0.1:6379 through the ``servers`` fixture (own namespace, one
FakeClock); tests that pause Redis use ``private_redis``. Nothing sleeps.
"""

from __future__ import annotations

import redis
from conftest import make_kv, tokens

from kvstore.spec import ModelSpec
from tiers.base import BlockRef
from tiers.remote_redis import RedisKeyBackend

SPEC = ModelSpec(model="m", revision="r1", num_layers=2, num_kv_heads=2, head_dim=8,
                 dtype="float16", block_tokens=4)
N = SPEC.block_nbytes


def _refs(tenant: str, keys: list[bytes], spec: ModelSpec = SPEC) -> list[BlockRef]:
    return [BlockRef(tenant, k, spec) for k in keys]


def _values(servers) -> list[bytes]:
    """The block values (``<ns>:<tenant>:<model>:<key>``) in the servers' namespace."""
    raw = redis.Redis.from_url(servers.url)
    try:
        return [k for k in raw.scan_iter(match=f"{servers.ns}:*", count=1000)
                if k.count(b":") == 3 and b":keyring:" not in k and b":dropped:" not in k]
    finally:
        raw.close()


# -- p4: two servers delete one tenant at once -----------------------------------------------------
def test_a_tenant_key_deleted_by_another_server_meanwhile_is_no_error(servers, monkeypatch) -> None:
    """Keyring.destroy checked ``tenant in backend`` then deleted it: when another server's
    drop_tenant deleted the key in between, a bare KeyError came out of drop_tenant and the
    remote purge never ran."""
    a = servers("a")
    keys = a.block_keys("acme", SPEC, tokens(2, SPEC))
    a.put("acme", SPEC, keys, make_kv(SPEC, 2))
    a.flush()
    assert len(_values(servers)) == 2
    real_get = RedisKeyBackend.__getitem__
    real_del = RedisKeyBackend.__delitem__

    def other_server_first(self, tenant):  # the other server's deletion lands first
        self._client.delete(self._k(tenant))
        return real_del(self, tenant)

    monkeypatch.setattr(RedisKeyBackend, "__delitem__", other_server_first)
    monkeypatch.setattr(RedisKeyBackend, "__contains__",
                        lambda self, t: (real_get(self, t), self._client.delete(self._k(t)))[1] >= 0)
    a.drop_tenant("acme")  # raised KeyError
    assert _values(servers) == []
    assert a.get("acme", SPEC, keys).shape[0] == 0
