"""What the CLI prints is what is in force: the TTL of `policy get/set` exactly, and every
command's --help whole (rich read ``[tls]`` in a docstring as markup and dropped it)."""

from __future__ import annotations

import re

import click
import pytest
import typer
from rich.console import Console
from typer.testing import CliRunner

from kvstore.cli import app
from kvstore.cli_views import policy_view, ttl_text


@pytest.mark.parametrize(("ttl", "shown"), [(1234567.0, "1234567 s"), (1209600.0, "1209600 s"), (0.25, "0.25 s"),
                                             (3600.0, "3600 s"), (86400.5, "86400.5 s")])
def test_policy_view_shows_the_ttl_in_force_exactly(ttl, shown):
    console = Console(width=100, record=True)
    console.print(policy_view({"tenant": "t", "ttl_s": ttl, "priority": 0, "quota_bytes": {}}, str))
    assert shown in console.export_text()
    assert ttl_text(ttl).startswith(shown)


def _commands(cmd: click.Command, path: list[str]):
    yield path, cmd
    for name, sub in (getattr(cmd, "commands", None) or {}).items():
        yield from _commands(sub, [*path, name])


def _unescaped(text: str) -> list[str]:
    """The bracketed words of a help text, as the reader should see them."""
    return [m.replace("\\", "") for m in re.findall(r"\\*\[[^\]\s]*\]", text)]


def test_every_bracketed_word_of_a_commands_help_is_printed():
    root = typer.main.get_command(app)
    runner = CliRunner()
    checked = 0
    for path, cmd in _commands(root, []):
        words = [w for t in [cmd.help or ""] + [getattr(p, "help", "") or "" for p in cmd.params]
                 for w in _unescaped(t)]
        if not words:
            continue
        result = runner.invoke(app, [*path, "--help"], terminal_width=200)
        assert result.exit_code == 0, result.output
        flat = " ".join(result.output.split())
        for w in words:
            assert w in flat, f"kvstore {' '.join(path)} --help lost {w!r}"
        checked += 1
    assert checked  # serve's help names the config sections
