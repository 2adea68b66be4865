"""``splitspec chat``: an interactive multi-turn session against a running trunk server.

With a tokenizer that has a chat template (instruct checkpoints), every turn renders the whole
conversation with it (:mod:`splitspec.chat_template`) and sends only what the caches (edge and
cloud) do not already hold; a turn ends at the template's end-of-turn token or the checkpoint's
stop tokens. Without one (base models), or with ``plain=True``, each line is plain text appended
to the running context (special tokens such as BOS only at the very start). Lines starting with
``/`` are commands: ``/reset`` starts over, ``/quit`` (or end of input) leaves.

Lines are read off the event loop (on a daemon thread, one line at a time): while the user types,
the loop keeps answering the trunk connection's keepalive pings, so a long pause does not lose
the connection (and the conversation's cloud cache with it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TextIO

from transformers import PreTrainedTokenizerBase

from splitspec.chat_template import Message, end_of_turn_ids, has_chat_template, plan_turn, render
from splitspec.decoding.adjusters import RepetitionPenalty
from splitspec.decoding.sampling import SamplingParams
from splitspec.detokenize import IncrementalText
from splitspec.edge import EdgeConfig, SplitClient
from splitspec.exceptions import ConfigError
from splitspec.models.checkpoint import load_tokenizer


def _template_error(exc: Exception) -> bool:
    """A Jinja error: the chat template's own ``raise_exception``, or a template that does not parse (jinja2 is
    transformers' dependency, not ours: told by its module)."""
    return type(exc).__module__.split(".")[0] == "jinja2"


@dataclass(frozen=True)
class ChatConfig:
    edge: EdgeConfig  # how to reach the trunk and which model to run
    max_new_tokens: int  # per turn
    params: SamplingParams  # temperature / top-p / seed
    speculate: str  # --speculate mode
    json_lines: bool = False  # print one JSON object per turn instead of streaming text
    system_prompt: str | None = None  # a system message opening the conversation (chat template only)
    plain: bool = False  # ignore the chat template: plain text turns (base models)
    repetition_penalty: float = 1.0  # over the whole conversation so far (transformers' rule); 1: off


class Conversation:
    """The turns so far and how to turn the next user line into tokens for the caches."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, config: ChatConfig) -> None:
        self.tokenizer = tokenizer
        self.templated = has_chat_template(tokenizer) and not config.plain
        if config.system_prompt is not None and not self.templated:
            raise ConfigError("--system needs a tokenizer with a chat template (this one has none, or --plain)")
        self.system = config.system_prompt
        self.messages: list[Message] = []
        self.stop_ids = frozenset[int]()
        if self.templated:
            try:
                self.stop_ids = end_of_turn_ids(tokenizer)
            except Exception as exc:
                if not _template_error(exc):
                    raise
                raise ConfigError(f"the chat template refused a one-exchange conversation: {exc}") from None
            if self.system is not None:  # a template that refuses a system role says so now, before connecting
                self._render([{"role": "system", "content": self.system}, {"role": "user", "content": "hi"}])
        self.reset()

    def _render(self, messages: list[Message]) -> list[int]:
        try:
            return render(self.tokenizer, messages)
        except Exception as exc:  # the template's own raise_exception (e.g. Gemma's: no system role)
            if not _template_error(exc):
                raise
            system = " (--system)" if any(m["role"] == "system" for m in messages) else ""
            raise ConfigError(f"the chat template refused the conversation{system}: {exc}") from None

    def reset(self) -> None:
        self.messages = [] if self.system is None else [{"role": "system", "content": self.system}]

    def rendered(self, line: str, cached: tuple[int, ...]) -> list[int]:
        """The whole context this turn's generation continues from."""
        if self.templated:
            self.messages.append({"role": "user", "content": line})
            try:
                return self._render(self.messages)
            except ConfigError:
                self.retract()
                raise
        return [*cached, *self.tokenizer.encode(line + "\n", add_special_tokens=not cached)]

    def retract(self) -> None:
        """Forget the line just passed to :meth:`rendered` (its turn did not run)."""
        if self.templated:
            self.messages.pop()

    def reply(self, generated: list[int]) -> str:
        text = str(self.tokenizer.decode([t for t in generated if t not in self.stop_ids], skip_special_tokens=True))
        if self.templated:
            self.messages.append({"role": "assistant", "content": text})
        return text


def _deliver(future: asyncio.Future[str | None], line: str | None, error: BaseException | None) -> None:
    if future.done():  # the reader was cancelled meanwhile
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(line)


async def next_line(lines: Iterator[str]) -> str | None:
    """The next item of ``lines`` (None at its end), read on a daemon thread: the event loop runs meanwhile.

    A daemon thread, not the loop's default executor: a read still blocked on a terminal when the
    program leaves (Ctrl-C) must not hold up the interpreter's exit."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[str | None] = loop.create_future()

    def read() -> None:
        line: str | None = None
        error: BaseException | None = None
        try:
            line = next(lines, None)
        except BaseException as exc:  # handed to the awaiting coroutine, raised there
            error = exc
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits for this line any more
            loop.call_soon_threadsafe(_deliver, future, line, error)

    threading.Thread(target=read, name="splitspec-chat-input", daemon=True).start()
    return await future


async def chat(config: ChatConfig, lines: Iterable[str], out: TextIO = sys.stdout) -> int:
    """Run turns read from ``lines`` (read off the event loop, see :func:`next_line`); returns the number of
    turns answered."""
    tokenizer = load_tokenizer(config.edge.model_dir)
    conversation = Conversation(tokenizer, config)
    turns = 0
    carry: list[int] = []  # the last generated token: not in the caches yet
    async with SplitClient(config.edge) as client:
        generator, _ = client.runtime.generator(config.params)  # where the edge's logits live (CUDA: on CUDA)
        stops = client.eos_token_ids | conversation.stop_ids
        if not config.json_lines:
            out.write("splitspec chat: type a line and press enter; /reset starts over, /quit leaves.\n> ")
            out.flush()
        source = iter(lines)
        while (raw := await next_line(source)) is not None:
            line = raw.rstrip("\n")
            if line.strip() == "/quit":
                break
            if line.strip() == "/reset":
                carry = []
                client.reset()
                conversation.reset()
                out.write("(history cleared)\n> " if not config.json_lines else "")
                continue
            try:  # a turn the template refuses, or that cannot fit: say so and keep the conversation as it was
                context = conversation.rendered(line, (*client.history, *carry))
                plan = plan_turn(client.history, context)
                try:
                    client.check_length(len(plan.send), config.max_new_tokens, plan.keep)
                except ConfigError:
                    conversation.retract()
                    raise
            except ConfigError as exc:
                out.write(
                    json.dumps({"error": str(exc)}) + "\n" if config.json_lines else f"({exc}; /reset starts over)\n> "
                )
                out.flush()
                continue
            client.truncate(plan.keep)
            first_step = len(client.steps)
            generated: list[int] = []
            streamed = IncrementalText(lambda ids: str(tokenizer.decode(ids)))
            async for token in client.stream(
                plan.send,
                config.max_new_tokens,
                config.params,
                stop_token_ids=stops,
                generator=generator,
                speculate=config.speculate,
                fresh=plan.keep == 0,
                processor=None if config.repetition_penalty == 1.0 else RepetitionPenalty(config.repetition_penalty),
            ):
                generated.append(token)
                if not config.json_lines and token not in stops:
                    out.write(streamed.push(token))
                    out.flush()
            if not config.json_lines:
                out.write(streamed.finish())
            carry = generated[-1:]
            text = conversation.reply(generated)
            turns += 1
            steps = client.steps[first_step:]
            if config.json_lines:
                record = {
                    "turn": turns,
                    "input_ids": context,
                    "sent_ids": plan.send,
                    "token_ids": generated,
                    "text": text,
                    "sent_tokens": sum(s.query_tokens for s in steps),
                    "round_trips": len(steps),
                }
                out.write(json.dumps(record) + "\n")
            else:
                out.write("\n> ")
            out.flush()
    return turns
