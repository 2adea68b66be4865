"""Are the edge's weights the published ones? The edge refuses to run them silently.

Hidden states a few layers from the embedding are close to plaintext for anyone who holds the
same weights. With stock public edge weights, an untrusted cloud can rebuild (activation, token)
pairs at will, so splitspec treats stock edge weights as a conscious choice:

* with ``published_model_dir`` the edge layers are compared tensor by tensor with the published
  checkpoint: the weights count as stock when the head layers, whose output the cloud receives, are (a tail of
  its own does not hide what the head sends);
* otherwise the checkpoint must carry a divergence record (``splitspec_edge.json``, written by
  ``splitspec diverge``) whose fingerprint matches the edge tensors actually loaded and differs
  from the published fingerprint. A checkpoint without a valid record counts as stock. The record is trusted
  as written (its published fingerprint is the one ``diverge`` computed): ``published_model_dir`` checks the
  weights against the published ones themselves.

Stock weights raise :class:`~splitspec.exceptions.ConfigError` unless explicitly allowed; then the
client warns at every session.

The record also carries the edge's send-noise defence (:func:`send_noise`): the noise scale the
edge layers were trained with and the secret key that makes the noise a function of the prefix.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from splitspec.exceptions import ConfigError
from splitspec.models.split import SplitPlan
from splitspec.privacy.record import EDGE_RECORD, DivergenceRecord
from splitspec.privacy.weights import edge_fingerprint, edge_weight_report

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EdgeProvenance:
    stock: bool  # the edge runs (or cannot prove it does not run) the published edge weights
    reason: str  # how that was decided, for logs and errors


def edge_provenance(model_dir: Path, plan: SplitPlan, published_model_dir: Path | None) -> EdgeProvenance:
    """Decide whether ``model_dir``'s edge weights are the published ones."""
    if published_model_dir is not None:
        report = edge_weight_report(model_dir, published_model_dir, plan)
        if report.head_is_stock:  # what the cloud sees is then public, however the tail differs
            return EdgeProvenance(
                True, f"the head layers, whose output the cloud sees, equal those of {published_model_dir}"
            )
        if report.stock_layers:
            log.warning("edge layers %s are still the published ones", report.stock_layers)
        return EdgeProvenance(
            False, f"edge layers differ from {published_model_dir} (max relative {report.max_relative_difference:.3g})"
        )
    record = DivergenceRecord.read(model_dir)
    if record is None:
        return EdgeProvenance(True, f"no divergence record ({EDGE_RECORD}) in {model_dir}")
    if (record.head, record.tail) != (plan.head, plan.tail):
        return EdgeProvenance(
            True, f"the divergence record is for edge layers {record.head},{record.tail}, not {plan.head},{plan.tail}"
        )
    actual = edge_fingerprint(model_dir, plan)
    if actual != record.fingerprint_sha256:
        return EdgeProvenance(True, "the edge tensors do not match the divergence record's fingerprint")
    if actual == record.published_fingerprint_sha256:
        return EdgeProvenance(True, "the divergence record says these are the published weights")
    return EdgeProvenance(False, f"diverged edge weights, fingerprint {actual[:16]}")


@dataclass(frozen=True)
class SendNoise:
    """The send-noise defence a diverged edge was trained with (scale 0 = none)."""

    scale: float  # noise std relative to each token's RMS activation
    key: bytes  # secret key of the per-prefix noise (empty when scale is 0)


def send_noise(model_dir: Path) -> SendNoise:
    """The send-noise settings of ``model_dir``'s divergence record (none without a record)."""
    record = DivergenceRecord.read(model_dir)
    if record is None or record.send_noise_scale == 0:
        return SendNoise(0.0, b"")
    return SendNoise(record.send_noise_scale, record.noise_key)


def check_edge_weights(
    model_dir: Path, plan: SplitPlan, published_model_dir: Path | None, allow_stock: bool
) -> EdgeProvenance:
    """Refuse stock edge weights unless ``allow_stock``; return the verdict."""
    verdict = edge_provenance(model_dir, plan, published_model_dir)
    if verdict.stock and not allow_stock:
        raise ConfigError(
            f"refusing to run stock public edge weights ({verdict.reason}): whoever holds the published "
            "model can invert the hidden states the cloud sees. Run `splitspec diverge` to make private "
            "edge weights, or pass --allow-stock-edge-weights to accept the risk."
        )
    return verdict
