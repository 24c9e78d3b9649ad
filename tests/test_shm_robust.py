"""The shared-memory data plane survives what clients and the host do to its regions.

* SIGBUS: the server copied through a mapping of each client region. A tenant that shrank its
  own region (ftruncate) and sent a PutLocal/GetLocal past the new end, or a get larger than
  what was left of a small /dev/shm (docker's 64 MiB), killed the whole sidecar (exit -7) with
  every tenant's memory-tier blocks. Those tests run the server in a subprocess, so that a
  crash fails the test instead of killing pytest.
* Regions of clients killed with their process group (docker kill, OOM kill) were never
  unlinked and stayed registered: after max_regions_per_principal such deaths the tenant had no
  shared memory any more, and the segments held memory across server restarts.
* A PutLocal whose client was told DEADLINE_EXCEEDED committed all the same.
* A session name holding a lone surrogate failed in the client with a raw UnicodeEncodeError.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import grpc
import pytest
from service_harness import SPEC, fresh_tokens, random_kv, start

from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.spec import ModelSpec
from proto.kvstore.v1 import kvstore_pb2 as pb
from proto.kvstore.v1 import kvstore_pb2_grpc

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
#: 1 MiB blocks
BIG = ModelSpec(model="test/big", revision="r1", num_layers=16, num_kv_heads=8, head_dim=128, block_tokens=16)


class Served:
    """``kvstore serve`` in a subprocess (a crash is its exit code, not pytest's)."""

    def __init__(self, home: Path, limits: str = "", dram_bytes: int = 32 << 20) -> None:
        home.mkdir(parents=True, exist_ok=True)
        cfg = home / "kvstore.toml"
        cfg.write_text(textwrap.dedent(f"""\
            listen = "127.0.0.1:0"
            audit_fsync = false
            expire_interval_s = 0
            [limits]
            {limits}
            [metrics]
            enabled = false
            [store]
            path = "{home / 'data'}"
            hbm_bytes = {32 << 20}
            dram_bytes = {dram_bytes}
            nvme_bytes = {512 << 20}
            durable = false
            """))
        env = {**os.environ, "PYTHONPATH": str(REPO), "KVSTORE_HOME": str(home)}
        self.log = open(home / "server.log", "w+")  # noqa: SIM115
        self.proc = subprocess.Popen([sys.executable, "-c", "from kvstore.cli import main; main()", "serve",
                                      "--config", str(cfg)], stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=env, cwd=home, start_new_session=True)
        lines = []
        while True:
            line = self.proc.stdout.readline()
            lines.append(line)
            if line == "" or line.startswith("ready"):
                break
        out = "".join(lines)
        port = re.search(r"serving on 127\.0\.0\.1:(\d+)", out)
        token = re.search(r"admin token \(shown once, store it now\): (\S+)", out)
        if port is None or token is None:
            self.stop()
            raise RuntimeError(f"the server did not start: {out}{self.stderr()}")
        self.target = f"127.0.0.1:{port.group(1)}"
        self.admin_token = token.group(1)
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()

    def tenant(self, name: str) -> str:
        from kvstore.admin_client import AdminClient

        with AdminClient(self.target, self.admin_token) as admin:
            return admin.create_tenant(name)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stderr(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


@pytest.fixture
def served(tmp_path):
    made: list[Served] = []

    def make(**kw) -> Served:
        s = Served(tmp_path / f"srv{len(made)}", **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.stop()


def _stub(target: str, token: str):
    ch = grpc.insecure_channel(target)
    return ch, kvstore_pb2_grpc.KVStoreStub(ch), (("authorization", f"Bearer {token}"),)


def _register(stub, md, region) -> int:
    return stub.RegisterRegion(pb.RegisterRegionRequest(kind=pb.REGION_KIND_POSIX_SHM, name=region.name,
                                                        size=region.usable, nonce=region.nonce),
                               metadata=md, timeout=30).region_id


# -- PutLocal after its deadline -----------------------------------------------------------------
def test_a_put_local_whose_client_saw_its_deadline_stores_nothing(tmp_path, monkeypatch):
    sc = start(tmp_path)
    try:
        c = sc.client(sc.admin().create_tenant("late"), local=True, timeout=0.5)
        keys = c.block_keys(SPEC, fresh_tokens(2))
        plane = sc.server.data
        gave_up, ended = threading.Event(), threading.Event()
        real_copy, real_put = plane._copy, plane.put_local

        def copy(pairs):
            gave_up.wait(60)  # the client's deadline passes while the bytes are read
            real_copy(pairs)

        def put_local(*args, **kw):
            try:
                return real_put(*args, **kw)
            finally:
                ended.set()

        monkeypatch.setattr(plane, "_copy", copy)
        monkeypatch.setattr(plane, "put_local", put_local)
        with pytest.raises(KVStoreError) as err:
            c.put(SPEC, keys, random_kv(2, seed=7))
        assert err.value.code == "DEADLINE_EXCEEDED"
        gave_up.set()
        assert ended.wait(60)
        monkeypatch.setattr(plane, "_copy", real_copy)
        c.timeout = 30
        assert c.lookup(SPEC, keys).num_blocks == 0  # was 2: stored after the client gave up
    finally:
        sc.stop()


# -- names the client cannot send ----------------------------------------------------------------
def test_names_with_a_lone_surrogate_are_refused_in_the_client(sidecar):
    c = sidecar.tenant("surrogates", local=False)
    keys = c.block_keys(SPEC, fresh_tokens(1))
    for call in (lambda: c.open_session("\ud800x"), lambda: c.close_session("a\udfffb"),
                 lambda: c.put(SPEC, keys, random_kv(1), session="\ud800"),
                 lambda: c.get(SPEC, keys, namespace="\ud800"),
                 lambda: c.block_keys(SPEC, fresh_tokens(1), namespace="x\ud800"),
                 lambda: c.block_keys(SPEC, fresh_tokens(1), [["\udc80"]])):
        with pytest.raises(InvalidArgument, match="surrogate"):
            call()
    assert c.lookup(SPEC, keys).num_blocks == 0
    c.open_session("fine")
