"""Refusals past ``workers + limits.max_queued_calls`` are counted when they are decided, and the
Admin service and health checks keep ``admin_workers`` of headroom above that bound.

Counted when the refusal was sent (on a thread of its own), a burst of refusals waiting for that
thread passed grpc's own bound, which refused the rest uncounted (300 refused, 277 counted); and
one tenant's flood, each call about to be refused by the per-principal limits, filled the queue
so that health checks and admin calls were refused with it (39 of 179 health checks served)."""

from __future__ import annotations

import types

import grpc
from test_queue_refusals18 import QUEUE, REJECTIONS, busy  # noqa: F401 - busy is a fixture

from kvstore.service_limits import QueueBound
from proto.kvstore.v1 import kvstore_pb2 as pb


def test_every_refusal_of_a_burst_is_counted(busy):  # noqa: F811 - the fixture
    sc, token, _ = busy
    channel = grpc.insecure_channel(sc.target)
    sc.clients.append(channel)
    whoami = channel.unary_unary("/kvstore.v1.KVStore/WhoAmI", request_serializer=pb.WhoAmIRequest.SerializeToString,
                                 response_deserializer=pb.WhoAmIResponse.FromString)
    md = (("authorization", f"Bearer {token}"),)
    futures = [whoami.future(pb.WhoAmIRequest(), metadata=md, timeout=30) for _ in range(300)]
    refused = 0
    for f in futures:  # NOTE: kept until here: a dropped future cancels its call
        try:
            f.result()
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert err.details() == "Concurrent RPC limit exceeded!"
            refused += 1
    assert refused == 300  # both workers held: no call served
    registry = sc.server.metrics_registry
    assert registry.get_sample_value(REJECTIONS, QUEUE) == refused  # was 277 of 300
    assert registry.get_sample_value("kvstore_requests_total", {"rpc": "WhoAmI", "code": "RESOURCE_EXHAUSTED"}) == refused


class _Queue:
    bound, held = 2, 2


def test_admin_and_health_calls_have_the_admin_workers_headroom():
    counted: list[str] = []
    queue = _Queue()
    bound = QueueBound(queue, counted.append, lambda context: None, reserved=1)
    served = object()

    def asked(method: str) -> bool:
        return bound.intercept_service(lambda details: served, types.SimpleNamespace(method=method)) is served

    tenant, admin, health = "/kvstore.v1.KVStore/WhoAmI", "/kvstore.v1.Admin/ListTenants", "/grpc.health.v1.Health/Check"
    assert not asked(tenant) and counted == [tenant]  # at the bound: refused, and counted at once
    assert asked(admin) and asked(health)  # within admin_workers above it
    assert not asked("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo")
    queue.held = 3
    assert not asked(admin) and not asked(health)
    assert counted == [tenant, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", admin, health]
    queue.held = 1
    assert asked(tenant)
