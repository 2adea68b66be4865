"""``splitspec cloud serve``: the untrusted trunk server's command (its arguments and the config they make)."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from splitspec.arguments import (
    add_compile_args,
    add_connection_limit_args,
    add_split_args,
    add_wire_codecs,
    port_number,
    positive_int,
    read_token_file,
)
from splitspec.exceptions import ConfigError
from splitspec.models.prepack_choices import PREPACK_CHOICES


def _run_serve(args: argparse.Namespace) -> int:
    from splitspec.cloud.config import CloudConfig
    from splitspec.cloud.server import serve_forever

    config = CloudConfig(
        model_dir=args.model,
        edge_layers=args.edge_layers,
        host=args.host,
        port=args.port,
        auth_token=read_token_file(args.token_file),
        session_ttl_s=args.session_ttl,
        max_sessions=args.max_sessions,
        max_sessions_per_connection=args.max_sessions_per_connection,
        max_sessions_per_address=args.max_sessions_per_address,
        kv_budget_mb=args.kv_budget_mb,
        evict_idle_s=args.evict_idle,
        kv_block_tokens=args.kv_block,
        batching=not args.no_batching,
        max_batch_steps=args.max_batch_steps,
        prefill_chunk_tokens=args.prefill_chunk,
        batch_gather=args.batch_gather,
        prepack=args.prepack,
        compute_on=args.compute_on,
        handshake_timeout_s=args.handshake_timeout,
        max_connections_per_address=args.max_connections_per_address,
        max_message_bytes=args.max_message_mb * 1024 * 1024,
        dtype=args.dtype,
        wire_codecs=args.wire_codecs,
        quantize=args.quantize,
        device=args.device,
        devices=tuple(args.devices.split(",")) if args.devices else (),
        torch_threads=args.threads,
        tls_cert_file=args.tls_cert,
        tls_key_file=args.tls_key,
        compile=args.compile,
        max_cache_tokens=args.max_cache_tokens,
    )
    if args.ray_replicas is not None:
        if args.ray_cpus_per_replica <= 0:
            raise ConfigError(f"--ray-cpus-per-replica must be positive, got {args.ray_cpus_per_replica}")
        from splitspec.cloud.ray_serve import serve_on_ray

        serve_on_ray(
            config,
            args.ray_replicas,
            address=args.ray_address,
            cpus_per_replica=args.ray_cpus_per_replica,
            gpus_per_replica=args.ray_gpus_per_replica,
        )
        return 0
    if args.ray_address is not None:
        raise ConfigError("--ray-address needs --ray-replicas")
    if args.ray_cpus_per_replica != 1.0:
        raise ConfigError("--ray-cpus-per-replica needs --ray-replicas")
    if args.ray_gpus_per_replica is not None:
        raise ConfigError("--ray-gpus-per-replica needs --ray-replicas")
    asyncio.run(serve_forever(config))
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    cloud = sub.add_parser("cloud", help="the untrusted trunk server")
    cloud_sub = cloud.add_subparsers(dest="cloud_command", required=True)
    p = cloud_sub.add_parser("serve", help="serve the middle layers of a model")
    add_split_args(p)
    add_wire_codecs(p)
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=port_number, default=8765, help="TCP port (default 8765; 0 picks one)")
    p.add_argument(
        "--session-ttl", type=float, default=300.0, help="idle seconds before a session is dropped (default 300)"
    )
    p.add_argument("--max-sessions", type=int, default=64, help="concurrent sessions (default 64)")
    p.add_argument(
        "--max-sessions-per-connection", type=int, default=4, help="sessions one connection may hold (default 4)"
    )
    p.add_argument(
        "--max-sessions-per-address",
        type=int,
        default=32,
        help="sessions all connections from one IP address may hold (default 32)",
    )
    p.add_argument(
        "--kv-budget-mb",
        type=float,
        help="KV cache memory of all sessions, MiB; when full, idle sessions are evicted (least recently used "
        "first) and steps get a 'capacity' refusal (default: 40%% of the memory available at start-up)",
    )
    p.add_argument(
        "--evict-idle",
        type=float,
        default=1.0,
        help="seconds a session must have been idle before a full KV budget may evict it (default 1)",
    )
    p.add_argument(
        "--kv-block",
        type=int,
        default=16,
        help="a session's KV cache grows in blocks of this many entries: it holds at most one block beyond "
        "its tokens (default 16)",
    )
    p.add_argument(
        "--no-batching",
        action="store_true",
        help="run each session's step alone on a thread pool instead of batching steps across sessions",
    )
    p.add_argument(
        "--max-batch-steps", type=int, default=64, help="most decode/draft steps in one batched forward (default 64)"
    )
    p.add_argument(
        "--batch-gather",
        type=float,
        default=0.5,
        metavar="FRACTION",
        help="a free batch worker waits up to this fraction of a decode batch's forward time for the next steps "
        "of the active sessions due meanwhile (each one its last measured away time after its last reply), so "
        "they run in one batch rather than two (default 0.5; 0 = start at once; a lone session never waits)",
    )
    p.add_argument(
        "--prepack",
        choices=PREPACK_CHOICES,
        default="auto",
        help="prepack the trunk's linear weights for oneDNN once at load: batched forwards on a CPU ran 1.3-1.5x "
        "faster than with PyTorch's default matmul (auto, the default: for a batching float32 trunk wholly on "
        "the CPU, each layer shape that runs faster packed on this CPU, timed at load; on: every one, required; "
        "off: PyTorch's default)",
    )
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=256,
        help="most tokens of a big prefill run per batching iteration (default 256); while decode steps are "
        "flowing a chunk is cut to about one decode batch's time, so a prefill never stalls them",
    )
    add_connection_limit_args(p)
    p.add_argument("--max-message-mb", type=positive_int, default=16, help="largest accepted message, MiB (default 16)")
    p.add_argument("--tls-cert", type=Path, help="PEM certificate chain: serve wss:// (TLS)")
    p.add_argument("--tls-key", type=Path, help="PEM private key for --tls-cert")
    p.add_argument(
        "--devices",
        metavar="DEV,DEV,...",
        help="split the trunk's layers over several devices in contiguous runs, e.g. cuda:0,cuda:1 (replaces --device)",
    )
    add_compile_args(p, "the trunk's (with --no-batching)")
    p.add_argument(
        "--ray-replicas",
        type=int,
        metavar="N",
        help="serve the trunk as a Ray Serve deployment of N replicas behind Ray's HTTP proxy on --host/--port "
        "(needs pip install 'splitspec[cluster]'); edges connect as to a plain server",
    )
    p.add_argument(
        "--ray-address",
        metavar="ADDR",
        help="with --ray-replicas: the Ray cluster to join (auto, or the HOST:6379 that ray start --head prints; "
        "default: start a Ray instance on this machine)",
    )
    p.add_argument(
        "--ray-cpus-per-replica",
        type=float,
        default=1.0,
        help="with --ray-replicas: CPUs Ray reserves for each replica (default 1; fractions allowed)",
    )
    p.add_argument(
        "--ray-gpus-per-replica",
        type=float,
        help="with --ray-replicas: GPUs Ray reserves for each replica, which it sees as cuda:0, ... (default: 1 with "
        "--device cuda or cuda:N, or auto where this machine has a CUDA GPU; each CUDA device of --devices; 0 on "
        "the CPU; fractions such as 0.5 put several replicas on one GPU, each with that share of the default KV "
        "budget: docs/ray-serve.md)",
    )
    p.set_defaults(run=_run_serve)
