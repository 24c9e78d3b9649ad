"""The checked-in stubs match the .proto files; health checking and reflection are served."""

from __future__ import annotations

import re
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto.kvstore.v1 import generate

pytest.importorskip("grpc_tools")

# version stamps differ between grpcio-tools releases without changing the API
_VERSION_LINE = re.compile(r"(Protobuf Python Version|GRPC_GENERATED_VERSION|_runtime_version\.Domain|^\s+\d+,$)")


def _normalised(path: Path) -> list[str]:
    return [ln for ln in path.read_text().splitlines() if not _VERSION_LINE.search(ln)]


def test_checked_in_stubs_are_not_stale(tmp_path):
    fresh = generate.generate(tmp_path)
    assert len(fresh) == 6
    for rel, new in zip(generate.GENERATED, fresh):
        old = generate.REPO_ROOT / rel
        assert old.exists(), f"{rel} is missing: run python -m proto.kvstore.v1.generate"
        assert _normalised(old) == _normalised(new), f"{rel} is stale: run python -m proto.kvstore.v1.generate"


def test_stubs_import_under_proto_package():
    from proto.kvstore.v1 import admin_pb2_grpc, kvstore_pb2

    assert kvstore_pb2.DESCRIPTOR.package == "kvstore.v1"
    assert hasattr(admin_pb2_grpc, "AdminStub")


def test_health_reports_serving_for_each_service(sidecar):
    with grpc.insecure_channel(sidecar.target) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for name in ("", "kvstore.v1.KVStore", "kvstore.v1.Admin"):
            resp = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_the_services(sidecar):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(sidecar.target) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                              timeout=5)
        names = {s.name for r in responses for s in r.list_services_response.service}
    assert {"kvstore.v1.KVStore", "kvstore.v1.Admin", "grpc.health.v1.Health"} <= names
