from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_HBM: _ClassVar[Tier]
    TIER_DRAM: _ClassVar[Tier]
    TIER_NVME: _ClassVar[Tier]
    TIER_REMOTE: _ClassVar[Tier]

class RegionKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REGION_KIND_UNSPECIFIED: _ClassVar[RegionKind]
    REGION_KIND_POSIX_SHM: _ClassVar[RegionKind]
    REGION_KIND_CUDA_IPC: _ClassVar[RegionKind]

class SessionState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SESSION_STATE_UNSPECIFIED: _ClassVar[SessionState]
    SESSION_STATE_ACTIVE: _ClassVar[SessionState]
    SESSION_STATE_PAUSED: _ClassVar[SessionState]
    SESSION_STATE_RESUMED: _ClassVar[SessionState]
    SESSION_STATE_CLOSED: _ClassVar[SessionState]
TIER_UNSPECIFIED: Tier
TIER_HBM: Tier
TIER_DRAM: Tier
TIER_NVME: Tier
TIER_REMOTE: Tier
REGION_KIND_UNSPECIFIED: RegionKind
REGION_KIND_POSIX_SHM: RegionKind
REGION_KIND_CUDA_IPC: RegionKind
SESSION_STATE_UNSPECIFIED: SessionState
SESSION_STATE_ACTIVE: SessionState
SESSION_STATE_PAUSED: SessionState
SESSION_STATE_RESUMED: SessionState
SESSION_STATE_CLOSED: SessionState

class ModelSpec(_message.Message):
    __slots__ = ("model", "revision", "num_layers", "num_kv_heads", "head_dim", "dtype", "block_tokens", "tokenizer_hash", "layout", "rope_scaling", "adapter", "tp_rank", "tp_size", "num_params", "hidden_size")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_HASH_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    ROPE_SCALING_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_PARAMS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    model: str
    revision: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_tokens: int
    tokenizer_hash: str
    layout: str
    rope_scaling: str
    adapter: str
    tp_rank: int
    tp_size: int
    num_params: int
    hidden_size: int
    def __init__(self, model: _Optional[str] = ..., revision: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., block_tokens: _Optional[int] = ..., tokenizer_hash: _Optional[str] = ..., layout: _Optional[str] = ..., rope_scaling: _Optional[str] = ..., adapter: _Optional[str] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., num_params: _Optional[int] = ..., hidden_size: _Optional[int] = ...) -> None: ...

class ExtraKeys(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, items: _Optional[_Iterable[bytes]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids", "extra")
    IDS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    extra: _containers.RepeatedCompositeFieldContainer[ExtraKeys]
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., extra: _Optional[_Iterable[_Union[ExtraKeys, _Mapping]]] = ...) -> None: ...

class Target(_message.Message):
    __slots__ = ("spec", "namespace", "keys", "tokens", "parent", "roots")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    ROOTS_FIELD_NUMBER: _ClassVar[int]
    spec: ModelSpec
    namespace: str
    keys: bytes
    tokens: TokenIds
    parent: bytes
    roots: bool
    def __init__(self, spec: _Optional[_Union[ModelSpec, _Mapping]] = ..., namespace: _Optional[str] = ..., keys: _Optional[bytes] = ..., tokens: _Optional[_Union[TokenIds, _Mapping]] = ..., parent: _Optional[bytes] = ..., roots: _Optional[bool] = ...) -> None: ...

class BlockKeysRequest(_message.Message):
    __slots__ = ("spec", "namespace", "tokens")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    spec: ModelSpec
    namespace: str
    tokens: TokenIds
    def __init__(self, spec: _Optional[_Union[ModelSpec, _Mapping]] = ..., namespace: _Optional[str] = ..., tokens: _Optional[_Union[TokenIds, _Mapping]] = ...) -> None: ...

class BlockKeysResponse(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: bytes
    def __init__(self, keys: _Optional[bytes] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("target",)
    TARGET_FIELD_NUMBER: _ClassVar[int]
    target: Target
    def __init__(self, target: _Optional[_Union[Target, _Mapping]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("num_blocks", "keys", "tier_codes")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TIER_CODES_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    keys: bytes
    tier_codes: bytes
    def __init__(self, num_blocks: _Optional[int] = ..., keys: _Optional[bytes] = ..., tier_codes: _Optional[bytes] = ...) -> None: ...

class PutHeader(_message.Message):
    __slots__ = ("target", "session", "ttl_s")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    target: Target
    session: str
    ttl_s: float
    def __init__(self, target: _Optional[_Union[Target, _Mapping]] = ..., session: _Optional[str] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class PutFrame(_message.Message):
    __slots__ = ("meta_bytes", "header", "block", "offset", "xxh3", "data")
    META_BYTES_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    XXH3_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    meta_bytes: int
    header: PutHeader
    block: int
    offset: int
    xxh3: int
    data: bytes
    def __init__(self, meta_bytes: _Optional[int] = ..., header: _Optional[_Union[PutHeader, _Mapping]] = ..., block: _Optional[int] = ..., offset: _Optional[int] = ..., xxh3: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("blocks_written",)
    BLOCKS_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    blocks_written: int
    def __init__(self, blocks_written: _Optional[int] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("target", "chunk_bytes", "pack_blocks", "partial", "keys_after")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    PACK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_FIELD_NUMBER: _ClassVar[int]
    KEYS_AFTER_FIELD_NUMBER: _ClassVar[int]
    target: Target
    chunk_bytes: int
    pack_blocks: bool
    partial: bool
    keys_after: int
    def __init__(self, target: _Optional[_Union[Target, _Mapping]] = ..., chunk_bytes: _Optional[int] = ..., pack_blocks: _Optional[bool] = ..., partial: _Optional[bool] = ..., keys_after: _Optional[int] = ...) -> None: ...

class GetHeader(_message.Message):
    __slots__ = ("num_blocks", "block_nbytes", "limited", "present")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_NBYTES_FIELD_NUMBER: _ClassVar[int]
    LIMITED_FIELD_NUMBER: _ClassVar[int]
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    block_nbytes: int
    limited: bool
    present: bytes
    def __init__(self, num_blocks: _Optional[int] = ..., block_nbytes: _Optional[int] = ..., limited: _Optional[bool] = ..., present: _Optional[bytes] = ...) -> None: ...

class GetFrame(_message.Message):
    __slots__ = ("meta_bytes", "header", "block", "offset", "xxh3", "data")
    META_BYTES_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    XXH3_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    meta_bytes: int
    header: GetHeader
    block: int
    offset: int
    xxh3: int
    data: bytes
    def __init__(self, meta_bytes: _Optional[int] = ..., header: _Optional[_Union[GetHeader, _Mapping]] = ..., block: _Optional[int] = ..., offset: _Optional[int] = ..., xxh3: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class RegisterRegionRequest(_message.Message):
    __slots__ = ("kind", "name", "size", "nonce", "cuda_ipc_handle", "device")
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    kind: RegionKind
    name: str
    size: int
    nonce: bytes
    cuda_ipc_handle: bytes
    device: int
    def __init__(self, kind: _Optional[_Union[RegionKind, str]] = ..., name: _Optional[str] = ..., size: _Optional[int] = ..., nonce: _Optional[bytes] = ..., cuda_ipc_handle: _Optional[bytes] = ..., device: _Optional[int] = ...) -> None: ...

class RegisterRegionResponse(_message.Message):
    __slots__ = ("region_id", "nonce")
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    region_id: int
    nonce: bytes
    def __init__(self, region_id: _Optional[int] = ..., nonce: _Optional[bytes] = ...) -> None: ...

class UnregisterRegionRequest(_message.Message):
    __slots__ = ("region_id",)
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    region_id: int
    def __init__(self, region_id: _Optional[int] = ...) -> None: ...

class UnregisterRegionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PutLocalRequest(_message.Message):
    __slots__ = ("target", "region_id", "offsets", "session", "ttl_s", "seq")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    target: Target
    region_id: int
    offsets: _containers.RepeatedScalarFieldContainer[int]
    session: str
    ttl_s: float
    seq: int
    def __init__(self, target: _Optional[_Union[Target, _Mapping]] = ..., region_id: _Optional[int] = ..., offsets: _Optional[_Iterable[int]] = ..., session: _Optional[str] = ..., ttl_s: _Optional[float] = ..., seq: _Optional[int] = ...) -> None: ...

class GetLocalRequest(_message.Message):
    __slots__ = ("target", "region_id", "offsets", "seq", "keys_after")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    KEYS_AFTER_FIELD_NUMBER: _ClassVar[int]
    target: Target
    region_id: int
    offsets: _containers.RepeatedScalarFieldContainer[int]
    seq: int
    keys_after: int
    def __init__(self, target: _Optional[_Union[Target, _Mapping]] = ..., region_id: _Optional[int] = ..., offsets: _Optional[_Iterable[int]] = ..., seq: _Optional[int] = ..., keys_after: _Optional[int] = ...) -> None: ...

class FenceRegionRequest(_message.Message):
    __slots__ = ("region_id", "seq")
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    region_id: int
    seq: int
    def __init__(self, region_id: _Optional[int] = ..., seq: _Optional[int] = ...) -> None: ...

class FenceRegionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetLocalResponse(_message.Message):
    __slots__ = ("num_blocks", "present")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    present: bytes
    def __init__(self, num_blocks: _Optional[int] = ..., present: _Optional[bytes] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("session_id", "namespace")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    namespace: str
    def __init__(self, session_id: _Optional[str] = ..., namespace: _Optional[str] = ...) -> None: ...

class SessionResponse(_message.Message):
    __slots__ = ("session_id", "state")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    state: SessionState
    def __init__(self, session_id: _Optional[str] = ..., state: _Optional[_Union[SessionState, str]] = ...) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("target", "tier")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    target: Target
    tier: Tier
    def __init__(self, target: _Optional[_Union[Target, _Mapping]] = ..., tier: _Optional[_Union[Tier, str]] = ...) -> None: ...

class PrefetchResponse(_message.Message):
    __slots__ = ("blocks",)
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    blocks: int
    def __init__(self, blocks: _Optional[int] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("namespace", "keys")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    keys: bytes
    def __init__(self, namespace: _Optional[str] = ..., keys: _Optional[bytes] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: int
    def __init__(self, deleted: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("json",)
    JSON_FIELD_NUMBER: _ClassVar[int]
    json: str
    def __init__(self, json: _Optional[str] = ...) -> None: ...

class WhoAmIRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WhoAmIResponse(_message.Message):
    __slots__ = ("principal", "role", "readable", "writable", "supports_roots")
    PRINCIPAL_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    READABLE_FIELD_NUMBER: _ClassVar[int]
    WRITABLE_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_ROOTS_FIELD_NUMBER: _ClassVar[int]
    principal: str
    role: str
    readable: _containers.RepeatedScalarFieldContainer[str]
    writable: _containers.RepeatedScalarFieldContainer[str]
    supports_roots: bool
    def __init__(self, principal: _Optional[str] = ..., role: _Optional[str] = ..., readable: _Optional[_Iterable[str]] = ..., writable: _Optional[_Iterable[str]] = ..., supports_roots: _Optional[bool] = ...) -> None: ...
