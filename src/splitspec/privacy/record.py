"""The divergence record: what ``splitspec diverge`` leaves in a diverged checkpoint directory.

:mod:`splitspec.privacy.diverge` writes it; the edge (:mod:`splitspec.edge.provenance`) reads it
before it agrees to run the checkpoint's edge weights. It lives here, apart from both, so that
the edge depends on privacy and never the other way round.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from splitspec.exceptions import ConfigError

EDGE_RECORD = "splitspec_edge.json"  # divergence record inside a diverged checkpoint directory


@dataclass(frozen=True)
class DivergenceRecord:
    """Which edge layers were diverged, and the fingerprints before and after."""

    head: int  # edge layers at the bottom of the model
    tail: int  # edge layers at the top of the model
    fingerprint_sha256: str  # sha256 over the diverged edge tensors (privacy.weights.edge_fingerprint)
    published_fingerprint_sha256: str  # the same fingerprint of the published checkpoint
    published_model: str = ""  # where the published checkpoint was, for people reading the file
    send_noise_scale: float = 0.0  # send-noise defence: std relative to each token's RMS (0 = none)
    send_noise_key: str = ""  # hex secret key of the per-prefix send noise (set when the scale is > 0)
    # ids of the corpus documents the edge layers were fitted on: an audit must not test on them (empty: unknown)
    train_documents: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not (math.isfinite(self.send_noise_scale) and self.send_noise_scale >= 0):
            raise ConfigError(f"send_noise_scale must be a finite number >= 0, got {self.send_noise_scale}")
        if self.send_noise_scale > 0 and not 16 <= len(self.noise_key) <= 64:
            raise ConfigError(f"send noise needs a 16-64 byte send_noise_key (hex), got {len(self.noise_key)} bytes")

    @property
    def noise_key(self) -> bytes:
        """The send-noise key as bytes."""
        try:
            return bytes.fromhex(self.send_noise_key)
        except ValueError:
            raise ConfigError(f"send_noise_key is not hex: {self.send_noise_key[:8]!r}...") from None

    def write(self, checkpoint_dir: Path) -> Path:
        """Write the record into ``checkpoint_dir``; returns its path."""
        path = checkpoint_dir / EDGE_RECORD
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")
        return path

    @classmethod
    def read(cls, checkpoint_dir: Path) -> DivergenceRecord | None:
        """The record of ``checkpoint_dir``; None if it has none. A malformed one raises ConfigError."""
        path = checkpoint_dir / EDGE_RECORD
        if not path.is_file():
            return None
        try:
            raw = json.loads(path.read_text())
            return cls(
                head=int(raw["head"]),
                tail=int(raw["tail"]),
                fingerprint_sha256=str(raw["fingerprint_sha256"]),
                published_fingerprint_sha256=str(raw["published_fingerprint_sha256"]),
                published_model=str(raw.get("published_model", "")),
                send_noise_scale=float(raw.get("send_noise_scale", 0.0)),
                send_noise_key=str(raw.get("send_noise_key", "")),
                train_documents=tuple(str(d) for d in raw.get("train_documents", ())),
            )
        except (OSError, ValueError, KeyError, TypeError, AttributeError, ConfigError) as exc:
            raise ConfigError(f"{path} is not a valid divergence record: {exc}") from None
