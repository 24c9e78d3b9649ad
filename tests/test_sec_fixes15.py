"""Session 15's security fixes: a put racing a shared namespace's wipe, the audit of deletions
and of refused admin reads, an unknown role, and what a refused session put tells a tenant."""

from __future__ import annotations

import pytest
import torch
from service_harness import SPEC, HeldPut, fresh_tokens, random_kv

from kvstore import errors

torch.set_num_threads(1)


class _InNamespace:
    """A client whose ``put`` writes into ``namespace`` (for :class:`HeldPut`)."""

    def __init__(self, client, namespace: str) -> None:
        self.client, self.namespace = client, namespace

    def put(self, spec, keys, kv):
        return self.client.put(spec, keys, kv, namespace=self.namespace)


# -- 1: a put racing an admin's drop of a shared namespace's blocks ----------------------------
def test_a_put_racing_a_shared_namespace_drop_is_aborted_and_a_retry_stores(sidecar, monkeypatch):
    """DeleteTenant of ``shared:x`` drops its blocks; the namespace, its publishers and grants
    stay. A publisher's put under way failed UNAUTHENTICATED "tenant was deleted", though its
    token was valid and the same put made again succeeded: it is ABORTED now, saying to retry."""
    admin = sidecar.admin()
    pub = sidecar.client(admin.create_tenant("pub", "publisher", ["shared:x"]), local=False)
    keys = pub.block_keys(SPEC, fresh_tokens(2), namespace="shared:x")
    kv = random_kv(2)
    held = HeldPut(monkeypatch, _InNamespace(pub, "shared:x"), SPEC, keys, kv)
    admin.delete_tenant("shared:x")
    outcome = held.finish()
    monkeypatch.undo()
    assert getattr(outcome, "code", None) == "ABORTED", outcome
    assert not isinstance(outcome, errors.Unauthenticated)
    assert "dropped" in str(outcome) and "retry" in str(outcome)
    assert pub.lookup(SPEC, keys, namespace="shared:x").num_blocks == 0  # nothing was stored
    pub.put(SPEC, keys, kv, namespace="shared:x")
    assert pub.lookup(SPEC, keys, namespace="shared:x").num_blocks == 2


def test_a_reservation_before_a_drop_is_aborted_when_the_namespace_stays(open_store, spec):
    """In-process: a reservation made before ``drop_tenant(namespace_stays=True)`` fails its
    commit with Aborted; before a plain ``drop_tenant`` (the tenant deleted) Unauthenticated."""
    s = open_store(spec)
    for stays, expected in ((True, "ABORTED"), (False, "UNAUTHENTICATED")):
        name = "shared:x" if stays else "gone"
        keys = s.block_keys(name, spec, list(range(spec.block_tokens * 2)))
        since = s.drop_epoch
        res = s.reserve_put(name, spec, keys, since=since)
        s.drop_tenant(name, namespace_stays=True) if stays else s.drop_tenant(name)
        kv = random_kv(2, spec).contiguous().view(torch.uint8).reshape(2, -1).numpy()
        with pytest.raises(errors.KVStoreError) as err:
            s.commit_put(res, kv.__getitem__)
        assert err.value.code == expected
        with pytest.raises(errors.KVStoreError) as err:  # a reservation after the epoch read, too
            s.reserve_put(name, spec, keys, since=since)
        assert err.value.code == expected
        assert s.lookup(name, spec, keys).num_blocks == 0


def test_aborted_travels_as_its_own_typed_error():
    import grpc

    from kvstore.status import from_rpc_error, to_status

    assert to_status(errors.Aborted("retry"))[0] == grpc.StatusCode.ABORTED

    class _Err(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.ABORTED

        def details(self):
            return "retry"

    assert isinstance(from_rpc_error(_Err()), errors.Aborted)
