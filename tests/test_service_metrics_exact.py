"""The sidecar's metrics and Stats agree with what happened.

Before:

* a Get stream's outcome was recorded once its header existed: its latency left out sending
  the data, a stream that failed part-way (its principal deleted meanwhile) or that the client
  cancelled counted as OK, and ``kvstore_bytes_out`` counted every leased byte, sent or not
  (GetLocal too: a copy that failed counted its bytes);
* ``kvstore_saved_prefill_tokens`` counted every Lookup's hits, so a client that looks up
  before it saves (HF ``PrefixCache.save``) or once per rank reported the tokens it reused twice;
* quota rejections disagreed between Stats (``counters.quota_rejections``) and
  ``kvstore_limit_rejections``: a put that could never fit its quota was labelled
  ``quota:TENANT:TIER`` but not counted, a session put over its HBM quota was counted but
  labelled ``hbm`` (a capacity refusal's label, which deleting the tenant left behind), and a
  quota lowered under pinned blocks counted a rejection of nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
import torch
from conftest import make_kv, tokens, wait_until
from service_harness import SPEC, Sidecar, fresh_tokens, random_kv

from kvstore import service_rpc, service_streams, servicer_kv
from kvstore.client import spec_to_pb
from kvstore.errors import ResourceExhausted
from kvstore.service_data import DataPlane
from proto.kvstore.v1 import kvstore_pb2 as pb
from proto.kvstore.v1 import kvstore_pb2_grpc

torch.set_num_threads(1)
N = 6  # blocks of a Get stream: one frame each (pack_blocks=False, SPEC blocks < a chunk)
NB = SPEC.block_nbytes
WAIT = 20.0  # seconds any event may take before the test gives up (never a timing assertion)


def _metric(sc: Sidecar, name: str, **labels: str) -> float:
    return sc.server.metrics_registry.get_sample_value(name, labels) or 0.0


def _gets(sc: Sidecar, code: str) -> float:
    return _metric(sc, "kvstore_requests_total", rpc="Get", code=code)


def _quota_rejections(stats: dict[str, Any]) -> int:
    return stats["counters"].get("quota_rejections", 0)


class _Stream:
    """A raw Get stream of ``N`` stored blocks of a new tenant, one block per frame, whose
    server holds before producing data frame ``hold_at`` until :attr:`go` is set
    (:attr:`held` is set meanwhile); ``at_hold`` runs on the server as it holds."""

    def __init__(self, sc: Sidecar, monkeypatch: pytest.MonkeyPatch, name: str, hold_at: int,
                 at_hold: Callable[[], None] = lambda: None) -> None:
        self.held, self.go = threading.Event(), threading.Event()
        token = sc.admin().create_tenant(name)
        c = sc.client(token, local=False)
        keys = c.block_keys(SPEC, fresh_tokens(N))
        c.put(SPEC, keys, random_kv(N))
        real = service_streams.block_frames

        def held_frames(*args: Any, **kw: Any) -> Iterator[bytes]:
            for i, frame in enumerate(real(*args, **kw)):
                if i == hold_at:
                    at_hold()
                    self.held.set()
                    assert self.go.wait(WAIT)
                yield frame

        monkeypatch.setattr(service_streams, "block_frames", held_frames)
        self.channel = grpc.insecure_channel(sc.target)
        target = pb.Target(spec=spec_to_pb(SPEC), keys=b"".join(keys))
        self.calls = kvstore_pb2_grpc.KVStoreStub(self.channel).Get(
            pb.GetRequest(target=target, pack_blocks=False), metadata=(("authorization", f"Bearer {token}"),),
            timeout=WAIT)

    def close(self) -> None:
        self.go.set()
        self.channel.close()


@pytest.fixture
def streams(sidecar: Sidecar, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., _Stream]]:
    opened: list[_Stream] = []

    def _open(name: str, hold_at: int, at_hold: Callable[[], None] = lambda: None) -> _Stream:
        opened.append(_Stream(sidecar, monkeypatch, name, hold_at, at_hold))
        return opened[-1]

    yield _open
    for s in opened:
        s.close()


# -- M2: the Get stream ------------------------------------------------------------------------------


def test_a_get_streams_latency_covers_sending_its_data(sidecar, streams, monkeypatch):
    now = [0.0]
    clock = SimpleNamespace(perf_counter=lambda: now[0])
    monkeypatch.setattr(service_rpc, "time", clock)
    monkeypatch.setattr(servicer_kv, "time", clock, raising=False)

    def later() -> None:
        now[0] += 100.0  # as the data is sent: after the header was built

    s = streams("slow", hold_at=1, at_hold=later)
    s.go.set()
    frames = list(s.calls)
    assert frames[0].header.num_blocks == N and sum(len(f.data) for f in frames[1:]) == N * NB
    assert wait_until(lambda: _metric(sidecar, "kvstore_request_latency_seconds_count", rpc="Get") == 1)
    assert _metric(sidecar, "kvstore_request_latency_seconds_sum", rpc="Get") == 100.0  # it was 0
    assert _gets(sidecar, "OK") == 1
    assert _metric(sidecar, "kvstore_bytes_out_total", plane="stream") == N * NB
    assert _metric(sidecar, "kvstore_saved_prefill_tokens_total", tenant="slow") == N * SPEC.block_tokens


def test_a_get_stream_that_fails_part_way_counts_its_status_and_only_the_bytes_sent(sidecar, streams):
    s = streams("gone", hold_at=2)
    got = [next(s.calls), next(s.calls), next(s.calls)]  # the header and two data frames
    assert got[0].header.num_blocks == N and all(len(f.data) == NB for f in got[1:])
    assert s.held.wait(WAIT)
    sidecar.admin().delete_tenant("gone")  # the principal is deleted while its stream runs
    s.go.set()
    with pytest.raises(grpc.RpcError) as err:
        list(s.calls)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, err.value.details()
    assert wait_until(lambda: _gets(sidecar, "UNAUTHENTICATED") == 1)
    assert _gets(sidecar, "OK") == 0  # it was counted OK
    assert _metric(sidecar, "kvstore_request_latency_seconds_count", rpc="Get") == 1  # once
    assert _metric(sidecar, "kvstore_bytes_out_total", plane="stream") == 2 * NB  # not N * NB


def test_a_get_stream_the_client_cancels_counts_cancelled_and_not_the_frame_left_unsent(
        sidecar, streams, monkeypatch):
    contexts: list[grpc.ServicerContext] = []
    real = service_rpc.RpcRunner.principal

    def principal(self: service_rpc.RpcRunner, context: grpc.ServicerContext) -> Any:
        contexts.append(context)
        return real(self, context)

    monkeypatch.setattr(service_rpc.RpcRunner, "principal", principal)
    s = streams("quitter", hold_at=1)
    got = [next(s.calls), next(s.calls)]  # the header and one data frame
    assert len(got[1].data) == NB
    assert s.held.wait(WAIT)
    s.calls.cancel()
    assert wait_until(lambda: not contexts[-1].is_active())  # the server knows before it sends on
    s.go.set()
    assert wait_until(lambda: _gets(sidecar, "CANCELLED") == 1)
    assert _gets(sidecar, "OK") == 0
    assert _metric(sidecar, "kvstore_request_latency_seconds_count", rpc="Get") == 1
    assert _metric(sidecar, "kvstore_bytes_out_total", plane="stream") == NB
    assert _metric(sidecar, "kvstore_saved_prefill_tokens_total", tenant="quitter") == 0


def test_a_get_local_whose_copy_fails_counts_nothing_served(sidecar, monkeypatch):
    c = sidecar.tenant("copyfail", local=True)
    assert c.uses_shared_memory
    keys = c.block_keys(SPEC, fresh_tokens(3))
    c.put(SPEC, keys, random_kv(3))

    def broken(self: DataPlane, pairs: Any) -> None:
        raise OSError("the region could not be written")

    monkeypatch.setattr(DataPlane, "_copy", broken)
    with pytest.raises(Exception):  # noqa: B017 - whatever the client makes of INTERNAL
        c.get(SPEC, keys)
    assert _metric(sidecar, "kvstore_requests_total", rpc="GetLocal", code="INTERNAL") == 1
    assert _metric(sidecar, "kvstore_bytes_out_total", plane="shm") == 0  # it was 3 * NB
    assert _metric(sidecar, "kvstore_saved_prefill_tokens_total", tenant="copyfail") == 0
    monkeypatch.undo()
    assert c.get(SPEC, keys).shape[0] == 3
    assert _metric(sidecar, "kvstore_bytes_out_total", plane="shm") == 3 * NB


# -- M3: saved prefill tokens --------------------------------------------------------------------------


@pytest.mark.parametrize("local", [False, True])
def test_saved_prefill_tokens_count_the_blocks_served_not_the_lookups(sidecar, local):
    c = sidecar.tenant("saver", local=local)
    keys = c.block_keys(SPEC, fresh_tokens(4))
    c.put(SPEC, keys[:3], random_kv(3))
    for _ in range(3):  # a client asks before it saves, once per rank, at every step...
        assert c.lookup(SPEC, keys).num_blocks == 3
    assert _metric(sidecar, "kvstore_lookup_hit_blocks_total", tenant="saver") == 9
    assert _metric(sidecar, "kvstore_lookup_miss_blocks_total", tenant="saver") == 3
    assert _metric(sidecar, "kvstore_saved_prefill_tokens_total", tenant="saver") == 0  # it was 144
    assert c.get(SPEC, keys).shape[0] == 3  # the prefix served: 3 blocks
    assert _metric(sidecar, "kvstore_saved_prefill_tokens_total", tenant="saver") == 3 * SPEC.block_tokens
    plane = "shm" if local else "stream"
    assert _metric(sidecar, "kvstore_bytes_out_total", plane=plane) == 3 * NB


def test_the_hf_prefix_cache_reports_the_tokens_it_reused(sidecar):
    from kvstore.integrations.hf import PrefixCache, cache_from_blocks

    pc = PrefixCache(sidecar.tenant("hf"), SPEC)
    base = fresh_tokens(6, tail=0)
    turn1 = base[: 4 * SPEC.block_tokens + 3]
    reused = pc.restore(turn1).num_tokens
    pc.save(turn1, cache_from_blocks(random_kv(4), SPEC))
    turn2 = base + [7, 8, 9]  # its first 4 blocks were stored by turn 1
    reused += pc.restore(turn2).num_tokens
    pc.save(turn2, cache_from_blocks(random_kv(6), SPEC))
    assert reused == 4 * SPEC.block_tokens
    assert _metric(sidecar, "kvstore_saved_prefill_tokens_total", tenant="hf") == reused  # it was 2x


# -- M5: quota rejections ---------------------------------------------------------------------------


def test_a_put_that_can_never_fit_its_quota_is_counted_once(open_store, spec):
    s = open_store(spec, hbm_blocks=4, dram_blocks=4, nvme_blocks=8)
    s.set_tenant_policy("a", quota_bytes={"hbm": spec.block_nbytes, "dram": spec.block_nbytes,
                                          "nvme": spec.block_nbytes})
    with pytest.raises(ResourceExhausted, match="can never fit") as err:
        s.put("a", spec, s.block_keys("a", spec, tokens(4, spec)), make_kv(spec, 4))
    assert err.value.resource == "quota:a:hbm"
    assert _quota_rejections(s.stats()) == 1  # it was 0


def test_a_refusal_for_capacity_keeps_the_tiers_label_and_is_no_quota_rejection(open_store, spec):
    s = open_store(spec, hbm_blocks=2, dram_blocks=2, nvme_blocks=4)
    big = 100 * spec.block_nbytes  # quotas the store's capacity never lets it reach
    s.set_tenant_policy("a", quota_bytes={"hbm": big, "dram": big, "nvme": big})
    with pytest.raises(ResourceExhausted, match="can never fit.*give the store more room") as err:
        s.put("a", spec, s.block_keys("a", spec, tokens(9, spec)), make_kv(spec, 9))
    assert err.value.resource == "hbm"  # it was "quota:a:hbm"
    assert _quota_rejections(s.stats()) == 0
    # no quota on one tier it may use, the others' quota binding: the quota refuses it
    s.set_tenant_policy("b", quota_bytes={"hbm": spec.block_nbytes, "dram": spec.block_nbytes})
    with pytest.raises(ResourceExhausted, match="raise its quota") as err:
        s.put("b", spec, s.block_keys("b", spec, tokens(7, spec, start=100)), make_kv(spec, 7))
    assert err.value.resource == "quota:b:hbm"
    assert _quota_rejections(s.stats()) == 1


def test_a_session_put_over_its_hbm_quota_is_a_quota_rejection_and_a_lowered_quota_is_none(open_store, spec):
    s = open_store(spec, hbm_blocks=6, dram_blocks=4, nvme_blocks=8)
    s.set_tenant_policy("a", quota_bytes={"hbm": 2 * spec.block_nbytes})
    s.open_session("a", "chat")
    keys = s.block_keys("a", spec, tokens(3, spec))
    s.put("a", spec, keys[:2], make_kv(spec, 2), session="chat")
    with pytest.raises(ResourceExhausted, match="no room") as err:
        s.put("a", spec, keys[2:], make_kv(spec, 1), parent=keys[1], session="chat")
    assert err.value.resource == "quota:a:hbm"  # it was "hbm"
    assert _quota_rejections(s.stats()) == 1
    s.set_tenant_policy("a", quota_bytes={"hbm": spec.block_nbytes})  # under its pinned blocks
    assert _quota_rejections(s.stats()) == 1  # it counted one more
    # another tenant's pinned blocks fill HBM: a capacity refusal, whatever a's quota
    s.set_tenant_policy("a", quota_bytes={"hbm": 6 * spec.block_nbytes})
    s.open_session("b", "chat")
    s.put("b", spec, s.block_keys("b", spec, tokens(4, spec, start=100)), make_kv(spec, 4), session="chat")
    with pytest.raises(ResourceExhausted, match="no room") as err:
        s.put("a", spec, keys[2:], make_kv(spec, 1), parent=keys[1], session="chat")
    assert err.value.resource == "hbm"
    assert _quota_rejections(s.stats()) == 1


def test_stats_and_the_metric_count_the_same_quota_rejections(sidecar):
    admin = sidecar.admin()
    a = sidecar.tenant("alice", local=False)
    admin.set_policy("alice", quota_bytes={"hbm": 2 * NB})
    a.open_session("s1")
    keys = a.block_keys(SPEC, fresh_tokens(3))
    a.put(SPEC, keys[:2], random_kv(2), session="s1")
    before = _quota_rejections(admin.stats())
    with pytest.raises(ResourceExhausted):  # in-band: reserved, then refused at its commit
        a.put(SPEC, keys[2:], random_kv(1), parent=keys[1], session="s1")
    with pytest.raises(ResourceExhausted):  # can never fit: refused up front
        a.put(SPEC, a.block_keys(SPEC, fresh_tokens(3)), random_kv(3), session="s1")
    admin.set_policy("alice", quota_bytes={"hbm": NB})  # under its pinned blocks: refuses nothing
    assert _quota_rejections(admin.stats()) - before == 2
    assert _metric(sidecar, "kvstore_limit_rejections_total", resource="quota:alice:hbm") == 2
    assert _metric(sidecar, "kvstore_limit_rejections_total", resource="hbm") == 0
    admin.delete_tenant("alice")  # its series go with it
    assert _metric(sidecar, "kvstore_limit_rejections_total", resource="quota:alice:hbm") == 0
