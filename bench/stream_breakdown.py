"""Where the in-band Put stream loses to a bare grpcio stream: the client's frame building, or
the server's per-chunk work (checksum check and the copy into the tier slot)?

Four ways of moving the same ``count`` blocks of ``--mib`` MiB, interleaved round by round,
GB/s medians (same run, same machine state):

  put         — ``Client.put`` of a tensor: the client builds every frame (xxh3 + one copy)
  prebuilt    — the same kvstore frames built before the clock starts, sent to the sidecar:
                only the server's work is left on top of grpc
  bare_frames — those prebuilt frames sent to a bare grpcio sink (no work on either side)
  bare        — the blocks as plain ``bytes`` messages to the bare sink (service_bench's (d))

So put/prebuilt is what the client's frame building costs, prebuilt/bare_frames what the
server's checks and copy cost. Both servers are child processes (one core each side on a
2-core machine), as in ``bench/service_bench.py``.

    python -m bench.stream_breakdown [--mib 2] [--rounds 7] [--out bench/results/stream_breakdown.json]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from bench.output import emit_json
from bench.service_bench import MiB, _gbps, _spec, sidecar_and_raw


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=2, help="block size in MiB")
    ap.add_argument("--bytes-per-call", type=int, default=64, help="MiB per Put")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    from kvstore.memtune import reexec_with_streaming_copies

    reexec_with_streaming_copies()  # as the sidecar and service_bench do; children inherit it
    torch.set_num_threads(1)
    import grpc

    from kvstore.client import Client, _flat_bytes
    from kvstore.frames import block_frames, encode
    from proto.kvstore.v1 import kvstore_pb2 as pb

    spec = _spec(args.mib)
    count = max(1, args.bytes_per_call // args.mib)
    nbytes = count * spec.block_nbytes
    kv = torch.randint(-1000, 1000, (count, *spec.block_shape), dtype=torch.int16).view(torch.float16)
    rows = _flat_bytes(kv, count, spec.block_nbytes)
    with sidecar_and_raw(hbm=1024 * MiB, dram=0, nvme=0) as (target, token, raw_port, _, _):
        opts = [("grpc.max_receive_message_length", 64 * MiB), ("grpc.max_send_message_length", 64 * MiB)]
        ident = lambda b: b
        with grpc.insecure_channel(f"127.0.0.1:{raw_port}", options=opts) as ch, \
                Client(target, token, local=False) as c:
            sink = ch.stream_unary("/raw.Raw/Sink", request_serializer=ident, response_deserializer=ident)
            step = c.chunk_bytes
            # the bare baseline: each block's chunks as plain bytes (service_bench's (d))
            plain = [bytes(rows[i][o : o + step]) for i in range(count) for o in range(0, spec.block_nbytes, step)]
            times: dict[str, list[float]] = {k: [] for k in ("put", "prebuilt", "bare_frames", "bare")}
            for r in range(args.rounds + 1):  # round 0 warms up, untimed
                base = (r + 1) * 10**7
                keys = c.block_keys(spec, list(range(base, base + count * spec.block_tokens)))
                t0 = time.perf_counter()
                c.put(spec, keys, kv)
                t_put = time.perf_counter() - t0
                c.delete(keys)
                keys = c.block_keys(spec, list(range(base + 5 * 10**6, base + 5 * 10**6 + count * spec.block_tokens)))
                header = pb.PutHeader()
                c._target(header.target, spec, keys, None, "", None)
                frames = [encode(pb.PutFrame(header=header)),
                          *block_frames(pb.PutFrame, rows, spec.block_nbytes, step)]
                t0 = time.perf_counter()
                c._call(c._put_frames, iter(frames))
                t_pre = time.perf_counter() - t0
                c.delete(keys)
                t0 = time.perf_counter()
                sink(iter(frames))
                t_bf = time.perf_counter() - t0
                t0 = time.perf_counter()
                sink(iter(plain))
                t_bare = time.perf_counter() - t0
                if r:
                    for k, t in zip(times, (t_put, t_pre, t_bf, t_bare)):
                        times[k].append(t)
    gbps = {k: _gbps(nbytes, v) for k, v in times.items()}
    result = {"block_mib": args.mib, "blocks_per_call": count, "rounds": args.rounds, "unit": "GB/s (median)",
              "gbps": gbps,
              "ratios": {"put/bare": round(gbps["put"] / gbps["bare"], 3),
                         "put/prebuilt (client frame building)": round(gbps["put"] / gbps["prebuilt"], 3),
                         "prebuilt/bare_frames (server checks + copy)": round(gbps["prebuilt"] / gbps["bare_frames"], 3)}}
    emit_json(result, args.out)
    return 0


if __name__ == "__main__":
    from kvstore.memtune import process_entry

    process_entry()  # run as a script: it may re-execute itself (streaming copies)
    sys.exit(main())
