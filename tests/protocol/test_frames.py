"""Frames from literal bytes: what goes on the wire, and every way a frame is refused."""

from __future__ import annotations

import struct

import pytest
import torch

from splitspec.exceptions import BadDtype, BadMagic, BadTensor, MalformedFrame, MessageTooLarge, UnsupportedVersion
from splitspec.protocol.frames import DTYPES, decode_frame, encode_frame, peek_type


def frame(header: bytes, payload: bytes = b"", *, magic: bytes = b"SPLT", version: int = 2) -> bytes:
    return magic + struct.pack(">HI", version, len(header)) + header + payload


def test_encoding_is_exactly_the_documented_layout() -> None:
    data = encode_frame({"type": "t"}, {"x": torch.tensor([1, 2], dtype=torch.int32)})
    header = b'{"type":"t","tensors":[{"name":"x","dtype":"int32","shape":[2],"nbytes":8}]}'
    assert data == b"SPLT\x00\x02" + struct.pack(">I", len(header)) + header + b"\x01\x00\x00\x00\x02\x00\x00\x00"


def test_decode_literal_frame() -> None:
    header = b'{"type":"t","k":3,"tensors":[{"name":"h","dtype":"float16","shape":[1,2],"nbytes":4}]}'
    decoded = decode_frame(frame(header, b"\x00\x3c\x00\xc0"))  # 1.0, -2.0 in little-endian fp16
    assert decoded.header == {"type": "t", "k": 3}
    assert decoded.tensors["h"].tolist() == [[1.0, -2.0]]
    assert peek_type(frame(header, b"")) == "t"  # peeking never looks at payloads


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_round_trip_every_dtype(name: str) -> None:
    tensor = (torch.arange(24).reshape(2, 3, 4) - 7).to(DTYPES[name])
    out = decode_frame(encode_frame({"type": "t"}, {"a": tensor, "empty": torch.zeros(0, 5, dtype=DTYPES[name])}))
    assert out.tensors["a"].dtype == DTYPES[name]
    assert torch.equal(out.tensors["a"], tensor)
    assert out.tensors["empty"].shape == (0, 5)


def test_encode_refuses_unlisted_dtype() -> None:
    with pytest.raises(BadDtype):
        encode_frame({"type": "t"}, {"a": torch.zeros(2, dtype=torch.complex64)})


GOOD_DESC = '{"name":"h","dtype":"float32","shape":[2],"nbytes":8}'


@pytest.mark.parametrize(
    ("data", "error"),
    [
        (b"", MalformedFrame),
        (b"SPLT\x00\x01\x00", MalformedFrame),
        (frame(b"{}", magic=b"SPLX"), BadMagic),
        (frame(b"{}", version=1), UnsupportedVersion),  # version 1 had no wire codecs
        (frame(b"{}", version=3), UnsupportedVersion),
        (b"SPLT\x00\x02" + struct.pack(">I", 100) + b"{}", MalformedFrame),  # header longer than frame
        (b"SPLT\x00\x02" + struct.pack(">I", 1 << 20) + b"{}", MalformedFrame),  # header over the limit
        (frame(b"\xff\xfe"), MalformedFrame),
        (frame(b"{not json"), MalformedFrame),
        (frame(b"[1,2]"), MalformedFrame),
        (frame(b'{"tensors":3}'), MalformedFrame),
        (frame(b'{"tensors":[3]}'), MalformedFrame),
        (frame(b'{"tensors":[{"dtype":"float32","shape":[1],"nbytes":4}]}', b"\x00" * 4), MalformedFrame),
        (frame(b'{"tensors":[{"name":"h","dtype":"complex64","shape":[1],"nbytes":8}]}', b"\x00" * 8), BadDtype),
        (frame(b'{"tensors":[{"name":"h","dtype":"float32","shape":[3],"nbytes":8}]}', b"\x00" * 8), BadTensor),
        (frame(b'{"tensors":[{"name":"h","dtype":"float32","shape":[-2],"nbytes":8}]}', b"\x00" * 8), BadTensor),
        (frame(b'{"tensors":[{"name":"h","dtype":"float32","shape":[1,1,1,1,2],"nbytes":8}]}'), BadTensor),
        # empty, so its bytes match, but 2**64 is no torch size: reshape raised TypeError (answered server_error)
        (frame(b'{"tensors":[{"name":"h","dtype":"float32","shape":[0,18446744073709551616],"nbytes":0}]}'), BadTensor),
        (frame(b'{"tensors":[{"name":"h","dtype":"float32","shape":[2],"nbytes":true}]}'), BadTensor),
        (frame(b'{"tensors":[' + GOOD_DESC.encode() + b"]}", b"\x00" * 7), MalformedFrame),  # short payload
        (frame(b'{"tensors":[' + GOOD_DESC.encode() + b"]}", b"\x00" * 9), MalformedFrame),  # trailing byte
        (frame(b'{"tensors":[' + (GOOD_DESC + "," + GOOD_DESC).encode() + b"]}", b"\x00" * 16), MalformedFrame),
    ],
)
def test_defective_frames_are_refused_with_their_type(data: bytes, error: type[Exception]) -> None:
    with pytest.raises(error):
        decode_frame(data)


def test_size_cap() -> None:
    data = encode_frame({"type": "t"}, {"h": torch.zeros(100)})
    decode_frame(data, max_bytes=len(data))
    with pytest.raises(MessageTooLarge):
        decode_frame(data, max_bytes=len(data) - 1)
