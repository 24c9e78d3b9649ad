import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from tiers.arena import ExtentAllocator


def test_equal_blocks_fill_exactly_and_never_fragment():
    a = ExtentAllocator(1024, alignment=256)
    offs = [a.alloc(256) for _ in range(4)]
    assert sorted(offs) == [0, 256, 512, 768] and a.alloc(1) is None
    a.free(256)
    a.free(768)
    assert a.alloc(256) in (256, 768)
    a.free(0)
    assert a.used == 512


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 3000)), max_size=60))
def test_allocator_invariants(ops):
    a = ExtentAllocator(8192, alignment=128)
    live: dict[int, int] = {}
    for is_alloc, n in ops:
        if is_alloc or not live:
            off = a.alloc(n)
            if off is not None:
                live[off] = a.rounded(n)
        else:
            off = sorted(live)[n % len(live)]
            a.free(off)
            del live[off]
        ext = a.extents()
        assert dict(ext) == live
        assert a.used == sum(live.values()) <= a.capacity
        for (o1, l1), (o2, _) in itertools.pairwise(ext):
            assert o1 + l1 <= o2  # no overlap
        assert all(0 <= o and o + n <= a.capacity for o, n in ext)
    for off in list(live):
        a.free(off)
    assert a.used == 0 and a.alloc(8192) == 0  # fully coalesced again
