"""`kvstore audit` and `kvstore model purge`, after a docs prober.

(1) Piped, or on an 80-column terminal, the audit table cut every column to an ellipsis
(``tenant.…``): create, rotate and delete read alike and ``kvstore audit | grep tenant.delete``
found nothing. Off a terminal, and where the table does not fit, each entry is one complete
tab-separated line. (2) With no options it showed the OLDEST 1000 entries, silently: it shows
the newest, saying on stderr how many earlier ones it left out. (3) The Admin PurgeModel RPC had
no CLI verb: ``kvstore model purge FINGERPRINT``.
"""

from __future__ import annotations

import json
import re

import pytest
from service_harness import SPEC, fresh_tokens, random_kv, start
from typer.testing import CliRunner

from kvstore.admin_client import AdminClient
from kvstore.cli_serve import admin_app


@pytest.fixture
def sidecar(tmp_path):
    sc = start(tmp_path)
    yield sc
    sc.stop()


def _cli(sc, *args: str, env: dict[str, str] | None = None, stdin: str | None = None):
    return CliRunner().invoke(admin_app, [*args, "--target", sc.target, "--token", sc.admin_token],
                              env={"COLUMNS": "80", **(env or {})}, input=stdin)


def _tenant_lifecycle(sc) -> None:
    admin = sc.admin()
    admin.create_tenant("acme")
    admin.rotate_token("acme")
    admin.delete_tenant("acme")


# -- (1) nothing cut ------------------------------------------------------------------------------
def test_piped_audit_is_one_complete_greppable_line_per_entry(sidecar):
    _tenant_lifecycle(sidecar)
    result = _cli(sidecar, "audit")  # CliRunner's stdout is no terminal: as `kvstore audit | grep`
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "…" not in out
    deleted = [line.split("\t") for line in out.splitlines() if "tenant.delete" in line]
    assert [(f[3], f[4], f[5]) for f in deleted] == [("tenant.delete", "acme", "STARTED"),
                                                     ("tenant.delete", "acme", "OK")]
    assert deleted[1][6] == deleted[0][0]  # the outcome's ref: its STARTED entry
    assert deleted[1][7] == "blocks=0"
    actions = [line.split("\t")[3] for line in out.splitlines()[1:]]
    assert {"tenant.create", "tenant.rotate", "tenant.delete"} <= set(actions)
    assert out.splitlines()[0].split("\t") == ["seq", "time", "principal", "action", "target", "result", "ref",
                                               "detail"]


def test_audit_lines_escape_tabs_and_control_characters_of_what_a_caller_sent(sidecar):
    admin = sidecar.admin()
    with pytest.raises(Exception):  # noqa: B017 - no such (well-formed) principal
        admin.rotate_token("a\tb\x1b[2J")
    out = _cli(sidecar, "audit").stdout
    line = next(x for x in out.splitlines() if "tenant.rotate" in x)
    assert "\x1b" not in out
    assert line.split("\t")[4] == "a\\x09b\\x1b[2J"  # the target, one field


def test_audit_on_an_80_column_terminal_cuts_nothing(sidecar):
    _tenant_lifecycle(sidecar)
    result = _cli(sidecar, "audit", env={"TTY_COMPATIBLE": "1", "COLUMNS": "80", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    assert "…" not in result.stdout
    for action in ("tenant.create", "tenant.rotate", "tenant.delete"):
        assert action in result.stdout


def test_audit_on_a_wide_terminal_is_a_table_with_every_cell_whole(sidecar):
    _tenant_lifecycle(sidecar)
    sidecar.admin().create_tenant("beta")
    sidecar.admin().set_policy("beta", ttl_s=3600.0, quota_bytes={"hbm": 1 << 30, "dram": 2 << 30}, priority=3)
    for width in (130, 160, 250):
        result = _cli(sidecar, "audit", env={"TTY_COMPATIBLE": "1", "COLUMNS": str(width), "NO_COLOR": "1"})
        assert result.exit_code == 0, result.output
        out = re.sub(r"\x1b\[[0-9;]*m", "", result.stdout)  # the header's bold
        assert "─" in out and "\t" not in out  # a table
        assert "…" not in out
        assert all(len(line) <= width for line in out.splitlines())
        for action in ("tenant.create", "tenant.rotate", "tenant.delete", "policy.set"):
            assert action in out
        # the long detail is wrapped, not cut: every word of it is there
        detail = next(e["detail"] for e in sidecar.admin().audit() if e["action"] == "policy.set"
                      and e["result"] == "OK")
        words = " ".join(out.split())
        assert all(w in words for w in detail.split() if len(w) < 16)


# -- (2) the newest entries -----------------------------------------------------------------------
def test_audit_shows_the_newest_entries_and_says_how_many_were_left_out(sidecar):
    admin = sidecar.admin()
    for _ in range(1005):
        admin.list_tenants()
    admin.create_tenant("latest-tenant")
    last = admin.last_audit_seq()
    assert last > 1000

    result = _cli(sidecar, "audit", "--json")
    assert result.exit_code == 0, result.output
    seqs = [json.loads(line)["seq"] for line in result.stdout.splitlines()]
    assert seqs == list(range(last - 999, last + 1))  # the newest 1000, in order
    assert "latest-tenant" in result.stdout
    assert f"{last - 1000} earlier entries not shown (seq 1..{last - 1000})" in result.stderr
    assert "--since" in result.stderr and "--limit" in result.stderr

    result = _cli(sidecar, "audit", "--limit", "3")
    lines = result.stdout.splitlines()[1:]
    assert [int(x.split("\t")[0]) for x in lines] == [last - 2, last - 1, last]
    assert [x.split("\t")[3] for x in lines] == ["tenant.list", "tenant.create", "tenant.create"]
    assert f"{last - 3} earlier entries not shown" in result.stderr


def test_audit_shows_everything_with_no_note_when_nothing_was_left_out(sidecar):
    _tenant_lifecycle(sidecar)
    result = _cli(sidecar, "audit", "--json")
    seqs = [json.loads(line)["seq"] for line in result.stdout.splitlines()]
    assert seqs[0] == 1 and seqs == list(range(1, len(seqs) + 1))
    assert result.stderr == ""


def test_audit_since_reads_forward_and_says_where_to_read_on(sidecar):
    _tenant_lifecycle(sidecar)
    last = sidecar.admin().last_audit_seq()
    result = _cli(sidecar, "audit", "--since", "1", "--limit", "2", "--json")
    assert [json.loads(x)["seq"] for x in result.stdout.splitlines()] == [2, 3]
    assert "later entries not shown: --since 3 reads on" in result.stderr
    result = _cli(sidecar, "audit", "--since", str(last - 1), "--json")
    assert [json.loads(x)["seq"] for x in result.stdout.splitlines()] == [last]
    assert result.stderr == ""


def test_limit_help_says_which_entries():
    result = CliRunner().invoke(admin_app, ["audit", "--help"], env={"COLUMNS": "200"})
    assert "the newest N" in result.stdout and "after" in result.stdout


@pytest.mark.parametrize("size", [0, 1, 2, 999, 1000, 1001, 2047, 5000, 123_457])
def test_last_audit_seq_finds_the_end_of_a_log_of_any_length(size, monkeypatch):
    """The bisection over one-entry pages, against a log of ``size`` entries (seq 1..size)."""
    calls = []

    def page(self, since_seq=0, limit=0):
        calls.append(since_seq)
        got = list(range(since_seq + 1, min(size, since_seq + limit) + 1))
        return [{"seq": s} for s in got], since_seq + limit < size

    monkeypatch.setattr(AdminClient, "audit_page", page)
    client = AdminClient.__new__(AdminClient)
    assert client.last_audit_seq() == size
    assert len(calls) <= 2 * max(size, 1000).bit_length() + 4


# -- (3) model purge ------------------------------------------------------------------------------
def test_model_purge_removes_the_models_blocks_and_is_audited(sidecar):
    c = sidecar.tenant("acme", local=False)
    keys = c.block_keys(SPEC, fresh_tokens(3))
    c.put(SPEC, keys, random_kv(3))
    assert c.lookup(SPEC, keys).num_blocks == 3
    fp = SPEC.fingerprint.hex()

    result = _cli(sidecar, "model", "purge", fp, "--yes")
    assert result.exit_code == 0, result.output
    assert f"purged model {fp}: 3 blocks removed" in result.stdout
    assert c.lookup(SPEC, keys).num_blocks == 0
    entries = [e for e in sidecar.admin().audit() if e["action"] == "model.purge"]
    assert [(e["target"], e["result"], e["detail"]) for e in entries] == [(fp, "STARTED", ""),
                                                                          (fp, "OK", "blocks=3")]


def test_model_purge_asks_first_and_does_nothing_when_refused(sidecar):
    c = sidecar.tenant("acme", local=False)
    keys = c.block_keys(SPEC, fresh_tokens(2))
    c.put(SPEC, keys, random_kv(2))
    result = _cli(sidecar, "model", "purge", SPEC.fingerprint.hex(), stdin="n\n")
    assert result.exit_code == 1
    assert "purge model" in result.output and "Aborted" in result.output
    assert c.lookup(SPEC, keys).num_blocks == 2
    assert not [e for e in sidecar.admin().audit() if e["action"] == "model.purge"]


@pytest.mark.parametrize("fingerprint", ["xyz", "abcd", "00" * 17])
def test_model_purge_refuses_what_is_not_a_fingerprint(sidecar, fingerprint):
    result = _cli(sidecar, "model", "purge", fingerprint, "--yes")
    assert result.exit_code == 2
    assert "32 hex digits" in result.output


def test_model_purge_errors_are_one_line_with_their_code(sidecar):
    result = CliRunner().invoke(admin_app, ["model", "purge", SPEC.fingerprint.hex(), "--yes", "--target",
                                            sidecar.target, "--token", "kvs_not_a_token"])
    assert result.exit_code == 1
    assert "error (UNAUTHENTICATED)" in result.output and "Traceback" not in result.output
