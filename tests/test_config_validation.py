"""Configuration that cannot work is refused at load, as one line per problem naming the field;
a capacity the machine cannot allocate, or a data directory that cannot be one, fails at
open with a typed error naming the field, never a traceback."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvstore import server_config
from kvstore.cli_serve import admin_app
from kvstore.config import MAX_CAPACITY, StoreConfig, store_policies
from kvstore.errors import InvalidArgument, ResourceExhausted


def _one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text and "errors.pydantic.dev" not in text, text
    return text


# -- policy ---------------------------------------------------------------------------------------
def test_belady_is_refused_at_config_time_not_at_the_first_eviction(tmp_path):
    """``policy = "belady"`` started a server whose every eviction failed ("belady needs a
    next-use oracle"): only the trace replay can give it the future."""
    with pytest.raises(InvalidArgument, match=r"store\.policy: 'belady' .*trace replay") as exc:
        server_config.build({"store": {"policy": "belady"}}, data_dir=tmp_path)
    assert "['cost', 'gdsf', 'lru']" in _one_line(exc)
    with pytest.raises(InvalidArgument, match="policy: 'belady'"):
        StoreConfig.build(path=tmp_path, policy="belady")


def test_an_unknown_policy_is_refused_at_config_time(tmp_path):
    with pytest.raises(InvalidArgument, match=r"store\.policy: unknown policy 'fifo'; choose one of \['cost'"):
        server_config.build({"store": {"policy": "fifo"}}, data_dir=tmp_path)


def test_the_policies_a_store_runs_are_accepted(tmp_path):
    assert store_policies() == ["cost", "gdsf", "lru"]
    for name in store_policies():
        assert server_config.build({"store": {"policy": name}}, data_dir=tmp_path).store.policy == name


# -- non-finite and unbounded floats --------------------------------------------------------------
@pytest.mark.parametrize(("data", "field"), [
    ({"grace_s": math.inf}, "grace_s"),  # grpc's stop raised OverflowError at SIGINT
    ({"grace_s": 1e12}, "grace_s"),
    ({"expire_interval_s": math.inf}, "expire_interval_s"),  # Event.wait(inf): OverflowError
    ({"expire_interval_s": 1e10}, "expire_interval_s"),  # past threading.TIMEOUT_MAX
    ({"store": {"default_ttl_s": math.inf}}, "store.default_ttl_s"),  # infinite TTL = unset
    ({"store": {"default_ttl_s": math.nan}}, "store.default_ttl_s"),
])
def test_infinite_or_unbounded_seconds_are_refused(tmp_path, data, field):
    with pytest.raises(InvalidArgument, match=rf"^bad server config: {field}: ") as exc:
        server_config.build(data, data_dir=tmp_path)
    _one_line(exc)


def test_finite_seconds_within_bounds_are_kept(tmp_path):
    cfg = server_config.build({"grace_s": 3600, "expire_interval_s": 86400,
                               "store": {"default_ttl_s": 1e9}}, data_dir=tmp_path)
    assert (cfg.grace_s, cfg.expire_interval_s, cfg.store.default_ttl_s) == (3600, 86400, 1e9)


# -- the [store] table and the file -------------------------------------------------------------
@pytest.mark.parametrize("store", ["abc", 5, [["path", "/tmp/x"]]])
def test_store_that_is_not_a_table_is_refused(tmp_path, store):
    """``store = "abc"`` raised ValueError, ``store = 5`` TypeError, and a list of pairs was
    silently taken as the table."""
    with pytest.raises(InvalidArgument, match=r"store: must be a table \(\[store\]\)"):
        server_config.build({"store": store}, data_dir=tmp_path)


def test_a_config_file_that_is_not_utf8_is_invalid_argument(tmp_path):
    path = tmp_path / "kvstore.toml"
    path.write_bytes(b"\xff\xfelisten = 1\n")
    with pytest.raises(InvalidArgument, match="not UTF-8"):
        server_config.load(path, data_dir=tmp_path)


# -- messages -------------------------------------------------------------------------------------
def test_validation_errors_are_one_line_per_problem_naming_the_field(tmp_path):
    with pytest.raises(InvalidArgument) as exc:
        server_config.build({"workers": 0}, data_dir=tmp_path)
    assert _one_line(exc) == "bad server config: workers: Input should be greater than or equal to 1 (got 0)"
    with pytest.raises(InvalidArgument) as exc:
        server_config.build({"workers": 0, "store": {"hbm_bytes": -1}}, data_dir=tmp_path)
    lines = str(exc.value).splitlines()
    assert lines[0] == "bad server config: 2 problems:" and len(lines) == 3
    assert sorted(line.strip().split(":")[0] for line in lines[1:]) == ["store.hbm_bytes", "workers"]
    assert "errors.pydantic.dev" not in str(exc.value)
    with pytest.raises(InvalidArgument) as exc:
        StoreConfig.build(path=tmp_path, high_watermark=math.nan)
    assert _one_line(exc).startswith("bad StoreConfig: high_watermark: Input should be a finite number")


def test_serve_prints_a_config_error_as_one_line(tmp_path):
    cfg = tmp_path / "p.toml"
    cfg.write_text(f'[store]\npath = "{tmp_path / "data"}"\npolicy = "belady"\n')
    result = CliRunner().invoke(admin_app, ["serve", "--config", str(cfg)])
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error (INVALID_ARGUMENT): bad server config: store.policy:")


# -- the data directory ---------------------------------------------------------------------------
def test_serve_with_a_file_for_data_dir_is_invalid_argument_not_a_traceback(tmp_path):
    """``kvstore serve --data-dir /etc/passwd`` raised FileExistsError."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    result = CliRunner().invoke(admin_app, ["serve", "--listen", "127.0.0.1:0", "--data-dir", str(afile)])
    assert result.exit_code == 1 and not isinstance(result.exception, FileExistsError)
    assert result.output.strip() == f"error (INVALID_ARGUMENT): store.path (--data-dir) {str(afile)!r} is a file, not a directory"


@pytest.mark.parametrize("where", ["under-a-file", "proc"])
def test_a_data_dir_that_cannot_be_made_or_written_is_invalid_argument(tmp_path, where):
    """``store.path = "/proc/nope/kv"`` raised FileNotFoundError; ``/proc`` itself (which
    root's os.access calls writable) failed later, opening the audit log."""
    from kvstore.server import bootstrap

    if where == "proc":
        if not Path("/proc/self").exists():
            pytest.skip("no /proc")
        path, says = Path("/proc"), "cannot write in the data directory"
    else:
        (tmp_path / "afile").write_text("x")
        path, says = tmp_path / "afile" / "kv", "cannot create the data directory"
    cfg = server_config.build({"metrics": {"enabled": False}}, data_dir=path)
    with pytest.raises(InvalidArgument, match=rf"store\.path \(--data-dir\) .*: {says}"):
        bootstrap(cfg)


# -- capacities -----------------------------------------------------------------------------------
@pytest.mark.parametrize("field", ["hbm_bytes", "dram_bytes", "nvme_bytes"])
def test_a_capacity_past_one_pib_is_refused_at_config_time(tmp_path, field):
    """``hbm_bytes = "99999999999TiB"`` reached numpy as a bare ValueError."""
    assert server_config.build({"store": {field: MAX_CAPACITY}}, data_dir=tmp_path)
    with pytest.raises(InvalidArgument, match=rf"store\.{field}: Input should be less than or equal to "
                                              rf"{MAX_CAPACITY} \(1024\.0 TiB\) \(got '99999999999TiB'\)"):
        server_config.build({"store": {field: "99999999999TiB"}}, data_dir=tmp_path)


def test_a_memory_capacity_the_machine_cannot_allocate_fails_at_open_naming_the_field(tmp_path):
    """``hbm_bytes = "1TiB"`` on a 23 GiB machine was a MemoryError from the arena. 1 PiB is
    past the address space a process gets (47 bits on x86-64, 48 on arm64) and any device."""
    from kvstore.store import Store

    cfg = StoreConfig(path=tmp_path / "s", hbm_bytes=MAX_CAPACITY, dram_bytes=0, nvme_bytes=0)
    with pytest.raises(ResourceExhausted, match="cannot allocate the hbm tier: hbm_bytes = .* lower hbm_bytes"):
        Store.open(cfg)
    Store.open(StoreConfig(path=tmp_path / "s", hbm_bytes=1 << 20, dram_bytes=0, nvme_bytes=0)).close()


def test_an_nvme_capacity_lmdb_cannot_map_fails_at_open_naming_the_field(tmp_path):
    """``nvme_bytes = "1000000TiB"`` was an lmdb.MemoryError (the map is twice the capacity)."""
    from kvstore.store import Store

    cfg = StoreConfig(path=tmp_path / "s", hbm_bytes=0, dram_bytes=0, nvme_bytes=MAX_CAPACITY)
    with pytest.raises(ResourceExhausted, match="cannot open the NVMe tier: nvme_bytes = .* lower nvme_bytes"):
        Store.open(cfg)
    # the directory is not left locked: a sane capacity opens it
    Store.open(StoreConfig(path=tmp_path / "s", hbm_bytes=0, dram_bytes=0, nvme_bytes=64 << 20)).close()


def test_remote_config_refuses_an_infinite_ttl_cap_in_one_line():
    """``ttl_cap_s = inf`` was accepted (no cap is written as unset), and RemoteConfig's
    errors were pydantic's multi-line dump."""
    import math

    from tiers.remote_config import RemoteConfig

    for bad in (math.inf, math.nan):
        with pytest.raises(InvalidArgument) as err:
            RemoteConfig.build(urls=["redis://127.0.0.1:6379/0"], ttl_cap_s=bad)
        assert str(err.value).startswith("bad RemoteConfig: ttl_cap_s: ") and "\n" not in str(err.value)
    assert RemoteConfig.build(urls=["redis://127.0.0.1:6379/0"], ttl_cap_s=None).ttl_cap_s is None
