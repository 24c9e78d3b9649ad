"""Shared fixtures: a small spec, KV tensors, a settable clock and a store factory."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from kvstore.config import StoreConfig
from kvstore.spec import ModelSpec
from kvstore.store import Store

torch.set_num_threads(1)
MASTER = bytes(range(32))


class FakeClock:
    """An injected clock: tests set time instead of sleeping."""

    def __init__(self, t: float = 1_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


def wait_until(cond: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Poll ``cond`` until it holds (True) or ``timeout`` seconds pass (False): for what
    another thread does (a reader applying a stream entry), never a sleep that assumes a speed."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


@pytest.fixture
def spec() -> ModelSpec:
    return ModelSpec(model="m", revision="r1", num_layers=2, num_kv_heads=2, head_dim=8,
                     dtype="float16", block_tokens=4)


def make_kv(spec: ModelSpec, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, *spec.block_shape), generator=g).to(spec.torch_dtype)


def tokens(n_blocks: int, spec: ModelSpec, start: int = 0) -> list[int]:
    return list(range(start, start + n_blocks * spec.block_tokens))


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def open_store(tmp_path: Path, clock: FakeClock) -> Iterator[Callable[..., Store]]:
    """``open_store(hbm_blocks=, dram_blocks=, nvme_blocks=, spec=, **config)``."""
    opened: list[Store] = []

    def _open(spec: ModelSpec, hbm_blocks: int = 4, dram_blocks: int = 4,
              nvme_blocks: int = 64, path: Path | None = None, **kw: object) -> Store:
        n = spec.block_nbytes
        cfg = StoreConfig(path=path or tmp_path / "store", hbm_bytes=hbm_blocks * n,
                          dram_bytes=dram_blocks * n, nvme_bytes=nvme_blocks * n,
                          master_key=MASTER, **kw)
        s = Store.open(cfg, clock=clock)
        opened.append(s)
        return s

    yield _open
    for s in opened:
        s.close()


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[object]:
    """A gRPC sidecar on port 0 in a temp dir (``service_harness.Sidecar``), stopped after."""
    from service_harness import start

    sc = start(tmp_path)
    yield sc
    sc.stop()


@pytest.fixture
def redis_ns(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """``(url, namespace)`` on a real Redis; the namespace's keys are removed afterwards."""
    from remote_harness import redis_namespace

    with redis_namespace(tmp_path) as pair:
        yield pair


os.environ.setdefault("KVSTORE_TEST", "1")


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[object]:
    """A redis-server of this test alone (``remote_harness.PrivateRedis``): pause/resume/raw."""
    from remote_harness import PrivateRedis

    r = PrivateRedis(tmp_path)
    try:
        yield r
    finally:
        r.resume()  # NOTE: never leave a stopped process behind
        r.procs.stop()


@pytest.fixture
def servers(tmp_path: Path, redis_ns: tuple[str, str]) -> Iterator[Callable[..., Store]]:
    """``servers(name, hbm=, remote={...}, **config)``: Stores of the small spec sharing one
    Redis namespace (write-through by default) and one FakeClock (``servers.clock``)."""
    from tiers.remote_config import RemoteConfig

    url, ns = redis_ns
    clock = FakeClock()
    n = ModelSpec(model="m", revision="r1", num_layers=2, num_kv_heads=2, head_dim=8,
                  dtype="float16", block_tokens=4).block_nbytes
    opened: list[Store] = []

    def _open(name: str, *, hbm: int = 16, remote: dict | None = None, **kw: object) -> Store:
        kw.setdefault("remote_write", "through")
        cfg = StoreConfig(path=tmp_path / name, hbm_bytes=hbm * n, dram_bytes=0, nvme_bytes=0,
                          master_key=MASTER,
                          remote=RemoteConfig(urls=[url], namespace=ns, **(remote or {})), **kw)
        s = Store.open(cfg, clock=clock)
        opened.append(s)
        return s

    _open.clock = clock  # type: ignore[attr-defined]
    _open.url, _open.ns = url, ns  # type: ignore[attr-defined]
    yield _open
    for s in opened:
        s.close()
