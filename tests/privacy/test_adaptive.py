"""T2 attackers on tiny models: they adapt to a transformed deployment, and never learn its labels."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from splitspec.models.checkpoint import Checkpoint
from splitspec.models.loading import load_full
from splitspec.privacy import adaptive
from splitspec.privacy.activations import collect_layers
from splitspec.privacy.adaptive import Traffic, align, self_train
from splitspec.privacy.attackers import TrainConfig, train_inverter

torch.set_num_threads(1)

FAST = TrainConfig(seq_epochs=6, batch_windows=4, gru_hidden=32, bottleneck=64, lr=1e-2, dropout=0.0)
K = 1  # stream index attacked: after one layer


def windows(rng: np.random.Generator, n: int, vocab: list[int], q: int = 16) -> np.ndarray:
    tokens = rng.choice(vocab, size=(n, q + 1))
    tokens[:, 0] = 0  # BOS
    return tokens


def deployment(acts: np.ndarray, seed: int = 7) -> np.ndarray:
    """A 'defended' deployment: every feature rescaled and shifted (what re-standardisation undoes)."""
    rng = np.random.default_rng(seed)
    scale = rng.uniform(0.2, 5.0, size=acts.shape[-1])
    shift = rng.normal(0, 3.0, size=acts.shape[-1])
    return (acts * scale + shift).astype(np.float32)


@pytest.fixture(scope="module")
def setting(make_checkpoint: Callable[..., Path]) -> dict[str, object]:
    full = load_full(Checkpoint(make_checkpoint("llama", layers=4)), torch.float32)
    rng = np.random.default_rng(0)
    public_vocab = list(range(3, 40))
    canary = 77  # only the deployment's users ever write this token
    public = windows(rng, 24, public_vocab)
    traffic = windows(rng, 24, public_vocab)
    traffic[:, 1::3] = canary
    test = windows(rng, 12, public_vocab)
    acts = {
        name: collect_layers(full, t, [K])[K] for name, t in (("public", public), ("traffic", traffic), ("test", test))
    }
    stock_inv = train_inverter("bigru", acts["public"][:, 1:], public[:, 1:], FAST)
    return {
        "full": full,
        "public": public,
        "traffic": traffic,
        "test": test,
        "acts": acts,
        "stock": stock_inv,
        "canary": canary,
    }


def _view(full: torch.nn.Module) -> adaptive.PublicView:
    return lambda tokens: collect_layers(full, tokens, [K])[K]  # type: ignore[arg-type]


def test_t2_api_takes_activations_only() -> None:
    """T2 entry points have no parameter that could carry the traffic's tokens, and Traffic refuses ids."""
    for fn in (self_train, align):
        params = set(inspect.signature(fn).parameters)
        assert not params & {"targets", "labels", "tokens", "traffic_tokens"}
    with pytest.raises(TypeError, match="float activations"):
        Traffic(np.zeros((2, 3, 4), dtype=np.int64))
    with pytest.raises(TypeError, match="float activations"):
        Traffic(np.zeros((2, 3), dtype=np.float32))


def test_t2_never_learns_a_token_only_the_traffic_contains(setting: dict[str, object]) -> None:
    """If labels reached T2 it would learn the canary, as T3 (which is given them) does."""
    acts, traffic, canary = setting["acts"], setting["traffic"], setting["canary"]
    assert isinstance(acts, dict)
    assert isinstance(traffic, np.ndarray)
    seen = Traffic(acts["traffic"][:, 1:])
    t3 = train_inverter("bigru", acts["traffic"][:, 1:], traffic[:, 1:], FAST)
    assert canary in t3.classes
    t3_top1 = t3.predict_top5(acts["traffic"][:, 1:])[..., 0]
    assert (t3_top1[traffic[:, 1:] == canary] == canary).mean() > 0.5  # the canary is learnable from labels
    t2s = self_train(setting["stock"], seen, FAST)  # type: ignore[arg-type]
    t2a = align(setting["stock"], seen, _view(setting["full"]), bos_id=0)  # type: ignore[arg-type]
    assert canary not in t2s.classes
    assert canary not in t2a.inner.classes
    for t2 in (t2s, t2a):
        assert not (t2.predict_top5(acts["traffic"][:, 1:]) == canary).any()


def test_t2_adapts_where_t1_fails(setting: dict[str, object]) -> None:
    """On a per-feature-rescaled deployment T1 collapses; both T2 attackers recover, without labels."""
    acts, test, stock = setting["acts"], setting["test"], setting["stock"]
    assert isinstance(acts, dict)
    assert isinstance(test, np.ndarray)
    targets = test[:, 1:]
    deployed_traffic = Traffic(deployment(acts["traffic"][:, 1:]))
    deployed_test = deployment(acts["test"][:, 1:])

    def top1(inv: object, x: np.ndarray) -> float:
        return float((inv.predict_top5(x)[..., 0] == targets).mean())  # type: ignore[attr-defined]

    clean = top1(stock, acts["test"][:, 1:])
    t1 = top1(stock, deployed_test)
    t2s = top1(self_train(stock, deployed_traffic, FAST), deployed_test)  # type: ignore[arg-type]
    t2a = top1(align(stock, deployed_traffic, _view(setting["full"]), bos_id=0), deployed_test)  # type: ignore[arg-type]
    assert clean > 0.6
    assert t1 < 0.5 * clean
    assert t2s > t1 + 0.2, (clean, t1, t2s)
    assert t2a > t1 + 0.2, (clean, t1, t2a)
