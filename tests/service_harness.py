"""Shared helpers of the tests/test_service_*.py files (imported as ``service_harness``): a sidecar on port 0 in a temp dir."""

from __future__ import annotations

import itertools
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvstore import server_config
from kvstore.admin_client import AdminClient
from kvstore.client import Client
from kvstore.server import SidecarServer, bootstrap, create_server, serve
from kvstore.spec import ModelSpec

SPEC = ModelSpec(model="test/model", revision="r1", num_layers=2, num_kv_heads=2, head_dim=16, block_tokens=16)
_TOKENS = itertools.count(1)


@dataclass
class FakeClock:
    now: float = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Sidecar:
    server: SidecarServer
    port: int
    target: str
    admin_token: str
    clock: FakeClock
    data_dir: Path
    overrides: dict[str, Any]
    clients: list[Any] = field(default_factory=list)

    def admin(self) -> AdminClient:
        c = AdminClient(self.target, self.admin_token)
        self.clients.append(c)
        return c

    def client(self, token: str, **kw: Any) -> Client:
        c = Client(self.target, token, **kw)
        self.clients.append(c)
        return c

    def tenant(self, name: str, **kw: Any) -> Client:
        return self.client(self.admin().create_tenant(name), **kw)

    def stop(self) -> None:
        for c in self.clients:
            c.close()
        self.clients.clear()
        self.server.stop(0)


def config(data_dir: Path, **overrides: Any) -> server_config.ServerConfig:
    data: dict[str, Any] = {
        "listen": "127.0.0.1:0",
        "metrics": {"enabled": False},
        "expire_interval_s": 0,
        "audit_fsync": False,
        "store": {"hbm_bytes": 32 << 20, "dram_bytes": 32 << 20, "nvme_bytes": 256 << 20, "durable": False},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return server_config.build(data, data_dir=data_dir)


def start(data_dir: Path, clock: FakeClock | None = None, admin_token: str | None = None,
          **overrides: Any) -> Sidecar:
    clock = clock or FakeClock()
    cfg = config(data_dir, **overrides)
    token = bootstrap(cfg, clock=clock) or admin_token
    assert token is not None, "restarting a sidecar needs the admin token of the first start"
    server, port = create_server(cfg, clock=clock)
    server.start()
    return Sidecar(server, port, f"127.0.0.1:{port}", token, clock, data_dir, overrides)


def restart(sc: Sidecar) -> Sidecar:
    sc.stop()
    return start(sc.data_dir, sc.clock, sc.admin_token, **sc.overrides)


def fresh_tokens(n_blocks: int, spec: ModelSpec = SPEC, tail: int = 3) -> list[int]:
    """Token ids no other test uses (so keys never collide), plus a partial tail block."""
    base = next(_TOKENS) * 1_000_000
    return list(range(base, base + n_blocks * spec.block_tokens + tail))


def random_kv(n: int, spec: ModelSpec = SPEC, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, *spec.block_shape), generator=g).to(spec.torch_dtype)


class HeldPut:
    """``client.put(spec, keys, kv)`` in a thread, held on the server after it reserved its
    blocks (authenticated, before the commit) until :meth:`finish`: the test changes something
    meanwhile (rotates the token, deletes the tenant). Patches ``DataPlane.reserve_put`` through
    ``monkeypatch``; ``real`` is the unpatched method."""

    def __init__(self, monkeypatch: Any, client: Client, spec: ModelSpec, keys: Any,
                 kv: torch.Tensor, wait: float = 10.0) -> None:
        import threading

        from kvstore import service_data

        self.wait = wait
        self.go = threading.Event()
        reserved = threading.Event()
        self.real = real = service_data.DataPlane.reserve_put

        def reserve_then_wait(plane: Any, *args: Any) -> Any:
            res = real(plane, *args)
            reserved.set()
            assert self.go.wait(wait)
            return res

        monkeypatch.setattr(service_data.DataPlane, "reserve_put", reserve_then_wait)
        self.outcome: list[BaseException | None] = []

        def put() -> None:
            try:
                client.put(spec, keys, kv)
                self.outcome.append(None)
            except BaseException as exc:  # noqa: BLE001 - recorded for the assertion
                self.outcome.append(exc)

        self.thread = threading.Thread(target=put)
        self.thread.start()
        assert reserved.wait(wait)

    def finish(self) -> BaseException | None:
        """Let the put go on; what it raised (None: it returned)."""
        self.go.set()
        self.thread.join(self.wait)
        return self.outcome[0]


def serve_once(data_dir: Path) -> list[str]:
    """One start of ``kvstore serve`` (its ``serve``) in this process, stopped once ready (its
    own SIGINT handler is in place then); the lines it printed."""
    lines: list[str] = []

    def echo(line: str) -> None:
        lines.append(line)
        if line.startswith("ready"):
            os.kill(os.getpid(), signal.SIGINT)
    serve(config(data_dir), echo=echo)
    return lines
