"""`kvstore model list`, `session list` and `tenant list`, and the CLI's escapes, after a prober.

(1) The three lists were rich tables that rich shrank with an ellipsis when wider than the
console (80 columns in a pipe, and cut at 120 too): the model names, revisions, session ids and
tenant names an operator copies into ``model purge``, ``session close`` and ``tenant delete``
read ``meta-llama/Meta-Ll…``. As ``kvstore audit`` already does, they print a table only on a
terminal where it fits with every cell whole, else one complete tab-separated line per row.
``COLUMNS=0`` printed nothing at all. ``tenant list`` had no ``--json``. (2) A backslash was
printed as it is, so a TAB (shown ``\\x09``) and the four characters ``\\x09`` read alike, and
U+2028 / U+2029 went out raw. (3) ``audit --limit 0`` meant 1000; a negative ``--limit`` or
``--since`` was a server error naming neither option; ``--since`` past the end said nothing;
``model purge`` of a fingerprint with no blocks said only "0 blocks removed"; a deletion asked
for confirmation before saying that the token was missing.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
from service_harness import SPEC, fresh_tokens, random_kv, start
from typer.testing import CliRunner

from kvstore import cli_serve
from kvstore.cli_serve import _printable, _shown, admin_app

MODEL = "meta-llama/Meta-Llama-3.1-70B-Instruct"
REVISION = "33101ce6ccc08fa6249c10a543ebfcac65173393"
TENANT = "tenant-with-a-rather-long-name"
SESSION = "12345678-90ab-cdef-1234-567890abcdef"
TTY = {"TTY_COMPATIBLE": "1", "NO_COLOR": "1"}


@pytest.fixture
def sidecar(tmp_path):
    sc = start(tmp_path)
    yield sc
    sc.stop()


@pytest.fixture
def stocked(sidecar):
    """A model with a long name and revision, stored by a tenant with a long name, which holds
    a session with a UUID for its id."""
    spec = replace(SPEC, model=MODEL, revision=REVISION)
    c = sidecar.tenant(TENANT, local=False)
    c.open_session(SESSION)
    c.put(spec, c.block_keys(spec, fresh_tokens(3)), random_kv(3, spec), session=SESSION)
    sidecar.spec = spec
    return sidecar


def _cli(sc, *args: str, env: dict[str, str] | None = None, stdin: str | None = None, token: bool = True):
    tail = ["--target", sc.target, *(["--token", sc.admin_token] if token else [])]
    return CliRunner().invoke(admin_app, [*args, *tail], env={"COLUMNS": "80", "KVSTORE_ADMIN_TOKEN": "", **(env or {})},
                              input=stdin)


def _plain(out: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", out)  # the header's bold, the title's italics


def _rows(out: str) -> list[list[str]]:
    return [line.split("\t") for line in out.splitlines()]


def _expected(sc) -> dict[str, list[str]]:
    """What each list shows as its header and its row of ``stocked``."""
    fp = sc.spec.fingerprint.hex()
    return {
        "model": [["fingerprint", "model", "revision", "dtype", "block tokens", "blocks", "size", "tenants"],
                  [fp, MODEL, REVISION, sc.spec.dtype, str(sc.spec.block_tokens), "3"]],
        "session": [["tenant", "session", "state", "blocks", "size", "pinned", "pinned size", "only it", "idle"],
                    [TENANT, SESSION, "active", "3"]],
        "tenant": [["name", "role", "namespaces", "created", "state"], [TENANT, "tenant", ""]],
    }


# -- (1) nothing cut ------------------------------------------------------------------------------
@pytest.mark.parametrize("verb", ["model", "session", "tenant"])
@pytest.mark.parametrize("env", [{}, {"COLUMNS": "0"}, {"COLUMNS": "200"}, {**TTY, "COLUMNS": "80"},
                                 {**TTY, "COLUMNS": "40"}, {**TTY, "COLUMNS": "0"}, {**TTY, "COLUMNS": "1"}],
                         ids=["piped", "piped-0", "piped-200", "tty-80", "tty-40", "tty-0", "tty-1"])
def test_lists_piped_or_too_narrow_are_one_whole_tab_separated_line_per_row(stocked, verb, env):
    result = _cli(stocked, verb, "list", env=env)
    assert result.exit_code == 0, result.output
    assert "…" not in result.stdout
    header, row = _expected(stocked)[verb]
    rows = _rows(result.stdout)
    assert rows[0] == header
    mine = [r for r in rows[1:] if r[0] == row[0]]
    assert len(mine) == 1 and mine[0][:len(row)] == row and len(mine[0]) == len(header)


@pytest.mark.parametrize("verb", ["model", "session", "tenant"])
def test_lists_on_a_wide_terminal_are_a_table_with_every_cell_whole(stocked, verb):
    width = 250
    result = _cli(stocked, verb, "list", env={**TTY, "COLUMNS": str(width)})
    assert result.exit_code == 0, result.output
    out = _plain(result.stdout)
    assert "─" in out and "\t" not in out and "…" not in out  # a table
    assert all(len(line) <= width for line in out.splitlines())
    header, row = _expected(stocked)[verb]
    assert all(name in out for name in header)
    line = next(x for x in out.splitlines() if row[0] in x)
    assert all(c in line.split() for c in row if c)


def test_a_table_narrower_than_its_cells_is_not_drawn():
    from kvstore.cli_views import Field, Listing, whole_table

    listing = Listing((Field("id"), Field("n", right=True)), lambda text: [[text("x" * 30), "1"]])
    rows = listing.rows(_shown)
    assert whole_table(listing, rows, 34) is None  # 30 + 1 + 2 * 2 padding + 1 separator = 36
    assert whole_table(listing, rows, 36) is not None
    # a wrapping column is folded, not cut, and needs FOLD_MIN
    folded = Listing((Field("id"), Field("ns", wrap=1)), lambda text: [["a", text("n" * 100)]])
    assert whole_table(folded, folded.rows(_shown), 20) is None
    assert whole_table(folded, folded.rows(_shown), 40) is not None


def test_tenant_list_wraps_long_namespaces_and_keeps_the_names_whole(sidecar):
    spaces = [f"shared:namespace-number-{i}" for i in range(6)]
    sidecar.admin().create_tenant("pub", "publisher", spaces)
    result = _cli(sidecar, "tenant", "list", env={**TTY, "COLUMNS": "100"})
    out = _plain(result.stdout)
    assert "─" in out and "…" not in out  # a table: the namespaces wrap
    assert all(len(line) <= 100 for line in out.splitlines())
    assert all(ns in out for ns in spaces)


def test_tenant_list_json(stocked):
    result = _cli(stocked, "tenant", "list", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc == json.loads(json.dumps(stocked.admin().list_tenants()))
    assert {t["name"] for t in doc} == {"admin", TENANT}


def test_columns_0_does_not_print_nothing(sidecar):
    result = _cli(sidecar, "stats", env={"COLUMNS": "0"})
    assert result.exit_code == 0 and "tiers" in result.stdout and "hbm" in result.stdout


def test_lists_of_nothing_still_print_their_header(sidecar):
    for verb, first in (("model", "fingerprint"), ("session", "tenant")):
        result = _cli(sidecar, verb, "list")
        assert result.exit_code == 0 and result.stdout.split("\t")[0] == first


# -- (2) escapes ----------------------------------------------------------------------------------
def test_a_tab_and_the_characters_of_its_escape_print_differently():
    assert _printable("a\tb") == "a\\x09b"
    assert _printable("a\\x09b") == "a\\\\x09b"
    assert _printable("a\tb") != _printable("a\\x09b")
    assert _printable("l\u2028p\u2029") == "l\\u2028p\\u2029"
    assert len(_printable("l\u2028p\u2029\x85").splitlines()) == 1


def test_audit_lines_and_table_show_a_tab_a_backslash_and_line_separators_alike(sidecar):
    admin = sidecar.admin()
    for name in ("a\tb", "a\\x09b", "ls\u2028sep", "\\[red]x"):
        with pytest.raises(Exception):  # noqa: B017 - no such (well-formed) principal
            admin.rotate_token(name)
    want = ["a\\x09b", "a\\\\x09b", "ls\\u2028sep", "\\\\[red]x"]
    piped = _cli(sidecar, "audit").stdout
    assert [f[4] for f in _rows(piped)[1:] if f[5] == "NOT_FOUND"] == want
    assert len(piped.splitlines()) == len(piped.split("\n")) - 1  # no line broken by U+2028
    table = _plain(_cli(sidecar, "audit", env={**TTY, "COLUMNS": "250"}).stdout)
    assert "─" in table and "\u2028" not in table
    assert all(w in table.split() for w in want)  # the table as the lines


# -- (3) small ones -------------------------------------------------------------------------------
@pytest.mark.parametrize("args, option", [(["--limit", "0"], "--limit"), (["--limit", "-1"], "--limit"),
                                          (["--since", "-1"], "--since")])
def test_audit_limit_and_since_out_of_range_are_usage_errors_naming_the_option(sidecar, args, option):
    result = _cli(sidecar, "audit", *args)
    assert result.exit_code == 2
    assert option in result.output and "INVALID_ARGUMENT" not in result.output


def test_audit_since_past_the_end_says_where_the_log_ends(sidecar):
    sidecar.admin().create_tenant("acme")
    last = sidecar.admin().last_audit_seq()
    result = _cli(sidecar, "audit", "--since", str(last + 5))
    assert result.exit_code == 0
    assert f"no entries after seq {last + 5} (the newest is {last})" in result.stderr


def test_model_purge_of_a_model_not_stored_says_so(sidecar):
    fp = "ab" * 16
    result = _cli(sidecar, "model", "purge", fp, "--yes")
    assert result.exit_code == 0, result.output
    assert "0 blocks removed" in result.stdout
    assert f"no block of model {fp} was stored here" in result.stderr and "kvstore model list" in result.stderr


@pytest.mark.parametrize("args", [["model", "purge", "ab" * 16], ["tenant", "delete", "acme"]])
def test_a_deletion_without_a_token_says_so_before_asking(sidecar, args):
    result = _cli(sidecar, *args, token=False, stdin="y\n")
    assert result.exit_code == 2
    assert "admin token is required" in result.output
    assert "?" not in result.output  # never asked


def test_help_and_usage_are_plain_and_complete():
    result = CliRunner().invoke(admin_app, ["tenant", "list", "--help"], env={"COLUMNS": "200"})
    assert "deleting" in result.stdout and "``" not in result.stdout and "--json" in result.stdout
    usage = cli_serve.__doc__
    assert "model list [--json]" in usage and "list [--json] | grant" in usage
