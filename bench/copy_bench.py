"""What glibc's non-temporal threshold does to block copies (``kvstore.memtune``,
``ServerConfig.streaming_copy_bytes``).

Two child processes copy the same way, one with the C library's own threshold and one with
``GLIBC_TUNABLES=glibc.cpu.x86_non_temporal_threshold=<--threshold>``; each measures, with
numpy ``copyto`` (one ``memcpy``), ``--mib`` MiB moved as ``--block-kib`` KiB block copies and
as one copy, over ``--rounds`` rounds (GB/s medians). The two children alternate round by round
so a shared machine's drift hits both alike.

    python -m bench.copy_bench [--mib 64] [--block-kib 2048] [--threshold 1048576] [--rounds 9]

``--alias`` measures instead where the destination sits against the source within a 4 KiB page
(``kernels.copy.host_copy``): one child with the lowered threshold copies ``--mib`` MiB with the
destination ``delta`` bytes past the source (mod 4096), as one ``np.copyto`` ("copyto") and in
768 KiB pieces ("pieces", ``kernels.copy.copy_in_pieces``), the order of the two alternating
round by round (it ran copyto first always, so only copyto met what the previous delta's copies
left in the caches). ``auto`` in the output (and a line on stderr) is what ``host_copy`` chose
in that child, measured there first (``kernels.copy.AliasCopyCalibration``; ``source`` is
``env`` when ``KVSTORE_ALIAS_COPY`` forced it).

Which is faster depends on the machine; that is why ``host_copy`` measures it. GB/s copyto ->
pieces at deltas 16, 64, 256, 320 (the window), ``--mib 32 --rounds 9``:

* AMD EPYC, glibc 2.36 (the development machine, two runs, copyto always first): 3.4/3.1/4.3/4.4
  -> 5.6/5.6/5.7/5.4 and 3.5/3.1/4.4/4.6 -> 6.1/5.7/6.4/6.3; deltas 0, 384, 448, 2048 (outside,
  where its second column was one copy too): 7.0–9.1. The pieces win.
* Intel Xeon (KVM guest, 2 vCPUs, 300 MiB L3, glibc 2.36, 2026-12-01, load 4-9 from other
  work; five runs): 4.9/5.1/5.1/11.3 -> 3.7/4.0/3.9/3.7, 5.2/11.2/5.3/5.3 -> 4.1/4.1/4.3/4.3,
  13.1/12.8/11.5/11.2 -> 7.2/7.5/6.4/7.5, 12.4/13.0/13.2/13.1 -> 6.3/4.6/7.1/4.5,
  13.1/11.4/13.8/13.4 -> 6.9/7.7/8.0/7.9 (one copy swings between about 5 and 13 GB/s from run
  to run, as it does at deltas outside the window too); the pieces lose at every delta, and
  ``auto`` chose one copy in every run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.output import emit_json


def _child(mib: int, block: int) -> None:
    """Measure one round per line read from stdin; print each round's GB/s as JSON."""
    import numpy as np

    n = mib << 20
    src = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
    dst = np.ones_like(src)
    for _ in sys.stdin:
        t0 = time.perf_counter()
        for off in range(0, n, block):
            np.copyto(dst[off : off + block], src[off : off + block])
        t1 = time.perf_counter()
        np.copyto(dst, src)
        t2 = time.perf_counter()
        print(json.dumps({"blocks": n / (t1 - t0) / 1e9, "one_copy": n / (t2 - t1) / 1e9}), flush=True)


ALIAS_DELTAS = (0, 16, 64, 256, 320, 384, 448, 2048)


def _alias_child(mib: int, rounds: int) -> None:
    """Print {"auto": host_copy's choice, "gbps": {delta: {"copyto": GB/s, "pieces": GB/s}}}
    (medians) as one JSON line."""
    import numpy as np

    from kernels.copy import PAGE_BYTES, alias_copy_choice, copy_in_pieces

    choice = alias_copy_choice()  # first, on a quiet process: what host_copy would do here
    n = mib << 20
    src_raw = np.random.default_rng(0).integers(0, 256, n + 2 * PAGE_BYTES, dtype=np.uint8)
    dst_raw = np.ones_like(src_raw)

    def page_start(a: np.ndarray) -> int:
        return (-a.__array_interface__["data"][0]) % PAGE_BYTES

    s0, d0 = page_start(src_raw), page_start(dst_raw)
    src = src_raw[s0 : s0 + n]
    methods = (("copyto", np.copyto), ("pieces", copy_in_pieces))
    times: dict[int, dict[str, list[float]]] = {d: {k: [] for k, _ in methods} for d in ALIAS_DELTAS}
    for r in range(rounds + 1):  # round 0 faults the pages in, untimed
        for delta in ALIAS_DELTAS:
            dst = dst_raw[d0 + delta : d0 + delta + n]
            # NOTE: the order alternates round by round: copyto always ran first, so it alone
            # met whatever the previous delta's copies left in the caches
            for name, fn in methods if r % 2 else methods[::-1]:
                if not r:
                    dst.fill(1)
                t0 = time.perf_counter()
                fn(dst, src)
                if r:
                    times[delta][name].append(n / (time.perf_counter() - t0) / 1e9)
                elif not np.array_equal(dst, src):
                    raise AssertionError(f"delta {delta}: {name}'s copy differs from its source")
    print(json.dumps({"auto": {"pieces": choice.pieces, "source": choice.source,
                               "ratio": None if choice.ratio is None else round(choice.ratio, 2)},
                      "gbps": {d: {k: round(statistics.median(v), 2) for k, v in t.items()}
                               for d, t in times.items()}}), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--block-kib", type=int, default=2048)
    ap.add_argument("--threshold", type=int, default=1 << 20, help="bytes")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--alias", action="store_true", help="measure source/destination page offsets")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    block = args.block_kib << 10
    if args.child:
        if args.alias:
            _alias_child(args.mib, args.rounds)
        else:
            _child(args.mib, block)
        return 0
    from kvstore.memtune import NONTEMPORAL_TUNABLE

    base = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    repo = Path(__file__).resolve().parents[1]
    if args.alias:
        env = {**base, "GLIBC_TUNABLES": f"{NONTEMPORAL_TUNABLE}={args.threshold}"}
        out = json.loads(subprocess.run(
            [sys.executable, "-m", "bench.copy_bench", "--child", "--alias", "--mib", str(args.mib),
             "--rounds", str(args.rounds)], env=env, cwd=repo, check=True, capture_output=True, text=True).stdout)
        auto = out["auto"]
        print(f"host_copy in the window ({auto['source']}): {'pieces' if auto['pieces'] else 'one copy'}"
              + ("" if auto["ratio"] is None else f" (pieces took {auto['ratio']}x one copy's time)"),
              file=sys.stderr)
        emit_json({"mib": args.mib, "threshold": args.threshold, "rounds": args.rounds,
                   "unit": "GB/s (median) by (dst - src) mod 4096", "gbps": out["gbps"],
                   "auto": auto}, args.out)
        return 0
    envs = {"glibc_default": base,
            "streaming": {**base, "GLIBC_TUNABLES": f"{NONTEMPORAL_TUNABLE}={args.threshold}"}}
    cmd = [sys.executable, "-m", "bench.copy_bench", "--child", "--mib", str(args.mib),
           "--block-kib", str(args.block_kib)]
    procs = {k: subprocess.Popen(cmd, env=env, cwd=repo, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True) for k, env in envs.items()}
    rounds: dict[str, list[dict[str, float]]] = {k: [] for k in procs}
    try:
        for r in range(args.rounds + 1):  # round 0 faults the pages in, untimed
            for k, p in procs.items():
                assert p.stdin is not None and p.stdout is not None
                p.stdin.write("go\n")
                p.stdin.flush()
                line = json.loads(p.stdout.readline())
                if r:
                    rounds[k].append(line)
    finally:
        for p in procs.values():
            if p.stdin is not None:
                p.stdin.close()
            p.wait(timeout=30)
    gbps = {k: {m: round(statistics.median(x[m] for x in v), 2) for m in ("blocks", "one_copy")}
            for k, v in rounds.items()}
    emit_json({"mib": args.mib, "block_kib": args.block_kib, "threshold": args.threshold,
               "rounds": args.rounds, "unit": "GB/s (median)", "gbps": gbps,
               "blocks_speedup": round(gbps["streaming"]["blocks"] / gbps["glibc_default"]["blocks"], 2)},
              args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
