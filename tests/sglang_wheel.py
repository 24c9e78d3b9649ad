"""The ``sglang`` wheel's HiCache storage API, without SGLang's engine (imported as ``sglang_wheel``).

SGLang does not run on CPU, so the tests never install it. Instead this helper:

1. downloads the wheel once with ``pip download --no-deps sglang==VERSION`` into the cache
   directory (``$KVSTORE_SGLANG_CACHE``, default ``~/.cache/kvstore/sglang``);
2. unpacks only :data:`MEMBERS` (the module defining ``HiCacheStorage``, the storage package with
   ``StorageBackendFactory``, and ``sglang/srt/environ.py``, the stdlib-only settings module
   ``hicache_storage`` imports) into ``<cache>/unpacked-VERSION``;
3. puts that directory first on ``sys.path`` and imports the two modules.

Nothing is stubbed: ``sglang/__init__.py`` (which pulls in the frontend language and transformers
patches) is simply not unpacked, so ``sglang`` and ``sglang.srt`` load as implicit namespace
packages — the wheel itself ships no ``__init__.py`` for ``sglang/srt`` and
``sglang/srt/mem_cache``. The unpacked modules need only the standard library and torch.

:func:`load` raises :class:`WheelUnavailable` (the tests skip on it) when the wheel cannot be
downloaded, e.g. without network access and without a cached wheel.
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The SGLang release the conformance tests run against (override: $KVSTORE_SGLANG_VERSION).
VERSION = os.environ.get("KVSTORE_SGLANG_VERSION", "0.5.23")

#: Files unpacked from the wheel: the HiCache storage API and what it imports from sglang.
MEMBERS = (
    "sglang/srt/environ.py",
    "sglang/srt/mem_cache/hicache_storage.py",
    "sglang/srt/mem_cache/storage/__init__.py",
    "sglang/srt/mem_cache/storage/backend_factory.py",
)


class WheelUnavailable(RuntimeError):
    """The sglang wheel is neither cached nor downloadable."""


@dataclass(frozen=True, slots=True)
class SGLangStorageAPI:
    """The real classes from the wheel."""

    version: str
    root: Path
    HiCacheStorage: type
    HiCacheStorageConfig: type
    HiCacheStorageExtraInfo: type
    StorageBackendFactory: type


def cache_dir() -> Path:
    return Path(os.environ.get("KVSTORE_SGLANG_CACHE", Path.home() / ".cache" / "kvstore" / "sglang"))


def wheel(cache: Path | None = None, version: str = VERSION) -> Path:
    """The cached wheel of ``version``, downloading it (no dependencies) on first use."""
    cache = cache or cache_dir()
    found = sorted(cache.glob(f"sglang-{version}-*.whl"))
    if found:
        return found[-1]
    cache.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", f"sglang=={version}", "-d", str(cache)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    except subprocess.TimeoutExpired:
        raise WheelUnavailable(f"downloading sglang=={version} took over 600 s") from None
    found = sorted(cache.glob(f"sglang-{version}-*.whl"))
    if proc.returncode != 0 or not found:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:]
        raise WheelUnavailable(f"cannot download sglang=={version}: {(tail[0] if tail else 'no wheel')[:300]}")
    return found[-1]


def unpack(whl: Path, dest: Path) -> Path:
    """Extract :data:`MEMBERS` of ``whl`` into ``dest`` (once; atomic rename of a temp dir)."""
    if all((dest / m).is_file() for m in MEMBERS):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".unpack-", dir=dest.parent))
    try:
        with zipfile.ZipFile(whl) as zf:
            names = set(zf.namelist())
            missing = [m for m in MEMBERS if m not in names]
            if missing:
                raise WheelUnavailable(f"{whl.name} lacks {missing}: the HiCache API moved")
            for m in MEMBERS:
                zf.extract(m, tmp)
        try:
            tmp.rename(dest)
        except OSError:  # NOTE: another process unpacked it first; theirs is identical
            if not all((dest / m).is_file() for m in MEMBERS):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def load(version: str = VERSION) -> SGLangStorageAPI:
    """Import the wheel's ``hicache_storage`` and ``storage`` modules (see the module docstring)."""
    whl = wheel(version=version)
    root = unpack(whl, cache_dir() / f"unpacked-{version}")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    hs: Any = importlib.import_module("sglang.srt.mem_cache.hicache_storage")
    storage: Any = importlib.import_module("sglang.srt.mem_cache.storage")
    return SGLangStorageAPI(version, root, hs.HiCacheStorage, hs.HiCacheStorageConfig,
                            hs.HiCacheStorageExtraInfo, storage.StorageBackendFactory)
