"""Store: the tiered KV-cache store (in-process API).

Primitives and what each guarantees (see DESIGN.md §7 for the invariants):

* ``put``     — writes the blocks of a key chain, all or nothing: on any error every block the
  call inserted is removed again. New blocks land in the fastest enabled tier that can make
  room (session blocks must land in HBM); the tier of a block is never faster than its parent's.
* ``lookup``  — the longest usable prefix of a chain (all ancestors present, visible, same
  fingerprint, not expired) and the tier of each block. Never another tenant's blocks.
* ``get``     — the bytes of the longest usable prefix, bit-exact; blocks found below HBM are
  promoted (copied up; an NVMe copy is kept so a crash cannot lose a committed block). A block
  that fails its integrity check is a miss, is deleted, and is counted. Both are in
  :mod:`kvstore.store_reads`.
* eviction    — when a tier would pass its high watermark, the policy ranks the evictable
  leaves (unpinned, not in flight) and the Store demotes or drops them down to the low
  watermark; moves are two-phase (in flight → published or aborted).
* sessions    — ACTIVE/RESUMED pin their blocks in HBM; PAUSED demotes them to DRAM and keeps
  them; CLOSED unpins them (:mod:`kvstore.store_sessions`, with ``prefetch``). ``expire`` pauses
  a session unused for ``session_idle_pause_s`` and closes one unused for
  ``session_idle_close_s`` (a client gone without closing it pinned HBM for good). Sessions do
  not survive :meth:`close` / a restart: their blocks come back as ordinary blocks (unpinned),
  and a session verb or ``put(session=)`` naming one is NotFound, saying so.
* TTL/quotas  — per tenant; expired blocks are invisible and deleted from every tier; a tenant
  over quota evicts its own blocks first, never another tenant's. The rules, ``expire`` and the
  verbs that delete blocks, tenants and models are in :mod:`kvstore.store_admin`.
* remote      — with ``StoreConfig.remote``, blocks leaving the last local tier (or every new
  block, ``remote_write="through"``) are queued to Redis/Valkey; lookups and gets continue into
  it where the local chain ends and promote what they find. A delete or model purge on another
  server sharing it drops the local copies here too (``_deleted_elsewhere``).
* chains      — ``parent=`` continues a chain split across calls; keys must chain from it.
* roots       — ``put(roots=True)``, :meth:`lookup_roots`, :meth:`get_roots_into` and
  :meth:`lease_roots` take keys that are independent root blocks (each its own one-block
  prefix, no parent links), as an engine keying its pages itself has them (SGLang's HiCache):
  one call answers, stores or serves many of them, exactly as one call per key would.
* reserve/commit_put — a put whose bytes arrive later (the gRPC stream) lands them in reserved
  tier slots and publishes the slots without a copy (:mod:`kvstore.store_reserve`).
* lease_prefix — a get whose reader reads the blocks in place, outside the lock (the gRPC
  stream): pinned and never freed until released (:mod:`kvstore.store_lease`).

Quantized NVMe and remote copies (opt-in per tenant/model) are the one exception to bit-exact gets.
Thread-safe: one lock owns the index and every pool; every public call that writes to NVMe
commits before it returns: one LMDB transaction (one sync), or, for a put or flush of many
blocks bound for NVMe, one every few MiB while the next blocks are encoded (tiers.nvme).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Self

import torch

from kvstore.block import BlockMeta, Tier
from kvstore.block_buffers import block_views, kv_blocks
from kvstore.config import StoreConfig
from kvstore.dirlock import LOCK_NAME, DirLock
from kvstore.errors import (
    Aborted,
    FailedPrecondition,
    InvalidArgument,
    NVMeWriteFailed,
    ParentNotStored,
    ResourceExhausted,
    Unauthenticated,
)
from kvstore.expiry import check_ttl
from kvstore.index import Ident, PrefixIndex
from kvstore.keys import ROOT_KEY, block_keys, check_chain, check_keys
from kvstore.memtune import retain_freed_memory
from kvstore.placement import Placement
from kvstore.sessions import SessionTable
from kvstore.sizes import format_size
from kvstore.spec import ModelSpec, check_fingerprint, check_spec
from kvstore.stats import Counters, store_counter_names
from kvstore.store_admin import TenantAdmin, TenantPolicy
from kvstore.store_lease import LeasedGets
from kvstore.store_reads import LookupResult, ReadPath
from kvstore.store_reserve import ReservedPuts, _parent, check_roots
from kvstore.store_sessions import SessionPins
from kvstore.validation import check_text
from kvstore.victims import CloseVictims
from tiers.base import BlockRef
from tiers.memory import (
    MemoryTier,
    default_device,
    dram_tier,
    hbm_tier,
    usable_device,
)
from tiers.nvme import NVMeTier
from tiers.remote import RemoteTier

Clock = Callable[[], float]
log = logging.getLogger(__name__)
#: ``progress(done, total)``: blocks handled so far of all, by Store.open (the index rebuilt
#: from NVMe, every RECOVERY_STEP blocks) and Store.flush / close (committed to NVMe, every
#: FLUSH_STEP blocks); called at the end too, when there was anything to do
Progress = Callable[[int, int], None]
RECOVERY_STEP = 8192
FLUSH_STEP = 64

__all__ = ["LookupResult", "Store"]  # LookupResult lives in kvstore.store_reads


@dataclass(slots=True)
class PlacedPut:
    """A put's blocks, set by the put once every one is placed (see :meth:`Store._put_batch`)."""

    blocks: list[BlockMeta] | None = None


def _later(a: float | None, b: float | None, cap: float | None = None) -> float | None:
    """The later of two TTL deadlines, None meaning never, but no later than ``cap`` (None: no
    cap). NOTE: a re-put under a tenant's TTL kept a block's longer deadline, or its none."""
    later = None if a is None or b is None else max(a, b)
    return cap if cap is not None and (later is None or later > cap) else later


class Store(ReadPath, ReservedPuts, LeasedGets, SessionPins, TenantAdmin):
    """Use :meth:`Store.open`; see the module docstring for the contracts."""

    def __init__(self, config: StoreConfig, *, clock: Clock = time.time,
                 progress: Progress | None = None, dir_lock: DirLock | None = None) -> None:
        from policy import make_policy
        from policy.quantization import QuantizationPolicy

        self.config = config
        if config.retain_freed_memory:
            retain_freed_memory()
        self._clock = clock
        self._lock = threading.RLock()
        self._closed = False
        self.quant_policy = QuantizationPolicy.from_names(config.nvme_quantization)
        self._index = PrefixIndex()
        self._specs: dict[bytes, ModelSpec] = {}
        self._sessions = SessionTable(clock)  # dates each session's last use (idle expiry)
        self._tenant_policy: dict[str, TenantPolicy] = {}
        self._model_ttl: dict[bytes, float] = {}  # fingerprint -> its TTL (set_model_ttl)
        # drop_tenant calls so far, and the count at each tenant's last drop (see drop_epoch),
        # and at its last drop that deleted the tenant (not only a namespace's blocks)
        self._drop_epoch = 0
        self._dropped_at: dict[str, int] = {}
        self._deleted_at: dict[str, int] = {}
        # delete / drop_tenant / purge_model calls so far: a get promotes what it fetched from
        # the remote tier (with the lock released) only when none ran meanwhile (store_reads)
        self._removals = 0
        # deletes running their remote part without the lock: close waits for them
        self._deletes_open = 0
        self._deletes_done = threading.Condition(self._lock)
        self.counters = Counters(names=store_counter_names())  # each exported from the start, at 0
        #: memory blocks :meth:`close` could not commit to NVMe (see there)
        self.uncommitted_at_close = 0
        self.policy = make_policy(config.policy, self._specs.get)

        path = config.path
        try:
            path.mkdir(parents=True, exist_ok=True, mode=0o700)  # other users: not even metadata
        except OSError as exc:  # NOTE: a read-only file system gave a raw OSError
            if dir_lock is not None:
                dir_lock.release()
            raise FailedPrecondition(f"cannot make the store directory {path}: {exc.strerror or exc}") from None
        if dir_lock is not None and dir_lock.path != path / LOCK_NAME:
            dir_lock.release()
            raise InvalidArgument(f"the directory lock given ({dir_lock.path}) is not {path}'s")
        self._dir_lock = dir_lock if dir_lock is not None else DirLock(path)
        try:
            self._open_tiers(config, clock, progress)
        except BaseException:
            # NOTE: the tiers opened before the failure close too: a refused open (the other
            # encrypt setting, a wrong master key) left the remote tier's threads and
            # connections running, and the NVMe environment open
            for tier in (getattr(self, "_remote", None), getattr(self, "_nvme", None)):
                if tier is not None:
                    try:
                        tier.close()
                    except Exception:  # the open's own error goes on
                        log.warning("closing %s after a failed open failed", type(tier).__name__, exc_info=True)
            self._dir_lock.release()
            raise

    def _open_tiers(self, config: StoreConfig, clock: Clock, progress: Progress | None) -> None:
        """The tiers, the codec and the placement; the index rebuilt from NVMe."""
        from kvstore.codec import Codec, CodecConfig
        from kvstore.keyring import DEFAULT_ENV_VAR, Keyring, load_master_key

        path = config.path
        self._mem: dict[Tier, MemoryTier] = {}
        device = usable_device(config.device) if config.device else default_device()
        self.device = device
        if config.hbm_bytes:
            self._mem[Tier.HBM] = hbm_tier(config.hbm_bytes, device)
        if config.dram_bytes:
            self._mem[Tier.DRAM] = dram_tier(config.dram_bytes)
        self._nvme: NVMeTier | None = None
        self._nvme_batch_open = False  # an NVMe batch is open (see _nvme_batch)
        self._remote: RemoteTier | None = None
        self.keyring = None
        master = None
        if config.nvme_bytes or config.remote is not None:
            key_file = config.master_key_file or path / "master.key"
            # NOTE: never a new key beside a keyring made with another: it could not unwrap the
            # tenants' data keys, and writing it would leave the operator to overwrite it again
            # when restoring the real one
            keyring_made = (path / "nvme" / "keys" / "data.mdb").exists()
            try:
                master = load_master_key(config.master_key, key_file=key_file, create=not keyring_made)
            except InvalidArgument as exc:
                if not keyring_made:
                    raise
                raise FailedPrecondition(
                    f"no master key, but {path / 'nvme'} holds data keys wrapped with one: restore "
                    f"{key_file} (or pass the key: master_key, ${DEFAULT_ENV_VAR}); a new key would "
                    f"not open them ({exc})") from None
        if config.remote is not None:
            assert master is not None
            self._remote = RemoteTier.open(config.remote, master, clock=clock)
        if config.nvme_bytes:
            assert master is not None
            self._nvme = NVMeTier(path / "nvme", config.nvme_bytes, durable=config.durable)
            # NOTE: before the keyring and recovery: a store reopened with the other encrypt
            # setting lost its blocks (deleted at their first get, or dropped at open as blocks
            # of deleted tenants); now the open is refused, nothing read or dropped
            self._nvme.check_encrypt(config.encrypt)
            self.keyring = Keyring(master, self._nvme.key_backend())
            self._nvme.codec = Codec(
                CodecConfig(compression_level=config.compression_level,
                            encrypt=config.encrypt, threads=config.codec_threads,
                            min_compress_ratio=config.min_compress_ratio),
                self.keyring if config.encrypt else None)
        self._place = Placement(config=config, clock=clock, index=self._index, specs=self._specs,
                                mem=self._mem, nvme=self._nvme, policy=self.policy,
                                counters=self.counters, sessions=self._sessions,
                                quotas=self._quota, quant_policy=self.quant_policy,
                                remote=self._remote, priorities={})
        self.tiers = self._place.tiers
        self.disk_warning: str | None = None
        if self._nvme is not None:
            self._recover(progress)
            room, need = self._nvme.disk_room()
            if room < need:
                self.disk_warning = (
                    f"nvme_bytes is {format_size(config.nvme_bytes)}, but the disk of {self._nvme.path} "
                    f"can take only {format_size(room)} more: NVMe writes will fail (RESOURCE_EXHAUSTED) "
                    f"before the tier fills; lower nvme_bytes or free space there")
                log.warning("%s", self.disk_warning)
        if self._remote is not None:  # NOTE: last: the reader calls into the Store from now on
            self._remote.on_deletion(self._deleted_elsewhere, position=path / "remote-deletions.pos")

    @classmethod
    def open(cls, config: StoreConfig, *, clock: Clock = time.time, progress: Progress | None = None,
             dir_lock: DirLock | None = None) -> Store:
        """Open (or create) the store at ``config.path``; rebuilds the index from NVMe
        (about 25 µs a block on a 2-core CPU: a million blocks take tens of seconds), calling
        ``progress(done, total)`` every :data:`RECOVERY_STEP` blocks and at the end when there
        are any. ``dir_lock``: the directory's lock, taken already by the caller (the sidecar,
        before it opens its own files there); the Store owns it from then on, and releases it
        at :meth:`close` or when the open fails."""
        return cls(config, clock=clock, progress=progress, dir_lock=dir_lock)

    # -- recovery -----------------------------------------------------------------------------
    def _recover(self, progress: Progress | None) -> None:
        assert self._nvme is not None
        # a delete that met a damaged page of the LMDB file (the block is gone all the same)
        self._nvme.on_damage = lambda: self.counters.add("nvme_damaged_deletes")
        records = self._nvme.records()
        # tenants with a data key: a block of any other tenant cannot be decrypted (its tenant
        # was deleted, and a crash came between the key's destruction and the blocks' deletion)
        keyed = set(self.keyring.tenants()) if self.keyring is not None and self.config.encrypt else None
        # tenants whose deletion a crash interrupted once their key was condemned: no key to
        # tenants() (their blocks go as keyless), and their key goes after (Keyring.condemn)
        condemned = self.keyring.condemned() if self.keyring is not None else []
        keyless: list[tuple[str, bytes]] = []
        unreadable: list[tuple[str, bytes]] = []
        if progress is not None and records:  # NOTE: the first report came RECOVERY_STEP blocks in
            progress(0, len(records))
        for i, (rec, spec) in enumerate(records, 1):
            if progress is not None and (i % RECOVERY_STEP == 0 or i == len(records)):
                progress(i, len(records))
            if keyed is not None and rec.tenant not in keyed:
                keyless.append((rec.tenant, rec.key))
                continue
            if spec is None:  # NOTE: before, such blocks stayed on disk, counted against
                unreadable.append((rec.tenant, rec.key))  # nvme_bytes, in no index: never evicted
                continue
            self._specs.setdefault(rec.fingerprint, spec)
            meta = BlockMeta(key=rec.key, tenant=rec.tenant, fingerprint=rec.fingerprint,
                             parent=rec.parent, depth=rec.depth, nbytes=rec.nbytes,
                             tokens=rec.tokens, tier=Tier.NVME, created=rec.created,
                             last_access=rec.created, ttl_deadline=rec.ttl_deadline,
                             persisted=True)
            self._index.add(meta)
            self._place.charge(meta, Tier.NVME, +1)
            self.policy.on_insert(meta, rec.created)
        # keyless: before, such blocks were announced by lookups, missed by gets, and a put of
        # the same prompt took them for stored and wrote nothing
        with self._nvme.batch():
            for tenant, key in (*keyless, *unreadable):
                self._nvme.delete_key(tenant, key)
            damaged = self._nvme.drop_damaged()
        if condemned:  # NOTE: before, such a key stayed for good (a tenant created again got it)
            assert self.keyring is not None
            for tenant in condemned:
                self.keyring.destroy(tenant)
            log.warning("destroyed the data keys of %d tenants whose deletion was interrupted", len(condemned))
        if keyless:
            self.counters.add("keyless_dropped", len(keyless))
            log.warning("dropped %d blocks of deleted tenants (no data key): a tenant deletion was "
                        "interrupted", len(keyless))
        if unreadable or damaged:
            self.counters.add("unreadable_dropped", len(unreadable) + damaged)
            log.warning("dropped %d NVMe blocks whose record (%d) or model spec (%d) could not be read",
                        len(unreadable) + damaged, damaged, len(unreadable))
        # A block whose ancestor was never committed (it lived above NVMe at a crash) can
        # never be part of a usable prefix: drop it and its subtree.
        for meta in sorted(self._index, key=lambda m: m.depth):
            if self._index.get(meta.tenant, meta.key) is not meta or meta.parent == ROOT_KEY:
                continue
            if self._index.get(meta.tenant, meta.parent) is None:
                self._place.drop(meta, reason="orphans_dropped")

    # -- helpers ------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise FailedPrecondition("store is closed")

    def _batch(self) -> Any:
        """One NVMe write transaction (and one sync) for a whole public call."""
        self._check_open()
        return self._nvme_batch() if self._nvme is not None else nullcontext()

    @contextmanager
    def _nvme_batch(self) -> Iterator[None]:
        """:meth:`NVMeTier.batch`; when a commit fails, the blocks it did not store leave the
        index (or lose their NVMe copy) before the error goes on to the caller."""
        assert self._nvme is not None
        if self._nvme_batch_open:
            # NOTE: an inner batch (a put inside commit_put's) joins the outer one, which counts
            # and handles a failure once: both did, and one failed commit counted twice
            yield
            return
        self._nvme_batch_open = True  # under the lock, as every batch is
        try:
            with self._nvme.batch():
                yield
        except NVMeWriteFailed as exc:
            self.counters.add("nvme_commit_failures")
            self._forget_unwritten(exc.lost)
            raise
        finally:
            self._nvme_batch_open = False

    @contextmanager
    def _put_batch(self, tenant: str) -> Iterator[PlacedPut]:
        """The lock and NVMe batch of one put of ``tenant`` (:meth:`_put`, :meth:`commit_put`):
        the body sets ``blocks`` of the :class:`PlacedPut` it is given once every block of the
        put is placed. When the batch's commit then fails (NVMeWriteFailed) but each of them is
        still indexed as placed, the commit lost only other blocks the put pushed down to NVMe
        (dropped and counted by :meth:`_nvme_batch`): the put succeeded, and the failure is
        logged instead of raised.

        NOTE: a commit that failed after every block of the put was placed may have hit only
        other blocks; an engine told the put failed would recompute for nothing (and a server
        answered RESOURCE_EXHAUSTED for a put whose blocks were stored and pinned, while
        Store.put answered OK: only :meth:`_put` made this check)."""
        placed = PlacedPut()
        try:
            with self._lock, self._batch():
                yield placed
        except NVMeWriteFailed as exc:
            with self._lock:
                if placed.blocks is None or not all(self._index.get(tenant, m.key) is m for m in placed.blocks):
                    raise
            log.warning("put stored its %d blocks, but %s", len(placed.blocks), exc)

    def _forget_unwritten(self, lost: Sequence[tuple[str, bytes]]) -> None:
        """Drop from the index what an NVMe commit that failed did not store: a block living
        in NVMe only (with its subtree, unusable without it), or a memory block's NVMe copy."""
        for tenant, key in lost:
            m = self._index.get(tenant, key)
            if m is None or not (m.persisted or m.tier == Tier.NVME):
                continue
            try:
                self._place.lost(m, reason="nvme_write_failures")
            except NVMeWriteFailed:  # a delete of a descendant failed too: it stays on disk,
                log.warning("could not delete a block below one NVMe did not store")  # not indexed

    def _quota(self, tenant: str, tier: Tier) -> int | None:
        pol = self._tenant_policy.get(tenant)
        return pol.quota_bytes.get(tier) if pol else None

    def _ttl_cap_s(self, tenant: str, fingerprint: bytes) -> float | None:
        """The most TTL a block of ``tenant`` and model ``fingerprint`` gets: the lesser of
        the tenant's policy TTL and the model's (:meth:`set_model_ttl`); None: no bound."""
        pol = self._tenant_policy.get(tenant)
        caps = [c for c in (pol.ttl_s if pol is not None else None, self._model_ttl.get(fingerprint))
                if c is not None]
        return min(caps) if caps else None

    def _ttl_deadline(self, tenant: str, ttl_s: float | None, now: float, fingerprint: bytes) -> float | None:
        """The deadline of a block put now with ``ttl_s``: the tenant's policy TTL and the
        model's TTL are an upper bound (an operator's retention limit that a put cannot lift;
        before, any ``ttl_s`` a tenant sent replaced it), and the default where the put gives
        none."""
        cap = self._ttl_cap_s(tenant, fingerprint)
        if ttl_s is None:
            ttl_s = cap if cap is not None else self.config.default_ttl_s
        elif cap is not None:
            ttl_s = min(ttl_s, cap)
        return None if ttl_s is None else now + ttl_s

    def _register_spec(self, spec: ModelSpec) -> None:
        self._check_spec(spec)
        self._specs.setdefault(spec.fingerprint, spec)

    @staticmethod
    def _check_spec(spec: Any) -> None:
        check_spec(spec)  # NOTE: one check, the client's too

    @property
    def drop_epoch(self) -> int:
        """A counter :meth:`drop_tenant` advances: read it before checking a caller's right to
        write a tenant's blocks and pass it to :meth:`reserve_put` as ``since``."""
        return self._drop_epoch

    def _check_not_dropped(self, tenant: str, since: int) -> None:
        """Unauthenticated when ``tenant`` was deleted after epoch ``since``; Aborted (retry)
        when only its blocks were dropped then (``drop_tenant(namespace_stays=True)``: a shared
        namespace wiped by an admin, its publishers and grants kept). Caller holds the lock."""
        if self._deleted_at.get(tenant, -1) > since:
            raise Unauthenticated(f"tenant {tenant!r} was deleted while this call ran: nothing was stored")
        if self._dropped_at.get(tenant, -1) > since:
            # NOTE: this was Unauthenticated too, though the caller's token and rights were intact
            # and the same call made again succeeded
            raise Aborted(f"the blocks of namespace {tenant!r} were dropped (by an admin) while this "
                          f"call ran: nothing was stored; the namespace is still there, retry the call")

    @staticmethod
    def _check_tenant(tenant: str) -> None:
        if not isinstance(tenant, str) or not tenant or len(tenant) > 256:
            raise InvalidArgument("tenant must be a non-empty string of at most 256 characters")
        check_text("tenant", tenant)  # NOTE: encoded into keys and NVMe records (see check_text)

    @staticmethod
    def _check_fingerprint(fingerprint: Any) -> bytes:
        return check_fingerprint(fingerprint)

    # -- keys ---------------------------------------------------------------------------------
    def block_keys(self, tenant: str, spec: ModelSpec, token_ids: Any,
                   extra_keys: Sequence[Any] | None = None) -> list[bytes]:
        """Chained keys of every full block of ``token_ids`` in ``tenant``'s namespace."""
        self._check_tenant(tenant)
        self._check_spec(spec)
        return block_keys(tenant, spec.fingerprint, spec.block_tokens, token_ids, extra_keys)

    # -- put ----------------------------------------------------------------------------------
    def put(self, tenant: str, spec: ModelSpec, keys: Sequence[bytes], kv: torch.Tensor, *,
            session: str | None = None, ttl_s: float | None = None,
            parent: bytes | None = None, roots: bool = False) -> None:
        """Store ``kv`` ([len(keys), 2, L, H, T, D] of the spec's dtype) under the key chain.

        ``parent``: the stored block ``keys[0]`` continues from, to split a long chain across
        calls (default: ``keys[0]`` is the first block of a prefix). ``roots``: the keys are
        not a chain but independent root blocks (no parent links, each block placed as the
        first of a prefix); all or nothing as a chain's put, and no ``parent``."""
        self._check_tenant(tenant)
        self._check_spec(spec)
        keys = check_keys(keys)
        kv = kv_blocks(spec, kv, len(keys))  # the client checks its kv with the same function
        if not keys:  # NOTE: after the tenant check, and not on a closed store (it returned quietly)
            self._check_open()
            return
        flat = kv.detach().contiguous().view(torch.uint8).reshape(len(keys), -1)
        # NOTE: rows of a numpy view on CPU: indexing a torch tensor per block costs several
        # microseconds (a tenth of a 2 MiB block's copy), a numpy row a fraction of one.
        rows = flat.numpy() if flat.device.type == "cpu" else flat
        self._put(tenant, spec, keys, rows.__getitem__, session, ttl_s, _parent(parent), roots=roots)

    def put_bytes(self, tenant: str, spec: ModelSpec, keys: Sequence[bytes],
                  buffers: Sequence[Any], *, session: str | None = None,
                  ttl_s: float | None = None, parent: bytes | None = None, roots: bool = False) -> None:
        """Like :meth:`put`, each block given as a contiguous buffer of ``spec.block_nbytes``."""
        self._check_tenant(tenant)
        self._check_spec(spec)
        keys = check_keys(keys)
        views = block_views(spec, buffers, len(keys), "buffer")
        self._put(tenant, spec, keys, views.__getitem__, session, ttl_s, _parent(parent), roots=roots)

    def _put(self, tenant: str, spec: ModelSpec, keys: list[bytes], data: Callable[[int], Any],
             session: str | None, ttl_s: float | None, parent0: bytes = ROOT_KEY, *,
             roots: bool = False) -> None:
        self._check_tenant(tenant)
        check_roots(roots, parent0)
        check_chain(keys, roots=roots)
        ttl_s = check_ttl(ttl_s)
        with self._put_batch(tenant) as placed:
            placed.blocks = self._put_locked(tenant, spec, keys, data, session, ttl_s, parent0, roots)

    def _up_chain(self, blocks: Sequence[BlockMeta], top: Tier) -> list[BlockMeta]:
        """``blocks`` with every ancestor they continue from that lies below ``top``, each once,
        shallowest first: what :meth:`Placement.promote` takes to bring them all up to ``top``
        (no block above its parent). Under the lock."""
        chain = {(m.tenant, m.key): m for m in blocks}
        for m in blocks:
            p = self._index.get(m.tenant, m.parent)
            while p is not None and p.tier > top and (p.tenant, p.key) not in chain:
                chain[(p.tenant, p.key)] = p
                p = self._index.get(p.tenant, p.parent)
        return sorted(chain.values(), key=lambda m: m.depth)

    def _bring_up(self, m: BlockMeta, what: str) -> None:
        """Promote ``m`` with the ancestors it continues from into the top tier (ancestors
        first: no block sits above its parent); ResourceExhausted when they do not all fit (the
        tier is full of pinned blocks). Under the lock."""
        top = self.tiers[0]
        self._place.promote(self._up_chain([m], top), top)
        if m.tier > top:
            # NOTE: no count: the bytes pinned, every tenant's, told a tenant others' session use
            raise ResourceExhausted(f"cannot bring {what} into {top.label} (it is in {m.tier.label}): "
                                    f"{top.label} cannot make room (the rest of it is pinned by sessions "
                                    f"or in flight); retry once sessions close", resource=top.label)

    def _put_locked(self, tenant: str, spec: ModelSpec, keys: list[bytes], data: Callable[[int], Any],
                    session: str | None, ttl_s: float | None, parent0: bytes,
                    roots: bool = False) -> list[BlockMeta]:
        """The body of :meth:`_put` inside its lock and NVMe batch; returns the put's blocks
        once every one is placed. ``roots``: each key is a root
        (parent ROOT_KEY, depth 0, placed from the fastest tier down), not the next link."""
        self._check_open()
        self._register_spec(spec)
        sess = None
        if session is not None:
            sess = self._sessions.get(tenant, session)
        # NOTE: a PAUSED session's put is placed as any put is (not pinned, not held to HBM)
        # and parked with the session's other blocks: it was placed as pinned, in HBM only, so
        # it was refused with DRAM free while other sessions' pins filled HBM, and a re-put of
        # its parked blocks pulled them back up
        pinning = sess is not None and sess.pinning
        if sess is not None and not pinning:
            self._check_paused_put(tenant, sess, keys, spec.block_nbytes)
        now = self._clock()
        deadline = self._ttl_deadline(tenant, ttl_s, now, spec.fingerprint)
        inserted: list[BlockMeta] = []
        existing: list[BlockMeta] = []  # already stored: touched and re-timed on success
        held: list[BlockMeta] = []  # every block of the put, in order
        guarded: list[Ident] = []
        parent_tier, base_depth = self.tiers[0], 0
        pm = self._stored_parent(tenant, spec, parent0, now) if parent0 != ROOT_KEY else None
        lift: list[bytes] = []  # the ancestors a session put brings up with it
        if pinning and pm is not None and pm.tier > self.tiers[0]:
            lift = [m.key for m in self._up_chain([pm], self.tiers[0])]
        # NOTE: checked before the ancestors come up, as reserve_put does: bringing them up
        # first could evict other tenants' blocks for a put then refused
        self._refuse_what_cannot_fit(tenant, spec, [*lift, *keys], pm.tier if pm is not None else parent_tier,
                                     pinned=pinning, parent=pm, roots=roots)
        if pm is not None:
            if lift:
                # NOTE: session blocks live in the top tier and no block sits above its parent:
                # a parent demoted meanwhile (a shared prompt under other traffic) failed the put
                # as "could not be brought up", and nothing had tried to
                self._bring_up(pm, f"the block session {session!r} continues from")
            parent_tier, base_depth = pm.tier, pm.depth + 1
        # New blocks bound for NVMe are encoded ahead while the previous ones are written.
        with self._put_ahead(tenant, spec, keys, data, parent_tier):
            # NOTE: guarded here, next to the try whose finally lets go: a put refused
            # above, or whose encode-ahead failed to start, leaves its parent evictable
            if parent0 != ROOT_KEY and (tenant, parent0) not in self._place.protected:
                self._place.protected.add((tenant, parent0))
                guarded.append((tenant, parent0))
            try:
                for i, key in enumerate(keys):
                    parent = ROOT_KEY if roots else keys[i - 1] if i else parent0
                    if roots:
                        parent_tier = self.tiers[0]  # each root is placed as a prefix's first block
                    m = self._index.get(tenant, key)
                    if m is not None and self._place.expired(m, now):
                        self._place.drop(m, reason="expired")
                        m = None
                    if m is not None and (m.fingerprint != spec.fingerprint or m.parent != parent):
                        want = "roots must be keys no chain holds" if roots else \
                            "keys must be a chain from block_keys() for this spec"
                        raise InvalidArgument(f"key {i} is already stored with another fingerprint or parent: {want}")
                    if m is not None and pinning and m.tier > self.tiers[0]:  # session blocks live in HBM
                        m = self._bring_up_stored(m, f"block {i} of session {session!r}")
                    if m is None:
                        depth = 0 if roots else base_depth + i
                        m = self._place.insert_new(tenant, spec, key, parent, depth, data(i), now,
                                                   deadline, parent_tier, pinned=pinning,
                                                   refuse=self._refusal)
                        inserted.append(m)
                    else:
                        existing.append(m)
                    if (tenant, key) not in self._place.protected:
                        self._place.protected.add((tenant, key))
                        guarded.append((tenant, key))
                    held.append(m)
                    parent_tier = m.tier
                # NOTE: only once every block is placed: a failed put changes no TTL
                ttl_cap = self._ttl_cap_s(tenant, spec.fingerprint)  # the TTLs cap a re-put's deadline too
                cap = now + ttl_cap if ttl_cap is not None else None
                for m in existing:
                    self._place.touch(m, now)
                    later = _later(m.ttl_deadline, deadline, cap)
                    if later != m.ttl_deadline:
                        earlier = later is not None and (m.ttl_deadline is None or later < m.ttl_deadline)
                        m.ttl_deadline = later
                        if earlier:
                            self._index.deadline_moved(m)
                        if self._nvme is not None and (m.persisted or m.tier == Tier.NVME):
                            # NOTE: its NVMe record too: a restart read the old deadline there
                            # and dropped the block before the one it had been given
                            self._nvme.update_record(self._place.record(m))
                        if self._remote is not None:
                            # NOTE: and its remote copy (queued, behind a queued write of it):
                            # another server read the old deadline there and deleted it
                            self._remote.submit_ttl(self._place.ref(m), later, parent=m.parent)
                if sess is not None:
                    for m in held:
                        self._session_add(sess, m)
            except BaseException:
                self._unput(inserted)
                raise
            finally:
                self._place.protected.difference_update(guarded)
        self._published(inserted)
        if sess is not None and not pinning:
            self._park(held)  # DESIGN §5: a paused session's blocks wait in DRAM
        return held

    def _bring_up_stored(self, m: BlockMeta, what: str) -> BlockMeta | None:
        """:meth:`_bring_up` of a block a put names again; None when its stored value failed
        its integrity check on the way up and was dropped: the put holds its bytes and stores
        it anew. NOTE: such a put was refused as "cannot make room" in a tier that had room,
        and its retry succeeded. Under the lock."""
        try:
            self._bring_up(m, what)
        except ResourceExhausted:
            if self._index.get(m.tenant, m.key) is m:
                raise
        return m if self._index.get(m.tenant, m.key) is m else None

    def _stored_parent(self, tenant: str, spec: ModelSpec, parent: bytes, now: float) -> BlockMeta:
        """The stored block a put continues from (``parent``, not ROOT_KEY): visible, of the
        put's model, not expired; else ParentNotStored. The one check of every put path
        (:meth:`_put_locked`, :meth:`reserve_put`), made before any room is made. Lock held."""
        pm = self._index.get(tenant, parent)
        if (pm is None or pm.in_flight or pm.fingerprint != spec.fingerprint
                or self._place.expired(pm, now)):
            raise ParentNotStored(f"{ParentNotStored.PREFIX} (never put, evicted or expired): put "
                                  "the chain from its root")
        return pm

    def _refuse_what_cannot_fit(self, tenant: str, spec: ModelSpec, keys: Sequence[bytes], floor: Tier,
                                *, pinned: bool = False, parent: BlockMeta | None = None,
                                roots: bool = False) -> None:
        """ResourceExhausted, before anything is evicted, for a put whose new blocks outnumber
        what the tiers it may use could ever hold for this tenant (a put holds its own blocks
        until it ends, so such a put would evict everything it could and still fail), or what
        they could hold now, with pinned, in-flight and protected blocks where they are.
        ``parent``: the stored block ``keys[0]`` continues from. ``roots``: the keys are roots
        (a stored one sets no floor for the new ones).

        NOTE: it counted the put's new blocks only, as if the chain's stored blocks (which the
        put holds while it runs; a session put pins them in HBM) could be evicted for them, and
        as if NVMe took what memory could not besides the memory blocks (a block goes to NVMe
        only once its ancestors have copies there, the put's own blocks above it included):
        puts that could never fit evicted and demoted other tenants' blocks, then were
        refused. Now the chain (with every ancestor) is held where it is, the new blocks start
        no higher than the stored block they continue from, and NVMe must take them all with
        the copies (``Placement.room_now``)."""
        lift = pinned and Tier.HBM in self.tiers  # session blocks stored below HBM come up
        new = up = 0
        stored: list[BlockMeta] = [parent] if parent is not None else []
        before = parent  # the stored block the first new block continues from
        for k in keys:
            m = self._index.get(tenant, k)
            if m is None:
                new += 1
                continue
            stored.append(m)
            if not new and not roots:
                before = m
            if lift and m.tier > Tier.HBM:
                up += 1
        if not lift and before is not None:
            floor = max(floor, before.tier)  # the put's new blocks go no higher
        most = self._place.most_blocks(tenant, spec.block_nbytes, floor, pinned)
        tiers = [Tier.HBM] if lift else [t for t in self.tiers if t >= floor]
        if new > most:
            where = "hbm (session blocks)" if pinned else "the tiers it may use"
            # NOTE: say which quota binds, when one is set: "give the store more room" misled
            # an operator whose tenant had hit its own quota
            quotas = {t: q for t in tiers if (q := self._quota(tenant, t)) is not None}
            limit = ", ".join(f"{t.label}={format_size(q)}" for t, q in quotas.items())
            why = f"capacity, and its quota {limit}" if quotas else "capacity"
            bound = self._quota_bound(tenant, tiers, spec.block_nbytes, new, now=False)
            fix = "raise its quota (kvstore policy set)" if bound is not None else "give the store more room"
            if not most:
                raise self._refusal(tenant, bound, floor, (
                    f"a block of {spec.block_nbytes} bytes fits in none of {where} for tenant {tenant!r} "
                    f"({why}): {fix}"))
            raise self._refusal(tenant, bound, floor, (
                f"a put of {new} new blocks of {spec.block_nbytes} bytes can never fit: {where} hold "
                f"at most {most} of them for tenant {tenant!r} ({why}); "
                f"put fewer blocks at a time or {fix}"))
        under = None if lift else before
        room = self._place.room_now(tenant, spec.block_nbytes, floor, pinned, new + up, stored, under)
        if new + up > room:
            bound = self._quota_bound(tenant, tiers, spec.block_nbytes, new + up, now=True,
                                      pinned=pinned, held=stored, under=under)
            # NOTE: the message named how many blocks could be made: with the room other tenants'
            # sessions and puts hold, it told a tenant how much of a tier they held pinned (which
            # its Stats hide); only the tenant's own quota and usage are named now
            if bound is not None:
                quota = self._quota(tenant, bound) or 0
                own = self._place.tenant_usage.get((tenant, bound), 0)
                why = (f"its quota {bound.label}={format_size(quota)} binds (it holds {format_size(own)} "
                       f"there); raise its quota (kvstore policy set), close its sessions or put fewer "
                       f"blocks at a time")
            else:
                why = ("the room eviction could make is held by pinned (session) or in-flight blocks, or by "
                       "the stored blocks of this chain, which the put keeps; "
                       "retry once sessions close or puts end, or put fewer blocks at a time")
            raise self._refusal(tenant, bound, Tier.HBM if pinned else floor, (
                f"no room for {new + up} blocks of {spec.block_nbytes} bytes of tenant {tenant!r} in "
                f"{'hbm' if pinned else 'the tiers it may use'} now: {why}; nothing was evicted"))

    def _refusal(self, tenant: str, bound: Tier | None, tier: Tier, message: str) -> ResourceExhausted:
        """The error of a put refused up front (or by ``Placement.insert_new``, placing a
        block): by the quota of ``tenant`` in ``bound`` (resource ``quota:TENANT:TIER``,
        counted in ``quota_rejections``), else (``bound`` None) by the capacity of ``tier``
        (resource: its name)."""
        # NOTE: the refusals disagreed: one a quota caused was not counted (a put that could never
        # fit), another was labelled with the tier's name (a session put over its hbm quota), and
        # quota_rejections counted inside Placement.fit_quota, a policy change's included
        if bound is None:
            return ResourceExhausted(message, resource=tier.label)
        self.counters.add("quota_rejections")
        return ResourceExhausted(message, resource=f"quota:{tenant}:{bound.label}")

    def _quota_bound(self, tenant: str, tiers: Sequence[Tier], nbytes: int, need: int, *, now: bool,
                     pinned: bool = False, held: Sequence[BlockMeta] = (),
                     under: BlockMeta | None = None) -> Tier | None:
        """The tier whose quota refused a put of ``need`` blocks of ``nbytes`` of ``tenant`` in
        ``tiers``: the first whose quota holds the tenant to fewer blocks than its capacity
        would, when ``tiers`` would take ``need`` blocks were there no quotas; None when they
        would not (capacity refused it). ``now``: capacity as ``Placement.room_now`` counts it
        (less pinned, in-flight and protected blocks, and the chain of ``held``, with the NVMe
        copies ``under`` needs; ``tiers`` are those of its ``pinned`` and floor ``tiers[0]``);
        else an empty store's (``Placement.most_blocks``)."""
        chain = self._place.lineage(held) if now else []
        bound, room = None, 0
        for t in tiers:
            backend = self._place.backend(t)
            used, own = self._place._held(t, tenant, chain) if now else (0, 0)
            fit = max(backend.capacity - used, 0) // max(backend.charge(nbytes), 1)
            room += fit
            quota = self._quota(tenant, t)
            if bound is None and quota is not None and max(quota - own, 0) // max(nbytes, 1) < fit:
                bound = t
        if now and tiers:
            room = self._place.room_now(tenant, nbytes, tiers[0], pinned, need, held, under, quotas=False)
        return bound if room >= need else None

    def _unput(self, metas: list[BlockMeta]) -> None:
        """Roll back the blocks a failed put inserted (those still indexed as themselves)."""
        for m in reversed(metas):
            if self._index.get(m.tenant, m.key) is m:
                self._place.remove(m)

    def _published(self, metas: list[BlockMeta]) -> None:
        """Count the blocks a put made visible; queue them to the remote tier (write-through)."""
        self.counters.add("blocks_put", len(metas))
        if self._remote is not None and self.config.remote_write == "through":
            for m in metas:
                if self._index.get(m.tenant, m.key) is m:
                    self._place.spill_remote(m)

    def _put_ahead(self, tenant: str, spec: ModelSpec, keys: list[bytes],
                   data: Callable[[int], Any], parent_tier: Tier) -> AbstractContextManager[None]:
        """Encode-ahead of the new blocks of a put when NVMe is the only tier they can land in
        (the parent lives there, or NVMe is the fastest tier); the caller's bytes outlive it."""
        if parent_tier != Tier.NVME:
            return nullcontext()
        get = self._index.get
        return self._place.nvme_ahead([(BlockRef(tenant, k, spec), data(i))
                                       for i, k in enumerate(keys) if get(tenant, k) is None])

    # -- expiry -------------------------------------------------------------------------------
    def expire(self) -> int:
        """Delete every expired block from every tier (:meth:`TenantAdmin.expire`) and return
        how many; then pause the pinning sessions unused for ``config.session_idle_pause_s``
        and close those unused for ``config.session_idle_close_s`` (counted:
        ``sessions_idle_paused``, ``sessions_idle_closed``). The sidecar calls this every
        ``expire_interval_s``.

        NOTE: sessions had no expiry: a client gone without closing its session (a crash, a
        disconnect) kept its blocks pinned in HBM and its id counted against the tenant's
        session limit for as long as the store ran, and no verb of another principal could
        end it."""
        with self._lock, self._batch():
            n = super().expire()
            self._expire_idle_sessions(self._clock())
            return n

    def _expire_idle_sessions(self, now: float) -> None:
        """Close, then pause, the sessions :meth:`SessionTable.idle` names. Under the lock.
        A pause or close made here is no use of the session: its last use stays what it was
        (the close timer runs from the client's last call, not from the idle pause)."""
        cfg = self.config
        to_close, to_pause = self._sessions.idle(now, cfg.session_idle_pause_s, cfg.session_idle_close_s)
        for tenant, sess in to_close:
            self._end_session(tenant, sess.sid, f"closed after {now - sess.last_used:.0f} s unused "
                                                f"(session_idle_close_s)")
            self.counters.add("sessions_idle_closed")
        for tenant, sess in to_pause:
            last = sess.last_used
            try:
                self.pause_session(tenant, sess.sid)
            finally:
                sess.last_used = last
            self.counters.add("sessions_idle_paused")
        if to_close or to_pause:
            log.info("idle sessions: %d paused, %d closed", len(to_pause), len(to_close))

    # -- room: quotas, watermarks, eviction ---------------------------------------------------
    # -- moves (two-phase) --------------------------------------------------------------------
    # -- stats / lifecycle --------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Per tier used/capacity bytes and block counts, per tenant bytes per tier, plus the
        counters. A tenant's bytes are its blocks' nominal sizes (``spec.block_nbytes``: what
        quotas are checked against); a tier's ``used_bytes`` is what its allocator holds (the
        memory tiers round each slot up to 256-byte alignment), so the tenants of a tier can
        sum to less than its ``used_bytes``."""
        with self._lock:
            tiers = {}
            for t in self.tiers:
                u = self._place.backend(t).usage()
                tiers[t.label] = {"used_bytes": u.used_bytes, "capacity_bytes": u.capacity_bytes,
                                  "blocks": u.blocks}
            if self._nvme is not None:  # deleted, but no commit could delete them yet (full disk)
                tiers["nvme"]["deletions_pending"] = self._nvme.deletions_pending
            c = self.counters.snapshot()
            tenants: dict[str, dict[str, int]] = {}
            for (tenant, tier), n in self._place.tenant_usage.items():
                if n:
                    tenants.setdefault(tenant, {})[tier.label] = n
            if self._remote is not None:
                u = self._remote.usage()
                tiers["remote"] = {"used_bytes": u.used_bytes, "capacity_bytes": u.capacity_bytes,
                                   "blocks": u.blocks}
                c.update({f"remote_{k}": v for k, v in self._remote.metrics().items()})
                # NOTE: every tenant the remote tier holds bytes of: a tenant whose blocks had
                # all gone down to it had no row (it showed only next to local blocks)
                remote = self._remote.tenants_bytes()
                for tenant in {*tenants, *remote}:
                    tenants.setdefault(tenant, {})["remote"] = remote.get(tenant, 0)
            return {
                "tiers": tiers,
                "blocks": len(self._index),
                "sessions": len(self._sessions),
                "tenants": tenants,
                "hits": c.get("hits", 0),
                "misses": c.get("misses", 0),
                "evictions": c.get("evictions", 0),
                "demotions": c.get("demotions", 0),
                "promotions": c.get("promotions", 0),
                "integrity_failures": c.get("integrity_failures", 0),
                "counters": c,
                "policy": self.policy.name,
            }

    def flush(self, remote_timeout_s: float | None = 30.0, *, progress: Progress | None = None) -> int:
        """Commit an NVMe copy of every block above NVMe that has none, ancestors first, as far
        as the NVMe tier has room and each tenant's NVMe quota allows (nothing is evicted for
        them); returns how many were written.
        Also waits (up to ``remote_timeout_s``) for the remote tier's queued writes.
        ``progress(done, total)``: blocks considered so far (see :data:`Progress`)."""
        if self._remote is not None:
            self._remote.flush(remote_timeout_s)
        return self._flush(progress, closing=False)[0]

    def _flush(self, progress: Progress | None, *, closing: bool) -> tuple[int, int]:
        """:meth:`flush`'s commit; ``(committed, not committed)`` of the memory blocks it
        considered. ``closing`` (:meth:`close`: what is not committed now is gone): a block
        short of NVMe quota or space makes room by evicting NVMe's blocks the policy values
        less, then by dropping its own NVMe descendants, deepest first; one that cannot be
        committed takes those descendants with it (see :meth:`_room_at_close`)."""
        with self._lock, self._batch():
            self._check_open()
            if self._nvme is None:
                return 0, 0
            n = 0
            todo = [m for m in sorted(self._index, key=lambda m: m.depth)
                    if not (m.persisted or m.tier == Tier.NVME or m.in_flight)]
            if progress is not None and todo:  # NOTE: the first report came FLUSH_STEP blocks in
                progress(0, len(todo))
            colder: list[CloseVictims] = []  # made once, when a block first finds no room
            with self._flush_ahead(todo):
                for i, m in enumerate(todo, 1):
                    if progress is not None and (i % FLUSH_STEP == 0 or i == len(todo)):
                        progress(i, len(todo))
                    if self._index.get(m.tenant, m.key) is not m:
                        continue  # dropped at close below an ancestor (see _room_at_close)
                    parent = self._index.get(m.tenant, m.parent)
                    if parent is not None and not parent.persisted:
                        continue  # a copy without its ancestors could never be served
                    if closing and not self._room_at_close(m, colder):
                        continue
                    if not self._nvme.can_fit(m.nbytes):
                        break
                    if not self._place.within_quota(m.tenant, Tier.NVME, m.nbytes):
                        continue  # NOTE: a flush wrote past the tenant's NVMe quota
                    ref = self._place.ref(m)
                    if self._place.write(Tier.NVME, ref, m, self._mem[m.tier].host_bytes(ref)):
                        self._index.set_persisted(m, True)
                        self._place.charge(m, Tier.NVME, +1)
                        n += 1
            self.counters.add("flushed", n)
            return n, len(todo) - n

    def _room_at_close(self, m: BlockMeta, colder: list[CloseVictims]) -> bool:
        """Whether memory block ``m`` (its parent committed) fits in NVMe, within its tenant's
        quota, after evicting NVMe's blocks the policy values less than ``m`` (coldest first,
        leaves first; its tenant's own when the quota is short: ``colder`` holds the queue,
        made on first need), then dropping its own NVMe descendants, deepest first, as far
        as needed; when it cannot fit, all of them are dropped. Under the lock, at close.

        NOTE: a close with NVMe near capacity committed the first memory blocks that fitted
        and lost the rest (13-18 of them in a prober's run) while NVMe stayed full of colder
        blocks: a graceful restart kept the cold cache and lost the hot one. Only NVMe's own
        leaves go (never a memory block's copy: those are kept blocks; never a pinned or
        in-flight block, nor one with a child: no kept block loses an ancestor), each only
        for a block valued above it (:meth:`Placement.close_key`); when none is colder, ``m``
        is committed as room allows, as before (counted: ``evicted_at_close``).

        NOTE: a tenant at its NVMe quota lost its whole cache on a graceful restart: its
        memory blocks (a chain's ancestors) found no quota at close, and the NVMe blocks below
        them were dropped at the next open as orphans. Those descendants cannot be served after
        the close unless ``m`` is committed, so trading them for ``m`` keeps a usable prefix and
        loses nothing that would have survived; dropping them when ``m`` cannot be committed
        anyway gives their room (quota, disk) to the ancestors of other chains, and no block
        is left on disk that the next open would count as recovered and then drop. Only
        ``m``'s own subtree is touched: never another chain's blocks, nor another tenant's.
        Only at close: a flush while the store runs keeps them (they are served until then)."""
        assert self._nvme is not None

        def fits() -> bool:
            return (self._nvme.can_fit(m.nbytes)  # type: ignore[union-attr]
                    and self._place.within_quota(m.tenant, Tier.NVME, m.nbytes))

        if fits():
            return True
        bound = self._place.close_key(m)
        if bound is not None:
            if not colder:
                colder.append(self._place.close_victims())
            while not fits():
                own = None if self._place.within_quota(m.tenant, Tier.NVME, m.nbytes) else m.tenant
                v = colder[0].pop_below(bound, own)
                if v is None:
                    break
                self._place.drop(v, reason="evicted_at_close")
                colder[0].offer(self._index.get(v.tenant, v.parent))
            if fits():
                return True
        below = [d for d in self._index.subtree(m) if d is not m and (d.tier == Tier.NVME or d.persisted)]
        for d in below:  # deepest first
            if self._index.get(d.tenant, d.key) is d:
                self._place.drop(d, reason="dropped_at_close")
                if fits():
                    return True
        return False

    def _flush_ahead(self, todo: list[BlockMeta]) -> AbstractContextManager[None]:
        """Encode-ahead of flush's host-resident blocks (flush frees no slot while it runs)."""
        jobs = []
        for m in todo:
            if self._mem[m.tier].device.type == "cpu":
                ref = self._place.ref(m)
                jobs.append((ref, self._mem[m.tier].buffer(ref)))
        return self._place.nvme_ahead(jobs)

    def close(self, *, progress: Progress | None = None) -> int:
        """Close the store. Blocks committed to NVMe come back on the next :meth:`open`
        (with ``persist_on_close``, the warm blocks of HBM and DRAM are committed first,
        reported to ``progress`` as :meth:`flush` does); returns how many were committed.
        Sessions do not come back (they live in memory only): their blocks do, as ordinary
        unpinned blocks. When that commit fails (a full disk), the store still closes, then raises it.

        Committed ancestors first: a memory block short of NVMe quota or space makes room by
        evicting NVMe blocks the policy values less (leaves first, never pinned or in flight;
        counted: ``evicted_at_close``), then by dropping its own NVMe descendants (they could
        not be served without it), and one that cannot be committed takes them with it
        (counted: ``dropped_at_close``), so the next open
        finds no orphans. How many memory blocks were not committed (lost) is logged and kept
        in :attr:`uncommitted_at_close`."""
        flushed = 0
        failed: NVMeWriteFailed | None = None
        if self._remote is not None:  # NOTE: before the lock, which its reader may wait for
            self._remote.stop_deletions()
        with self._lock:
            # NOTE: a delete in its remote part (without the lock) went on talking to Redis
            # after close returned, and ended with its local part undone; it ends first now
            self._deletes_done.wait_for(lambda: not self._deletes_open)
            if self._closed:
                return 0
            if self.config.persist_on_close:
                if self._remote is not None:
                    self._remote.flush(30.0)  # as flush() did here, with its default
                try:
                    flushed, self.uncommitted_at_close = self._flush(progress, closing=True)
                except NVMeWriteFailed as exc:
                    failed = exc
                if self.uncommitted_at_close:
                    log.warning("close: %d blocks of HBM and DRAM could not be committed to NVMe (NVMe "
                                "space or their tenant's NVMe quota was short and NVMe held nothing "
                                "colder to evict, or an ancestor was not committed): they are lost; %d "
                                "NVMe blocks below them were dropped too",
                                self.uncommitted_at_close, self.counters.get("dropped_at_close"))
            self._closed = True
            for t in self._mem.values():
                t.close()
            if self._nvme is not None:
                self._nvme.close()
            if self._remote is not None:
                self._remote.close()
            self._dir_lock.release()
        if failed is not None:
            raise failed
        return flushed

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

