"""What the trace replay refuses, and how: malformed trace lines, hash ids that do not form a
prefix tree, numbers out of range and output paths that cannot be written each give one
InvalidArgument (one ``error:`` line and exit code 2 from the CLI) that names the line and the
field, before the replay runs; a valid trace replays as before."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from kvstore.errors import InvalidArgument
from kvstore.replay import ReplayConfig, block_key, make_replay_policy, run_replay
from kvstore.workloads import TraceRequest, generate, load_trace, parse_request, write_trace

GOOD = '{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]}'
MOONCAKE = Path(__file__).resolve().parents[2] / "shared" / "data" / "mooncake_synthetic_trace.jsonl"


def trace_file(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "t.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return path


def line(**fields: object) -> str:
    """A trace line: GOOD's fields with ``fields`` replaced (values as JSON text)."""
    obj = {"timestamp": "0", "input_length": "1024", "output_length": "1", "hash_ids": "[1, 2]"}
    obj.update({k: str(v) for k, v in fields.items()})
    return "{" + ", ".join(f'"{k}": {v}' for k, v in obj.items()) + "}"


def cli_app(module: object, name: str, command: str) -> typer.Typer:
    app = typer.Typer()
    app.command(name)(getattr(module, command))

    @app.callback()
    def _root() -> None:
        pass

    return app


def one_line(output: str) -> str:
    return " ".join(output.split())  # rich wraps long lines


# -- 1. timestamps: a finite number ---------------------------------------------------------


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "1e400", "1" + "0" * 400, '"12"',
                                   "true", "null", "[1]"])
def test_a_timestamp_that_is_not_a_finite_number_is_refused(tmp_path, value):
    """NaN used to be taken (and change the results), "12" was read as 12."""
    path = trace_file(tmp_path, GOOD, line(timestamp=value, hash_ids="[3, 4]"))
    with pytest.raises(InvalidArgument, match="trace line 2: 'timestamp' must be a finite number"):
        load_trace(path)


def test_nan_between_sorted_timestamps_no_longer_hides_the_disorder(tmp_path):
    """10000, NaN, 1 passed the "sorted" check: every comparison with NaN is false."""
    path = trace_file(tmp_path, line(timestamp=10000), line(timestamp="NaN", hash_ids="[3, 4]"),
                      line(timestamp=1, hash_ids="[5, 6]"))
    with pytest.raises(InvalidArgument, match="trace line 2: 'timestamp' must be a finite number"):
        load_trace(path)


# -- 2. hash ids that are not a prefix tree: one error line from the CLI --------------------


@pytest.mark.parametrize(("second", "message"), [
    ("[3, 2]", "trace line 2: hash id 2 comes after 3 here but after 1 on an earlier line"),
    ("[2, 1]", "trace line 2: hash id 2 comes first here but after 1 on an earlier line"),
])
def test_a_hash_id_under_two_parents_is_one_error_line_from_the_cli(tmp_path, second, message):
    """It used to escape run_replay (outside the CLI's error handling) as a traceback."""
    from kvstore import cli_replay

    path = trace_file(tmp_path, GOOD, line(timestamp=1, hash_ids=second))
    with pytest.raises(InvalidArgument, match=message):
        load_trace(path)
    res = CliRunner().invoke(cli_app(cli_replay, "replay", "replay"),
                             ["replay", str(path), "--hbm-blocks", "10"])
    assert res.exit_code == 2 and f"error: {path}: {message}" in one_line(res.output), res.output


def test_an_error_raised_by_the_replay_itself_is_one_error_line(tmp_path, monkeypatch):
    from kvstore import cli_replay

    def fail(*_a, **_k):
        raise InvalidArgument("policy lru demoted to nowhere")

    monkeypatch.setattr(cli_replay, "run_replay", fail)
    path = trace_file(tmp_path, GOOD)
    res = CliRunner().invoke(cli_app(cli_replay, "replay", "replay"),
                             ["replay", str(path), "--hbm-blocks", "10"])
    assert res.exit_code == 2 and "error: policy lru demoted to nowhere" in one_line(res.output)


# -- 3. numbers out of range -----------------------------------------------------------------


@pytest.mark.parametrize(("fields", "message"), [
    ({"hash_ids": "[1e20]", "input_length": 5}, "'hash_ids' holds 1e+20, not an integer"),
    ({"hash_ids": f"[{1 << 63}]", "input_length": 5}, "'hash_ids' holds 9223372036854775808, not an integer"),
    ({"hash_ids": f"[{-(1 << 63) - 1}]", "input_length": 5}, "not an integer in the signed 64-bit range"),
    ({"input_length": "1e400"}, "'input_length' must be an integer >= 0 (tokens), got inf"),
    ({"hash_ids": "[" + "1" * 5000 + "]"}, "not JSON (Exceeds the limit"),
    ({"hash_ids": "[" * 100_000 + "]" * 100_000}, "not JSON"),
])
def test_odd_numbers_are_an_invalid_argument_not_a_crash(tmp_path, fields, message):
    """Each used to raise OverflowError, ValueError or RecursionError with a traceback."""
    path = trace_file(tmp_path, line(**fields))
    with pytest.raises(InvalidArgument) as info:
        load_trace(path)
    assert str(info.value).startswith(f"{path}: trace line 1: ") and message in str(info.value)


def test_a_hash_id_out_of_range_in_a_trace_built_in_memory_is_refused_by_the_replay():
    with pytest.raises(InvalidArgument, match="outside the signed 64-bit range"):
        block_key(1 << 64)
    cfg = ReplayConfig.with_defaults(4)
    trace = [TraceRequest(0.0, 512, 1, (1 << 64,))]
    with pytest.raises(InvalidArgument, match="outside the signed 64-bit range"):
        run_replay(trace, cfg, make_replay_policy("lru", cfg))


# -- 4. malformed values: refused, naming the line and the field ------------------------------


@pytest.mark.parametrize(("fields", "message"), [
    ({"hash_ids": '"123"'}, "'hash_ids' must be a list of integers, got '123'"),
    ({"hash_ids": "[1.7, 2.2]"}, "'hash_ids' holds 1.7, not an integer"),
    ({"hash_ids": "[1.0, 2.0]"}, "'hash_ids' holds 1.0, not an integer"),
    ({"hash_ids": "[true, false]"}, "'hash_ids' holds True, not an integer"),
    ({"hash_ids": '["1", "2"]'}, "'hash_ids' holds '1', not an integer"),
    ({"hash_ids": '{"a": 1}'}, "'hash_ids' must be a list of integers"),
    ({"hash_ids": "[1, 1]"}, "'hash_ids' holds 1 twice"),
    ({"input_length": 5.9}, "'input_length' must be an integer >= 0 (tokens), got 5.9"),
    ({"input_length": -5}, "'input_length' must be an integer >= 0 (tokens), got -5"),
    ({"input_length": "true"}, "'input_length' must be an integer >= 0 (tokens), got True"),
    ({"input_length": '"1024"'}, "'input_length' must be an integer >= 0 (tokens), got '1024'"),
    ({"output_length": -7}, "'output_length' must be an integer >= 0 (tokens), got -7"),
    ({"output_length": 0.5}, "'output_length' must be an integer >= 0 (tokens), got 0.5"),
    ({"input_length": 0, "hash_ids": "[1, 2, 3]"}, ("'input_length' 0 needs 0 hash ids (one per 512 tokens, "
                                                    "the last one partial), 'hash_ids' holds 3")),
    ({"input_length": 5}, "'input_length' 5 needs 1 hash ids"),
    ({"input_length": 1025}, "'input_length' 1025 needs 3 hash ids"),
    ({"hash_ids": "[]"}, "'input_length' 1024 needs 2 hash ids"),
    ({"tenant": '{"x": 1}'}, "'tenant' must be a string, got {'x': 1}"),
])
def test_a_malformed_value_is_refused_naming_line_and_field(tmp_path, fields, message):
    """These used to be coerced ("123" -> (1, 2, 3), 5.9 -> 5, true -> 1) or taken as they were
    (-7 tokens, 3 hash ids for 0 tokens) without a word."""
    path = trace_file(tmp_path, GOOD, line(timestamp=1, **fields))
    with pytest.raises(InvalidArgument) as info:
        load_trace(path)
    assert str(info.value).startswith(f"{path}: trace line 2: {message}")


@pytest.mark.parametrize("obj", ["[1, 2]", "5", '"x"', "null"])
def test_a_line_that_is_not_an_object_is_refused(tmp_path, obj):
    with pytest.raises(InvalidArgument, match="trace line 1: not a JSON object"):
        load_trace(trace_file(tmp_path, obj))


def test_values_that_are_well_formed_are_taken_as_they_are():
    r = parse_request(json.loads(line(input_length=1024.0, output_length=3.0, hash_ids="[-1, 9223372036854775807]",
                                      timestamp=1.5)))
    assert (r.input_length, r.output_length, r.hash_ids, r.timestamp_ms) == (1024, 3, (-1, (1 << 63) - 1), 1.5)
    assert isinstance(r.input_length, int) and isinstance(r.output_length, int)
    assert parse_request({"timestamp": 0, "input_length": 0, "hash_ids": []}).hash_ids == ()
    assert parse_request({"timestamp": 0, "input_length": 4, "hash_ids": [7]}, block_tokens=4).hash_ids == (7,)
    with pytest.raises(InvalidArgument, match="'input_length' 5 needs 2 hash ids"):
        parse_request({"timestamp": 0, "input_length": 5, "hash_ids": [7]}, 3, block_tokens=4)


def test_the_cli_checks_hash_ids_at_its_block_size(tmp_path):
    """A trace cut at 512 tokens is refused at --block-tokens 256 (its token counts per block
    would be wrong), and taken at 512."""
    from kvstore import cli_replay

    path = tmp_path / "t.jsonl"
    write_trace(path, generate("chat", seed=1)[:30])
    app = cli_app(cli_replay, "replay", "replay")
    res = CliRunner().invoke(app, ["replay", str(path), "--hbm-blocks", "10", "--block-tokens", "256"])
    assert res.exit_code == 2 and "needs" in res.output and "one per 256 tokens" in one_line(res.output)
    assert CliRunner().invoke(app, ["replay", str(path), "--hbm-blocks", "10"]).exit_code == 0


@pytest.mark.skipif(not MOONCAKE.is_file(), reason="the shared Mooncake trace is not here")
def test_the_mooncake_trace_passes_the_checks():
    trace = load_trace(MOONCAKE)
    assert len(trace) == 3993
    assert all(len(r.hash_ids) == -(-r.input_length // 512) for r in trace)


# -- 5. output paths checked before the run --------------------------------------------------


@pytest.mark.parametrize(("target", "message"), [
    ("/proc/nope.json", "cannot be written"),
    ("{dir}", "is a directory"),
    ("{file}/r.json", "does not exist"),
])
def test_cli_replay_checks_that_the_json_file_can_be_written_before_it_runs(tmp_path, monkeypatch, target,
                                                                             message):
    """/proc/nope.json used to fail with a FileNotFoundError traceback after the whole replay."""
    from kvstore import cli_replay

    if target.startswith("/proc") and not Path("/proc").is_dir():
        pytest.skip("no /proc here")
    ran = []
    monkeypatch.setattr(cli_replay, "run_replay", lambda *a, **k: ran.append(1))
    path = trace_file(tmp_path, GOOD)
    out = target.format(dir=tmp_path, file=path)
    res = CliRunner().invoke(cli_app(cli_replay, "replay", "replay"),
                             ["replay", str(path), "--hbm-blocks", "5", "--json", out])
    assert res.exit_code == 2 and message in one_line(res.output), res.output
    assert not ran


def test_the_json_check_leaves_no_file_behind_and_keeps_an_existing_one(tmp_path):
    from kvstore.cli_replay import check_output_file

    new = tmp_path / "new.json"
    check_output_file(new, "--json")
    assert not new.exists()
    old = tmp_path / "old.json"
    old.write_text("kept")
    check_output_file(old, "--json")
    assert old.read_text() == "kept"


@pytest.mark.parametrize(("args", "message"), [
    (["--json", "{dir}"], "--json '{dir}' is a directory"),
    (["--json", "/proc/nope.json"], "cannot be written"),
    (["--json", "/proc/no/such/r.json"], "cannot create directory"),
    (["--json", "{dir}/r.json", "--plot", "{dir}"], "--plot '{dir}' is a directory"),
])
def test_bench_checks_its_output_files_before_the_suite_runs(tmp_path, monkeypatch, args, message):
    """`kvstore bench replay --quick --json DIR` used to run the whole suite, then raise
    IsADirectoryError."""
    import bench.suite
    from bench import cli as bench_cli

    if not Path("/proc").is_dir():
        pytest.skip("no /proc here")
    ran = []
    monkeypatch.setattr(bench.suite, "run_one", lambda *a, **k: ran.append(1) or {})
    monkeypatch.setattr(bench.suite, "run_suite", lambda *a, **k: ran.append(1) or {})
    args = [a.format(dir=tmp_path) for a in args]
    res = CliRunner().invoke(cli_app(bench_cli, "bench", "bench"), ["bench", "replay", "--quick", *args])
    assert res.exit_code == 2 and message.format(dir=tmp_path) in one_line(res.output), res.output
    assert not ran


def test_run_suite_checks_its_output_files_first(tmp_path, monkeypatch):
    import bench.suite

    ran = []
    monkeypatch.setattr(bench.suite, "run_one", lambda *a, **k: ran.append(1) or {})
    with pytest.raises(InvalidArgument, match="is a directory"):
        bench.suite.run_suite("replay", True, tmp_path, results_md=None, show_progress=False)
    assert not ran
