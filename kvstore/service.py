"""The ``kvstore.v1`` service, assembled from small modules with one job each.

Layers, outermost first:

* servicers (thin: decode, call one plain function, encode) —
  :mod:`kvstore.servicer_kv` (``KVStore``) and :mod:`kvstore.servicer_admin` (``Admin``);
* :mod:`kvstore.service_rpc` — authentication, error mapping (through :mod:`kvstore.status`,
  the one place that maps typed errors to status codes), latency, auditing, and handler
  registration with per-method codecs;
* :mod:`kvstore.service_convert` — request validation and protobuf <-> Python conversion;
* :mod:`kvstore.service_data` / :mod:`kvstore.service_admin` — the data and admin planes on
  Python values, testable without gRPC; :mod:`kvstore.service_streams` — the in-band Put/Get
  streams over :mod:`kvstore.frames`; :mod:`kvstore.service_resources` — per-call budgets,
  shared-memory regions and staging buffers.

:func:`add_services` registers both servicers on a grpc server.
"""

from __future__ import annotations

import grpc

from kvstore.service_admin import AdminPlane
from kvstore.service_data import DataPlane
from kvstore.service_rpc import RpcRunner, add_service
from kvstore.servicer_admin import AdminServicer
from kvstore.servicer_kv import KVStoreServicer, add_kvstore_servicer
from proto.kvstore.v1 import admin_pb2

__all__ = ["AdminPlane", "AdminServicer", "DataPlane", "KVStoreServicer", "RpcRunner", "add_services"]


def add_services(server: grpc.Server, data: DataPlane, admin: AdminPlane, rpc: RpcRunner) -> None:
    """Register the KVStore (with its frame codecs for Put/Get) and Admin servicers."""
    add_kvstore_servicer(KVStoreServicer(data, rpc), server)
    # NOTE: the generated add_AdminServicer_to_server parsed with FromString: a request that
    # did not parse answered INTERNAL, before authentication (see service_rpc.parser)
    add_service(server, admin_pb2.DESCRIPTOR.services_by_name["Admin"], AdminServicer(admin, rpc),
                prefix="Admin.", admin_only=True)
