"""ServerConfig: the one typed, validated configuration of ``kvstore serve``.

Loaded from TOML (``kvstore serve --config kvstore.toml``) or built from embedded defaults when
there is no file. Every field is documented below; a minimal file is::

    listen = "127.0.0.1:50551"

    [store]                     # a kvstore.config.StoreConfig
    path = "/var/lib/kvstore"
    hbm_bytes = "8GiB"          # every *_bytes field: a byte count or a size (kvstore.sizes)

    [tls]                       # optional; mutual TLS when client_ca_file is set
    cert_file = "server.pem"
    key_file = "server.key"

    [limits]
    max_message_bytes = 4194304

    [metrics]
    listen = "127.0.0.1:9464"
    token_file = "/var/lib/kvstore/metrics.token"  # scrapes send it: Authorization: Bearer <token>
                                                   # (its directory must exist; default: in store.path)

Defaults: the data directory is ``$KVSTORE_HOME``, else ``./.kvstore`` when the current
directory is writable, else ``~/.local/share/kvstore``; the Store generates its master key file
there on first start and the server prints the admin token once.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import tomllib
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)

from kvstore.config import StoreConfig, validation_error
from kvstore.errors import InvalidArgument
from kvstore.memtune import NONTEMPORAL_MIN as STREAMING_COPY_MIN
from kvstore.metrics import MAX_TENANT_LABELS
from kvstore.paths import OptionalUserPath, UserPath, private_file_problem
from kvstore.sizes import ByteCount, Float, Int

MiB = 1 << 20
GiB = 1 << 30
DEFAULT_LISTEN = "127.0.0.1:50551"


class TLSConfig(BaseModel):
    """Transport security. With ``client_ca_file`` the server requires client certificates (mTLS)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    cert_file: UserPath
    """PEM certificate chain of the server. (Every path: not empty; a leading ``~`` is the home
    directory.)"""

    key_file: UserPath
    """PEM private key of the server."""

    client_ca_file: OptionalUserPath = None
    """PEM CA bundle that client certificates must chain to; set = mutual TLS required."""


def _read_pem(path: Path, option: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise InvalidArgument(f"{option} {str(path)!r}: cannot read it: {exc.strerror or exc}") from None


def check_certificates(path: Path, option: str) -> list[Any]:
    """The PEM certificates in ``path`` (a chain or a CA bundle); InvalidArgument naming
    ``option`` and the file when it cannot be read or holds none."""
    from cryptography import x509

    data = _read_pem(path, option)
    try:
        return x509.load_pem_x509_certificates(data)
    except ValueError:
        raise InvalidArgument(f"{option} {str(path)!r} holds no PEM certificate "
                              f"(-----BEGIN CERTIFICATE-----)") from None


def check_key_pair(cert_file: Path, key_file: Path, *, cert_option: str = "tls.cert_file",
                   key_option: str = "tls.key_file") -> None:
    """Check that ``key_file`` is an unencrypted PEM private key that other users cannot read
    and that the first certificate of ``cert_file`` is for it; InvalidArgument naming the
    options and files otherwise. (grpc reported a mismatched pair as a failure to bind the port.)"""
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization

    cert = check_certificates(cert_file, cert_option)[0]
    data = _read_pem(key_file, key_option)
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except TypeError:
        raise InvalidArgument(f"{key_option} {str(key_file)!r} is encrypted: give the key unencrypted "
                              f"(e.g. openssl pkey -in KEY -out PLAIN.key), readable by this user only") from None
    except (ValueError, UnsupportedAlgorithm):
        raise InvalidArgument(f"{key_option} {str(key_file)!r} holds no PEM private key "
                              f"(-----BEGIN PRIVATE KEY-----)") from None
    spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(*spki) != cert.public_key().public_bytes(*spki):
        raise InvalidArgument(f"{key_option} {str(key_file)!r} is not the key of the certificate in "
                              f"{cert_option} {str(cert_file)!r}: give the key the certificate was issued for")
    _check_private(key_file, key_option)


def _check_private(key_file: Path, option: str) -> None:
    """InvalidArgument when other users may read or write the private key ``key_file``.
    NOTE: a key at 0644 was taken, where a master key file at 0644 is refused. Group access
    stays allowed: a key shared with a service group (``root:ssl-cert 0640``) is usual."""
    if problem := private_file_problem(key_file, group_ok=True):
        raise InvalidArgument(f"{option} {str(key_file)!r} {problem}")


#: bytes per key of the longest reply that lists a call's keys (a Lookup by token ids sends back
#: each 32-byte key and its block's tier code), and the room kept for the rest of a message
_KEY_REPLY_BYTES = 33
_MESSAGE_FRAMING = 1024


def max_keys_in(max_message_bytes: int) -> int:
    """The most keys a call may name (``limits.max_keys_per_call``) for a message listing them
    all (a BlockKeys or token Lookup reply, a request sending them) to fit ``max_message_bytes``."""
    return (max_message_bytes - _MESSAGE_FRAMING) // _KEY_REPLY_BYTES


class LimitsConfig(BaseModel):
    """Bounds on what one call may ask for. Past them: RESOURCE_EXHAUSTED / INVALID_ARGUMENT
    with a message naming the limit."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_message_bytes: Annotated[ByteCount, Field(ge=64 * 1024, le=1 * GiB)] = 4 * MiB
    """Largest gRPC message accepted or sent; in-band blocks are streamed in chunks below it."""

    chunk_bytes: Annotated[ByteCount, Field(ge=4096, le=1 * GiB)] = 2 * MiB
    """Default payload per streamed chunk, and the most a Get may ask for (must leave room for
    framing under max_message_bytes). 2 MiB: frames of 4 MiB moved 15–25 % less than 2 MiB
    ones through the sidecar (see ``kvstore.client.DEFAULT_CHUNK_BYTES``)."""

    max_keys_per_call: Annotated[Int, Field(ge=1)] = 65536
    """Most blocks one BlockKeys/Lookup/Get/Prefetch/Delete/PutLocal/GetLocal may name (token
    ids: full blocks, refused before any key is computed). A message listing that many keys must
    fit ``max_message_bytes``: 33 bytes a key (a token Lookup's reply: key and tier code) plus
    1 KiB, at most :func:`max_keys_in` (127,069 at 4 MiB; 1,954 at 64 KiB)."""

    max_blocks_per_stream: Annotated[Int, Field(ge=1)] = 4096
    """Most blocks one Put stream may carry."""

    max_stream_bytes: Annotated[ByteCount, Field(ge=1)] = 2 * GiB
    """Most payload bytes one Put stream may buffer before it commits (and one Get stream may
    stage: a Get asking for more is served up to it when the request says ``partial``, as
    :class:`kvstore.client.Client` does, and reads on in another Get; else refused)."""

    max_inflight_bytes_per_tenant: Annotated[ByteCount, Field(ge=1)] = 4 * GiB
    """Payload bytes one principal (a tenant or a publisher, whatever namespaces it writes) may
    have buffered across its concurrent Put streams and shared-memory staging."""

    max_tokens_per_call: Annotated[Int, Field(ge=1)] = 4 * MiB
    """Most token ids a request may send for key computation."""

    max_sessions_per_tenant: Annotated[Int, Field(ge=1)] = 4096
    """Sessions one tenant may have open at once (a session lives until closed)."""

    max_session_id_bytes: Annotated[Int, Field(ge=1, le=65536)] = 256
    """Longest session id, in UTF-8 bytes; at least 1 KiB below ``max_message_bytes`` (an
    operator's session list sends each one with its namespace in one message)."""

    max_regions_per_principal: Annotated[Int, Field(ge=0)] = 64
    """Shared-memory regions one principal may have registered at once (0 disables the local plane)."""

    region_idle_evict_s: Annotated[Float, Field(gt=0, le=86400, allow_inf_nan=False)] = 60.0
    """At ``max_regions_per_principal``, a new registration drops that principal's least
    recently used region that no call is using and that has been idle this many seconds (its
    live client registers it again at its next call) instead of being refused. Finite, at
    most a day."""

    max_region_bytes: Annotated[ByteCount, Field(ge=1)] = 64 * GiB
    """Largest shared-memory region the server will map."""

    staging_cache_bytes: Annotated[ByteCount, Field(ge=0)] = 256 * MiB
    """Block buffers of the in-band streams kept for reuse between calls (0 = allocate per call)."""

    max_calls_per_principal: Annotated[Int, Field(ge=1, le=1024)] | None = None
    """Calls one principal may have running at once, streams included; past it the call is
    refused with RESOURCE_EXHAUSTED naming this limit (the client may retry). None = half the
    ``workers`` (8 of 16). The admin principal is not counted. At most ``workers -
    admin_workers``: each running call holds one worker thread."""

    max_streams_per_principal: Annotated[Int, Field(ge=1, le=1024)] | None = None
    """In-band Put and Get streams one principal may have running at once (they count as calls
    too); past it RESOURCE_EXHAUSTED naming this limit. None = a quarter of the ``workers``
    (4 of 16). At most ``max_calls_per_principal``. Engines with many ranks on one token that
    stream in-band: raise ``workers`` and these two together."""

    admin_workers: Annotated[Int, Field(ge=0, le=1024)] | None = None
    """Worker threads kept for the admin principal and health checks: the calls of all tenants
    together may hold at most ``workers - admin_workers`` of them (past that: RESOURCE_EXHAUSTED
    naming this limit). None = an eighth of the ``workers``, at least 1 (2 of 16; 0 with one
    worker). Below ``workers``."""

    max_queued_calls: Annotated[Int, Field(ge=0, le=65536)] | None = None
    """Calls accepted while every worker is busy, waiting for one; past ``workers +
    max_queued_calls`` calls at once, the server refuses new ones at once with
    RESOURCE_EXHAUSTED ("Concurrent RPC limit exceeded", counted as a rejection of this limit)
    instead of queueing them without end. None = as many as ``workers``."""

    stream_idle_s: Annotated[Float, Field(gt=0, le=86400, allow_inf_nan=False)] = 30.0
    """A Put stream that receives no message, or a Get stream whose client takes no message,
    for this many seconds is cancelled (the client sees CANCELLED; a Put stores nothing) and
    gives its worker back. Checked every ``stream_idle_s / 2``: a stalled stream ends within
    1.5 × this. Finite, at most a day."""

    @model_validator(mode="after")
    def _fit_in_a_message(self) -> LimitsConfig:
        """What must fit in one message of max_message_bytes, every problem at once. NOTE: one
        validator each, a config with several such problems was refused one problem per start."""
        problems = [p for p in (self._chunk_problem(), self._session_id_problem(), self._key_list_problem()) if p]
        if problems:
            raise ValueError("\n".join(problems))
        return self

    def _chunk_problem(self) -> str:
        if self.chunk_bytes > self.max_message_bytes - 1024:
            return "limits.chunk_bytes must be at least 1 KiB below max_message_bytes"
        return ""

    def _session_id_problem(self) -> str:
        # NOTE: nothing tied them: a session id near max_message_bytes was accepted, and then the
        # Admin ListSessions page that had to carry it failed in grpc for every session listed
        if self.max_session_id_bytes > self.max_message_bytes - _MESSAGE_FRAMING:
            return (f"limits.max_session_id_bytes={self.max_session_id_bytes} does not fit in one message of "
                    f"limits.max_message_bytes={self.max_message_bytes} with {_MESSAGE_FRAMING} bytes for the rest "
                    f"(a session list entry): set it to at most {self.max_message_bytes - _MESSAGE_FRAMING}, or "
                    f"raise max_message_bytes")
        return ""

    def _key_list_problem(self) -> str:
        # NOTE: nothing tied them: BlockKeys or a token Lookup under a smaller max_message_bytes
        # did all the work, then failed in grpc ("Sent message larger than max"), counted as OK
        most = max_keys_in(self.max_message_bytes)
        if self.max_keys_per_call > most:
            return (f"limits.max_keys_per_call={self.max_keys_per_call} keys do not fit in one message of "
                    f"limits.max_message_bytes={self.max_message_bytes} ({_KEY_REPLY_BYTES} bytes a key in a "
                    f"Lookup's reply, plus {_MESSAGE_FRAMING}): set max_keys_per_call to at most {most}, or raise "
                    f"max_message_bytes")
        return ""


@dataclass(frozen=True)
class CallLimits:
    """How many calls may run at once, resolved from ``workers`` and ``[limits]``
    (:attr:`ServerConfig.call_limits`); :class:`kvstore.service_rpc.RpcRunner` enforces them."""

    calls_per_principal: int
    """Calls of one (non-admin) principal running at once, streams included."""
    streams_per_principal: int
    """In-band Put/Get streams of one (non-admin) principal running at once."""
    tenant_calls: int
    """Calls of all non-admin principals together (``workers - admin_workers``)."""
    max_concurrent_rpcs: int
    """grpc's own bound: calls running or queued for a worker (``workers + max_queued_calls``)."""
    stream_idle_s: float
    """A stream that moves no message for this long is cancelled."""


def split_host_port(value: str) -> tuple[str, int]:
    """``"host:port"`` -> ``(host, port)``, an IPv6 host in brackets (``"[::1]:9464"`` ->
    ``("::1", 9464)``). InvalidArgument for anything else: a port outside 0..65535 (grpc would
    take 99999 modulo 65536 without a word), no host, an IPv6 address without brackets."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise InvalidArgument(f"{value!r} is not host:port with a port in 0..65535 (0 = pick one)")
    if host.startswith("["):
        inner = host[1:-1] if host.endswith("]") else ""
        try:
            ipaddress.IPv6Address(inner)
        except ValueError:
            raise InvalidArgument(f"{value!r}: {host!r} is not an IPv6 address in brackets "
                                  f"(e.g. [::1]:{port})") from None
        return inner, int(port)
    if ":" in host or "]" in host:
        raise InvalidArgument(f"{value!r}: an IPv6 address goes in brackets, e.g. [::1]:{port}")
    return host, int(port)


def _address(value: str | None) -> str | None:
    """``host:port`` (:func:`split_host_port`), or ``unix:/path`` (the gRPC address only)."""
    if value is None or value.startswith("unix:"):
        return value
    try:
        split_host_port(value)
    except InvalidArgument as exc:
        raise ValueError(str(exc)) from None
    return value


def _http_address(value: str | None) -> str | None:
    """``host:port`` (:func:`split_host_port`): the metrics endpoint is HTTP over TCP."""
    if value is not None and value.startswith("unix:"):
        raise ValueError(f"{value!r}: the metrics endpoint listens on host:port, not a unix socket")
    return _address(value)


Address = Annotated[str, AfterValidator(_address)]
HTTPAddress = Annotated[str, AfterValidator(_http_address)]


class MetricsConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    listen: HTTPAddress | None = "127.0.0.1:9464"
    """host:port of the Prometheus HTTP endpoint (an IPv6 host in brackets: ``[::1]:9464``);
    None (omit in TOML with enabled=false) = off."""

    enabled: bool = True
    """Serve metrics over HTTP."""

    allow_remote: bool = False
    """Serve them on a non-loopback address. Off: such a server refuses to start. The endpoint
    is plain HTTP (a bearer token travels in clear), and its labels name every tenant."""

    auth: Literal["token", "none"] = "token"
    """``token``: a scrape must send ``Authorization: Bearer <token>``, the token in
    ``token_file`` (Prometheus: ``authorization: {credentials_file: <token_file>}``); other
    requests get 401. ``none``: anyone who can connect reads every tenant's name and usage,
    tenants' processes on this host included (their own Stats shows them only themselves)."""

    token_file: OptionalUserPath = None
    """The scrape token's file (one line; only this user may read it); None =
    ``<store.path>/metrics.token``. Made with a new random token (mode 0600) when missing; its
    directory must exist (NOTE: the example above named /etc/kvstore/, which a fresh host lacks:
    it failed as written)."""

    max_tenant_labels: Annotated[Int, Field(ge=0, le=100_000)] = MAX_TENANT_LABELS
    """Tenants (and shared namespaces) with their own ``tenant`` label value at once, in the
    per-tenant series (lookups, saved prefill tokens, bytes per tier, quota refusals
    ``resource="quota:TENANT:TIER"``); the others are counted together under
    ``tenant="_other"``, so a metric's sum over its series stays the total. A tenant keeps
    its place until it is deleted (its series go then). Why: each tenant label value is ~9
    series, and uncapped, 50,000 tenants made 450,019 series, a 32 MB scrape taking 7 s, the
    sidecar's memory and Prometheus's growing with every tenant (:mod:`kvstore.metrics`).
    0 = every tenant under ``_other``; at most 100,000."""


class ServerConfig(BaseModel):
    """Everything ``kvstore serve`` needs."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    store: StoreConfig
    """The embedded Store's configuration (``[store]`` table)."""

    listen: Address = DEFAULT_LISTEN
    """gRPC address: ``host:port`` (port 0 = pick one) or ``unix:/path/to.sock``."""

    allow_insecure_remote: bool = False
    """Allow plaintext on a non-loopback address. Off: such a server refuses to start without TLS."""

    tls: TLSConfig | None = None
    """TLS/mTLS settings; None = plaintext (loopback/unix only unless allowed above)."""

    workers: Annotated[Int, Field(ge=1, le=1024)] = 16
    """Threads serving RPCs (each stream holds one while it runs)."""

    copy_threads: Annotated[Int, Field(ge=1, le=64)] = 2
    """Threads that copy one shared-memory Put's or Get's blocks between the client's region
    and the memory tiers (the RPC's own thread is one of them; 1 = it alone). The copies run
    outside the Store's lock either way. On the 2-core development machine, one client, 32
    blocks of 2 MiB per call, three sidecars in one run (two runs, GB/s put/get): the locked
    single copy of before 3.88/4.15 and 4.63/5.18, 1 thread 3.48/4.50 and 4.41/5.41, 2 threads
    4.53/5.52 and 4.71/5.90."""

    torch_threads: Annotated[Int, Field(ge=0, le=1024)] = 1
    """torch intra-op threads of ``kvstore serve`` (0 = torch's default). Block copies are
    memory-bound; extra intra-op threads slowed 2 MiB copies by an order of magnitude whenever
    another core was busy (measured on the 2-core development machine)."""

    streaming_copy_bytes: Annotated[ByteCount, Field(ge=0, lt=1 << 62)] = 1 << 20
    """glibc's non-temporal threshold for ``kvstore serve``: copies of at least this many bytes
    use streaming stores (2 MiB block copies ran at 8.8–9.2 instead of 5.6–5.8 GB/s on the
    development machine, ``python -m bench.copy_bench``; :mod:`kvstore.memtune`). Set at start through ``GLIBC_TUNABLES`` (the server
    re-executes itself once); 0 keeps glibc's default, and a threshold already set in
    ``GLIBC_TUNABLES`` is kept. No effect off glibc/x86-64. At least 16448 when not 0."""

    limits: LimitsConfig = LimitsConfig()
    """Per-call bounds."""

    metrics: MetricsConfig = MetricsConfig()
    """Prometheus endpoint."""

    audit_fsync: bool = True
    """fsync every audit entry (admin actions and deletions are durable before the reply)."""

    local_data_plane: bool = True
    """Accept shared-memory region registration from same-host clients. False: RegisterRegion
    is refused FAILED_PRECONDITION (as with ``limits.max_regions_per_principal = 0``, which
    :attr:`limits` then holds) and clients move blocks over the in-band streams; a client
    that chose shared memory itself (a local target) falls back to them, one built with
    ``local=True`` fails."""

    expire_interval_s: Annotated[Float, Field(ge=0, le=86400, allow_inf_nan=False)] = 30.0
    """Seconds between sweeps that delete expired blocks from every tier (0 = no sweeper;
    expired blocks are invisible to lookups either way); at most a day."""

    grace_s: Annotated[Float, Field(ge=0, le=3600, allow_inf_nan=False)] = 5.0
    """On shutdown, how long in-flight calls may finish: finite seconds, at most an hour (an
    infinite grace made grpc's stop raise OverflowError at SIGINT)."""

    drain_s: Annotated[Float, Field(ge=0, le=3600, allow_inf_nan=False)] = 60.0
    """On shutdown, after ``grace_s``, how long to wait for handlers still running (grpc
    cancels their calls but cannot stop their threads: a delete in its Redis part, say) before
    the audit log and the Store close under them; one still running then is logged, and its
    outcome may be missing from the audit log. At most an hour."""

    @model_validator(mode="after")
    def _streaming_copy_threshold(self) -> ServerConfig:
        if 0 < self.streaming_copy_bytes < STREAMING_COPY_MIN:
            raise ValueError(f"streaming_copy_bytes must be 0 or at least {STREAMING_COPY_MIN} "
                             f"(glibc's minimum)")
        return self

    @model_validator(mode="after")
    def _local_data_plane_off(self) -> ServerConfig:
        # NOTE: the field was read nowhere (regions were registered and used with it false).
        # Off is what the region table already does at max_regions_per_principal = 0 (the
        # limit the data plane is built with): no region is taken, FAILED_PRECONDITION
        if not self.local_data_plane and self.limits.max_regions_per_principal:
            object.__setattr__(self, "limits", self.limits.model_copy(update={"max_regions_per_principal": 0}))
        return self

    @model_validator(mode="after")
    def _call_limits_fit(self) -> ServerConfig:
        limits, workers = self.limits, self.workers
        if limits.admin_workers is not None and limits.admin_workers >= workers:
            raise ValueError(f"limits.admin_workers={limits.admin_workers} must be below workers={workers}")
        c = self.call_limits
        if limits.max_calls_per_principal is not None and c.calls_per_principal > c.tenant_calls:
            raise ValueError(f"limits.max_calls_per_principal={c.calls_per_principal} must be at most workers - "
                             f"admin_workers = {c.tenant_calls}")
        if limits.max_streams_per_principal is not None and c.streams_per_principal > c.calls_per_principal:
            raise ValueError(f"limits.max_streams_per_principal={c.streams_per_principal} must be at most "
                             f"max_calls_per_principal={c.calls_per_principal}")
        return self

    @property
    def call_limits(self) -> CallLimits:
        """The ``limits`` on concurrent calls, their defaults worked out from ``workers``."""
        limits, workers = self.limits, self.workers
        admin = limits.admin_workers
        if admin is None:
            admin = 0 if workers == 1 else max(1, workers // 8)
        tenants = max(1, workers - admin)
        calls = limits.max_calls_per_principal or min(tenants, max(1, workers // 2))
        streams = limits.max_streams_per_principal or min(calls, max(1, workers // 4))
        queued = workers if limits.max_queued_calls is None else limits.max_queued_calls
        return CallLimits(calls_per_principal=calls, streams_per_principal=streams, tenant_calls=tenants,
                          max_concurrent_rpcs=workers + queued, stream_idle_s=limits.stream_idle_s)

    @property
    def data_dir(self) -> Path:
        return Path(self.store.path)

    @property
    def auth_file(self) -> Path:
        return self.data_dir / "auth.json"

    @property
    def audit_file(self) -> Path:
        return self.data_dir / "audit.log"

    @property
    def metrics_token_file(self) -> Path:
        return self.metrics.token_file or self.data_dir / "metrics.token"


def default_data_dir(env: dict[str, str] | None = None, cwd: Path | None = None) -> Path:
    """``$KVSTORE_HOME``, else ``./.kvstore`` if the cwd is writable, else ``~/.local/share/kvstore``."""
    env = dict(os.environ) if env is None else env
    if env.get("KVSTORE_HOME"):
        return Path(env["KVSTORE_HOME"]).expanduser()
    cwd = Path.cwd() if cwd is None else cwd
    if os.access(cwd, os.W_OK):
        return cwd / ".kvstore"
    base = Path(env.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    return base / "kvstore"


def build(data: dict[str, Any], *, data_dir: Path | None = None) -> ServerConfig:
    """Validate a config mapping; ``store.path`` defaults to ``data_dir`` or :func:`default_data_dir`."""
    data = dict(data)
    store = data.get("store")
    if store is None:
        store = {}
    elif isinstance(store, StoreConfig):
        store = store.model_dump()
    elif not isinstance(store, dict):  # a list of pairs would pass dict(): not a table either
        raise InvalidArgument(f"bad server config: store: must be a table ([store]), got {type(store).__name__} "
                              f"{store!r:.80}")
    store = dict(store)
    store.setdefault("path", str(data_dir or default_data_dir()))
    data["store"] = store
    try:
        return ServerConfig(**data)
    except ValidationError as exc:
        raise validation_error("bad server config", exc) from None


def load(path: str | Path | None = None, *, data_dir: Path | None = None,
         overrides: dict[str, Any] | None = None) -> ServerConfig:
    """Load ``path`` (TOML), or the embedded defaults when None; ``overrides`` win over the file."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except OSError as exc:
            raise InvalidArgument(f"cannot read config {path}: {exc}") from None
        except tomllib.TOMLDecodeError as exc:
            raise InvalidArgument(f"bad TOML in {path}: {exc}") from None
        except UnicodeDecodeError as exc:
            raise InvalidArgument(f"config {path} is not UTF-8 text (TOML must be): byte "
                                  f"{exc.object[exc.start:exc.start + 1]!r} at offset {exc.start}") from None
    for key, value in (overrides or {}).items():
        if value is not None:
            data[key] = value
    return build(data, data_dir=data_dir)
