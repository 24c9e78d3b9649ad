from proto.kvstore.v1 import kvstore_pb2 as _kvstore_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_TENANT: _ClassVar[Role]
    ROLE_PUBLISHER: _ClassVar[Role]
    ROLE_ADMIN: _ClassVar[Role]
ROLE_UNSPECIFIED: Role
ROLE_TENANT: Role
ROLE_PUBLISHER: Role
ROLE_ADMIN: Role

class TenantInfo(_message.Message):
    __slots__ = ("name", "role", "namespaces", "created", "deleting")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    DELETING_FIELD_NUMBER: _ClassVar[int]
    name: str
    role: Role
    namespaces: _containers.RepeatedScalarFieldContainer[str]
    created: float
    deleting: bool
    def __init__(self, name: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., namespaces: _Optional[_Iterable[str]] = ..., created: _Optional[float] = ..., deleting: _Optional[bool] = ...) -> None: ...

class CreateTenantRequest(_message.Message):
    __slots__ = ("name", "role", "namespaces")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    name: str
    role: Role
    namespaces: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., namespaces: _Optional[_Iterable[str]] = ...) -> None: ...

class TenantToken(_message.Message):
    __slots__ = ("name", "token")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    name: str
    token: str
    def __init__(self, name: _Optional[str] = ..., token: _Optional[str] = ...) -> None: ...

class TenantName(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DeleteTenantResponse(_message.Message):
    __slots__ = ("blocks",)
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    blocks: int
    def __init__(self, blocks: _Optional[int] = ...) -> None: ...

class ListTenantsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListTenantsResponse(_message.Message):
    __slots__ = ("tenants",)
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    tenants: _containers.RepeatedCompositeFieldContainer[TenantInfo]
    def __init__(self, tenants: _Optional[_Iterable[_Union[TenantInfo, _Mapping]]] = ...) -> None: ...

class GrantRequest(_message.Message):
    __slots__ = ("tenant", "namespace", "revoke")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    REVOKE_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    namespace: str
    revoke: bool
    def __init__(self, tenant: _Optional[str] = ..., namespace: _Optional[str] = ..., revoke: _Optional[bool] = ...) -> None: ...

class TenantPolicy(_message.Message):
    __slots__ = ("tenant", "ttl_s", "quota_bytes", "priority")
    class QuotaBytesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    QUOTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    ttl_s: float
    quota_bytes: _containers.ScalarMap[str, int]
    priority: int
    def __init__(self, tenant: _Optional[str] = ..., ttl_s: _Optional[float] = ..., quota_bytes: _Optional[_Mapping[str, int]] = ..., priority: _Optional[int] = ...) -> None: ...

class PurgeModelRequest(_message.Message):
    __slots__ = ("fingerprint", "spec")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    fingerprint: bytes
    spec: _kvstore_pb2.ModelSpec
    def __init__(self, fingerprint: _Optional[bytes] = ..., spec: _Optional[_Union[_kvstore_pb2.ModelSpec, _Mapping]] = ...) -> None: ...

class PurgeModelResponse(_message.Message):
    __slots__ = ("blocks",)
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    blocks: int
    def __init__(self, blocks: _Optional[int] = ...) -> None: ...

class ReadAuditRequest(_message.Message):
    __slots__ = ("since_seq", "limit", "max_bytes")
    SINCE_SEQ_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    since_seq: int
    limit: int
    max_bytes: int
    def __init__(self, since_seq: _Optional[int] = ..., limit: _Optional[int] = ..., max_bytes: _Optional[int] = ...) -> None: ...

class AuditEntry(_message.Message):
    __slots__ = ("seq", "time", "principal", "action", "target", "result", "detail", "ref")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    PRINCIPAL_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    REF_FIELD_NUMBER: _ClassVar[int]
    seq: int
    time: float
    principal: str
    action: str
    target: str
    result: str
    detail: str
    ref: int
    def __init__(self, seq: _Optional[int] = ..., time: _Optional[float] = ..., principal: _Optional[str] = ..., action: _Optional[str] = ..., target: _Optional[str] = ..., result: _Optional[str] = ..., detail: _Optional[str] = ..., ref: _Optional[int] = ...) -> None: ...

class ReadAuditResponse(_message.Message):
    __slots__ = ("entries", "more")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[AuditEntry]
    more: bool
    def __init__(self, entries: _Optional[_Iterable[_Union[AuditEntry, _Mapping]]] = ..., more: _Optional[bool] = ...) -> None: ...

class ListSessionsRequest(_message.Message):
    __slots__ = ("tenant", "after_tenant", "after_session_id", "max_bytes")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    AFTER_TENANT_FIELD_NUMBER: _ClassVar[int]
    AFTER_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    after_tenant: str
    after_session_id: str
    max_bytes: int
    def __init__(self, tenant: _Optional[str] = ..., after_tenant: _Optional[str] = ..., after_session_id: _Optional[str] = ..., max_bytes: _Optional[int] = ...) -> None: ...

class SessionInfo(_message.Message):
    __slots__ = ("tenant", "session_id", "state", "blocks", "bytes", "pinned_blocks", "pinned_bytes", "idle_s", "only_pinned_blocks", "only_pinned_bytes")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PINNED_BYTES_FIELD_NUMBER: _ClassVar[int]
    IDLE_S_FIELD_NUMBER: _ClassVar[int]
    ONLY_PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ONLY_PINNED_BYTES_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    session_id: str
    state: _kvstore_pb2.SessionState
    blocks: int
    bytes: int
    pinned_blocks: int
    pinned_bytes: int
    idle_s: float
    only_pinned_blocks: int
    only_pinned_bytes: int
    def __init__(self, tenant: _Optional[str] = ..., session_id: _Optional[str] = ..., state: _Optional[_Union[_kvstore_pb2.SessionState, str]] = ..., blocks: _Optional[int] = ..., bytes: _Optional[int] = ..., pinned_blocks: _Optional[int] = ..., pinned_bytes: _Optional[int] = ..., idle_s: _Optional[float] = ..., only_pinned_blocks: _Optional[int] = ..., only_pinned_bytes: _Optional[int] = ...) -> None: ...

class ListSessionsResponse(_message.Message):
    __slots__ = ("sessions", "more")
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[SessionInfo]
    more: bool
    def __init__(self, sessions: _Optional[_Iterable[_Union[SessionInfo, _Mapping]]] = ..., more: _Optional[bool] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("tenant", "session_id")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    session_id: str
    def __init__(self, tenant: _Optional[str] = ..., session_id: _Optional[str] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("fingerprint", "model", "revision", "dtype", "block_tokens", "blocks", "bytes", "tenants")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    fingerprint: bytes
    model: str
    revision: str
    dtype: str
    block_tokens: int
    blocks: int
    bytes: int
    tenants: int
    def __init__(self, fingerprint: _Optional[bytes] = ..., model: _Optional[str] = ..., revision: _Optional[str] = ..., dtype: _Optional[str] = ..., block_tokens: _Optional[int] = ..., blocks: _Optional[int] = ..., bytes: _Optional[int] = ..., tenants: _Optional[int] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...

class ModelPolicy(_message.Message):
    __slots__ = ("fingerprint", "ttl_s")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    fingerprint: bytes
    ttl_s: float
    def __init__(self, fingerprint: _Optional[bytes] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class ModelPolicyRequest(_message.Message):
    __slots__ = ("fingerprint",)
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    fingerprint: bytes
    def __init__(self, fingerprint: _Optional[bytes] = ...) -> None: ...
