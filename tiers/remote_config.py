"""RemoteConfig: the typed, validated configuration of the remote (Redis/Valkey) tier."""

from __future__ import annotations

from typing import Annotated

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    field_validator,
    model_validator,
)

from kvstore.paths import OptionalUserPath
from kvstore.sizes import ByteCount, Float, Int
from kvstore.validation import validation_error

MiB = 1 << 20
GiB = 1 << 30


class RemoteConfig(BaseModel):
    """Where the remote tier lives and how hard it may be pushed. Bounds are checked here."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    urls: Annotated[list[str], Field(min_length=1)]
    """Server URL(s): ``redis://host:port/db`` or ``rediss://`` (TLS). Standalone mode uses the
    first one; cluster mode uses all of them as startup nodes (any live one is enough)."""

    cluster: bool = False
    """True: Redis/Valkey Cluster (redis-py ``RedisCluster``; MOVED/ASK followed by the client)."""

    namespace: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")] = "kvs"
    """Prefix of every key this tier writes (``<ns>:<tenant hash>:<fingerprint>:<key>``), so
    several deployments (or tests) can share one Redis without seeing each other."""

    username: str | None = None
    """ACL user name (Redis 6+); None = the default user."""

    password: SecretStr | None = None
    """Password (AUTH); None = no authentication. Never logged (a SecretStr)."""

    tls: bool = False
    """Use TLS to every server (implied by a ``rediss://`` URL)."""

    tls_ca_file: OptionalUserPath = None
    """CA bundle that signs the servers' certificates; None = the system store."""

    tls_cert_file: OptionalUserPath = None
    """Client certificate for mutual TLS (with ``tls_key_file``); None = no client cert."""

    tls_key_file: OptionalUserPath = None
    """Private key of ``tls_cert_file``."""

    tls_verify: bool = True
    """Verify the servers' certificates and host names (turn off only for tests)."""

    connect_timeout_s: Annotated[Float, Field(gt=0, le=60)] = 1.0
    """TCP/TLS connect timeout of one connection attempt."""

    op_timeout_s: Annotated[Float, Field(gt=0, le=600)] = 2.0
    """Socket read/write timeout of one command (a 32 MiB block at 0.5 GB/s takes ~70 ms)."""

    retries: Annotated[Int, Field(ge=0, le=10)] = 1
    """redis-py retries of a command after a connection error or timeout (``redis.Retry``)."""

    retry_base_s: Annotated[Float, Field(gt=0, le=10)] = 0.01
    """Base of redis-py's exponential-with-jitter backoff between those retries."""

    retry_cap_s: Annotated[Float, Field(gt=0, le=60)] = 0.2
    """Cap of that backoff (keep it short: a get must not stall the hot path)."""

    breaker_failures: Annotated[Int, Field(ge=1, le=1000)] = 3
    """Consecutive faults on one server (node) that open its circuit breaker: while open,
    operations on that node are misses without touching the network."""

    breaker_base_s: Annotated[Float, Field(gt=0, le=60)] = 0.1
    """First open period of a breaker; doubles (with jitter) on every failed probe."""

    breaker_cap_s: Annotated[Float, Field(gt=0, le=3600)] = 10.0
    """Longest open period of a breaker."""

    max_connections: Annotated[Int, Field(ge=1, le=4096)] = 32
    """Connections per server in redis-py's pool."""

    max_inflight_bytes: Annotated[ByteCount, Field(ge=1 * MiB)] = 256 * MiB
    """Raw block bytes queued for asynchronous demotion at most, and the size of one pipelined
    batch of gets (a longer prefix is fetched in several round trips)."""

    queue_depth: Annotated[Int, Field(ge=1, le=1 << 20)] = 1024
    """Blocks queued for asynchronous demotion at most; ``submit`` refuses beyond it."""

    capacity_bytes: Annotated[ByteCount, Field(ge=0)] = 1024 * GiB
    """Raw block bytes this node may keep in the remote tier (its own writes, all tenants);
    the servers' ``maxmemory`` is the hard limit, enforced by Redis eviction (a miss here).

    Per server, like a tenant's ``"remote"`` quota (``Store.set_tenant_policy``): each server
    counts only the blocks it wrote itself, so N servers sharing one Redis may together hold up
    to N times this capacity, and a tenant N times its remote quota, there. Size ``maxmemory``
    for that (a shared, cluster-wide budget is not implemented)."""

    accounting_resync_s: Annotated[Float, Field(ge=0, le=86400, allow_inf_nan=False)] = 10.0
    """Least time between two re-counts of this server's remote blocks (an ``EXISTS`` of each
    one, in the background writer). A re-count is made when a write is refused for capacity or
    quota, so blocks that vanished without this server's knowledge (Redis eviction, a
    ``FLUSHALL``, a purge by another server) stop counting against them."""

    ttl_cap_s: Annotated[Float, Field(gt=0, allow_inf_nan=False)] | None = 7 * 86400.0
    """Redis expiry of blocks put without a TTL, and the longest expiry of any block, so a
    shared Redis is never filled with blocks nobody deletes; None = no cap."""

    copy_verify_margin_s: Annotated[Float, Field(ge=0, le=3600, allow_inf_nan=False)] = 1.0
    """How much sooner than this server wrote it a copy in Redis may expire and still count as
    its copy at eviction (one ``PTTL`` checks it, see ``RemoteTier._verify_held``): the expiry
    is set in whole milliseconds, after the write's round trip. A copy expiring sooner (another
    server put the block with a shorter TTL) is written again."""

    skew_grace_s: Annotated[Float, Field(ge=0, le=86400, allow_inf_nan=False)] = 60.0
    """A copy read past its TTL deadline (on this server's clock) is a miss at once, but is
    deleted from Redis only once it is this much past it: the servers' clocks differ, and one
    running ahead deleted copies still valid for the others (Redis' own expiry removes it in
    any case). Set it to the clock skew the servers may have."""

    encrypt: bool = True
    """AES-256-GCM with the tenant's data key (the Redis operator cannot read prompts)."""

    key_cache_ttl_s: Annotated[Float, Field(gt=0, le=86400)] = 30.0
    """How long a server trusts its cached copy of a tenant's data key before re-reading the
    shared wrapped key from Redis: after another server deletes the tenant, this one stops
    encrypting or decrypting with the destroyed key within this time."""

    compression_level: Annotated[Int, Field(ge=0, le=22)] = 0
    """zstd level of the value codec; 0 = off. Off is fastest on loopback or fast networks;
    level 1 pays for bf16 blocks (ratio ~1.45) on links slower than ~1.5 GB/s (set
    ``min_compress_ratio`` to 1.0 or 1.4 for them then)."""

    min_compress_ratio: Annotated[Float, Field(ge=1.0, le=64.0)] = 1.5
    """With ``compression_level`` > 0, a value whose sampled ratio (raw / stored bytes) is below
    this is stored uncompressed, as in ``StoreConfig.min_compress_ratio`` (fp16 KV compresses
    ~1.18x, bf16 ~1.45x); 1.0 = always compress. Each value's header records the choice."""

    codec_threads: Annotated[Int, Field(ge=1, le=64)] = 2
    """Threads that encode/decode the chunks of one value in parallel."""

    share_deletions: bool = True
    """Publish every ``delete``, model purge and tenant drop this server makes in the stream
    ``<namespace>:deletions`` and apply the other servers' (a thread reads it): their local
    copies (HBM, DRAM, NVMe) of the deleted blocks go too, so none is served or written back to
    Redis later (:mod:`tiers.remote_invalidate`). Off: deletions reach Redis and the deleting
    server's own tiers only."""

    deletions_maxlen: Annotated[Int, Field(ge=100, le=100_000_000)] = 100_000
    """Entries the deletions stream keeps, about (each ``XADD`` trims it, ``MAXLEN ~``): a
    server that restarts (or whose reads failed) applies the deletions it missed while they are
    still there; one entry is at most 4,096 block keys (128 KiB), a small deletion ~0.2 KiB."""

    deletions_block_s: Annotated[Float, Field(gt=0, le=60, allow_inf_nan=False)] = 1.0
    """Longest wait of one read of the deletions stream (``XREAD BLOCK``): a new entry ends it at
    once; a reader stopped by ``close`` ends at once too (its connection is shut down)."""

    rewrite_window_s: Annotated[Float, Field(ge=0, le=3600, allow_inf_nan=False)] = 5.0
    """How long this server remembers each demotion its writer completed (block, model,
    parent), so that when it applies another server's deletion it deletes from Redis the ones
    that landed there after that deletion (a demotion of a block it still held, written
    between the other server's ``UNLINK`` and its reading the entry: about a millisecond on a
    healthy Redis; counted ``deletions_rewritten``). An entry read later than this after such
    a write (its reader stalled or Redis unreachable meanwhile) does not find it: the block
    stays in Redis until it expires. 0: nothing is remembered (the window stays open)."""

    rewrite_window_blocks: Annotated[Int, Field(ge=0, le=1 << 22)] = 16_384
    """The most demotions remembered for ``rewrite_window_s`` (about 0.6 KiB each: 10 MiB by
    default); past it the oldest are forgotten first, so at more than this many writes per
    ``rewrite_window_s`` the window is shorter. 0: nothing is remembered."""

    @field_validator("urls")
    @classmethod
    def _schemes(cls, urls: list[str]) -> list[str]:
        for u in urls:
            if not u.startswith(("redis://", "rediss://")):
                raise ValueError(f"remote URL {u!r} must start with redis:// or rediss://")
        return urls

    @model_validator(mode="after")
    def _consistent(self) -> RemoteConfig:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together")
        if self.retry_base_s > self.retry_cap_s or self.breaker_base_s > self.breaker_cap_s:
            raise ValueError("a backoff base must not exceed its cap")
        return self

    @property
    def use_tls(self) -> bool:
        return self.tls or any(u.startswith("rediss://") for u in self.urls)

    @classmethod
    def build(cls, **kwargs: object) -> RemoteConfig:
        """Like the constructor, but raises :class:`kvstore.errors.InvalidArgument`."""
        from pydantic import ValidationError

        try:
            return cls(**kwargs)  # type: ignore[arg-type]
        except ValidationError as exc:
            raise validation_error("bad RemoteConfig", exc) from None


__all__ = ["RemoteConfig"]
