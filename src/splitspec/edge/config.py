"""Configuration of the edge client, built once by the CLI (or a test) and never mutated."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from splitspec.device_choices import check_compute_on
from splitspec.exceptions import ConfigError
from splitspec.models.prepack_choices import PREPACK_CHOICES


@dataclass(frozen=True)
class EdgeConfig:
    model_dir: Path  # checkpoint directory; only edge tensors are read
    cloud_url: str  # trunk server, e.g. ws://127.0.0.1:8765, or wss://host:port for TLS
    tls_ca_file: Path | None = None  # PEM CA bundle to verify a wss:// server; None = system store
    edge_layers: tuple[int, int] = (2, 2)  # decoder layers kept on the edge (head, tail)
    # compute dtype; auto follows the trunk's (Welcome), a pinned one must equal it when wire_codec is raw
    dtype: str = "auto"
    # how hidden states travel both ways: raw (the compute dtype as is), bf16 or int8 (protocol.codec)
    wire_codec: str = "raw"
    # quantize the head and tail layers at load ("nf4", "int8"; bitsandbytes), and expect a trunk quantized so
    quantize: str | None = None
    device: str = "auto"  # compute device of the edge and the draft model: auto, cpu, cuda, cuda:N or mps
    auth_token: str | None = None  # shared secret, if the server requires one
    max_message_bytes: int = 16 * 1024 * 1024  # our own frame cap, bytes (the server's may be lower)
    connect_timeout_s: float = 10.0  # one connection attempt, seconds
    request_timeout_s: float = 120.0  # waiting for one reply, seconds
    reconnect_timeout_s: float = 30.0  # how long recovery keeps retrying the cloud, seconds
    max_recoveries: int = 3  # recoveries allowed for one step before giving up
    capacity_wait_s: float = 60.0  # how long a step waits out the trunk's "capacity" refusals, seconds
    attn_implementation: str | None = None  # transformers attention kernel (sdpa, eager); None = the family's
    draft_model_dir: Path | None = None  # small local model sharing the tokenizer, for drafting
    draft_head_dir: Path | None = None  # EAGLE draft head for this model (splitspec train-drafter), for drafting
    # refuse a draft head pinned to another model (off: warn instead; a published EAGLE-layout head carries no pin,
    # so it needs off, and is then checked against this model's shapes)
    draft_head_target_check: bool = True
    draft_tree_width: int = 4  # children per expanded node of the draft model's and the head's trees; 1 = a chain
    allow_stock_edge_weights: bool = False  # run the published edge weights anyway (warned every session)
    published_model_dir: Path | None = None  # published checkpoint to compare the edge weights with
    # torch.compile mode of the edge's fixed-shape decode steps (head and tail) over static KV buffers: auto,
    # default, reduce-overhead, ... (splitspec.models.fixed_decode); None = eager with growable caches
    compile: str | None = None
    max_cache_tokens: int | None = None  # with compile: the static KV buffers' size, tokens; None = max positions
    compile_backend: str = "inductor"  # torch.compile backend of compile; tests pass "eager" (graph capture only)
    trunk_fingerprint: str | None = None  # pinned trunk content fingerprint; None = hash model_dir's own trunk
    # linear layers and LM head, the edge's and the draft model's, reordered once for oneDNN (models/prepack.py):
    # auto = on a float32 CPU without --compile or quantization, each layer shape only where it runs faster
    # packed (timed at load); on = every one, and refuse anything else; off = PyTorch's matmul
    prepack: str = "auto"
    # sessions one trunk connection carries at once (their steps multiplexed); the trunk's
    # --max-sessions-per-connection (default 4) caps it, and the engine opens more connections as needed
    sessions_per_connection: int = 4
    # a trunk connection emptied of sessions (not the last one) stays open this long for the next ones, seconds:
    # a burst after a lull then skips the handshake's round trips; 0 = close it at once
    idle_connection_s: float = 30.0
    batch_gather: float = 0.5  # engine: how long a free worker waits for the other sequences' steps, in batch times
    # where the engine's head and tail forwards and the draft model's proposals run: threads = worker threads, loop =
    # the event loop; auto = threads on an accelerator, the loop on a CPU (splitspec.devices.compute_on_threads)
    compute_on: str = "auto"

    def __post_init__(self) -> None:
        if self.sessions_per_connection < 1:
            raise ConfigError(f"sessions per trunk connection must be at least 1, got {self.sessions_per_connection}")
        if not self.idle_connection_s >= 0:
            raise ConfigError(f"the idle connection time must be >= 0 seconds, got {self.idle_connection_s}")
        if self.prepack not in PREPACK_CHOICES:
            raise ConfigError(f"--prepack must be one of {', '.join(PREPACK_CHOICES)}, got {self.prepack!r}")
        if not self.batch_gather >= 0:
            raise ConfigError(f"the batch gathering window must be >= 0, got {self.batch_gather}")
        check_compute_on(self.compute_on)
        if self.draft_tree_width < 1:
            raise ConfigError(f"the draft tree width must be at least 1 (1: a chain), got {self.draft_tree_width}")
