"""The compact bit stream a SpecFed worker uploads: top-K ids and quantized probabilities.

Pure numpy/torch, no I/O. :func:`encode_topk` turns a worker's exact laws and the top-K it kept
into bytes; :func:`decode_topk` turns bytes from a peer back into a :class:`~splitspec.federated.
topk.TopK`, refusing anything malformed with :class:`~splitspec.exceptions.BadTensor`.

Layout: one bit string, most significant bit first, zero-padded to a whole byte::

    2 bits        value codec: 0 = quantized, 1 = float16, 2 = float32
    per position:
      W bits      K − 1, W = bit length of |V| − 1 (13 bits for |V| = 8192)
      16 bits     ⌈ε · 65535⌉: an upper bound on ε = ‖p − p̃‖₁ (exact law p, transmitted p̃)
      5 bits      r, the exp-Golomb order of the ids
      K codes     EG_r of the first id, then of ``gap − 1`` between consecutive ascending ids
      quantized:  8 bits e (step s = 2^(−e/4)), 5 bits order r', K codes EG_r'(q − 1): p̃ = q·s
      float16 / float32: K raw IEEE values, 16 / 32 bits each

Exp-Golomb of order r codes v >= 0 as u = v + 2^r in n = bitlen(u) bits after n − 1 − r zeros
(2n − 1 − r bits): small gaps and small quantized values cost few bits, and one large value costs
about twice its bit length, not a unary run. The encoder picks r per position and field to
minimise the bits.

Quantization: with the kept ids' exact mass 1 − τ (τ the tail mass outside them), the step is
the largest grid value s <= min(2b/K, max p) for a budget b = ρ·τ + 2⁻¹⁶; each value moves by at
most s/2, so η = Σ_kept |p̃ − p| <= K·s/2 <= b. Tokens whose value rounds to 0 are dropped (their
mass joins ε). The worker sends the exact ε = τ + η (ceiled to the 16-bit grid), so the SpecFed
bounds ‖p − p̂‖₁ <= 2ε and Δ <= 2Σ wᵢεᵢ hold with the transmitted ε, whatever the codec. Adaptive
K selects on τ (the residual mass, as the paper defines it); the codec then adds at most
ρτ + 2⁻¹⁶ (quantized), 2⁻¹¹ (float16, relative rounding) or nothing (float32, the law's dtype).

Measured on the demo models at K = 1 % of |V| = 8192 (ρ = 0.05): ids ~6.8 bits and values
~4.5-6.5 bits per kept token, η ~2.5 % of τ; 126-148 bytes per position for T = 1.2-0.8
(``benchmarks/specfed_eval.py``) against 16 384 for the dense float16 law and 239 with float16
values.
"""

from __future__ import annotations

import math
from array import array
from typing import Any

import numpy as np
import torch

from splitspec.exceptions import BadTensor, ConfigError
from splitspec.federated.topk import TopK
from splitspec.protocol.choices import DEFAULT_QUANT_BUDGET
from splitspec.protocol.fed import (
    MAX_QUANT_BUDGET,
    SCORES_HEADER_SIZE,
    VALUE_CODECS,
    ValueCodec,
)

ETA_FLOOR = 2.0**-16  # quantization error always allowed, probability (covers τ = 0)
EPS_SCALE = 65535  # ε travels as ⌈ε · EPS_SCALE⌉ in 16 bits
MAX_CODE_BITS = 52  # longest exp-Golomb payload accepted (values < 2**52 fit float64 exactly)
ORDER_BITS = 5  # width of an exp-Golomb order field
STEP_BITS = 8  # width of the quantization step exponent
MASS_SLACK = 1e-4  # |Σ p̃ − 1| may exceed the reported ε by this much (float32 laws), no more
_CODEC_IDS = {"quantized": 0, "float16": 1, "float32": 2}
_RAW_FLOATS = {1: (np.float16, np.uint16), 2: (np.float32, np.uint32)}  # codec id -> (float, same-width uint)
_WIRE_FLOATS: dict[int, np.dtype[Any]] = {1: np.dtype(">f2"), 2: np.dtype(">f4")}  # codec id -> raw value on the wire


def _bit_length(u: np.ndarray) -> np.ndarray:
    """Exact bit length of positive ints < 2**53 (frexp of an exact float64)."""
    return np.frexp(u.astype(np.float64))[1].astype(np.int64)


def _best_order(values: np.ndarray) -> int:
    """The exp-Golomb order that codes ``values`` (>= 0, at least one) in the fewest bits.

    Order r costs ``2·bitlen((v >> r) + 1) − 1 + r`` bits per value v; orders above
    bitlen(max v) only add bits, so the search stops there.
    """
    top = min((1 << ORDER_BITS) - 1, int(values.max()).bit_length())
    orders = np.arange(top + 1, dtype=np.int64)
    n = _bit_length((values.astype(np.int64)[:, None] >> orders[None, :]) + 1)  # (K, orders)
    return int(np.argmin((2 * n - 1).sum(axis=0) + values.size * orders))


class _BitWriter:
    """Collects (value, width) fields; :meth:`to_bytes` packs them MSB first, zero padded."""

    def __init__(self) -> None:
        self._values: list[np.ndarray] = []
        self._widths: list[np.ndarray] = []

    def fixed(self, value: int, width: int) -> None:
        if not 0 <= value < (1 << width):
            raise ValueError(f"{value} does not fit {width} bits")
        self._values.append(np.array([value], dtype=np.uint64))
        self._widths.append(np.array([width], dtype=np.int64))

    def raw(self, values: np.ndarray, width: int) -> None:
        self._values.append(values.astype(np.uint64))
        self._widths.append(np.full(values.size, width, dtype=np.int64))

    def exp_golomb(self, values: np.ndarray, order: int) -> None:
        u = values.astype(np.int64) + (1 << order)
        n = _bit_length(u)
        if values.size and int(n.max()) > MAX_CODE_BITS:
            raise ValueError(f"a value needs more than {MAX_CODE_BITS} bits")
        # each code: (n − 1 − order) zero bits, then u in n bits
        self._values.append(np.stack([np.zeros_like(u), u], 1).reshape(-1).astype(np.uint64))
        self._widths.append(np.stack([n - 1 - order, n], 1).reshape(-1))

    def to_bytes(self) -> bytes:
        values = np.concatenate(self._values) if self._values else np.zeros(0, np.uint64)
        widths = np.concatenate(self._widths) if self._widths else np.zeros(0, np.int64)
        field = np.repeat(np.arange(values.size), widths)
        starts = np.cumsum(widths) - widths
        shift = (widths[field] - 1 - (np.arange(field.size) - starts[field])).astype(np.uint64)
        bits = ((values[field] >> shift) & np.uint64(1)).astype(np.uint8)
        return bytes(np.packbits(bits).tobytes())


class _BitReader:
    """Reads fields from a peer's bit string; every overrun or malformed code is a BadTensor.

    Works on the bytes in place: each field reads the few bytes it spans, so decoding holds
    O(1) memory beyond the input and the decoded values (never a per-bit expansion).
    """

    def __init__(self, data: bytes) -> None:
        self.data = bytes(data)
        self.size = 8 * len(self.data)
        self.pos = 0

    def _bits(self, start: int, width: int) -> int:
        """``width`` bits from bit ``start``, as an int (bits past the end read as 0)."""
        first, end = start >> 3, (start + width + 7) >> 3
        chunk = int.from_bytes(self.data[first:end], "big") << 8 * max(0, end - len(self.data))
        return (chunk >> (8 * end - start - width)) & ((1 << width) - 1)

    def fixed(self, width: int, what: str) -> int:
        if self.pos + width > self.size:
            raise BadTensor(f"top-K stream ends inside {what}")
        value = self._bits(self.pos, width)
        self.pos += width
        return value

    def raw(self, count: int, dtype: np.dtype[Any], what: str) -> np.ndarray:
        """``count`` big-endian values of ``dtype`` (whole bytes wide), realigned to a byte boundary."""
        nbits = 8 * count * dtype.itemsize
        if self.pos + nbits > self.size:
            raise BadTensor(f"top-K stream ends inside {what}")
        first, skip = self.pos >> 3, self.pos & 7
        window = np.frombuffer(self.data, dtype=np.uint8, count=nbits // 8 + (skip > 0), offset=first)
        self.pos += nbits
        if not skip:
            return window.view(dtype)
        high = window[:-1] << np.uint8(skip)  # (bytes,) this byte's low bits, moved up
        high |= window[1:] >> np.uint8(8 - skip)  # the next byte's high bits below them
        return high.view(dtype)

    def exp_golomb(self, count: int, order: int, what: str) -> np.ndarray:
        # every code takes at least order + 1 bits: refuse a count the stream cannot hold before
        # allocating anything for it
        if self.pos + count * (order + 1) > self.size:
            raise BadTensor(f"top-K stream ends inside {what}")
        if order == 0 and self._bits(self.pos, count) == (1 << count) - 1:
            self.pos += count  # K one-bits at order 0 are K zeros: every id of a dense law, at once
            return np.zeros(count, dtype=np.int64)
        values = array("q")  # 8 bytes a value, read back without a copy
        data, pos, size, top = self.data, self.pos, self.size, MAX_CODE_BITS - order - 1
        for _ in range(count):  # code boundaries depend on the previous code: a short scalar walk
            # the 16 bytes from pos's byte hold pos's offset and a whole code (<= 2·52 bits);
            # near the end of the stream they are zero-padded on the right
            first, skip = pos >> 3, pos & 7
            chunk = data[first : first + 16]
            window = (int.from_bytes(chunk, "big") << 8 * (16 - len(chunk))) & ((1 << (128 - skip)) - 1)
            zeros = 128 - skip - window.bit_length()
            if zeros > size - pos:  # the padding past the end is not the stream's
                zeros = size - pos
            if zeros > top:
                raise BadTensor(f"top-K stream holds an over-long code in {what}")
            end = pos + 2 * zeros + order + 1
            if end > size:
                raise BadTensor(f"top-K stream ends inside {what}")
            values.append((window >> (8 * first + 128 - end)) - (1 << order))
            pos = end
        self.pos = pos
        return np.frombuffer(values, dtype=np.int64)

    def finish(self) -> None:
        rest = self.size - self.pos
        if rest >= 8:
            raise BadTensor(f"top-K stream has {rest // 8} trailing bytes")
        if rest and self._bits(self.pos, rest):
            raise BadTensor("top-K stream padding must be zero")


def _id_width(vocab_size: int) -> int:
    return max(1, (vocab_size - 1).bit_length())


def max_stream_bytes(positions: int, k: int, vocab_size: int) -> int:
    """The longest top-K stream :func:`encode_topk` can produce for ``positions`` of at most ``k`` ids.

    Per position: the count, ε, the orders and the step (W + 16 + 5 + 8 + 5 bits), then per kept
    token its id code and its value code. The encoder picks each field's order to minimise its
    bits, so a field costs at most its order-0 codes: an id gap < |V| at most 2·bitlen(|V|) − 1
    bits, a quantized value at most 2·52 − 1 bits (the encoder refuses longer), a raw float 32.
    """
    id_bits = 2 * vocab_size.bit_length() - 1
    value_bits = max(2 * MAX_CODE_BITS - 1, 32)
    per_position = _id_width(vocab_size) + 16 + 2 * ORDER_BITS + STEP_BITS + k * (id_bits + value_bits)
    return (2 + positions * per_position + 7) // 8


def max_reply_bytes(positions: int, k: int, vocab_size: int, *, audit: bool) -> int:
    """The largest ``fed_scores`` frame a worker can legitimately send for a request scoring
    ``positions`` with at most ``k`` tokens each (audit mode adds the float32 laws)."""
    full = 4 * positions * vocab_size if audit else 0
    return SCORES_HEADER_SIZE + max_stream_bytes(positions, k, vocab_size) + full


def quantization_step(tail: float, k: int, top: float, rho: float) -> tuple[int, float]:
    """(e, s = 2^(−e/4)): the largest grid step <= min(2(ρτ + 2⁻¹⁶)/K, top) (so η <= ρτ + 2⁻¹⁶)."""
    wanted = min(2.0 * (rho * tail + ETA_FLOOR) / k, top)
    e = min((1 << STEP_BITS) - 1, max(0, math.ceil(-4.0 * math.log2(wanted))))
    return e, 2.0 ** (-e / 4.0)


def encode_topk(
    laws: torch.Tensor, topk: TopK, codec: ValueCodec = "quantized", rho: float = DEFAULT_QUANT_BUDGET
) -> bytes:
    """The upload of one round: ``topk`` (ids chosen from ``laws`` (n, V)) with values per ``codec``.

    ``laws`` are the worker's exact probabilities; they give the exact ε each position reports.
    """
    if codec not in _CODEC_IDS:
        raise ConfigError(f"value codec must be one of {VALUE_CODECS}, got {codec!r}")
    if not 0.0 < rho <= MAX_QUANT_BUDGET:
        raise ConfigError(f"quantization budget must be in (0, {MAX_QUANT_BUDGET}], got {rho}")
    n, vocab = laws.shape
    if n != topk.positions or vocab != topk.vocab_size:
        raise ValueError(f"laws {tuple(laws.shape)} do not match a top-K of {topk.positions} x {topk.vocab_size}")
    exact = laws.double().numpy()
    ends = np.cumsum(topk.counts.numpy())
    all_ids = topk.ids.numpy()
    codec_id = _CODEC_IDS[codec]
    out = _BitWriter()
    out.fixed(codec_id, 2)
    for j in range(n):
        ids = all_ids[ends[j] - int(topk.counts[j]) : ends[j]].astype(np.int64)
        row = exact[j]
        kept = row[ids]
        if codec_id == 0:
            e, step = quantization_step(max(0.0, 1.0 - float(kept.sum())), ids.size, float(kept.max()), rho)
            q = np.rint(kept / step).astype(np.int64)
            nonzero = q >= 1  # a value that rounds to 0 is dropped: its mass joins ε
            ids, q, kept = ids[nonzero], q[nonzero], kept[nonzero]
            sent = q * step
        else:
            float_type, uint_type = _RAW_FLOATS[codec_id]
            wire = kept.astype(float_type)
            sent = wire.astype(np.float64)
        epsilon = float(np.abs(sent - kept).sum()) + max(0.0, float(row.sum()) - float(kept.sum()))
        out.fixed(ids.size - 1, _id_width(vocab))
        out.fixed(min(EPS_SCALE, math.ceil((epsilon + 1e-12) * EPS_SCALE)), 16)
        gaps = np.diff(ids, prepend=-1) - 1  # first id as is, then gap − 1
        order = _best_order(gaps)
        out.fixed(order, ORDER_BITS)
        out.exp_golomb(gaps, order)
        if codec_id == 0:
            order = _best_order(q - 1)
            out.fixed(e, STEP_BITS)
            out.fixed(order, ORDER_BITS)
            out.exp_golomb(q - 1, order)
        else:
            out.raw(wire.view(uint_type), 8 * wire.itemsize)
    return out.to_bytes()


def decode_topk(data: bytes, positions: int, vocab_size: int, max_k: int | None = None) -> TopK:
    """Inverse of :func:`encode_topk`, validating every field a peer could get wrong.

    ``max_k``: the most tokens per position the request allowed (its K, or its adaptive cap);
    a count above it is refused before anything is allocated for it. Memory stays within a small
    multiple of the input and the decoded top-K (which the counts bound by the stream's length).
    """
    if not 1 <= vocab_size <= 1 << 28:
        raise BadTensor(f"vocabulary size {vocab_size} is out of range")
    limit = vocab_size if max_k is None else min(max_k, vocab_size)
    reader = _BitReader(data)
    codec = reader.fixed(2, "the codec field")
    if codec not in _CODEC_IDS.values():
        raise BadTensor(f"unknown value codec {codec}")
    counts, epsilons, id_parts, value_parts = [], [], [], []
    for j in range(positions):
        k = reader.fixed(_id_width(vocab_size), "a count") + 1
        if k > limit:
            raise BadTensor(
                f"position {j}: K = {k} exceeds the vocabulary of {vocab_size}"
                if k > vocab_size
                else f"position {j}: K = {k} exceeds the {limit} the request allowed"
            )
        epsilon = reader.fixed(16, "an epsilon") / EPS_SCALE
        ids = reader.exp_golomb(k, reader.fixed(ORDER_BITS, "an order"), "the ids")  # gaps, turned into ids in place
        # a gap of |V| or more leaves the vocabulary at once; with every gap below |V| <= 2**28 and K <= |V|, the
        # running sum stays far inside int64 (gaps of up to 2**52 used to wrap it past the last id's check)
        if int(ids.max()) >= vocab_size:
            raise BadTensor(f"position {j}: a top-K id is outside the vocabulary of {vocab_size}")
        ids += 1
        np.cumsum(ids, out=ids)
        ids -= 1
        if int(ids[-1]) >= vocab_size:
            raise BadTensor(f"position {j}: a top-K id is outside the vocabulary of {vocab_size}")
        upper = 1.0  # largest value allowed: rounding to the step may overshoot 1 by s/2
        if codec == 0:
            step = 2.0 ** (-reader.fixed(STEP_BITS, "a step") / 4.0)
            upper += step / 2
            values = reader.exp_golomb(k, reader.fixed(ORDER_BITS, "an order"), "the values").astype(np.float64)
            values += 1.0
            values *= step
        else:
            with np.errstate(invalid="ignore"):  # NaN bit patterns are refused just below
                values = reader.raw(k, _WIRE_FLOATS[codec], "the values").astype(np.float64)
        if not np.isfinite(values).all() or (values < 0).any() or (values > upper).any():
            raise BadTensor(f"position {j}: top-K probabilities must be finite and in [0, 1]")
        # ‖p − p̃‖₁ <= ε and Σp = 1 imply |Σp̃ − 1| <= ε: a reply breaking it misreports ε
        if abs(float(values.sum()) - 1.0) > epsilon + MASS_SLACK:
            raise BadTensor(
                f"position {j}: top-K mass {float(values.sum()):.6f} is inconsistent with ε = {epsilon:.6f}"
            )
        counts.append(k)
        epsilons.append(epsilon)
        id_parts.append(ids.astype(np.int32))  # ids < |V| <= 2**28; widened once, at the end
        value_parts.append(values.astype(np.float32))  # what TopK keeps
    reader.finish()
    return TopK(
        vocab_size=vocab_size,
        counts=torch.tensor(counts, dtype=torch.long),
        ids=torch.from_numpy(np.concatenate(id_parts, dtype=np.int64) if id_parts else np.zeros(0, np.int64)),
        probs=torch.from_numpy(np.concatenate(value_parts) if value_parts else np.zeros(0)).float(),
        epsilon=torch.tensor(epsilons, dtype=torch.float32),
    )
