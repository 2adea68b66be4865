"""Sans-I/O wire protocol: frames, tensor codec, typed messages and their validation.

Nothing in this package imports asyncio, websockets or transformers (a test checks it). It turns
bytes into typed messages and back; the transport moves the bytes.
"""

from splitspec.protocol.frames import (
    DTYPES,
    MAGIC,
    PROTOCOL_VERSION,
    decode_frame,
    encode_frame,
)
from splitspec.protocol.messages import (
    CacheCommand,
    CloseSession,
    Error,
    Hello,
    Message,
    OpenSession,
    SessionClosed,
    SessionOpened,
    Step,
    StepResult,
    Welcome,
    decode_message,
    encode_message,
)

__all__ = [
    "DTYPES",
    "MAGIC",
    "PROTOCOL_VERSION",
    "CacheCommand",
    "CloseSession",
    "Error",
    "Hello",
    "Message",
    "OpenSession",
    "SessionClosed",
    "SessionOpened",
    "Step",
    "StepResult",
    "Welcome",
    "decode_frame",
    "decode_message",
    "encode_frame",
    "encode_message",
]
