"""N1: a flipped bit in the NVMe tier's LMDB file killed the process (SIGBUS, or SIGABRT from an
LMDB assertion) when the Store opened it or at the first get of a block, with no word of which
file or what to do. Now the open is refused with an IntegrityError naming the file and the way
out (``tiers.lmdb_check`` reads the file before LMDB maps it).

Each open runs in a child process, so that a regression shows as a signal death, not as a dead
test run. The damage is made on the store of ``test_nvme_damaged`` (pages found the same way:
LMDB's documented on-disk layout, walked from the newest meta page)."""

from __future__ import annotations

import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_nvme_damaged import PAGE, _build, _config, _is_branch, _nodes, _root

from kvstore.errors import IntegrityError
from kvstore.store import Store

TESTS = Path(__file__).parent

#: open the store at argv[1], get every block, put one more (a write allocates pages from the
#: free-page list); exit 3 with the error where the open or a call is refused
CHILD = f"""
import sys
from pathlib import Path
sys.path.insert(0, {str(TESTS)!r})
from test_nvme_damaged import CHAINS, SPEC, TENANTS, _chain, _config
from kvstore.errors import KVStoreError
from kvstore.store import Store
try:
    s = Store.open(_config(Path(sys.argv[1])))
    n = sum(s.get(t, SPEC, s.block_keys(t, SPEC, _chain(t, c)[0])).shape[0]
            for t in TENANTS for c in range(CHAINS))
    toks = list(range(700_000, 700_000 + 4 * SPEC.block_tokens))
    s.put("t0", SPEC, s.block_keys("t0", SPEC, toks), _chain("t0", 0)[1])
    s.close()
except KVStoreError as exc:
    print(type(exc).__name__, exc)
    sys.exit(3)
print("served", n)
"""


def _open_in_child(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", CHILD, str(path)], check=False, capture_output=True,
                          text=True, timeout=120)


def _newest_meta(data: bytes) -> int:
    return max((0, 1), key=lambda m: struct.unpack_from("<Q", data, m * PAGE + 144)[0])


def _first_leaf(data: bytes, name: bytes) -> int:
    pg = _root(data, name)
    while _is_branch(data, pg):
        pg = next(child for child, _, _ in _nodes(data, pg))
    return pg


def _node_at(data: bytes, pg: int, i: int = 0) -> int:
    """The file offset of node ``i`` of page ``pg``."""
    return pg * PAGE + struct.unpack_from("<H", data, pg * PAGE + 16 + 2 * i)[0]


def _value_size(data: bytearray, name: bytes) -> None:
    """The size of the first value of ``name`` made about 2 GiB (a flipped high bit): LMDB reads
    that many bytes from where the value starts, far past the end of the file."""
    node = _node_at(data, _first_leaf(data, name))
    struct.pack_into("<H", data, node + 2, 0x7FFF)  # mn_hi: bits 16..31 of the data size


def _one_key_branch(data: bytearray, name: bytes) -> None:
    """The root branch page of ``name`` left with one key (its header's lower offset): LMDB
    asserts a branch page has two (SIGABRT)."""
    root = _root(data, name)
    assert _is_branch(data, root), "too few blocks for a branch page"
    struct.pack_into("<H", data, root * PAGE + 12, 16 + 2)


def _free_root(data: bytes) -> int:
    """The root page of LMDB's free-page database (its record in the newest meta page)."""
    root = struct.unpack_from("<Q", data, _newest_meta(data) * PAGE + 80)[0]
    assert root != 2**64 - 1, "no free-page list in this file"
    assert not _is_branch(data, root), "a free-page database of more than one page"
    return root


def _free_lists_lost(data: bytearray, name: bytes) -> None:
    """The free-page database's only page left with no records (its header's lower offset): a
    write that saves the free pages trips an LMDB assertion (SIGABRT)."""
    struct.pack_into("<H", data, _free_root(data) * PAGE + 12, 16)


def _free_list_count(data: bytearray, name: bytes) -> None:
    """The page count of the first free-page list made 2**28: LMDB merges that many page
    numbers from the record when a write allocates pages (a write failed with MDB_BAD_TXN, as
    a full disk)."""
    node = _node_at(data, _free_root(data))
    _, _, flags, ksize = struct.unpack_from("<HHHH", data, node)
    assert not flags & 1, "the first free-page list is inline"
    struct.pack_into("<Q", data, node + 8 + ksize, 1 << 28)


DAMAGE = {
    "a value's size in the values database": (_value_size, b"blocks"),
    "a branch page of the values database with one key": (_one_key_branch, b"blocks"),
    "the free-page lists lost": (_free_lists_lost, b""),
    "a free-page list's count": (_free_list_count, b""),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("n1") / "s"
    _build(path)
    return path


def _copy(built: Path, to: Path) -> Path:
    shutil.copytree(built, to)
    return to


@pytest.mark.parametrize("what", list(DAMAGE))
def test_a_damaged_lmdb_file_is_refused_at_open_by_name_not_a_signal_death(built, tmp_path, what):
    """SIGBUS (a value's size), SIGABRT (a branch page with one key, the free-page lists lost),
    a write failed as a full disk (a free-page list's count): now the open is refused."""
    path = _copy(built, tmp_path / "s")
    data_file = path / "nvme" / "data.mdb"
    data = bytearray(data_file.read_bytes())
    damage, name = DAMAGE[what]
    damage(data, name)
    data_file.write_bytes(data)
    proc = _open_in_child(path)
    assert proc.returncode >= 0, f"killed by {signal.Signals(-proc.returncode).name}: {proc.stderr[-2000:]}"
    assert proc.returncode == 3, proc.stdout + proc.stderr[-2000:]
    assert proc.stdout.startswith(f"IntegrityError {data_file} is damaged ("), proc.stdout
    assert f"restore it from a backup, or move {path / 'nvme'} away" in proc.stdout


def test_the_damage_is_named_in_process_too(built, tmp_path):
    """The same refusal raised in this process (the check never maps the file): the page and
    what is wrong with it."""
    path = _copy(built, tmp_path / "s")
    data_file = path / "nvme" / "data.mdb"
    data = bytearray(data_file.read_bytes())
    _value_size(data, b"blocks")
    data_file.write_bytes(data)
    with pytest.raises(IntegrityError, match=r"node 0 of page \d+ of the blocks database has a value of "
                                             r"\d+ bytes, longer than its \d+ overflow pages"):
        Store.open(_config(path))


def test_a_sound_file_passes_the_check_in_a_few_milliseconds(built):
    """The check reads the tree pages and one header per value, no value: far below the open's
    own cost (about 25 µs a block)."""
    from tiers.lmdb_check import check_file  # here: the module is new, the other tests run without it

    start = time.perf_counter()
    for name in ("nvme", "nvme/keys"):
        check_file(built / name / "data.mdb", lenient=frozenset({b"blocks"}))
    assert time.perf_counter() - start < 1.0
    s = Store.open(_config(built))
    s.close()
