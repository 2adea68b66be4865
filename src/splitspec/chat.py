"""``splitspec chat``: an interactive multi-turn session against a running trunk server.

The KV caches (edge and cloud) are kept across turns: each turn sends only its new tokens. Lines
starting with ``/`` are commands: ``/reset`` starts over, ``/quit`` (or end of input) leaves.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TextIO

from splitspec.decoding.sampling import SamplingParams
from splitspec.edge import EdgeConfig, SplitClient


@dataclass(frozen=True)
class ChatConfig:
    edge: EdgeConfig  # how to reach the trunk and which model to run
    max_new_tokens: int  # per turn
    params: SamplingParams  # temperature / top-p / seed
    speculate: str  # --speculate mode
    json_lines: bool = False  # print one JSON object per turn instead of streaming text


async def chat(config: ChatConfig, lines: Iterable[str], out: TextIO = sys.stdout) -> int:
    """Run turns read from ``lines``; returns the number of turns answered."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.edge.model_dir, local_files_only=True)
    generator, _ = config.params.generator()
    turns = 0
    carry: list[int] = []  # the last generated token: not in the caches yet
    async with SplitClient(config.edge) as client:
        if not config.json_lines:
            out.write("splitspec chat: type a line and press enter; /reset starts over, /quit leaves.\n> ")
            out.flush()
        for raw in lines:
            line = raw.rstrip("\n")
            if line.strip() == "/quit":
                break
            if line.strip() == "/reset":
                carry = []
                client.reset()
                out.write("(history cleared)\n> " if not config.json_lines else "")
                continue
            ids = [*carry, *tokenizer.encode(line + "\n")]
            if not ids:
                continue
            fresh = not carry
            first_step = len(client.steps)
            generated: list[int] = []
            shown = ""
            async for token in client.stream(
                ids,
                config.max_new_tokens,
                config.params,
                generator=generator,
                speculate=config.speculate,
                fresh=fresh,
            ):
                generated.append(token)
                if not config.json_lines:
                    text = str(tokenizer.decode(generated))
                    out.write(text[len(shown) :])
                    out.flush()
                    shown = text
            carry = generated[-1:]
            turns += 1
            steps = client.steps[first_step:]
            if config.json_lines:
                record = {
                    "turn": turns,
                    "input_ids": ids,
                    "token_ids": generated,
                    "text": tokenizer.decode(generated),
                    "sent_tokens": sum(s.query_tokens for s in steps),
                    "round_trips": len(steps),
                }
                out.write(json.dumps(record) + "\n")
            else:
                out.write("\n> ")
            out.flush()
    return turns
