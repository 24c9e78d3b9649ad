"""A crash window that lost something for good, found by a kill -9 at one point.

* ``Store.drop_tenant`` commits its block deletions, then destroys the tenant's data key.
  Killed between the two, the key stayed on disk for good: nothing at the next open destroyed
  it (recovery dropped blocks without a key, never a key without blocks), so the freed pages'
  ciphertext stayed readable under it and a tenant created again under the name got it
  (DESIGN.md §7 invariant 5). Now the key is condemned first (durably), and the next open
  drops whatever blocks the tenant still has, then destroys the key.

The crashes run in child processes that ``os._exit`` at the point (as a kill -9 leaves it:
nothing closed or committed at exit).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kvstore.config import StoreConfig
from kvstore.errors import KeyUnavailable
from kvstore.keyring import Keyring
from kvstore.spec import ModelSpec
from kvstore.store import Store

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
ENV = {**os.environ, "PYTHONPATH": f"{TESTS}{os.pathsep}{ROOT}"}
MASTER = bytes(range(32))
SPEC = ModelSpec(model="crash17", revision="r", num_layers=2, num_kv_heads=2, head_dim=32,
                 dtype="bfloat16", block_tokens=8)
TOKENS = list(range(3 * SPEC.block_tokens))


def _store(path: Path) -> Store:
    return Store.open(StoreConfig(path=path, hbm_bytes=0, dram_bytes=0, nvme_bytes=16 << 20, device="cpu",
                                  master_key=MASTER))


# The child puts acme's blocks (straight to NVMe), prints its data key's id, and dies at
# ``point`` of the deletion: "destroy" (its block deletions committed, the key not yet
# destroyed) or "commit" (before the block deletions are committed).
_DROP_CHILD = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    import torch
    sys.path[:0] = [{tests!r}, {root!r}]
    from test_crash_windows17 import SPEC, TOKENS, _store

    path, point = Path(sys.argv[1]), sys.argv[2]
    s = _store(path)
    keys = s.block_keys("acme", SPEC, TOKENS)
    s.put("acme", SPEC, keys, torch.ones((len(keys), *SPEC.block_shape), dtype=SPEC.torch_dtype))
    print(s.keyring.key_id("acme").hex(), flush=True)
    if point == "destroy":
        s.keyring.destroy = lambda tenant: os._exit(9)
    else:
        s._nvme.commit_now = lambda: os._exit(9)
    s.drop_tenant("acme")
    print("the deletion ended without the crash", flush=True)
""").format(tests=str(TESTS), root=str(ROOT))


def _crash_in_drop(path: Path, point: str) -> bytes:
    """Run the child; returns the id of acme's data key before the deletion."""
    proc = subprocess.run([sys.executable, "-c", _DROP_CHILD, str(path), point],
                          capture_output=True, text=True, timeout=120, env=ENV, cwd=str(ROOT), check=False)
    assert proc.returncode == 9, proc.stdout + proc.stderr
    return bytes.fromhex(proc.stdout.split()[0])


@pytest.mark.parametrize("point", ["destroy", "commit"])
def test_drop_tenant_killed_before_its_key_is_destroyed_finishes_at_the_next_open(tmp_path, point):
    old_key = _crash_in_drop(tmp_path, point)

    s = _store(tmp_path)
    try:
        # the deletion finished: no key, condemned or not, and none of acme's blocks
        assert s.keyring.tenants() == [] and s.keyring.condemned() == []
        assert s.stats()["blocks"] == 0
        keys = s.block_keys("acme", SPEC, TOKENS)
        assert s.lookup("acme", SPEC, keys).num_blocks == 0
        # a tenant created again under the name gets a new key
        s.put("acme", SPEC, keys, torch.zeros((len(keys), *SPEC.block_shape), dtype=SPEC.torch_dtype))
        assert s.keyring.key_id("acme") not in (None, old_key)
    finally:
        s.close()


def test_a_condemned_key_is_no_key_to_a_keyring_opened_after(tmp_path):
    backend: dict[str, bytes] = {}
    ring = Keyring(MASTER, backend)
    key = ring.data_key("t")
    assert ring.condemn("t") and not ring.condemn("never")
    assert ring.data_key("t", create=False) == key  # the cached copy works until destroyed

    reopened = Keyring(MASTER, backend)
    assert reopened.tenants() == [] and reopened.condemned() == ["t"]
    with pytest.raises(KeyUnavailable):
        reopened.data_key("t", create=False)
    assert reopened.data_key("t") != key  # a new key replaces it
    assert reopened.condemned() == [] and reopened.tenants() == ["t"]
    assert ring.destroy("t") and backend.keys() == {""}

