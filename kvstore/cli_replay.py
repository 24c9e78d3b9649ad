"""``kvstore replay``: replay a Mooncake-format trace through a placement policy.

Register it on the CLI app with ``app.command("replay")(replay)``. Progress goes to stderr,
the results table to stdout, and ``--json`` writes the full result (see
:meth:`kvstore.replay.ReplayResult.to_dict`).

Example::

    kvstore replay ../shared/data/mooncake_synthetic_trace.jsonl --hbm-blocks 400 \\
        --policy cost --json out.json
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.replay import (
    ReplayConfig,
    ReplayResult,
    make_replay_policy,
    replay_spec,
    run_replay,
)
from kvstore.spec import DTYPES, MAX_BLOCK_BYTES
from kvstore.workloads import load_trace
from policy.cost_model import CostModelConfig


def results_table(results: list[ReplayResult], title: str = "replay") -> Table:
    """One column per result, one row per figure the issue asks for, human-readable.
    NOTE: one row per result with ten figure columns was cut to ``0.52…`` at 80 columns."""
    table = Table(title=title)
    table.add_column("figure", no_wrap=True)
    for r in results:
        table.add_column(r.policy, justify="right", no_wrap=True)

    def row(name: str, cell: Callable[[ReplayResult], str]) -> None:
        table.add_row(name, *(cell(r) for r in results))

    def tiers(d: dict[str, int]) -> str:
        return f"{d['hbm']}/{d['dram']}/{d['nvme']}"

    row("requests", lambda r: str(r.requests))
    row("token hit rate", lambda r: f"{r.token_hit_rate:.4f}")
    row("saved FLOPs fraction", lambda r: f"{r.saved_flops_fraction:.4f}")
    row("net saved time fraction", lambda r: f"{r.net_saved_time_fraction:.4f}")
    row("block hits hbm/dram/nvme", lambda r: tiers(r.block_hits_by_tier))
    row("DRAM written GB", lambda r: f"{r.bytes_written_by_tier['dram'] / 1e9:.1f}")
    row("NVMe written GB", lambda r: f"{r.bytes_written_by_tier['nvme'] / 1e9:.1f}")
    row("promoted GB", lambda r: f"{r.bytes_promoted / 1e9:.1f}")
    row("evictions hbm/dram/nvme", lambda r: tiers(r.evictions_by_tier))
    return table


def check_output_file(path: Path, option: str, inputs: dict[str, Path] | None = None) -> None:
    """InvalidArgument unless ``path`` can be written: not a directory, in an existing directory,
    not one of the ``inputs`` (name -> path: the same file, through a symbolic or hard link
    too), and a file there can be created or opened for writing. Tried by opening it for
    append, which writes nothing; a file the try creates is removed again."""
    if path.is_dir():
        raise InvalidArgument(f"{option} {str(path)!r} is a directory: name the file to write")
    if not path.parent.is_dir():
        raise InvalidArgument(f"{option} {str(path)!r}: directory {str(path.parent)!r} does not exist")
    # NOTE: `kvstore replay T --json T` (or --json a link to T) overwrote the trace with the
    # result and exited 0. samefile follows links and compares device and inode.
    for name, source in (inputs or {}).items():
        try:
            # NOTE: resolved paths too: two outputs not written yet (``--json x --plot x``) are
            # no files samefile could compare
            same = path.resolve() == Path(source).resolve() or (path.exists() and os.path.samefile(path, source))
        except OSError:
            same = False
        if same:
            raise InvalidArgument(f"{option} {str(path)!r} is the {name} {str(source)!r} "
                                  f"(the same file): writing the result there would overwrite it")
    existed = os.path.lexists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as exc:
        raise InvalidArgument(f"{option} {str(path)!r} cannot be written ({exc.strerror or exc})") from None
    if not existed:
        path.unlink(missing_ok=True)


def check_options(num_params: float, hidden_size: int, tflops: float, dram_gbps: float,
                  nvme_gbps: float, dtype: str, num_layers: int, kv_heads: int, head_dim: int,
                  block_tokens: int) -> None:
    """InvalidArgument naming the flag and its unit for a value the replay's model cannot take.
    NOTE: these were left to CostModelConfig and ModelSpec, whose errors named their fields
    and units (``--tflops 1e7`` said "CostModelConfig.flops_per_s must be in (0, 1e+18], got
    1e+19"); the bounds are theirs, in the flags' units."""
    if not (math.isfinite(num_params) and 1 <= num_params <= 1e14):
        raise InvalidArgument(f"--params must be a finite number of parameters in [1, 1e14], got {num_params:g}")
    if hidden_size > 1_000_000:
        raise InvalidArgument(f"--hidden must be at most 1000000, got {hidden_size}")
    if not (math.isfinite(tflops) and 0 < tflops <= 1e6):
        raise InvalidArgument(f"--tflops must be in (0, 1e6] TFLOP/s, got {tflops:g}")
    for flag, value in (("--dram-gbps", dram_gbps), ("--nvme-gbps", nvme_gbps)):
        if not (math.isfinite(value) and 0 < value <= 1e4):
            raise InvalidArgument(f"{flag} must be in (0, 10000] GB/s, got {value:g}")
    if dtype not in DTYPES:
        raise InvalidArgument(f"--dtype {dtype!r} is not supported; use one of {sorted(DTYPES)}")
    nbytes = 2 * num_layers * kv_heads * head_dim * block_tokens * DTYPES[dtype][1]
    if nbytes > MAX_BLOCK_BYTES:
        raise InvalidArgument(f"a block would be {nbytes} bytes (2 × --layers {num_layers} × --kv-heads "
                              f"{kv_heads} × --head-dim {head_dim} × --block-tokens {block_tokens} × "
                              f"{DTYPES[dtype][1]} bytes of {dtype}), more than {MAX_BLOCK_BYTES} (16 GiB)")


def replay(
    trace: Annotated[Path, typer.Argument(help="Mooncake-format JSONL trace.", exists=True,
                                          dir_okay=False, readable=True)],
    hbm_blocks: Annotated[int, typer.Option("--hbm-blocks", min=1, help="HBM capacity, blocks.")],
    dram_blocks: Annotated[int | None, typer.Option(
        "--dram-blocks", min=0, help="DRAM capacity in blocks (default 3 × HBM; 0 = none).")] = None,
    nvme_blocks: Annotated[int | None, typer.Option(
        "--nvme-blocks", min=0, help="NVMe capacity in blocks (default 10 × HBM; 0 = none).")] = None,
    policy: Annotated[str, typer.Option("--policy", help="lru, gdsf, cost or belady.")] = "cost",
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the result here.")] = None,
    num_params: Annotated[float, typer.Option("--params", help="Model parameters.")] = 8e9,
    num_layers: Annotated[int, typer.Option("--layers", min=1)] = 32,
    hidden_size: Annotated[int, typer.Option("--hidden", min=1)] = 4096,
    kv_heads: Annotated[int, typer.Option("--kv-heads", min=1)] = 8,
    head_dim: Annotated[int, typer.Option("--head-dim", min=1)] = 128,
    dtype: Annotated[str, typer.Option("--dtype", help="KV dtype (float16, bfloat16, float8...).")] = "float16",
    block_tokens: Annotated[int, typer.Option("--block-tokens", min=1)] = 512,
    tflops: Annotated[float, typer.Option("--tflops", help="Effective prefill TFLOP/s.")] = 400.0,
    dram_gbps: Annotated[float, typer.Option("--dram-gbps", help="DRAM→HBM GB/s.")] = 25.0,
    nvme_gbps: Annotated[float, typer.Option("--nvme-gbps", help="NVMe→HBM GB/s.")] = 5.0,
) -> None:
    """Replay TRACE through the policy and report hits, time saved and bytes moved."""
    err = Console(stderr=True)
    try:
        check_options(num_params, hidden_size, tflops, dram_gbps, nvme_gbps, dtype, num_layers,
                      kv_heads, head_dim, block_tokens)
        # NOTE: checked before the replay, which may run for minutes, not after it
        if json_out is not None:
            check_output_file(json_out, "--json", {"trace": trace})
        spec = replay_spec(num_layers=num_layers, num_kv_heads=kv_heads, head_dim=head_dim,
                           dtype=dtype, block_tokens=block_tokens, num_params=int(num_params),
                           hidden_size=hidden_size)
        costs = CostModelConfig(flops_per_s=tflops * 1e12, dram_gbps=dram_gbps,
                                nvme_gbps=nvme_gbps, num_params=int(num_params),
                                hidden_size=hidden_size)
        cfg = ReplayConfig.with_defaults(hbm_blocks, dram_blocks, nvme_blocks, spec=spec,
                                         costs=costs)
        pol = make_replay_policy(policy, cfg)
        requests = load_trace(trace, block_tokens)
        with Progress(TextColumn(f"replay {policy}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=err, transient=True) as bar:
            task = bar.add_task("replay", total=len(requests))
            result = run_replay(requests, cfg, pol,
                                progress=lambda done: bar.update(task, completed=done))
    except KVStoreError as exc:
        err.print(f"[red]error:[/red] {escape(str(exc))}")
        raise typer.Exit(code=2) from None
    out = Console()
    if not out.is_terminal:
        out = Console(width=200)  # piped: do not squeeze the table to 80 columns
    out.print(results_table(
        [result], title=f"{trace.name}: hbm={cfg.hbm_blocks} dram={cfg.dram_blocks} "
                        f"nvme={cfg.nvme_blocks} blocks"))
    if json_out is not None:
        doc = {"trace": str(trace), "hbm_blocks": cfg.hbm_blocks, "dram_blocks": cfg.dram_blocks,
               "nvme_blocks": cfg.nvme_blocks, **result.to_dict()}
        json_out.write_text(json.dumps(doc, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    """Run the command alone (``python -m kvstore.cli_replay``)."""
    app = typer.Typer(add_completion=False)
    app.command("replay")(replay)

    @app.callback()
    def _root() -> None:  # keeps "replay" as a named sub-command, as under ``kvstore``
        """kvstore trace replay."""

    app(args=argv, prog_name="kvstore")


if __name__ == "__main__":
    main()
