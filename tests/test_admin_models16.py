"""Admin ListModels / ``kvstore model list``: the models stored and their fingerprints.

Before: an operator rolling a model out could purge it only by fingerprint (``kvstore model
purge``, Admin PurgeModel), and nothing told them the fingerprint: they had to compute
``ModelSpec.fingerprint`` in Python from every field of the old spec."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from service_harness import SPEC, fresh_tokens, random_kv, start
from typer.testing import CliRunner

from kvstore.cli_serve import admin_app
from kvstore.errors import PermissionDenied


@pytest.fixture
def sidecar(tmp_path):
    sc = start(tmp_path)
    yield sc
    sc.stop()


def _cli(sc, *args: str):
    return CliRunner().invoke(admin_app, [*args, "--target", sc.target, "--token", sc.admin_token],
                              env={"COLUMNS": "200"})


def test_models_are_listed_with_the_fingerprint_purge_takes(sidecar):
    old, new = SPEC, replace(SPEC, revision="r2")
    a, b = sidecar.tenant("a", local=False), sidecar.tenant("b", local=False)
    a.put(old, a.block_keys(old, fresh_tokens(3)), random_kv(3))
    b.put(old, b.block_keys(old, fresh_tokens(1)), random_kv(1))
    a.put(new, a.block_keys(new, fresh_tokens(1)), random_kv(1))

    models = sidecar.admin().list_models()
    assert models == [
        {"fingerprint": old.fingerprint.hex(), "model": old.model, "revision": old.revision, "dtype": old.dtype,
         "block_tokens": old.block_tokens, "blocks": 4, "bytes": 4 * old.block_nbytes, "tenants": 2},
        {"fingerprint": new.fingerprint.hex(), "model": new.model, "revision": "r2", "dtype": new.dtype,
         "block_tokens": new.block_tokens, "blocks": 1, "bytes": new.block_nbytes, "tenants": 1},
    ]
    result = _cli(sidecar, "model", "list")
    assert result.exit_code == 0, result.output
    assert old.fingerprint.hex() in result.stdout and new.fingerprint.hex() in result.stdout  # never cut
    assert json.loads(_cli(sidecar, "model", "list", "--json").stdout) == models

    # what the list shows is what purge takes
    result = _cli(sidecar, "model", "purge", models[0]["fingerprint"], "--yes")
    assert result.exit_code == 0, result.output
    assert [m["revision"] for m in sidecar.admin().list_models()] == ["r2"]


def test_a_tenant_cannot_list_models_and_the_refusal_is_audited(sidecar):
    t = sidecar.tenant("a", local=False)
    from kvstore.admin_client import AdminClient

    with AdminClient(sidecar.target, t._metadata[0][1].split()[-1]) as as_tenant, pytest.raises(PermissionDenied):
        as_tenant.list_models()
    entries = [e for e in sidecar.admin().audit() if e["action"] == "model.list"]
    assert [(e["principal"], e["result"]) for e in entries] == [("a", "PERMISSION_DENIED")]
    sidecar.admin().list_models()  # an admin's read is not audited (as stats)
    assert len([e for e in sidecar.admin().audit() if e["action"] == "model.list"]) == 1
