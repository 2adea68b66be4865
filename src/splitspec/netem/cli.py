"""The splitspec netem subcommand: run the WAN emulator in front of a server.

Example: put 80 ms of round-trip time, 5 ms of jitter and a 100 Mbit/s link in front of a trunk
server listening on port 8765, and point the edge at port 9000::

    splitspec netem --listen 127.0.0.1:9000 --upstream 127.0.0.1:8765 --rtt-ms 80 \\
        --jitter-ms 5 --bandwidth-mbit 100 --seed 1

The main CLI wires this in with :func:`register`, which sets ``run=run`` on the subparser like the
other subcommands; ``splitspec netem ...`` runs it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging

from splitspec.exceptions import ConfigError
from splitspec.netem.emulator import WanEmulator
from splitspec.netem.schedule import NetemConfig

__all__ = ["build_config", "parse_hostport", "register", "run"]

logger = logging.getLogger(__name__)


def parse_hostport(text: str, *, allow_zero_port: bool = False) -> tuple[str, int]:
    """Parse ``host:port`` or ``[v6addr]:port`` into ``(host, port)``."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not host:
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not port_text.isdigit():
        raise ValueError(f"port must be a number, got {port_text!r}")
    port = int(port_text)
    low = 0 if allow_zero_port else 1
    if not low <= port <= 65535:
        raise ValueError(f"port must be in {low}..65535, got {port}")
    return host, port


def _listen_arg(text: str) -> tuple[str, int]:
    try:
        return parse_hostport(text, allow_zero_port=True)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _upstream_arg(text: str) -> tuple[str, int]:
    try:
        return parse_hostport(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--listen",
        type=_listen_arg,
        default=("127.0.0.1", 9000),
        metavar="HOST:PORT",
        help="address to listen on (port 0 = any free port; default 127.0.0.1:9000)",
    )
    parser.add_argument(
        "--upstream",
        type=_upstream_arg,
        required=True,
        metavar="HOST:PORT",
        help="server to forward to, e.g. 127.0.0.1:8765",
    )
    parser.add_argument("--rtt-ms", type=float, default=0.0, help="added round-trip time, ms (default 0)")
    parser.add_argument(
        "--jitter-ms", type=float, default=0.0, help="jitter per message (burst) and direction, ms (default 0)"
    )
    parser.add_argument(
        "--jitter-distribution",
        choices=("uniform", "normal"),
        default="uniform",
        help="uniform: U(-J, J); normal: N(0, J^2) clipped to ±3J (default uniform)",
    )
    parser.add_argument(
        "--bandwidth-mbit",
        type=float,
        default=None,
        help="link rate per direction, Mbit/s (10^6 bit/s); default unlimited",
    )
    parser.add_argument("--seed", type=int, default=0, help="jitter seed (default 0)")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``netem`` subcommand to ``subparsers`` and set ``run=run`` on it."""
    parser = subparsers.add_parser(
        "netem",
        help="run the WAN emulator (delay, jitter, bandwidth) as a TCP proxy",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    _add_arguments(parser)
    parser.set_defaults(run=run)


def build_config(args: argparse.Namespace) -> NetemConfig:
    """Turn parsed arguments into a :class:`NetemConfig` (raises ConfigError on bad values)."""
    listen_host, listen_port = args.listen
    upstream_host, upstream_port = args.upstream
    bandwidth_bps = None if args.bandwidth_mbit is None else float(args.bandwidth_mbit) * 1e6
    return NetemConfig(
        upstream_host=upstream_host,
        upstream_port=upstream_port,
        listen_host=listen_host,
        listen_port=listen_port,
        rtt_ms=float(args.rtt_ms),
        jitter_ms=float(args.jitter_ms),
        jitter_distribution=args.jitter_distribution,
        bandwidth_bps=bandwidth_bps,
        seed=int(args.seed),
    )


def run(args: argparse.Namespace) -> int:
    """Run the emulator until interrupted. Returns a process exit status."""
    try:
        config = build_config(args)
    except ConfigError as exc:
        logger.error("netem: %s", exc)
        return 2
    try:
        asyncio.run(WanEmulator(config).serve_forever())
    except KeyboardInterrupt:
        logger.info("netem: interrupted, shut down")
    except OSError as exc:
        logger.error("netem: %s", exc)
        return 1
    return 0
