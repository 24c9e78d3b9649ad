"""The shared-memory client when its region is dropped, dropped without close(), or its
server hangs (each failed on the code before)."""

from __future__ import annotations

import gc
import threading
import time

import torch
from service_harness import SPEC, fresh_tokens, random_kv, start

from kvstore.client import FENCE_AFTER_ERROR_S, Client
from kvstore.errors import KVStoreError


def test_a_client_whose_region_was_dropped_goes_in_band_while_it_cannot_register(tmp_path):
    """B's registration drops A's idle region (one region per principal); while B keeps its
    region busy, A's re-registration is refused: every put and get of A failed with
    RESOURCE_EXHAUSTED, though the bytes could go in-band."""
    sc = start(tmp_path, limits={"max_regions_per_principal": 1, "region_idle_evict_s": 0.2})
    try:
        token = sc.admin().create_tenant("t")
        a = sc.client(token, local=True, region_bytes=8 << 20)
        keys = a.block_keys(SPEC, fresh_tokens(4))
        kv = random_kv(4)
        a.put(SPEC, keys, kv)
        time.sleep(0.3)  # A's region idle past region_idle_evict_s
        b = sc.client(token, local=True, region_bytes=8 << 20)
        assert b.uses_shared_memory  # A's region was dropped for it
        stop = threading.Event()

        def busy():  # B's region in use the whole time: A's cannot be taken back
            while not stop.is_set():
                b.get(SPEC, keys)
        worker = threading.Thread(target=busy)
        worker.start()
        try:
            for i in range(3):
                assert torch.equal(a.get(SPEC, keys), kv)
                more = a.block_keys(SPEC, fresh_tokens(2))
                a.put(SPEC, more, random_kv(2, seed=i))
                assert a.lookup(SPEC, more).num_blocks == 2
        finally:
            stop.set()
            worker.join()
        assert a._local is not None and a._local.region_id == 0  # unregistered: it went in-band
    finally:
        sc.stop()


def test_a_client_dropped_without_close_frees_its_region_on_the_server(tmp_path):
    """Its memfd was closed and unmapped client-side, but the process lived on: the server
    kept the region, and every page it had touched, until the process exited."""
    sc = start(tmp_path)
    try:
        token = sc.admin().create_tenant("t")
        c = Client(sc.target, token, local=True, region_bytes=8 << 20)
        assert c.uses_shared_memory
        c.put(SPEC, c.block_keys(SPEC, fresh_tokens(2)), random_kv(2))
        regions = sc.server.data.regions
        assert len(regions._regions) == 1
        del c
        gc.collect()
        assert regions.prune() == 1
        assert not regions._regions
    finally:
        sc.stop()


def test_a_hung_server_holds_a_shared_memory_call_about_its_timeout_not_twice(tmp_path, monkeypatch):
    """After DEADLINE_EXCEEDED the client waited a whole timeout more for the server's fence."""
    sc = start(tmp_path)
    try:
        token = sc.admin().create_tenant("t")
        c = sc.client(token, local=True, region_bytes=8 << 20, timeout=2.0)
        keys = c.block_keys(SPEC, fresh_tokens(2))
        kv = random_kv(2)
        c.put(SPEC, keys, kv)
        release = threading.Event()
        plane = sc.server.data

        def hang(*args, **kwargs):
            release.wait(30)
            raise KVStoreError("released")
        monkeypatch.setattr(plane, "get_local", hang)
        monkeypatch.setattr(plane.regions, "fence", lambda *a, **k: release.wait(30))
        began = time.monotonic()
        try:
            c.get(SPEC, keys)
        except KVStoreError as exc:
            assert exc.code == "DEADLINE_EXCEEDED"
        took = time.monotonic() - began
        release.set()
        assert took < 2.0 + FENCE_AFTER_ERROR_S + 0.75, f"{took:.2f} s for a 2 s timeout"
    finally:
        sc.stop()
