"""Two crash windows that lost something for good, each found by a kill -9 at one point.

* ``Store.drop_tenant`` commits its block deletions, then destroys the tenant's data key.
  Killed between the two, the key stayed on disk for good: nothing at the next open destroyed
  it (recovery dropped blocks without a key, never a key without blocks), so the freed pages'
  ciphertext stayed readable under it and a tenant created again under the name got it
  (DESIGN.md §7 invariant 5). Now the key is condemned first (durably), and the next open
  drops whatever blocks the tenant still has, then destroys the key.
* ``kvstore serve``'s first start saved the admin principal, then wrote an audit entry and
  several lines before printing the admin token. Killed in between, the token was never seen
  and every later start, finding an admin, printed none: no admin token could be had. Now the
  registry records that the token was not shown until it is; the next start replaces it and
  prints the new one.

The crashes run in child processes that ``os._exit`` at the point (as a kill -9 leaves them:
nothing closed or committed at exit).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from service_harness import serve_once

from kvstore.audit import AuditLog
from kvstore.auth import AuthRegistry, Role
from kvstore.config import StoreConfig
from kvstore.errors import KeyUnavailable, Unauthenticated
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


# The first start of ``kvstore serve`` dies at the audit entry of the first admin's creation:
# after the admin was saved, before its token was printed.
_SERVE_CHILD = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    sys.path[:0] = [{tests!r}, {root!r}]
    from service_harness import config
    from kvstore import audit
    from kvstore.server import serve

    real = audit.AuditLog.append
    def append(self, principal, action, target, result, detail="", *a, **k):
        if action == "tenant.create" and "first start" in detail:
            os._exit(9)
        return real(self, principal, action, target, result, detail, *a, **k)
    audit.AuditLog.append = append
    serve(config(Path(sys.argv[1])))
""").format(tests=str(TESTS), root=str(ROOT))


def test_a_first_start_killed_before_it_printed_the_admin_token_leaves_the_next_one_to(tmp_path):
    proc = subprocess.run([sys.executable, "-c", _SERVE_CHILD, str(tmp_path)], capture_output=True, text=True,
                          timeout=120, env=ENV, cwd=str(ROOT), check=False)
    assert proc.returncode == 9, proc.stdout + proc.stderr
    assert "admin token" not in proc.stdout
    assert "admin" in json.loads((tmp_path / "auth.json").read_text())["principals"]  # saved, never shown

    lines = serve_once(tmp_path)
    shown = [ln for ln in lines if ln.startswith("admin token (shown once, store it now): ")]
    assert len(shown) == 1, lines
    token = shown[0].rsplit(" ", 1)[1]
    registry = AuthRegistry(tmp_path / "auth.json", clock=lambda: 0.0)
    assert registry.authenticate(token).role is Role.ADMIN
    last = AuditLog(tmp_path / "audit.log", clock=lambda: 0.0).read(0, 100)[-1]
    assert (last.principal, last.action, last.target, last.result) == ("kvstore serve", "tenant.rotate",
                                                                       "admin", "OK")

    # shown once: the next start prints none, and the token still works
    lines = serve_once(tmp_path)
    assert not any("admin token" in ln for ln in lines), lines
    assert AuthRegistry(tmp_path / "auth.json", clock=lambda: 0.0).authenticate(token).role is Role.ADMIN


def test_an_admin_token_never_confirmed_shown_is_replaced_until_one_is(tmp_path):
    path = tmp_path / "auth.json"
    first = AuthRegistry(path, clock=lambda: 0.0).ensure_admin()
    assert first is not None and not first.replaced  # saved; killed before it was shown

    registry = AuthRegistry(path, clock=lambda: 0.0)
    again = registry.ensure_admin()
    assert again is not None and again.replaced and again.name == first.name
    assert registry.authenticate(again.token).role is Role.ADMIN
    with pytest.raises(Unauthenticated):
        registry.authenticate(first.token)  # never seen: it stops working
    registry.admin_token_shown(again)

    registry = AuthRegistry(path, clock=lambda: 0.0)
    assert registry.ensure_admin() is None
    assert registry.authenticate(again.token).role is Role.ADMIN
