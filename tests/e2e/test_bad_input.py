"""Every kind of bad input gets its typed error, and another session's generation is unharmed."""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from splitspec.cloud.config import CloudConfig
from splitspec.cloud.server import TrunkServer
from splitspec.edge import EdgeConfig, SplitClient
from splitspec.exceptions import AuthenticationFailed, HandshakeMismatch
from splitspec.protocol.frames import MAGIC, encode_frame
from splitspec.protocol.messages import (
    Error,
    Hello,
    OpenSession,
    SessionOpened,
    decode_message,
    encode_message,
)
from splitspec.transport.client import Channel
from tests.conftest import local_greedy
from tests.e2e.test_split_generate import PROMPT

H = 64  # hidden size of the tiny models
CAP = 256 * 1024


def step_frame(
    session_id: str,
    q: int = 1,
    *,
    hidden: torch.Tensor | None = None,
    positions: list[int] | None = None,
    **header: object,
) -> bytes:
    tensors = {
        "hidden": torch.zeros(1, q, H) if hidden is None else hidden,
        "positions": torch.tensor(positions if positions is not None else list(range(q)), dtype=torch.int32),
        "parents": torch.arange(-1, q - 1, dtype=torch.int32),
    }
    return encode_frame({"type": "step", "session_id": session_id, "seq": 1, **header}, tensors)


def with_descriptor(frame: bytes, **changes: object) -> bytes:
    """Rewrite the first tensor descriptor of a frame's header."""
    (header_len,) = struct.unpack_from(">I", frame, 6)
    header = json.loads(frame[10 : 10 + header_len])
    header["tensors"][0].update(changes)
    new = json.dumps(header).encode()
    return frame[:6] + struct.pack(">I", len(new)) + new + frame[10 + header_len :]


async def raw_channel(server: TrunkServer, hello: Hello, max_bytes: int = CAP) -> tuple[Channel, str]:
    channel = await Channel.connect(server.url, max_message_bytes=max_bytes, timeout_s=5)
    await channel.request(hello, 5)
    opened, _ = await channel.request(OpenSession(request_id=1), 5)
    assert isinstance(opened, SessionOpened)
    return channel, opened.session_id


async def error_for(channel: Channel, data: bytes) -> Error:
    await channel.send_raw(data)
    reply = decode_message(await channel.recv_raw(5))
    assert isinstance(reply, Error), reply
    return reply


async def test_each_bad_input_gets_its_typed_error_while_another_session_completes(
    make_checkpoint: Callable[..., Path],
) -> None:
    model = make_checkpoint("llama")
    expected = local_greedy(model, PROMPT, 40)
    async with TrunkServer(CloudConfig(model_dir=model, port=0, max_message_bytes=CAP)) as server:
        async with SplitClient(
            EdgeConfig(allow_stock_edge_weights=True, model_dir=model, cloud_url=server.url)
        ) as good:
            good_task = asyncio.create_task(good.generate(PROMPT, 40))
            channel, sid = await raw_channel(server, good.hello)
            await asyncio.sleep(0)
            good_frame = step_frame(sid)
            cases: list[tuple[str, bytes]] = [
                ("malformed_frame", b"SPL"),
                ("malformed_frame", MAGIC + b"\x00\x02" + struct.pack(">I", 5) + b"{not json"),
                ("malformed_frame", good_frame + b"trailing"),
                ("malformed_frame", good_frame[:-3]),
                ("bad_magic", b"XXXX" + good_frame[4:]),
                ("unsupported_version", good_frame[:4] + b"\x00\x63" + good_frame[6:]),
                ("bad_dtype", with_descriptor(good_frame, dtype="complex64")),
                ("bad_tensor", with_descriptor(good_frame, shape=[1, 1, H + 1])),
                ("bad_tensor", step_frame(sid, hidden=torch.zeros(1, 1, H + 8))),  # wrong hidden size
                ("bad_tensor", step_frame(sid, hidden=torch.zeros(1, 1, H, dtype=torch.float16))),
                ("malformed_frame", step_frame(sid, return_layer=2)),  # the edge's own head output, not the trunk's
                ("malformed_frame", step_frame(sid, return_layer=4)),  # the trunk's output: returned anyway
                ("position_out_of_range", step_frame(sid, positions=[5])),  # the session holds 0 tokens
                ("position_out_of_range", step_frame(sid, positions=[4095 + 1])),
                ("unknown_session", step_frame("0123456789abcdef")),
                ("unknown_session", step_frame(good.session_id or "")),  # another connection's session
                ("message_too_large", step_frame(sid, q=CAP // (H * 4) + 8, positions=None)),
                ("unexpected_message", encode_message(good.hello)),  # a second Hello
                ("unexpected_message", encode_message(SessionOpened(request_id=1, session_id=sid))),
            ]
            for code, data in cases:
                error = await error_for(channel, data)
                assert error.code == code, (code, error.message)
                assert not error.fatal
            # the connection and its session survived every refusal
            reply, _ = await channel.request(decode_message(good_frame), 5)
            assert reply.TYPE == "step_result"
            await channel.close()
            result = await good_task
    assert result.token_ids == expected


async def test_auth_is_required_before_anything_is_decoded(make_checkpoint: Callable[..., Path]) -> None:
    model = make_checkpoint("llama")
    config = CloudConfig(model_dir=model, port=0, auth_token="s3cret")
    async with TrunkServer(config) as server:
        for token in (None, "wrong"):
            with pytest.raises(AuthenticationFailed):
                async with SplitClient(
                    EdgeConfig(allow_stock_edge_weights=True, model_dir=model, cloud_url=server.url, auth_token=token)
                ):
                    pass
        # a step before the handshake carries a payload that would fail tensor checks; auth is refused first
        channel = await Channel.connect(server.url, max_message_bytes=CAP, timeout_s=5)
        error = await error_for(channel, with_descriptor(step_frame("x"), nbytes=3))
        assert (error.code, error.fatal) == ("authentication_failed", True)
        await channel.close()
        async with SplitClient(
            EdgeConfig(allow_stock_edge_weights=True, model_dir=model, cloud_url=server.url, auth_token="s3cret")
        ) as client:
            result = await client.generate(PROMPT, 4)
    assert result.token_ids == local_greedy(model, PROMPT, 4)


async def test_handshake_pins_layer_range_and_dtype(make_checkpoint: Callable[..., Path]) -> None:
    model = make_checkpoint("llama")
    async with TrunkServer(CloudConfig(model_dir=model, port=0, edge_layers=(2, 2))) as server:
        with pytest.raises(HandshakeMismatch, match="layer_start"):
            async with SplitClient(
                EdgeConfig(allow_stock_edge_weights=True, model_dir=model, cloud_url=server.url, edge_layers=(1, 2))
            ):
                pass
        with pytest.raises(HandshakeMismatch, match="dtype"):
            async with SplitClient(
                EdgeConfig(allow_stock_edge_weights=True, model_dir=model, cloud_url=server.url, dtype="bfloat16")
            ):
                pass
        other = make_checkpoint("qwen2")
        with pytest.raises(HandshakeMismatch, match="fingerprint"):
            async with SplitClient(EdgeConfig(allow_stock_edge_weights=True, model_dir=other, cloud_url=server.url)):
                pass
