"""Configuration of ``splitspec serve``, built once by the CLI (or a test) and never mutated."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from splitspec.edge.config import EdgeConfig
from splitspec.exceptions import ConfigError

TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json")  # the formats of splitspec.serve.tool_parsers
GenerationConfigMode = Literal["auto", "vllm"]  # the sampling defaults' source: serve/sampling_defaults.py
GENERATION_CONFIG_MODES: tuple[GenerationConfigMode, ...] = ("auto", "vllm")


@dataclass(frozen=True)
class ServeConfig:
    edge: EdgeConfig  # model, trunk URL, TLS, secret, edge layers, dtype, draft model
    served_model_name: str  # the `model` id clients must send and /v1/models lists
    host: str = "127.0.0.1"  # interface the HTTP server listens on
    port: int = 8000  # TCP port of the HTTP server (0 picks one)
    api_key: str | None = None  # bearer token clients must send; None = no authentication
    speculate: str = "auto"  # --speculate mode used for every request
    max_active: int = 8  # requests generating at once, each on its own cloud session
    queue_timeout_s: float = 10.0  # a request waits this long for a free session, then gets 429 (0: no wait)
    prefix_cache_entries: int = 16  # idle conversations kept (edge caches + cloud session)
    prefix_cache_bytes: int = 512 * 1024 * 1024  # edge KV memory the idle conversations may hold, bytes
    prefix_reuse: bool = True  # False: every request re-prefills its whole prompt (for comparison)
    chat_template: str | None = None  # Jinja chat template overriding the tokenizer's, if any
    tool_call_parser: str = "auto"  # --tool-call-parser: auto (from the template), hermes, llama3_json
    # --generation-config: auto (the checkpoint's generation_config.json gives the temperature, top_p and top_k a
    # request leaves unset, as vLLM) or vllm (OpenAI's neutral defaults): serve/sampling_defaults.py
    generation_config: GenerationConfigMode = "auto"
    worker: int | None = None  # this process's index under --workers N (its /metrics carry worker="i"); None: alone

    def __post_init__(self) -> None:
        if self.max_active < 1:
            raise ConfigError(f"--max-active must be at least 1, got {self.max_active}")
        if self.queue_timeout_s < 0:
            raise ConfigError(f"--queue-timeout must be >= 0, got {self.queue_timeout_s}")
        if self.prefix_cache_entries < 0:
            raise ConfigError(f"--prefix-cache-size must be >= 0, got {self.prefix_cache_entries}")
        if self.prefix_cache_bytes < 0:
            raise ConfigError(f"--prefix-cache-mb must be >= 0, got {self.prefix_cache_bytes}")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ConfigError(
                f"--tool-call-parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got {self.tool_call_parser!r}"
            )
        if self.generation_config not in GENERATION_CONFIG_MODES:
            raise ConfigError(
                f"--generation-config must be one of {', '.join(GENERATION_CONFIG_MODES)}, "
                f"got {self.generation_config!r}"
            )
        if not self.served_model_name:
            raise ConfigError("the served model name must not be empty")
