"""A tenant's data key and its blocks, across crashes and restarts (found by a crash probe).

* ``drop_tenant`` deleted the blocks in the call's NVMe batch (committed at its end) but
  destroyed the data key at once (its own LMDB): a crash between the two left blocks that no
  key opens. After the restart lookups announced them, gets missed them, and a put of the same
  prompt took them for stored and wrote nothing.
* With ``master.key`` missing beside an existing keyring, the Store wrote a new key there and
  then failed to open with "the master key is wrong", pointing the operator the wrong way.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_kv, tokens

from kvstore.config import StoreConfig
from kvstore.errors import FailedPrecondition
from kvstore.store import Store
from tiers.nvme import tenant_prefix


def _records_on_disk(store: Store, tenant: str) -> int:
    """Committed records of ``tenant`` (a read transaction sees only committed writes)."""
    nvme = store._nvme
    prefix = tenant_prefix(tenant)
    with nvme._env.begin() as txn:
        return sum(1 for k, _ in txn.cursor(db=nvme._meta) if bytes(k).startswith(prefix))


def test_drop_tenant_commits_the_deletions_before_it_destroys_the_key(open_store, spec):
    s = open_store(spec, hbm_blocks=0, dram_blocks=0, nvme_blocks=16)
    s.put("acme", spec, s.block_keys("acme", spec, tokens(3, spec)), make_kv(spec, 3))
    assert _records_on_disk(s, "acme") == 3
    seen = []
    real = s.keyring.destroy

    def destroy(tenant: str) -> bool:
        seen.append(_records_on_disk(s, tenant))  # what a crash right now would leave
        return real(tenant)

    s.keyring.destroy = destroy
    s.drop_tenant("acme")
    assert seen == [0]


def test_blocks_left_without_their_key_are_dropped_at_open(open_store, spec, tmp_path):
    """The state such a crash left, made directly: the key gone, the blocks still on disk."""
    path = tmp_path / "k"
    s = open_store(spec, hbm_blocks=0, dram_blocks=0, nvme_blocks=16, path=path)
    keys = s.block_keys("acme", spec, tokens(3, spec))
    s.put("acme", spec, keys, make_kv(spec, 3))
    kept = s.block_keys("other", spec, tokens(1, spec))
    s.put("other", spec, kept, make_kv(spec, 1))
    s.keyring.destroy("acme")
    s.close()
    s = open_store(spec, hbm_blocks=0, dram_blocks=0, nvme_blocks=16, path=path)
    assert s.lookup("acme", spec, keys).num_blocks == 0
    assert s.stats()["counters"]["keyless_dropped"] == 3 and s.stats()["blocks"] == 1
    assert _records_on_disk(s, "acme") == 0
    kv = make_kv(spec, 3, seed=2)
    s.put("acme", spec, keys, kv)  # stored this time, under a new key
    assert torch.equal(s.get("acme", spec, keys), kv)
    assert s.lookup("other", spec, kept).num_blocks == 1


def test_a_missing_master_key_file_is_not_replaced_beside_a_keyring(tmp_path, spec):
    path = tmp_path / "m"
    cfg = StoreConfig(path=path, hbm_bytes=0, dram_bytes=0, nvme_bytes=16 * spec.block_nbytes)
    s = Store.open(cfg)
    s.put("acme", spec, s.block_keys("acme", spec, tokens(1, spec)), make_kv(spec, 1))
    s.close()
    key = (path / "master.key").read_bytes()
    (path / "master.key").unlink()
    with pytest.raises(FailedPrecondition, match="restore .*master.key"):
        Store.open(cfg)
    assert not (path / "master.key").exists()
    (path / "master.key").write_bytes(key)
    (path / "master.key").chmod(0o600)
    s = Store.open(cfg)
    assert s.stats()["blocks"] == 1
    s.close()
