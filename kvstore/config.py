"""StoreConfig: the one typed, validated configuration of an in-process Store."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator

from kvstore.errors import InvalidArgument
from kvstore.paths import OptionalUserPath, UserPath
from kvstore.sizes import ByteCount, Float, Int
from kvstore.validation import validation_error
from tiers.remote_config import RemoteConfig

GiB = 1 << 30
#: the most any tier capacity may be (1 PiB): beyond every machine's memory and address space,
#: and far below the sizes that overflow numpy, torch or LMDB (``"99999999999TiB"`` reached
#: them as a bare ValueError). A smaller capacity the machine cannot allocate fails at open,
#: naming the field (:class:`tiers.memory.MemoryTier`, :class:`tiers.nvme.NVMeTier`).
MAX_CAPACITY = 1 << 50




def _master_key(value: Any) -> Any:
    """Key text (TOML has no bytes) read as ``$KVSTORE_MASTER_KEY`` is: hex or base64 of 32
    bytes; bytes (given in Python) are the key itself, checked by the field.

    NOTE: text was taken as its UTF-8 bytes: the hex or base64 form of a key was refused
    ("must be 32 bytes, got 64") and a typed 32-character password became the key."""
    if not isinstance(value, str):
        return value
    from kvstore.keyring import KEY_BYTES, parse_key_text  # local: keeps cryptography out of config import

    try:
        return parse_key_text(value, "store.master_key")
    except InvalidArgument:
        raise ValueError(f"as text, the key is {KEY_BYTES} bytes in hex (64 hex digits) or base64 (44 "
                         f"characters), e.g. from `openssl rand -hex 32`; this text ({len(value)} characters) "
                         f"is neither, and a password is not a key") from None


def store_policies() -> list[str]:
    """The registered placement policies a Store can run: all but those that need a next-use
    oracle (``belady``, the trace replay's offline reference)."""
    from policy.base import POLICIES, make_policy
    from policy.registry import OraclePolicy

    make_policy("lru")  # registers every policy
    return sorted(name for name, factory in POLICIES.items()
                  if not isinstance(factory(lambda fp: None), OraclePolicy))


class StoreConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    path: UserPath
    """Store directory: holds the NVMe tier (LMDB), the master key file and the audit log. Not
    empty; a leading ``~`` is the home directory."""

    hbm_bytes: Annotated[ByteCount, Field(ge=0, le=MAX_CAPACITY)] = 1 * GiB
    """Capacity of the HBM tier (device block pool; a CPU arena where there is no GPU). 0 disables it;
    at most 1 PiB (:data:`MAX_CAPACITY`), and the Store refuses to open when the device cannot
    allocate it."""

    dram_bytes: Annotated[ByteCount, Field(ge=0, le=MAX_CAPACITY)] = 4 * GiB
    """Capacity of the DRAM tier (host slab pool, page-locked when CUDA is present). 0 disables it;
    at most 1 PiB, and the Store refuses to open when the host cannot allocate it."""

    nvme_bytes: Annotated[ByteCount, Field(ge=0, le=MAX_CAPACITY)] = 64 * GiB
    """Capacity of the NVMe tier (raw block bytes; LMDB's map is sized with headroom). 0 disables it;
    at most 1 PiB, and the Store refuses to open when LMDB cannot map twice it."""

    device: str | None = None
    """Device of the HBM pool (``"cuda"``, ``"cuda:1"``, ``"cpu"``); None = cuda when available."""

    master_key: Annotated[bytes | None, BeforeValidator(_master_key)] = None
    """32-byte master key wrapping the tenants' data keys: as text (TOML), in hex (64 digits)
    or base64, as ``$KVSTORE_MASTER_KEY`` takes it; as bytes (Python), the 32 bytes
    themselves. None: env KVSTORE_MASTER_KEY, then ``master_key_file`` (generated with mode
    0600 on first open when absent)."""

    master_key_file: OptionalUserPath = None
    """Where the master key lives; default ``<path>/master.key``. A leading ``~`` is the home
    directory."""

    encrypt: bool = True
    """AES-256-GCM on the NVMe tier; False stores values with an xxh3 checksum instead. Fixed
    when the store is created: reopening it with the other setting is refused."""

    compression_level: Annotated[Int, Field(ge=0, le=22)] = 1
    """zstd level of the NVMe codec; 0 turns compression off."""

    min_compress_ratio: Annotated[Float, Field(ge=1.0, le=64.0, allow_inf_nan=False)] = 1.5
    """Compression has to pay for itself: the NVMe codec compresses an 8 KiB sample of each
    block first and stores the block uncompressed when the ratio estimated for the whole block
    (raw / stored bytes) is below this; each value's header records the choice, so reading
    needs no setting. KV compresses about 1.18x in fp16 and 1.41-1.49x in bf16, and on the
    development machine compressing either made NVMe put and get slower (get up to 5x), so by
    default both are stored raw. 1.0 = always compress (when ``compression_level`` > 0): for
    a disk much slower than zstd (~0.5-1 GB/s per core)."""

    codec_threads: Annotated[Int, Field(ge=1, le=64)] = 2
    """Threads that encode/decode chunks of one value in parallel."""

    retain_freed_memory: bool = True
    """Keep freed large buffers in the process (glibc ``mallopt``: blocks up to 64 MiB come
    from the heap and are reused; up to 256 MiB of free heap top is kept) instead of returning
    them to the OS and faulting them in again on the next NVMe commit or streamed chunk: this
    doubled NVMe put throughput on the development machine (``python -m bench.malloc_bench``).
    Process-wide, applied at open; turn it off in an engine process that tunes its own
    allocator. No effect outside glibc (:mod:`kvstore.memtune`)."""

    durable: bool = True
    """LMDB syncs on every commit: a put that returned and whose blocks went to NVMe survives a
    crash (kill -9). Blocks living only in HBM/DRAM (the usual case while they fit) are not
    committed until a :meth:`~kvstore.store.Store.flush` or a close (``persist_on_close``).
    NOTE: it said every put that returned survived: with the default tier sizes none did."""

    persist_on_close: bool = True
    """On a graceful close, write the HBM/DRAM blocks that have no NVMe copy to NVMe (ancestors
    first), so a restart finds the warm cache. A block short of NVMe space or quota evicts
    NVMe blocks the placement policy values less (as if it were demoted into NVMe now: leaves
    first, never pinned or in flight, a paused session's last; by recency for a policy without
    comparable keys), and only when nothing colder can go is it written as room allows, or
    lost (logged, ``Store.uncommitted_at_close``). A crash keeps only what was already
    committed."""

    high_watermark: Annotated[Float, Field(gt=0, le=1, allow_inf_nan=False)] = 0.95
    """A tier starts evicting when a new block would take it above this fraction of capacity."""

    low_watermark: Annotated[Float, Field(gt=0, le=1, allow_inf_nan=False)] = 0.85
    """... and evicts down to this fraction."""

    policy: str = "cost"
    """Placement policy: ``cost`` (the cost-aware policy, default), ``gdsf`` or ``lru`` (the
    baselines). Replayed on the Mooncake trace and the generated workloads at several
    capacities, ``cost`` saved at least as much prefill time as LRU and wrote less to NVMe in
    every cell (README "Benchmarks" has the figures and their dates; ``kvstore bench replay``).
    Benchmarks of migration paths set ``lru`` to measure the mechanism alone. ``belady`` (the
    trace replay's offline reference) is refused: it needs to know the future
    (:func:`store_policies`)."""

    default_ttl_s: Annotated[Float, Field(gt=0, allow_inf_nan=False)] | None = None
    """TTL of blocks whose tenant has no TTL policy: finite seconds > 0; None = no expiry
    (an infinite TTL is written as unset, as everywhere: :func:`kvstore.expiry.check_ttl`)."""

    session_idle_pause_s: Annotated[Float, Field(ge=0)] = 600.0
    """An ACTIVE (or RESUMED) session not used for this many seconds — no session verb, no put
    naming it — is PAUSED by :meth:`kvstore.store.Store.expire` (the sidecar runs it every
    ``expire_interval_s``): its blocks are unpinned and demoted to DRAM as ``pause_session``
    does; opening or resuming it brings them back. 0 = never. Why: a client that went away
    without closing its session (a crash, a disconnect) kept its blocks pinned in HBM for as
    long as the store ran, refusing every other session's puts once HBM was full of them."""

    session_idle_close_s: Annotated[Float, Field(ge=0)] = 86400.0
    """A session (in any state) not used for this many seconds is CLOSED by
    :meth:`kvstore.store.Store.expire`: its blocks are unpinned (kept as prefix cache under the
    policy) and its id is freed (it counted against ``limits.max_sessions_per_tenant``).
    0 = never."""

    remote: RemoteConfig | None = None
    """The remote tier (Redis/Valkey, standalone or cluster) below the local tiers; None = off.
    Values are encrypted with tenant data keys kept (wrapped) in Redis, so every server with
    the same master key can serve blocks another server wrote."""

    remote_write: Literal["demote", "through"] = "demote"
    """``demote``: blocks reach the remote tier when evicted from the last local tier (if the
    policy keeps them). ``through``: every new block is also queued to the remote tier at put
    (cross-server sharing at once). Remote writes are asynchronous (bounded queue)."""

    nvme_quantization: str = "none"
    """Default format of blocks written to NVMe and the remote tier: ``"none"`` = lossless (default), ``"int8"`` or
    ``"fp8_e4m3"`` (per-channel key scales; add ``"/head"`` for per-head). Lossy: see the README
    for the measured error. Per tenant: ``Store.set_tenant_policy(quantization=)``; per model:
    ``Store.set_model_quantization``."""

    @field_validator("nvme_quantization")
    @classmethod
    def _quant_name(cls, v: str) -> str:
        # local: keeps torch out of config import
        from kvstore.quantization import Quantization

        Quantization.parse(v)  # InvalidArgument is a ValueError -> ValidationError
        return v

    @field_validator("policy")
    @classmethod
    def _runnable_policy(cls, v: str) -> str:
        runnable = store_policies()
        if v in runnable:
            return v
        from policy.base import POLICIES

        if v in POLICIES:  # registered, but needs a next-use oracle
            raise ValueError(f"{v!r} needs to know when each block is next used, which only the trace "
                             f"replay can tell (it is the offline reference); a Store runs one of {runnable}")
        raise ValueError(f"unknown policy {v!r}; choose one of {runnable}")

    @field_validator("master_key")
    @classmethod
    def _key_len(cls, v: bytes | None) -> bytes | None:
        if v is not None and len(v) != 32:
            raise ValueError(f"master_key must be 32 bytes, got {len(v)}")
        return v

    @model_validator(mode="after")
    def _watermarks(self) -> StoreConfig:
        if self.low_watermark > self.high_watermark:
            raise ValueError("low_watermark must be <= high_watermark")
        if self.hbm_bytes == 0 and self.dram_bytes == 0 and self.nvme_bytes == 0:
            raise ValueError("at least one local tier needs a capacity > 0")
        return self

    @classmethod
    def build(cls, **kwargs: object) -> StoreConfig:
        """Like the constructor, but raises :class:`kvstore.errors.InvalidArgument`."""
        try:
            return cls(**kwargs)  # type: ignore[arg-type]
        except ValidationError as exc:
            raise validation_error("bad StoreConfig", exc) from None
