"""Service benchmark: Put/Get throughput through the sidecar against raw baselines, same run.

For 2 MiB and 32 MiB blocks (``--sizes``; sub-MiB blocks of small models too, e.g.
``--sizes 0.25,0.5,2``), GB/s (median of repeats) of:

  (a) shm     — kvstore client, shared-memory data plane, buffers already in the region (one copy)
  (a') shm-staged — same plane, an ordinary tensor staged through the region (two copies)
  (b) stream  — kvstore client, in-band gRPC stream (chunked, checksummed)
  (c) memcpy  — numpy copy of the same bytes into a preallocated buffer
  (d) grpc    — a bare grpcio client/server stream of the same raw bytes, one message per
                block chunk (the client's ``chunk_bytes``, ``--chunk-kib``) both ways, no
                kvstore logic. NOTE: the in-band stream packs several blocks smaller than a
                chunk into one frame; this baseline does not, so at sub-MiB blocks it pays
                grpc's per-message cost that the stream avoids (stream/grpc_raw can pass 1)
  (e) redis   — redis-py SET/GET of the same bytes on 127.0.0.1:6379 (skipped when unreachable)

(memcpy's "get" copies the bytes back). Every method runs once per repeat, interleaved with
the others, so the drift of a shared machine hits all of them alike. ``ratios`` divides the
medians; ``paired_ratios`` is the median over repeats of the ratio within each repeat (the
two methods ran back to back there), which drift moves less. Also: the end-to-end Lookup
latency of a 128K-token prompt (8,192 blocks of 16 tokens, keys sent by the client) next to the
same lookup on an in-process Store, and the per-chunk costs of the stream (xxh3, framing).
Servers run in child processes (one core each side on a 2-core machine).

``cpu_ms_per_mib`` is what each method costs the machine: the CPU time of this process (the
client, every thread) plus that of the server it talks to (the sidecar, the bare grpcio
server, or Redis), per MiB moved, median over repeats (Linux ``/proc/PID/task/*/schedstat``;
absent elsewhere). Why: the client and its server share the machine's cores, so when both
keep them busy the throughput of a method is set by its CPU per byte, not by where it waits.
The stream's extra over bare grpcio is its one copy and one xxh3 per side (``per_chunk``).

    python bench/service_bench.py [--repeats 5] [--sizes 2,32] [--chunk-kib N] [--out bench/results/service.json]
    python bench/service_bench.py --sizes 0.25,0.5,2    # small blocks: several per stream frame

Prints one JSON document.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from bench.output import emit_json

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MiB = 1 << 20


def _spec(block_mib: float):
    from kvstore.spec import ModelSpec

    # 2 * layers * heads * tokens * head_dim * 2 bytes = 128 KiB per token: 2 MiB at 16 tokens,
    # 32 MiB at 256, 256 KiB at 2
    tokens = block_mib * 8
    if tokens < 1 or tokens != int(tokens):
        raise SystemExit(f"--sizes: {block_mib} MiB is not a multiple of 0.125 MiB (one token)")
    return ModelSpec(model="bench", revision="r", num_layers=32, num_kv_heads=8, head_dim=128,
                     dtype="float16", block_tokens=int(tokens))


def _size_label(block_mib: float) -> str:
    """The row's key in the JSON: "2MiB" as before for whole MiB, "0.25MiB" below."""
    return f"{int(block_mib)}MiB" if block_mib == int(block_mib) else f"{block_mib:g}MiB"


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


class Servers(NamedTuple):
    target: str  #: the sidecar's
    token: str  #: a new tenant's
    raw_port: int  #: the bare grpcio server's
    sidecar_pid: int
    raw_pid: int


@contextmanager
def sidecar_and_raw(hbm: int, dram: int, nvme: int) -> Iterator[Servers]:
    """A sidecar (``kvstore serve``: memory tiers of these sizes, NVMe not durable, no metrics)
    and the bare grpcio server, each in its own child process; yields them (:class:`Servers`)
    and stops both."""
    from kvstore.admin_client import AdminClient

    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "bench.toml"
        cfg.write_text(
            f'listen = "127.0.0.1:0"\naudit_fsync = false\nexpire_interval_s = 0\n'
            f'[store]\npath = "{tmp}/data"\nhbm_bytes = {hbm}\ndram_bytes = {dram}\n'
            f'nvme_bytes = {nvme}\ndurable = false\npersist_on_close = false\n'
            f'[metrics]\nenabled = false\n[limits]\nmax_stream_bytes = {1 << 30}\n')
        children = []
        try:
            server, lines = _start_child(["-c", "from kvstore.cli_serve import admin_app; admin_app()", "serve",
                                          "--config", str(cfg)])
            children.append(server)
            raw, raw_lines = _start_child([str(Path(__file__).resolve()), "--raw-server", "x"])
            children.append(raw)
            port = int(next(ln for ln in lines if "serving on" in ln).rsplit(":", 1)[1])
            admin_token = next(ln for ln in lines if "admin token" in ln).split()[-1]
            raw_port = int(next(ln for ln in raw_lines if ln.startswith("port")).split()[1])
            target = f"127.0.0.1:{port}"
            with AdminClient(target, admin_token) as admin:
                token = admin.create_tenant("bench")
            yield Servers(target, token, raw_port, server.pid, raw.pid)
        finally:
            for p in children:
                p.terminate()
                p.wait(timeout=30)


def _raw_server_main(port_file: str) -> None:
    """A bare grpcio server: client-stream sink and server-stream source of raw bytes. It keeps
    freed buffers like the sidecar does (StoreConfig.retain_freed_memory, on by default): the
    allocator setting speeds up grpc's own message handling too, and the baseline must not
    lose by it."""
    import grpc

    from kvstore.memtune import retain_freed_memory

    retain_freed_memory()

    ident = lambda b: b
    payload: dict[tuple[int, int, int], list[bytes]] = {}

    def chunks_of(nbytes: int, count: int, chunk: int) -> list[bytes]:
        # NOTE: not payload.setdefault(nbytes, [urandom...]): that would draw fresh random bytes
        # on every call and time os.urandom instead of grpc
        if (nbytes, count, chunk) not in payload:
            payload[nbytes, count, chunk] = _blocks_as_messages(nbytes, count, chunk)
        return payload[nbytes, count, chunk]

    def sink(it, ctx):
        n = 0
        for m in it:
            n += len(m)
        return str(n).encode()

    def source(req, ctx):
        nbytes, count, chunk = map(int, req.decode().split(","))
        yield from chunks_of(nbytes, count, chunk)

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


# -- CPU accounting --------------------------------------------------------------------------------
def _cpu_ns(pid: int) -> int | None:
    """CPU time of every live thread of ``pid`` (another process: not running while this one
    reads it) so far, ns (Linux schedstat); None elsewhere.
    NOTE: not /proc/PID/stat's utime+stime: their 10 ms ticks are a fifth of one 64 MiB call."""
    total = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile
    return total


class Stopwatch:
    """Wall time and CPU time (this process plus ``server_pid``) at each :meth:`mark`."""

    def __init__(self, server_pid: int | None) -> None:
        self.server_pid = server_pid
        self.marks: list[tuple[float, float | None]] = []

    def mark(self) -> None:
        server = _cpu_ns(self.server_pid) if self.server_pid is not None else 0
        # NOTE: this process's own clock, not its schedstat: a running thread's schedstat lags
        # until the scheduler next accounts it (a 128 KiB copy read as 0 ns)
        cpu = None if server is None else (time.process_time_ns() + server) / 1e9
        self.marks.append((time.perf_counter(), cpu))

    def spans(self) -> tuple[float, ...]:
        """(wall seconds of each span between marks..., CPU seconds of each span or NaN)"""
        walls = tuple(b[0] - a[0] for a, b in zip(self.marks, self.marks[1:]))
        cpus = tuple(b[1] - a[1] if a[1] is not None and b[1] is not None else float("nan")
                     for a, b in zip(self.marks, self.marks[1:]))
        self.marks.clear()
        return walls + cpus


def redis_pid(r: Any) -> int | None:
    """The Redis server's pid when it runs on this machine (INFO says so), else None."""
    try:
        pid = int(r.info("server")["process_id"])
    except Exception:  # noqa: BLE001 - no pid, no CPU figure
        return None
    return pid if os.path.exists(f"/proc/{pid}/task") else None


# -- measurements -------------------------------------------------------------------------------
# Each method is a "round": one timed put and one timed get of the same bytes, returning
# (put_seconds, get_seconds, put_cpu_seconds, get_cpu_seconds) (Stopwatch.spans). main() runs every method once per repeat, interleaved, so that
# the machine's drift (shared, noisy cores) hits all of them alike; figures are medians.
Round = Callable[[], tuple[float, ...]]


def _blocks_as_messages(nbytes: int, count: int, chunk: int) -> list[bytes]:
    """``count`` distinct random blocks of ``nbytes``, each cut into ``chunk``-byte messages as
    the kvstore client cuts a block. NOTE: distinct blocks, not one block sent ``count`` times:
    the in-band stream moves ``count * nbytes`` distinct bytes through memory, and one block
    repeated would stay in cache (2 MiB fits in L2) and flatter the baseline."""
    blocks = [os.urandom(nbytes) for _ in range(count)]
    return [b[o : o + chunk] for b in blocks for o in range(0, nbytes, chunk)]


def raw_grpc_round(stack: ExitStack, port: int, nbytes: int, count: int, chunk: int, pid: int | None = None) -> Round:
    """Bare grpcio, same process layout and message sizes as the in-band stream: a client
    stream of ``count`` blocks of ``nbytes`` in ``chunk``-byte messages, and the same back."""
    import grpc

    ident = lambda b: b
    opts = [("grpc.max_receive_message_length", 64 * MiB), ("grpc.max_send_message_length", 64 * MiB)]
    ch = stack.enter_context(grpc.insecure_channel(f"127.0.0.1:{port}", options=opts))
    sink = ch.stream_unary("/raw.Raw/Sink", request_serializer=ident, response_deserializer=ident)
    source = ch.unary_stream("/raw.Raw/Source", request_serializer=ident, response_deserializer=ident)
    messages = _blocks_as_messages(nbytes, count, chunk)
    watch = Stopwatch(pid)

    def one() -> tuple[float, ...]:
        watch.mark()
        sink(iter(messages))
        watch.mark()
        for _ in source(f"{nbytes},{count},{chunk}".encode()):
            pass
        watch.mark()
        return watch.spans()

    return one


def redis_round(stack: ExitStack, nbytes: int, count: int) -> Round | str:
    """A round of redis-py SET/GET, or why Redis is skipped."""
    try:
        import redis

        r = redis.Redis(host="127.0.0.1", port=6379)
        r.ping()
    except Exception as exc:  # noqa: BLE001 - any failure means "no redis here"
        return str(exc)[:80]
    stack.callback(r.close)
    values = [os.urandom(nbytes) for _ in range(count)]
    names = [f"kvstore-bench:{os.getpid()}:{i}" for i in range(count)]  # NOTE: two runs shared "bench:i"
    stack.callback(lambda: r.delete(*names))
    watch = Stopwatch(redis_pid(r))

    def one() -> tuple[float, ...]:
        watch.mark()
        for name, v in zip(names, values):
            r.set(name, v)
        watch.mark()
        for name in names:
            r.get(name)
        watch.mark()
        return watch.spans()

    return one


def memcpy_round(nbytes: int, count: int) -> Round:
    src = np.random.randint(0, 255, nbytes * count, dtype=np.uint8)
    dst = np.empty_like(src)
    watch = Stopwatch(None)

    def one() -> tuple[float, ...]:
        watch.mark()
        np.copyto(dst, src)
        watch.mark()
        np.copyto(src, dst)
        watch.mark()
        return watch.spans()

    return one


def kvstore_rounds(stack: ExitStack, target: str, token: str, block_mib: float, count: int,
                   chunk: int, pid: int | None = None) -> dict[str, Round]:
    """shm (buffers in the region), shm_staged (ordinary tensors), stream (in-band)."""
    from kvstore.client import Client

    spec = _spec(block_mib)
    nbytes = spec.block_nbytes * count
    kv = torch.randint(-1000, 1000, (count, *spec.block_shape), dtype=torch.int16).view(torch.float16)
    seq = iter(range(10**6))
    watch = Stopwatch(pid)

    def make(c: Client, data: torch.Tensor, sink: torch.Tensor) -> Round:
        def one() -> tuple[float, ...]:
            base = next(seq) * 10**7 + round(block_mib * 10**6)
            keys = c.block_keys(spec, list(range(base, base + count * spec.block_tokens)))
            watch.mark()
            c.put(spec, keys, data)
            watch.mark()
            got = c.get_into(spec, keys, sink)
            watch.mark()
            assert got == count and torch.equal(sink.view(torch.int16), kv.view(torch.int16))
            c.delete(keys)
            sink.zero_()
            return watch.spans()
        return one

    local = stack.enter_context(Client(target, token, local=True, region_bytes=3 * nbytes + MiB))
    remote = stack.enter_context(Client(target, token, local=False, chunk_bytes=chunk))
    assert local.uses_shared_memory and not remote.uses_shared_memory
    src = stack.enter_context(local.local_blocks(spec, count))
    dst = stack.enter_context(local.local_blocks(spec, count))
    src.tensor.copy_(kv)
    return {"shm": make(local, src.tensor, dst.tensor),
            "shm_staged": make(local, kv, torch.empty_like(kv)),
            "stream": make(remote, kv, torch.empty_like(kv))}


def _interleaved(rounds: dict[str, Round], repeats: int) -> dict[str, list[tuple[float, ...]]]:
    """One warm-up round each, then ``repeats`` rounds of every method in turn."""
    times: dict[str, list[tuple[float, ...]]] = {name: [] for name in rounds}
    for one in rounds.values():
        one()
    for _ in range(repeats):
        for name, one in rounds.items():
            times[name].append(one())
    return times


def bench_size(servers: Servers, mib: float, count: int, repeats: int, chunk: int) -> dict[str, object]:
    nbytes = round(mib * MiB)
    with ExitStack() as stack:
        rounds = kvstore_rounds(stack, servers.target, servers.token, mib, count, chunk, servers.sidecar_pid)
        rounds["memcpy"] = memcpy_round(nbytes, count)
        rounds["grpc_raw"] = raw_grpc_round(stack, servers.raw_port, nbytes, count, chunk, servers.raw_pid)
        redis = redis_round(stack, nbytes, count)
        if callable(redis):
            rounds["redis"] = redis
        times = _interleaved(rounds, repeats)
        rounds.clear()  # the rounds hold views of the shared region: drop them before it closes
    total = nbytes * count
    row: dict[str, object] = {"blocks_per_call": count, "chunk_bytes": chunk}
    cpu: dict[str, dict[str, float]] = {}
    for name, ts in times.items():
        row[name] = {"put": _gbps(total, [t[0] for t in ts]), "get": _gbps(total, [t[1] for t in ts])}
        per_mib = {op: statistics.median(t[2 + k] for t in ts) / (total / MiB) * 1e3
                   for k, op in enumerate(("put", "get"))}
        if not any(math.isnan(v) for v in per_mib.values()):
            cpu[name] = {op: round(v, 3) for op, v in per_mib.items()}
    if not callable(redis):
        row["redis"] = {"skipped": redis}
    ratios, paired = {}, {}
    for num, den in (("shm", "memcpy"), ("stream", "grpc_raw"), ("stream", "redis")):
        if "put" in row.get(den, {}):
            for k, op in enumerate(("put", "get")):
                ratios[f"{num}_{op}/{den}"] = round(row[num][op] / row[den][op], 2)
                paired[f"{num}_{op}/{den}"] = round(statistics.median(
                    d[k] / n[k] for n, d in zip(times[num], times[den])), 2)
    row["ratios"] = ratios
    row["paired_ratios"] = paired
    if cpu:
        row["cpu_ms_per_mib"] = cpu
    return row


def bench_checksum(chunk: int) -> dict[str, float]:
    """xxh3_64 and frame encoding of one chunk, GB/s (the per-chunk costs of the stream)."""
    import xxhash

    from kvstore.frames import data_frame
    from proto.kvstore.v1 import kvstore_pb2 as pb

    data = memoryview(np.random.randint(0, 255, chunk, dtype=np.uint8))
    xxh = _timed(lambda: xxhash.xxh3_64_intdigest(data), 50)
    frame = _timed(lambda: data_frame(pb.PutFrame, 0, 0, data), 50)
    return {"xxh3_gbps": _gbps(chunk, xxh), "frame_encode_gbps": _gbps(chunk, frame)}


def bench_lookup(target: str, token: str, repeats: int) -> dict[str, float]:
    """End-to-end Lookup of 8,192 client-sent keys, plus the same lookup on an in-process Store
    (the floor the service adds to) and a 1-byte-ish unary round trip, all p50 in ms."""
    from kvstore.client import Client
    from kvstore.config import StoreConfig
    from kvstore.spec import ModelSpec
    from kvstore.store import Store

    spec = ModelSpec(model="bench-lookup", revision="r", num_layers=1, num_kv_heads=1, head_dim=16,
                     dtype="float16", block_tokens=16)
    n = 8192
    reps = max(repeats, 100)
    kv = torch.zeros((n, *spec.block_shape), dtype=torch.float16)
    with Client(target, token, local=True, region_bytes=n * spec.block_nbytes + MiB) as c:
        keys = c.block_keys(spec, list(range(n * 16)))
        c.put(spec, keys, kv)
        assert c.lookup(spec, keys).num_blocks == n
        times = _timed(lambda: c.lookup(spec, keys), reps)
        unary = _timed(lambda: c.whoami(), reps)
    with tempfile.TemporaryDirectory() as tmp:
        store = Store.open(StoreConfig(path=Path(tmp), hbm_bytes=64 * MiB, dram_bytes=0, nvme_bytes=64 * MiB,
                                       durable=False, persist_on_close=False))
        with store:
            skeys = store.block_keys("bench", spec, list(range(n * 16)))
            store.put("bench", spec, skeys, kv)
            inproc = _timed(lambda: store.lookup("bench", spec, skeys), reps)
    ms = lambda ts: round(statistics.median(ts) * 1e3, 3)
    return {"lookup_8192_blocks_p50_ms": ms(times),
            "lookup_8192_blocks_p90_ms": round(sorted(times)[int(len(times) * 0.9)] * 1e3, 3),
            "store_lookup_in_process_p50_ms": ms(inproc),
            "unary_rpc_p50_ms": ms(unary)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sizes", default="2,32",
                    help="block sizes in MiB; multiples of 0.125 below 1 MiB (e.g. 0.25,0.5,2)")
    ap.add_argument("--bytes-per-call", type=int, default=64, help="MiB moved per Put/Get call")
    ap.add_argument("--chunk-kib", type=int, default=None,
                    help="payload per streamed message, both for kvstore and bare grpcio "
                         "(default: the kvstore client's chunk_bytes)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--raw-server", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.raw_server is not None:
        _raw_server_main(args.raw_server)
        return 0
    from kvstore.memtune import reexec_with_streaming_copies

    reexec_with_streaming_copies()  # as the sidecar does; the children (both servers) inherit it
    torch.set_num_threads(1)
    sizes = [float(s) for s in args.sizes.split(",")]
    for mib in sizes:
        _spec(mib)  # a size that is no whole number of tokens fails before the servers start
    from kvstore.client import DEFAULT_CHUNK_BYTES

    chunk = args.chunk_kib * 1024 if args.chunk_kib else DEFAULT_CHUNK_BYTES
    with sidecar_and_raw(hbm=1024 * MiB, dram=256 * MiB, nvme=512 * MiB) as servers:
        results: dict[str, object] = {"repeats": args.repeats, "unit": "GB/s (median)", "sizes": {}}
        for mib in sizes:
            count = max(1, int(args.bytes_per_call // mib))
            results["sizes"][_size_label(mib)] = bench_size(servers, mib, count, args.repeats, chunk)
        results["per_chunk"] = bench_checksum(chunk)
        results["lookup"] = bench_lookup(servers.target, servers.token, args.repeats)
    emit_json(results, args.out)
    return 0


if __name__ == "__main__":
    from kvstore.memtune import process_entry

    process_entry()  # run as a script: it may re-execute itself (streaming copies)
    sys.exit(main())
