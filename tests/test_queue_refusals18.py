"""Calls refused past ``workers + limits.max_queued_calls`` are counted.

grpc's ``maximum_concurrent_rpcs`` refused them before any kvstore code ran: the client got
RESOURCE_EXHAUSTED naming ``limits.max_queued_calls``, but neither
``kvstore_limit_rejections_total`` nor ``kvstore_requests_total`` moved, so an operator saw no
sign of a server turning calls away. The bound is now kvstore's (``QueueBound``), grpc's a
backstop above it; the refusal reads as before.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from service_harness import start

from kvstore.errors import ResourceExhausted
from proto.kvstore.v1 import kvstore_pb2 as pb

WAIT = 20.0  # a bound on waiting for a state, never a timing claim
REJECTIONS = "kvstore_limit_rejections_total"
QUEUE = {"resource": "limits.max_queued_calls"}


def _wait_for(predicate, timeout: float = WAIT) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()


def _stalled(release: threading.Event):
    """A Put stream that sends nothing until ``release``: it holds a worker."""
    release.wait(WAIT)
    yield from ()


@pytest.fixture
def busy(tmp_path):
    """A sidecar of 2 workers and no queue, both workers held by a stalled Put of its own
    tenant; yields (sidecar, a third tenant's token, the release of the two Puts)."""
    sc = start(tmp_path, workers=2, limits={"admin_workers": 0, "max_queued_calls": 0,
                                            "max_calls_per_principal": 1, "max_streams_per_principal": 1,
                                            "stream_idle_s": WAIT})
    release = threading.Event()
    try:
        admin = sc.admin()
        tokens = [admin.create_tenant(name) for name in ("a", "b", "c")]
        held = []
        for name, token in zip("ab", tokens, strict=False):
            channel = grpc.insecure_channel(sc.target)
            sc.clients.append(channel)
            put = channel.stream_unary("/kvstore.v1.KVStore/Put", request_serializer=None,
                                       response_deserializer=pb.PutResponse.FromString)
            held.append(put.future(_stalled(release), metadata=(("authorization", f"Bearer {token}"),),
                                   timeout=WAIT))
            assert _wait_for(lambda name=name: sc.server.rpc.limiter.running(name) == (1, 1))
        yield sc, tokens[2], release
    finally:
        release.set()
        sc.stop()


def test_calls_refused_past_the_workers_and_queue_are_counted(busy):
    sc, token, release = busy
    registry = sc.server.metrics_registry
    c = sc.client(token, local=False)
    for _ in range(3):
        with pytest.raises(ResourceExhausted) as err:
            c.whoami()
        assert err.value.resource == "limits.max_queued_calls"  # as grpc's own refusal read
        assert "max_queued_calls" in str(err.value)
    assert registry.get_sample_value(REJECTIONS, QUEUE) == 3  # it was None: never counted
    assert registry.get_sample_value("kvstore_requests_total",
                                     {"rpc": "WhoAmI", "code": "RESOURCE_EXHAUSTED"}) == 3
    with pytest.raises(ResourceExhausted):
        sc.admin().list_tenants()  # the admin's calls too: the bound is on calls at once
    assert registry.get_sample_value("kvstore_requests_total",
                                     {"rpc": "Admin.ListTenants", "code": "RESOURCE_EXHAUSTED"}) == 1

    release.set()  # the two Puts end: their workers are free again
    assert _wait_for(lambda: sc.server.rpc.limiter.running("a") == (0, 0)
                     and sc.server.rpc.limiter.running("b") == (0, 0))
    refused = 0

    def served() -> bool:
        nonlocal refused
        try:
            return c.whoami() is not None
        except ResourceExhausted:  # a Put's worker not handed back yet
            refused += 1
            return False

    assert _wait_for(served)
    assert registry.get_sample_value(REJECTIONS, QUEUE) == 4 + refused  # each refusal seen, no other


def test_a_refused_health_check_counts_as_a_rejection_only(busy):
    """Health checks and reflection are not kvstore's RPCs (no request series), but their
    refusal is one of the limit's."""
    sc, _, _ = busy
    channel = grpc.insecure_channel(sc.target)
    sc.clients.append(channel)
    with pytest.raises(grpc.RpcError) as err:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=WAIT)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.value.details() == "Concurrent RPC limit exceeded!"
    registry = sc.server.metrics_registry
    assert registry.get_sample_value(REJECTIONS, QUEUE) == 1
    text = "\n".join(f"{m.name} {s.labels}" for m in registry.collect() for s in m.samples)
    assert "Health" not in text
