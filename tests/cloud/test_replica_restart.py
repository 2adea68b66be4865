"""A trunk replica whose compute was stopped serves again at its next connection, and its Starlette socket turns
a send after the close into SocketClosed, as the connection loop expects."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from starlette.types import Message
from starlette.websockets import WebSocket

from splitspec.cloud.config import CloudConfig
from splitspec.cloud.ray_serve import TrunkReplica, _StarletteSocket
from splitspec.protocol.messages import Step
from splitspec.transport.server import SocketClosed


@pytest.mark.parametrize("batching", [False, True])
async def test_a_stopped_replica_serves_steps_again(batching: bool, make_checkpoint: Callable[..., Path]) -> None:
    """Without batching the step pool was made once, in the constructor, and shut down by stop_compute: after
    TrunkReplica.stop() and a new connection every step failed "cannot schedule new futures after shutdown"
    while /health answered 200."""
    config = CloudConfig(model_dir=make_checkpoint("llama"), torch_threads=1, batching=batching)
    replica = TrunkReplica(config, name="r")
    server = replica.server
    replica._start_compute()
    await replica.stop()
    replica._start_compute()  # what the next connect() does
    try:
        session = server.sessions.open(0, "127.0.0.1")
        q = 3
        hidden = torch.randn(1, q, server.identity.hidden_size, dtype=server.dtype)
        step = Step(session.session_id, 1, hidden, torch.arange(q, dtype=torch.int32), torch.arange(-1, q - 1).int())
        result = await server.run_step(step, 0)
        assert result.hidden.shape == (1, q, server.identity.hidden_size)
        assert server.metrics.health()[0] == 200
    finally:
        await replica.stop()


async def test_a_send_after_the_close_raises_socket_closed() -> None:
    """Starlette raises RuntimeError (WebSocketDisconnected) on a send after the close, e.g. a concurrent step's
    reply after another frame's refusal closed the connection: it escaped the SocketClosed handling."""
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "websocket.connect"}

    async def send(message: Message) -> None:
        sent.append(message)

    websocket = WebSocket({"type": "websocket", "path": "/", "headers": [], "query_string": b""}, receive, send)
    await websocket.accept()
    socket = _StarletteSocket(websocket)
    await socket.send(b"reply")
    await socket.close(1008, "refused")
    with pytest.raises(SocketClosed):
        await socket.send(b"a late reply")
    await socket.close(1008, "refused")  # closing twice is a no-op, not a RuntimeError
    assert [m["type"] for m in sent] == ["websocket.accept", "websocket.send", "websocket.close"]
