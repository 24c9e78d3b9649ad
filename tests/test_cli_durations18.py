"""``--ttl`` of ``kvstore policy set`` and ``kvstore model policy`` takes a duration (``1h``,
``30m``, ``1h30m``) as well as seconds: ``--ttl 1h`` was refused as not a number."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from kvstore.cli_serve import admin_app
from kvstore.durations import parse_duration
from kvstore.errors import InvalidArgument


@pytest.mark.parametrize(("text", "seconds"), [
    ("3600", 3600.0), ("0.25", 0.25), ("90s", 90.0), ("30m", 1800.0), ("30min", 1800.0),
    ("1.5h", 5400.0), ("7d", 604_800.0), ("2w", 1_209_600.0), ("1h30m", 5400.0),
    ("1H 30M", 5400.0), ("1d2h3m4s", 93_784.0), (".5h", 1800.0), ("-5", -5.0),
])
def test_parse(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "h", "1x", "1 hour and more", "1h-30m", "nan", "inf", "1e400", "m30"])
def test_refused_naming_the_units(text):
    with pytest.raises(InvalidArgument, match="duration"):
        parse_duration(text)


@given(st.floats(min_value=0, max_value=1e9, allow_nan=False))
def test_plain_seconds_read_back_exactly(x):
    assert parse_duration(repr(x)) == x


@given(st.lists(st.tuples(st.integers(0, 10_000), st.sampled_from(["s", "m", "h", "d", "w"])), min_size=1, max_size=4))
def test_parts_add_up(parts):
    text = "".join(f"{n}{u}" for n, u in parts)
    unit = {"s": 1, "m": 60, "h": 3600, "d": 86_400, "w": 604_800}
    assert math.isclose(parse_duration(text), sum(n * unit[u] for n, u in parts))


def test_policy_set_takes_a_duration(sidecar):
    args = ["--target", sidecar.target, "--token", sidecar.admin_token]
    assert CliRunner().invoke(admin_app, ["tenant", "add", "dur", *args]).exit_code == 0
    result = CliRunner().invoke(admin_app, ["policy", "set", "dur", "--ttl", "1h30m", "--json", *args])
    assert result.exit_code == 0, result.output
    assert '"ttl_s": 5400.0' in result.output
    bad = CliRunner().invoke(admin_app, ["policy", "set", "dur", "--ttl", "1hour", *args])
    assert bad.exit_code == 2 and "--ttl" in bad.output and "1h30m" in bad.output, bad.output


def test_model_policy_takes_a_duration(sidecar):
    args = ["--target", sidecar.target, "--token", sidecar.admin_token]
    result = CliRunner().invoke(admin_app, ["model", "policy", "ab" * 16, "--ttl", "2d", "--json", *args])
    assert result.exit_code == 0, result.output
    assert '"ttl_s": 172800.0' in result.output
