"""SGLang HiCache storage backend (the L3 tier of SGLang's hierarchical cache) on the kvstore sidecar.

Importing this module does not import SGLang. The backend class is built on first access of
:data:`KVStoreHiCacheStorage` (a PEP 562 module attribute) by :func:`hicache_storage_class`, which
subclasses the installed ``sglang.srt.mem_cache.hicache_storage.HiCacheStorage``. SGLang loads it
through its dynamic-backend path::

    --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvstore",
        "module_path": "kvstore.integrations.sglang", "class_name": "KVStoreHiCacheStorage",
        "kvstore_target": "127.0.0.1:50551", "kvstore_token": "..."}'

``StorageBackendFactory`` then calls ``KVStoreHiCacheStorage(storage_config, kwargs)``.
Settings are read from ``storage_config.extra_config`` (see :class:`KVStoreBackendConfig`).

Contracts:

* **Keys.** SGLang keys are strings (hashes of a page's token ids that already chain over the
  prefix: SGLang computes each page's hash from its parent's). Prefix chaining is therefore
  SGLang's responsibility in this API: every page is stored as an independent *root* block of
  kvstore (no parent), under the 32-byte key ``BLAKE2b-256(person="kvstore-sglang1",
  spec fingerprint || utf-8 key)``. The tenant namespace is applied by the server from the
  authenticated token, so two tenants never see each other's pages even for equal SGLang keys.
* **Values.** A page is opaque bytes of a fixed size ``page_bytes`` (SGLang's flat data page,
  e.g. ``[2, layers, page_size, heads, head_dim]`` for MHA). It is stored under a *flat bytes*
  :class:`~kvstore.spec.ModelSpec` — one layer, one head, one token, ``head_dim =
  page_bytes / (2 * itemsize)`` of the page dtype — whose fingerprint still separates model,
  page geometry, SGLang layout, TP shard (MLA pages are shared by all TP ranks), PP stage and
  attention CP rank (in the ``layout`` tag). With decode context parallelism (``dcp_size > 1``,
  SGLang 0.5.23 on; MLA) each DCP rank stores its own shard of every page: the shard is the
  spec's rank among ``dcp_size``, and TP size and logical page size join the tag, so shards never
  share a key (DCP groups, which hold the same shards, do). Configs of SGLang releases without
  the DCP fields are read as no DCP; keys without DCP are unchanged. Round trips are bit-exact (kvstore's codecs are lossless unless an
  operator enables NVMe quantization for the tenant or model). The host pool SGLang registers
  fixes the spec: its page size, dtype and layout (so a backend configured with
  ``kvstore_page_bytes`` and one that is not share pages once the pool is registered);
  ``kvstore_page_bytes`` or ``kvstore_dtype`` that disagree with the pool are refused there,
  as an :class:`~kvstore.errors.InvalidArgument`, rather than failing every transfer later.
* **Results.** ``get`` returns the page or ``None``; ``set``/``batch_set`` return ``False`` on
  a store-side failure (quota, unavailable, ...) and log it; a page of the wrong size raises
  :class:`~kvstore.errors.InvalidArgument` (a caller bug). ``batch_exists`` returns the number of
  leading keys present. The ``*_v1`` variants move pages between the registered host pool and
  the store with one staging page buffer (not zero-copy: the host pool does not live in the
  client's shared-memory region).
* **Side pools (``*_v2``).** SGLang 0.5.23 runs every HiCache model through its
  ``HybridCacheController``; a model with pools beside the KV pool (DSA indexer, Mamba/SWA state,
  a speculative draft KV pool) registers them with ``register_mem_host_pool_v2`` and moves them
  with ``batch_exists_v2`` / ``batch_get_v2`` / ``batch_set_v2``. Each side pool's page is a block
  of its own flat bytes spec (the pool's page size and dtype, its name in the layout tag; keys as
  above, so a side page never shares a key with the KV page of the same SGLang key). Under MLA they
  are shared by the TP ranks as the KV pages are, but Mamba state, which SGLang shards over TP
  even then. Hit policies ``all_pages`` and ``trailing_pages`` are computed as SGLang's file
  backend does; a pool whose flat page kvstore cannot hold (an odd number of bytes, no flat pages)
  is refused at ``register_mem_host_pool_v2``, which fails SGLang's attach, instead of failing
  every transfer in its cache threads. Same guard, timeout and misses as the KV pages: after one
  failed call, the pages left in that call are misses.
* **Hooks.** ``get_stats`` returns ``None`` (SGLang logs empty storage metrics; the sidecar's
  stats are ``client.stats()``); ``clear`` keeps the pages, logs a warning and returns ``False``
  (a tenant token can neither list nor purge pages).
* **Cost.** Pages are independent roots, moved many to an RPC by the client's root verbs
  (``lookup_roots``, ``put_bytes(roots=True)``, ``get_roots_into``: ``Target.roots``): each
  batch verb makes one RPC per pool it touches (``batch_exists``, ``batch_get``/``batch_set``
  and their ``_v1`` forms one; the ``_v2`` verbs one per transfer or side pool), not one per
  page (0.4-1 ms each: tens of ms for a 64-page batch in SGLang's prefetch and backup
  threads). A batch of more than 1024 pages, or 128 MiB of pages, goes in several calls (the
  sidecar's default limits per call, half the client's shared-memory region). Results are as
  the per-page calls gave them, and after a failed call the pages left are misses, not asked;
  but a put call that fails (a quota, a sidecar that fails or times out) stores all its pages
  or none (as a chained put), so every page of it is reported not stored, where the pages
  before the failing one stayed stored.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.integrations.guard import SidecarGuard
from kvstore.integrations.options import DEFAULT_TIMEOUT_S, non_negative_int, positive_seconds
from kvstore.keys import KEY_BYTES
from kvstore.spec import DTYPES, ModelSpec

__all__ = ["KVStoreBackendConfig", "hicache_storage_class", "page_key", "page_spec"]

log = logging.getLogger(__name__)

_PERSON = b"kvstore-sglang1"
#: what a call to the sidecar returns when the sidecar failed (logged; the page is a miss)
_FAILED = object()
#: SGLang's names (``PoolName`` values) of the KV pool and of the Mamba state pool
_KV_POOL, _MAMBA_POOL = "kv", "mamba"
#: torch dtype -> kvstore dtype name
_DTYPE_NAMES = {getattr(torch, attr): name for name, (attr, _) in DTYPES.items() if name == attr}
#: the most pages, and bytes of pages, one call to the sidecar names or moves: a bigger batch
#: (SGLang's page size 1, a long prompt) goes in several calls, within the sidecar's default
#: limits per call (``limits.max_keys_per_call``, ``max_blocks_per_stream``) and half the
#: client's default shared-memory region (a put staged through it goes in-band when it does not fit)
_CALL_PAGES, _CALL_BYTES = 1024, 128 << 20


@dataclass(frozen=True, slots=True)
class KVStoreBackendConfig:
    """The backend's settings, from ``HiCacheStorageConfig.extra_config`` (``kvstore_*`` keys).

    Attributes:
        target: sidecar address (``kvstore_target``, required).
        token: tenant bearer token (``kvstore_token``; else ``$KVSTORE_TOKEN``).
        page_bytes: bytes of one page (``kvstore_page_bytes``); 0 = take it from the host pool
            registered by SGLang (``get_dummy_flat_data_page().nbytes``). When set, pages can
            move before a host pool is registered; a pool whose pages are of another size is
            refused at ``register_mem_pool_host``.
        dtype: page dtype name for the spec (``kvstore_dtype``); "" = the host pool's (float16
            until one is registered). A pool of another (known) dtype is refused at registration.
        model / revision: spec identity (``kvstore_model`` defaults to SGLang's ``model_name``).
        ttl_s: per-page TTL in seconds (``kvstore_ttl_s``), None = the tenant's policy.
        shared_memory: ``kvstore_shared_memory``: None = automatic, False = in-band streams only.
        timeout_s: seconds each call to the sidecar may take (``kvstore_timeout_s``, default
            10): a sidecar that stops answering costs a prefetch or backup that long, then a miss.
    """

    target: str
    token: str
    page_bytes: int = 0
    dtype: str = ""
    model: str = "sglang"
    revision: str = ""
    ttl_s: float | None = None
    shared_memory: bool | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S

    def __post_init__(self) -> None:
        if not self.target:
            raise InvalidArgument("extra_config needs kvstore_target (the sidecar address)")
        if not self.token:
            raise InvalidArgument("extra_config needs kvstore_token (or set $KVSTORE_TOKEN)")
        if not isinstance(self.page_bytes, int) or self.page_bytes < 0:
            raise InvalidArgument(f"kvstore_page_bytes must be a non-negative int, got {self.page_bytes!r}")
        if self.dtype and self.dtype not in DTYPES:
            raise InvalidArgument(f"kvstore_dtype {self.dtype!r} is not one of {sorted(DTYPES)}")
        if self.ttl_s is not None and not (math.isfinite(self.ttl_s) and self.ttl_s > 0):
            raise InvalidArgument(f"kvstore_ttl_s must be a finite number of seconds > 0, got {self.ttl_s}")
        positive_seconds(self.timeout_s, "kvstore_timeout_s")
        if self.shared_memory is not None and not isinstance(self.shared_memory, bool):
            raise InvalidArgument(f"kvstore_shared_memory must be true, false or absent (automatic), "
                                  f"got {self.shared_memory!r}")

    @classmethod
    def from_storage_config(cls, storage_config: Any) -> KVStoreBackendConfig:
        extra = dict(storage_config.extra_config or {})
        ttl = extra.get("kvstore_ttl_s")
        return cls(target=str(extra.get("kvstore_target", "")),
                   token=str(extra.get("kvstore_token") or os.environ.get("KVSTORE_TOKEN", "")),
                   page_bytes=non_negative_int(extra.get("kvstore_page_bytes", 0), "kvstore_page_bytes"),
                   dtype=str(extra.get("kvstore_dtype", "")),
                   model=str(extra.get("kvstore_model") or storage_config.model_name or "sglang"),
                   revision=str(extra.get("kvstore_revision", "")),
                   ttl_s=None if ttl is None else positive_seconds(ttl, "kvstore_ttl_s"),
                   shared_memory=extra.get("kvstore_shared_memory"),
                   timeout_s=positive_seconds(extra.get("kvstore_timeout_s", DEFAULT_TIMEOUT_S), "kvstore_timeout_s"))


def page_spec(cfg: KVStoreBackendConfig, storage_config: Any, page_bytes: int, dtype: str,
              layout: str, *, tp_shared: bool | None = None) -> ModelSpec:
    """The flat bytes spec of one SGLang page (see the module docstring). ``tp_shared``: one
    page for all TP ranks (default: MLA models' pages are, others' are not)."""
    itemsize = DTYPES[dtype][1]
    if page_bytes <= 0 or page_bytes % (2 * itemsize):
        raise InvalidArgument(f"page of {page_bytes} bytes is not a whole number of K/V {dtype} pairs")
    mla = bool(storage_config.is_mla_model)
    shared = mla if tp_shared is None else tp_shared
    tp_rank, tp_size = (0, 1) if shared else (storage_config.tp_rank, storage_config.tp_size)
    tag = (f"sglang-page:{layout or 'flat'}:pp{storage_config.pp_rank}/{storage_config.pp_size}"
           f":cp{storage_config.attn_cp_rank}/{storage_config.attn_cp_size}:mla={int(mla)}")
    dcp_rank, dcp_size = _dcp_shard(storage_config)
    if dcp_size > 1:
        # NOTE: under DCP each rank of a group holds (and writes) its own shard of every page;
        # keyed as one MLA page, the first shard written was served to every rank. The shard
        # index is the spec's rank (equal across DCP groups, which hold the same shards), and
        # the tag carries the topology the shard's contents depend on, as SGLang's file and
        # Mooncake backends do. Without DCP the tag is unchanged (keys stay as they were).
        if shared:
            tp_rank, tp_size = dcp_rank, dcp_size
        tag += (f":dcp{dcp_rank}/{dcp_size}:tp{storage_config.tp_size}"
                f":page{getattr(storage_config, 'logical_page_size', None)}")
    return ModelSpec(model=cfg.model, revision=cfg.revision, num_layers=1, num_kv_heads=1,
                     head_dim=page_bytes // (2 * itemsize), dtype=dtype, block_tokens=1,
                     layout=tag, tp_rank=tp_rank, tp_size=tp_size)


def _dcp_shard(storage_config: Any) -> tuple[int, int]:
    """``(dcp_rank, dcp_size)`` of the config: decode-context-parallel shard of each page.
    SGLang releases before DCP storage have neither field, meaning (0, 1)."""
    size = getattr(storage_config, "dcp_size", None)
    rank = getattr(storage_config, "dcp_rank", None)
    size = 1 if size is None else size
    rank = 0 if rank is None else rank
    if isinstance(size, bool) or isinstance(rank, bool) or not isinstance(size, int) \
            or not isinstance(rank, int) or size < 1 or not 0 <= rank < size:
        raise InvalidArgument(f"storage config has dcp_rank {rank!r} of dcp_size {size!r}: "
                              f"need ints with 0 <= dcp_rank < dcp_size")
    return rank, size


def _pool_name(name: Any) -> str:
    """SGLang's pool name (a ``PoolName``, a str enum, or a plain str) as a plain str."""
    return str(getattr(name, "value", name))


def page_key(spec: ModelSpec, key: str) -> bytes:
    """The kvstore block key of SGLang page ``key`` under ``spec`` (deterministic everywhere)."""
    if not isinstance(key, str):  # NOTE: bytes or None gave an AttributeError from .encode()
        raise InvalidArgument(f"a page key must be a str (SGLang's page hash), got {type(key).__name__}")
    return hashlib.blake2b(spec.fingerprint + key.encode(), digest_size=KEY_BYTES, person=_PERSON).digest()


def _calls(n: int, page_bytes: int = 0) -> list[slice]:
    """The pages of a batch of ``n`` that each call to the sidecar takes (see :data:`_CALL_PAGES`);
    ``page_bytes``: bytes each page moves (0: only keys are sent)."""
    step = min(_CALL_PAGES, max(1, _CALL_BYTES // page_bytes)) if page_bytes else _CALL_PAGES
    return [slice(i, i + step) for i in range(0, n, step)]


def _check_page(t: Any, nbytes: int) -> None:
    """InvalidArgument (a caller bug) unless ``t`` is a tensor of ``nbytes`` bytes."""
    if not isinstance(t, torch.Tensor):
        raise InvalidArgument(f"a page must be a torch.Tensor, got {type(t).__name__}")
    if t.numel() * t.element_size() != nbytes:
        raise InvalidArgument(f"page of {t.numel() * t.element_size()} bytes, the backend stores pages of {nbytes}")


def _byte_rows(t: torch.Tensor, nbytes: int) -> torch.Tensor:
    """``t`` as a [1, nbytes] uint8 CPU view (a copy only when not contiguous or not on CPU)."""
    if not isinstance(t, torch.Tensor):
        raise InvalidArgument(f"a page must be a torch.Tensor, got {type(t).__name__}")
    flat = t.detach().contiguous().view(-1).view(torch.uint8)
    if flat.numel() != nbytes:
        raise InvalidArgument(f"page of {flat.numel()} bytes, the backend stores pages of {nbytes}")
    return flat.cpu().view(1, nbytes)


@functools.cache
def hicache_storage_class() -> type:
    """Build (once) the ``HiCacheStorage`` subclass; needs the sglang package importable."""
    from sglang.srt.mem_cache import hicache_storage as hs  # NOTE: its v2 types are looked up when used
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

    from kvstore.client import Client

    class KVStoreHiCacheStorage(HiCacheStorage):
        """SGLang ``HiCacheStorage`` on a kvstore sidecar; see :mod:`kvstore.integrations.sglang`."""

        def __init__(self, storage_config: Any, kwargs: dict[str, Any] | None = None) -> None:
            self.storage_config = storage_config
            self.config = KVStoreBackendConfig.from_storage_config(storage_config)
            # NOTE: registers its region at its first (guarded) put or get: built here, outside
            # the guard, a sidecar that never answers held SGLang's start for a whole timeout
            self.client = Client(self.config.target, self.config.token, local=self.config.shared_memory,
                                 timeout=self.config.timeout_s, register="at_first_use")
            self.guard = SidecarGuard(self.config.target, probe=self.client.whoami, timeouts_open=True)
            self._spec: ModelSpec | None = None
            self._dtype = self.config.dtype
            self._side_pools: dict[str, tuple[Any, ModelSpec]] = {}  # pool name -> (host pool, page spec)
            if self.config.page_bytes:
                self._spec = page_spec(self.config, storage_config, self.config.page_bytes,
                                       self._dtype or "float16", "flat")

        # -- page geometry --------------------------------------------------------------------
        def register_mem_pool_host(self, mem_pool_host: Any) -> None:
            """Take the page geometry from the host pool (see the module docstring); refuses a
            configured page size or dtype that disagrees with the pool's."""
            page = mem_pool_host.get_dummy_flat_data_page()
            nbytes = page.numel() * page.element_size()
            if self.config.page_bytes and self.config.page_bytes != nbytes:
                raise InvalidArgument(f"kvstore_page_bytes is {self.config.page_bytes}, but the host pool's "
                                      f"pages are {nbytes} bytes: drop the setting or make them agree")
            pool_dtype = _DTYPE_NAMES.get(page.dtype)
            if self._dtype and pool_dtype and DTYPES[self._dtype][0] != DTYPES[pool_dtype][0]:
                raise InvalidArgument(f"kvstore_dtype is {self._dtype!r}, but the host pool holds {page.dtype}: "
                                      f"drop the setting or make them agree")
            # NOTE: a pool of a dtype kvstore has no name for (e.g. fp8 stored as uint8) keeps
            # the configured dtype, else float16: the page is opaque bytes either way
            dtype = self._dtype or pool_dtype or "float16"
            spec = page_spec(self.config, self.storage_config, nbytes, dtype, str(getattr(mem_pool_host, "layout", "")))
            super().register_mem_pool_host(mem_pool_host)
            self._spec = spec

        @property
        def spec(self) -> ModelSpec:
            """The page spec; unsafe to use before a page size is known (config or host pool)."""
            if self._spec is None:
                raise InvalidArgument("page size unknown: set kvstore_page_bytes or register the host pool")
            return self._spec

        def _key(self, key: str) -> bytes:
            return page_key(self.spec, key)

        # -- the HiCacheStorage verbs ---------------------------------------------------------
        def _ask(self, what: str, fn: Any, *args: Any, **kw: Any) -> Any:
            """``fn(*args, **kw)`` through the guard; :data:`_FAILED` when the sidecar fails or
            does not answer within ``kvstore_timeout_s`` (logged), so the engine treats the
            page as a miss. Bad arguments still raise."""
            try:
                return self.guard.call(fn, *args, **kw)
            except InvalidArgument:
                raise
            except KVStoreError as err:
                log.log(self.guard.level(), "kvstore HiCache %s failed: %s", what, err)
                return _FAILED

        def _present(self, spec: ModelSpec, key: str) -> Any:
            """Whether page ``key`` of ``spec`` is stored; :data:`_FAILED` when the sidecar fails."""
            hit = self._ask(f"exists of {key}", self.client.lookup, spec, [page_key(spec, key)])
            return _FAILED if hit is _FAILED else hit.num_blocks == 1

        def exists(self, key: str) -> bool:
            """Whether the page is stored; ``False`` too when the sidecar fails (see :meth:`_ask`)."""
            return self._present(self.spec, key) is True

        def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
            """Number of leading ``keys`` present (the first miss ends the count); one RPC, 0
            when the sidecar fails (logged)."""
            return sum(self._presence(self.spec, keys, leading=True)[0])

        def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
            """The page into ``target_location`` (a tensor of ``page_bytes``) or a new flat tensor
            of the spec's dtype; ``None`` on a miss, and when the sidecar fails (logged)."""
            out = self._get(self.spec, key, target_location)
            return None if out is _FAILED else out

        def _get(self, spec: ModelSpec, key: str, target_location: Any) -> Any:
            """:meth:`get` of a page of ``spec``, a failure of the sidecar returned as :data:`_FAILED`."""
            pages, failed = self._fetch(spec, [key], [target_location])
            return _FAILED if failed else pages[0]

        def _fetch(self, spec: ModelSpec, keys: list[str], targets: list[Any]) -> tuple[list[Any], bool]:
            """Pages ``keys`` of ``spec``, each into its target (a tensor of ``page_bytes``; else
            a new flat tensor of the spec's dtype), in one RPC (per :func:`_calls` piece): (the
            page or ``None`` for a miss, per key; whether the sidecar failed: then the pages
            left are misses, not asked)."""
            nbytes = spec.block_nbytes
            outs = [t if isinstance(t, torch.Tensor) else torch.empty(nbytes // spec.itemsize, dtype=spec.torch_dtype)
                    for t in targets]
            for out in outs:  # NOTE: a caller bug, raised before anything is asked
                _check_page(out, nbytes)
            pages: list[Any] = [None] * len(keys)
            for part in _calls(len(keys), nbytes):
                names = keys[part]
                staging = torch.empty((len(names), nbytes), dtype=torch.uint8)  # CPU pages, one copy out
                present = self._ask(f"get of {len(names)} pages ({names[0]}...)", self.client.get_roots_into,
                                    spec, [page_key(spec, k) for k in names], staging)
                if present is _FAILED:  # the rest would wait as long: all misses
                    return pages, True
                for i, row, hit in zip(range(part.start, part.start + len(names)), staging, present):
                    if hit:
                        outs[i].copy_(row.view(outs[i].dtype).view(outs[i].shape))
                        pages[i] = outs[i]
            return pages, False

        def batch_get(self, keys: list[str], target_locations: Any = None,
                      target_sizes: Any = None) -> list[torch.Tensor | None]:
            """Each page (into its target) or ``None``; one RPC. After a failure of the sidecar
            every page is a miss (logged). Keys past the targets given are misses."""
            targets = list(target_locations) if target_locations else [None] * len(keys)
            asked = min(len(keys), len(targets))
            pages, _ = self._fetch(self.spec, list(keys[:asked]), targets[:asked])
            return pages + [None] * (len(keys) - asked)

        def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
            """Store one page (``value``, else ``target_location``); ``True`` when stored (or
            already present), ``False`` on a store-side failure."""
            return self._set(self.spec, key, value if value is not None else target_location)

        def _set(self, spec: ModelSpec, key: str, page: Any) -> bool:
            return not self._put_pages(spec, [key], [page])[1]

        def _put_pages(self, spec: ModelSpec, keys: list[str], pages: list[Any]) -> tuple[list[bool], bool]:
            """Store ``pages`` as pages ``keys`` of ``spec`` in one RPC (per :func:`_calls`
            piece), all or none of a call's (roots: see the module docstring): (per-page
            success, whether the sidecar failed, logged; then the pages left are not stored,
            not sent). A page of the wrong size raises before anything is stored."""
            nbytes = spec.block_nbytes
            for page in pages:  # NOTE: a caller bug, raised before anything is stored
                _check_page(page, nbytes)
            # a page named twice is put once (its first value) and reported as its first is:
            # a put of roots refuses a repeated key
            # NOTE: the whole batch was one put(roots=True), whose InvalidArgument for the
            # repeat was raised into SGLang's backup thread (the per-page loop stored it)
            first: dict[str, int] = {}
            for i, key in enumerate(keys):
                first.setdefault(key, i)
            once = list(first.values())
            stored = [False] * len(once)
            failed = False
            for part in _calls(len(once), nbytes):
                names = [keys[i] for i in once[part]]
                rows = torch.empty((len(names), nbytes), dtype=torch.uint8)
                for row, i in zip(rows, once[part]):
                    row.copy_(_byte_rows(pages[i], nbytes)[0])
                if self._ask(f"set of {len(names)} pages ({names[0]}...)", self.client.put_bytes, spec,
                             [page_key(spec, k) for k in names], rows.numpy(), ttl_s=self.config.ttl_s,
                             roots=True) is _FAILED:  # the rest would fail as slowly
                    failed = True
                    break
                stored[part] = [True] * len(names)
            done_first = dict(zip(once, stored))
            return [done_first[first[key]] for key in keys], failed

        def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                      target_sizes: Any = None) -> bool:
            """Store every page in one RPC; ``True`` when all are stored, ``False`` on a
            store-side failure (logged: none of that call's pages is stored)."""
            pages = values if values is not None else target_locations
            if pages is None or len(pages) != len(keys):
                raise InvalidArgument(f"batch_set of {len(keys)} keys needs as many values")
            return not self._put_pages(self.spec, list(keys), list(pages))[1]

        # -- host-pool variants ---------------------------------------------------------------
        @staticmethod
        def _page_offsets(pool: Any, keys: list[str], host_indices: Any) -> list[int]:
            page_size = int(getattr(pool, "page_size", 1) or 1)
            if not isinstance(host_indices, torch.Tensor) or host_indices.numel() != len(keys) * page_size:
                got = host_indices.numel() if isinstance(host_indices, torch.Tensor) else host_indices
                raise InvalidArgument(f"{got} host indices for {len(keys)} pages of {page_size}")
            return [int(host_indices[i * page_size]) for i in range(len(keys))]

        def _load(self, spec: ModelSpec, pool: Any, keys: list[str], host_indices: Any) -> tuple[list[bool], bool]:
            """Pages ``keys`` of ``spec`` into ``pool`` at ``host_indices``, in one RPC:
            (per-page success, whether the sidecar failed; then every page is a miss)."""
            offsets = self._page_offsets(pool, keys, host_indices)
            if not keys:
                return [], False
            dummy = pool.get_dummy_flat_data_page()
            staging = torch.empty((len(keys), *dummy.shape), dtype=dummy.dtype)  # CPU pages
            pages, failed = self._fetch(spec, keys, list(staging))
            for offset, page in zip(offsets, pages):
                if page is not None:
                    pool.set_from_flat_data_page(offset, page)
            return [page is not None for page in pages], failed

        def _store(self, spec: ModelSpec, pool: Any, keys: list[str], host_indices: Any) -> tuple[list[bool], bool]:
            """Pool pages at ``host_indices`` as pages ``keys`` of ``spec``, in one RPC (all or
            none of its pages); as :meth:`_load`."""
            offsets = self._page_offsets(pool, keys, host_indices)
            return self._put_pages(spec, keys, [pool.get_data_page(offset, flat=True) for offset in offsets])

        def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
            """Load pages into the registered host pool at ``host_indices``; per-page success."""
            return self._load(self.spec, self.mem_pool_host, keys, host_indices)[0]

        def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
            """Store the host pool's pages at ``host_indices``; per-page success."""
            return self._store(self.spec, self.mem_pool_host, keys, host_indices)[0]

        # -- hybrid pools (v2) ----------------------------------------------------------------
        def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
            """Register a pool of SGLang's host pool group (the KV pool, or a side pool: DSA
            indexer, Mamba/SWA state, draft KV...). A side pool's pages get their own spec
            (its page size and dtype, the pool's name in the layout tag); a page kvstore cannot
            hold is refused here, when SGLang attaches the backend, not in its cache threads."""
            name = _pool_name(host_pool_name)
            spec = None if name == _KV_POOL else self._side_spec(name, host_pool)
            super().register_mem_host_pool_v2(host_pool, host_pool_name)
            if spec is not None:
                self._side_pools[name] = (host_pool, spec)

        def _side_spec(self, name: str, pool: Any) -> ModelSpec:
            try:
                page = pool.get_dummy_flat_data_page()
            except NotImplementedError as err:  # e.g. SGLang's MXFP8 pool: no flat pages
                raise InvalidArgument(f"SGLang host pool {name!r} cannot be stored in kvstore: {err}") from None
            nbytes = page.numel() * page.element_size()
            dtype = _DTYPE_NAMES.get(page.dtype)
            if dtype is None or nbytes % (2 * DTYPES[dtype][1]):
                dtype = "float8_e4m3fn"  # NOTE: opaque bytes (an fp8 indexer is uint8): 1-byte items
            # NOTE: as SGLang's file backend keys them: Mamba state is TP-sharded even when the
            # model's (MLA) KV, and the pools derived from it, are replicated over TP ranks
            shared = bool(self.storage_config.is_mla_model) and name != _MAMBA_POOL
            layout = f"{getattr(pool, 'layout', '') or 'flat'}/pool={name}"
            try:
                return page_spec(self.config, self.storage_config, nbytes, dtype, layout, tp_shared=shared)
            except InvalidArgument as err:
                raise InvalidArgument(f"SGLang host pool {name!r} cannot be stored in kvstore: {err}") from None

        def _pool(self, name: Any) -> tuple[Any, ModelSpec]:
            """The registered host pool named ``name`` and the spec of its pages."""
            key = _pool_name(name)
            if key == _KV_POOL:
                return self.mem_pool_host, self.spec
            if key not in self._side_pools:
                raise InvalidArgument(f"SGLang host pool {key!r} was not registered (register_mem_host_pool_v2)")
            return self._side_pools[key]

        def batch_get_v2(self, transfers: list[Any], extra_info: Any = None) -> dict[Any, list[bool]]:
            """Load each transfer's pages into its pool; per pool, per-page success. After a
            failure of the sidecar every page left is a miss (one timeout per call)."""
            return self._io_v2(transfers, self._load)

        def batch_set_v2(self, transfers: list[Any], extra_info: Any = None) -> dict[Any, list[bool]]:
            """Store each transfer's pool pages; as :meth:`batch_get_v2`."""
            return self._io_v2(transfers, self._store)

        def _io_v2(self, transfers: list[Any], move: Any) -> dict[Any, list[bool]]:
            out: dict[Any, list[bool]] = {}
            failed = False
            for transfer in transfers:
                pool, spec = self._pool(transfer.name)
                keys = list(transfer.keys or [])
                if failed:
                    out[transfer.name] = [False] * len(keys)
                    continue
                out[transfer.name], failed = move(spec, pool, keys, transfer.host_indices)
            return out

        def batch_exists_v2(self, keys: list[str], pool_transfers: list[Any] | None = None,
                            extra_info: Any = None) -> Any:
            """The usable prefix of ``keys`` given the side pools' hit policies: ``all_pages``
            needs the pool's page for every page of the prefix, ``trailing_pages`` (N keys)
            only for its last N pages, so the prefixes that can be restored need not be
            contiguous (``restorable_prefix_pages``); as SGLang's file backend computes it.
            After a failure of the sidecar every page left is a miss (one timeout per call)."""
            have, failed = self._presence(self.spec, keys, leading=True)
            kv_pages = sum(have)
            hits: dict[Any, int] = {hs.PoolName.KV: kv_pages} if kv_pages else {}
            restorable = list(range(1, kv_pages + 1))
            for transfer in pool_transfers or []:
                if not restorable:
                    break
                _, spec = self._pool(transfer.name)
                if transfer.hit_policy == hs.PoolHitPolicy.ALL_PAGES:
                    have, failed = self._presence(spec, keys[:kv_pages], leading=True, skip=failed)
                    boundary = sum(have)
                    pool_restorable = set(range(1, boundary + 1))
                elif transfer.hit_policy == hs.PoolHitPolicy.TRAILING_PAGES:
                    trailing = max(1, len(transfer.keys or ()))
                    have, failed = self._presence(spec, keys[:kv_pages], leading=False, skip=failed)
                    pool_restorable = {p for p in range(1, kv_pages + 1) if all(have[max(0, p - trailing):p])}
                    boundary = max(pool_restorable, default=0)
                else:
                    raise InvalidArgument(f"hit policy {transfer.hit_policy!r} of SGLang host pool "
                                          f"{_pool_name(transfer.name)!r} is not supported")
                if boundary:
                    hits[transfer.name] = boundary
                restorable = [p for p in restorable if p in pool_restorable]
            return hs.PoolTransferResult(restorable[-1] if restorable else 0, hits, restorable)

        def _presence(self, spec: ModelSpec, keys: list[str], *, leading: bool,
                      skip: bool = False) -> tuple[list[bool], bool]:
            """(presence of each page of ``keys``, whether the sidecar failed), in one RPC (per
            :func:`_calls` piece). ``leading``: stop at the first miss. After a failure (or
            with ``skip``) the pages left are misses, not asked."""
            have = [False] * len(keys)
            for part in [] if skip else _calls(len(keys)):
                names = keys[part]
                tiers = self._ask(f"exists of {len(names)} pages ({names[0]}...)", self.client.lookup_roots, spec,
                                  [page_key(spec, k) for k in names])
                if tiers is _FAILED:
                    return have, True
                for i, tier in zip(range(part.start, part.start + len(names)), tiers):
                    if tier is None and leading:
                        return have, False
                    have[i] = tier is not None
            return have, skip

        # -- housekeeping ---------------------------------------------------------------------
        def delete(self, key: str) -> bool:
            """Drop one page (not part of ``HiCacheStorage``; for tests and tools)."""
            return self.client.delete([self._key(key)]) == 1

        def get_stats(self) -> None:
            """``None``: SGLang (0.5.23, with storage metrics on) then logs an empty
            ``StorageMetrics``. NOTE: it calls this on its scheduler thread and sets an
            attribute on the result: the sidecar's stats dict raised there, and the unguarded
            Stats call could hold the scheduler a whole timeout. ``client.stats()`` has them."""

        def clear(self) -> bool:
            """Pages are not cleared (returns ``False``, logged): a tenant's token can neither
            list nor purge its pages; an operator purges each page spec's fingerprint
            (``kvstore model purge``)."""
            log.warning("kvstore HiCache: SGLang asked to clear the storage backend; kvstore pages are "
                        "not cleared by the engine (an operator runs `kvstore model purge FINGERPRINT`)")
            return False

        def close(self) -> None:
            self.client.close()

    return KVStoreHiCacheStorage


def __getattr__(name: str) -> Any:
    if name == "KVStoreHiCacheStorage":
        return hicache_storage_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
