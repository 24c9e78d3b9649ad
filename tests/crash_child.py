"""Child process of the crash test: writes chains of blocks and acknowledges each put.

Usage: python crash_child.py PATH MODE START
Prints ``ack <i>`` (flushed) after put number i returned. MODE ``nvme`` stores straight to
NVMe (every put is committed when it returns); ``tiered`` uses small HBM/DRAM so blocks are
demoted to NVMe while the process is killed. MODE ``hot`` first reads the shared prefix (it
comes up into HBM), then puts: the prefix stays hot in HBM while each chain's own blocks are
demoted to NVMe under it (tests/test_nvme_closure15.py).
"""

import sys
from pathlib import Path

import torch

from kvstore.config import StoreConfig
from kvstore.spec import ModelSpec
from kvstore.store import Store

SPEC = ModelSpec(model="crash", revision="r", num_layers=2, num_kv_heads=2, head_dim=32,
                 dtype="bfloat16", block_tokens=8)
MASTER = bytes(range(32))
PREFIX_BLOCKS = 2


def chain(i: int) -> tuple[list[int], torch.Tensor]:
    """Chain i: a prefix shared by every chain, then 2 + i % 3 blocks of its own."""
    n_own = 2 + i % 3
    toks = list(range(PREFIX_BLOCKS * SPEC.block_tokens))
    toks += [100_000 + i * 1000 + j for j in range(n_own * SPEC.block_tokens)]
    g = torch.Generator().manual_seed(1234)
    prefix = torch.randn((PREFIX_BLOCKS, *SPEC.block_shape), generator=g)
    g = torch.Generator().manual_seed(i)
    own = torch.randn((n_own, *SPEC.block_shape), generator=g)
    return toks, torch.cat([prefix, own]).to(SPEC.torch_dtype)


def config(path: Path, mode: str) -> StoreConfig:
    n = SPEC.block_nbytes
    if mode == "nvme":
        # NOTE: room for every chain ten kills can write (about 2,300 chains of 3 blocks): the
        # test checks that every acknowledged chain survives, which holds only while nothing
        # is evicted. With 4,000 blocks it used to pass because the first eviction loop ran
        # past every kill (each victim re-ranked the whole tier); once that became fast,
        # evicted chains were (rightly) gone.
        return StoreConfig(path=path, hbm_bytes=0, dram_bytes=0, nvme_bytes=40_000 * n,
                           master_key=MASTER)
    if mode == "hot":
        # lru demotes every victim (the cost policy may drop a leaf not worth writing): each
        # chain older than what HBM and DRAM hold is on NVMe
        return StoreConfig(path=path, hbm_bytes=8 * n, dram_bytes=8 * n, nvme_bytes=4000 * n,
                           master_key=MASTER, persist_on_close=False, durable=True, policy="lru")
    return StoreConfig(path=path, hbm_bytes=6 * n, dram_bytes=6 * n, nvme_bytes=4000 * n,
                       master_key=MASTER, persist_on_close=False)


def main() -> None:
    path, mode, start = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    store = Store.open(config(path, mode))
    if mode == "hot":  # an engine reading its system prompt from the cache brings it up
        toks, _ = chain(0)
        store.get("t", SPEC, store.block_keys("t", SPEC, toks[: PREFIX_BLOCKS * SPEC.block_tokens]))
    print("ready", flush=True)
    i = start
    while True:
        toks, kv = chain(i)
        store.put("t", SPEC, store.block_keys("t", SPEC, toks), kv)
        print(f"ack {i}", flush=True)
        i += 1


if __name__ == "__main__":
    main()
