"""The shared error-reply policy of splitspec's servers (sans-I/O)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from splitspec.exceptions import (
    AuthenticationFailed,
    BadMagic,
    BadTensor,
    CapacityExceeded,
    HandshakeMismatch,
    MessageTooLarge,
    ProtocolError,
    UnexpectedMessage,
    error_from_code,
)
from splitspec.protocol.frames import encode_frame
from splitspec.protocol.messages import Error, decode_message, encode_message
from splitspec.protocol.replies import internal_error, is_fatal, refusal


@dataclass
class _Request:
    seq: object = None
    session_id: object = None


@pytest.mark.parametrize(
    ("exc", "ready", "fatal"),
    [
        (AuthenticationFailed("bad token"), True, True),
        (HandshakeMismatch("other model"), True, True),
        (BadTensor("bad ids"), True, False),
        (BadTensor("bad ids"), False, True),  # before the handshake every refusal closes
        (UnexpectedMessage("hello first"), False, True),
    ],
)
def test_fatality(exc: ProtocolError, ready: bool, fatal: bool) -> None:
    assert is_fatal(exc, ready=ready) is fatal
    error = refusal(exc, None, ready=ready)
    assert (error.code, error.message, error.fatal) == (exc.code, str(exc), fatal)


def test_refusal_echoes_well_typed_ids_only() -> None:
    error = refusal(BadTensor("x"), _Request(seq=7, session_id="s1"), ready=True)
    assert (error.seq, error.session_id) == (7, "s1")
    odd = refusal(BadTensor("x"), _Request(seq=True, session_id=3), ready=True)
    assert (odd.seq, odd.session_id) == (None, None)
    assert refusal(BadTensor("x"), None, ready=True).seq is None


def test_internal_error_is_fatal_only_before_the_handshake_and_round_trips() -> None:
    assert internal_error(ValueError("boom"), None, ready=False).fatal
    error = internal_error(ValueError("boom"), _Request(seq=3), ready=True)
    assert (error.code, error.fatal, error.seq) == ("server_error", False, 3)
    assert "ValueError: boom" in error.message
    decoded = decode_message(encode_message(error))
    assert isinstance(decoded, Error)
    assert decoded == error


def test_a_capacity_refusal_carries_its_retry_hint_across_the_wire() -> None:
    error = refusal(CapacityExceeded("full", retry_after_s=0.25), _Request(seq=1, session_id="s"), ready=True)
    back = decode_message(encode_message(error))
    assert isinstance(back, Error)
    assert (back.code, back.retry_after_s, back.fatal) == ("capacity", 0.25, False)
    rebuilt = error_from_code(back.code, back.message, back.retry_after_s)
    assert isinstance(rebuilt, CapacityExceeded)
    assert rebuilt.retry_after_s == 0.25
    assert refusal(BadTensor("x"), None, ready=True).retry_after_s is None


def _step_frame(session_id: object, seq: object) -> bytes:
    return encode_frame({"type": "step", "session_id": session_id, "seq": seq})


def test_a_refusal_of_an_undecodable_frame_echoes_the_ids_its_header_names() -> None:
    """A step the server cannot decode (too large, a bad tensor) is refused naming its session and seq, read
    from the header: a multiplexing edge matches the refusal to that step (it used to reach every open in
    flight instead, and the step waited out its timeout)."""
    error = refusal(MessageTooLarge("too big"), None, ready=True, frame=_step_frame("s1", 4))
    assert (error.session_id, error.seq) == ("s1", 4)
    crash = internal_error(ValueError("boom"), None, ready=True, frame=_step_frame("s2", 5))
    assert (crash.session_id, crash.seq) == ("s2", 5)
    odd = refusal(BadTensor("x"), None, ready=True, frame=_step_frame(["s"], "7"))
    assert (odd.session_id, odd.seq) == (None, None)  # ill-typed ids are not echoed
    unreadable = refusal(BadMagic("x"), None, ready=True, frame=b"JUNK" + bytes(12))
    assert (unreadable.session_id, unreadable.seq) == (None, None)
    # a decoded request's own ids win over its frame's
    decoded = refusal(BadTensor("x"), _Request(seq=1, session_id="s"), ready=True, frame=_step_frame("t", 9))
    assert (decoded.session_id, decoded.seq) == ("s", 1)
