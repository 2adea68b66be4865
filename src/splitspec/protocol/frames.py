"""Binary frames: magic, version, JSON header, raw tensor payloads.

Layout (all integers big-endian)::

    offset  size  field
    0       4     magic b"SPLT"
    4       2     protocol version (uint16)
    6       4     header length H (uint32)
    10      H     header: ASCII JSON object (other characters as JSON escapes, as ``json.dumps``
                  writes them); its "tensors" list describes the payloads
    10+H    ...   tensor payloads, concatenated in header order, little-endian, C-contiguous

Each tensor descriptor is ``{"name": str, "dtype": str, "shape": [int, ...], "nbytes": int}``.
The decoder checks, before it touches any payload byte: magic, version, header size, JSON shape,
dtype against :data:`DTYPES`, ``prod(shape) * itemsize == nbytes``, and that the payloads fill
the frame exactly (no missing and no trailing bytes).

Memory: a parsed JSON value costs a Python object (a 3-byte ``{},`` becomes a 64-byte dict), so
before parsing, a header may hold at most :data:`MAX_HEADER_VALUES` commas and opening brackets
(counted anywhere, strings included; a real header has fewer than 30). That bounds its objects,
and its nesting, whatever the bytes; an ASCII header also decodes to a string of its own size.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from splitspec.exceptions import (
    BadDtype,
    BadMagic,
    BadTensor,
    MalformedFrame,
    MessageTooLarge,
    UnsupportedVersion,
)

MAGIC = b"SPLT"
PROTOCOL_VERSION = 2  # 2: hidden-state wire codecs (protocol.codec), int8 and int16 tensors
_PREFIX = struct.Struct(">4sHI")  # magic, version, header length
PREFIX_SIZE = _PREFIX.size  # 10 bytes
MAX_HEADER_BYTES = 64 * 1024  # a header is metadata only; tensors carry the bulk
MAX_HEADER_VALUES = 128  # commas and opening brackets a header may hold, i.e. a bound on its JSON values
MAX_TENSOR_DIMS = 4
MAX_TENSOR_DIM = 2**63 - 1  # torch's sizes are int64: an empty tensor's other dimensions must fit one

# Wire dtype name -> torch dtype. Nothing outside this whitelist is ever decoded.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class Frame:
    """A decoded frame: the header fields (without ``tensors``) and the named tensors."""

    header: dict[str, Any]
    tensors: dict[str, torch.Tensor]


def _tensor_view(tensor: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of ``tensor`` in C order, without copying a contiguous host tensor."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().data


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """Raw little-endian bytes of ``tensor`` in C order."""
    return bytes(_tensor_view(tensor))


def encode_frame(
    header: Mapping[str, Any],
    tensors: Mapping[str, torch.Tensor] | None = None,
    *,
    version: int = PROTOCOL_VERSION,
) -> bytes:
    """Serialize ``header`` and ``tensors`` into one frame."""
    descriptors = []
    payloads: list[memoryview] = []
    for name, tensor in (tensors or {}).items():
        if tensor.dtype not in DTYPE_NAMES:
            raise BadDtype(f"tensor {name!r} has dtype {tensor.dtype}, not one of {sorted(DTYPES)}")
        raw = _tensor_view(tensor)  # copied once, by the join below
        descriptors.append(
            {"name": name, "dtype": DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape), "nbytes": len(raw)}
        )
        payloads.append(raw)
    head = json.dumps({**header, "tensors": descriptors}, separators=(",", ":")).encode()
    return b"".join([_PREFIX.pack(MAGIC, version, len(head)), head, *payloads])


def _descriptor(raw: object) -> tuple[str, torch.dtype, tuple[int, ...], int]:
    if not isinstance(raw, dict):
        raise MalformedFrame("tensor descriptor is not an object")
    name, dtype, shape, nbytes = raw.get("name"), raw.get("dtype"), raw.get("shape"), raw.get("nbytes")
    if not isinstance(name, str) or not name:
        raise MalformedFrame("tensor descriptor lacks a name")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise BadDtype(f"tensor {name!r}: dtype {dtype!r} is not one of {sorted(DTYPES)}")
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_TENSOR_DIMS
        or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_TENSOR_DIM for d in shape)
    ):
        raise BadTensor(f"tensor {name!r}: shape {shape!r} is not a list of <= 4 non-negative 64-bit ints")
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
        raise BadTensor(f"tensor {name!r}: nbytes {nbytes!r} is not a non-negative int")
    torch_dtype = DTYPES[dtype]
    expected = math.prod(shape) * torch_dtype.itemsize
    if expected != nbytes:
        raise BadTensor(f"tensor {name!r}: shape {shape} of {dtype} needs {expected} bytes, header says {nbytes}")
    return name, torch_dtype, tuple(shape), nbytes


def _refuse_constant(name: str) -> Any:
    raise MalformedFrame(f"header holds {name}, which is not JSON")


def _parse_header(data: bytes) -> tuple[dict[str, Any], int]:
    """Validate the prefix and parse the JSON header; return it and the payload offset."""
    if len(data) < PREFIX_SIZE:
        raise MalformedFrame(f"frame of {len(data)} bytes is shorter than the {PREFIX_SIZE}-byte prefix")
    magic, version, header_len = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise BadMagic(f"bad magic {magic!r}, expected {MAGIC!r}")
    if version != PROTOCOL_VERSION:
        raise UnsupportedVersion(f"protocol version {version}, this peer speaks {PROTOCOL_VERSION}")
    if header_len > MAX_HEADER_BYTES or PREFIX_SIZE + header_len > len(data):
        raise MalformedFrame(f"header length {header_len} does not fit the frame")
    try:  # decoded straight from the frame: no copy of the header's bytes
        text = str(memoryview(data)[PREFIX_SIZE : PREFIX_SIZE + header_len], "ascii")
    except UnicodeDecodeError:
        raise MalformedFrame("header is not ASCII (other characters travel as \\u escapes)") from None
    values = text.count(",") + text.count("[") + text.count("{")
    if values > MAX_HEADER_VALUES:
        raise MalformedFrame(f"header holds {values} commas and brackets, more than the {MAX_HEADER_VALUES} allowed")
    try:
        header = json.loads(text, parse_constant=_refuse_constant)
    except ValueError as exc:  # not JSON, or an integer of more than 4,300 digits
        raise MalformedFrame(f"header is not JSON: {str(exc)[:200]}") from None
    if not isinstance(header, dict):
        raise MalformedFrame("header is not a JSON object")
    return header, PREFIX_SIZE + header_len


def peek_header(data: bytes) -> dict[str, Any]:
    """A frame's validated header (its ``tensors`` list included), reading no payload byte."""
    header, _ = _parse_header(data)
    return header


def peek_type(data: bytes) -> str | None:
    """The message type named by a frame's header, reading no payload byte."""
    kind = peek_header(data).get("type")
    return kind if isinstance(kind, str) else None


def decode_frame(data: bytes, *, max_bytes: int | None = None) -> Frame:
    """Parse and validate one frame. Raises a :class:`ProtocolError` subclass on any defect."""
    if max_bytes is not None and len(data) > max_bytes:
        raise MessageTooLarge(f"frame of {len(data)} bytes exceeds the cap of {max_bytes} bytes")
    header, offset = _parse_header(data)
    raw_descriptors = header.pop("tensors", [])
    if not isinstance(raw_descriptors, list):
        raise MalformedFrame("header 'tensors' is not a list")
    descriptors = [_descriptor(d) for d in raw_descriptors]
    if offset + sum(d[3] for d in descriptors) != len(data):
        raise MalformedFrame(
            f"payloads need {sum(d[3] for d in descriptors)} bytes, frame carries {len(data) - offset}"
        )
    tensors: dict[str, torch.Tensor] = {}
    for name, dtype, shape, nbytes in descriptors:
        if name in tensors:
            raise MalformedFrame(f"tensor {name!r} appears twice")
        buf = bytearray(memoryview(data)[offset : offset + nbytes])  # one copy, writable for torch
        offset += nbytes
        flat = torch.frombuffer(buf, dtype=dtype) if nbytes else torch.empty(0, dtype=dtype)
        tensors[name] = flat.reshape(shape)
    return Frame(header=header, tensors=tensors)
