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
  some of them with errors no caller can tell from others); the newest one's last page inside
  the file (a truncated file), its two database records' flags and roots;
* every branch and leaf page reachable from a database root: the page header's offsets inside
  the page, at least two keys on a branch page (else an assertion), each node and its key inside
  the page, a value stored in the page inside it, an overflow value's pages inside the last
  commit's, counted in its overflow page's header (LMDB reads ``size`` bytes from there);
* the free-page database's records (page lists LMDB merges when it allocates): their counts
  inside the record, their page numbers inside the last commit's;
* in a *strict* database (all but those named ``lenient``), also what LMDB would report as an
  error (a child page past the last commit's, a page of the wrong kind, leaves at different
  depths): the databases walked at open, whose damage refuses the open anyway. In a lenient
  database (the NVMe tier's values) such a page is not followed, as LMDB will not follow it
  either; the tier counts the blocks behind it as misses.

Cost: one read per branch/leaf page and one 16-byte read per overflow value; no value is read.

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
from itertools import pairwise
from pathlib import Path

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


class FileDamage(Exception):
    """The file is damaged in a way LMDB would not survive; the message says where and how.
    ``truncated``: the file is shorter than its last commit (``have`` < ``need`` bytes)."""

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

    def read(self, offset: int, n: int, what: str) -> bytes:
        data = os.pread(self.fd, n, offset)
        if len(data) < n:
            raise FileDamage(f"{what} ends past the end of the file ({self.size} bytes)")
        return data

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
        need = (meta.last_pg + 1) * psize
        if need > self.size:
            raise FileDamage(f"the file is {self.size} bytes, but its last commit uses {need}",
                             truncated=True, have=self.size, need=need)
        self.next_pg = meta.last_pg + 1
        if meta.free.flags != MDB_INTEGERKEY or meta.main.flags & ~MDB_INTEGERKEY:
            raise FileDamage(f"the meta page names database flags {meta.free.flags:#x} and "
                             f"{meta.main.flags:#x}, not those LMDB writes")
        named: list[_Db] = []
        self.tree(meta.free, strict=True, free=True)
        self.tree(meta.main, strict=True, named=named)
        for db in named:
            self.tree(db, strict=db.key not in self.lenient)

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
        at page ``pg``; return the value if ``want`` (a free-page list), else None."""
        if pg < NUM_METAS or pg >= self.next_pg:
            if strict:
                raise FileDamage(f"{_node(i, where)} names page {pg} for its value, outside the last "
                                 f"commit's pages 2..{self.next_pg - 1}")
            return None  # LMDB: MDB_PAGE_NOTFOUND at the read
        head = os.pread(self.fd, PAGE_HDR_BYTES, pg * self.psize)  # inside the file: pg < next_pg
        _, _, flags, pages_lo, pages_hi = _PAGE_HDR.unpack(head)
        pages = pages_lo | pages_hi << 16  # mp_pages overlays lower and upper
        if not flags & P_OVERFLOW or pages < 1 or pg + pages > self.next_pg:
            raise FileDamage(f"{_node(i, where)} names page {pg} for its value, which is not an overflow "
                             f"page of the last commit (flags {flags:#x}, {pages} pages)")
        if PAGE_HDR_BYTES + dsize > pages * self.psize:
            raise FileDamage(f"{_node(i, where)} has a value of {dsize} bytes, longer than its {pages} "
                             f"overflow pages")
        if not want:
            return None
        return self.read(pg * self.psize + PAGE_HDR_BYTES, dsize, f"the value of {_node(i, where)}")

    def free_list(self, value: bytes, at: str) -> None:
        """A free-page record: a count, then that many page numbers, largest first."""
        if len(value) < _PGNO.size:
            raise FileDamage(f"{at} is a free-page list of {len(value)} bytes")
        (n,) = _PGNO.unpack_from(value)
        if (n + 1) * _PGNO.size > len(value):
            raise FileDamage(f"{at} is a free-page list of {n} pages in {len(value)} bytes")
        pages = struct.unpack_from(f"<{n}Q", value, _PGNO.size)
        if any(not NUM_METAS <= p < self.next_pg for p in pages) or any(
                a <= b for a, b in pairwise(pages)):
            raise FileDamage(f"{at} is a free-page list with pages outside 2..{self.next_pg - 1} or "
                             f"out of order")
