"""Hidden-state wire codecs (sans-I/O): how a ``(1, q, H)`` hidden state travels in a frame.

The edge's Hello names one codec (``--wire-codec``), the trunk accepts it or refuses the
handshake (``cloud serve --wire-codecs``), and from then on both directions of every step, and
every prefill chunk, carry their hidden states in it. A step names its codec in its header
(``"codec"``; absent means ``raw``), so a frame decodes on its own; the server also checks that
it is the connection's.

Codecs, and their tensors in the frame (every one of shape ``(1, q, ...)``)::

    raw    "hidden"                (1, q, H) the compute dtype, as is; both sides must compute in it
    bf16   "hidden"                (1, q, H) bfloat16                       2·H bytes per token
    int8   "hidden"                (1, q, H) int8: round(x / scale), in [-127, 127]
           "hidden_scale"          (1, q, ⌈H/16⌉) bfloat16: one per block of 16 channels, max|x| / 127
           "hidden_outlier_index"  (1, q, k) int16: each token's k largest-magnitude channels, distinct
           "hidden_outlier_value"  (1, q, k) bfloat16: their values (rounded to bfloat16, not quantized)

int8 costs H + 2·⌈H/16⌉ + 4·k bytes per token (k = :data:`INT8_OUTLIERS` = 8, or H if smaller):
1.125·H + 32, against 2·H for bf16. LLM hidden states carry a few massive activations (a
handful of channels hundreds of times the others); per-block scales alone would zero every other
channel of their block, so each token's k largest values leave the blocks (their int8 slots are
0) and travel as bfloat16 beside them. The last block of an H that is not a multiple of 16 is
zero-padded before its scale is taken. (Blocks of 32, 1.0625·H + 32 bytes, missed the shipped
models' quality bar by a few near-tie tokens in 10,496: see docs/architecture.md.)

Decoding checks, before it computes anything: each tensor's presence, dtype and shape; scales
finite and >= 0; outlier values finite; outlier indices in [0, H) and distinct within a token.
Any defect raises :class:`~splitspec.exceptions.BadEncoding` (a
:class:`~splitspec.exceptions.BadTensor`). A raw or bf16 hidden state decodes to itself; an int8
one to float32. The receiver casts to its compute dtype.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F

from splitspec.exceptions import BadEncoding, BadTensor, HandshakeMismatch
from splitspec.protocol.choices import WIRE_CODECS

__all__ = [
    "INT8_BLOCK",
    "INT8_OUTLIERS",
    "WIRE_CODECS",
    "check_codec",
    "decode_hidden",
    "encode_hidden",
    "wire_bytes_per_token",
]

INT8_BLOCK = 16  # channels sharing one int8 scale (32 measured 13 % more top-1 flips: docs/architecture.md)
INT8_OUTLIERS = 8  # largest-magnitude channels per token sent as bfloat16
_INT8_MAX = 127

HIDDEN = "hidden"
SCALE = "hidden_scale"
OUTLIER_INDEX = "hidden_outlier_index"
OUTLIER_VALUE = "hidden_outlier_value"


def check_codec(name: str, accepted: tuple[str, ...]) -> None:
    """Refuse a codec outside ``accepted`` with a :class:`HandshakeMismatch` naming both."""
    if name not in accepted:
        raise HandshakeMismatch(f"wire codec: edge sends {name!r}, trunk accepts {', '.join(accepted)}")


def _outliers(hidden_size: int) -> int:
    return min(INT8_OUTLIERS, hidden_size)


def _blocks(hidden_size: int) -> int:
    return math.ceil(hidden_size / INT8_BLOCK)


def wire_bytes_per_token(codec: str, hidden_size: int, dtype: torch.dtype) -> int:
    """Payload bytes of one token's hidden state in ``codec`` (``dtype``: the compute dtype, for raw)."""
    if codec == "raw":
        return hidden_size * dtype.itemsize
    if codec == "bf16":
        return hidden_size * 2
    return hidden_size + 2 * _blocks(hidden_size) + 4 * _outliers(hidden_size)


def encode_hidden(codec: str, hidden: torch.Tensor) -> dict[str, torch.Tensor]:
    """The frame tensors carrying ``hidden`` (1, q, H) in ``codec``."""
    if codec == "raw":
        return {HIDDEN: hidden}
    if codec == "bf16":
        return {HIDDEN: hidden.to(torch.bfloat16)}
    return _encode_int8(hidden)


def _blocked(x: torch.Tensor, blocks: int) -> torch.Tensor:
    """(1, q, H) -> (1, q, blocks, INT8_BLOCK), zero-padded at the end when H is not a multiple of the block."""
    batch, q, h = x.shape
    pad = blocks * INT8_BLOCK - h
    return (F.pad(x, (0, pad)) if pad else x).view(batch, q, blocks, INT8_BLOCK)


def _encode_int8(hidden: torch.Tensor) -> dict[str, torch.Tensor]:
    x = hidden.detach().to(device="cpu", dtype=torch.float32)  # (1, q, H), maybe the caller's own tensor
    batch, q, h = x.shape
    k, nb = _outliers(h), _blocks(h)
    magnitude = x.abs()  # (1, q, H), ours
    index = magnitude.topk(k, dim=-1).indices  # (1, q, k)
    value = x.gather(-1, index).to(torch.bfloat16)  # (1, q, k)
    magnitude.scatter_(-1, index, 0.0)  # the outliers leave their blocks' scales
    scale = (_blocked(magnitude, nb).amax(dim=-1) / _INT8_MAX).to(torch.bfloat16)  # (1, q, nb)
    step = scale.float()  # (1, q, nb): the scale as the decoder will read it
    inverse = torch.where(step > 0, 1.0 / step, 0.0).unsqueeze(-1)  # (1, q, nb, 1); an all-zero block stays 0
    quantized = (_blocked(x, nb) * inverse).round_().clamp_(-_INT8_MAX, _INT8_MAX)  # (1, q, nb, 16)
    ints = quantized.to(torch.int8).view(batch, q, nb * INT8_BLOCK)[..., :h].contiguous()  # (1, q, H)
    return {
        HIDDEN: ints.scatter_(-1, index, 0),  # the outliers' slots carry nothing
        SCALE: scale,
        OUTLIER_INDEX: index.to(torch.int16),
        OUTLIER_VALUE: value,
    }


def _tensor(tensors: Mapping[str, torch.Tensor], name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    tensor = tensors.get(name)
    if tensor is None:
        raise BadEncoding(f"the int8 codec needs tensor {name!r}")
    if tensor.dtype != dtype or tuple(tensor.shape) != shape:
        raise BadEncoding(f"tensor {name!r} must be {dtype} of shape {shape}, got {tensor.dtype} {tuple(tensor.shape)}")
    return tensor


def decode_hidden(codec: str, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The hidden state (1, q, H) that ``tensors`` carry in ``codec``; :class:`BadEncoding` on any defect.

    The caller has checked that ``tensors["hidden"]`` exists and has shape (1, q, H).
    """
    hidden = tensors[HIDDEN]
    if codec == "raw":
        if not hidden.is_floating_point():
            raise BadTensor(f"a raw hidden state is a float tensor, got {hidden.dtype}")
        return hidden
    if codec == "bf16":
        if hidden.dtype != torch.bfloat16:
            raise BadEncoding(f"the bf16 codec carries bfloat16, got {hidden.dtype}")
        return hidden
    return _decode_int8(tensors)


def _decode_int8(tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    batch, q, h = tensors[HIDDEN].shape
    k, nb = _outliers(h), _blocks(h)
    quantized = _tensor(tensors, HIDDEN, torch.int8, (batch, q, h))  # (1, q, H)
    scale = _tensor(tensors, SCALE, torch.bfloat16, (batch, q, nb)).float()  # (1, q, nb)
    index = _tensor(tensors, OUTLIER_INDEX, torch.int16, (batch, q, k)).long()  # (1, q, k)
    value = _tensor(tensors, OUTLIER_VALUE, torch.bfloat16, (batch, q, k)).float()  # (1, q, k)
    if not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()):
        raise BadEncoding("int8 block scales must be finite and non-negative")
    if not bool(torch.isfinite(value).all()):
        raise BadEncoding("int8 outlier values must be finite")
    if bool(((index < 0) | (index >= h)).any()):
        raise BadEncoding(f"int8 outlier indices must lie in [0, {h})")
    ordered = index.sort(dim=-1).values  # (1, q, k)
    if bool((ordered[..., 1:] == ordered[..., :-1]).any()):
        raise BadEncoding("int8 outlier indices repeat within a token")
    # a fresh float32 copy (padded or not), scaled in place: one H x 4-byte buffer a token, not two (a peer's
    # frame of n bytes cost 8.4 n of memory at its peak, past the decoders' 8x bound)
    blocks = _blocked(quantized.float(), nb)  # (1, q, nb, 16)
    out = blocks.mul_(scale.unsqueeze(-1)).view(batch, q, nb * INT8_BLOCK)[..., :h].contiguous()  # (1, q, H)
    return out.scatter_(-1, index, value)
