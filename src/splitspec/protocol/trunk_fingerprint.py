"""The trunk's content fingerprint as it travels in the handshake, and the edge's check of it (sans-I/O).

The config hash in :class:`~splitspec.protocol.messages.Hello` says which *architecture* the cloud
serves; it cannot see weights. A :class:`TrunkFingerprint` names the trunk's *content*: the layer
range, the dtype the trunk tensors are stored in (wrapped in the quantization method when the trunk
is quantized: ``nf4(bfloat16)``), and a digest of every trunk tensor's name, dtype, shape and bytes
(computed by :mod:`splitspec.models.trunk_fingerprint`). Its text form, ``START-END:DTYPE:DIGEST``
(END exclusive), is what the cloud sends in its ``Welcome`` and what a user pins with
``--trunk-fingerprint``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from splitspec.exceptions import TrunkMismatch

_DTYPE = r"[a-z0-9_+]{1,64}"
_TEXT = re.compile(rf"(\d{{1,6}})-(\d{{1,6}}):((?:[a-z0-9_]{{1,16}}\({_DTYPE}\))|{_DTYPE}):([0-9a-f]{{32}})")
MAX_TEXT_LEN = 160  # longest fingerprint text a peer may send, characters


@dataclass(frozen=True)
class TrunkFingerprint:
    """What a trunk is made of: layers ``layer_start..layer_end-1`` stored as ``dtype``, hashed to ``digest``."""

    layer_start: int  # first trunk layer (inclusive)
    layer_end: int  # last trunk layer (exclusive)
    dtype: str  # stored dtype of the trunk tensors ("bfloat16"; several joined by "+"), in its method if quantized
    digest: str  # blake2b-128 over every trunk tensor's name, dtype, shape and bytes, hex

    @property
    def quantization(self) -> str:
        """The quantization method the trunk is served with ("nf4", "bnb_nf4", ...), or "none"."""
        method, paren, _ = self.dtype.partition("(")
        return method if paren else "none"

    def __str__(self) -> str:
        return f"{self.layer_start}-{self.layer_end}:{self.dtype}:{self.digest}"

    @property
    def layers(self) -> str:
        """The layer range for people, e.g. "layers 2..5"."""
        return f"layers {self.layer_start}..{self.layer_end - 1}"

    @classmethod
    def parse(cls, text: str) -> TrunkFingerprint:
        """The fingerprint written as ``START-END:DTYPE:DIGEST``; ValueError for anything else."""
        match = _TEXT.fullmatch(text)
        if match is None or int(match[1]) >= int(match[2]):
            raise ValueError(
                f"a trunk fingerprint looks like START-END:DTYPE:DIGEST (e.g. 2-6:bfloat16:<32 hex digits>), "
                f"got {text!r:.100}"
            )
        return cls(int(match[1]), int(match[2]), match[3], match[4])


def check_trunk(expected: TrunkFingerprint, served: TrunkFingerprint, source: str) -> None:
    """Refuse a trunk whose fingerprint is not ``expected`` (from ``source``), saying what differs."""
    if served == expected:
        return
    if (served.layer_start, served.layer_end) != (expected.layer_start, expected.layer_end):
        what = f"the layer range differs ({source}: {expected.layers}; cloud: {served.layers})"
    elif served.quantization != expected.quantization:
        what = f"the quantization differs ({source}: {expected.quantization}; cloud: {served.quantization})"
    elif served.dtype != expected.dtype:
        what = f"the stored dtype differs ({source}: {expected.dtype}; cloud: {served.dtype})"
    else:
        what = f"same {expected.layers} stored as {expected.dtype}, but other weights"
    raise TrunkMismatch(
        f"the cloud serves another trunk than {source}: {what}. Expected trunk fingerprint {expected}, "
        f"the cloud sent {served}"
    )
