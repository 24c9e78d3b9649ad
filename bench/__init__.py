"""kvstore's benchmarks: each module measures its baselines in the same run and prints JSON.

Installed with kvstore so that ``kvstore bench`` works from any directory; it plugs into the
CLI through the ``kvstore.commands`` entry point (``bench.cli:bench``), so nothing in
``kvstore`` imports ``bench`` (the import direction of DESIGN.md §1).
"""
