"""Service benchmark: Put/Get throughput through the sidecar against raw baselines, same run.

For 2 MiB and 32 MiB blocks, GB/s (median of repeats) of:

  (a) shm     — kvstore client, shared-memory data plane, buffers already in the region (one copy)
  (a') shm-staged — same plane, an ordinary tensor staged through the region (two copies)
  (b) stream  — kvstore client, in-band gRPC stream (chunked, checksummed)
  (c) memcpy  — numpy copy of the same bytes into a preallocated buffer
  (d) grpc    — a bare grpcio client/server stream of the same raw bytes, same chunking, no kvstore
  (e) redis   — redis-py SET/GET of the same bytes on 127.0.0.1:6379 (skipped when unreachable)

plus the end-to-end Lookup latency of a 128K-token prompt (8,192 blocks of 16 tokens, keys sent
by the client). Servers run in child processes (one core each side on a 2-core machine).

    python bench/service_bench.py [--repeats 5] [--sizes 2,32] [--out bench/results/service.json]

Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent import futures
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MiB = 1 << 20
CHUNK = 4 * MiB - 4096


def _spec(block_mib: int):
    from kvstore.spec import ModelSpec

    # 2 * layers * heads * tokens * head_dim * 2 bytes: 2 MiB at 16 tokens, 32 MiB at 256
    return ModelSpec(model="bench", revision="r", num_layers=32, num_kv_heads=8, head_dim=128,
                     dtype="float16", block_tokens=16 * block_mib // 2)


def _gbps(nbytes: int, seconds: list[float]) -> float:
    return round(nbytes / statistics.median(seconds) / 1e9, 3)


def _timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


# -- children ---------------------------------------------------------------------------------
def _start_child(args: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.Popen, list[str]]:
    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})
    lines = []
    while True:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError("child exited:\n" + "".join(lines))
        lines.append(line)
        if line.startswith("ready"):
            return proc, lines


def _raw_server_main(port_file: str) -> None:
    """A bare grpcio server: client-stream sink and server-stream source of raw bytes."""
    import grpc

    ident = lambda b: b  # noqa: E731
    payload: dict[int, list[bytes]] = {}

    def sink(it, ctx):
        n = 0
        for m in it:
            n += len(m)
        return str(n).encode()

    def source(req, ctx):
        nbytes, count = map(int, req.decode().split(","))
        chunks = payload.setdefault(nbytes, [os.urandom(min(CHUNK, nbytes - o)) for o in range(0, nbytes, CHUNK)])
        for _ in range(count):
            yield from chunks

    handler = grpc.method_handlers_generic_handler("raw.Raw", {
        "Sink": grpc.stream_unary_rpc_method_handler(sink, request_deserializer=ident, response_serializer=ident),
        "Source": grpc.unary_stream_rpc_method_handler(source, request_deserializer=ident, response_serializer=ident),
    })
    opts = [("grpc.max_receive_message_length", 64 * MiB), ("grpc.max_send_message_length", 64 * MiB)]
    server = grpc.server(futures.ThreadPoolExecutor(4), options=opts)
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(f"port {port}", flush=True)
    print("ready", flush=True)
    server.wait_for_termination()


# -- measurements -------------------------------------------------------------------------------
def bench_raw_grpc(port: int, nbytes: int, count: int, repeats: int) -> dict[str, float]:
    import grpc

    ident = lambda b: b  # noqa: E731
    opts = [("grpc.max_receive_message_length", 64 * MiB), ("grpc.max_send_message_length", 64 * MiB)]
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=opts) as ch:
        sink = ch.stream_unary("/raw.Raw/Sink", request_serializer=ident, response_deserializer=ident)
        source = ch.unary_stream("/raw.Raw/Source", request_serializer=ident, response_deserializer=ident)
        chunks = [os.urandom(min(CHUNK, nbytes - o)) for o in range(0, nbytes, CHUNK)]

        def put():
            sink(iter(chunks * count))

        def get():
            for _ in source(f"{nbytes},{count}".encode()):
                pass

        put(), get()
        return {"put": _gbps(nbytes * count, _timed(put, repeats)), "get": _gbps(nbytes * count, _timed(get, repeats))}


def bench_redis(nbytes: int, count: int, repeats: int) -> dict[str, float] | None:
    try:
        import redis

        r = redis.Redis(host="127.0.0.1", port=6379)
        r.ping()
    except Exception as exc:  # noqa: BLE001 - any failure means "no redis here"
        return {"skipped": str(exc)[:80]}
    values = [os.urandom(nbytes) for _ in range(count)]

    def put():
        for i, v in enumerate(values):
            r.set(f"bench:{i}", v)

    def get():
        for i in range(count):
            r.get(f"bench:{i}")

    put(), get()
    out = {"put": _gbps(nbytes * count, _timed(put, repeats)), "get": _gbps(nbytes * count, _timed(get, repeats))}
    r.delete(*[f"bench:{i}" for i in range(count)])
    return out


def bench_memcpy(nbytes: int, count: int, repeats: int) -> float:
    src = np.random.randint(0, 255, nbytes * count, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    return _gbps(nbytes * count, _timed(lambda: np.copyto(dst, src), repeats))


def bench_kvstore(target: str, token: str, block_mib: int, count: int, repeats: int) -> dict[str, float]:
    from kvstore.client import Client

    spec = _spec(block_mib)
    nbytes = spec.block_nbytes * count
    kv = torch.randint(-1000, 1000, (count, *spec.block_shape), dtype=torch.int16).view(torch.float16)
    out: dict[str, float] = {}
    seq = iter(range(10**6))

    def fresh_keys(c: Client) -> list[bytes]:
        base = next(seq) * 10**7 + block_mib * 10**6
        return c.block_keys(spec, list(range(base, base + count * spec.block_tokens)))

    for name, local in (("shm", True), ("stream", False)):
        with Client(target, token, local=local, region_bytes=3 * nbytes + MiB) as c:
            assert c.uses_shared_memory is local
            keys = fresh_keys(c)
            if local:
                src = c.local_blocks(spec, count)
                src.tensor.copy_(kv)
                dst = c.local_blocks(spec, count)
                data, sink = src.tensor, dst.tensor
            else:
                data, sink = kv, torch.empty_like(kv)
            put_times, get_times = [], []
            for _ in range(repeats + 1):
                keys = fresh_keys(c)
                t0 = time.perf_counter()
                c.put(spec, keys, data)
                put_times.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                assert c.get_into(spec, keys, sink) == count
                get_times.append(time.perf_counter() - t0)
                c.delete(keys[:1])
            assert torch.equal(sink.view(torch.int16), kv.view(torch.int16))
            out[f"{name}_put"] = _gbps(nbytes, put_times[1:])
            out[f"{name}_get"] = _gbps(nbytes, get_times[1:])
            if local:
                stage = torch.empty_like(kv)
                times_p, times_g = [], []
                for _ in range(repeats):
                    keys = fresh_keys(c)
                    t0 = time.perf_counter()
                    c.put(spec, keys, kv)
                    times_p.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    c.get_into(spec, keys, stage)
                    times_g.append(time.perf_counter() - t0)
                    c.delete(keys[:1])
                out["shm_staged_put"] = _gbps(nbytes, times_p)
                out["shm_staged_get"] = _gbps(nbytes, times_g)
                src.free()
                dst.free()
    return out


def bench_lookup(target: str, token: str, repeats: int) -> dict[str, float]:
    from kvstore.client import Client
    from kvstore.spec import ModelSpec

    spec = ModelSpec(model="bench-lookup", revision="r", num_layers=1, num_kv_heads=1, head_dim=16,
                     dtype="float16", block_tokens=16)
    n = 8192
    with Client(target, token, local=True, region_bytes=n * spec.block_nbytes + MiB) as c:
        keys = c.block_keys(spec, list(range(n * 16)))
        c.put(spec, keys, torch.zeros((n, *spec.block_shape), dtype=torch.float16))
        assert c.lookup(spec, keys).num_blocks == n
        times = _timed(lambda: c.lookup(spec, keys), max(repeats, 30))
        unary = _timed(lambda: c.whoami(), 50)
    return {"lookup_8192_blocks_p50_ms": round(statistics.median(times) * 1e3, 3),
            "lookup_8192_blocks_p90_ms": round(sorted(times)[int(len(times) * 0.9)] * 1e3, 3),
            "unary_rpc_p50_ms": round(statistics.median(unary) * 1e3, 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sizes", default="2,32", help="block sizes in MiB")
    ap.add_argument("--bytes-per-call", type=int, default=64, help="MiB moved per Put/Get call")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--raw-server", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.raw_server is not None:
        _raw_server_main(args.raw_server)
        return 0
    torch.set_num_threads(1)
    sizes = [int(s) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "bench.toml"
        cfg.write_text(
            f'listen = "127.0.0.1:0"\naudit_fsync = false\nexpire_interval_s = 0\n'
            f'[store]\npath = "{tmp}/data"\nhbm_bytes = {1024 * MiB}\ndram_bytes = {256 * MiB}\n'
            f'nvme_bytes = {512 * MiB}\ndurable = false\npersist_on_close = false\n'
            f'[metrics]\nenabled = false\n[limits]\nmax_stream_bytes = {1 << 30}\n')
        server, lines = _start_child(["-c", "from kvstore.cli_serve import admin_app; admin_app()", "serve",
                                      "--config", str(cfg)])
        raw, raw_lines = _start_child([str(Path(__file__).resolve()), "--raw-server", "x"])
        try:
            port = int(next(ln for ln in lines if "serving on" in ln).rsplit(":", 1)[1])
            admin_token = next(ln for ln in lines if "admin token" in ln).split()[-1]
            raw_port = int(next(ln for ln in raw_lines if ln.startswith("port")).split()[1])
            target = f"127.0.0.1:{port}"
            from kvstore.client import AdminClient

            with AdminClient(target, admin_token) as admin:
                token = admin.create_tenant("bench")
            results: dict[str, object] = {"repeats": args.repeats, "unit": "GB/s (median)", "sizes": {}}
            for mib in sizes:
                count = max(1, args.bytes_per_call // mib)
                nbytes = mib * MiB
                row: dict[str, object] = {"blocks_per_call": count}
                row.update(bench_kvstore(target, token, mib, count, args.repeats))
                row["memcpy"] = bench_memcpy(nbytes, count, args.repeats)
                row["grpc_raw"] = bench_raw_grpc(raw_port, nbytes, count, args.repeats)
                row["redis"] = bench_redis(nbytes, count, args.repeats)
                g = row["grpc_raw"]
                row["ratios"] = {
                    "shm_put/memcpy": round(row["shm_put"] / row["memcpy"], 2),
                    "shm_get/memcpy": round(row["shm_get"] / row["memcpy"], 2),
                    "stream_put/grpc_raw": round(row["stream_put"] / g["put"], 2),
                    "stream_get/grpc_raw": round(row["stream_get"] / g["get"], 2),
                }
                r = row["redis"]
                if isinstance(r, dict) and "put" in r:
                    row["ratios"]["stream_put/redis"] = round(row["stream_put"] / r["put"], 2)
                    row["ratios"]["stream_get/redis"] = round(row["stream_get"] / r["get"], 2)
                results["sizes"][f"{mib}MiB"] = row
            results["lookup"] = bench_lookup(target, token, args.repeats)
        finally:
            for p in (server, raw):
                p.terminate()
                p.wait(timeout=30)
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
