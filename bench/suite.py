"""The benchmark suite behind ``kvstore bench SUITE [--quick] --json OUT [--plot OUT.png]``.

Suites (each measures its baselines in the same run; see the module of each):

* ``tiers``   — every Store migration path next to its physical limit (``bench.suite_tiers``).
* ``service`` — the gRPC paths against memcpy, bare grpcio and Redis (``bench/service_bench.py``,
  run as a child process) plus aggregate throughput of 1, 4 and 16 concurrent clients
  (``bench.suite_service``).
* ``replay``  — every placement policy over several HBM capacities (``bench/replay_bench.py``),
  a table and a plot of net saved time vs HBM capacity per policy.
* ``peers``   — the same put/get workload through LMCache (in its own venv), Redis and kvstore
  (``bench.suite_peers``).

:func:`run_suite` writes the JSON document (machine, date, command, load average at start and end,
the suite's figures), the plot when asked, and the suite's section of ``bench/RESULTS.md``
(``bench.suite_report``). Progress goes to stderr as rich progress bars.

    python -m bench.suite tiers --quick --json /tmp/tiers.json
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shlex
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

REPO = Path(__file__).resolve().parents[1]
DEFAULT_RESULTS = REPO / "bench" / "RESULTS.md"
SUITES = ("tiers", "service", "replay", "peers")

Tick = Callable[[], None]
TickFactory = Callable[[str, int], Tick]
"""``tick(description, total)`` adds a progress bar and returns its per-step callback."""


@contextmanager
def progress_bars(enabled: bool = True) -> Iterator[TickFactory]:
    """Rich progress bars on stderr; ``enabled=False`` gives silent callbacks."""
    if not enabled:
        yield lambda _desc, _total: (lambda: None)
        return
    bars = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=Console(stderr=True), transient=False)
    with bars:
        def factory(desc: str, total: int) -> Tick:
            task = bars.add_task(desc, total=total)
            return lambda: bars.advance(task)

        yield factory


def machine() -> dict[str, Any]:
    """Host facts (CPU, memory, versions, git commit) and the load average now."""
    from bench.store_bench import machine_info

    info = machine_info()
    info["loadavg_start"] = [round(x, 2) for x in info["loadavg_start"]]
    return info


def run_one(suite: str, quick: bool, tick: TickFactory, workdir: Path) -> dict[str, Any]:
    """The figures of one suite (a JSON-ready dict)."""
    if suite == "tiers":
        from bench.suite_tiers import run_tiers

        sizes = iter(range(1000))
        return run_tiers(quick, workdir, lambda total: tick(f"tiers case {next(sizes) + 1}", total))
    if suite == "replay":
        from bench.suite_replay import run_replay_suite

        return run_replay_suite(quick, tick)
    if suite == "service":
        from bench.suite_service import run_service_suite

        return run_service_suite(quick, tick, workdir)
    if suite == "peers":
        from bench.suite_peers import run_peers

        return run_peers(quick, tick, workdir)
    raise ValueError(f"unknown suite {suite!r}; choose one of {', '.join(SUITES)}")


def check_outputs(json_out: Path, plot: Path | None = None, results_md: Path | None = None) -> None:
    """InvalidArgument unless the suite's output files can be written (the directory of
    ``json_out`` is created as :func:`run_suite` does) and are distinct files: ``--json``,
    ``--plot`` and the results markdown (NOTE: ``--json x --plot x`` wrote the plot over the
    figures). Checked before a suite that may run for many minutes, not when it is over."""
    from kvstore.cli_replay import check_output_file
    from kvstore.errors import InvalidArgument

    try:
        json_out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InvalidArgument(f"--json {str(json_out)!r}: cannot create directory "
                              f"{str(json_out.parent)!r} ({exc.strerror or exc})") from None
    results = {"results file (--results)": results_md} if results_md is not None else {}
    check_output_file(json_out, "--json", results)
    if plot is not None:
        check_output_file(plot, "--plot", {"--json output": json_out, **results})


def run_suite(suite: str, quick: bool, json_out: Path, plot: Path | None = None,
              results_md: Path | None = DEFAULT_RESULTS, command: str | None = None,
              show_progress: bool = True) -> dict[str, Any]:
    """Run ``suite``, write ``json_out`` (and ``plot``, and the suite's section of
    ``results_md`` unless None); returns the JSON document."""
    import torch

    from bench import suite_report

    if suite not in SUITES:
        raise ValueError(f"unknown suite {suite!r}; choose one of {', '.join(SUITES)}")
    check_outputs(json_out, plot, results_md)
    torch.set_num_threads(1)
    started = time.perf_counter()
    doc: dict[str, Any] = {
        "suite": suite, "quick": quick,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": command or shlex.join(["kvstore", "bench", *sys.argv[1:]]),
        "machine": machine(),
    }
    with tempfile.TemporaryDirectory(prefix=f"kvstore-bench-{suite}-") as tmp, \
            progress_bars(show_progress) as tick:
        doc["results"] = run_one(suite, quick, tick, Path(tmp))
    doc["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    doc["wall_s"] = round(time.perf_counter() - started, 1)
    if plot is not None:
        suite_report.plot(doc, plot)
        doc["plot"] = str(plot)
    json_out.parent.mkdir(parents=True, exist_ok=True)
    json_out.write_text(json.dumps(doc, indent=1) + "\n")
    if results_md is not None:
        suite_report.write_section(results_md, doc, plot)
    return doc


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("suite", choices=SUITES)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", type=Path, required=True, dest="json_out")
    ap.add_argument("--plot", type=Path, default=None)
    ap.add_argument("--results", type=Path, default=DEFAULT_RESULTS)
    args = ap.parse_args(argv)
    cmd = shlex.join(["python", "-m", "bench.suite", *(sys.argv[1:] if argv is None else argv)])
    from kvstore.errors import KVStoreError

    try:
        check_outputs(args.json_out, args.plot, args.results)
    except KVStoreError as exc:
        ap.error(str(exc))
    run_suite(args.suite, args.quick, args.json_out, args.plot, args.results, command=cmd)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
