"""A check of an LMDB data file before LMDB maps it: damage that would kill the process is found
with plain reads (``os.pread``) and reported as :class:`FileDamage`.

Why: LMDB reads its file through a memory map and trusts what it finds there. A flipped bit that
makes it read past the end of the file (a value's size, a node offset, a page count) is SIGBUS,
and a page of the wrong shape trips one of its assertions (SIGABRT): the server died at start,
or at the first get of one block, with no word of which file or what to do. What LMDB reports
as an error itself (a child page number past the last commit's, a page of the wrong kind met by a
search) is left to it: the NVMe tier turns those into counted misses or a refused open.

What :func:`check_file` checks, in the commit LMDB will open (the meta page with the larger
transaction id), following the layout LMDB 0.9 documents in ``mdb.c`` (``MDB_meta``,
``MDB_page``, ``MDB_node``, ``MDB_db``):

* both meta pages: page flags, magic, format version, page size (LMDB refuses any other too,
  some of them with errors no caller can tell from others); the newest one's two database
  records' flags and roots;
* every branch and leaf page reachable from a database root: inside the file (a truncated
  file), the page header's offsets inside the page, at least two keys on a branch page (else an
  assertion), each node and its key inside the page, a value stored in the page inside it, an
  overflow value's pages inside the last commit's, counted in its overflow page's header (LMDB
  reads ``size`` bytes from there), and the pages its ``size`` fills inside the file;
* the free-page database's records (page lists LMDB merges when it allocates): their counts
  inside the record, their page numbers inside the last commit's (in numpy: millions of them
  after a large delete).

The file may end before the last commit's last page (``mm_last_pg``): LMDB does not write the
pages it allocated at the end of the file and freed again in the same transaction. Only the
pages a read would fault on (SIGBUS) are held to the file's size.
* in a *strict* database (all but those named ``lenient``), also what LMDB would report as an
  error (a child page past the last commit's, a page of the wrong kind, leaves at different
  depths): the databases walked at open, whose damage refuses the open anyway. In a lenient
  database (the NVMe tier's values) such a page is not followed, as LMDB will not follow it
  either; the tier counts the blocks behind it as misses.

Cost: one read per branch/leaf page and one 16-byte read per overflow value, in page order
after the walk, the kernel told ahead (``POSIX_FADV_WILLNEED``) of each run of them; no value is
read. Measured (one 2-core VM, noisy; 100k blocks of 4 KiB, an 852 MB file, the check alone):
with the file's page cache dropped (``POSIX_FADV_DONTNEED``) 1.5-1.8 s, where reading the
headers in the walk's (key) order took 4.3-5.3 s; warm 0.36-0.65 s, as before (0.34-0.58 s,
the Python walk of the tree pages). Free-page lists of 1M pages (4 GiB deleted): 0.02 s, where
Python ints took 0.27 s (and about 40 bytes a page).

What it does not catch (documented, not fixed):

* damage LMDB reads safely but wrongly: a flipped bit inside a key or a record, a value's size
  made smaller (the codec's check counts such a value as a miss; a record that does not parse is
  dropped and counted at open);
* a flipped bit in a meta page's transaction id that makes LMDB open the commit before the last:
  the last commit's blocks are gone without a word (nothing in the file tells the two apart);
* damage made while the file is open (a disk that flips a bit under a running server): the first
  read of it can still be a signal death;
* in a lenient database, a page LMDB reports as damaged when a search meets it is not followed:
  a deletion beside it (LMDB merging pages) reads it all the same. About 2200 single-bit flips
  of a store's file (tree pages, meta pages) found no signal death after this check, but that
  path is not checked here.

Pages outside the last commit (free pages, the older meta page's commit) are not read: LMDB does
not read them either.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

#: ``MDB_page`` header: pgno, pad, flags, lower, upper (``mp_pages`` overlays lower/upper)
_PAGE_HDR = struct.Struct("<QHHHH")
PAGE_HDR_BYTES = _PAGE_HDR.size  # 16
_NODE = struct.Struct("<HHHH")  # mn_lo, mn_hi, mn_flags, mn_ksize
NODE_BYTES = _NODE.size
#: ``MDB_db``: pad (the page size in the free database's), flags, depth, branch/leaf/overflow page
#: counts, entries, root
_DB = struct.Struct("<IHHQQQQQ")
_META_AT = PAGE_HDR_BYTES  # MDB_meta follows the page header
_MAGIC_VERSION = struct.Struct("<II")
_LAST_TXN = struct.Struct("<QQ")  # mm_last_pg, mm_txnid, after mm_address, mm_mapsize, mm_dbs
_DBS_AT = _META_AT + 8 + 8 + 8  # magic+version, address, mapsize
_LAST_AT = _DBS_AT + 2 * _DB.size

MAGIC = 0xBEEFC0DE
DATA_VERSION = 1
NUM_METAS = 2
P_INVALID = (1 << 64) - 1
P_BRANCH, P_LEAF, P_OVERFLOW, P_META, P_LEAF2 = 0x01, 0x02, 0x04, 0x08, 0x20
F_BIGDATA, F_SUBDATA = 0x01, 0x02
MDB_INTEGERKEY = 0x08
MAX_DEPTH = 32  # LMDB's cursor stack (CURSOR_STACK)
_PGNO = struct.Struct("<Q")
#: overflow headers the kernel is told of together (``POSIX_FADV_WILLNEED``, in
#: :meth:`_Walk.overflow_heads`): runs of them at most this many pages apart, told of at most
#: this many bytes at a time
_GAP_PAGES = 16
_RUN_BYTES = 1 << 20
_WILLNEED = hasattr(os, "posix_fadvise")
_HDR_DTYPE = np.dtype([("pgno", "<u8"), ("pad", "<u2"), ("flags", "<u2"), ("lower", "<u2"),
                       ("upper", "<u2")])


class FileDamage(Exception):
    """The file is damaged in a way LMDB would not survive; the message says where and how.
    ``truncated``: the file ends before a page its last commit uses (``have`` < ``need`` bytes)."""

    def __init__(self, message: str, *, truncated: bool = False, have: int = 0, need: int = 0) -> None:
        super().__init__(message)
        self.truncated, self.have, self.need = truncated, have, need


@dataclass(frozen=True, slots=True)
class _Db:
    name: str
    key: bytes  # a named database's name as stored (b"" for LMDB's two own)
    fields: tuple[int, ...]  # the MDB_db record, as _DB unpacks it

    @property
    def flags(self) -> int:
        return self.fields[1]

    @property
    def depth(self) -> int:
        return self.fields[2]

    @property
    def entries(self) -> int:
        return self.fields[6]

    @property
    def root(self) -> int:
        return self.fields[7]


@dataclass(frozen=True, slots=True)
class _Meta:
    psize: int
    free: _Db
    main: _Db
    last_pg: int
    txnid: int


def check_file(path: Path, *, lenient: frozenset[bytes] = frozenset()) -> None:
    """Check the LMDB data file ``path`` (``data.mdb``) as the module docstring says; raise
    :class:`FileDamage` naming what is wrong. An absent or empty file passes (LMDB makes a new
    one). ``lenient``: names of databases where damage LMDB itself reports as an error is left
    to it. Reads only; never maps the file."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return
        _Walk(fd, size, lenient).run()
    finally:
        os.close(fd)


def _node(i: int, where: str) -> str:
    return f"node {i} of {where}"


class _Walk:
    def __init__(self, fd: int, size: int, lenient: frozenset[bytes]) -> None:
        self.fd, self.size, self.lenient = fd, size, lenient
        self.psize = 0
        self.next_pg = 0  # pages of the last commit: 0 .. next_pg - 1
        self.seen: set[int] = set()
        #: the values' overflow pages met by the walk, checked after it in page order
        #: (:meth:`overflow_heads`): (page, value size, node, page the node is on)
        self.heads: list[tuple[int, int, int, str]] = []

    def read(self, offset: int, n: int, what: str) -> bytes:
        data = os.pread(self.fd, n, offset)
        if len(data) < n:
            raise self.past_end(what, offset + n)
        return data

    def past_end(self, what: str, end: int) -> FileDamage:
        """The file is shorter than ``what`` of the last commit, which ends at byte ``end``."""
        return FileDamage(f"the file is {self.size} bytes, but its last commit uses {end} ({what} ends "
                          f"past the end of the file)", truncated=True, have=self.size, need=end)

    # -- meta pages -------------------------------------------------------------------------
    def meta(self, i: int, psize: int) -> _Meta:
        page = self.read(i * psize, _LAST_AT + _LAST_TXN.size, f"meta page {i}")
        flags = _PAGE_HDR.unpack_from(page)[2]
        magic, version = _MAGIC_VERSION.unpack_from(page, _META_AT)
        if not flags & P_META or magic != MAGIC:
            raise FileDamage(f"meta page {i} is not an LMDB meta page (flags {flags:#x}, magic {magic:#x})")
        if version != DATA_VERSION:
            raise FileDamage(f"meta page {i} names LMDB format version {version}, not {DATA_VERSION}")
        dbs = [_DB.unpack_from(page, _DBS_AT + j * _DB.size) for j in range(2)]
        last_pg, txnid = _LAST_TXN.unpack_from(page, _LAST_AT)
        return _Meta(psize=dbs[0][0], free=_Db("free-page", b"", dbs[0]), main=_Db("main", b"", dbs[1]),
                     last_pg=last_pg, txnid=txnid)

    def run(self) -> None:
        first = self.meta(0, 0)
        psize = first.psize
        # NOTE: LMDB takes the page size from meta page 0 to find meta page 1, and keeps the
        # newest one's: a damaged one escaped as a bare EINVAL (lmdb.InvalidParameterError), as
        # an older meta page's damaged version did as "LMDB data format v5 is not supported"
        if psize < 512 or psize > 65536 or psize & (psize - 1):
            raise FileDamage(f"meta page 0 names a page size of {psize} bytes")
        second = self.meta(1, psize)
        if second.psize != psize:
            raise FileDamage(f"the meta pages name page sizes of {psize} and {second.psize} bytes")
        meta = second if second.txnid > first.txnid else first
        self.psize = psize
        # NOTE: this refused a file shorter than (last_pg + 1) pages as truncated, and healthy
        # stores with it (an outage): LMDB never writes the pages it allocated at the end of the
        # file and freed again in the same transaction, so a commit that mixes overflow puts and
        # deletes leaves last_pg past the end of a file LMDB reads and writes fine. What a short
        # file kills (SIGBUS) is a read of a page the tree uses: each page read below, and each
        # value's extent, is checked against the file's size instead (:meth:`past_end`).
        self.next_pg = meta.last_pg + 1
        if meta.free.flags != MDB_INTEGERKEY or meta.main.flags & ~MDB_INTEGERKEY:
            raise FileDamage(f"the meta page names database flags {meta.free.flags:#x} and "
                             f"{meta.main.flags:#x}, not those LMDB writes")
        named: list[_Db] = []
        self.tree(meta.free, strict=True, free=True)
        self.tree(meta.main, strict=True, named=named)
        for db in named:
            self.tree(db, strict=db.key not in self.lenient)
        self.overflow_heads()

    # -- trees ------------------------------------------------------------------------------
    def tree(self, db: _Db, *, strict: bool, free: bool = False, named: list[_Db] | None = None) -> None:
        """Walk database ``db`` from its root, depth first, as LMDB would read it."""
        if db.root == P_INVALID:
            return  # empty
        leaf_depth: int | None = None
        entries = 0
        todo = [(db.root, 1, "its root")]
        while todo:
            pg, depth, via = todo.pop()
            where = f"page {pg} of the {db.name} database"
            if pg < NUM_METAS or pg >= self.next_pg or pg in self.seen or depth > MAX_DEPTH:
                if strict:
                    why = ("a page the tree reaches twice" if pg in self.seen and pg < self.next_pg
                           else "deeper than LMDB goes" if depth > MAX_DEPTH
                           else f"outside the last commit's pages 2..{self.next_pg - 1}")
                    raise FileDamage(f"{via} names page {pg} of the {db.name} database: {why}")
                continue  # LMDB reports it (MDB_PAGE_NOTFOUND, MDB_CURSOR_FULL) when it gets there
            self.seen.add(pg)
            page = self.read(pg * self.psize, self.psize, where)
            _, _, flags, lower, upper = _PAGE_HDR.unpack_from(page)
            if flags & P_LEAF2:
                raise FileDamage(f"{where} has flags {flags:#x} (a page kind these databases never have)")
            if not flags & (P_BRANCH | P_LEAF):
                if strict:
                    raise FileDamage(f"{where} is neither a branch nor a leaf page (flags {flags:#x})")
                continue  # LMDB: MDB_CORRUPTED when a search gets there
            branch = bool(flags & P_BRANCH)  # LMDB takes a page with both flags for a branch
            if not PAGE_HDR_BYTES <= lower <= upper <= self.psize:
                raise FileDamage(f"{where} has its free space at {lower}..{upper}, outside the page")
            nkeys = (lower - PAGE_HDR_BYTES) >> 1
            if branch and nkeys < (1 if free else 2):
                raise FileDamage(f"{where} is a branch page with {nkeys} keys")
            if strict:
                if branch and flags & P_LEAF:
                    raise FileDamage(f"{where} is both a branch and a leaf page (flags {flags:#x})")
                if not branch and leaf_depth not in (None, depth):
                    raise FileDamage(f"{where} is a leaf at depth {depth}, others at {leaf_depth}")
                if not branch:
                    leaf_depth = depth
            ptrs = struct.unpack_from(f"<{nkeys}H", page, PAGE_HDR_BYTES)
            if not branch:
                entries += nkeys
            prev: bytes | None = None
            psize = self.psize
            for i, ptr in enumerate(ptrs):
                if ptr < upper or ptr + NODE_BYTES > psize:
                    raise FileDamage(f"{_node(i, where)} is at offset {ptr}, outside the page's nodes "
                                     f"({upper}..{psize})")
                lo, hi, nflags, ksize = _NODE.unpack_from(page, ptr)
                data_at = ptr + NODE_BYTES + ksize
                if data_at > psize:
                    raise FileDamage(f"{_node(i, where)} has a key of {ksize} bytes, past the end of the page")
                if strict and (i or not branch):  # a branch page's key 0 is empty
                    key = page[data_at - ksize:data_at]
                    if free:
                        key = key[::-1]  # MDB_INTEGERKEY: 8-byte little-endian numbers
                    if prev is not None and key <= prev:
                        raise FileDamage(f"{_node(i, where)} has a key out of order (a stale node, a lost one)")
                    prev = key
                if branch:
                    todo.append((lo | hi << 16 | nflags << 32, depth + 1, _node(i, where)))
                elif nflags == F_BIGDATA and not free and named is None:  # a value in overflow pages
                    if data_at + _PGNO.size > psize:
                        raise FileDamage(f"{_node(i, where)} has its value's page number past the end of the page")
                    self.overflow(_PGNO.unpack_from(page, data_at)[0], lo | hi << 16, i, where, strict=strict)
                else:
                    self.leaf_node(page, i, where, page[data_at - ksize:data_at], data_at, lo | hi << 16,
                                   nflags, strict=strict, free=free, named=named)
        # NOTE: LMDB keeps both counts exact; a page that lost keys (its header's offsets) or
        # gained stale ones is found here, and a lost free-page record tripped an assertion
        if strict and (entries != db.entries or (leaf_depth or 0) != db.depth):
            raise FileDamage(f"the {db.name} database holds {entries} entries at depth {leaf_depth}, "
                             f"but its record says {db.entries} at depth {db.depth}")

    def leaf_node(self, page: bytes, i: int, where: str, key: bytes, data_at: int, dsize: int, nflags: int,
                  *, strict: bool, free: bool, named: list[_Db] | None) -> None:
        """Check node ``i`` of leaf page ``where``: its value inside the page or its overflow
        pages; a database record (main) or a free-page list (free-page database) in it."""
        at = _node(i, where)
        allowed = F_BIGDATA | (F_SUBDATA if named is not None else 0)
        if nflags & ~allowed:
            raise FileDamage(f"{at} has flags {nflags:#x}, not those of a value")
        if not nflags & F_BIGDATA:
            if data_at + dsize > self.psize:
                raise FileDamage(f"{at} has a value of {dsize} bytes, past the end of the page")
            value = page[data_at:data_at + dsize]
        else:
            if data_at + _PGNO.size > self.psize:
                raise FileDamage(f"{at} has its value's page number past the end of the page")
            value = self.overflow(_PGNO.unpack_from(page, data_at)[0], dsize, i, where, strict=strict,
                                  want=free or named is not None)
        if named is not None and nflags & F_SUBDATA:
            if nflags & F_BIGDATA or dsize != _DB.size:
                raise FileDamage(f"{at} is a database record of {dsize} bytes, not {_DB.size}")
            fields = _DB.unpack(value)
            if fields[1] & ~MDB_INTEGERKEY:
                raise FileDamage(f"{at} names database {key!r} with flags {fields[1]:#x} (none of "
                                 f"these databases has duplicate keys)")
            named.append(_Db(key.decode(errors="replace"), key, fields))
        elif free and value is not None:
            self.free_list(value, at)

    def overflow(self, pg: int, dsize: int, i: int, where: str, *, strict: bool,
                 want: bool = False) -> bytes | None:
        """Check the overflow pages of node ``i`` of page ``where``, a value of ``dsize`` bytes
        at page ``pg``; return the value if ``want`` (a free-page list, a database record), else
        None, the header read later with the others in page order (:meth:`overflow_heads`)."""
        if pg < NUM_METAS or pg >= self.next_pg:
            if strict:
                raise FileDamage(f"{_node(i, where)} names page {pg} for its value, outside the last "
                                 f"commit's pages 2..{self.next_pg - 1}")
            return None  # LMDB: MDB_PAGE_NOTFOUND at the read
        if (pg + 1) * self.psize > self.size:  # (and so every page number below fits in an int64)
            raise self.past_end(f"the overflow page {pg} of {_node(i, where)}", (pg + 1) * self.psize)
        if not want:
            self.heads.append((pg, dsize, i, where))
            return None
        self.overflow_head(pg, dsize, i, where, self.read(pg * self.psize, PAGE_HDR_BYTES, _node(i, where)))
        return self.read(pg * self.psize + PAGE_HDR_BYTES, dsize, f"the value of {_node(i, where)}")

    def overflow_head(self, pg: int, dsize: int, i: int, where: str, head: bytes) -> None:
        """Check the header ``head`` of the overflow pages at ``pg`` of node ``i`` of page
        ``where``, a value of ``dsize`` bytes, and that the value lies inside the file."""
        _, _, flags, pages_lo, pages_hi = _PAGE_HDR.unpack(head)
        pages = pages_lo | pages_hi << 16  # mp_pages overlays lower and upper
        if not flags & P_OVERFLOW or pages < 1 or pg + pages > self.next_pg:
            raise FileDamage(f"{_node(i, where)} names page {pg} for its value, which is not an overflow "
                             f"page of the last commit (flags {flags:#x}, {pages} pages)")
        if PAGE_HDR_BYTES + dsize > pages * self.psize:
            raise FileDamage(f"{_node(i, where)} has a value of {dsize} bytes, longer than its {pages} "
                             f"overflow pages")
        # the pages the value fills (LMDB reads dsize bytes from after the header): a fault past
        # the end of the file is SIGBUS; the header's count may be larger (a value rewritten in
        # place keeps its pages) but LMDB never reads those
        end = (pg + -(-(PAGE_HDR_BYTES + dsize) // self.psize)) * self.psize
        if end > self.size:
            raise self.past_end(f"the value of {_node(i, where)}", end)

    def overflow_heads(self) -> None:
        """Check the overflow headers the walk met (:meth:`overflow`), reading them in page
        order, the kernel told ahead (``POSIX_FADV_WILLNEED``) of each run of them close
        together: a cold page cache reads the file front to back, in large reads, where the walk
        meets them in key order, all over the file. The reads are of the 16-byte headers alone
        (nothing else is copied from a warm cache), checked together in numpy; the first bad one
        is named by :meth:`overflow_head`."""
        if not self.heads:
            return
        psize, fd = self.psize, self.fd
        pg = np.array([h[0] for h in self.heads], dtype=np.int64)
        dsize = np.array([h[1] for h in self.heads], dtype=np.int64)
        order = np.argsort(pg, kind="stable")
        pg, dsize = pg[order], dsize[order]
        if _WILLNEED:
            cut = np.flatnonzero(np.diff(pg) > _GAP_PAGES) + 1
            for a, b in zip(np.concatenate(([0], cut)).tolist(), np.concatenate((cut, [len(pg)])).tolist(),
                            strict=True):
                for at in range(int(pg[a]) * psize, int(pg[b - 1]) * psize + PAGE_HDR_BYTES, _RUN_BYTES):
                    os.posix_fadvise(fd, at, min(_RUN_BYTES, int(pg[b - 1]) * psize + PAGE_HDR_BYTES - at),
                                     os.POSIX_FADV_WILLNEED)
        heads = [os.pread(fd, PAGE_HDR_BYTES, p * psize) for p in pg.tolist()]
        raw = b"".join(heads)
        bad = np.zeros(len(pg), dtype=bool)
        if len(raw) != PAGE_HDR_BYTES * len(pg):
            bad |= np.array([len(h) != PAGE_HDR_BYTES for h in heads])
        else:
            hdr = np.frombuffer(raw, dtype=_HDR_DTYPE)
            pages = hdr["lower"].astype(np.int64) | hdr["upper"].astype(np.int64) << 16
            ends = (pg + (PAGE_HDR_BYTES + dsize + psize - 1) // psize) * psize
            bad = ((hdr["flags"] & P_OVERFLOW) == 0) | (pages < 1) | (pg + pages > self.next_pg) | (
                PAGE_HDR_BYTES + dsize > pages * psize) | (ends > self.size)
        if bad.any():
            k = int(order[int(np.argmax(bad))])
            p, n, i, where = self.heads[k]
            head = os.pread(fd, PAGE_HDR_BYTES, p * psize)
            if len(head) < PAGE_HDR_BYTES:
                raise self.past_end(f"the overflow page {p} of {_node(i, where)}", p * psize + PAGE_HDR_BYTES)
            self.overflow_head(p, n, i, where, head)
            raise AssertionError(f"overflow page {p}: numpy and overflow_head disagree")  # pragma: no cover
        self.heads = []

    def free_list(self, value: bytes, at: str) -> None:
        """A free-page record: a count, then that many page numbers, largest first."""
        if len(value) < _PGNO.size:
            raise FileDamage(f"{at} is a free-page list of {len(value)} bytes")
        (n,) = _PGNO.unpack_from(value)
        if (n + 1) * _PGNO.size > len(value):
            raise FileDamage(f"{at} is a free-page list of {n} pages in {len(value)} bytes")
        # NOTE: this unpacked each page number into a Python int and compared them in Python:
        # after a large delete (millions of free pages) the open spent seconds and a few hundred
        # MiB here. numpy compares them in place, in the record's bytes.
        pages = np.frombuffer(value, dtype="<u8", count=n, offset=_PGNO.size)
        if n and (int(pages[-1]) < NUM_METAS or int(pages[0]) >= self.next_pg
                  or not bool(np.all(pages[:-1] > pages[1:]))):
            raise FileDamage(f"{at} is a free-page list with pages outside 2..{self.next_pg - 1} or "
                             f"out of order")
