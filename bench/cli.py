"""``kvstore bench SUITE [--quick] --json OUT [--plot OUT.png]``: the benchmark suite.

Thin: parses options and calls :func:`bench.suite.run_suite` (imported lazily, so the rest of the
CLI never loads the benchmarks). The suite writes its section of ``bench/RESULTS.md`` too.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Annotated

import typer

SUITES = ("tiers", "service", "replay", "peers")


def bench(
    suite: Annotated[str, typer.Argument(help="tiers | service | replay | peers")],
    quick: Annotated[bool, typer.Option("--quick", help="small, fast run (CI smoke)")] = False,
    json_out: Annotated[Path, typer.Option("--json", help="where to write the JSON figures")] = ...,  # type: ignore[assignment]
    plot: Annotated[Path | None, typer.Option("--plot", help="also draw a PNG here")] = None,
    results: Annotated[Path | None, typer.Option(
        "--results", help="Markdown results file to update (default bench/RESULTS.md)")] = None,
) -> None:
    """Run a benchmark suite; figures are medians measured next to their baselines, same run."""
    if suite not in SUITES:
        raise typer.BadParameter(f"unknown suite {suite!r}; choose one of {', '.join(SUITES)}")
    from kvstore.memtune import reexec_with_streaming_copies

    # NOTE: as `kvstore serve` does (ServerConfig.streaming_copy_bytes): the store's block copies,
    # the limits they are judged against and every baseline's child process run under it alike
    reexec_with_streaming_copies()
    from bench.suite import DEFAULT_RESULTS, check_outputs, run_suite
    from kvstore.errors import KVStoreError

    try:
        check_outputs(json_out, plot, results or DEFAULT_RESULTS)  # before the suite, which may run for minutes
    except KVStoreError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from None

    cmd = ["kvstore", "bench", suite, *(["--quick"] if quick else []), "--json", str(json_out),
           *(["--plot", str(plot)] if plot else []), *(["--results", str(results)] if results else [])]
    doc = run_suite(suite, quick, json_out, plot, results or DEFAULT_RESULTS, command=shlex.join(cmd))
    typer.echo(f"{suite}: wrote {json_out} ({doc['wall_s']} s, load {doc['machine']['loadavg_start']}"
               f" -> {doc['machine']['loadavg_end']})")
