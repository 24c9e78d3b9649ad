"""Trace replay on small hand-written traces whose LRU and Belady results are worked out by
hand in the comments, plus the trace format and the ``kvstore replay`` command."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvstore.errors import InvalidArgument
from kvstore.replay import ReplayConfig, make_replay_policy, replay_spec, run_replay
from kvstore.workloads import TraceRequest, WorkloadConfig, generate, load_trace, write_trace
from policy.cost_model import CostModelConfig

# A tiny model so the arithmetic is easy: block = 4 tokens, 32 bytes.
SPEC = replay_spec(num_layers=1, num_kv_heads=1, head_dim=2, block_tokens=4, num_params=1000,
                   hidden_size=8)
# Recompute of a full block at depth 0: 2*1000*4 + 4*1*8*4*(0 + 2) = 8256 FLOPs -> 8.256 s at
# 1000 FLOP/s. Restore of 32 bytes from DRAM at 1e-8 GB/s (10 B/s) = 3.2 s.
COSTS = CostModelConfig(flops_per_s=1e3, dram_gbps=1e-8, nvme_gbps=1e-8, num_params=1000,
                        hidden_size=8)
REC = 8.256


def req(t: int, *ids: int, tokens: int | None = None) -> TraceRequest:
    return TraceRequest(timestamp_ms=1000.0 * t, input_length=tokens or 4 * len(ids),
                        output_length=1, hash_ids=ids)


def replay(trace, policy, hbm, dram=0, nvme=0):
    cfg = ReplayConfig(hbm_blocks=hbm, dram_blocks=dram, nvme_blocks=nvme, spec=SPEC, costs=COSTS)
    return run_replay(trace, cfg, make_replay_policy(policy, cfg), check_invariants=True)


# HBM only, 2 blocks. Requests: 1, 2, 1, 3, 2, 1.
#   LRU:    1 miss {1}; 2 miss {1,2}; 1 HIT; 3 miss, evict 2 (older) {1,3};
#           2 miss, evict 1 {3,2}; 1 miss, evict 3 {2,1}                      -> 1 hit
#   Belady: same until 3: evict 1 (next use: request 5) rather than 2 (request 4) {2,3};
#           2 HIT; 1 miss                                                      -> 2 hits
HBM_ONLY = [req(0, 1), req(1, 2), req(2, 1), req(3, 3), req(4, 2), req(5, 1)]


def test_hbm_only_lru_by_hand():
    r = replay(HBM_ONLY, "lru", hbm=2)
    assert r.block_hits_by_tier == {"hbm": 1, "dram": 0, "nvme": 0}
    assert r.token_hit_rate == pytest.approx(1 / 6)
    # HBM hits restore for free: time saved = FLOPs saved
    assert r.net_saved_time_fraction == pytest.approx(1 / 6)
    assert r.saved_flops_fraction == pytest.approx(1 / 6)
    assert r.evictions_by_tier["hbm"] == 3


def test_hbm_only_belady_by_hand():
    r = replay(HBM_ONLY, "belady", hbm=2)
    assert r.block_hits_by_tier == {"hbm": 2, "dram": 0, "nvme": 0}
    assert r.net_saved_time_fraction == pytest.approx(2 / 6)


# HBM 1 block, DRAM 1 block. Requests: 1, 2, 1, 2.
#   LRU:  1 miss {H:1}; 2 miss: 1 demoted {H:2, D:1};
#         1 HIT in DRAM, pinned; promoting it needs HBM room: 2 is evicted, but DRAM is full of
#         the pinned 1, so 2 is dropped; 1 moves up {H:1};
#         2 miss: 1 demoted {H:2, D:1}.
#   hits: 1 in DRAM, saving 8.256 - 3.2 s of 4 x 8.256 s; written to DRAM: 2 blocks (64 B);
#   promoted 1 block (32 B); HBM evictions 3 (one of them dropped).
#   Belady: the same, except at the last request: block 1 is never used again, so it is
#   dropped instead of demoted -> DRAM written 32 B, 2 drops.
TWO_TIERS = [req(0, 1), req(1, 2), req(2, 1), req(3, 2)]


@pytest.mark.parametrize("policy", ["lru", "belady"])
def test_promotion_and_demotion_by_hand(policy):
    r = replay(TWO_TIERS, policy, hbm=1, dram=1)
    assert r.block_hits_by_tier == {"hbm": 0, "dram": 1, "nvme": 0}
    assert r.net_saved_s == pytest.approx(REC - 3.2)
    assert r.net_saved_time_fraction == pytest.approx((REC - 3.2) / (4 * REC))
    assert r.bytes_written_by_tier["dram"] == (64 if policy == "lru" else 32)
    assert r.bytes_promoted == 32
    assert r.evictions_by_tier["hbm"] == 3
    assert r.drops_by_tier["hbm"] == (1 if policy == "lru" else 2)


# Prefix tree, HBM 3 blocks. Requests: [1,2,3], [1,2,4], [1,2,3].
#   LRU:  miss x3 {1,2,3}; hits 1,2 then 4 misses: the only candidate (unpinned, no child in
#         HBM) is 3 -> {1,2,4}; hits 1,2, 3 misses: evict 4 -> {1,2,3}.  Hits: 4 of 9 blocks.
#   Belady: the same (3 and 4 are the only candidates each time).            Hits: 4.
PREFIX = [req(0, 1, 2, 3), req(1, 1, 2, 4), req(2, 1, 2, 3)]


@pytest.mark.parametrize("policy", ["lru", "belady", "gdsf", "cost"])
def test_prefix_hits_and_leaf_first_eviction(policy):
    r = replay(PREFIX, policy, hbm=3)
    assert r.block_hits_by_tier["hbm"] == 4
    assert r.evictions_by_tier["hbm"] == 2


def test_hit_stops_at_the_first_missing_block():
    # [1,2,3] then [1,9,3]: 9 is not a child of 1 in the cache, so only 1 hits; and hash id 3
    # would then sit under two parents, which the trace format forbids.
    with pytest.raises(InvalidArgument):
        replay([req(0, 1, 2, 3), req(1, 1, 9, 3)], "lru", hbm=8)
    r = replay([req(0, 1, 2, 3), req(1, 1, 9, 10)], "lru", hbm=8)
    assert r.block_hits_by_tier["hbm"] == 1


def test_partial_tail_tokens_are_counted():
    # 3 blocks, last one holds 2 tokens: 4 + 4 + 2 = 10 tokens; second time all hit
    r = replay([req(0, 1, 2, 3, tokens=10), req(1, 1, 2, 3, tokens=10)], "lru", hbm=4)
    assert r.total_tokens == 20
    assert r.token_hit_rate == pytest.approx(0.5)


def test_result_json_has_the_issue_keys():
    r = replay(HBM_ONLY, "cost", hbm=2, dram=2, nvme=2).to_dict()
    for key in ("token_hit_rate", "block_hits_by_tier", "saved_flops_fraction",
                "net_saved_time_fraction", "bytes_written_by_tier", "bytes_promoted",
                "evictions_by_tier", "requests"):
        assert key in r
    json.dumps(r)


def test_trace_round_trip_and_bad_lines(tmp_path):
    trace = generate("chat", seed=3)[:50]
    path = tmp_path / "t.jsonl"
    write_trace(path, trace)
    assert load_trace(path) == trace
    (tmp_path / "bad.jsonl").write_text('{"timestamp": 0, "hash_ids": [1]}\n')
    with pytest.raises(InvalidArgument):
        load_trace(tmp_path / "bad.jsonl")


def test_a_trace_out_of_arrival_order_is_refused_naming_the_line(tmp_path):
    """The replay's clock follows the trace: an unsorted one would run time backwards."""
    path = tmp_path / "unsorted.jsonl"
    rows = [(5, [1, 2]), (5, [1, 2, 3]), (3, [4])]
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": 512 * len(ids), "output_length": 1,
                                        "hash_ids": ids}) + "\n" for t, ids in rows))
    with pytest.raises(InvalidArgument, match="trace line 3: timestamp 3.0 comes before line 2's 5.0"):
        load_trace(path)
    path.write_text(path.read_text().replace('"timestamp": 3', '"timestamp": 7'))
    assert [r.timestamp_ms for r in load_trace(path)] == [5.0, 5.0, 7.0]  # ties are in order


@pytest.mark.parametrize("kind", ["chat", "agent", "shared_prompt", "tenants"])
def test_generated_workloads_load_back_in_arrival_order(tmp_path, kind):
    trace = generate(kind, seed=2)
    write_trace(tmp_path / "w.jsonl", trace)
    assert load_trace(tmp_path / "w.jsonl") == trace


@pytest.mark.parametrize("kind", ["chat", "agent", "shared_prompt", "tenants"])
def test_generators_are_seeded_and_well_formed(kind):
    a, b = generate(kind, seed=7), generate(kind, seed=7)
    assert a == b and a != generate(kind, seed=8)
    parents: dict[int, int | None] = {}
    for r in a:
        assert len(r.hash_ids) == -(-r.input_length // 512)
        prev = None
        for h in r.hash_ids:
            assert parents.setdefault(h, prev) == prev  # one parent per id: a prefix tree
            prev = h
    assert [r.timestamp_ms for r in a] == sorted(r.timestamp_ms for r in a)


def test_cli_replay_writes_json(tmp_path):
    import typer

    from kvstore.cli_replay import replay as replay_cmd

    app = typer.Typer()  # registered the way kvstore/cli.py does: app.command("replay")
    app.command("replay")(replay_cmd)

    @app.callback()
    def _root() -> None:
        pass

    path = tmp_path / "t.jsonl"
    write_trace(path, generate("agent", seed=1)[:200])
    out = tmp_path / "r.json"
    res = CliRunner().invoke(app, ["replay", str(path), "--hbm-blocks", "50", "--policy", "lru",
                                   "--json", str(out)])
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert doc["requests"] == 200 and doc["policy"] == "lru" and doc["dram_blocks"] == 150
    assert "net saved time" in res.stdout
    bad = CliRunner().invoke(app, ["replay", str(path), "--hbm-blocks", "50", "--policy", "nope"])
    assert bad.exit_code == 2


@pytest.mark.parametrize("kind", ["chat", "agent", "tenants"])
@pytest.mark.parametrize("n", [1000, 4000])
def test_generated_sessions_keep_arriving_to_the_end_of_the_trace(kind, n):
    # sessions stopped starting once 1.2 x n requests were generated: the last tenth of an
    # agent trace held 0.41-0.47 of the requests of a tenth before it (tenants 0.27-0.34)
    trace = generate(kind, seed=0, cfg=WorkloadConfig(requests=n))
    assert len(trace) == n
    end = trace[-1].timestamp_ms
    tenths = [0] * 10
    for r in trace:
        tenths[min(9, int(10 * r.timestamp_ms / end))] += 1
    assert tenths[9] >= 0.75 * max(tenths[5:9]), tenths


def test_the_results_table_reads_whole_at_80_columns(tmp_path):
    # ten figure columns were cut to "0.52…" on an 80-column terminal
    import io

    from rich.console import Console

    from kvstore.cli_replay import results_table

    path = tmp_path / "t.jsonl"
    write_trace(path, generate("agent", seed=1)[:100])
    results = [replay(load_trace(path), p, 20, 60, 200) for p in ("lru", "belady")]
    buf = io.StringIO()
    Console(file=buf, width=80).print(results_table(results))
    text = buf.getvalue()
    assert "…" not in text and max(map(len, text.splitlines())) <= 80
    for r in results:
        assert f"{r.net_saved_time_fraction:.4f}" in text
        assert f"{r.evictions_by_tier['hbm']}/{r.evictions_by_tier['dram']}/{r.evictions_by_tier['nvme']}" in text


def test_oracle_reuse_reference_by_hand():
    """``bench.replay_ceiling``'s reference knows only *whether* a block comes back.
    HBM 2 blocks, requests 1, 2, 9, 1, 2: 9 is never read again.
      LRU:          {1,2}; 9 evicts 1 {2,9}; 1 evicts 2 {9,1}; 2 evicts 9 {1,2}  -> 0 hits
      oracle-reuse: 9 evicts 1 (LRU: both come back) {2,9}; 1 evicts 9 (never read
                    again) {2,1}; 2 HIT                                          -> 1 hit"""
    from bench.replay_bounds import OracleReuseLRU

    trace = [req(0, 1), req(1, 2), req(2, 9), req(3, 1), req(4, 2)]
    cfg = ReplayConfig(hbm_blocks=2, dram_blocks=0, nvme_blocks=0, spec=SPEC, costs=COSTS)
    assert run_replay(trace, cfg, make_replay_policy("lru", cfg)).block_hits_by_tier["hbm"] == 0
    r = run_replay(trace, cfg, OracleReuseLRU(), check_invariants=True)
    assert r.block_hits_by_tier["hbm"] == 1 and r.net_saved_s == pytest.approx(REC)


def test_oracle_probability_reference_uses_the_cost_decisions():
    """``oracle-p`` is the ``cost`` policy fed the truth as p. HBM 2 blocks, requests 1, 9, 2, 1:
      LRU:      {1,9}; 2 evicts 1 (older) {9,2}; 1 misses                      -> 0 hits
      oracle-p: {1,9}; 2 evicts 9 (p = 0.02 against 0.95: lower value) {1,2}; 1 HIT -> 1 hit"""
    from bench.replay_bounds import OracleProbabilityCost, spec_lookup

    trace = [req(0, 1), req(1, 9), req(2, 2), req(3, 1)]
    cfg = ReplayConfig(hbm_blocks=2, dram_blocks=0, nvme_blocks=0, spec=SPEC, costs=COSTS)
    assert run_replay(trace, cfg, make_replay_policy("lru", cfg)).block_hits_by_tier["hbm"] == 0
    pol = OracleProbabilityCost(spec_lookup(cfg))
    r = run_replay(trace, cfg, pol, check_invariants=True)
    assert r.block_hits_by_tier["hbm"] == 1 and r.net_saved_s == pytest.approx(REC)
    assert pol.name == "oracle-p"


def test_fitted_feature_rates_by_hand():
    """Uses: block 1 at t=0 (new, request of 1 block, last of it), block 1 again at t=1 s
    (used once before, 1 s since), block 2 at t=2 (new, like the first use of 1).
    Class (new, 1 block, last, no gap): 2 uses, 1 followed by another -> (1+1)/(2+2) = 0.5.
    Class (used once, 1 block, last, gap 1 s): 1 use, none followed -> (0+1)/(1+2) = 1/3."""
    from bench.replay_bounds import fitted_rates
    from kvstore.replay import block_key

    rates = fitted_rates([req(0, 1), req(1, 1), req(2, 2)])
    assert rates == {(block_key(1), 0): pytest.approx(0.5), (block_key(1), 1): pytest.approx(1 / 3),
                     (block_key(2), 0): pytest.approx(0.5)}


def test_fitted_features_reference_replays_within_the_invariants():
    from bench.replay_bounds import FittedFeaturesCost, spec_lookup

    trace = generate("chat", seed=3)[:300]
    cfg = ReplayConfig.with_defaults(20)
    pol = FittedFeaturesCost(trace, spec_lookup(cfg))
    r = run_replay(trace, cfg, pol, check_invariants=True)
    lru = run_replay(trace, cfg, make_replay_policy("lru", cfg))
    assert r.requests == 300 and r.total_recompute_s == pytest.approx(lru.total_recompute_s)
    assert 0.0 < r.net_saved_time_fraction < 1.0


def test_crossfit_rates_by_hand():
    """Requests 1 (t=0), 1 (t=1 s), 2 (t=2), 4 (t=3), each of one block; folds by root parity:
    root 1 in fold 1, roots 2 and 4 in fold 0. Cell A = (new, 1 block, last, no gap): fold 0 has
    2 uses, none followed; fold 1 has 1, followed. Cell B = (used once, 1 block, last, 1 s):
    fold 1 has 1, not followed. Each fold's rates come from the other, smoothed with weight 2
    toward its overall rate (again + 1) / (uses + 2): fold 0's is 1/4, fold 1's 2/4.
      block 1, use 0 (fold 1): A in fold 0  -> (0 + 2·1/4) / (2 + 2) = 1/8
      block 1, use 1 (fold 1): B unseen in fold 0 -> (0 + 2·1/4) / (0 + 2) = 1/4
      blocks 2, 4, use 0 (fold 0): A in fold 1 -> (1 + 2·1/2) / (1 + 2) = 2/3
    (in-sample, :func:`fitted_rates` gives cell A (1 + 1) / (3 + 2) for every one of them)."""
    from bench.replay_ceiling import crossfit_rates, root_fold
    from kvstore.replay import block_key

    trace = [req(0, 1), req(1, 1), req(2, 2), req(3, 4)]
    rates = crossfit_rates(trace, fold=lambda root: root % 2)
    assert rates == {(block_key(1), 0): pytest.approx(1 / 8), (block_key(1), 1): pytest.approx(1 / 4),
                     (block_key(2), 0): pytest.approx(2 / 3), (block_key(4), 0): pytest.approx(2 / 3)}
    fold = root_fold(2, seed=0)
    assert {fold(r) for r in range(200)} == {0, 1} and fold(7) == root_fold(2, seed=0)(7)


def test_crossfit_reference_replays_within_the_invariants():
    from bench.replay_bounds import spec_lookup
    from bench.replay_ceiling import CrossFittedCost, crossfit_rates

    trace = generate("chat", seed=3)[:300]
    cfg = ReplayConfig.with_defaults(20)
    pol = CrossFittedCost(trace, spec_lookup(cfg))
    assert pol.name == "fitted-crossfit" and pol._rates == crossfit_rates(trace)
    r = run_replay(trace, cfg, pol, check_invariants=True)
    assert r.requests == 300 and 0.0 < r.net_saved_time_fraction < 1.0


def test_ceiling_bench_reports_the_crossfit_mean_over_its_splits(tmp_path):
    from bench.replay_ceiling import CROSSFIT_SEEDS, REFERENCES, run

    path = tmp_path / "chat.jsonl"
    write_trace(path, generate("chat", seed=3)[:200])
    (row,) = run(path, [20])
    got, by_seed = row["net_saved_time_fraction"], row["crossfit_by_seed"]
    assert set(got) == set(REFERENCES) and len(by_seed) == len(CROSSFIT_SEEDS)
    span = got["belady"] - got["lru"]
    assert span > 0
    mean_gap = sum(by_seed.values()) / len(by_seed)
    assert row["gap_closed"]["fitted-crossfit"] == pytest.approx(mean_gap)
    assert got["fitted-crossfit"] == pytest.approx(got["lru"] + mean_gap * span)


def test_repeat_bench_doubles_the_trace_with_fresh_ids_and_splits_the_passes():
    """``bench.replay_repeat``: the copy reads nothing of the first pass, starts after it, and
    the first pass of the doubled replay is the single replay (so the split is exact)."""
    from bench.replay_repeat import doubled, passes

    trace = [req(0, 1, 2), req(1, 1, 2, 3), req(2, 7)]
    two = doubled(trace, gap_ms=500.0)
    assert [r.hash_ids for r in two[3:]] == [(9, 10), (9, 10, 11), (15,)]  # ids + 8
    assert two[3].timestamp_ms == 2000.0 + 500.0 and len(two) == 6
    assert doubled([]) == []
    cfg = ReplayConfig(hbm_blocks=4, dram_blocks=0, nvme_blocks=0, spec=SPEC, costs=COSTS)
    first, second = passes(trace, cfg, "lru")
    assert first == pytest.approx(run_replay(trace, cfg, make_replay_policy("lru", cfg))
                                  .net_saved_time_fraction)
    # HBM 4 holds 1, 2, 3 and 7; the copy starts cold but its own hits (8, 9) match the first's
    assert second == pytest.approx(first)


def test_a_trace_with_no_request_or_not_text_is_refused(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(InvalidArgument, match="holds no request"):
        load_trace(empty)
    binary = tmp_path / "bin.jsonl"
    binary.write_bytes(b'{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1]}\n\xff\xfe\x00')
    with pytest.raises(InvalidArgument, match="not UTF-8 text"):
        load_trace(binary)


@pytest.mark.parametrize(("args", "message"), [
    (["--params", "nan"], "--params must be a finite number"),
    (["--params", "0"], "--params must be a finite number"),
    (["--json", "{missing}/r.json"], "does not exist"),
    (["--json", "{dir}"], "is a directory"),
])
def test_cli_replay_refuses_bad_options_before_it_runs(tmp_path, monkeypatch, args, message):
    """Bad options fail with exit code 2 and a one-line error before the replay starts (a
    --json path that cannot be written used to fail with a traceback after the whole replay)."""
    import typer

    from kvstore import cli_replay

    ran = []
    monkeypatch.setattr(cli_replay, "run_replay", lambda *a, **k: ran.append(1))
    app = typer.Typer()
    app.command("replay")(cli_replay.replay)

    @app.callback()
    def _root() -> None:
        pass

    path = tmp_path / "t.jsonl"
    write_trace(path, generate("agent", seed=1)[:20])
    args = [a.format(missing=tmp_path / "no" / "such", dir=tmp_path) for a in args]
    res = CliRunner().invoke(app, ["replay", str(path), "--hbm-blocks", "5", *args])
    assert res.exit_code == 2 and message in " ".join(res.output.split()), res.output  # rich wraps lines
    assert not ran
