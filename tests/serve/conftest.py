"""Fixtures for the OpenAI server tests: a tiny checkpoint with a chat template, and a stack of
real servers on loopback (trunk, WAN emulator, edge HTTP server) on a background event loop, so
that the official synchronous and asynchronous ``openai`` clients can both drive it."""

from __future__ import annotations

import asyncio
import shutil
import threading
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from splitspec.cloud.config import CloudConfig
from splitspec.cloud.server import TrunkServer
from splitspec.edge import EdgeConfig
from splitspec.netem.emulator import WanEmulator
from splitspec.netem.schedule import NetemConfig
from splitspec.serve.config import ServeConfig
from splitspec.serve.server import RunningServer
from tests.conftest import TOKENIZER_TEXT, VOCAB

T = TypeVar("T")
MODEL_NAME = "tiny-chat"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
SPECIALS = ["<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]


def save_chat_tokenizer(directory: Path) -> None:
    """The tiny BPE tokenizer plus role markers as special tokens and a chat template."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([TOKENIZER_TEXT] * 4, trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        additional_special_tokens=SPECIALS[3:],
    )  # fmt: skip
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)


@pytest.fixture(scope="session")
def chat_model(make_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama whose tokenizer carries a chat template (nothing downloaded)."""
    directory = tmp_path_factory.mktemp("chat-llama")
    shutil.copytree(make_checkpoint("llama"), directory, dirs_exist_ok=True)
    save_chat_tokenizer(directory)
    return directory


class Stack:
    """Trunk server -> WAN emulator -> ``splitspec serve`` app, all on one background loop."""

    def __init__(
        self, model: Path, rtt_ms: float = 0.0, edge_options: dict[str, Any] | None = None, **serve: Any
    ) -> None:
        self.model = model
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.trunk: TrunkServer | None = None
        self.trunk_port = 0
        self.call(self.start_trunk())
        self.emulator = self.call(WanEmulator(NetemConfig(upstream_port=self.trunk_port, rtt_ms=rtt_ms)).start())
        serve.setdefault("served_model_name", MODEL_NAME)
        edge = {"allow_stock_edge_weights": True, "reconnect_timeout_s": 1.0, **(edge_options or {})}
        serve.setdefault("edge", EdgeConfig(
            model_dir=model, cloud_url=f"ws://127.0.0.1:{self.emulator.port}", **edge,
        ))  # fmt: skip
        self.server = RunningServer(ServeConfig(port=0, **serve))
        self.call(self.server.__aenter__())
        self.base_url = self.server.base_url

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 120.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def start_trunk(self) -> None:
        """(Re)start the trunk, on the same port as before if it ran already."""
        self.trunk = TrunkServer(CloudConfig(model_dir=self.model, port=self.trunk_port))
        await self.trunk.start()
        self.trunk_port = self.trunk.port

    async def stop_trunk(self) -> None:
        if self.trunk is not None:
            await self.trunk.stop()
            self.trunk = None

    def trunk_sessions(self) -> int:
        assert self.trunk is not None
        return len(self.trunk.sessions)

    @property
    def state(self) -> Any:
        return self.server.state

    def close(self) -> None:
        self.call(self.server.__aexit__(None, None, None))
        self.call(self.emulator.aclose())
        self.call(self.stop_trunk())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


@pytest.fixture(scope="session")
def stack(chat_model: Path) -> Iterator[Stack]:
    """One shared stack for every test that does not stop the trunk or need special settings."""
    s = Stack(chat_model)
    yield s
    s.close()


@pytest.fixture(scope="session")
def tool_stack(tool_model: Path) -> Iterator[Stack]:
    """A stack serving the tiny tool-calling checkpoint (byte-level tokenizer, Qwen2.5-style template)."""
    s = Stack(tool_model)
    yield s
    s.close()


@pytest.fixture
def make_stack(chat_model: Path) -> Iterator[Callable[..., Stack]]:
    """A private stack per test (killed trunks, a slow link, small pools); closed afterwards."""
    made: list[Stack] = []

    def build(**kw: Any) -> Stack:
        made.append(Stack(chat_model, **kw))
        return made[-1]

    yield build
    for s in made:
        s.close()
