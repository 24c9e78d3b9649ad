"""Two small windows that lost something for good.

* ``kvstore serve``'s first start writes the master key (it wraps every tenant's data key:
  lost, every NVMe and remote block is unreadable) and, once ready, prints "generated master
  key ... back it up". Killed in between, the notice was never printed, and every later start,
  finding the key file, said nothing: nobody was told to back the key up. Now a mark beside the
  key (``master.key.unshown``), written before the key and removed only after the notice was
  printed, makes the next start print it, once.
* A Lookup, Get or refused Put that authenticated before its tenant's deletion and was counted
  after ``ServiceMetrics.forget_tenant`` made the deleted tenant's label series again, for as
  long as the sidecar ran (and took a place under ``max_tenant_labels``). Now a count made
  once the tenant is no principal any more is dropped.

The crash runs in a child process that ``os._exit`` s right after the key file is written (as a
kill -9 leaves it); the interleavings are forced by wrapping the metrics' count methods, so the
deletion runs between the call's work and its count.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest
from service_harness import SPEC, Sidecar, fresh_tokens, random_kv, serve_once, start

from kvstore.errors import ResourceExhausted

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
ENV = {**os.environ, "PYTHONPATH": f"{TESTS}{os.pathsep}{ROOT}"}
NOTICE = "generated master key: "

# The first start of ``kvstore serve`` dies right after the master key file was written.
_KEY_CHILD = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    sys.path[:0] = [{tests!r}, {root!r}]
    from service_harness import config
    from kvstore import keyring
    from kvstore.server import serve

    real = keyring._write_key_file
    def write(path, key):
        real(path, key)
        os._exit(9)
    keyring._write_key_file = write
    serve(config(Path(sys.argv[1])))
""").format(tests=str(TESTS), root=str(ROOT))


def test_a_first_start_killed_after_writing_the_master_key_leaves_its_notice_to_the_next(tmp_path):
    proc = subprocess.run([sys.executable, "-c", _KEY_CHILD, str(tmp_path)], capture_output=True, text=True,
                          timeout=120, env=ENV, cwd=str(ROOT), check=False)
    assert proc.returncode == 9, proc.stdout + proc.stderr
    key = (tmp_path / "master.key").read_bytes()  # written, never announced
    assert NOTICE not in proc.stdout

    lines = serve_once(tmp_path)
    assert [ln for ln in lines if ln.startswith(NOTICE)] == [
        f"{NOTICE}{tmp_path / 'master.key'} (back it up: without it NVMe blocks are unreadable)"], lines
    assert (tmp_path / "master.key").read_bytes() == key  # the same key, not a new one

    lines = serve_once(tmp_path)  # shown once: no more
    assert not any(ln.startswith(NOTICE) for ln in lines), lines
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("master.key")) == ["master.key"]


def test_a_first_start_that_lives_announces_the_key_once_and_leaves_no_mark(tmp_path):
    assert sum(ln.startswith(NOTICE) for ln in serve_once(tmp_path)) == 1
    assert not (tmp_path / "master.key.unshown").exists()
    assert not any(ln.startswith(NOTICE) for ln in serve_once(tmp_path))


# -- metrics of a tenant deleted while its call ran ------------------------------------------------
@pytest.fixture
def sc(tmp_path: Path) -> Iterator[Sidecar]:
    sidecar = start(tmp_path)
    try:
        yield sidecar
    finally:
        sidecar.stop()


def _delete_before(sc: Sidecar, monkeypatch: pytest.MonkeyPatch, count: str, tenant: str) -> list[Any]:
    """Make the server's next ``ServiceMetrics.<count>`` of ``tenant`` run after the tenant's
    deletion (through the Admin API): the call authenticated and did its work before. The
    list it returns gets the deletion's result."""
    metrics = sc.server.data.metrics
    assert metrics is sc.server.rpc.metrics
    real: Callable[..., None] = getattr(metrics, count)
    admin = sc.admin()
    deleted: list[Any] = []

    def racing(name_or_resource: str, *args: Any, **kwargs: Any) -> None:
        if not deleted and tenant in name_or_resource.split(":"):
            deleted.append(admin.delete_tenant(tenant))
        real(name_or_resource, *args, **kwargs)

    monkeypatch.setattr(metrics, count, racing)
    return deleted


def _series_of(sc: Sidecar, tenant: str) -> list[str]:
    """The endpoint's lines that name ``tenant`` (as a label value, or inside a quota resource)."""
    text = generate_latest(sc.server.metrics_registry).decode()
    return [ln for ln in text.splitlines() if f'"{tenant}"' in ln or f":{tenant}:" in ln]


def test_a_lookup_counted_after_its_tenant_was_deleted_makes_no_series(sc, monkeypatch):
    acme = sc.tenant("acme")
    keys = acme.block_keys(SPEC, fresh_tokens(2))
    acme.put(SPEC, keys, random_kv(2))
    assert acme.lookup(SPEC, keys).num_blocks == 2
    assert sc.server.metrics_registry.get_sample_value("kvstore_lookup_hit_blocks_total", {"tenant": "acme"}) == 2

    deleted = _delete_before(sc, monkeypatch, "lookup", "acme")
    acme.lookup(SPEC, keys)  # found both, then the deletion, then the count
    assert deleted == [2]
    assert _series_of(sc, "acme") == []

    again = sc.tenant("acme")  # a tenant created later under the name is counted again
    again.lookup(SPEC, again.block_keys(SPEC, fresh_tokens(1)))
    assert sc.server.metrics_registry.get_sample_value("kvstore_lookup_miss_blocks_total", {"tenant": "acme"}) == 1


@pytest.mark.parametrize("local", [False, True], ids=["get", "get_local"])
def test_a_get_counted_after_its_tenant_was_deleted_makes_no_series(sc, monkeypatch, local):
    acme = sc.tenant("acme", local=local)  # GetLocal through its shared-memory region, or Get
    keys = acme.block_keys(SPEC, fresh_tokens(2))
    acme.put(SPEC, keys, random_kv(2))
    deleted = _delete_before(sc, monkeypatch, "served", "acme")
    got = acme.get(SPEC, keys)
    assert len(got) == 2  # served in full, then the deletion, then the count
    assert deleted == [2]
    rpc = "GetLocal" if local else "Get"
    assert sc.server.metrics_registry.get_sample_value("kvstore_requests_total", {"rpc": rpc, "code": "OK"}) == 1
    assert _series_of(sc, "acme") == []


def test_a_quota_refusal_counted_after_its_tenant_was_deleted_makes_no_series(sc, monkeypatch):
    acme = sc.tenant("acme")
    sc.admin().set_policy("acme", quota_bytes={"hbm": 1, "dram": 1, "nvme": 1})
    keys = acme.block_keys(SPEC, fresh_tokens(1))
    with pytest.raises(ResourceExhausted):
        acme.put(SPEC, keys, random_kv(1))
    assert sc.server.metrics_registry.get_sample_value("kvstore_limit_rejections_total",
                                                       {"resource": "quota:acme:hbm"}) == 1

    deleted = _delete_before(sc, monkeypatch, "rejected", "acme")
    with pytest.raises(ResourceExhausted):
        acme.put(SPEC, keys, random_kv(1))
    assert deleted == [0]
    assert _series_of(sc, "acme") == []
