"""The in-band frame codec: kvstore's layout, the generic protobuf layout, malformed frames, and
frames packed across blocks (written by block_frames, read back by scatter)."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.frames import (
    block_frames,
    data_frame,
    decoder,
    encode,
    intact,
    scatter,
    write_into,
)
from proto.kvstore.v1 import kvstore_pb2 as pb

decode_put = decoder(pb.PutFrame)
decode_get = decoder(pb.GetFrame)


@settings(max_examples=60, deadline=None)
@given(block=st.integers(0, 2**32 - 1), offset=st.integers(0, 2**63), data=st.binary(min_size=1, max_size=3000))
def test_data_frames_round_trip_and_are_valid_protobuf(block, offset, data):
    raw = data_frame(pb.PutFrame, block, offset, data)
    frame = decode_put(raw)
    assert not frame.error and intact(frame)
    assert (frame.meta.block, frame.meta.offset, bytes(frame.data)) == (block, offset, data)
    # any protobuf reader sees the same message
    plain = pb.PutFrame.FromString(raw)
    assert (plain.block, plain.offset, plain.data, plain.xxh3) == (block, offset, data, xxhash.xxh3_64_intdigest(data))


def test_the_payload_is_a_view_of_the_received_frame_not_a_copy():
    raw = data_frame(pb.GetFrame, 1, 0, b"x" * 1000)
    frame = decode_get(raw)
    assert frame.data.obj is raw


def test_header_frames_carry_no_payload():
    header = pb.GetHeader(num_blocks=3, block_nbytes=4096)
    frame = decode_get(encode(pb.GetFrame(header=header)))
    assert frame.meta.header == header and len(frame.data) == 0 and intact(frame)


@settings(max_examples=40, deadline=None)
@given(block=st.integers(0, 1000), data=st.binary(min_size=1, max_size=500))
def test_frames_from_a_generic_protobuf_writer_are_accepted(block, data):
    raw = pb.PutFrame(block=block, offset=7, data=data, xxh3=xxhash.xxh3_64_intdigest(data)).SerializeToString()
    frame = decode_put(raw)
    assert not frame.error and intact(frame) and bytes(frame.data) == data and frame.meta.block == block


def test_malformed_frames_decode_to_an_error_instead_of_raising():
    for raw in (b"\xff\xff\xff", b"\x0d\x10\x00\x00\x00\x12\x05ab", b"\x7a\x80"):
        frame = decode_put(raw)
        assert frame.error.startswith("malformed PutFrame")


def test_a_flipped_payload_byte_fails_the_checksum():
    raw = bytearray(data_frame(pb.PutFrame, 0, 0, b"payload bytes"))
    raw[-1] ^= 1
    assert not intact(decode_put(bytes(raw)))


def test_a_frame_of_several_pieces_carries_and_checksums_their_concatenation():
    pieces = [b"abc", memoryview(b"defgh"), bytearray(b"ij")]
    frame = decode_put(data_frame(pb.PutFrame, 2, 7, *pieces))
    assert bytes(frame.data) == b"abcdefghij" and intact(frame)
    assert frame.meta.xxh3 == xxhash.xxh3_64_intdigest(b"abcdefghij")
    assert (frame.meta.block, frame.meta.offset) == (2, 7)


def test_a_payload_of_several_passes_is_hashed_and_copied_whole():
    """data_frame hashes and copies a pass at a time, into a bytes object it fills in place:
    the frame is the same as joining the header and the pieces, checksum included."""
    from kvstore import frames

    rng = np.random.default_rng(3)
    pieces = [rng.integers(0, 256, 2 * frames._PASS + 5, dtype=np.uint8),
              rng.integers(0, 256, frames._PASS - 1, dtype=np.uint8).tobytes()]
    whole = pieces[0].tobytes() + pieces[1]
    raw = data_frame(pb.GetFrame, 4, 99, *pieces)
    assert type(raw) is bytes
    assert raw == encode(pb.GetFrame(block=4, offset=99, xxh3=xxhash.xxh3_64_intdigest(whole)), whole)
    frame = decode_get(raw)
    assert intact(frame) and bytes(frame.data) == whole


@settings(max_examples=60, deadline=None)
@given(pieces=st.lists(st.binary(max_size=300), min_size=1, max_size=5), step=st.integers(1, 64),
       block=st.integers(0, 2**32 - 1), offset=st.integers(0, 2**40))
def test_frames_built_a_pass_at_a_time_equal_the_joined_layout(pieces, step, block, offset):
    """Whatever the pass size and wherever the pieces end, the frame is the header and the
    joined pieces, with the digest of the whole payload."""
    from kvstore import frames

    whole = b"".join(pieces)
    saved = frames._PASS  # NOTE: not monkeypatch: hypothesis runs many examples per fixture
    frames._PASS = step
    try:
        raw = data_frame(pb.PutFrame, block, offset, *pieces)
    finally:
        frames._PASS = saved
    assert raw == encode(pb.PutFrame(block=block, offset=offset, xxh3=xxhash.xxh3_64_intdigest(whole)), whole)


def test_a_zero_digest_leaves_the_field_out_as_protobuf_does(monkeypatch):
    """xxh3 is the one header field whose size depends on its value (0 is not written): the
    frame of a payload whose digest is 0 is laid out again, and still decodes and checks."""
    from kvstore import frames

    class Zero:
        def update(self, _data) -> None:
            pass

        def intdigest(self) -> int:
            return 0

    monkeypatch.setattr(frames.xxhash, "xxh3_64", Zero)
    monkeypatch.setattr(frames, "checksum", lambda _data: 0)
    raw = data_frame(pb.PutFrame, 1, 2, b"some payload")
    assert raw == encode(pb.PutFrame(block=1, offset=2), b"some payload")
    frame = decode_put(raw)
    assert not frame.error and frame.meta.xxh3 == 0 and bytes(frame.data) == b"some payload"
    assert intact(frame)


# -- packed across blocks -----------------------------------------------------------------------
class StreamBroken(Exception):
    pass


def _blocks(n: int, nbytes: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, nbytes), dtype=np.uint8)


def _scatter(raws, n: int, nbytes: int) -> tuple[np.ndarray, list[int]]:
    """The blocks rebuilt from raw frames, and the order their destinations were asked for."""
    out = np.zeros((n, nbytes), np.uint8)
    asked: list[int] = []

    def destination(i: int) -> np.ndarray:
        asked.append(i)
        return out[i]

    scatter((decode_put(r) for r in raws), n, nbytes, destination, write_into, StreamBroken)
    return out, asked


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 9), nbytes=st.integers(1, 700), chunk=st.integers(1, 2500), pack=st.booleans())
def test_block_frames_round_trip_bit_exact_through_scatter(n, nbytes, chunk, pack):
    blocks = _blocks(n, nbytes, seed=n * 1000 + nbytes)
    raws = list(block_frames(pb.PutFrame, blocks, nbytes, chunk, pack=pack))
    frames = [decode_put(r) for r in raws]
    assert all(intact(f) and 0 < len(f.data) <= chunk for f in frames)
    # the payloads, in order, are the blocks' bytes
    assert b"".join(bytes(f.data) for f in frames) == blocks.tobytes()
    if pack:  # every frame full but the last: ceil(total / chunk) frames
        assert len(frames) == -(-n * nbytes // chunk)
    else:  # the old layout: no frame crosses the end of its block
        assert all(f.meta.offset + len(f.data) <= nbytes for f in frames)
        assert len(frames) == n * -(-nbytes // chunk)
    out, asked = _scatter(raws, n, nbytes)
    assert np.array_equal(out, blocks)
    assert asked == list(range(n))  # each block's destination asked for once, in order


def test_small_blocks_share_frames_and_a_frame_starts_where_the_last_one_stopped():
    nbytes, chunk = 1000, 2500  # 2.5 blocks a frame
    frames = [decode_put(r) for r in block_frames(pb.PutFrame, _blocks(6, nbytes), nbytes, chunk)]
    assert [(f.meta.block, f.meta.offset, len(f.data)) for f in frames] == [
        (0, 0, 2500), (2, 500, 2500), (5, 0, 1000)]


def _crossing_frames(blocks: np.ndarray, nbytes: int) -> list[tuple[int, int, bytes]]:
    """(block, offset, payload) of frames of 1.5 blocks each over ``blocks``."""
    flat = blocks.tobytes()
    step = nbytes * 3 // 2
    return [(start // nbytes, start % nbytes, flat[start : start + step]) for start in range(0, len(flat), step)]


def test_a_crossing_frame_with_a_bad_checksum_is_rejected_before_any_of_it_is_written():
    nbytes = 64
    blocks = _blocks(3, nbytes)
    parts = _crossing_frames(blocks, nbytes)
    raws = [data_frame(pb.PutFrame, *p) for p in parts]
    b, o, payload = parts[1]
    raws[1] = encode(pb.PutFrame(block=b, offset=o, xxh3=xxhash.xxh3_64_intdigest(payload) ^ 1), payload)
    out = np.zeros((3, nbytes), np.uint8)
    with pytest.raises(StreamBroken, match="checksum mismatch"):
        scatter((decode_put(r) for r in raws), 3, nbytes, out.__getitem__, write_into, StreamBroken)
    # the first frame (1.5 blocks) landed; nothing of the bad one (the rest of block 1 on)
    assert np.array_equal(out[0], blocks[0]) and np.array_equal(out[1, : nbytes // 2], blocks[1, : nbytes // 2])
    assert not out[1, nbytes // 2 :].any() and not out[2].any()


@pytest.mark.parametrize("where", [(1, 0), (0, 96), (2, 32)], ids=["block-start", "past-the-end", "skipped"])
def test_out_of_order_crossing_frames_are_rejected(where):
    nbytes = 64
    parts = _crossing_frames(_blocks(4, nbytes), nbytes)  # frames at (0, 0), (1, 32), (3, 0)
    parts[1] = (*where, parts[1][2])
    raws = [data_frame(pb.PutFrame, *p) for p in parts]
    with pytest.raises(StreamBroken, match="out-of-order frame: got block"):
        _scatter(raws, 4, nbytes)


def test_a_frame_running_past_the_last_block_is_rejected():
    nbytes = 64
    flat = _blocks(3, nbytes).tobytes() + b"x"
    with pytest.raises(StreamBroken, match="overruns"):
        _scatter([data_frame(pb.PutFrame, 0, 0, flat[:100]), data_frame(pb.PutFrame, 1, 36, flat[100:])], 3, nbytes)
    with pytest.raises(StreamBroken, match="more data than the 3 blocks"):
        _scatter([data_frame(pb.PutFrame, 0, 0, flat[:-1]), data_frame(pb.PutFrame, 3, 0, b"x")], 3, nbytes)


def test_a_stream_that_ends_inside_a_block_or_early_is_rejected():
    nbytes = 64
    flat = _blocks(3, nbytes).tobytes()
    for cut in (100, 128):
        with pytest.raises(StreamBroken, match="the stream ended after 1 of 3 blocks|ended after 2 of 3"):
            _scatter([data_frame(pb.PutFrame, 0, 0, flat[:cut])], 3, nbytes)


def test_old_and_generic_one_block_frames_mixed_with_packed_ones_are_accepted():
    nbytes = 64
    blocks = _blocks(4, nbytes)
    flat = blocks.tobytes()
    raws = [
        data_frame(pb.PutFrame, 0, 0, flat[:40]),  # old layout: a chunk of block 0 ...
        pb.PutFrame(block=0, offset=40, data=flat[40:64],  # ... its end, from a generic writer
                    xxh3=xxhash.xxh3_64_intdigest(flat[40:64])).SerializeToString(),
        data_frame(pb.PutFrame, 1, 0, flat[64:200]),  # packed: blocks 1, 2 and part of 3
        data_frame(pb.PutFrame, 3, 8, flat[200:]),
    ]
    out, asked = _scatter(raws, 4, nbytes)
    assert np.array_equal(out, blocks) and asked == [0, 1, 2, 3]


def test_a_header_or_an_empty_frame_after_the_first_is_rejected():
    with pytest.raises(StreamBroken, match="header"):
        _scatter([encode(pb.PutFrame(header=pb.PutHeader()))], 1, 8)
    with pytest.raises(StreamBroken, match="without data"):
        _scatter([encode(pb.PutFrame(block=0, offset=0))], 1, 8)
