"""The trunk as a Ray Serve deployment: N replicas behind Ray's HTTP proxy (``cloud serve --ray-replicas N``).

Each replica is a :class:`~splitspec.cloud.server.TrunkServer` without its own listener: it loads the
trunk once, in its constructor, and serves the WebSocket connections Ray's proxy routes to it
through the plain server's per-connection loop and limits (:class:`ConnectionGuard`), reading
Starlette's WebSocket through a :class:`FrameSocket` adapter. A connection stays on the replica
that accepted it for its whole life. When that replica dies or is scaled down the connection
closes; the edge reconnects through the proxy, lands on a live replica and replays its session's
history (``edge/client.py``), so its output does not change. Placement, health checks and
restarts are Ray's: a replica that dies, or whose batching loop has stopped (:meth:`TrunkReplica.check_health`),
is replaced by Serve's controller.

Every replica answers the handshake's WebSocket upgrade with the header ``x-splitspec-replica``
(the replica's Ray actor name), so an operator or a test can tell which replica serves a
connection. The proxy's address takes the plain server's place: edges connect to ``ws://HOST:PORT``
as before, and ``GET /metrics`` and ``/health`` answer there too, each from one replica of the
proxy's choice.

Ray is an optional dependency (``pip install 'splitspec[cluster]'``), imported only inside the
functions that start it: importing this module needs only FastAPI.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, WebSocket
from fastapi.responses import Response
from starlette.websockets import WebSocketDisconnect, WebSocketState

from splitspec.arguments import read_token_file
from splitspec.cloud.budget import DEFAULT_BUDGET_FRACTION
from splitspec.cloud.config import CloudConfig, check_config
from splitspec.cloud.server import TrunkServer
from splitspec.exceptions import ConfigError
from splitspec.transport.server import HttpRoute, SocketClosed, warn_if_open, warn_if_unencrypted

log = logging.getLogger(__name__)

REPLICA_HEADER = "x-splitspec-replica"  # the WebSocket upgrade's answer names the replica serving the connection
APP_NAME = "splitspec-trunk"  # the Serve application's name
_MIN_ONGOING = 8  # connections a replica accepts beyond its session cap (for /metrics and /health scrapes)


class _StarletteSocket:
    """A :class:`~splitspec.transport.server.FrameSocket` over a WebSocket Starlette accepted.

    Ray's proxy has already read a frame whole when it arrives here, so the frame caps are checked
    on its length after the fact (the proxy's own cap, 16 MiB, is what bounds the buffering).
    """

    def __init__(self, websocket: WebSocket) -> None:
        self._ws = websocket
        self._max_bytes = 0

    async def recv(self) -> bytes:
        message = await self._ws.receive()
        if message["type"] == "websocket.disconnect":
            raise SocketClosed(f"closed by the client ({message.get('code')})")
        data: bytes | None = message.get("bytes")
        if data is None:
            data = str(message.get("text", "")).encode()
        if len(data) > self._max_bytes:
            await self.close(1009, "message too big")
            raise SocketClosed(f"a frame of {len(data)} bytes exceeds the cap of {self._max_bytes}")
        return data

    async def send(self, data: bytes) -> None:
        # Starlette raises RuntimeError (WebSocketDisconnected since 0.47) on a send after the close: this
        # connection's own, e.g. a concurrent step's reply after another frame's refusal closed it
        if self._ws.application_state != WebSocketState.CONNECTED:
            raise SocketClosed("the connection is closed")
        try:
            await self._ws.send_bytes(data)
        except WebSocketDisconnect as exc:
            raise SocketClosed("closed by the client") from exc
        except RuntimeError as exc:  # Starlette's "Cannot call send once a close message has been sent"
            raise SocketClosed(str(exc)) from exc

    async def close(self, code: int, reason: str) -> None:
        if self._ws.application_state != WebSocketState.CONNECTED:
            return  # closed already (a second close would raise RuntimeError)
        with contextlib.suppress(WebSocketDisconnect):  # the client is gone: nothing to close
            await self._ws.close(code, reason)

    def limit_frames(self, max_bytes: int) -> None:
        self._max_bytes = max_bytes


class TrunkReplica:
    """One replica: a trunk server serving the connections Ray routes to it.

    ``name`` is what the upgrade header reports; None: this replica's Ray actor name (inside Serve).
    Serve ends a stopped replica's process, which is all the cleanup it needs; :meth:`stop` is for
    a replica run outside Serve.
    """

    def __init__(self, config: CloudConfig, name: str | None = None) -> None:
        self.server = TrunkServer(config)  # loads the trunk layers, once per replica
        self.name = _replica_name() if name is None else name
        self.server.metrics.label_samples({"replica": self.name})  # the proxy routes a scrape to any replica
        self._computing = False
        log.info("replica %s: trunk fingerprint %s", self.name, self.server.trunk_fingerprint)

    def _start_compute(self) -> None:
        """The sweep and the batcher start on the loop that serves the connections, at the first one."""
        if not self._computing:
            self.server.start_compute()
            self._computing = True

    async def stop(self) -> None:
        if self._computing:
            await self.server.stop_compute()
            self._computing = False

    def check_health(self) -> None:
        """Ray Serve's health check (called periodically): raises once the replica's batching loop or TTL sweep
        has ended, when every step it is sent would fail, so Serve's controller replaces it."""
        failure = self.server.compute_failure()
        if failure is not None:
            raise RuntimeError(f"replica {self.name}: {failure}")

    async def connect(self, websocket: WebSocket) -> None:
        """Serve one WebSocket connection the proxy routed here, until it closes."""
        self._start_compute()
        client = websocket.client
        remote = f"{client.host}:{client.port}" if client is not None else "?"
        address = client.host if client is not None else "?"
        await websocket.accept(headers=[(REPLICA_HEADER.encode(), self.name.encode())])
        await self.server.guard.serve(_StarletteSocket(websocket), self.server.new_peer, remote, address)

    def answer(self, route: HttpRoute) -> Response:
        """A plain HTTP answer of the trunk's (``/metrics``, ``/health``), naming this replica."""
        status, content_type, body = route()
        return Response(body, status_code=status, media_type=content_type, headers={REPLICA_HEADER: self.name})


def this_replica() -> TrunkReplica:
    """The replica running this code, inside Serve."""
    from ray import serve

    replica = serve.get_replica_context().servable_object
    if not isinstance(replica, TrunkReplica):
        raise TypeError(f"the Serve replica runs {type(replica).__name__}, not a TrunkReplica")
    return replica


def trunk_asgi_app(replica: Callable[[], TrunkReplica] = this_replica) -> FastAPI:
    """The replica's routes: the trunk's WebSocket at ``/``, ``GET /metrics`` and ``GET /health``.

    Serve builds it on each replica (a builder rather than a module-level app with class-method
    routes: Serve pickles the ingress app, and a module-level one would reach the replicas by
    reference, without the routes' binding to the replica). ``replica`` finds the replica serving
    a request; outside Serve, any ASGI server can run the app for a replica of one's own.
    """
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

    @app.websocket("/")
    async def connect(websocket: WebSocket) -> None:
        await replica().connect(websocket)

    @app.get("/metrics")
    def metrics() -> Response:
        serving = replica()
        return serving.answer(serving.server.metrics.render)

    @app.get("/health")
    def health() -> Response:
        serving = replica()
        return serving.answer(serving.server.metrics.health)

    return app


def _replica_name() -> str:
    """This replica's Ray actor name (what ``ray.get_actor(name, namespace="serve")`` finds)."""
    from ray import serve

    name: str = serve.get_replica_context().replica_id.to_full_id_str()
    return name


def _ray_serve() -> Any:
    """``ray.serve``, or a clear error when the optional extra is missing."""
    try:
        from ray import serve
    except ImportError:
        raise ConfigError("serving on Ray needs Ray Serve: pip install 'splitspec[cluster]'") from None
    return serve


def trunk_application(
    config: CloudConfig, replicas: int, cpus_per_replica: float = 1.0, gpus_per_replica: float | None = None
) -> Any:
    """The Serve application of ``replicas`` trunk replicas (a ``ray.serve.Application``, for ``serve.run``).

    The trunk's checks that need no model are made here, once, before Ray starts a replica: a bad
    value is one :class:`ConfigError`, not a failure in each replica (or Serve's own validation error).
    Ray reserves ``cpus_per_replica`` CPUs and ``gpus_per_replica`` GPUs for each replica (None:
    :func:`default_gpus_per_replica`); with the KV budget left to its default, each replica takes
    :func:`replica_budget_share` of it.
    """
    check_config(config)
    if replicas < 1:
        raise ConfigError(f"--ray-replicas must be at least 1, got {replicas}")
    if not (math.isfinite(cpus_per_replica) and cpus_per_replica >= 0):
        raise ConfigError(f"--ray-cpus-per-replica must be a finite number >= 0, got {cpus_per_replica}")
    gpus = default_gpus_per_replica(config) if gpus_per_replica is None else gpus_per_replica
    if not (math.isfinite(gpus) and gpus >= 0):
        raise ConfigError(f"--ray-gpus-per-replica must be a finite number >= 0, got {gpus}")
    _check_visible_gpus(config, gpus)
    share = 1.0 if config.kv_budget_mb is not None else replica_budget_share(config, replicas, gpus)
    if share < 1:
        log.info(
            "each replica's default KV budget: %.3g of %.0f %% of the memory available at its start "
            "(--kv-budget-mb to choose; docs/ray-serve.md)",
            share,
            DEFAULT_BUDGET_FRACTION * 100,
        )
    serve = _ray_serve()
    deployment = serve.deployment(
        name="trunk",
        num_replicas=replicas,
        # a WebSocket connection is one request for its whole life: admit as many as the sessions
        max_ongoing_requests=config.max_sessions + _MIN_ONGOING,
        # GPUs reserved: Ray sets each replica's CUDA_VISIBLE_DEVICES to its own (with none it leaves the
        # variable alone, and every replica on a node would run on cuda:0)
        ray_actor_options={"num_cpus": cpus_per_replica, "num_gpus": gpus},
    )(serve.ingress(trunk_asgi_app)(TrunkReplica))
    # the replicas listen nowhere: host, port and TLS are the proxies' (see serve_on_ray), so a
    # replica reads no certificate and does not warn about a secret sent in the clear
    return deployment.bind(
        dataclasses.replace(config, host="127.0.0.1", tls_cert_file=None, tls_key_file=None, kv_budget_share=share)
    )


def _device_names(config: CloudConfig) -> list[str]:
    return [name.strip().lower() for name in (config.devices or (config.device,))]


def _trunk_on_cuda(config: CloudConfig) -> bool:
    """Whether the trunk runs wholly on CUDA devices (``auto``: where this machine has one)."""
    names = _device_names(config)
    if names == ["auto"]:
        return bool(torch.cuda.is_available())
    return all(name == "cuda" or name.startswith("cuda:") for name in names)


def default_gpus_per_replica(config: CloudConfig) -> float:
    """``--ray-gpus-per-replica``'s default: the CUDA devices one replica's trunk names (``--device cuda`` or
    ``cuda:N``: 1; ``--devices``: each CUDA one; ``auto``: 1 where the machine building the application has a
    CUDA GPU), else 0 (a CPU trunk)."""
    names = _device_names(config)
    if names == ["auto"]:
        return 1.0 if _trunk_on_cuda(config) else 0.0
    return float(sum(name == "cuda" or name.startswith("cuda:") for name in names))


def _check_visible_gpus(config: CloudConfig, gpus: float) -> None:
    """Refuse a CUDA index a replica cannot see: Ray makes a replica's reserved GPUs its cuda:0, cuda:1, ..."""
    if gpus <= 0:
        return  # no GPU reserved: Ray leaves CUDA_VISIBLE_DEVICES alone, every GPU of the node is visible
    visible = math.ceil(gpus)
    for name in _device_names(config):
        index = name.partition(":")[2]
        if name.startswith("cuda:") and index.isdigit() and int(index) >= visible:
            raise ConfigError(
                f"device {name!r}: a Ray replica sees only the GPUs Ray reserves for it ({gpus:g}, "
                f"--ray-gpus-per-replica), as cuda:0 to cuda:{visible - 1}"
            )


def replica_budget_share(config: CloudConfig, replicas: int, gpus_per_replica: float) -> float:
    """The share of the default KV budget (40 % of the memory available at start) each replica takes.

    A trunk on CUDA with ``gpus_per_replica`` >= 1 has its GPUs to itself: 1. With a fraction g of a GPU,
    up to 1/g replicas share that GPU: g. Otherwise (a CPU trunk, or GPUs not reserved) Ray does not divide a
    host's memory between the replicas it places there, and all of them may land on one: 1 / replicas.
    """
    if replicas == 1:
        return 1.0
    if gpus_per_replica > 0 and _trunk_on_cuda(config):
        return min(1.0, gpus_per_replica)
    return 1.0 / replicas


# CloudConfig fields a Serve config file may not set: the proxies' http_options hold host, port and TLS (the
# secret is token_file's); kv_budget_share is trunk_application's to set (replica_budget_share)
_RESERVED_FIELDS = frozenset({"host", "port", "tls_cert_file", "tls_key_file", "auth_token", "kv_budget_share"})


def build_app(args: dict[str, Any]) -> Any:
    """The application builder of a Serve config file (``import_path: splitspec.cloud.ray_serve:build_app``).

    ``args``: ``replicas`` (default 1), ``cpus_per_replica`` (1.0), ``gpus_per_replica`` (default:
    :func:`default_gpus_per_replica`), ``token_file`` (the shared
    secret's file, read where Serve builds the application) and any :class:`CloudConfig` field by
    name, ``model_dir`` required (``edge_layers``, ``devices`` and ``wire_codecs`` as lists). Where the proxies
    listen, and their TLS, is the file's ``http_options``. See deploy/ray-serve.yaml.
    """
    options = dict(args)
    replicas = int(options.pop("replicas", 1))
    cpus_per_replica = float(options.pop("cpus_per_replica", 1.0))
    gpus = options.pop("gpus_per_replica", None)
    gpus_per_replica = None if gpus is None else float(gpus)
    token_file = options.pop("token_file", None)
    fields = {field.name for field in dataclasses.fields(CloudConfig)} - _RESERVED_FIELDS
    unknown = sorted(set(options) - fields)
    if unknown:
        raise ConfigError(f"unknown trunk options {unknown} in the Serve config's args (known: {sorted(fields)})")
    if "model_dir" not in options:
        raise ConfigError("the Serve config's args need model_dir (the checkpoint directory on every node)")
    options["model_dir"] = Path(options["model_dir"])
    for name in ("edge_layers", "devices", "wire_codecs"):
        if name in options:
            options[name] = tuple(options[name])
    config = CloudConfig(**options, auth_token=read_token_file(None if token_file is None else Path(token_file)))
    return trunk_application(config, replicas, cpus_per_replica, gpus_per_replica)


def serve_on_ray(
    config: CloudConfig,
    replicas: int,
    *,
    address: str | None = None,
    cpus_per_replica: float = 1.0,
    gpus_per_replica: float | None = None,
) -> None:
    """Deploy the trunk on Ray (a local instance when ``address`` is None) and serve until SIGINT/SIGTERM.

    Ray's HTTP proxy listens on ``config.host:config.port`` (with TLS when the config has a
    certificate), on every node of the cluster.
    """
    application = trunk_application(config, replicas, cpus_per_replica, gpus_per_replica)
    import ray
    from ray import serve

    ray.init(address=address)
    try:
        refuse_running_serve(serve)
        serve.start(http_options=_http_options(config))
        serve.run(application, name=APP_NAME, route_prefix="/")
        scheme = "ws" if config.tls_cert_file is None else "wss"
        url = f"{scheme}://{config.host}:{config.port}"
        log.info("trunk on Ray Serve: %d replicas behind %s", replicas, url)
        warn_if_open(config.auth_token, url, "trunk server")
        warn_if_unencrypted(config.host, scheme == "wss", config.auth_token)
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
        serve.delete(APP_NAME)
    finally:
        ray.shutdown()
    log.info("trunk server stopped")


def refuse_running_serve(serve: Any) -> None:
    """Refuse a cluster whose Ray Serve already runs: it keeps the HTTP options it started with (Ray only
    warns), so ``--host``, ``--port`` and the TLS certificate would be ignored, a TLS trunk served in the
    clear, and the URL logged would be wrong. ``serve`` is the ``ray.serve`` module."""
    status = serve.status()
    if status.proxies or status.applications:
        raise ConfigError(
            "Ray Serve already runs on this cluster and keeps its own HTTP options (host, port, TLS), which "
            "--host, --port and --tls-cert cannot change: stop it (`serve shutdown`) or deploy into it with "
            "`serve deploy deploy/ray-serve.yaml`"
        )


def _http_options(config: CloudConfig) -> dict[str, Any]:
    """Serve's HTTP options: where its proxies listen, with the trunk's TLS certificate if it has one (a half
    pair was refused by :func:`~splitspec.cloud.config.check_config`, in :func:`trunk_application`)."""
    options: dict[str, Any] = {"host": config.host, "port": config.port}
    if config.tls_cert_file is not None and config.tls_key_file is not None:
        options |= {"ssl_certfile": str(config.tls_cert_file), "ssl_keyfile": str(config.tls_key_file)}
    return options
