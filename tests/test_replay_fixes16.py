"""Replay input and output fixes after a prober (session 16): the result is never written over
the trace; an id covers the same tokens on every line; a byte that is not UTF-8 is reported on
its own line; option errors name the flag and its unit, line errors the file; the docs say what
the replay models (exclusive tiers, Belady per tier, one namespace)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

import kvstore.replay
from kvstore.errors import InvalidArgument
from kvstore.replay import ReplayConfig, make_replay_policy, run_replay
from kvstore.workloads import WORKLOADS, TraceRequest, WorkloadConfig, generate, load_trace, write_trace
from policy.cost_model import CostModelConfig

README = Path(__file__).resolve().parents[1] / "README.md"
TRACE = ('{"timestamp": 0, "input_length": 1024, "hash_ids": [1, 2]}\n'
         '{"timestamp": 5, "input_length": 1024, "hash_ids": [1, 2]}\n')


def app() -> typer.Typer:
    from kvstore import cli_replay

    a = typer.Typer()
    a.command("replay")(cli_replay.replay)

    @a.callback()
    def _root() -> None:
        pass

    return a


def one_line(output: str) -> str:
    return " ".join(output.split())  # rich wraps long lines


def invoke(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(app(), ["replay", *args])
    return res.exit_code, one_line(res.output)


# -- 1. --json never names the trace ----------------------------------------------------------


@pytest.mark.parametrize("how", ["same path", "relative path", "symlink", "hard link"])
def test_json_output_that_is_the_trace_is_refused_before_the_run(tmp_path, monkeypatch, how):
    """`kvstore replay T --json T` (or a link to T) overwrote the trace with the result, exit 0."""
    from kvstore import cli_replay

    trace = tmp_path / "trace.jsonl"
    trace.write_text(TRACE)
    out = {"same path": trace, "relative path": Path("trace.jsonl"),
           "symlink": tmp_path / "out.json", "hard link": tmp_path / "out.json"}[how]
    if how == "symlink":
        out.symlink_to(trace)
    elif how == "hard link":
        os.link(trace, out)
    monkeypatch.chdir(tmp_path)
    ran = []
    monkeypatch.setattr(cli_replay, "run_replay", lambda *a, **k: ran.append(1))
    code, output = invoke(str(trace), "--hbm-blocks", "4", "--json", str(out))
    assert code == 2, output
    assert "--json" in output and "is the trace" in output and "would overwrite it" in output
    assert trace.read_text() == TRACE and not ran


def test_json_output_elsewhere_is_still_written(tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text(TRACE)
    (tmp_path / "copy.json").write_text(TRACE)  # equal content, another file: not the trace
    code, output = invoke(str(trace), "--hbm-blocks", "4", "--json", str(tmp_path / "copy.json"))
    assert code == 0, output
    assert '"token_hit_rate": 0.5' in (tmp_path / "copy.json").read_text()
    assert trace.read_text() == TRACE


# -- 2. an id covers the same tokens on every line --------------------------------------------


def write(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "t.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_an_id_that_was_a_partial_block_and_then_a_full_one_is_refused(tmp_path):
    """The prober's trace: id 2 held 1 token on line 1 and 512 on line 2; the replay credited
    512 hit tokens for it (hit rate 0.6662 where at most 0.3338 is possible)."""
    path = write(tmp_path, '{"timestamp": 0, "input_length": 513, "hash_ids": [1, 2]}',
                 '{"timestamp": 1000, "input_length": 1024, "hash_ids": [1, 2]}')
    with pytest.raises(InvalidArgument, match=f"^{re.escape(str(path))}: trace line 2: hash id 2 covers 512 tokens "
                                              f"here but 1 on line 1"):
        load_trace(path)
    code, output = invoke(str(path), "--hbm-blocks", "8", "--policy", "lru")
    assert code == 2 and f"error: {path}: trace line 2: hash id 2 covers 512 tokens" in output, output


@pytest.mark.parametrize(("first", "second", "message"), [
    ("[1, 2]", "[1, 2, 3]", "trace line 2: hash id 2 covers 512 tokens here but 100 on line 1"),
    ("[1, 2, 3]", "[1, 2]", "trace line 2: hash id 2 covers 100 tokens here but 512 on line 1"),
])
def test_an_id_in_the_middle_and_at_the_partial_end_is_refused(tmp_path, first, second, message):
    lengths = {"[1, 2]": 612, "[1, 2, 3]": 1124}
    path = write(tmp_path, f'{{"timestamp": 0, "input_length": {lengths[first]}, "hash_ids": {first}}}',
                 f'{{"timestamp": 1, "input_length": {lengths[second]}, "hash_ids": {second}}}')
    with pytest.raises(InvalidArgument, match=message):
        load_trace(path)


def test_a_partial_block_with_other_tokens_under_the_same_id_is_refused(tmp_path):
    path = write(tmp_path, '{"timestamp": 0, "input_length": 600, "hash_ids": [1, 2]}',
                 '{"timestamp": 1, "input_length": 700, "hash_ids": [1, 2]}')
    with pytest.raises(InvalidArgument, match="trace line 2: hash id 2 covers 188 tokens here but 88 on line 1"):
        load_trace(path)


def test_a_partial_block_repeated_whole_is_taken_and_credited_with_its_tokens(tmp_path):
    path = write(tmp_path, '{"timestamp": 0, "input_length": 600, "hash_ids": [1, 2]}',
                 '{"timestamp": 1, "input_length": 600, "hash_ids": [1, 2]}',
                 '{"timestamp": 2, "input_length": 1024, "hash_ids": [1, 3]}')
    trace = load_trace(path)
    cfg = ReplayConfig(hbm_blocks=8, dram_blocks=0, nvme_blocks=0)
    r = run_replay(trace, cfg, make_replay_policy("lru", cfg))
    assert (r.total_tokens, r.hit_tokens) == (2224, 600 + 512)


@pytest.mark.parametrize("kind", WORKLOADS)
def test_generated_workloads_still_load(tmp_path, kind):
    trace = generate(kind, WorkloadConfig(requests=1500), seed=3)
    write_trace(tmp_path / "g.jsonl", trace)
    assert load_trace(tmp_path / "g.jsonl") == trace


# -- 3. a byte that is not UTF-8 is reported on its own line ----------------------------------


@pytest.mark.parametrize("bad_line", [2, 3001])
def test_a_byte_that_is_not_utf8_is_reported_on_its_line(tmp_path, bad_line):
    """It was "after line 0" for line 2 and "after line 2990" for line 3001 (the text layer
    decodes 8 KiB ahead of the lines)."""
    lines = [b'{"timestamp": %d, "input_length": 512, "hash_ids": [%d]}' % (i, i)
             for i in range(bad_line - 1)]
    lines.append(b'{"timestamp": 9999, "input_length": 512, "hash_ids": [\xff]}')
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(InvalidArgument, match=f"^{re.escape(str(path))}: trace line {bad_line}: not UTF-8 text"):
        load_trace(path)
    code, output = invoke(str(path), "--hbm-blocks", "4")
    assert code == 2 and f"trace line {bad_line}: not UTF-8 text" in output, output


def test_utf8_text_beyond_ascii_is_still_read(tmp_path):
    path = write(tmp_path, '{"timestamp": 0, "input_length": 512, "hash_ids": [1], "tenant": "zoë 🙂"}')
    assert load_trace(path)[0].tenant == "zoë 🙂"


# -- 4. errors name the flag, its unit, and the file ------------------------------------------


@pytest.mark.parametrize(("args", "message"), [
    (["--tflops", "1e7"], "--tflops must be in (0, 1e6] TFLOP/s, got 1e+07"),
    (["--tflops", "nan"], "--tflops must be in (0, 1e6] TFLOP/s, got nan"),
    (["--dram-gbps", "0"], "--dram-gbps must be in (0, 10000] GB/s, got 0"),
    (["--nvme-gbps", "inf"], "--nvme-gbps must be in (0, 10000] GB/s, got inf"),
    (["--params", "1e30"], "--params must be a finite number of parameters in [1, 1e14], got 1e+30"),
    (["--hidden", "2000000"], "--hidden must be at most 1000000, got 2000000"),
    (["--dtype", "foo"], "--dtype 'foo' is not supported"),
    (["--layers", "100000"], "a block would be 209715200000 bytes (2 × --layers 100000 × --kv-heads 8"),
])
def test_option_errors_name_the_flag_and_its_unit(tmp_path, monkeypatch, args, message):
    from kvstore import cli_replay

    ran = []
    monkeypatch.setattr(cli_replay, "run_replay", lambda *a, **k: ran.append(1))
    path = write(tmp_path, '{"timestamp": 0, "input_length": 512, "hash_ids": [1]}')
    code, output = invoke(str(path), "--hbm-blocks", "4", *args)
    assert code == 2 and f"error: {message}" in output, output
    assert "CostModelConfig" not in output and "ModelSpec" not in output and not ran


def test_line_errors_name_the_file(tmp_path):
    path = write(tmp_path, '{"timestamp": 0, "input_length": 512, "hash_ids": [1]}', "{oops")
    with pytest.raises(InvalidArgument, match=f"^{re.escape(str(path))}: trace line 2: not JSON"):
        load_trace(path)
    path = write(tmp_path, '{"timestamp": 0, "input_length": 512, "hash_ids": [1]}',
                 '{"timestamp": "x", "input_length": 512, "hash_ids": [2]}')
    code, output = invoke(str(path), "--hbm-blocks", "4")
    assert code == 2 and f"error: {path}: trace line 2: 'timestamp' must be a finite number" in output


# -- 5. the docs say what the replay models ---------------------------------------------------


def replay_section() -> str:
    text = README.read_text()
    start = text.index("## Policy replay")
    return " ".join(text[start:text.index("\n## ", start + 1)].split())


def test_docs_say_the_tiers_are_exclusive_and_the_store_keeps_its_nvme_copy():
    """The replay writes a block to NVMe on every demotion (here 5 writes for 2 blocks); the
    Store writes each once and keeps the copy. Its NVMe figures are the replay model's."""
    reqs = [TraceRequest(1000.0 * i, 512, 1, (h,)) for i, h in enumerate([1, 2, 1, 2, 1, 2])]
    cfg = ReplayConfig(hbm_blocks=1, dram_blocks=0, nvme_blocks=4)
    r = run_replay(reqs, cfg, make_replay_policy("lru", cfg))
    assert r.bytes_written_by_tier["nvme"] == 5 * cfg.spec.block_nbytes
    assert "**exclusive**" in replay_section() and "NVMe TB written" in replay_section()
    assert "Exclusive tiers" in (kvstore.replay.__doc__ or "")


def test_docs_say_belady_is_a_reference_that_lru_can_beat():
    """Belady's MIN per tier counts next uses, not restore costs: here it hits more tokens and
    LRU saves more prefill time, so a policy's "gap closed" can pass 100 %."""
    trace = [(1, (1001, 1002, 1003)), (1001, (1001, 1004, 1005)), (1011, (1001, 1002, 1006)),
             (1012, (1007, 1008, 1009)), (1022, (1010, 1011)), (1023, (1001, 1002, 1003, 1012, 1013)),
             (1024, (1007, 1014, 1015)), (2024, (1010, 1011, 1016, 1017, 1018)),
             (2025, (1001, 1002, 1006, 1019, 1020)), (3025, (1001, 1004, 1021, 1022)),
             (3026, (1001, 1002, 1003, 1023)), (3036, (1024,)), (3037, (1007, 1008, 1009, 1025)),
             (4037, (1001,)), (4047, (1007, 1008, 1026)), (4048, (1010, 1027, 1028, 1029))]
    reqs = [TraceRequest(float(t), 512 * len(ids), 1, ids) for t, ids in trace]
    cfg = ReplayConfig(hbm_blocks=2, dram_blocks=1, nvme_blocks=1, costs=CostModelConfig(nvme_gbps=1.0))
    lru, belady = (run_replay(reqs, cfg, make_replay_policy(p, cfg), check_invariants=True)
                   for p in ("lru", "belady"))
    assert belady.hit_tokens > lru.hit_tokens and lru.net_saved_s > belady.net_saved_s
    section = replay_section()
    assert "offline optimum" not in section
    assert "not** an optimum of the multi-tier problem" in section and "exceed 100 %" in section
    assert "not an optimum" in (kvstore.replay.__doc__ or "")


def test_docs_say_blocks_are_shared_across_tenants():
    reqs = [TraceRequest(0.0, 1024, 1, (1, 2), "a"), TraceRequest(1000.0, 1024, 1, (1, 2), "b")]
    cfg = ReplayConfig(hbm_blocks=8, dram_blocks=0, nvme_blocks=0)
    assert run_replay(reqs, cfg, make_replay_policy("lru", cfg)).token_hit_rate == 0.5
    assert "keyed by hash id only, across tenants" in replay_section()
    assert "One namespace" in (kvstore.replay.__doc__ or "")
