"""Plots (matplotlib, Agg) and the ``bench/RESULTS.md`` sections of the benchmark suite.

``RESULTS.md`` holds one section per suite (``quick`` runs get their own), delimited by HTML
comments; a run replaces its own section and leaves the others as they are, so the file always
shows the last real run of every suite, written by the suite itself.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from bench.pyspy_profile import profiles_md

HEADER = ("# Benchmark results\n\nWritten by `kvstore bench SUITE` (bench/suite.py); do not edit "
          "by hand. GB/s = 1e9 bytes/s, medians over rounds. The machine may be shared: see the "
          "load average of each run.\n")


# -- markdown ---------------------------------------------------------------------------------
def _table(head: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def _tiers_md(res: dict[str, Any]) -> str:
    out = []
    for case in res["cases"]:
        out.append(f"**{case['block_mib']} MiB blocks** ({case['dtype']}, {case['blocks_per_op']} "
                   f"per op, {case['rounds']} rounds)\n")
        out.append(_table(["limit stage", "GB/s"], [[k, v] for k, v in case["limits"].items()]
                          + [[f"{k} (reference, not a limit)", v]
                             for k, v in case.get("reference", {}).items()]))
        out.append("")
        rows = [[p["path"], p["gbps"], f"{p['limit']} {p['limit_gbps']}", p["ratio"],
                 p.get("vs_disk_write_fsync", ""), "yes" if p["pass"] else "**no**"]
                for p in case["paths"]]
        out.append(_table(["path", "GB/s", "limit (slowest stage) GB/s", "ratio",
                           "vs disk+fsync", f">= {res['target_ratio']}x"], rows))
        out.append("")
    return "\n".join(out)


def _replay_md(res: dict[str, Any]) -> str:
    pols = res["policies"]
    rows = []
    for e in res["summary"]:
        cells = []
        for p in pols:
            if p not in e:
                cells.append("-")
                continue
            s = f"{e[p]['net_saved_time_fraction']:.4f}"
            if e[p].get("gap_closed") is not None:
                s += f" [{e[p]['gap_closed']:.2f}]"
            cells.append(s)
        rows.append([f"{e['trace']}#{e['seed']}", e["hbm_blocks"], *cells])
    skipped = "".join(f"skipped: {line}\n\n" for line in res.get("skipped", ()))
    return (skipped + "net saved time fraction per policy [share of the LRU->Belady gap closed]; DRAM = "
            f"{res['dram_factor']}x, NVMe = {res['nvme_factor']}x HBM\n\n"
            + _table(["trace", "HBM blocks", *pols], rows) + "\n")


def _peers_md(res: dict[str, Any]) -> str:
    """One table of GB/s per case (every system side by side), then the issue's targets."""
    if "cases" not in res:
        return _flat_md(res)
    out = [f"{res.get('shape')}; {res.get('rounds')} rounds; every read-back verified byte for byte.", ""]
    if "error" in res.get("lmcache", {}):
        out += [f"LMCache: {res['lmcache']['error']}", ""]
    sides = [("LMCache L1 (DRAM)", "lmcache", "l1_put", "l1_get"),
             ("LMCache fs L2", "lmcache", "l2_store", "l2_get"),
             ("LMCache fs L2 + aesgcm serde", "lmcache_aesgcm", "l2_store", "l2_get")]
    for case in res["cases"]:
        rows = []
        for label, key, put, get in sides:
            side = case.get(key, {})
            g = side.get("gbps", {})
            rows.append([label, g.get(put, side.get("error", "-")), g.get(get, "-")])
        for key, side in case.items():
            if key in ("redis", "disk_write_fsync") or key.startswith("kvstore"):
                rows.append([key, side.get("put", side.get("error", "-")), side.get("get", "-")])
            if key == "disk_write_fsync" and "put_new_file" in side:
                rows.append(["disk_write_fsync, fresh file (reference)", side["put_new_file"], "-"])
        out += [(f"**{case['block_mib']} MiB blocks** ({case['block_tokens']} tokens, "
                 f"{case['blocks_per_op']} per op)"), "",
                _table(["system / path", "put (store) GB/s", "get GB/s"], rows), ""]
        trows = [[name, t["ratio"], t["target"], "yes" if t["pass"] else "**no**"]
                 for name, t in case["targets"].items() if t is not None]
        if trows:
            out += [_table(["target (kvstore / peer)", "ratio", "target", "met"], trows), ""]
    return "\n".join(out)


def _service_md(res: dict[str, Any]) -> str:
    rows = [[r["clients"], r["plane"], r["bytes_per_client_round"] >> 20,
             r.get("aggregate_put_get_gbps", r.get("error", "-")), r.get("memcpy_gbps", "-"),
             r.get("vs_memcpy", "-")]
            for r in res.get("concurrency", [])]
    conc = ("\n**Concurrent clients** (aggregate put+get GB/s, one sidecar; put+get timed alone; "
            "baseline: as many threads copying the same bytes, same rounds; ratio paired per "
            "round)\n\n"
            + _table(["clients", "plane", "MiB per client per round", "put+get GB/s",
                      "memcpy GB/s (N threads)", "vs memcpy"], rows) + "\n"
            if rows else "")
    return _flat_md({k: v for k, v in res.items() if k != "concurrency"}) + conc


def _flat_md(res: dict[str, Any]) -> str:
    rows = [[k, v] for k, v in _flatten(res).items() if not isinstance(v, list)]
    return _table(["figure", "value"], rows) + "\n"


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    else:
        out[prefix] = d
    return out


def section_text(doc: dict[str, Any], plot: Path | None, md_dir: Path) -> str:
    m = doc["machine"]
    res = doc["results"]
    body = {"tiers": _tiers_md, "replay": _replay_md, "peers": _peers_md,
            "service": _service_md}.get(
        doc["suite"], _flat_md)(res)
    if isinstance(res, dict) and "profiles" in res:
        body += "\n" + (profiles_md(res["profiles"]) if res["profiles"] else
                        "All targets met or a quick run: no profiles.\n")
    lines = [f"## {doc['suite']}{' (quick)' if doc['quick'] else ''}", "",
             f"- date: {doc['date']} (wall {doc['wall_s']} s)",
             f"- command: `{doc['command']}`",
             (f"- machine: {m['cpu']}, {m['cpus_usable']} usable CPUs, {m['mem_gib']} GiB, "
              f"kernel {m['kernel']}, python {m['python']}, torch {m['torch']} "
              f"({m['torch_threads']} thread), git {m['git_commit']}"),
             f"- load average (1/5/15 min): start {m['loadavg_start']}, end {m['loadavg_end']}",
             ""]
    if plot is not None:
        lines += [f"![{doc['suite']}]({os.path.relpath(plot.resolve(), md_dir.resolve())})", ""]
    return "\n".join(lines) + body


def write_section(md: Path, doc: dict[str, Any], plot: Path | None) -> None:
    """Replace (or append) this run's section of ``md``."""
    tag = doc["suite"] + ("-quick" if doc["quick"] else "")
    begin, end = f"<!-- suite:{tag} -->", f"<!-- /suite:{tag} -->"
    block = f"{begin}\n{section_text(doc, plot, md.parent)}\n{end}"
    text = md.read_text() if md.exists() else HEADER
    pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.DOTALL)
    text = pattern.sub(lambda _m: block, text) if pattern.search(text) else (
        text.rstrip("\n") + "\n\n" + block + "\n")
    md.parent.mkdir(parents=True, exist_ok=True)
    tmp = md.with_suffix(".md.tmp")
    tmp.write_text(text)
    tmp.replace(md)


# -- plots ------------------------------------------------------------------------------------
def plot(doc: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawer = {"tiers": _plot_tiers, "replay": _plot_replay}.get(doc["suite"], _plot_bars)
    fig = drawer(plt, doc["results"])
    fig.suptitle(f"kvstore bench {doc['suite']} — {doc['date']} "
                 f"(load {doc['machine']['loadavg_start'][0]})", fontsize=9, y=1.02)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)


def _plot_tiers(plt: Any, res: dict[str, Any]) -> Any:
    cases = res["cases"]
    fig, axes = plt.subplots(1, len(cases), figsize=(7 * len(cases), 8), squeeze=False)
    for ax, case in zip(axes[0], cases):
        paths = case["paths"]
        y = range(len(paths))
        ax.barh([i + 0.2 for i in y], [p["gbps"] for p in paths], height=0.4, label="measured")
        ax.barh([i - 0.2 for i in y], [p["limit_gbps"] for p in paths], height=0.4,
                label="limit (slowest stage)", alpha=0.5)
        ax.set_yticks(list(y), [p["path"] for p in paths], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("GB/s (median)")
        ax.set_title(f"{case['block_mib']} MiB blocks")
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _plot_replay(plt: Any, res: dict[str, Any]) -> Any:
    traces = sorted({(e["trace"], e["seed"]) for e in res["summary"]})
    cols = min(3, len(traces))
    rows = (len(traces) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    for ax, (trace, seed) in zip(axes.flat, traces):
        entries = sorted((e for e in res["summary"] if (e["trace"], e["seed"]) == (trace, seed)),
                         key=lambda e: e["hbm_blocks"])
        for p in res["policies"]:
            pts = [(e["hbm_blocks"], e[p]["net_saved_time_fraction"]) for e in entries if p in e]
            ax.plot([x for x, _ in pts], [v for _, v in pts], marker="o", label=p)
        ax.set_title(f"{trace}#{seed}", fontsize=9)
        ax.set_xlabel("HBM capacity (blocks)")
        ax.set_ylabel("net saved time fraction")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(traces):]:
        ax.set_visible(False)
    fig.tight_layout()
    return fig


#: Parts of a path whose leaves are not GB/s (ratios, CPU cost, targets, per-round lists).
_NOT_GBPS = {"ratios", "paired_ratios", "cpu_ms_per_mib", "targets", "lookup", "lookup_512"}


def _is_gbps(path: str) -> bool:
    """A leaf in GB/s: its key ends in ``gbps``, or sits under a ``gbps`` dict, or is a bare
    ``put``/``get`` rate (service_bench's methods, the peers suite's sides) outside _NOT_GBPS."""
    parts = path.split(".")
    if _NOT_GBPS & set(parts[:-1]):
        return False
    return parts[-1].endswith("gbps") or "gbps" in parts[:-1] or parts[-1] in ("put", "get")


def _rows_by_name(res: dict[str, Any]) -> dict[str, Any]:
    """``res`` with its lists of rows turned into dicts keyed by what tells the rows apart
    (``_flatten`` skips lists): concurrency rows by plane and clients, cases by block size."""
    out = dict(res)
    if isinstance(res.get("concurrency"), list):
        out["concurrency"] = {f"{r['plane']} x{r['clients']}": r for r in res["concurrency"]}
    if isinstance(res.get("cases"), list):
        out["cases"] = {f"{c.get('block_mib', i)}MiB": c for i, c in enumerate(res["cases"])}
    return out


def _plot_bars(plt: Any, res: dict[str, Any]) -> Any:
    """Every GB/s leaf as a horizontal bar (service, peers), the concurrency rows included."""
    # NOTE: every leaf with "put"/"get" in its path was drawn on the GB/s axis, ratios and
    # cpu_ms_per_mib included, and the concurrency rows (a list) were dropped.
    flat = {k: v for k, v in _flatten(_rows_by_name(res)).items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and _is_gbps(k)}
    fig, ax = plt.subplots(figsize=(9, max(3, 0.22 * len(flat))))
    ax.barh(range(len(flat)), list(flat.values()))
    ax.set_yticks(range(len(flat)), list(flat), fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("GB/s (median)")
    fig.tight_layout()
    return fig
