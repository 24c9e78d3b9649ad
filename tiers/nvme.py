"""NVMe tier: LMDB under the store's directory; survives restart.

Layout (one LMDB environment, four named databases):

* ``blocks``: ``tenant_prefix(16) + key(32)`` -> codec value (header + shuffled, zstd-compressed,
  AES-256-GCM encrypted payload; see ``kvstore.codec``).
* ``meta``:   same key -> :class:`NVMeRecord` packed (tenant, parent, depth, ...), written in the
  same transaction as the value, so after a crash either both exist or neither does.
* ``specs``:  fingerprint -> canonical ModelSpec JSON (to rebuild the index on open).
The keyring's wrapped data keys live in a second, small LMDB environment (``<path>/keys``),
committed and synced on their own: a key is durable before any value encrypted with it is. Its
``settings`` database holds ``b"encrypt"`` -> ``b"1"`` / ``b"0"``: whether the store encrypts its
values, recorded at its first open (:meth:`NVMeTier.check_encrypt`); an open with the other
setting is refused before anything is read or dropped.

Writes go into one write transaction per :meth:`NVMeTier.batch` (the Store opens one per public
call), or one per operation outside a batch; with ``durable=True`` LMDB syncs on commit, so a
block whose put returned survives ``kill -9``. A batch is a deferred commit, not an atomic
unit: whatever the Store did inside it is committed when it ends, even on an exception (the
Store has already undone its own inserts by then). Inside :meth:`NVMeTier.pipelined` (a Store
call that writes many blocks), values are encoded ahead on a background thread
(``tiers.nvme_ahead``) while this thread writes the previous ones, and the batch commits every
``PIPELINE_COMMIT_BYTES`` as it goes, so the disk writes overlap the encoding: a batch is several
durable commits then, each made before the call returns. A commit LMDB cannot make (a full
disk, an I/O error) raises :class:`kvstore.errors.NVMeWriteFailed` naming the blocks it would
have stored, which the tier forgets again (the Store drops them from its index). A value that fails its integrity check
is deleted (the Store counts it), never returned. Before LMDB maps either file, the open reads
it with plain reads (``tiers.lmdb_check``) and refuses, naming the file, damage LMDB would not
survive (a read past the end of the file is SIGBUS, a malformed page an LMDB assertion). Not
thread-safe by itself beyond LMDB's own rules: the Store serialises writers (LMDB's write
transactions stay on the caller's thread).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import struct
from collections.abc import Callable, Iterator, MutableMapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lmdb
import numpy as np

from kvstore.block import Tier
from kvstore.codec_format import parse_header
from kvstore.errors import (
    EncryptionMismatch,
    FailedPrecondition,
    IntegrityError,
    NVMeWriteFailed,
    ResourceExhausted,
)
from kvstore.quantization import Quantization
from kvstore.sizes import format_size
from kvstore.spec import ModelSpec
from tiers.base import BlockRef, TierUsage
from tiers.lmdb_check import FileDamage, check_file
from tiers.nvme_ahead import AheadJob, BufferPool, EncodeAhead

log = logging.getLogger(__name__)

_META = struct.Struct("<32sIIQdd16sB")  # parent, depth, tokens, nbytes, created, ttl, fp, has_ttl
TENANT_PREFIX_BYTES = 16
#: Inside a pipelined batch, commit (durably) once this many value bytes are pending, so the disk
#: writes and syncs of the values stored so far overlap the encoding of the next ones.
PIPELINE_COMMIT_BYTES = 4 << 20
#: What LMDB raises where a page of its file is damaged: a page number past the last commit's,
#: a page of the wrong kind, a cycle deeper than its cursor stack, a header it does not know.
DAMAGE_ERRORS: tuple[type[lmdb.Error], ...] = (
    lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.CursorFullError, lmdb.PageFullError,
    lmdb.InvalidError, lmdb.VersionMismatchError, lmdb.IncompatibleError)
#: The databases whose damaged pages the tier lives with (a block behind one is a counted miss):
#: :func:`_check_file` leaves to LMDB there what LMDB reports as an error itself.
LENIENT_DBS = frozenset({b"blocks"})


@functools.lru_cache(maxsize=4096)
def tenant_prefix(tenant: str) -> bytes:
    return hashlib.blake2b(tenant.encode(), digest_size=TENANT_PREFIX_BYTES,
                           person=b"kvstore-tenant").digest()


@dataclass(frozen=True, slots=True)
class NVMeRecord:
    tenant: str
    key: bytes
    parent: bytes
    depth: int
    tokens: int
    nbytes: int
    created: float
    ttl_deadline: float | None
    fingerprint: bytes

    def pack(self) -> bytes:
        t = self.tenant.encode()
        ttl = self.ttl_deadline if self.ttl_deadline is not None else 0.0
        return struct.pack("<H", len(t)) + t + _META.pack(
            self.parent, self.depth, self.tokens, self.nbytes, self.created, ttl,
            self.fingerprint, self.ttl_deadline is not None)

    @classmethod
    def unpack(cls, key: bytes, raw: bytes) -> NVMeRecord:
        (n,) = struct.unpack_from("<H", raw)
        tenant = bytes(raw[2 : 2 + n]).decode()
        parent, depth, tokens, nbytes, created, ttl, fp, has_ttl = _META.unpack_from(raw, 2 + n)
        return cls(tenant, key, parent, depth, tokens, nbytes, created,
                   ttl if has_ttl else None, fp)


class _KeyBackend(MutableMapping[str, bytes]):
    """The keyring's persistent store: wrapped data keys in the ``keys`` database.

    Names are stored as ``b"k" + name`` so any string (even empty) is a valid LMDB key."""

    def __init__(self, env: lmdb.Environment, db: Any) -> None:
        self._env, self._db = env, db

    def __getitem__(self, tenant: str) -> bytes:
        with self._env.begin(db=self._db) as txn:
            v = txn.get(b"k" + tenant.encode())
        if v is None:
            raise KeyError(tenant)
        return bytes(v)

    def __setitem__(self, tenant: str, wrapped: bytes) -> None:
        with self._writing(f"store tenant {tenant!r}'s data key"), \
                self._env.begin(db=self._db, write=True) as txn:
            txn.put(b"k" + tenant.encode(), wrapped)
        self._env.sync(True)

    def __delitem__(self, tenant: str) -> None:
        with self._writing(f"destroy tenant {tenant!r}'s data key"), \
                self._env.begin(db=self._db, write=True) as txn:
            old = txn.get(b"k" + tenant.encode())
            if old is None:
                raise KeyError(tenant)
            # NOTE: overwrite before delete so the freed page does not keep the wrapped key
            # in the clear of LMDB's own structures (best effort: SSDs may keep old copies).
            txn.put(b"k" + tenant.encode(), b"\x00" * len(old))
            txn.delete(b"k" + tenant.encode())
        self._env.sync(True)

    @contextmanager
    def _writing(self, what: str) -> Iterator[None]:
        """A failed commit of the key store (a full disk) as NVMeWriteFailed saying what failed."""
        try:
            yield
        except lmdb.Error as exc:
            raise NVMeWriteFailed(f"could not {what}: {exc} (is the disk of {self._env.path()} full?)") from None

    def __iter__(self) -> Iterator[str]:
        with self._env.begin(db=self._db) as txn:
            return iter([bytes(k)[1:].decode() for k in txn.cursor().iternext(values=False)])

    def __len__(self) -> int:
        with self._env.begin(db=self._db) as txn:
            return txn.stat(self._db)["entries"]


def _check_file(path: Path, *, lenient: frozenset[bytes] = frozenset()) -> None:
    """IntegrityError naming the file and the way out when the LMDB file of the environment at
    ``path`` is damaged in a way LMDB would not survive (:func:`tiers.lmdb_check.check_file`,
    plain reads, before LMDB maps it). NOTE: a truncated file (a bad restore or copy), a value's
    size or a node offset pointing past the end of the file killed the process with SIGBUS, and
    a page of the wrong shape with SIGABRT (an LMDB assertion), at open or at the first get of a
    block, without a word. ``lenient``: databases whose damaged pages LMDB reports itself and
    the tier takes as counted misses (the values)."""
    data = path / "data.mdb"
    try:
        check_file(data, lenient=lenient)
    except FileDamage as exc:
        if exc.truncated:
            raise IntegrityError(f"{data} is {exc.have} bytes, but its last commit uses {exc.need}: the "
                                 f"file was truncated or damaged; restore it from a backup, or move "
                                 f"{path} away to start without its blocks") from None
        raise damaged_file(path, exc) from None
    except OSError:
        return  # unreadable here: LMDB's open says why


def damaged_file(path: Path, exc: BaseException) -> IntegrityError:
    """The error for an LMDB environment at ``path`` whose file LMDB found damaged (``exc``),
    with the way out (as :func:`_check_file` gives for a truncated file). NOTE: before, a
    damaged page made the open raise LMDB's own error (``mdb_cursor_get: MDB_PAGE_NOTFOUND``,
    ``File is not an LMDB file``) with no word of what to do."""
    return IntegrityError(f"{path / 'data.mdb'} is damaged ({exc}): restore it from a backup, or "
                          f"move {path} away to start without its blocks")


def _first_value_setting(txn: lmdb.Transaction, db: Any) -> bytes | None:
    """The encrypt setting (``b"1"``/``b"0"``) the first value of ``db`` was written with, read
    from its header; None when ``db`` is empty or that header does not parse."""
    with txn.cursor(db=db) as cur:
        if not cur.first():
            return None
        try:
            return b"1" if parse_header(cur.value()).encrypted else b"0"
        except IntegrityError:
            return None


def _open_env(path: Path, **kw: Any) -> lmdb.Environment:
    """``lmdb.open(path, **kw)``; a damaged file (a header LMDB cannot read) as
    :func:`damaged_file`'s IntegrityError."""
    try:
        return lmdb.open(str(path), **kw)
    except DAMAGE_ERRORS as exc:
        raise damaged_file(path, exc) from None


def _make_dir(path: Path, *, parents: bool = True) -> None:
    """Make the directory ``path`` (mode 0700) unless it is there. FailedPrecondition naming it
    when it cannot be: NOTE: a file named ``nvme`` in the store directory gave a raw
    FileExistsError."""
    try:
        path.mkdir(parents=parents, exist_ok=True, mode=0o700)
    except OSError as exc:
        if os.path.lexists(path) and not path.is_dir():
            raise FailedPrecondition(f"the NVMe tier's directory {path} is not a directory (a file of that "
                                     f"name is in the way): move it away") from None
        raise FailedPrecondition(f"cannot make the NVMe tier's directory {path}: {exc.strerror or exc}") from None


#: the LMDB map of the NVMe tier: twice its capacity (values that do not compress, LMDB's own
#: pages) plus this, and at least the file already there plus this; never under MAP_FLOOR
MAP_HEADROOM = 256 << 20
MAP_FLOOR = 1 << 26


class NVMeTier:
    tier = Tier.NVME

    def __init__(self, path: Path, capacity: int, *, durable: bool = True,
                 map_size: int | None = None,
                 pipeline_commit_bytes: int | None = None,
                 writemap: bool = False) -> None:
        self.path = Path(path)
        # private: values are encrypted, but records name tenants and keys can be tested
        _make_dir(self.path)
        self.capacity = capacity
        # Room for LMDB's own pages and for values that do not compress (header overhead).
        # NOTE: writemap (values copied straight into the file mapping, no malloc'd dirty
        # pages, no copy at commit) is off by default: LMDB then extends the file to map_size
        # as a sparse file, and a write fault on a full disk is SIGBUS, not an error; on this
        # VM its gain did not stand out of the noise (see bench/RESULTS.md, tiers suite).
        map_size = map_size or max(capacity * 2 + MAP_HEADROOM, MAP_FLOOR)
        # NOTE: at least the file and room to write: a store reopened with a lower nvme_bytes
        # than its file already held mapped less than the file, and every put that had to evict
        # (a write) failed with MDB_MAP_FULL, as did close, with the disk nearly empty
        try:
            held = (self.path / "data.mdb").stat().st_size
        except OSError:
            held = 0
        map_size = max(map_size, held + MAP_HEADROOM)
        _check_file(self.path, lenient=LENIENT_DBS)
        _check_file(self.path / "keys")
        try:
            self._env = _open_env(
                self.path, map_size=map_size, max_dbs=8, sync=durable, metasync=durable,
                readahead=False, lock=True, writemap=writemap, mode=0o600)
        except (lmdb.MemoryError, OverflowError) as exc:  # the map does not fit the address space
            raise ResourceExhausted(
                f"cannot open the NVMe tier: nvme_bytes = {capacity} ({format_size(capacity)}) needs "
                f"a map of {format_size(map_size)}, and mapping it failed ({exc}); lower nvme_bytes",
                resource="nvme") from None
        try:
            self._blocks, self._meta, self._specs = (
                self._env.open_db(name) for name in (b"blocks", b"meta", b"specs"))
        except DAMAGE_ERRORS as exc:  # the main database, which names them, is damaged
            self._env.close()
            raise damaged_file(self.path, exc) from None
        try:
            _make_dir(self.path / "keys", parents=False)  # NOTE: lmdb would make it 0600 (mode)
        except FailedPrecondition:
            self._env.close()
            raise
        try:
            self._keys_env = _open_env(self.path / "keys", map_size=64 << 20, max_dbs=2, sync=True,
                                       metasync=True, readahead=False, lock=True, mode=0o600)
        except IntegrityError:
            self._env.close()
            raise
        try:
            self._keys = self._keys_env.open_db(b"keys")
            self._settings = self._keys_env.open_db(b"settings")
        except DAMAGE_ERRORS as exc:
            self._keys_env.close()
            self._env.close()
            raise damaged_file(self.path / "keys", exc) from None
        self._batch: lmdb.Transaction | None = None
        self.codec: Any = None  # set by the Store once the keyring (which lives here) is built
        self._sizes: dict[tuple[str, bytes], int] = {}
        self._used = 0
        self._known_specs: set[bytes] = set()
        self._scratch = np.empty(0, dtype=np.uint8)
        self._commit_bytes = (PIPELINE_COMMIT_BYTES if pipeline_commit_bytes is None
                              else pipeline_commit_bytes)
        self._ahead: EncodeAhead | None = None
        self._ahead_exec: ThreadPoolExecutor | None = None
        self._ahead_buffers = BufferPool(keep=3)
        self._pending_bytes = 0  # value bytes written in the open batch since its last commit
        # blocks put (ident -> nbytes) and specs first recorded in the open batch since its last
        # commit: forgotten again if that commit fails (and read in the batch's transaction)
        self._unsynced: dict[tuple[str, bytes], int] = {}
        self._unsynced_specs: list[bytes] = []
        # deletions made in the open transaction, and those a failed commit did not make: the
        # latter are made again in every later write transaction until one commits (a deleted
        # block must not come back at the next start)
        self._deleting: list[bytes] = []
        self._undeleted: set[bytes] = set()
        self._damaged: list[bytes] = []  # db keys of records that records() could not read
        #: called once for each block a delete could not remove for a damaged page (the Store
        #: counts it); the block is gone from the tier all the same
        self.on_damage: Callable[[], None] | None = None
        self._damage_met = False  # a damaged page was met in the open write transaction
        self._damage_warned = False

    # -- open / recovery ----------------------------------------------------------------------
    def check_encrypt(self, encrypt: bool) -> None:
        """Refuse (FailedPrecondition, the tier closed) an open whose ``encrypt`` is not the one
        the tier's values were written with; record it at the first open. Why: every value
        written with the other setting failed to decode and was deleted (encrypt=True reopened
        with False), or all were dropped at open as blocks of deleted tenants (the reverse): a
        configuration mistake wiped the tier. A tier written before the setting was recorded
        takes it from its first value's header (the current setting when it holds none, or
        none that parses); values of the other kind in such a tier (an earlier mistake) are
        unreadable under either setting, and :meth:`get_into` deletes them."""
        want = b"1" if encrypt else b"0"
        try:
            with self._keys_env.begin(db=self._settings) as txn:
                raw = txn.get(b"encrypt")
        except lmdb.Error as exc:
            self.close()
            raise damaged_file(self.path / "keys", exc) from None
        recorded = raw is not None
        have = bytes(raw) if raw is not None else None
        if have is None:
            try:
                with self._env.begin() as txn:
                    have = _first_value_setting(txn, self._blocks)
            except lmdb.Error as exc:
                self.close()
                raise damaged_file(self.path, exc) from None
        if have is not None and have != want:
            self.close()
            was = have == b"1"
            raise FailedPrecondition(
                f"the store at {self.path.parent} was written with encrypt={was}; it cannot be opened "
                f"with encrypt={encrypt} (its blocks would be unreadable, and deleted): set encrypt "
                f"back to {was}, or move {self.path} away to start without its blocks")
        if not recorded:
            try:
                with self._keys_env.begin(db=self._settings, write=True) as txn:
                    txn.put(b"encrypt", want)
            except lmdb.Error as exc:
                self.close()
                raise NVMeWriteFailed(f"could not record the store's encrypt setting in {self.path / 'keys'}: "
                                      f"{exc} (is the disk full?)") from None

    def key_backend(self) -> MutableMapping[str, bytes]:
        return _KeyBackend(self._keys_env, self._keys)

    def records(self) -> list[tuple[NVMeRecord, ModelSpec | None]]:
        """Every committed block's record and spec (rebuilds the Store's index on open); the
        spec is None where it cannot be read. A record that cannot be read at all is left out,
        and its block is deleted by :meth:`drop_damaged`. A damaged page of the file (LMDB's
        own error while walking it) closes the tier and raises :func:`damaged_file`'s
        IntegrityError, naming the file and the way out."""
        try:
            out = self._read_records()
        except lmdb.Error as exc:
            self._damaged.clear()
            self.close()
            raise damaged_file(self.path, exc) from None
        for rec, spec in out:
            self._sizes[(rec.tenant, rec.key)] = rec.nbytes
            self._used += rec.nbytes
            self._known_specs.add(rec.fingerprint)
        return out

    def _read_records(self) -> list[tuple[NVMeRecord, ModelSpec | None]]:
        """The walk of :meth:`records` over the specs and meta databases."""
        with self._env.begin() as txn:
            specs: dict[bytes, ModelSpec | None] = {}
            for fp, raw in txn.cursor(db=self._specs):
                try:
                    specs[bytes(fp)] = ModelSpec.from_dict(json.loads(bytes(raw)))
                except (ValueError, TypeError):
                    specs[bytes(fp)] = None
            out = []
            for k, raw in txn.cursor(db=self._meta):
                k = bytes(k)
                try:
                    rec = NVMeRecord.unpack(k[TENANT_PREFIX_BYTES:], bytes(raw))
                except (struct.error, UnicodeDecodeError):
                    self._damaged.append(k)  # a lost block, not a crash at open
                    continue
                out.append((rec, specs.get(rec.fingerprint)))
        return out

    def drop_damaged(self) -> int:
        """Delete the blocks whose record :meth:`records` could not read; their count. Why:
        such a block was in no index, so nothing ever deleted it, and its bytes stayed on disk."""
        damaged, self._damaged = self._damaged, []
        if damaged:
            with self._write() as txn:
                for k in damaged:
                    self._delete_in(txn, k)
        return len(damaged)

    # -- TierBackend --------------------------------------------------------------------------
    @staticmethod
    def _dbkey(ref: BlockRef) -> bytes:
        return tenant_prefix(ref.tenant) + ref.key

    def put_record(self, ref: BlockRef, data: np.ndarray, record: NVMeRecord,
                   quant: Quantization | None = None) -> bool:
        """Encode (quantized as ``quant``, None = lossless) and commit value + record in one
        transaction. False when there is no room."""
        if ref.ident in self._sizes:
            return True
        if self._used + ref.nbytes > self.capacity:
            return False
        ahead = self._ahead
        staged = ahead.take(ref, data, quant) if ahead is not None else None
        if staged is None:
            # NOTE: one reused scratch buffer (the Store serialises calls): a fresh 32 MiB
            # buffer per put costs more in page faults than the cipher does.
            need = self.codec.max_encoded_nbytes(ref.spec)
            if self._scratch.shape[0] < need:
                self._scratch = np.empty(need, dtype=np.uint8)
            buf = self._scratch
            n = self.codec.encode_into(ref.tenant, ref.key, ref.spec, data, buf, quant=quant)
        else:
            buf, n = staged
        k = self._dbkey(ref)
        self._undeleted.discard(k)  # a deletion still to redo must not remove this new value
        fp = ref.spec.fingerprint
        try:
            with self._write() as txn:
                if fp not in self._known_specs:
                    txn.put(fp, json.dumps(ref.spec.to_dict()).encode(), db=self._specs)
                txn.put(k, memoryview(buf)[:n], db=self._blocks)
                txn.put(k, record.pack(), db=self._meta)
        except lmdb.MapFullError:
            if self._batch is not None:  # the open transaction is unusable now
                raise ResourceExhausted("the NVMe tier's LMDB map is full", resource="nvme")
            return False
        except DAMAGE_ERRORS as exc:
            # NOTE: a put whose key lands in a damaged page raised LMDB's own error, and the
            # batch's failed commit then said "free some space there"
            self._damage_met |= self._batch is not None  # that transaction cannot commit now
            raise IntegrityError(f"a damaged page of {self.path / 'data.mdb'} was met writing a block "
                                 f"({exc}): restore the file from a backup, or move {self.path} away "
                                 "to start without its blocks") from None
        finally:
            if staged is not None and ahead is not None:
                ahead.release(buf)
        if self._batch is not None:
            self._unsynced[ref.ident] = ref.nbytes
            if fp not in self._known_specs:
                self._unsynced_specs.append(fp)
        self._known_specs.add(fp)
        self._sizes[ref.ident] = ref.nbytes
        self._used += ref.nbytes
        if ahead is not None and self._batch is not None:
            self._pending_bytes += n
            if self._pending_bytes >= self._commit_bytes:
                self._commit_step()
        return True

    def put(self, ref: BlockRef, data: np.ndarray) -> bool:
        rec = NVMeRecord(ref.tenant, ref.key, b"\x00" * 32, 0, ref.spec.block_tokens,
                         ref.nbytes, 0.0, None, ref.spec.fingerprint)
        return self.put_record(ref, data, rec)

    def get_into(self, ref: BlockRef, out: np.ndarray) -> bool:
        """Decode the block's value into ``out``; False when it is not held, or when it fails
        its integrity check or sits behind a damaged page of the file (the block is deleted
        then, as far as the damage lets it be, and the caller counts an integrity failure)."""
        if ref.ident not in self._sizes:
            return False
        try:
            with self._read(ref.ident) as txn:
                try:
                    value = txn.get(self._dbkey(ref), db=self._blocks)
                except lmdb.Error as exc:  # NOTE: escaped as LMDB's own error (see _read)
                    self._damage_met |= txn is self._batch  # that transaction cannot commit now
                    raise IntegrityError(f"a damaged page of {self.path / 'data.mdb'}: {exc}") from None
                if value is None:
                    raise IntegrityError("value missing for a recorded block")
                self.codec.decode(ref.tenant, ref.key, ref.spec, value, out=out)
            return True
        except (IntegrityError, EncryptionMismatch) as exc:
            # NOTE: EncryptionMismatch: a value of the kind the store's recorded setting is not
            # (check_encrypt), written before it was recorded: no open the tier allows reads it
            log.warning("NVMe block of tenant %r failed its integrity check: %s", ref.tenant, exc)
            self.delete(ref)
            return False

    def update_record(self, record: NVMeRecord) -> bool:
        """Write ``record`` over the held block's record (its value unchanged): a TTL deadline
        moved later. False if the block is not held."""
        if (record.tenant, record.key) not in self._sizes:
            return False
        with self._write() as txn:
            txn.put(tenant_prefix(record.tenant) + record.key, record.pack(), db=self._meta)
        return True

    def delete(self, ref: BlockRef) -> bool:
        return self.delete_key(ref.tenant, ref.key)

    def delete_key(self, tenant: str, key: bytes) -> bool:
        """Delete a block by its tenant and key (its spec may be unknown); False if not held."""
        n = self._sizes.pop((tenant, key), None)
        if n is None:
            return False
        self._used -= n
        k = tenant_prefix(tenant) + key
        with self._write() as txn:
            self._delete_in(txn, k)
        return True

    def _delete_in(self, txn: lmdb.Transaction, k: bytes) -> None:
        """Delete the record and value under ``k`` in ``txn``. A damaged page of the file on the
        way to ``k`` is counted (:attr:`on_damage`) and the block taken as gone: it is deleted
        where the way is sound, and never tried again. NOTE: before, LMDB's error left ``txn``
        unable to commit, so the call failed as a full disk, and the deletion was kept to make
        again with every later write, failing them all: a drop_tenant never completed (its
        data key stayed), and the next open failed.

        How: a read-only look at ``k`` first (a write transaction that meets a damaged page
        cannot commit). A damaged page that only the deletion itself meets (a neighbour it
        merges with) still spoils ``txn``: that one commit fails, saying so
        (:meth:`_why_not_committed`), and ``k`` alone is not deleted again; the deletions after
        it in ``txn`` are left to its failed commit (made again with the next write)."""
        if self._damage_met:  # LMDB would refuse any further use of ``txn`` (MDB_BAD_TXN)
            self._deleting.append(k)
            return
        dbs, damage = self._sound_paths(k)
        try:
            for db in dbs:
                txn.delete(k, db=db)
        except DAMAGE_ERRORS as exc:
            self._damage_met = True
            damage = exc
        if damage is None:
            self._deleting.append(k)
        else:
            self._met_damage(damage)

    def _sound_paths(self, k: bytes) -> tuple[list[Any], lmdb.Error | None]:
        """The databases (record, then value) in which a read-only look reached ``k`` without
        meeting a damaged page, and the error met in the others (None: none). Read-only: a
        damaged page met by a write transaction leaves it unable to commit."""
        sound, damage = [], None
        for db in (self._meta, self._blocks):
            try:
                with self._env.begin() as ro:
                    ro.get(k, db=db)
            except lmdb.Error as exc:
                damage = exc
            else:
                sound.append(db)
        return sound, damage

    def _met_damage(self, exc: lmdb.Error) -> None:
        """Count a block that a deletion could not remove (or wholly) for a damaged page."""
        if not self._damage_warned:  # once: a drop_tenant can meet it for every block of a page
            self._damage_warned = True
            log.warning("a damaged page of %s: an NVMe block could not be deleted (%s), nor will "
                        "others there be (counted as nvme_damaged_deletes); restore the file from a "
                        "backup, or move %s away to start without its blocks",
                        self.path / "data.mdb", exc, self.path)
        if self.on_damage is not None:
            self.on_damage()

    def _begin(self, **kw: Any) -> lmdb.Transaction:
        """A write transaction that first makes again the deletions a failed commit lost."""
        txn = self._env.begin(write=True, **kw)
        self._damage_met = False
        if self._undeleted:
            undeleted, self._undeleted = self._undeleted, set()
            for k in undeleted:
                self._delete_in(txn, k)
        return txn

    @property
    def deletions_pending(self) -> int:
        """Blocks deleted whose deletion no commit has made yet (a full disk): they are
        deleted again with the next write, and would come back at a restart before that."""
        return len(self._undeleted)

    def disk_room(self) -> tuple[int, int]:
        """``(room, need)``: bytes the disk could still take for values (its free space, plus
        what the LMDB file holds beyond the stored values), and bytes the tier may still
        store (capacity less what it holds). ``room < need``: writes fail before the tier fills."""
        data = self.path / "data.mdb"
        try:
            allocated = data.stat().st_blocks * 512
        except OSError:
            allocated = 0
        room = shutil.disk_usage(self.path).free + max(allocated - self._used, 0)
        return room, max(self.capacity - self._used, 0)

    def contains(self, ref: BlockRef) -> bool:
        return ref.ident in self._sizes

    def can_fit(self, nbytes: int) -> bool:
        return self._used + nbytes <= self.capacity

    def charge(self, nbytes: int) -> int:
        return nbytes

    @property
    def used_bytes(self) -> int:
        return self._used

    def usage(self) -> TierUsage:
        return TierUsage(Tier.NVME, self._used, self.capacity, len(self._sizes))

    def close(self) -> None:
        assert self._batch is None, "close inside a batch"
        if self._ahead_exec is not None:
            self._ahead_exec.shutdown(wait=True)
        if self.codec is not None:
            self.codec.close()
        if self._undeleted:  # a last try (a full disk may have room again)
            try:
                with self._write():
                    pass
            except NVMeWriteFailed:
                log.warning("closing with %d deleted blocks still on disk (no commit could delete "
                            "them): they come back at the next start", len(self._undeleted))
        self._env.close()
        self._keys_env.close()

    def uncommitted(self, ident: tuple[str, bytes]) -> bool:
        """Whether the block ``ident`` was written in the open batch and is not committed yet."""
        return ident in self._unsynced

    # -- transactions -------------------------------------------------------------------------
    @contextmanager
    def batch(self) -> Iterator[None]:
        """Group every write until the block ends into one transaction and one sync.

        Re-entrant (an inner batch joins the outer one). Reads inside see the batch's writes.
        Committed on exit, exception or not."""
        if self._batch is not None:
            yield
            return
        self._batch = self._begin(buffers=True)
        self._pending_bytes = 0
        try:
            yield
        finally:
            txn, self._batch = self._batch, None
            if txn is not None:
                self._commit(txn)

    def commit_now(self) -> None:
        """Commit what the open batch wrote so far (durably) and go on in a new transaction;
        nothing to do outside a batch, where every write commits on its own."""
        if self._batch is not None:
            self._commit_step()

    def _commit_step(self) -> None:
        """Commit the open batch's writes so far and go on in a new transaction (pipelined
        batches only). Durable like any commit: a block stored here survives kill -9 from now."""
        txn, self._batch = self._batch, None
        assert txn is not None
        self._commit(txn)
        self._pending_bytes = 0
        self._batch = self._begin(buffers=True)

    def _commit(self, txn: lmdb.Transaction) -> None:
        """Commit ``txn``; when LMDB cannot (a full disk, an I/O error), forget the blocks it
        would have stored and raise :class:`NVMeWriteFailed` naming them."""
        try:
            txn.commit()
        except lmdb.Error as exc:
            lost = []
            for ident, nbytes in self._unsynced.items():
                if self._sizes.pop(ident, None) is not None:
                    self._used -= nbytes
                    lost.append(ident)
            self._known_specs.difference_update(self._unsynced_specs)
            self._unsynced.clear()
            self._unsynced_specs.clear()
            self._undeleted.update(self._deleting)
            self._deleting.clear()
            undeleted = (f"; {len(self._undeleted)} deleted blocks are still on disk (gone from the "
                         f"index, deleted again with the next write that commits; a restart before "
                         f"that would bring them back)" if self._undeleted else "")
            raise NVMeWriteFailed(
                f"the NVMe tier could not commit its writes ({exc}; {self._why_not_committed()}; "
                f"{len(lost)} blocks of this call were not stored{undeleted}", lost=tuple(lost)) from None
        self._unsynced.clear()
        self._unsynced_specs.clear()
        self._deleting.clear()

    def _why_not_committed(self) -> str:
        """What a failed commit's error says of its cause and the way out: a damaged page of the
        file met in the transaction, else the disk's free space. NOTE: a damaged page was
        reported as a full disk ("free some space there")."""
        if self._damage_met:
            return (f"a damaged page of {self.path / 'data.mdb'} was met in it): restore the file "
                    f"from a backup, or move {self.path} away to start without its blocks")
        try:
            free = f"{shutil.disk_usage(self.path).free} bytes free"
        except OSError:
            free = "free space unknown"
        return f"{free} on the disk of {self.path}): free some space there or lower nvme_bytes"

    @contextmanager
    def pipelined(self, jobs: Sequence[AheadJob]) -> Iterator[None]:
        """Encode ``jobs`` ahead, in order, on a background thread, while the caller stores them
        with :meth:`put_record` (same block, same source array, same ``quant``; others are
        encoded inline). The source arrays must stay valid and unchanged until the block ends.
        Inside a :meth:`batch`, the writes are committed every ``pipeline_commit_bytes`` (each
        commit as durable as the batch's last), so a batch is several commits then."""
        if self._ahead is not None or not jobs or self.codec is None:
            yield
            return
        if self._ahead_exec is None:
            self._ahead_exec = ThreadPoolExecutor(1, thread_name_prefix="kvstore-nvme-ahead")
        self._ahead = EncodeAhead(
            self._ahead_exec,
            lambda ref, data, quant, out: self.codec.encode_into(
                ref.tenant, ref.key, ref.spec, data, out, quant=quant),
            self._ahead_buffers, lambda ref: self.codec.max_encoded_nbytes(ref.spec), jobs)
        try:
            yield
        finally:
            ahead, self._ahead = self._ahead, None
            ahead.close()

    @contextmanager
    def _write(self) -> Iterator[lmdb.Transaction]:
        if self._batch is not None:
            yield self._batch
            return
        txn = self._begin()
        try:
            yield txn
        except BaseException:
            txn.abort()
            self._undeleted.update(self._deleting)  # NOTE: none made; redone with the next write
            self._deleting.clear()
            raise
        self._commit(txn)  # outside a batch nothing is recorded before it succeeds

    @contextmanager
    def _read(self, ident: tuple[str, bytes]) -> Iterator[lmdb.Transaction]:
        """A transaction to read block ``ident`` in: the open batch's where the block was written
        in it since its last commit, else a read-only one of its own. NOTE: every read ran in
        the open batch's write transaction, and LMDB refuses to commit a transaction that met a
        damaged page: a get that touched one failed the whole call as a full disk, every time."""
        if self._batch is not None and ident in self._unsynced:
            yield self._batch
        else:
            with self._env.begin(buffers=True) as txn:
                yield txn
