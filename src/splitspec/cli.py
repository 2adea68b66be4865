"""The splitspec command: one entry point, one subcommand per job.

    splitspec cloud serve --model DIR|ORG/NAME[@REV] [--edge-layers 2,2] [--port 8765] [--dtype auto] ...
    splitspec generate --model DIR|ORG/NAME[@REV] --cloud ws://HOST:PORT --prompt TEXT [--max-new-tokens N] ...

A model id is read from the local Hugging Face cache only (never downloaded).

Each subcommand builds its frozen config once from the arguments and hands it to the library.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from splitspec.arguments import (
    MODEL_HELP,
    add_compile_args,
    add_connection_limit_args,
    add_dtype_arg,
    add_tls_ca,
    add_token_file,
    add_wire_codec,
    add_wire_codecs,
    edge_layers,
    model_dir,
    read_token_file,
)
from splitspec.detokenize import IncrementalText
from splitspec.devices import DEVICE_HELP
from splitspec.exceptions import ConfigError, SplitspecError
from splitspec.models.quantize_choices import QUANTIZE_CHOICES, QUANTIZE_HELP

if TYPE_CHECKING:
    from splitspec.decoding.sampling import SamplingParams
    from splitspec.edge import EdgeConfig, SplitClient

log = logging.getLogger("splitspec")

Runner = Callable[[argparse.Namespace], int]


def set_threads(threads: int | None) -> None:
    """Pin torch's intra-op threads (small models run fastest on one thread of a shared CPU)."""
    if threads is None:
        return
    if threads < 1:
        raise ConfigError("--threads must be at least 1")
    import torch

    torch.set_num_threads(threads)


def _add_split_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=model_dir, required=True, help=MODEL_HELP)
    p.add_argument(
        "--edge-layers",
        type=edge_layers,
        default=(2, 2),
        metavar="HEAD,TAIL",
        help="decoder layers kept on the edge before and after the trunk (default 2,2)",
    )
    add_dtype_arg(
        p,
        ". With the raw wire codec it is the wire's dtype too: an auto edge follows the trunk's (stated at the "
        "handshake); a pinned one must equal it (--wire-codec bf16 and int8 carry their own)",
    )
    p.add_argument("--quantize", choices=QUANTIZE_CHOICES, help=QUANTIZE_HELP)
    p.add_argument("--device", default="auto", help=DEVICE_HELP)
    add_token_file(p)
    p.add_argument("--threads", type=int, help="CPU threads for this side's compute (default: torch's choice)")


def add_speculation_args(p: argparse.ArgumentParser) -> None:
    from splitspec.decoding.speculative import SPECULATE_MODES

    p.add_argument(
        "--speculate",
        choices=SPECULATE_MODES,
        default="auto",
        help="draft tokens locally and verify several per round trip; auto (default) picks the drafter "
        "and draft length from measured RTT, step cost (per context length) and acceptance, and falls "
        "back to one token per trip when speculation would not pay; it starts with a one-token step and "
        "probes each drafter with a short draft, so a short answer is not slower than off",
    )
    p.add_argument(
        "--draft-model",
        type=model_dir,
        help="small local model sharing the tokenizer, for --speculate draft: it drafts a dynamic tree "
        "(EAGLE-2), greedy or sampled (a directory or a cached org/name[@revision])",
    )
    p.add_argument(
        "--draft-tree-width",
        type=int,
        default=4,
        metavar="K",
        help="children per expanded node, and nodes expanded per level, of the draft model's and the head's "
        "trees (default 4, as EAGLE-2); 1 drafts a single chain",
    )
    add_draft_head_arg(p, "")


def add_draft_head_arg(p: argparse.ArgumentParser, default_help: str) -> None:
    p.add_argument(
        "--draft-head",
        type=Path,
        metavar="DIR",
        help="EAGLE draft head trained for this model (splitspec train-drafter), for --speculate eagle and auto; "
        "a head trained for another model is refused" + default_help,
    )
    p.add_argument(
        "--draft-head-target-check",
        choices=("on", "off"),
        default="on",
        help="on (default): refuse a draft head pinned to another model; off: warn instead, and load a published "
        "EAGLE-layout head (it carries no pin) when its shapes fit this model",
    )


# -- cloud serve ---------------------------------------------------------------------------------


def _run_cloud_serve(args: argparse.Namespace) -> int:
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
        from splitspec.cloud.ray_serve import serve_on_ray

        serve_on_ray(config, args.ray_replicas, address=args.ray_address, cpus_per_replica=args.ray_cpus_per_replica)
        return 0
    if args.ray_address is not None:
        raise ConfigError("--ray-address needs --ray-replicas")
    asyncio.run(serve_forever(config))
    return 0


def _register_cloud(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    cloud = sub.add_parser("cloud", help="the untrusted trunk server")
    cloud_sub = cloud.add_subparsers(dest="cloud_command", required=True)
    p = cloud_sub.add_parser("serve", help="serve the middle layers of a model")
    _add_split_args(p)
    add_wire_codecs(p)
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8765, help="TCP port (default 8765; 0 picks one)")
    p.add_argument("--session-ttl", type=float, default=300.0, help="idle seconds before a session is dropped")
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
        choices=("auto", "on", "off"),
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
    p.add_argument("--max-message-mb", type=int, default=16, help="largest accepted message, MiB (default 16)")
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
    p.set_defaults(run=_run_cloud_serve)


# -- generate ------------------------------------------------------------------------------------


def _run_generate(args: argparse.Namespace) -> int:
    from splitspec.edge import SplitClient
    from splitspec.models.checkpoint import load_tokenizer

    config = _edge_config(args)
    params = _sampling(args)
    tokenizer = load_tokenizer(args.model)
    prompt_ids = tokenizer.encode(args.prompt)
    if not prompt_ids:
        raise ConfigError("the prompt encodes to no tokens")

    client = SplitClient(config)
    client.check_length(len(prompt_ids), args.max_new_tokens)  # before connecting

    async def run() -> int:
        async with client:
            if args.json:
                return await _generate_json(client, tokenizer, prompt_ids, args, params)
            text = IncrementalText(lambda ids: str(tokenizer.decode(ids)))
            try:
                async for token in client.stream(prompt_ids, args.max_new_tokens, params, speculate=args.speculate):
                    sys.stdout.write(text.push(token))
                    sys.stdout.flush()
            finally:  # what was produced stays on screen, even when the link fails midway
                sys.stdout.write(text.finish() + "\n")
            return 0

    return asyncio.run(run())


async def _generate_json(
    client: SplitClient, tokenizer: Any, prompt_ids: list[int], args: argparse.Namespace, params: SamplingParams
) -> int:
    """--json: the result, or on a failure midway every token produced so far with an ``error`` field."""
    produced: list[int] = []
    try:
        result = await client.generate(
            prompt_ids, args.max_new_tokens, params, speculate=args.speculate, produced=produced
        )
    except SplitspecError as exc:
        out: dict[str, Any] = {"prompt_ids": prompt_ids, "token_ids": produced}
        out["text"] = tokenizer.decode(produced)
        out["error"] = f"{type(exc).__name__}: {exc}"
        print(json.dumps(out, indent=2))
        return 2
    out = result.to_json()
    out["text"] = tokenizer.decode(result.token_ids)
    print(json.dumps(out, indent=2))
    return 0


def _add_edge_link_args(p: argparse.ArgumentParser) -> None:
    """Arguments of every edge-side command that talks to a trunk server."""
    _add_split_args(p)
    p.add_argument("--cloud", required=True, help="trunk server URL, e.g. ws://127.0.0.1:8765 or wss://HOST:PORT")
    add_wire_codec(p)
    add_tls_ca(p)
    p.add_argument(
        "--allow-stock-edge-weights",
        action="store_true",
        help="run the published edge weights anyway (the cloud can invert its hidden states; warned every session)",
    )
    p.add_argument(
        "--published-model",
        type=model_dir,
        help="published checkpoint to compare the edge weights with (a directory or a cached org/name[@revision])",
    )
    p.add_argument(
        "--trunk-fingerprint",
        metavar="START-END:DTYPE:DIGEST",
        help="the trunk the cloud must serve, as its server logs it at start (default: hash the trunk layers of "
        "--model; needed when that copy lacks them)",
    )
    add_speculation_args(p)
    add_compile_args(p, "the edge's (head and tail layers)")


def _add_edge_args(p: argparse.ArgumentParser, tokens_help: str) -> None:
    """The link arguments plus one generation's length and sampling."""
    _add_edge_link_args(p)
    p.add_argument("--max-new-tokens", type=int, default=64, help=f"{tokens_help} (default 64)")
    p.add_argument(
        "--temperature",
        type=float,
        help="0 = greedy; > 0 samples (default: the checkpoint's generation_config.json: its temperature "
        "when it sets do_sample, else greedy, which is logged)",
    )
    p.add_argument("--top-p", type=float, help="nucleus sampling mass (default: generation_config.json's, else 1.0)")
    p.add_argument(
        "--top-k",
        type=int,
        help="sample from the k likeliest tokens, 0 = all (default: generation_config.json's, else 50)",
    )
    p.add_argument("--seed", type=int, help="sampling seed (reproducible output)")


def _edge_config(args: argparse.Namespace) -> EdgeConfig:
    from splitspec.edge import EdgeConfig

    if getattr(args, "max_new_tokens", 1) < 1:  # serve has no --max-new-tokens: requests say
        raise ConfigError("--max-new-tokens must be at least 1")
    set_threads(args.threads)
    return EdgeConfig(
        model_dir=args.model,
        cloud_url=args.cloud,
        edge_layers=args.edge_layers,
        dtype=args.dtype,
        wire_codec=args.wire_codec,
        quantize=args.quantize,
        device=args.device,
        auth_token=read_token_file(args.token_file),
        draft_model_dir=args.draft_model,
        draft_head_dir=args.draft_head,
        draft_head_target_check=args.draft_head_target_check == "on",
        draft_tree_width=args.draft_tree_width,
        allow_stock_edge_weights=args.allow_stock_edge_weights,
        published_model_dir=args.published_model,
        trunk_fingerprint=args.trunk_fingerprint,
        tls_ca_file=args.tls_ca,
        compile=args.compile,
        max_cache_tokens=args.max_cache_tokens,
    )


def _sampling(args: argparse.Namespace) -> SamplingParams:
    """The flags given, else the checkpoint's generation_config.json: the same rule as SplitClient.sampling."""
    from splitspec.decoding.published import published_sampling, sampling_settings

    return sampling_settings(published_sampling(args.model), args.temperature, args.top_p, args.top_k, args.seed)


def _register_generate(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("generate", help="generate text with the edge half of a split model")
    _add_edge_args(p, "tokens to generate")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--json", action="store_true", help="print token ids, text and per-step figures as JSON")
    p.set_defaults(run=_run_generate)


# -- entry point ---------------------------------------------------------------------------------


def _run_chat(args: argparse.Namespace) -> int:
    from splitspec.chat import ChatConfig, chat

    config = ChatConfig(
        edge=_edge_config(args),
        max_new_tokens=args.max_new_tokens,
        params=_sampling(args),
        speculate=args.speculate,
        json_lines=args.json,
        system_prompt=args.system,
        plain=args.plain,
    )
    asyncio.run(chat(config, sys.stdin))
    return 0


def _register_chat(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("chat", help="interactive multi-turn generation; the KV cache is kept across turns")
    _add_edge_args(p, "tokens per turn")
    p.add_argument("--json", action="store_true", help="one JSON object per turn (for scripts)")
    p.add_argument("--system", help="system prompt opening the conversation (needs a chat template)")
    p.add_argument(
        "--plain",
        action="store_true",
        help="ignore the tokenizer's chat template: each line is plain text appended to the context (base models)",
    )
    p.set_defaults(run=_run_chat)


def _run_demo(args: argparse.Namespace) -> int:
    from splitspec.demo import SHOWCASE, DemoConfig, embedded_model, run_demo

    if args.max_new_tokens < 1:
        raise ConfigError("--max-new-tokens must be at least 1")
    if args.rtt_ms < 0:
        raise ConfigError("--rtt-ms must be >= 0")
    set_threads(args.threads)
    model = args.model or embedded_model("base")
    draft = args.draft_model or (embedded_model("draft") if args.model is None else None)
    head = args.draft_head or (embedded_model("base-eagle") if args.model is None else None)
    config = DemoConfig(
        model_dir=model,
        draft_model_dir=draft,
        draft_head_dir=head,
        draft_head_target_check=args.draft_head_target_check == "on",
        prompts=(("prompt", args.prompt),) if args.prompt else SHOWCASE,
        max_new_tokens=args.max_new_tokens,
        rtt_ms=args.rtt_ms,
        mode=args.mode,
        temperature=args.temperature,
        edge_layers=args.edge_layers,
        device=args.device,
        wire_codec=args.wire_codec,
        dtype=args.dtype,
    )
    return run_demo(config)


def _register_demo(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from splitspec.decoding.speculative import SPECULATE_MODES

    p = sub.add_parser("demo", help="run cloud, WAN emulator and edge on this machine with the embedded models")
    p.add_argument("--prompt", help="prompt text (default: a short prose and code showcase)")
    p.add_argument("--max-new-tokens", type=int, default=48, help="tokens per prompt (default 48)")
    p.add_argument("--rtt-ms", type=float, default=80.0, help="emulated round-trip time, ms (default 80)")
    p.add_argument("--mode", choices=SPECULATE_MODES, default="auto", help="speculation mode (default auto)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--model", type=model_dir, help=MODEL_HELP + ", to split (default: the embedded base model)")
    p.add_argument(
        "--draft-model", type=model_dir, help="drafter, a directory or model id (default: the embedded draft model)"
    )
    add_draft_head_arg(p, " (default: the embedded base model's head)")
    p.add_argument("--edge-layers", type=edge_layers, default=(2, 2), metavar="HEAD,TAIL")
    p.add_argument("--threads", type=int, default=1, help="CPU threads for the edge (default 1: small models)")
    p.add_argument("--device", default="auto", help=DEVICE_HELP + "; the trunk server child uses it too")
    add_wire_codec(p)
    add_dtype_arg(p, "; the trunk server child uses it too")
    p.set_defaults(run=_run_demo)


def _register_netem(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from splitspec.netem.cli import register

    register(sub)


def _register_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from splitspec.bench.cli import register

    register(sub)


def _register_fed(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from splitspec.federated.cli import register

    register(sub)


def _register_privacy(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from splitspec.privacy.cli import register

    register(sub)


def _register_train_drafter(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from splitspec.train_drafter import register

    register(sub)


def _run_serve(args: argparse.Namespace) -> int:
    from splitspec.models.hub import model_label
    from splitspec.serve.config import ServeConfig
    from splitspec.serve.server import serve_forever

    if args.trunk_sessions_per_connection < 1:
        raise ConfigError(
            f"--trunk-sessions-per-connection must be at least 1, got {args.trunk_sessions_per_connection}"
        )
    edge = dataclasses.replace(
        _edge_config(args),
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
    )
    if args.workers < 1:
        raise ConfigError(f"--workers must be at least 1, got {args.workers}")
    if args.workers > 1:
        from splitspec.serve.workers import Supervisor, resolve_port

        config = dataclasses.replace(config, port=resolve_port(config.host, config.port))
        return Supervisor(config, args.workers, args.log_level, args.threads).run()
    asyncio.run(serve_forever(config, args.log_level.lower()))
    return 0


def _read_text(path: Path | None) -> str | None:
    if path is None:
        return None
    try:
        return path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None


def _register_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server on the edge (chat/completions, completions)")
    _add_edge_link_args(p)
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
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
        "--workers",
        type=int,
        default=1,
        help="server processes sharing the port (Linux SO_REUSEPORT), each with its own engine, session pool and "
        "--max-active; more than 1 lets a CPU edge use more cores than one interpreter can (default 1)",
    )
    p.add_argument("--max-active", type=int, default=8, help="requests generating at once, one cloud session each")
    p.add_argument("--queue-timeout", type=float, default=10.0, help="seconds a request waits for a session, then 429")
    p.add_argument("--prefix-cache-size", type=int, default=16, help="idle conversations kept for reuse (default 16)")
    p.add_argument("--prefix-cache-mb", type=int, default=512, help="edge KV memory of kept conversations, MiB")
    p.add_argument("--no-prefix-reuse", action="store_true", help="re-prefill every prompt (for comparison)")
    p.add_argument("--reconnect-timeout", type=float, default=10.0, help="seconds to retry a lost trunk before 503")
    p.add_argument(
        "--trunk-sessions-per-connection",
        type=int,
        default=4,
        help="requests' cloud sessions multiplexed on one trunk connection; more connections open as needed "
        "(at most the trunk's --max-sessions-per-connection, default 4)",
    )
    p.set_defaults(run=_run_serve)


REGISTRARS: list[Callable[[argparse._SubParsersAction[argparse.ArgumentParser]], None]] = [
    _register_cloud,
    _register_generate,
    _register_netem,
    _register_demo,
    _register_chat,
    _register_bench,
    _register_fed,
    _register_privacy,
    _register_serve,
    _register_train_drafter,
]


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


class CommandParser(argparse.ArgumentParser):
    """An ArgumentParser whose every command and subcommand takes the logging options.

    ``--log-level``, ``-v`` and ``-q`` are accepted before or after any subcommand's name
    (``splitspec -q generate ...`` and ``splitspec generate ... -q`` alike). Subparsers are made
    with the parent's class, so each level gets them; their default is "not given", so a value
    given at one level is not reset by another.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        levels = self.add_argument_group("logging").add_mutually_exclusive_group()
        levels.add_argument(
            "--log-level", choices=LOG_LEVELS, default=argparse.SUPPRESS, help="what to log (default INFO)"
        )
        levels.add_argument(
            "-v", "--verbose", dest="log_level", action="store_const", const="DEBUG", default=argparse.SUPPRESS,
            help="log everything (--log-level DEBUG)",
        )  # fmt: skip
        levels.add_argument(
            "-q", "--quiet", dest="log_level", action="store_const", const="WARNING", default=argparse.SUPPRESS,
            help="log only warnings and errors (--log-level WARNING)",
        )  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    from splitspec import __version__

    parser = CommandParser(prog="splitspec", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--version", action="version", version=f"splitspec {__version__}")
    # the registrars take any ArgumentParser's subparsers; these make CommandParsers
    sub = cast(
        "argparse._SubParsersAction[argparse.ArgumentParser]", parser.add_subparsers(dest="command", required=True)
    )
    for register in REGISTRARS:
        register(sub)
    return parser


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _log_cached_models(args: argparse.Namespace) -> None:
    """Say which cached snapshot each model id resolved to (resolved while parsing, before logging was set)."""
    from splitspec.models.hub import model_label, snapshot_repo

    for name, value in sorted(vars(args).items()):
        if isinstance(value, Path) and snapshot_repo(value) is not None:
            log.info("--%s %s: the cached snapshot %s", name.replace("_", "-"), model_label(value), value)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SplitspecError as exc:  # from an option's type: a --model id that is not in the local cache
        logging.basicConfig(level="INFO", format=LOG_FORMAT)
        log.error("%s: %s", type(exc).__name__, exc)
        return 2
    args.log_level = getattr(args, "log_level", "INFO")
    logging.basicConfig(level=args.log_level, format=LOG_FORMAT)
    logging.getLogger("websockets").setLevel(max(logging.WARNING, logging.getLevelName(args.log_level)))
    if args.log_level != "DEBUG":  # transformers' per-load progress bars are noise around our log lines
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    _log_cached_models(args)
    run: Runner = args.run
    try:
        return run(args)
    except KeyboardInterrupt:
        return 130
    except SplitspecError as exc:
        log.error("%s: %s", type(exc).__name__, exc)
        return 2


if __name__ == "__main__":
    sys.exit(main())
