"""Session 15's operations fixes: names ending in a newline, a config's problems on separate
lines, a tier given twice under two spellings, TOML booleans as numbers, a policy of a shared
namespace nobody uses, and ``local_data_plane = false``."""

from __future__ import annotations

import pytest
import torch

from kvstore import errors

torch.set_num_threads(1)


# -- names: ``$`` matched before a trailing newline -------------------------------------------
@pytest.mark.parametrize("name", ["acme\n", "x" * 63 + "\n", "acme\n\n"])
def test_a_principal_name_ending_in_a_newline_is_refused(name):
    from kvstore.auth import check_name, check_shared

    check_name("acme")
    check_name("x" * 63)
    with pytest.raises(errors.InvalidArgument):
        check_name(name)
    with pytest.raises(errors.InvalidArgument):
        check_shared("shared:" + name)


def test_a_region_name_ending_in_a_newline_is_refused():
    from kvstore.shm_checks import MEMFD_RE, NAME_RE

    assert NAME_RE.match("kvs_abc") and not NAME_RE.match("kvs_abc\n")
    assert MEMFD_RE.match("kvs_0123abcd@12:3") and not MEMFD_RE.match("kvs_0123abcd@12:3\n")


def test_the_admin_service_refuses_a_tenant_named_with_a_newline(sidecar):
    admin = sidecar.admin()
    admin.create_tenant("acme")
    for args in (("acme\n",), ("pub", "publisher", ["shared:pub\n"])):
        with pytest.raises(errors.InvalidArgument):
            admin.create_tenant(*args)
    assert sorted(t["name"] for t in admin.list_tenants()) == ["acme", "admin"]


# -- a config's problems: one line each ------------------------------------------------------
def test_serve_prints_each_config_problem_on_its_own_line(tmp_path, monkeypatch):
    """The whole message went through the control-character escape: the problems came out on
    one line joined by a literal ``\\x0a``. Other control characters stay escaped."""
    from typer.testing import CliRunner

    from kvstore.cli_serve import admin_app

    monkeypatch.setenv("COLUMNS", "300")
    cfg = tmp_path / "bad.toml"
    cfg.write_text(f'workers = 0\ncopy_threads = 0\n[store]\npath = "{tmp_path / "data"}"\nhbm_bytes = -1\n')
    result = CliRunner().invoke(admin_app, ["serve", "--config", str(cfg)])
    assert result.exit_code == 1
    assert "\\x0a" not in result.output
    lines = result.output.splitlines()
    assert any(line.strip().startswith("workers:") for line in lines), result.output
    assert any(line.strip().startswith("copy_threads:") for line in lines), result.output
    assert any(line.strip().startswith("store.hbm_bytes:") for line in lines), result.output


def test_a_failure_message_keeps_other_control_characters_escaped(capsys):
    import typer

    from kvstore.cli_serve import _fail

    with pytest.raises(typer.Exit):
        _fail(errors.InvalidArgument("one\x1b[31m\r\ntwo"))
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\\x1b" in err and "\\x0d" in err
    assert err.rstrip("\n").split("\n")[1] == "two"


# -- a tier given twice under two spellings --------------------------------------------------
@pytest.mark.parametrize("quota", [{"hbm": 1 << 20, "HBM": 2 << 20}, {"HBM": 2 << 20, "hbm": 1 << 20},
                                   {"dram": 1 << 20, "Dram": 3 << 20}])
def test_set_policy_refuses_a_tier_given_twice(sidecar, quota):
    """AdminPlane.set_policy folded the spellings into one dict before the Store could refuse
    the duplicate: one value was kept silently, which one by the order of the request's map."""
    admin = sidecar.admin()
    admin.create_tenant("q")
    with pytest.raises(errors.InvalidArgument, match="given twice"):
        admin.set_policy("q", quota_bytes=quota)
    assert admin.get_policy("q")["quota_bytes"] == {}
    assert admin.set_policy("q", quota_bytes={"HBM": 1 << 20})["quota_bytes"] == {"hbm": 1 << 20}


@pytest.mark.parametrize("quotas", [["hbm=1MiB", "HBM=2MiB"], ["dram=1MiB", " Dram =3MiB"]])
def test_policy_set_cli_refuses_a_tier_given_twice(sidecar, quotas):
    from typer.testing import CliRunner

    from kvstore.cli_serve import admin_app

    sidecar.admin().create_tenant("q")
    args = [a for q in quotas for a in ("--quota", q)]
    result = CliRunner().invoke(admin_app, ["policy", "set", "q", *args, "--target", sidecar.target,
                                            "--token", sidecar.admin_token])
    assert result.exit_code == 1, result.output
    assert "given twice" in result.output and "INVALID_ARGUMENT" in result.output
    assert sidecar.admin().get_policy("q")["quota_bytes"] == {}


# -- the policy of a shared namespace nobody uses --------------------------------------------
def test_policy_of_a_shared_namespace_nobody_uses_is_not_found(sidecar):
    """A mistyped shared namespace answered OK (``get`` an empty policy, ``set`` a policy
    recorded that binds nothing) where a mistyped tenant is NOT_FOUND."""
    admin = sidecar.admin()
    admin.create_tenant("pub", "publisher", ["shared:docs"])
    admin.create_tenant("reader", "tenant", ["shared:read"])
    for call in (lambda: admin.set_policy("shared:dosc", quota_bytes={"hbm": 1 << 20}),
                 lambda: admin.get_policy("shared:nothing")):
        with pytest.raises(errors.NotFound, match="shared:"):
            call()
    with pytest.raises(errors.NotFound):  # the refused set recorded nothing
        admin.get_policy("shared:dosc")
    # published or granted: a policy can be set and read
    assert admin.set_policy("shared:docs", ttl_s=5.0)["ttl_s"] == 5.0
    assert admin.set_policy("shared:read", ttl_s=6.0)["ttl_s"] == 6.0
    # its principals gone, the policy it has can still be read and replaced
    admin.delete_tenant("pub")
    assert admin.get_policy("shared:docs")["ttl_s"] == 5.0
    assert admin.set_policy("shared:docs", ttl_s=None)["ttl_s"] is None


# -- TOML booleans are not numbers -----------------------------------------------------------
@pytest.mark.parametrize("field", ["hbm_bytes", "dram_bytes", "nvme_bytes", "compression_level",
                                   "min_compress_ratio", "codec_threads", "high_watermark",
                                   "low_watermark", "default_ttl_s"])
@pytest.mark.parametrize("value", [True, False])
def test_a_boolean_in_a_numeric_store_field_is_refused(tmp_path, field, value):
    """pydantic took ``true`` as 1 and ``false`` as 0: ``hbm_bytes = true`` was a 1-byte tier,
    ``default_ttl_s = true`` a 1-second TTL, ``compression_level = false`` no compression."""
    from kvstore import server_config
    from kvstore.config import StoreConfig

    with pytest.raises(errors.InvalidArgument, match=rf"store\.{field}: {str(value).lower()} is a boolean"):
        server_config.build({"store": {"path": str(tmp_path), field: value}})
    with pytest.raises(errors.InvalidArgument, match=rf"{field}: {str(value).lower()} is a boolean"):
        StoreConfig.build(path=tmp_path, **{field: value})


def test_numbers_and_sizes_still_pass_in_store_fields(tmp_path):
    from kvstore.config import StoreConfig

    cfg = StoreConfig.build(path=tmp_path, hbm_bytes="1MiB", dram_bytes=2048, compression_level=0,
                            min_compress_ratio=2, default_ttl_s=5, high_watermark=1, encrypt=False)
    assert (cfg.hbm_bytes, cfg.dram_bytes, cfg.compression_level, cfg.default_ttl_s) == (1 << 20, 2048, 0, 5.0)
    assert cfg.min_compress_ratio == 2.0 and cfg.encrypt is False


# -- local_data_plane = false ----------------------------------------------------------------
def test_local_data_plane_false_refuses_regions_and_clients_use_streams(tmp_path):
    """The field was read nowhere: with ``local_data_plane = false`` clients still registered
    regions and moved blocks through shared memory."""
    from service_harness import SPEC, fresh_tokens, random_kv, start

    from kvstore.client import Client

    sc = start(tmp_path, local_data_plane=False)
    try:
        token = sc.admin().create_tenant("t1")
        c = sc.client(token)  # local chosen by itself (a loopback target): falls back to streams
        assert not c.uses_shared_memory
        keys = c.block_keys(SPEC, fresh_tokens(2))
        kv = random_kv(2)
        c.put(SPEC, keys, kv)
        assert torch.equal(c.get(SPEC, keys), kv)
        assert not sc.server.data.regions._regions  # nothing was registered
        with pytest.raises(errors.FailedPrecondition, match="local_data_plane = false"):
            Client(sc.target, token, local=True)  # shared memory asked for: the refusal says why
    finally:
        sc.stop()
    sc = start(tmp_path / "on")  # the default: regions are taken
    try:
        assert sc.tenant("t1").uses_shared_memory
    finally:
        sc.stop()



@pytest.mark.parametrize("path", ["workers", "copy_threads", "torch_threads", "streaming_copy_bytes",
                                  "expire_interval_s", "grace_s", "drain_s", "limits.max_keys_per_call",
                                  "limits.max_message_bytes", "limits.max_regions_per_principal",
                                  "limits.region_idle_evict_s", "limits.max_calls_per_principal",
                                  "limits.stream_idle_s"])
def test_a_boolean_in_a_numeric_server_field_is_refused(tmp_path, path):
    """``workers = true`` was one worker, ``max_keys_per_call = true`` one key per call."""
    from kvstore import server_config

    *table, field = path.split(".")
    data = {field: True} if not table else {table[0]: {field: True}}
    with pytest.raises(errors.InvalidArgument, match=rf"{path}: true is a boolean"):
        server_config.build(data, data_dir=tmp_path)


@pytest.mark.parametrize("field", ["retries", "op_timeout_s", "compression_level", "breaker_failures",
                                   "rewrite_window_s"])
def test_a_boolean_in_a_numeric_remote_field_is_refused(field):
    """The remote tier's numbers took ``true`` as 1 (one retry, a 1 s timeout)."""
    from kvstore.errors import InvalidArgument
    from tiers.remote_config import RemoteConfig

    with pytest.raises(InvalidArgument, match=rf"{field}: true is a boolean"):
        RemoteConfig.build(urls=["redis://127.0.0.1:6379"], **{field: True})
