"""Configuration of a trunk server, built once by the CLI (or a test) and never mutated."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from splitspec.device_choices import check_compute_on
from splitspec.exceptions import CheckpointError, ConfigError
from splitspec.models.compile_modes import COMPILE_MODES
from splitspec.models.dtype_choices import DTYPE_CHOICES
from splitspec.models.prepack_choices import PREPACK_CHOICES
from splitspec.models.quantize_choices import QUANTIZE_CHOICES
from splitspec.protocol.choices import WIRE_CODECS


@dataclass(frozen=True)
class CloudConfig:
    model_dir: Path  # checkpoint directory; only the trunk layers' tensors are read
    edge_layers: tuple[int, int] = (2, 2)  # decoder layers kept on the edge (head, tail)
    host: str = "127.0.0.1"  # interface to listen on
    port: int = 8765  # TCP port; 0 picks a free one
    auth_token: str | None = None  # shared secret required in the Hello; None = no auth
    tls_cert_file: Path | None = None  # PEM certificate chain: serve wss:// (TLS) instead of ws://
    tls_key_file: Path | None = None  # PEM private key of tls_cert_file
    session_ttl_s: float = 300.0  # idle seconds before a session's cache is dropped
    max_sessions: int = 64  # concurrent sessions across all connections
    max_sessions_per_connection: int = 4  # sessions one connection may hold at once
    max_sessions_per_address: int = 32  # sessions all connections from one IP address may hold at once
    kv_budget_mb: float | None = None  # KV memory of all sessions, MiB; None = 40 % of what is available at start
    # with kv_budget_mb None: the share of that default this server takes, 0 < share <= 1. A Ray replica that may
    # share its device's memory with others takes less (set by ray_serve.trunk_application; see docs/ray-serve.md)
    kv_budget_share: float = 1.0
    kv_block_tokens: int = 16  # a session's KV cache grows in blocks of this many entries (kv_cache.KV_BLOCK_TOKENS)
    evict_idle_s: float = 1.0  # a session idle this long may be evicted (LRU) when the KV budget is full
    handshake_timeout_s: float = 10.0  # seconds a new connection has to complete its handshake
    max_unauthenticated: int = 64  # connections in their handshake at once, all addresses
    max_connections_per_address: int = 32  # open connections from one IP address
    max_message_bytes: int = 16 * 1024 * 1024  # largest accepted frame, bytes
    max_query_tokens: int = 2048  # largest number of query tokens in one step
    dtype: str = "auto"  # compute dtype: auto (models.precision: per device) or float32, bfloat16, float16
    wire_codecs: tuple[str, ...] = ("raw", "bf16", "int8")  # hidden-state codecs an edge may pick (protocol.codec)
    quantize: str | None = None  # quantize the trunk at load with bitsandbytes: "nf4" or "int8"; None = as stored
    attn_implementation: str | None = None  # transformers attention kernel (sdpa, eager); None = the family's
    device: str = "auto"  # compute device: auto, cpu, cuda, cuda:N or mps (see splitspec.devices)
    devices: tuple[str, ...] = ()  # several devices: the trunk's layers split into contiguous runs; overrides device
    batching: bool = True  # continuous batching of steps across sessions; False = each step alone on the pool
    max_batch_steps: int = 64  # most small steps (decode, draft trees) in one batched forward
    # a free batch worker waits up to this fraction of a decode batch's forward time for the next steps of the
    # active sessions due meanwhile (splitspec.models.batcher; 0 = start at once; a lone session never waits)
    batch_gather: float = 0.5
    prefill_chunk_tokens: int = 256  # most tokens of a big prefill per batching iteration (fewer among decode traffic)
    # the trunk's linear weights prepacked for oneDNN (splitspec.models.prepack): "auto" = for a batching float32
    # trunk wholly on the CPU (its batched forwards ran 1.3-1.5x faster), "on" = required (refused where it cannot
    # apply), "off" = PyTorch's default CPU matmul (MKL)
    prepack: str = "auto"
    # torch.compile mode of the fixed-shape decode step over static KV buffers (auto, default, reduce-overhead,
    # max-autotune, ...: splitspec.models.fixed_decode); None = eager with growable caches. Needs batching=False
    compile: str | None = None
    max_cache_tokens: int | None = None  # with compile: each session's static KV capacity, tokens; None = max positions
    compile_backend: str = "inductor"  # torch.compile backend of compile; tests pass "eager" (graph capture only)
    # where the batched forwards run: threads = a worker thread, loop = the event loop; auto = the thread on an
    # accelerator, the loop on a CPU (splitspec.devices.compute_on_threads)
    compute_on: str = "auto"
    compute_workers: int = 4  # without batching: sessions computing at once (threads); others' steps queue
    torch_threads: int | None = None  # intra-op CPU threads for the trunk; None = torch's default
    sweep_interval_s: float | None = None  # TTL sweep period, seconds; None = ttl / 4 capped at 5


def check_config(config: CloudConfig) -> None:
    """The checks that need no model, each a :class:`ConfigError` of one line: made before a trunk loads (minutes,
    for a big one), by :class:`~splitspec.cloud.server.TrunkServer` and, before any replica starts, by the Ray
    Serve application (:func:`~splitspec.cloud.ray_serve.trunk_application`).

    Every number is checked finite and in its range (an infinite session TTL went into every Welcome, which
    edges refuse; a NaN one disabled the sweep), every choice against its allowed set."""
    if not (config.model_dir / "config.json").is_file():
        raise CheckpointError(f"{config.model_dir} is not a checkpoint directory: config.json is missing")
    _positive("the KV budget (--kv-budget-mb)", config.kv_budget_mb)
    if not (math.isfinite(config.kv_budget_share) and 0 < config.kv_budget_share <= 1):
        raise ConfigError(f"the default KV budget's share must be in (0, 1], got {config.kv_budget_share}")
    if min(config.max_sessions, config.max_sessions_per_connection, config.max_sessions_per_address) < 1:
        raise ConfigError("session limits must be at least 1")
    if config.kv_block_tokens < 1:
        raise ConfigError(f"--kv-block must be at least 1 entry, got {config.kv_block_tokens}")
    if config.max_batch_steps < 1 or config.prefill_chunk_tokens < 1:
        raise ConfigError("--max-batch-steps and --prefill-chunk must be at least 1")
    if not 0 <= config.batch_gather <= 10:  # NaN fails this too
        raise ConfigError(f"--batch-gather must be between 0 and 10 (decode batches' time), got {config.batch_gather}")
    if not config.wire_codecs or any(c not in WIRE_CODECS for c in config.wire_codecs):
        raise ConfigError(f"--wire-codecs must name one or more of {', '.join(WIRE_CODECS)}, got {config.wire_codecs}")
    _one_of("--prepack", config.prepack, PREPACK_CHOICES)
    check_compute_on(config.compute_on)
    _one_of("--dtype", config.dtype, DTYPE_CHOICES)
    if config.quantize is not None:
        _one_of("--quantize", config.quantize, QUANTIZE_CHOICES)
    if config.compile is not None:
        _one_of("--compile", config.compile, COMPILE_MODES)
        if config.batching:
            raise ConfigError(
                "--compile runs each session's decode step alone over static KV buffers: add --no-batching "
                "(batched steps use growable caches)"
            )
    _positive("--session-ttl", config.session_ttl_s)
    _positive("--handshake-timeout", config.handshake_timeout_s)
    _positive("the TTL sweep interval", config.sweep_interval_s)
    if not (math.isfinite(config.evict_idle_s) and config.evict_idle_s >= 0):
        raise ConfigError(f"--evict-idle must be a finite number of seconds >= 0, got {config.evict_idle_s}")
    if config.max_connections_per_address < 1:
        raise ConfigError("--max-connections-per-address must be at least 1")
    if config.max_unauthenticated < 1:
        raise ConfigError(f"max_unauthenticated must be at least 1, got {config.max_unauthenticated}")
    if config.max_message_bytes < 1:
        raise ConfigError("--max-message-mb must be at least 1")
    if config.max_query_tokens < 1:
        raise ConfigError(f"max_query_tokens must be at least 1, got {config.max_query_tokens}")
    if config.compute_workers < 1:
        raise ConfigError(f"compute_workers must be at least 1, got {config.compute_workers}")
    if config.torch_threads is not None and config.torch_threads < 1:
        raise ConfigError(f"--threads must be at least 1, got {config.torch_threads}")
    if config.max_cache_tokens is not None and config.max_cache_tokens < 1:
        raise ConfigError(f"--max-cache-tokens must be at least 1, got {config.max_cache_tokens}")
    if not 0 <= config.port <= 65535:
        raise ConfigError(f"--port must be between 0 and 65535, got {config.port}")
    if (config.tls_cert_file is None) != (config.tls_key_file is None):
        raise ConfigError("TLS needs both a certificate and a key file")
    _used_by_its_path(config)


# options only one compute path reads: set away from their defaults on the other, they would be ignored
_BATCHING_ONLY = {"max_batch_steps": "--max-batch-steps", "prefill_chunk_tokens": "--prefill-chunk",
                  "batch_gather": "--batch-gather", "compute_on": "--compute-on"}  # fmt: skip
_PER_SESSION_ONLY = {"compute_workers": "compute_workers"}


def _used_by_its_path(config: CloudConfig) -> None:
    """Refuse an option the chosen compute path ignores (``--no-batching`` with ``--max-batch-steps``, ...)."""
    defaults = {f.name: f.default for f in dataclasses.fields(CloudConfig)}
    unused = _PER_SESSION_ONLY if config.batching else _BATCHING_ONLY
    changed = [flag for name, flag in unused.items() if getattr(config, name) != defaults[name]]
    if changed:
        path = "the batching path (without --no-batching)" if not config.batching else "--no-batching"
        raise ConfigError(f"{', '.join(changed)} only applies with {path}: drop it or change the path")


def _positive(what: str, value: float | None) -> None:
    """Refuse ``value`` unless it is None (unset) or a finite number above 0."""
    if value is not None and not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{what} must be positive and finite, got {value}")


def _one_of(flag: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{flag} must be one of {', '.join(choices)}, got {value!r}")
