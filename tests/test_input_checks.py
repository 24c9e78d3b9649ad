"""Bad input on the Store's and the Client's verbs is a typed InvalidArgument (or the closed
store's FailedPrecondition), never a bare Python exception, a silent success, or a store that
another tenant's bad name breaks. Each case here was found by a prober on the old code:

* a tenant name with a lone surrogate was taken by ``put``; once its block went to NVMe every
  put that made room (any tenant's), ``close`` and its own ``drop_tenant`` raised
  UnicodeEncodeError, and the store stayed open holding its directory lock;
* ``Client.put`` checked shape and dtype of a tensor only: a numpy array of the right size but
  the wrong layout or dtype was stored;
* keys=None, spec=None, a list for quotas, a str TTL raised TypeError / AttributeError; a bool
  quota, a fingerprint of the wrong type, an empty put on a closed store or by a tenant of the
  wrong type passed silently.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_kv, tokens
from service_harness import SPEC, fresh_tokens, random_kv

from kvstore.errors import FailedPrecondition, InvalidArgument, KVStoreError

BAD = "a\udc80"


def test_a_tenant_name_utf8_cannot_encode_is_refused_and_breaks_no_one(open_store, spec):
    s = open_store(spec, hbm_blocks=1, dram_blocks=1, nvme_blocks=16)
    keys = s.block_keys("good", spec, tokens(1, spec))
    for call in (lambda: s.put(BAD, spec, keys, make_kv(spec, 1)),
                 lambda: s.put_bytes(BAD, spec, keys, [bytes(spec.block_nbytes)]),
                 lambda: s.block_keys(BAD, spec, tokens(1, spec)),
                 lambda: s.lookup(BAD, spec, keys),
                 lambda: s.drop_tenant(BAD)):
        with pytest.raises(InvalidArgument, match="tenant .*lone surrogate"):
            call()
    for i in range(4):  # every put pushes the one before down to NVMe: nothing poisoned
        k = s.block_keys("good", spec, tokens(1, spec, start=100 * i))
        s.put("good", spec, k, make_kv(spec, 1, seed=i))
    assert s.stats()["tiers"]["nvme"]["used_bytes"] > 0  # the spill path ran
    for i in range(4):
        k = s.block_keys("good", spec, tokens(1, spec, start=100 * i))
        assert torch.equal(s.get("good", spec, k), make_kv(spec, 1, seed=i))
    s.close()  # raised UnicodeEncodeError when a poisoned block was waiting


def test_an_extra_key_utf8_cannot_encode_is_refused(open_store, spec):
    s = open_store(spec)
    with pytest.raises(InvalidArgument, match="extra key"):
        s.block_keys("t", spec, tokens(1, spec), extra_keys=["img\ud800"])


@pytest.mark.parametrize("keys", [None, 7, object()])
def test_keys_that_are_not_a_sequence_are_refused(open_store, spec, keys):
    s = open_store(spec)
    for call in (s.lookup, s.get):
        with pytest.raises(InvalidArgument, match="keys must be a sequence"):
            call("t", spec, keys)


def test_calls_missing_a_spec_or_a_tenant_are_refused(open_store, spec):
    s = open_store(spec)
    keys = s.block_keys("t", spec, tokens(1, spec))
    with pytest.raises(InvalidArgument, match="spec must be a ModelSpec"):
        s.prefetch("t", None, keys)
    with pytest.raises(InvalidArgument, match="spec must be a ModelSpec"):
        s.reserve_put("t", None, keys)
    for tenant in (None, "x" * 10_000):
        with pytest.raises(InvalidArgument, match="tenant must be"):
            s.prefetch(tenant, spec, keys)
    empty = make_kv(spec, 0)
    with pytest.raises(InvalidArgument, match="tenant must be"):
        s.put(123, spec, [], empty)
    with pytest.raises(InvalidArgument, match="tenant must be"):
        s.put_bytes(123, spec, [], [])


def test_quotas_must_be_a_mapping_of_int_bytes(open_store, spec):
    s = open_store(spec)
    with pytest.raises(InvalidArgument, match="quota_bytes must map"):
        s.set_tenant_policy("t", quota_bytes=[("hbm", 1)])
    with pytest.raises(InvalidArgument, match="non-negative int"):
        s.set_tenant_policy("t", quota_bytes={"hbm": True})
    s.set_tenant_policy("t", quota_bytes={"hbm": 0})  # a real zero quota is fine


@pytest.mark.parametrize("fp", ["not a fingerprint", None, b"short"])
def test_a_fingerprint_must_be_a_spec_fingerprint(open_store, spec, fp):
    s = open_store(spec)
    with pytest.raises(InvalidArgument, match="fingerprint must be"):
        s.purge_model(fp)
    with pytest.raises(InvalidArgument, match="fingerprint must be"):
        s.set_model_quantization(fp, "int8")
    assert s.purge_model(spec.fingerprint) == 0


def test_a_closed_store_refuses_even_calls_with_nothing_to_do(open_store, spec):
    s = open_store(spec)
    s.close()
    with pytest.raises(FailedPrecondition, match="closed"):
        s.put("t", spec, [], make_kv(spec, 0))
    with pytest.raises(FailedPrecondition, match="closed"):
        s.set_model_quantization(spec.fingerprint, "int8")


@pytest.mark.parametrize("local", [True, False], ids=["shm", "stream"])
def test_client_put_checks_a_numpy_arrays_shape_and_dtype(sidecar, local):
    c = sidecar.tenant(f"np-{int(local)}", local=local)
    keys = c.block_keys(SPEC, fresh_tokens(2))
    kv = random_kv(2, seed=5)
    for wrong in (kv.numpy().reshape(2, -1), kv.numpy().reshape(2, 2, 2, 2, 16 * 16)):
        with pytest.raises(KVStoreError, match="shape"):  # the right byte count, another layout
            c.put(SPEC, keys, wrong)
    as_f32 = np.zeros((2, *SPEC.block_shape[:-1], SPEC.block_shape[-1] // 2), np.float32)
    assert as_f32.nbytes == 2 * SPEC.block_nbytes
    with pytest.raises(KVStoreError, match="dtype|shape"):
        c.put(SPEC, keys, as_f32)
    assert c.lookup(SPEC, keys=keys).num_blocks == 0  # nothing stored
    c.put(SPEC, keys, kv.numpy())  # the right array is taken
    assert torch.equal(c.get(SPEC, iter(keys)), kv)  # a key iterator, as Store.get takes
    # values, not the bytes as they lie: a reversed view, a big-endian copy; raw bytes as before
    more = c.block_keys(SPEC, fresh_tokens(2))
    c.put(SPEC, more, kv.numpy()[::-1])
    assert torch.equal(c.get(SPEC, more), kv.flip(0))
    more = c.block_keys(SPEC, fresh_tokens(2))
    c.put(SPEC, more, kv.numpy().astype(">f2"))
    assert torch.equal(c.get(SPEC, more), kv)
    more = c.block_keys(SPEC, fresh_tokens(2))
    c.put(SPEC, more, kv.view(torch.uint8).reshape(2, -1).numpy())
    assert torch.equal(c.get(SPEC, more), kv)


def test_client_put_refuses_a_ttl_that_is_not_a_number(sidecar):
    c = sidecar.tenant("ttl-str", local=False)
    keys = c.block_keys(SPEC, fresh_tokens(1))
    with pytest.raises(InvalidArgument, match="ttl_s must be"):
        c.put(SPEC, keys, random_kv(1), ttl_s="5")


def test_a_tier_given_twice_in_quotas_is_refused(open_store, spec):
    """{"HBM": 5, "hbm": 7} kept one of the two, silently."""
    s = open_store(spec)
    with pytest.raises(InvalidArgument, match="given twice"):
        s.set_tenant_policy("t", quota_bytes={"HBM": 5 << 20, "hbm": 7 << 20})


def test_client_target_and_admin_limits_are_checked_up_front():
    from kvstore.admin_client import AdminClient
    from kvstore.client import Client

    for target in ("", "  "):  # grpc failed at the first call: UNKNOWN "Failed to create channel"
        with pytest.raises(InvalidArgument, match="target"):
            Client(target, "tok")
    with pytest.raises(InvalidArgument, match="max_message_bytes"):  # it named a chunk_bytes=1
        AdminClient("127.0.0.1:1", "tok", max_message_bytes=1000)


def test_deleting_a_malformed_shared_namespace_is_refused(sidecar):
    with pytest.raises(InvalidArgument):  # it answered OK
        sidecar.admin().delete_tenant("shared:BAD NAME/..")


def test_a_store_directory_that_cannot_be_made_is_a_typed_error(tmp_path):
    """A raw OSError before (a read-only file system, a file in the way)."""
    from conftest import MASTER

    from kvstore.config import StoreConfig
    from kvstore.store import Store

    (tmp_path / "file").write_text("x")
    with pytest.raises(FailedPrecondition, match="cannot make the store directory"):
        Store.open(StoreConfig(path=tmp_path / "file" / "store", hbm_bytes=1 << 20, dram_bytes=0,
                               nvme_bytes=0, master_key=MASTER))
