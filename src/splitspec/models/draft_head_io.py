"""Draft heads on disk: splitspec's own layout, and heads published in the EAGLE layout.

**splitspec's layout** (what ``splitspec train-drafter`` writes): ``config.json``, the one-layer
transformers config of the head's decoder layer plus a ``"splitspec_draft_head"`` object (the
target's fingerprint and name, feature layers, the layout flags of
:class:`~splitspec.models.draft_head.DraftHeadConfig`, training notes), and ``model.safetensors``
with ``fc.*``, ``layers.0.*`` (the decoder layer, named as EAGLE names it), and, when present,
``norm.weight``, ``lm_head.weight`` and ``d2t``. A head whose target fingerprint is not the
target's is refused with one line naming both models.

**The EAGLE layout** (what vLLM's ``llama_eagle.py`` / SGLang's ``llama_eagle.py`` read): a
one-layer Llama-style ``config.json`` and safetensors with ``fc.weight`` (H x 2H, optional
``fc.bias``), the decoder layer as ``layers.0.*`` or ``midlayer.*`` (EAGLE-1 drops its input
norm), optional ``norm.weight``, optional ``lm_head.weight`` with ``d2t`` for a reduced draft
vocabulary; a copy of the embedding (``embed_tokens.weight``) is ignored, the target's is used.
EAGLE-1 heads read the target's last hidden state *after* its final norm and feed their output
straight to the LM head; the loaded config records both. What a standard decoder layer cannot
run is refused (EAGLE-3's fc over three layers' features and its 2H-wide attention input).
Published heads carry no splitspec fingerprint: they load only with ``target_check=False``
(``--draft-head-target-check off``), and then only when their shapes fit the target.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from splitspec.exceptions import ConfigError
from splitspec.models.checkpoint import Checkpoint
from splitspec.models.draft_head import (
    LOGITS_NORMS,
    DraftHead,
    DraftHeadConfig,
    check_feature_layers,
    target_fingerprint,
)

log = logging.getLogger(__name__)

HEAD_KEY = "splitspec_draft_head"
FORMAT_VERSION = 1
WEIGHTS_FILE = "model.safetensors"
_LAYER_PREFIXES = ("layers.0.", "midlayer.")
_CPU = torch.device("cpu")
_IGNORED = frozenset({"embed_tokens.weight", "t2d"})  # a copy of the target's embedding; the inverse of d2t


def head_state(head: DraftHead) -> dict[str, torch.Tensor]:
    """The head's own tensors under the layout's names (``layers.0.*`` for the decoder layer)."""
    out = {f"layers.0.{k}": v for k, v in head.layer.state_dict().items()}
    out |= {f"fc.{k}": v for k, v in head.fc.state_dict().items()}
    if head.norm is not None:
        out |= {f"norm.{k}": v for k, v in head.norm.state_dict().items()}
    if head.lm_head is not None:
        out["lm_head.weight"] = head.lm_head.weight
        out["d2t"] = head.d2t
    return out


def _load_state(head: DraftHead, state: Mapping[str, torch.Tensor], where: Path) -> None:
    """Copy ``state`` (layout names) into the head, every tensor present with its shape, or a ConfigError."""
    want = head_state(head)
    problems = [f"{n} is missing" for n in sorted(set(want) - set(state))]
    problems += [f"unexpected tensor {n}" for n in sorted(set(state) - set(want))]
    problems += [
        f"{n} has shape {tuple(state[n].shape)}, expected {tuple(t.shape)}"
        for n, t in want.items()
        if n in state and state[n].shape != t.shape
    ]
    if problems:
        raise ConfigError(f"{where} does not fit a draft head for this target: {'; '.join(problems[:4])}")
    with torch.no_grad():
        for name, tensor in want.items():
            tensor.copy_(state[name].to(tensor.dtype))


def save_draft_head(
    head: DraftHead, directory: str | Path, dtype: torch.dtype | None = None, notes: Mapping[str, Any] | None = None
) -> Path:
    """Write ``head`` in splitspec's layout (tensors in ``dtype``, default the head's); ``notes`` go in the config."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    config = head.config
    fields = asdict(config)
    layer_config = fields.pop("layer_config")
    fields["feature_layers"] = list(config.feature_layers)
    fields["format_version"] = FORMAT_VERSION
    fields["notes"] = dict(notes or {})
    body = {**layer_config, "architectures": [], HEAD_KEY: fields}
    if dtype is not None:
        body["dtype"] = str(dtype).removeprefix("torch.")
    state = {
        k: (v if dtype is None or not v.is_floating_point() else v.to(dtype)).detach().cpu().contiguous()
        for k, v in head_state(head).items()
    }
    save_file(state, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(body, indent=2, sort_keys=True) + "\n")
    return out


def _read_json(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return raw


def _read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    path = directory / WEIGHTS_FILE
    if not path.is_file():
        extra = (
            " (pickled .bin weights are never loaded: convert them to safetensors)"
            if any(directory.glob("*.bin"))
            else ""
        )
        raise ConfigError(f"draft head {directory} has no {WEIGHTS_FILE}{extra}")
    try:
        with safe_open(str(path), framework="pt") as f:
            return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
    except (SafetensorError, OSError) as exc:
        raise ConfigError(f"{path} is not a readable safetensors file ({exc})") from None


def _target_of(target: Checkpoint | Path | str) -> tuple[str, str, Checkpoint | None]:
    """(fingerprint, name, checkpoint or None) of a target given as a checkpoint, a directory or a fingerprint."""
    if isinstance(target, str):
        return target, f"fingerprint {target[:12]}", None
    ckpt = target if isinstance(target, Checkpoint) else Checkpoint(target)
    return target_fingerprint(ckpt), ckpt.directory.name, ckpt


def _own_config(raw: dict[str, Any], where: Path) -> DraftHeadConfig:
    """The DraftHeadConfig of splitspec's layout, from config.json's fields, each checked."""
    fields = raw.pop(HEAD_KEY)
    if not isinstance(fields, dict) or fields.get("format_version") != FORMAT_VERSION:
        raise ConfigError(f"{where}: {HEAD_KEY} must be an object with format_version {FORMAT_VERSION}")
    if fields.get("logits_norm") not in LOGITS_NORMS:
        raise ConfigError(f"{where}: logits_norm must be one of {', '.join(LOGITS_NORMS)}")
    try:
        layers = tuple(int(k) for k in fields["feature_layers"])
        draft_vocab = fields.get("draft_vocab")
        config = DraftHeadConfig(
            target_fingerprint=str(fields["target_fingerprint"]),
            target_name=str(fields["target_name"]),
            feature_layers=layers,
            hidden_size=int(fields["hidden_size"]),
            layer_config={k: v for k, v in raw.items() if k not in ("architectures", "dtype")},
            draft_vocab=None if draft_vocab is None else int(draft_vocab),
            input_norm=bool(fields["input_norm"]),
            normed_features=bool(fields["normed_features"]),
            logits_norm=fields["logits_norm"],
            fc_bias=bool(fields["fc_bias"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {HEAD_KEY} is incomplete or malformed ({exc!r})") from None
    return config


def _published_config(
    raw: dict[str, Any], state: Mapping[str, torch.Tensor], ckpt: Checkpoint, where: Path
) -> tuple[DraftHeadConfig, dict[str, torch.Tensor]]:
    """The DraftHeadConfig of a head in the EAGLE layout, and its tensors renamed to ours; or a ConfigError
    saying what does not fit a standard decoder layer over this target."""
    hidden = int(ckpt.config.hidden_size)
    vocab = int(ckpt.config.vocab_size)
    prefix = next((p for p in _LAYER_PREFIXES if any(n.startswith(p) for n in state)), None)
    if prefix is None or "fc.weight" not in state:
        raise ConfigError(f"{where} is not a draft head: no fc.weight and no layers.0.* or midlayer.* tensors")
    if any(n.startswith(prefix + "hidden_norm.") for n in state) or "eagle_config" in raw:
        raise ConfigError(
            f"{where} is an EAGLE-3 head: its decoder layer attends over the embedding and the feature side by side "
            "(2H wide), which the family's standard decoder layer cannot run"
        )
    fc = state["fc.weight"]
    if fc.ndim != 2 or tuple(fc.shape) != (hidden, 2 * hidden):
        raise ConfigError(
            f"{where}: fc.weight is {tuple(fc.shape)}, but an EAGLE-1 head over this target (hidden {hidden}) needs "
            f"({hidden}, {2 * hidden}); heads over several layers' features (EAGLE-3) are not supported"
        )
    if int(raw.get("hidden_size", hidden)) != hidden:
        raise ConfigError(f"{where}: hidden size {raw.get('hidden_size')} is not the target's {hidden}")
    renamed = {("layers.0." + n[len(prefix) :] if n.startswith(prefix) else n): t for n, t in state.items()}
    renamed = {n: t for n, t in renamed.items() if n not in _IGNORED}
    lm_head = renamed.get("lm_head.weight")
    draft_vocab = None if lm_head is None else int(lm_head.shape[0])
    if lm_head is not None and "d2t" not in renamed:
        if draft_vocab != vocab:
            raise ConfigError(
                f"{where}: lm_head.weight has {draft_vocab} rows but no d2t maps them to the target's {vocab}"
            )
        renamed["d2t"] = torch.zeros(vocab, dtype=torch.long)
    if "d2t" in renamed:
        _check_d2t(renamed["d2t"], draft_vocab, vocab, where)
    layer_config = {k: v for k, v in raw.items() if k not in ("architectures", "auto_map", "dtype", "torch_dtype")}
    layer_config = {**layer_config, "num_hidden_layers": 1, "vocab_size": vocab}
    layer_config.setdefault("model_type", ckpt.config.model_type)
    layer_config.pop("layer_types", None)
    config = DraftHeadConfig(
        target_fingerprint=None,
        target_name=where.name,
        feature_layers=(int(ckpt.config.num_hidden_layers),),
        hidden_size=hidden,
        layer_config=layer_config,
        draft_vocab=draft_vocab,
        input_norm="layers.0.input_layernorm.weight" in renamed,
        normed_features=True,  # EAGLE-1 reads the target's last hidden state after its final norm
        logits_norm="own" if "norm.weight" in renamed else "none",
        fc_bias="fc.bias" in renamed,
    )
    return config, renamed


def _check_d2t(d2t: torch.Tensor, draft_vocab: int | None, vocab: int, where: Path) -> None:
    """d2t (Vd,) integer offsets mapping each draft id to a distinct target id in [0, V)."""
    if draft_vocab is None or d2t.ndim != 1 or d2t.shape[0] != draft_vocab or d2t.is_floating_point():
        raise ConfigError(f"{where}: d2t must be ({draft_vocab},) integer offsets, one per lm_head row")
    target_ids = torch.arange(draft_vocab) + d2t.to(torch.long)
    if bool((target_ids < 0).any() or (target_ids >= vocab).any()) or target_ids.unique().numel() != draft_vocab:
        raise ConfigError(
            f"{where}: d2t maps draft ids outside the target's vocabulary [0, {vocab}) or onto one id twice"
        )


def _check_hidden_size(config: DraftHeadConfig, hidden: int, target_name: str, where: Path) -> None:
    """A splitspec head reads and predicts the target's hidden states: its width must be the target's."""
    for width in (config.hidden_size, config.layer_config.get("hidden_size", config.hidden_size)):
        if width != hidden:
            raise ConfigError(
                f"draft head {where} is for hidden size {width!r:.20}, but {target_name}'s is {hidden}: "
                "it cannot draft for this target"
            )


def load_draft_head(
    directory: str | Path,
    target: Checkpoint | Path | str,
    device: torch.device = _CPU,
    dtype: torch.dtype = torch.float32,
    target_check: bool = True,
) -> DraftHead:
    """The head stored in ``directory`` for ``target`` (a checkpoint, its directory, or its fingerprint string).

    A splitspec head trained for another target raises ConfigError (one line naming both), unless
    ``target_check`` is False (then a warning). A published EAGLE-layout head has no fingerprint: it
    needs ``target_check=False`` and the target's checkpoint, whose shapes it must fit."""
    where = Path(directory)
    raw = _read_json(where / "config.json")
    state = _read_tensors(where)
    want, want_name, ckpt = _target_of(target)
    if HEAD_KEY in raw:
        config = _own_config(raw, where)
        if config.target_fingerprint != want:
            message = (
                f"draft head {where} was trained for {config.target_name} "
                f"(fingerprint {str(config.target_fingerprint)[:12]}), not for {want_name} (fingerprint {want[:12]})"
            )
            if target_check:
                raise ConfigError(message)
            log.warning("%s: loaded anyway (target check off)", message)
        if ckpt is not None:  # its shapes must fit whatever the fingerprint check said (off: it may be any head)
            check_feature_layers(config.feature_layers, int(ckpt.config.num_hidden_layers))
            _check_hidden_size(config, int(ckpt.config.hidden_size), want_name, where)
        if config.draft_vocab is not None:  # a reduced vocabulary (splitspec.models.draft_vocab)
            vocab = int(config.layer_config.get("vocab_size", 0)) if ckpt is None else int(ckpt.config.vocab_size)
            _check_d2t(state.get("d2t", torch.zeros(0)), config.draft_vocab, vocab, where)
    else:
        if target_check:
            raise ConfigError(
                f"draft head {where} carries no splitspec target fingerprint (a published EAGLE-layout head?): "
                "pass --draft-head-target-check off to load it on shape checks alone"
            )
        if ckpt is None:
            raise ConfigError(
                f"draft head {where} has no fingerprint: its target's checkpoint is needed for shape checks"
            )
        config, state = _published_config(raw, state, ckpt, where)
        log.info("draft head %s: EAGLE layout, loaded for %s on shape checks alone", where, want_name)
    head = DraftHead(config, device, dtype)
    _load_state(head, state, where)
    return head.eval().requires_grad_(False)
