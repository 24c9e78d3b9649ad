"""``--help``'s command lists show each command's summary as one paragraph: typer kept the
docstring's line breaks there, so a summary wrapped at the source's breaks and again at the
terminal's edge ("... print how many" / "blocks went.")."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from kvstore.cli import app
from kvstore.cli_serve import admin_app


@pytest.mark.parametrize("command", [[], ["tenant"], ["model"], ["session"], ["policy"]])
def test_summaries_wrap_only_at_the_edge(command):
    width = 100
    result = CliRunner().invoke(app, [*command, "--help"], terminal_width=width)
    assert result.exit_code == 0, result.output
    lines = result.output.split("Commands", 1)[1].splitlines()
    ends = [len(ln.rstrip().rstrip("│").rstrip()) for ln in lines if ln.startswith("│")]
    edge = max(ends)  # where the summaries' column ends (rich sizes it below the box)
    rows = 0
    for line, nxt in zip(lines, lines[1:]):
        cont = re.match(r"│ {3,}(\S+)", nxt)  # the next line continues a summary
        if not line.startswith("│") or not cont:
            continue
        rows += 1
        free = edge - len(line.rstrip().rstrip("│").rstrip())  # columns left on this line
        assert len(cont.group(1)) + 1 > free, f"wrapped early before {cont.group(1)!r}:\n{line}\n{nxt}"
    assert rows  # some summary is long enough to wrap at 100 columns


def test_every_command_has_a_one_line_summary():
    def walk(t):
        for info in t.registered_commands:
            yield info
        for group in t.registered_groups:
            yield from walk(group.typer_instance)

    for top in (app, admin_app):
        for info in walk(top):
            assert info.short_help and "\n" not in info.short_help, info.name


def test_tenant_delete_summary_whole():
    out = CliRunner().invoke(admin_app, ["tenant", "--help"], terminal_width=200).output
    assert "print how many blocks went." in " ".join(out.split())
    assert any("print how many blocks went." in line for line in out.splitlines())
