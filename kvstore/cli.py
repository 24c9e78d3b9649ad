"""The ``kvstore`` console script: one typer app gathering the command groups.

* ``serve``, ``tenant``, ``policy``, ``session``, ``model``, ``stats``, ``audit`` — the sidecar and its
  operators (``kvstore.cli_serve``)
* ``replay`` — trace replay through the placement policies (``kvstore.cli_replay``)
* ``bench``  — the benchmark suites: tiers, service, replay, peers (``bench.cli``, plugged in
  through the ``kvstore.commands`` entry point so that kvstore never imports bench)
* ``demo``   — a chat model reusing prompt KV through an embedded sidecar (``kvstore.cli_demo``)

``main(argv=None)`` is testable by construction.
"""

from __future__ import annotations

from importlib.metadata import entry_points

import typer

from kvstore.cli_demo import demo
from kvstore.cli_replay import replay
from kvstore.cli_serve import register as register_service_commands
from kvstore.cli_views import one_line_listings

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="kvstore: a tiered KV-cache store for LLM inference.")
register_service_commands(app)
app.command("replay")(replay)
for _ep in entry_points(group="kvstore.commands"):
    app.command(_ep.name)(_ep.load())
app.command("demo")(demo)
one_line_listings(app)


def main(argv: list[str] | None = None) -> None:
    if argv is None:  # the console script: this process is ours (serve and bench may re-exec it)
        from kvstore.memtune import process_entry

        process_entry()
    app(args=argv, prog_name="kvstore")


if __name__ == "__main__":
    main()
