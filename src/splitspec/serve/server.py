"""Running the app under uvicorn: ``serve_forever`` for the CLI, ``RunningServer`` for tests and
benchmarks (an in-process server on a free port of the current event loop)."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from types import TracebackType

import uvicorn

from splitspec.exceptions import ConfigError
from splitspec.serve.app import create_app
from splitspec.serve.config import ServeConfig
from splitspec.serve.state import ServeState
from splitspec.transport import LOOPBACK_HOSTS

log = logging.getLogger(__name__)


def listen_socket(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """A TCP socket listening on (host, port), bound before the edge loads: a port in use is one line at once.
    ``reuse_port``: with SO_REUSEPORT, so that ``serve --workers`` processes each bind the same port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def warn_if_exposed(config: ServeConfig) -> None:
    """Say at start-up that a server reachable beyond this machine serves prompts and answers to anyone (no
    --api-key-file), and in plain HTTP (a key and the conversations cross the network readable)."""
    if config.host in LOOPBACK_HOSTS:
        return
    if config.api_key is None:
        log.warning(
            "splitspec serve on %s:%d requires NO key: anyone who can reach it can send prompts and read answers "
            "(give clients a key with --api-key-file)",
            config.host,
            config.port,
        )
    log.warning("splitspec serve speaks plain HTTP: put a TLS proxy in front of it beyond a trusted network")


def _uvicorn_config(config: ServeConfig, state: ServeState, log_level: str) -> uvicorn.Config:
    return uvicorn.Config(create_app(state), host=config.host, port=config.port, log_level=log_level,
                          access_log=False, lifespan="on")  # fmt: skip


async def serve_forever(
    config: ServeConfig,
    log_level: str = "info",
    sockets: list[socket.socket] | None = None,
    on_started: Callable[[], None] | None = None,
) -> None:
    """Load the edge, then serve until interrupted (uvicorn handles SIGINT/SIGTERM).

    ``sockets``: listen on these (a worker of ``serve --workers``) instead of binding config's host
    and port; ``on_started``: called once the server accepts connections.
    """
    warn_if_exposed(config)
    state = ServeState(config)
    log.info(
        "serving %s as %r on http://%s:%d/v1 (trunk %s, speculate %s, %d active sessions at most)",
        config.edge.model_dir, config.served_model_name, config.host, config.port,
        config.edge.cloud_url, config.speculate, config.max_active,
    )  # fmt: skip
    server = uvicorn.Server(_uvicorn_config(config, state, log_level))
    serving = asyncio.create_task(server.serve(sockets=sockets))
    while on_started is not None and not server.started and not serving.done():
        await asyncio.sleep(0.02)
    if on_started is not None and server.started:
        on_started()
    await serving


class RunningServer:
    """``async with RunningServer(cfg) as srv:`` serves on ``srv.base_url`` until the block ends."""

    def __init__(self, config: ServeConfig, log_level: str = "warning") -> None:
        self.state = ServeState(config)
        self._server = uvicorn.Server(_uvicorn_config(config, self.state, log_level))
        self._task: asyncio.Task[None] | None = None

    @property
    def port(self) -> int:
        return int(self._server.servers[0].sockets[0].getsockname()[1])

    @property
    def base_url(self) -> str:
        return f"http://{self.state.config.host}:{self.port}/v1"

    async def __aenter__(self) -> RunningServer:
        self._task = asyncio.create_task(self._server.serve())
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises why it could not start
                raise RuntimeError("the HTTP server stopped before it started")
            await asyncio.sleep(0.01)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._server.should_exit = True
        if self._task is not None:
            await self._task
