"""``splitspec serve --workers N``: N server processes on one port, and a supervisor over them.

One process runs one edge engine: its event loop, its head, tail and draft workers, all under one
Python interpreter lock, so on a CPU it tops out before the cores do. With ``--workers N`` the
parent starts N worker processes (``spawn``: no forked torch threads), each with its own runtime,
engine, session pool and trunk connections, each listening on the same port with
``SO_REUSEPORT``: the kernel spreads new connections over them (Linux only; elsewhere the option
is refused). Requests batch within a worker, not across workers, and each worker's ``/metrics``,
prefix cache and ``--max-active`` are its own (the limit is per worker). A scrape of ``/metrics``
reaches one worker, whichever the kernel picks: every sample carries ``worker="i"`` (the worker's
index, kept by a restarted worker), so the series of different workers never mix and a restart
reads as the counter reset it is.

The supervisor claims the port first (:func:`claim_port`): the workers' SO_REUSEPORT would let a
second ``serve --workers`` on the same port join them silently, the kernel splitting connections
between two servers; it is refused at once instead. Each worker watches the supervisor and stops
(gracefully) when it is gone, even SIGKILLed: no orphan keeps serving with nobody to stop it.

The supervisor restarts a worker that dies after it came up (accepted connections); one that dies
before (it cannot load its model, cannot bind, cannot reach what it needs) stops them all, with
exit status 1: starting it again would fail again.
SIGINT and SIGTERM stop every worker (uvicorn's graceful shutdown) and the supervisor returns 130
(an interrupt, as a single-process ``serve`` does) or 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Event as EventType
from types import FrameType

from splitspec.exceptions import ConfigError
from splitspec.serve.config import ServeConfig
from splitspec.serve.server import listen_socket

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 30.0  # seconds each worker gets to finish after SIGTERM before it is killed
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s [worker %(process)d] %(message)s"
CLAIM_NAME = "splitspec-serve-port-{port}"  # the abstract Unix socket a supervisor holds for its port


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) with SO_REUSEPORT, listening: one per worker, same port."""
    if not sys.platform.startswith("linux") or not hasattr(socket, "SO_REUSEPORT"):
        raise ConfigError("--workers above 1 needs SO_REUSEPORT load balancing, which only Linux provides")
    return listen_socket(host, port, reuse_port=True)


def resolve_port(host: str, port: int) -> int:
    """``port``, or for 0 a free one the workers can all bind (picked once, by the supervisor)."""
    if port != 0:
        return port
    probe = reuse_port_socket(host, 0)
    try:
        return int(probe.getsockname()[1])
    finally:
        probe.close()


def claim_port(port: int) -> socket.socket:
    """Hold ``port`` for one supervisor's workers, or a :class:`ConfigError` when another supervisor holds it.

    SO_REUSEPORT admits any socket of the same user that sets it too, so the workers' own sockets cannot
    refuse a second ``serve --workers`` on their port. The claim is an abstract Unix socket named after
    the port (Linux, as SO_REUSEPORT; in the port's network namespace): only one process can bind a name,
    and the kernel frees it when that process ends, however it ends. The workers do not inherit it.
    """
    claim = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        claim.bind("\0" + CLAIM_NAME.format(port=port))
    except OSError as exc:
        claim.close()
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(f"cannot listen on port {port}: another splitspec serve --workers serves it") from None
        raise ConfigError(f"cannot claim port {port} for the workers: {exc.strerror or exc}") from None
    return claim


def _stop_orphan() -> None:
    """The supervisor is gone: stop as it would have stopped us (SIGTERM: uvicorn's graceful shutdown), or die."""
    log.warning("the supervisor is gone: stopping")
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(STOP_TIMEOUT_S)
    os._exit(1)


def watch_parent(sentinel: int, on_gone: Callable[[], None] = _stop_orphan) -> threading.Thread:
    """Call ``on_gone`` (on a daemon thread) once ``sentinel`` is readable: the parent process's sentinel (the read
    end of a pipe the parent holds the other end of) is when the parent has ended, SIGKILLed included."""

    def watch() -> None:
        multiprocessing.connection.wait([sentinel])
        on_gone()

    thread = threading.Thread(target=watch, name="supervisor-watch", daemon=True)
    thread.start()
    return thread


def _worker_main(config: ServeConfig, log_level: str, threads: int | None, ready: EventType) -> None:
    """One worker process: the single-process server on a SO_REUSEPORT socket of its own, while the supervisor lives."""
    parent = multiprocessing.parent_process()
    if parent is not None:
        watch_parent(parent.sentinel)
    import torch

    from splitspec.serve.server import serve_forever

    logging.basicConfig(level=log_level, format=LOG_FORMAT)
    logging.getLogger("websockets").setLevel(max(logging.WARNING, logging.getLevelName(log_level)))
    if threads is not None:
        torch.set_num_threads(threads)
    sock = reuse_port_socket(config.host, config.port)
    with contextlib.suppress(KeyboardInterrupt):  # a terminal's Ctrl-C reaches every worker: uvicorn shut down
        asyncio.run(serve_forever(config, log_level.lower(), sockets=[sock], on_started=ready.set))


class Supervisor:
    """Starts ``workers`` server processes and keeps them running until stopped."""

    def __init__(self, config: ServeConfig, workers: int, log_level: str = "INFO", threads: int | None = None) -> None:
        if workers < 2:
            raise ConfigError(f"a supervisor runs 2 workers or more, got {workers}")
        self.config = config
        self.workers = workers
        self.log_level = log_level
        self.threads = threads
        self._context = multiprocessing.get_context("spawn")
        self._procs: list[BaseProcess | None] = [None] * workers
        self._ready: list[EventType | None] = [None] * workers  # set by the worker once it accepts connections
        self._stop_signal: int | None = None

    def _start(self, index: int) -> None:
        ready = self._context.Event()
        proc = self._context.Process(
            target=_worker_main,
            args=(dataclasses.replace(self.config, worker=index), self.log_level, self.threads, ready),
            name=f"splitspec-serve-{index}",
            daemon=False,
        )
        proc.start()
        self._procs[index] = proc
        self._ready[index] = ready

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._stop_signal = signum

    def run(self) -> int:
        """Serve until SIGINT or SIGTERM (130 or 0), or until a worker cannot start (1).

        Raises :class:`ConfigError` when another supervisor serves the port."""
        claim = claim_port(self.config.port)
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            for index in range(self.workers):
                self._start(index)
            log.info("%d workers serving on http://%s:%d/v1", self.workers, self.config.host, self.config.port)
            while self._stop_signal is None:
                live = [p for p in self._procs if p is not None]
                multiprocessing.connection.wait([p.sentinel for p in live], timeout=0.5)
                for index, proc in enumerate(self._procs):
                    if proc is None or proc.is_alive() or self._stop_signal is not None:
                        continue
                    ready = self._ready[index]
                    if ready is None or not ready.is_set():
                        log.error("worker %d exited (status %s) while starting: stopping", index, proc.exitcode)
                        return 1  # (finally: the others are stopped)
                    log.error("worker %d exited (status %s): restarting it", index, proc.exitcode)
                    self._start(index)
            return 130 if self._stop_signal == signal.SIGINT else 0
        finally:
            self._stop_all()
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            claim.close()

    def _stop_all(self) -> None:
        live = [p for p in self._procs if p is not None and p.is_alive()]
        for proc in live:
            proc.terminate()  # SIGTERM: uvicorn closes its sockets and finishes the requests in flight
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for proc in live:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                log.warning("worker %s did not stop in %.0f s: killed", proc.name, STOP_TIMEOUT_S)
                proc.kill()
                proc.join()
