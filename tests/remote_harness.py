"""Real Redis processes for the tests/test_remote_*.py files (imported as ``remote_harness``).

* :func:`redis_url` — the Redis on 127.0.0.1:6379 when it answers, else a private
  ``redis-server`` on a free loopback port (stopped by :meth:`Procs.stop`).
* :class:`LocalCluster` — a 3-master Redis Cluster on loopback ports in a temp dir, started with
  ``redis-server --cluster-enabled yes`` and ``redis-cli --cluster create ... --cluster-yes``;
  one node can be killed (SIGKILL) and restarted with its ``nodes.conf`` (it rejoins, empty).

Tests skip with a clear reason only when ``redis-server``/``redis-cli`` are not installed.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis

REDIS_SERVER = shutil.which("redis-server") or shutil.which("valkey-server")
REDIS_CLI = shutil.which("redis-cli") or shutil.which("valkey-cli")
DEFAULT_URL = "redis://127.0.0.1:6379/0"


def require_redis() -> None:
    if REDIS_SERVER is None or REDIS_CLI is None:
        pytest.skip("redis-server / redis-cli are not installed (apt-get install redis-server)")


def _free_port(avoid: set[int]) -> int:
    """A free loopback port p whose cluster bus port p+10000 is free too."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if p in avoid or p + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p + 10000))
            except OSError:
                continue
        return p
    raise RuntimeError("no free port pair found")


def _wait_ping(port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    c = redis.Redis(host="127.0.0.1", port=port, socket_timeout=0.5, socket_connect_timeout=0.5)
    try:
        while True:
            try:
                if c.ping():
                    return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on port {port} did not come up")
            time.sleep(0.05)
    finally:
        c.close()


@dataclass
class Procs:
    """redis-server processes started by a test; :meth:`stop` kills exactly these."""

    procs: dict[int, subprocess.Popen] = field(default_factory=dict)

    def start(self, port: int, workdir: Path, *extra: str) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        args = [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(workdir), "--logfile", "redis.log",
                "--protected-mode", "no", *extra]
        self.procs[port] = subprocess.Popen(args, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL)
        _wait_ping(port)

    def kill(self, port: int) -> None:
        p = self.procs.pop(port)
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=10)

    def stop(self) -> None:
        for port in list(self.procs):
            self.kill(port)


def redis_url(procs: Procs, tmp: Path) -> str:
    """127.0.0.1:6379 when it answers; else a private server (requires redis-server)."""
    c = redis.Redis.from_url(DEFAULT_URL, socket_connect_timeout=0.5, socket_timeout=0.5)
    try:
        if c.ping():
            return DEFAULT_URL
    except redis.RedisError:
        pass
    finally:
        c.close()
    require_redis()
    port = _free_port(set())
    procs.start(port, tmp / f"redis-{port}")
    return f"redis://127.0.0.1:{port}/0"


@dataclass
class LocalCluster:
    """A Redis Cluster of ``masters`` primaries (no replicas) on loopback."""

    root: Path
    masters: int = 3
    node_timeout_ms: int = 1000
    ports: list[int] = field(default_factory=list)
    procs: Procs = field(default_factory=Procs)

    def _args(self) -> list[str]:
        return ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(self.node_timeout_ms),
                "--cluster-require-full-coverage", "no"]

    def start(self) -> LocalCluster:
        require_redis()
        avoid: set[int] = set()
        for _ in range(self.masters):
            p = _free_port(avoid)
            avoid |= {p, p + 10000}
            self.ports.append(p)
        try:
            for p in self.ports:
                self.procs.start(p, self.root / str(p), *self._args())
            subprocess.run([REDIS_CLI, "--cluster", "create",
                            *[f"127.0.0.1:{p}" for p in self.ports],
                            "--cluster-replicas", "0", "--cluster-yes"],
                           check=True, capture_output=True, timeout=60)
            self.wait_ok()
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def urls(self) -> list[str]:
        return [f"redis://127.0.0.1:{p}" for p in self.ports]

    def node(self, port: int) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=port, socket_timeout=2)

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Until every running node reports cluster_state:ok and sees all 16384 slots."""
        deadline = time.monotonic() + timeout
        while True:
            ok = True
            for p in self.procs.procs:
                c = self.node(p)
                try:
                    info = c.cluster("info")
                    ok &= info.get("cluster_state") == "ok" and \
                        int(info.get("cluster_slots_assigned", 0)) == 16384 and \
                        int(info.get("cluster_slots_fail", 0)) == 0 and \
                        int(info.get("cluster_known_nodes", 0)) == self.masters
                except redis.RedisError:
                    ok = False
                finally:
                    c.close()
            if ok:
                return
            if time.monotonic() > deadline:
                raise RuntimeError("cluster did not reach cluster_state:ok")
            time.sleep(0.1)

    def node_id(self, port: int) -> str:
        c = self.node(port)
        try:
            return c.execute_command("CLUSTER", "MYID").decode()
        finally:
            c.close()

    def kill(self, port: int) -> None:
        self.procs.kill(port)

    def restart(self, port: int) -> None:
        """Start the killed node again from its directory (same nodes.conf, no data)."""
        self.procs.start(port, self.root / str(port), *self._args())

    def stop(self) -> None:
        self.procs.stop()


@contextmanager
def redis_namespace(tmp: Path) -> Iterator[tuple[str, str]]:
    """``(url, namespace)``: a Redis to use (see :func:`redis_url`) and a fresh key namespace,
    whose keys are unlinked afterwards (and any private server stopped)."""
    procs = Procs()
    url = redis_url(procs, tmp)
    ns = f"test-{uuid.uuid4().hex[:12]}"
    try:
        yield url, ns
    finally:
        raw = redis.Redis.from_url(url)
        try:
            for k in raw.scan_iter(match=f"{ns}:*", count=1000):
                raw.unlink(k)
        finally:
            raw.close()
            procs.stop()


class PrivateRedis:
    """A redis-server of one test alone: it may be flushed, paused (SIGSTOP) and resumed."""

    def __init__(self, tmp: Path) -> None:
        require_redis()
        self.procs = Procs()
        self.port = _free_port(set())
        self.procs.start(self.port, tmp / f"redis-{self.port}")
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def raw(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=5)

    def pause(self) -> None:
        self.procs.procs[self.port].send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.procs.procs[self.port].send_signal(signal.SIGCONT)
