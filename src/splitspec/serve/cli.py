"""``splitspec serve``: the edge's OpenAI-compatible HTTP server command (its arguments and the config they make)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
from pathlib import Path

from splitspec.arguments import add_edge_link_args, port_number, read_token_file
from splitspec.edge_cli import edge_config
from splitspec.exceptions import ConfigError


def _run_serve(args: argparse.Namespace) -> int:
    from splitspec.models.hub import model_label
    from splitspec.serve.config import ServeConfig
    from splitspec.serve.server import listen_socket, serve_forever

    if args.trunk_sessions_per_connection < 1:
        raise ConfigError(
            f"--trunk-sessions-per-connection must be at least 1, got {args.trunk_sessions_per_connection}"
        )
    edge = dataclasses.replace(
        edge_config(args),
        reconnect_timeout_s=args.reconnect_timeout,
        sessions_per_connection=args.trunk_sessions_per_connection,
    )
    config = ServeConfig(
        edge=edge,
        served_model_name=args.served_model_name or model_label(args.model),
        host=args.host,
        port=args.port,
        api_key=read_token_file(args.api_key_file),
        speculate=args.speculate,
        max_active=args.max_active,
        queue_timeout_s=args.queue_timeout,
        prefix_cache_entries=args.prefix_cache_size,
        prefix_cache_bytes=args.prefix_cache_mb * 1024 * 1024,
        prefix_reuse=not args.no_prefix_reuse,
        chat_template=_read_text(args.chat_template),
        tool_call_parser=args.tool_call_parser,
        generation_config=args.generation_config,
    )
    if args.workers < 1:
        raise ConfigError(f"--workers must be at least 1, got {args.workers}")
    if args.workers > 1:
        from splitspec.serve.workers import Supervisor, resolve_port

        config = dataclasses.replace(config, port=resolve_port(config.host, config.port))
        return Supervisor(config, args.workers, args.log_level, args.threads).run()
    listener = listen_socket(config.host, config.port)  # before the edge loads: a port in use fails at once
    config = dataclasses.replace(config, port=int(listener.getsockname()[1]))
    try:
        asyncio.run(serve_forever(config, args.log_level.lower(), sockets=[listener]))
    finally:
        listener.close()
    return 0


def _read_text(path: Path | None) -> str | None:
    if path is None:
        return None
    try:
        return path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "serve", help="an OpenAI-compatible HTTP server on the edge (chat/completions, completions, responses)"
    )
    add_edge_link_args(p)
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=port_number, default=8000, help="HTTP port (default 8000; 0 picks one)")
    p.add_argument(
        "--served-model-name", help="model id clients send (default: the --model id, or the model directory's name)"
    )
    p.add_argument("--api-key-file", type=Path, help="file holding the bearer key clients must send")
    p.add_argument("--chat-template", type=Path, help="Jinja chat template for a tokenizer that has none")
    p.add_argument(
        "--tool-call-parser",
        choices=("auto", "hermes", "llama3_json"),
        default="auto",
        help="how tool calls are read from the model's text: hermes (<tool_call>{...}</tool_call>: Qwen2.5, Qwen3, "
        'Hermes), llama3_json ({"name", "parameters"}: Llama 3.1+), or auto (the chat template says which)',
    )
    p.add_argument(
        "--generation-config",
        choices=("auto", "vllm"),
        default="auto",
        help="auto: a request that leaves temperature, top_p or top_k unset gets the checkpoint's "
        "generation_config.json values, as vLLM does; vllm: OpenAI's defaults (temperature 1, top_p 1) whatever "
        "the file says (default auto)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="server processes sharing the port (Linux SO_REUSEPORT), each with its own engine, session pool and "
        "--max-active; more than 1 lets a CPU edge use more cores than one interpreter can (default 1)",
    )
    p.add_argument(
        "--max-active", type=int, default=8, help="requests generating at once, one cloud session each (default 8)"
    )
    p.add_argument(
        "--queue-timeout", type=float, default=10.0, help="seconds a request waits for a session, then 429 (default 10)"
    )
    p.add_argument("--prefix-cache-size", type=int, default=16, help="idle conversations kept for reuse (default 16)")
    p.add_argument(
        "--prefix-cache-mb", type=int, default=512, help="edge KV memory of kept conversations, MiB (default 512)"
    )
    p.add_argument("--no-prefix-reuse", action="store_true", help="re-prefill every prompt (for comparison)")
    p.add_argument(
        "--reconnect-timeout", type=float, default=10.0, help="seconds to retry a lost trunk before 503 (default 10)"
    )
    p.add_argument(
        "--trunk-sessions-per-connection",
        type=int,
        default=4,
        help="requests' cloud sessions multiplexed on one trunk connection; more connections open as needed "
        "(at most the trunk's --max-sessions-per-connection, default 4)",
    )
    p.set_defaults(run=_run_serve)
