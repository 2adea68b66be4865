"""A grammar request's tokenizer wrap (a second for a 128k vocabulary) runs off the server's event loop; a
tokenizer llguidance cannot read is a 400, not a 500."""

from __future__ import annotations

import threading
from typing import Any

import httpx
import llguidance.hf
import pytest

from tests.serve.conftest import MODEL_NAME, Stack

ROUTES: tuple[tuple[str, dict[str, Any]], ...] = (
    ("/completions", {"prompt": "to be"}),
    ("/chat/completions", {"messages": [{"role": "user", "content": "to be"}]}),
)


def structured(stack: Stack, route: str, body: dict[str, Any], stops: list[int]) -> httpx.Response:
    request = {"model": MODEL_NAME, "max_tokens": 4, "response_format": {"type": "json_object"}, **body}
    return httpx.post(f"{stack.base_url}{route}", json={**request, "stop_token_ids": stops}, timeout=60)


def test_wrapping_the_tokenizer_for_new_stop_tokens_leaves_the_event_loop_free(
    tool_stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    wrapped_on: list[threading.Thread] = []
    real = llguidance.hf.from_tokenizer

    def recording(*args: Any, **kwargs: Any) -> Any:
        wrapped_on.append(threading.current_thread())
        return real(*args, **kwargs)

    monkeypatch.setattr(llguidance.hf, "from_tokenizer", recording)
    for (route, body), stop in zip(ROUTES, (101, 102), strict=True):
        response = structured(tool_stack, route, body, [stop])
        assert response.status_code == 200, response.text
    assert len(wrapped_on) == 2  # one wrap per new set of stop tokens, found ready when the processor was made
    assert tool_stack._thread not in wrapped_on  # the loop serving every stream did not build it


@pytest.mark.parametrize(("route", "body"), ROUTES)
def test_a_tokenizer_llguidance_cannot_read_is_a_400(stack: Stack, route: str, body: dict[str, Any]) -> None:
    response = structured(stack, route, body, [7])  # the chat model's tokenizer has no decoder llguidance knows
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("grammar_unsupported", "response_format")
    assert "llguidance cannot read this tokenizer" in error["message"]
