"""The in-band frame codec: kvstore's layout, the generic protobuf layout, and malformed frames."""

from __future__ import annotations

import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.frames import data_frame, decoder, encode, intact
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
