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
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import grpc
import pytest
import torch
from service_harness import SPEC, fresh_tokens, random_kv, start

from kvstore.client import Client, spec_to_pb
from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.shm import ShmRegion
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


def test_admin_names_with_a_lone_surrogate_are_refused_in_the_client(sidecar):
    admin = sidecar.admin()
    for call in (lambda: admin.create_tenant("\ud800x"), lambda: admin.rotate_token("a\udfff"),
                 lambda: admin.delete_tenant("\ud800"), lambda: admin.grant("t", "shared:\ud800"),
                 lambda: admin.create_tenant("ok", namespaces=["shared:\udc80"]),
                 lambda: admin.get_policy("\ud800"), lambda: admin.set_policy("\ud800", ttl_s=5.0)):
        with pytest.raises(InvalidArgument, match="surrogate"):
            call()
    assert "ok" not in [t["name"] for t in admin.list_tenants()]


# -- SIGBUS --------------------------------------------------------------------------------------
@pytest.mark.parametrize("call", ["PutLocal", "GetLocal"])
def test_a_region_truncated_by_its_tenant_fails_that_call_and_not_the_server(served, call):
    """(a) The tenant registers its own segment, shrinks it to 4 KiB and names a slot at 64 KiB:
    the server answered with SIGBUS (exit -7). Now that call fails, FAILED_PRECONDITION naming
    the region, and the server goes on serving every tenant."""
    s = served()
    other = Client(s.target, s.tenant("bystander"), local=False)
    keys = other.block_keys(SPEC, fresh_tokens(2))
    kv = random_kv(2, seed=1)
    other.put(SPEC, keys, kv)
    token = s.tenant("mallory")
    ch, stub, md = _stub(s.target, token)
    region = ShmRegion.create(1 << 20)  # a /dev/shm segment
    try:
        rid = _register(stub, md, region)
        mine = Client(s.target, token, local=False)
        stored = mine.block_keys(SPEC, fresh_tokens(1))
        mine.put(SPEC, stored, random_kv(1, seed=2))
        fd = os.open(f"/dev/shm/{region.name}", os.O_RDWR)
        os.ftruncate(fd, 4096)
        os.close(fd)
        target = pb.Target(spec=spec_to_pb(SPEC), keys=os.urandom(32) if call == "PutLocal" else stored[0])
        req = (pb.PutLocalRequest(target=target, region_id=rid, offsets=[64 << 10], seq=1) if call == "PutLocal"
               else pb.GetLocalRequest(target=target, region_id=rid, offsets=[64 << 10], seq=1))
        with pytest.raises(grpc.RpcError) as err:
            getattr(stub, call)(req, metadata=md, timeout=30)
        assert s.alive(), f"the server died (exit {s.proc.returncode}): {s.stderr()[-2000:]}"
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, err.value.details()
        assert region.name in err.value.details() and "truncated" in err.value.details()
        assert os.fstat(os.open(f"/dev/shm/{region.name}", os.O_RDONLY)).st_size == 4096  # not grown back
        assert torch.equal(other.get(SPEC, keys).view(torch.int16), kv.view(torch.int16))
        mine.close()
        other.close()
    finally:
        ch.close()
        region.close()


def test_a_default_client_region_cannot_be_shrunk_under_the_server(served):
    """A default client's region is a memfd sealed against shrinking, which the server maps:
    truncating it is refused by the kernel, so the server's memcpy can never fault."""
    s = served()
    c = Client(s.target, s.tenant("sealed"), local=True)
    try:
        region = c._local.region
        assert "@" in region.name  # a memfd region: kvs_<hex>@<pid>:<fd>
        fd = int(region.name.rsplit(":", 1)[1])
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 4096)
        keys = c.block_keys(SPEC, fresh_tokens(3))
        kv = random_kv(3, seed=3)
        c.put(SPEC, keys, kv)
        assert torch.equal(c.get(SPEC, keys).view(torch.int16), kv.view(torch.int16))
        assert s.alive()
    finally:
        c.close()


def test_an_unsealed_or_foreign_memfd_is_refused(served):
    """The server maps a memfd only when it carries F_SEAL_SHRINK (else its owner could shrink
    it under the server) and its /proc link names a kvstore memfd."""
    import fcntl
    import mmap
    import secrets

    from kvstore.shm import HEADER_BYTES, MAGIC, NONCE_OFFSET

    s = served()
    ch, stub, md = _stub(s.target, s.tenant("unsealed"))
    base = "kvs_" + secrets.token_hex(12)
    fd = os.memfd_create(base, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    other = os.memfd_create("not-kvstore", os.MFD_CLOEXEC)
    try:
        size = HEADER_BYTES + (1 << 20)
        os.ftruncate(fd, size)
        nonce = secrets.token_bytes(16)
        with mmap.mmap(fd, size) as mm:
            mm[NONCE_OFFSET : NONCE_OFFSET + 16] = nonce
            mm[: len(MAGIC)] = MAGIC
        for name in (f"{base}@{os.getpid()}:{fd}", f"{base}@{os.getpid()}:{other}"):
            with pytest.raises(grpc.RpcError) as err:
                stub.RegisterRegion(pb.RegisterRegionRequest(kind=pb.REGION_KIND_POSIX_SHM, name=name,
                                                             size=1 << 20, nonce=nonce), metadata=md, timeout=30)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, err.value.details()
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        ok = stub.RegisterRegion(pb.RegisterRegionRequest(kind=pb.REGION_KIND_POSIX_SHM,
                                                          name=f"{base}@{os.getpid()}:{fd}", size=1 << 20,
                                                          nonce=nonce), metadata=md, timeout=30)
        assert ok.nonce == nonce
    finally:
        os.close(fd)
        os.close(other)
        ch.close()
    assert s.alive()


_SMALL_SHM = textwrap.dedent("""\
    import os, sys
    sys.path[:0] = [{tests!r}, {repo!r}]
    import torch
    from test_shm_robust import BIG, Served
    from pathlib import Path
    from kvstore.client import Client
    from kvstore.shm import ShmRegion
    from kvstore.errors import KVStoreError
    import kvstore.client as client_mod

    s = Served(Path({home!r}), dram_bytes=256 << 20)
    try:
        token = s.tenant("t1")
        w = Client(s.target, token, local=False)
        keys = w.block_keys(BIG, list(range(16 * 80)))
        kv = torch.randn((80, *BIG.block_shape)).to(BIG.torch_dtype)
        for i in range(0, 80, 16):
            w.put(BIG, keys[i:i + 16], kv[i:i + 16], parent=keys[i - 1] if i else None)
        w.close()
        for kind in ("default", "segment"):
            if kind == "segment":  # a server that cannot open the memfd: a /dev/shm segment, or streams
                real = ShmRegion.create
                client_mod.ShmRegion.create = lambda size, **kw: real(size)
            c = Client(s.target, token)  # 256 MiB region, in a 64 MiB /dev/shm
            print(kind, "shm", c.uses_shared_memory, flush=True)
            got = c.get(BIG, keys)
            print(kind, "get", got.shape[0], bool(torch.equal(got.view(torch.int16), kv.view(torch.int16))), flush=True)
            more = c.block_keys(BIG, list(range(10**6 + 16 * 80 * (kind == "segment"), 10**6 + 16 * 80 * (1 + (kind == "segment")))))
            c.put(BIG, more, kv)
            print(kind, "put", c.lookup(BIG, more).num_blocks, flush=True)
            c.close()
        try:
            ShmRegion.create(256 << 20).close()
            print("create ok")
        except KVStoreError as exc:
            print("create", exc.code, str(exc).replace(chr(10), " "))
        print("server alive", s.alive(), s.proc.returncode, flush=True)
    finally:
        s.stop()
""")


def test_a_small_dev_shm_neither_crashes_the_server_nor_the_client(tmp_path):
    """(b) In a container whose /dev/shm is 64 MiB (docker's default), the client's 256 MiB
    sparse region could not be backed: an 80 MiB get made the server write pages tmpfs could not
    back (SIGBUS in the server), an 80 MiB put did the same to the client. Now a default client
    uses a memfd (no /dev/shm space at all), and a client that has to use a /dev/shm segment
    reserves its pages when it creates it: too big, it says so (RESOURCE_EXHAUSTED naming
    /dev/shm) and the client goes on with streams."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("a private /dev/shm needs root and unshare")
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                            "mount -t tmpfs -o size=64m tmpfs /dev/shm"], check=False, capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a private /dev/shm here: {probe.stderr.decode()[:200]}")
    script = tmp_path / "small_shm.py"
    script.write_text(_SMALL_SHM.format(tests=str(TESTS), repo=str(REPO), home=str(tmp_path / "srv")))
    done = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                           f"mount -t tmpfs -o size=64m tmpfs /dev/shm && exec {sys.executable} {script}"],
                          check=False, capture_output=True, text=True, timeout=900)
    out = done.stdout
    assert done.returncode == 0, out + done.stderr[-3000:]
    assert "server alive True None" in out, out + done.stderr[-3000:]
    assert "default shm True" in out and "default get 80 True" in out and "default put 80" in out, out
    assert "segment shm False" in out and "segment get 80 True" in out and "segment put 80" in out, out
    assert "create RESOURCE_EXHAUSTED" in out and "/dev/shm" in out, out


# -- regions of clients that are gone ------------------------------------------------------------
_CHILD = ("import sys, time\n"
          "sys.path.insert(0, {repo!r})\n"
          "import kvstore.client as client_mod\n"
          "from kvstore.client import Client\n"
          "real = client_mod.ShmRegion.create\n"
          "client_mod.ShmRegion.create = lambda size, **kw: real(size)  # a /dev/shm segment\n"
          "c = Client({target!r}, {token!r}, local=True, region_bytes=1 << 20)\n"
          "print(c._local.region.name, flush=True)\n"
          "time.sleep(600)\n")


def _kill_group(target: str, token: str) -> str:
    """A client in its own process group that registers a /dev/shm segment, killed with its
    whole group (its resource tracker too): the segment's name."""
    child = subprocess.Popen([sys.executable, "-c", _CHILD.format(repo=str(REPO), target=target, token=token)],
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    name = child.stdout.readline().strip()
    os.killpg(child.pid, signal.SIGKILL)
    child.wait()
    assert name.startswith("kvs_"), "the child registered no region"
    return name


def test_regions_of_clients_killed_with_their_process_group_are_dropped_and_unlinked(served):
    s = served(limits="max_regions_per_principal = 2")
    token = s.tenant("engine")
    names = [_kill_group(s.target, token) for _ in range(3)]
    # the third child registered: the first two were dropped at its registration
    assert not any(Path("/dev/shm", n).exists() for n in names[:2])
    c = Client(s.target, token, local=True, region_bytes=1 << 20)  # was RESOURCE_EXHAUSTED
    d = Client(s.target, token, local=True, region_bytes=1 << 20)
    try:
        assert c.uses_shared_memory and d.uses_shared_memory
        assert not Path("/dev/shm", names[2]).exists()
        keys = c.block_keys(SPEC, fresh_tokens(2))
        kv = random_kv(2, seed=5)
        c.put(SPEC, keys, kv)
        assert torch.equal(d.get(SPEC, keys).view(torch.int16), kv.view(torch.int16))
    finally:
        c.close()
        d.close()
    assert s.alive()


def test_segments_of_clients_that_died_before_the_server_started_are_swept_at_start(served):
    # NOTE: any kvstore server of this user on the machine sweeps such a segment too (at its
    # start, and while it serves): one started by a concurrent run took it between the first
    # server's stop and the check. A segment gone that way is made again, a few times.
    for _ in range(5):
        first = served()
        token = first.tenant("engine")
        name = _kill_group(first.target, token)
        assert first.stop() == 0
        if Path("/dev/shm", name).exists():  # nobody of ours left to unlink it
            break
    else:
        pytest.fail("another kvstore server swept every dead client's segment before this test could")
    served()
    assert not Path("/dev/shm", name).exists()


def test_a_live_clients_region_is_never_unlinked_and_one_of_another_namespace_is_kept(sidecar):
    """The server unlinks only what a creator known to be gone left: not the region of a live
    client, nor one whose creator it cannot judge (another pid namespace)."""
    from kvstore.shm import OWNER_OFFSET
    from kvstore.shm_owner import Owner

    c = sidecar.tenant("live", local=True)
    regions = sidecar.server.data.regions
    assert regions.prune() == 0 and c._local.region.alive()
    seg = ShmRegion.create(1 << 20)
    try:
        me = Owner.current()
        elsewhere = Owner(pid=1 << 22, start=me.start, pidns=me.pidns + 1, boot=me.boot)  # another namespace
        seg._buf[OWNER_OFFSET : OWNER_OFFSET + len(elsewhere.pack())] = elsewhere.pack()
        assert not elsewhere.gone()
        assert regions.sweep() == [] and Path("/dev/shm", seg.name).exists()
        gone = Owner(pid=me.pid, start=me.start + 1, pidns=me.pidns, boot=me.boot)  # the pid, reused
        assert gone.gone() and not me.gone()
    finally:
        seg.close()
    keys = c.block_keys(SPEC, fresh_tokens(1))
    c.put(SPEC, keys, random_kv(1))
    assert c.lookup(SPEC, keys).num_blocks == 1


def test_at_the_limit_an_idle_region_makes_room_and_its_live_client_registers_again(tmp_path):
    """Clients the server cannot judge (another pid namespace) or that just went quiet: at
    max_regions_per_principal, the least recently used region idle for region_idle_evict_s is
    dropped (not unlinked) for the new one, instead of refusing it; its client, still there,
    is told UNKNOWN region at its next call and registers it again."""
    sc = start(tmp_path, limits={"max_regions_per_principal": 1})
    try:
        token = sc.admin().create_tenant("quiet")
        a = sc.client(token, local=True, region_bytes=1 << 20)
        sc.server.data.regions.idle_evict_s = 0.0  # every region not in a call counts as idle
        b = sc.client(token, local=True, region_bytes=1 << 20)  # was RESOURCE_EXHAUSTED
        assert a.uses_shared_memory and b.uses_shared_memory
        assert a._local.region.alive()  # dropped, never unlinked
        for c, seed in ((a, 1), (b, 2), (a, 3)):
            keys = c.block_keys(SPEC, fresh_tokens(2))
            kv = random_kv(2, seed=seed)
            c.put(SPEC, keys, kv)
            assert torch.equal(c.get(SPEC, keys).view(torch.int16), kv.view(torch.int16))
    finally:
        sc.stop()


def test_the_region_idle_time_is_a_config_field(tmp_path):
    from kvstore import server_config

    assert server_config.build({}, data_dir=tmp_path).limits.region_idle_evict_s == 60.0
    for bad in (0, -1, float("inf"), float("nan")):
        with pytest.raises(InvalidArgument, match=r"limits\.region_idle_evict_s"):
            server_config.build({"limits": {"region_idle_evict_s": bad}}, data_dir=tmp_path)
    sc = start(tmp_path / "s", limits={"region_idle_evict_s": 5.0})
    try:
        assert sc.server.data.regions.idle_evict_s == 5.0
    finally:
        sc.stop()


def test_a_region_in_use_is_never_evicted():
    """A region whose call is running is not idle, whatever its last use."""
    import kvstore.service_resources as res
    from kvstore.errors import ResourceExhausted
    from kvstore.service_resources import RegionTable

    class Fake:
        nonce = b"n"

        def __init__(self, name: str) -> None:
            self.name, self.closed = name, False

        def alive(self) -> bool:
            return True

        def close(self) -> None:
            self.closed = True

    made: dict[str, Fake] = {}
    orig = res.attach_region
    res.attach_region = lambda kind, name, size, handle: made.setdefault(name, Fake(name))
    try:
        now = [0.0]
        table = RegionTable(max_per_principal=1, max_bytes=1 << 20, idle_evict_s=10, clock=lambda: now[0])
        rid, _ = table.register("t", "posix_shm", "kvs_a", 4096, nonce=b"n")
        with table.using("t", rid, 1):
            now[0] = 100.0
            with pytest.raises(ResourceExhausted):
                table.register("t", "posix_shm", "kvs_b", 4096, nonce=b"n")
        assert not made["kvs_a"].closed
        now[0] = 105.0
        with pytest.raises(ResourceExhausted):  # used 5 s ago
            table.register("t", "posix_shm", "kvs_b", 4096, nonce=b"n")
        now[0] = 111.0
        table.register("t", "posix_shm", "kvs_b", 4096, nonce=b"n")
        assert made["kvs_a"].closed
    finally:
        res.attach_region = orig
