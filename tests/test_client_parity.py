"""The Client against the Store: the same input gives the same answer, or the same typed error.

Found by a prober comparing the two:

* ``local_blocks(spec, n)`` did not check n: -1 gave a tensor over the rest of the shared
  region (other callers' slots), 1.5 left float offsets in the allocator (every later call of
  the client failed with TypeError).
* ``block_keys(..., extra_keys)`` encoded extra keys its own way: a bare str entry per
  character (a collision with the list of its characters), a bare bytes entry per int (into
  zero bytes), int items taken; the keys differed from the Store's for the same input.
* An in-band get asking for more bytes than ``limits.max_stream_bytes`` failed
  RESOURCE_EXHAUSTED however little was stored; the Store (and the shared-memory plane)
  return the longest stored prefix.
* Bad input raised other exception types than the Store's: a str or int parent TypeError, a
  spec that is not a ModelSpec AttributeError, a lazily negated kv or out RuntimeError (the
  Store stores the former), an expand()ed out RuntimeError after the whole fetch, a kv of the
  wrong dtype or shape the base InvalidArgument (Store: DTypeMismatch, ShapeMismatch).
* A put of no blocks returned quietly over shared memory and failed in-band on an unknown
  session, an unstored parent or a namespace not granted: put now does what Store.put does
  (returns), put_bytes what Store.put_bytes does (fails), on either plane.
* The session verbs returned None, dropping the state the server answers (what
  Store.open_session returns).
* grpc's URI forms of a target on this host (``dns:///localhost:P``, ``ipv4:127.0.0.1:P``,
  ``ipv6:[::1]:P``) and ``LOCALHOST:P`` got the in-band plane.
* A call under way on another thread when close() ran failed with a bare KVStoreError
  CANCELLED ("Channel closed!"); calls after close are FailedPrecondition.
"""

from __future__ import annotations

import threading
from functools import partial

import pytest
import service_harness
import torch
from service_harness import SPEC, fresh_tokens, random_kv

from kvstore.block import SessionState
from kvstore.client import Client
from kvstore.errors import (
    DTypeMismatch,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ParentNotStored,
    PermissionDenied,
    ResourceExhausted,
    ShapeMismatch,
)
from kvstore.keys import block_keys
from kvstore.shm import is_local_target
from tiers.arena import ExtentAllocator

PLANES = pytest.mark.parametrize("local", [True, False], ids=["shm", "stream"])


# -- 1. local_blocks counts ------------------------------------------------------------------
@pytest.mark.parametrize("n", [-1, 1.5, "2", None, True])
def test_local_blocks_refuses_a_count_that_is_not_a_whole_number(sidecar, n):
    c = sidecar.tenant("lb-count")
    keys = c.block_keys(SPEC, fresh_tokens(2))
    kv = random_kv(2)
    mine = c.local_blocks(SPEC, 2)
    mine.tensor.copy_(kv)
    free_before = c._local.alloc.free_bytes
    with pytest.raises(InvalidArgument, match="n must be"):
        c.local_blocks(SPEC, n)
    assert c._local.alloc.free_bytes == free_before  # nothing reserved
    assert torch.equal(mine.tensor, kv)
    c.put(SPEC, keys, mine.tensor)
    assert torch.equal(c.get(SPEC, keys), kv)  # the client still works, staged or not
    c.put(SPEC, keys, kv.clone())
    mine.free()


def test_local_blocks_of_zero_blocks_reserve_nothing(sidecar):
    c = sidecar.tenant("lb-zero")
    free_before = c._local.alloc.free_bytes
    with c.local_blocks(SPEC, 0) as none:
        assert tuple(none.tensor.shape) == (0, *SPEC.block_shape)
        assert c._local.alloc.free_bytes == free_before
    assert c._local.alloc.free_bytes == free_before


@pytest.mark.parametrize("size", [0, -1, 1.5, "8", True])
def test_extent_allocator_refuses_sizes_that_are_not_positive_whole_numbers(size):
    a = ExtentAllocator(4096, alignment=256)
    with pytest.raises(InvalidArgument, match="positive whole number"):
        a.alloc(size)
    assert a.used == 0 and a.extents() == [] and a.alloc(4096) == 0


# -- 2. extra keys ---------------------------------------------------------------------------
@pytest.mark.parametrize("extra", [
    ["img-A", None], [b"\x03\x01", None], [["i", "m", "g", "-", "A"], None], [[b"\0\0\0", b"\0"]],
    [None, [b"a", "b"]], [bytearray(b"xy")], [], None,
], ids=["str", "bytes", "chars", "zeros", "list", "bytearray", "empty", "none"])
def test_block_keys_with_extra_keys_equal_the_stores(sidecar, extra):
    c = sidecar.tenant("bk-extra")
    toks = list(range(1000, 1000 + 2 * SPEC.block_tokens))
    assert c.block_keys(SPEC, toks, extra) == block_keys("bk-extra", SPEC.fingerprint, SPEC.block_tokens, toks, extra)


def test_block_keys_bare_items_do_not_collide_with_their_parts(sidecar):
    c = sidecar.tenant("bk-collide")
    toks = list(range(1000, 1000 + SPEC.block_tokens))
    assert c.block_keys(SPEC, toks, ["img-A"]) != c.block_keys(SPEC, toks, [list("img-A")])
    assert c.block_keys(SPEC, toks, [b"\x03\x01"]) != c.block_keys(SPEC, toks, [[b"\0\0\0", b"\0"]])


@pytest.mark.parametrize("extra", [[[7]], [[10**7]], "ab", b"ab", [[memoryview(b"m")]]],
                         ids=["int", "big-int", "str", "bytes", "memoryview"])
def test_block_keys_refuse_the_extra_keys_the_store_refuses(sidecar, extra):
    c = sidecar.tenant("bk-bad")
    toks = list(range(1000, 1000 + 2 * SPEC.block_tokens))
    with pytest.raises(InvalidArgument) as store_err:
        block_keys("bk-bad", SPEC.fingerprint, SPEC.block_tokens, toks, extra)
    with pytest.raises(InvalidArgument) as client_err:
        c.block_keys(SPEC, toks, extra)
    assert type(client_err.value) is type(store_err.value)
    assert str(client_err.value) == str(store_err.value)


# -- 3. in-band gets past limits.max_stream_bytes --------------------------------------------
def test_in_band_get_past_the_stream_limit_returns_the_stored_prefix(tmp_path):
    sc = service_harness.start(tmp_path, limits={"max_stream_bytes": 16 * SPEC.block_nbytes})
    try:
        c = sc.tenant("big-get", local=False)
        keys = c.block_keys(SPEC, fresh_tokens(40))
        kv = random_kv(40, seed=5)
        c.put(SPEC, keys[:2], kv[:2])
        assert torch.equal(c.get(SPEC, keys), kv[:2])  # 40 asked for, 2 stored
        c.put(SPEC, keys[2:12], kv[2:12], parent=keys[1])
        c.put(SPEC, keys[12:28], kv[12:28], parent=keys[11])
        c.put(SPEC, keys[28:], kv[28:], parent=keys[27])
        assert torch.equal(c.get(SPEC, keys), kv)  # read in pieces of at most 16 blocks
        assert torch.equal(c.get(SPEC, keys[5:], parent=keys[4]), kv[5:])
        c.delete([keys[20]])
        assert torch.equal(c.get(SPEC, keys), kv[:20])  # a miss in a later piece ends the prefix
        out = torch.zeros_like(kv)
        assert c.get_into(SPEC, keys, out) == 20 and torch.equal(out[:20], kv[:20]) and not out[20:].any()
    finally:
        sc.stop()


def test_in_band_get_of_a_block_bigger_than_the_stream_limit_is_refused(tmp_path):
    sc = service_harness.start(tmp_path, limits={"max_stream_bytes": SPEC.block_nbytes // 2})
    try:
        c = sc.tenant("tiny-limit", local=False)
        keys = c.block_keys(SPEC, fresh_tokens(3))
        with pytest.raises(ResourceExhausted, match="max_stream_bytes"):
            c.get(SPEC, keys)
    finally:
        sc.stop()


# -- 4. the Store's error types --------------------------------------------------------------
def _same_error(store_call, client_call):
    with pytest.raises(InvalidArgument) as on_store:
        store_call()
    with pytest.raises(InvalidArgument) as on_client:
        client_call()
    assert type(on_client.value) is type(on_store.value)
    assert str(on_client.value) == str(on_store.value)


@PLANES
def test_bad_input_raises_what_the_store_raises(sidecar, open_store, local):
    c = sidecar.tenant("types", local=local)
    store = open_store(SPEC)
    toks = fresh_tokens(3)
    k, ks = c.block_keys(SPEC, toks), store.block_keys("types", SPEC, toks)
    kv = random_kv(3)
    c.put(SPEC, k, kv)
    store.put("types", SPEC, ks, kv)
    _same_error(lambda: store.put("types", SPEC, ks, kv.float()), lambda: c.put(SPEC, k, kv.float()))
    _same_error(lambda: store.put("types", SPEC, ks, kv[:2]), lambda: c.put(SPEC, k, kv[:2]))
    for parent in ("x" * 32, 1, b"short"):
        _same_error(partial(store.get, "types", SPEC, ks[1:], parent=parent), partial(c.get, SPEC, k[1:], parent=parent))
        _same_error(partial(store.lookup, "types", SPEC, ks[1:], parent=parent),
                    partial(c.lookup, SPEC, k[1:], parent=parent))
        _same_error(partial(store.put, "types", SPEC, ks[1:], kv[1:], parent=parent),
                    partial(c.put, SPEC, k[1:], kv[1:], parent=parent))
    for spec in ("test/model", None):
        _same_error(partial(store.get, "types", spec, ks), partial(c.get, spec, k))
        _same_error(partial(store.lookup, "types", spec, ks), partial(c.lookup, spec, k))
        _same_error(partial(store.put, "types", spec, ks, kv), partial(c.put, spec, k, kv))
        _same_error(partial(store.block_keys, "types", spec, toks), partial(c.block_keys, spec, toks))
        with pytest.raises(InvalidArgument, match="spec must be a ModelSpec"):
            c.get_into(spec, k, torch.zeros_like(kv))
        with pytest.raises(InvalidArgument, match="spec must be a ModelSpec"):
            c.prefetch(spec, k)
    _same_error(lambda: store.get("types", SPEC, ks, out=torch._neg_view(torch.zeros_like(kv))),
                lambda: c.get_into(SPEC, k, torch._neg_view(torch.zeros_like(kv))))
    with pytest.raises(DTypeMismatch):
        c.put(SPEC, k, kv.float())
    with pytest.raises(ShapeMismatch):
        c.put(SPEC, k, kv[:2])


@PLANES
def test_put_of_a_negated_view_stores_the_values_it_shows(sidecar, local):
    c = sidecar.tenant("neg", local=local)
    k = c.block_keys(SPEC, fresh_tokens(3))
    kv = random_kv(3, seed=9)
    c.put(SPEC, k, torch._neg_view(kv))
    assert torch.equal(c.get(SPEC, k), -kv)


@PLANES
def test_get_into_an_expanded_tensor_is_refused_before_the_fetch(sidecar, local, monkeypatch):
    c = sidecar.tenant("expand", local=local)
    k = c.block_keys(SPEC, fresh_tokens(3))
    c.put(SPEC, k, random_kv(3))
    out = torch.zeros((1, *SPEC.block_shape), dtype=SPEC.torch_dtype).expand(3, *SPEC.block_shape)
    fetched = []
    monkeypatch.setattr(type(c), "_get_stream", lambda *a, **kw: fetched.append(a) or 0)
    monkeypatch.setattr(type(c), "_get_local", lambda *a, **kw: fetched.append(a) or 0)
    with pytest.raises(ShapeMismatch, match="share memory"):
        c.get_into(SPEC, k, out)
    assert not fetched
    monkeypatch.undo()
    plain = torch.zeros((3, *SPEC.block_shape), dtype=SPEC.torch_dtype)
    assert c.get_into(SPEC, k, plain.transpose(1, 2)) == 3  # non-contiguous, not overlapping: taken


# -- 5. puts of no blocks --------------------------------------------------------------------
@PLANES
def test_a_put_of_no_blocks_does_what_the_stores_does(sidecar, open_store, local):
    c = sidecar.tenant("empty-put", local=local)
    store = open_store(SPEC)
    none = torch.empty((0, *SPEC.block_shape), dtype=SPEC.torch_dtype)
    unknown = b"\1" * 32
    assert store.put("empty-put", SPEC, [], none, session="nosuch") is None
    assert store.put("empty-put", SPEC, [], none, parent=unknown) is None
    for kw in ({"session": "nosuch"}, {"parent": unknown}, {"namespace": "other"}):
        assert c.put(SPEC, [], none, **kw) is None
    with pytest.raises(NotFound, match="unknown session"):
        store.put_bytes("empty-put", SPEC, [], [], session="nosuch")
    with pytest.raises(ParentNotStored):
        store.put_bytes("empty-put", SPEC, [], [], parent=unknown)
    with pytest.raises(NotFound, match="unknown session"):
        c.put_bytes(SPEC, [], [], session="nosuch")
    with pytest.raises(ParentNotStored):
        c.put_bytes(SPEC, [], [], parent=unknown)
    with pytest.raises(PermissionDenied):
        c.put_bytes(SPEC, [], [], namespace="other")
    c.open_session("s")
    assert c.put_bytes(SPEC, [], [], session="s") is None


# -- 6. session verbs ------------------------------------------------------------------------
def test_session_verbs_return_the_sessions_state(sidecar, open_store):
    c = sidecar.tenant("sess")
    store = open_store(SPEC)
    k = c.block_keys(SPEC, fresh_tokens(2))
    assert c.open_session("s") is SessionState.ACTIVE is store.open_session("sess", "s")
    assert c.open_session("s") is SessionState.ACTIVE  # re-opened: unchanged
    c.put(SPEC, k, random_kv(2), session="s")
    assert c.pause_session("s") is SessionState.PAUSED
    assert c.open_session("s") is SessionState.RESUMED  # re-opening a paused one resumes it
    assert c.pause_session("s") is SessionState.PAUSED
    assert c.resume_session("s") is SessionState.RESUMED
    assert c.close_session("s") is SessionState.CLOSED


# -- 7. targets on this host -----------------------------------------------------------------
@pytest.mark.parametrize("target", [
    "127.0.0.1:5", "localhost:5", "dns:///localhost:5", "dns:///127.0.0.1:5", "dns://8.8.8.8:53/localhost:5",
    "dns:localhost:5", "ipv4:127.0.0.1:5", "ipv4:127.0.0.1:5,127.0.0.2:6", "ipv6:[::1]:5", "LOCALHOST:5",
    "[::1]:5", "unix:/tmp/kv.sock", "unix-abstract:kv",
])
def test_targets_on_this_host_are_local(target):
    assert is_local_target(target)


@pytest.mark.parametrize("target", [
    "10.0.0.1:5", "example.com:5", "dns:///example.com:5", "ipv4:127.0.0.1:5,10.0.0.1:5", "ipv6:[::2]:5",
    "0.0.0.0:5", "[::]:5", "dns:5",
])
def test_targets_elsewhere_are_not_local(target):
    assert not is_local_target(target)


@pytest.mark.parametrize("form", ["dns:///localhost:{}", "dns:///127.0.0.1:{}", "ipv4:127.0.0.1:{}", "LOCALHOST:{}"])
def test_a_client_of_a_uri_form_target_on_this_host_uses_shared_memory(sidecar, form):
    token = sidecar.admin().create_tenant(f"uri-{form.partition(':')[0].lower()}-{len(form)}")
    c = Client(form.format(sidecar.port), token)
    try:
        assert c.uses_shared_memory
        keys = c.block_keys(SPEC, fresh_tokens(2))
        kv = random_kv(2)
        c.put(SPEC, keys, kv)
        assert torch.equal(c.get(SPEC, keys), kv)
    finally:
        c.close()


# -- 8. calls under way when the client closes -----------------------------------------------
def test_a_put_under_way_when_the_client_closes_is_failed_precondition(sidecar, monkeypatch):
    c = sidecar.tenant("close-put", local=False)
    keys = c.block_keys(SPEC, fresh_tokens(2))
    held = service_harness.HeldPut(monkeypatch, c, SPEC, keys, random_kv(2))
    c.close()
    exc = held.finish()
    assert isinstance(exc, FailedPrecondition) and "closed" in str(exc), repr(exc)


def test_a_get_under_way_when_the_client_closes_is_failed_precondition(sidecar, monkeypatch):
    from kvstore import servicer_kv

    c = sidecar.tenant("close-get", local=False)
    keys = c.block_keys(SPEC, fresh_tokens(2))
    c.put(SPEC, keys, random_kv(2))
    started, go = threading.Event(), threading.Event()
    real = servicer_kv.get_stream

    def held_get(*args):
        started.set()
        assert go.wait(10)
        return real(*args)

    monkeypatch.setattr(servicer_kv, "get_stream", held_get)
    outcome = []

    def get():
        try:
            outcome.append(c.get(SPEC, keys))
        except BaseException as exc:  # noqa: BLE001 - recorded for the assertion
            outcome.append(exc)

    t = threading.Thread(target=get)
    t.start()
    assert started.wait(10)
    c.close()
    go.set()
    t.join(10)
    assert isinstance(outcome[0], FailedPrecondition) and "closed" in str(outcome[0]), repr(outcome[0])
