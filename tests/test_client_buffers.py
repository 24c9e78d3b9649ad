"""The Client's caller buffers, its lifecycle and fork(): found by using it as an engine would.

* ``get_into`` with a list of per-block buffers (Store.get_into's convention) returned n and
  wrote nothing: the data went into a copy of the list made by ``np.asarray``.
* ``put_bytes`` took buffers of any size: 1-byte buffers were broadcast into whole blocks on the
  shared-memory plane, oversize ones truncated on the stream.
* A child of fork() using the inherited Client shared its parent's region and handed out the
  same slots (each stored and served the other's bytes); a child that exited unlinked its
  parent's region, after which every shared-memory call of the parent failed.
* A closed Client raised grpc's raw ValueError.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from service_harness import SPEC, fresh_tokens, random_kv

from kvstore.errors import FailedPrecondition, InvalidArgument, ShapeMismatch

PLANES = pytest.mark.parametrize("local", [True, False], ids=["shm", "stream"])


@PLANES
def test_get_into_a_list_of_block_buffers_fills_each(sidecar, local):
    c = sidecar.tenant(f"lists-{int(local)}", local=local)
    keys = c.block_keys(SPEC, fresh_tokens(3))
    kv = random_kv(3, seed=3)
    c.put(SPEC, keys[:2], kv[:2])
    n = SPEC.block_nbytes
    outs = [bytearray(n), np.zeros(n, np.uint8), torch.zeros(SPEC.block_shape, dtype=SPEC.torch_dtype)]
    assert c.get_into(SPEC, keys, outs) == 2
    raw = kv.view(torch.uint8).reshape(3, n).numpy()
    assert bytes(outs[0]) == raw[0].tobytes()
    assert np.array_equal(outs[1], raw[1])
    assert not outs[2].any()  # past the prefix: untouched
    with pytest.raises(InvalidArgument, match="output buffer 0 is read-only"):
        c.get_into(SPEC, keys[:1], [bytes(n)])
    with pytest.raises(ShapeMismatch, match="output buffer 1 has 8 bytes"):
        c.get_into(SPEC, keys[:2], [bytearray(n), bytearray(8)])
    with pytest.raises(ShapeMismatch, match="2 output buffers for 3 keys"):
        c.get_into(SPEC, keys, [bytearray(n), bytearray(n)])


@PLANES
def test_put_bytes_refuses_buffers_that_are_not_whole_blocks(sidecar, local):
    c = sidecar.tenant(f"sizes-{int(local)}", local=local)
    keys = c.block_keys(SPEC, fresh_tokens(2))
    n = SPEC.block_nbytes
    with pytest.raises(ShapeMismatch, match="buffer 0 has 1 bytes"):
        c.put_bytes(SPEC, keys, [b"x", b"y"])
    with pytest.raises(ShapeMismatch, match=f"buffer 1 has {n + 1} bytes"):
        c.put_bytes(SPEC, keys, [bytes(n), bytes(n + 1)])
    with pytest.raises(ShapeMismatch, match="uint8"):
        c.put_bytes(SPEC, keys, np.zeros((2, n // 2), np.int16))
    with pytest.raises(ShapeMismatch, match=r"\[2, "):
        c.put_bytes(SPEC, keys, np.zeros((2, n + 4), np.uint8))
    assert c.lookup(SPEC, keys).num_blocks == 0
    kv = random_kv(2, seed=4)
    c.put_bytes(SPEC, keys, [t.view(torch.uint8).reshape(-1) for t in kv])  # tensors, one per block
    assert torch.equal(c.get(SPEC, keys).view(torch.int16), kv.view(torch.int16))


def test_a_closed_client_says_so(sidecar):
    c = sidecar.tenant("closed", local=True)
    keys = c.block_keys(SPEC, fresh_tokens(1))
    c.close()
    for call in (lambda: c.lookup(SPEC, keys), lambda: c.put(SPEC, keys, random_kv(1)),
                 lambda: c.get(SPEC, keys), lambda: c.local_blocks(SPEC, 1)):
        with pytest.raises(FailedPrecondition, match="this Client is closed"):
            call()
    c.close()  # twice: nothing more to do


def _in_child(body) -> int:
    """Run ``body`` in a forked child; its exit status (0: passed)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            code = body()
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def test_a_client_inherited_through_fork_is_refused_and_leaves_the_parents_region(sidecar):
    c = sidecar.tenant("forked", local=True)
    assert c.uses_shared_memory
    keys = c.block_keys(SPEC, fresh_tokens(2))
    kv = random_kv(2, seed=8)

    def child() -> int:
        for call in (lambda: c.put(SPEC, keys, kv), lambda: c.get(SPEC, keys),
                     lambda: c.lookup(SPEC, keys), lambda: c.local_blocks(SPEC, 1)):
            try:
                call()
                return 2  # the inherited client worked: parent and child would share slots
            except FailedPrecondition as exc:
                if "before a fork()" not in str(exc):
                    return 3
        c.close()  # must not unlink the parent's region
        return 0

    assert _in_child(child) == 0
    assert c._local is not None and c._local.region.alive()  # the parent's region still exists
    sidecar.server.data.regions.prune()  # the server drops regions whose name is gone
    c.put(SPEC, keys, kv)
    assert c.uses_shared_memory
    assert torch.equal(c.get(SPEC, keys).view(torch.int16), kv.view(torch.int16))


def test_store_get_into_refuses_a_read_only_buffer_before_copying(open_store, spec):
    from conftest import make_kv, tokens

    s = open_store(spec)
    keys = s.block_keys("a", spec, tokens(2, spec))
    s.put("a", spec, keys, make_kv(spec, 2))
    outs = [bytearray(spec.block_nbytes), bytes(spec.block_nbytes)]
    with pytest.raises(InvalidArgument, match="output buffer 1 is read-only"):  # was numpy's ValueError
        s.get_into("a", spec, keys, outs)


def test_store_get_refuses_an_out_with_no_data(open_store, spec):
    from conftest import make_kv, tokens

    s = open_store(spec)
    keys = s.block_keys("a", spec, tokens(1, spec))
    s.put("a", spec, keys, make_kv(spec, 1))
    with pytest.raises(InvalidArgument, match="meta device"):  # returned as 1 block served before
        s.get("a", spec, keys, out=torch.empty((1, *spec.block_shape), dtype=spec.torch_dtype, device="meta"))
    with pytest.raises(InvalidArgument, match="out must be a torch tensor"):
        s.get("a", spec, keys, out=np.zeros((1, spec.block_nbytes), np.uint8))


def test_lookup_takes_keys_or_token_ids_not_both(sidecar):
    c = sidecar.tenant("both", local=False)
    ids = fresh_tokens(1)
    with pytest.raises(InvalidArgument, match="not both"):
        c.lookup(SPEC, c.block_keys(SPEC, ids), token_ids=ids)


def test_store_verbs_type_their_errors_for_odd_specs_and_tensors(open_store, spec):
    from conftest import make_kv, tokens

    s = open_store(spec)
    keys = s.block_keys("a", spec, tokens(1, spec))
    for call in (lambda: s.put("a", "x", keys, make_kv(spec, 1)), lambda: s.lookup("a", None, keys),
                 lambda: s.get("a", "x", keys), lambda: s.block_keys("a", "x", [1, 2, 3, 4])):
        with pytest.raises(InvalidArgument, match="spec must be a ModelSpec"):  # was AttributeError
            call()
    with pytest.raises(InvalidArgument, match="dense tensor"):  # was a RuntimeError from torch
        s.put("a", spec, keys, make_kv(spec, 1).to_sparse())
    kv = make_kv(spec, 1)
    s.put("a", spec, keys, torch._neg_view(kv))  # a lazily negated view: the values it shows
    assert torch.equal(s.get("a", spec, keys), -kv)
