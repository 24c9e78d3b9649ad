"""py-spy profiles of the Store paths a suite found below target, summarised for RESULTS.md.

:func:`profile_path` runs ``bench.profile_target`` under ``py-spy record --format raw`` (folded
stacks, idle samples included so waits on the disk or on codec threads show) and reduces the
samples below the public Store call to the functions with the largest inclusive share, and the
source lines with the largest own share: what bounds the path. Without py-spy (or when it may
not attach) the result says why instead; nothing is invented.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

#: the public Store call each profile target times (its samples are the ones summarised)
ROOTS = {"dram-put": "Store.put ", "dram-get": "ReadPath.get_into ", "nvme-put": "Store.put ",
         "nvme-put-nosync": "Store.put ", "dram-nvme": "Store.flush ", "nvme-get": "ReadPath.get_into "}
#: the codec's per-chunk work, on whichever thread runs it (caller, encode-ahead, pool)
CODEC_ROOT = "Codec._parallel.<locals>.drain "
_LINE = re.compile(r":\d+\)$")


def pyspy() -> str | None:
    """The py-spy executable next to this interpreter, else on PATH."""
    local = Path(sys.executable).with_name("py-spy")
    return str(local) if local.exists() else shutil.which("py-spy")


def summarize(folded: str, root: str, top: int = 12) -> dict[str, Any]:
    """Inclusive share per function and own share per source line, of the samples under
    ``root`` (a frame name prefix such as ``"Store.put "``), from py-spy's raw output."""
    incl: Counter[str] = Counter()
    own: Counter[str] = Counter()
    total = 0
    for line in folded.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = [f.strip() for f in stack.split(";")]
        start = next((i for i, f in enumerate(frames) if f.startswith(root)), None)
        if start is None:
            continue
        n = int(count)
        total += n
        frames = frames[start:]
        for f in {_LINE.sub(")", f) for f in frames}:
            incl[f] += n
        own[frames[-1]] += n
    if not total:
        return {"samples": 0}
    return {"samples": total,
            "inclusive": [[f, round(100 * n / total, 1)] for f, n in incl.most_common(top)],
            "own_lines": [[f, round(100 * n / total, 1)] for f, n in own.most_common(top)]}


def profile_path(target: str, mib: int, blocks: int, *, level: int = 1, encrypt: bool = True,
                 rounds: int | None = None, rate: int = 250, timeout_s: float = 180
                 ) -> dict[str, Any]:
    """Profile one target (see ``bench.profile_target``); a JSON-ready summary. ``rounds``
    defaults to about 6 GB through DRAM paths, 0.4 GB through NVMe ones (a few seconds each)."""
    if rounds is None:
        per_op = mib * blocks << 20
        rounds = max(4, (6 << 30) // per_op if target.startswith("dram-") and target != "dram-nvme"
                     else (400 << 20) // per_op)
    exe = pyspy()
    args = [target, "--mib", str(mib), "--blocks", str(blocks), "--rounds", str(rounds),
            "--level", str(level), *([] if encrypt else ["--no-encrypt"])]
    info: dict[str, Any] = {"target": target, "block_mib": mib, "blocks_per_op": blocks,
                            "level": level, "encrypt": encrypt,
                            "command": "py-spy record --idle --format raw -- python -m "
                                       "bench.profile_target " + " ".join(args)}
    if exe is None:
        return {**info, "error": "py-spy is not installed"}
    with tempfile.TemporaryDirectory(prefix="kvstore-pyspy-") as tmp:
        out = Path(tmp) / "folded.txt"
        cmd = [exe, "record", "--idle", "--rate", str(rate), "--format", "raw", "--output",
               str(out), "--", sys.executable, "-m", "bench.profile_target", *args]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False,
                                  cwd=Path(__file__).resolve().parents[1])
        except subprocess.TimeoutExpired:
            return {**info, "error": f"timed out after {timeout_s} s"}
        if proc.returncode != 0 or not out.exists():
            return {**info, "error": f"py-spy exit {proc.returncode}: {proc.stderr[-600:]}"}
        folded = out.read_text()
    codec = summarize(folded, CODEC_ROOT, top=6)
    return {**info, **summarize(folded, ROOTS[target]),
            "codec_samples": codec["samples"], "codec_own_lines": codec.get("own_lines", [])}


def profile_missed(wanted: list[tuple[float, str, int, int, int, bool]],
                   limit: int = 3) -> list[dict[str, Any]]:
    """Profiles of the worst ``limit`` distinct (ratio, target, MiB, blocks, level, encrypt)."""
    seen, out = set(), []
    for _ratio, *key in sorted(wanted):
        if tuple(key) in seen or len(out) >= limit:
            continue
        seen.add(tuple(key))
        target, mib, blocks, level, encrypt = key
        out.append(profile_path(target, mib, blocks, level=level, encrypt=encrypt))
    return out


def profiles_md(profiles: list[dict[str, Any]]) -> str:
    """The Markdown of a suite's profiles (empty when there are none)."""
    if not profiles:
        return ""
    out = ["### py-spy profiles of the paths below target", ""]
    for p in profiles:
        what = (f"`{p['target']}` {p['block_mib']} MiB x {p['blocks_per_op']}, "
                f"{'aes' if p['encrypt'] else 'xxh3'}+{'zstd' + str(p['level']) if p['level'] else 'raw'}")
        out.append(f"**{what}** (`{p['command']}`)")
        out.append("")
        if "error" in p or not p.get("samples"):
            out += [f"no profile: {p.get('error', 'no samples under the Store call')}", ""]
            continue
        out.append(f"{p['samples']} samples in the Store call. Inclusive share by function:")
        out.append("")
        out += [f"- {share}% {fn}" for fn, share in p["inclusive"]]
        out += ["", "Own share by source line (where the time is spent):", ""]
        out += [f"- {share}% {fn}" for fn, share in p["own_lines"]]
        if p.get("codec_samples"):
            out += ["", (f"Codec chunk work on all threads ({p['codec_samples']} samples; "
                         "compare with the Store call's), own share by line:"), ""]
            out += [f"- {share}% {fn}" for fn, share in p["codec_own_lines"]]
        out.append("")
    return "\n".join(out)
