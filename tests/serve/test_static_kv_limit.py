"""With ``--compile`` the edge's static KV buffers bound a request, not the model's positions: a request without
``max_tokens`` gets the room they leave (it got a 400 "exceeds the edge's static KV size" every time)."""

from __future__ import annotations

from collections.abc import Callable

import httpx

from tests.serve.conftest import MODEL_NAME, Stack

CACHE = 64  # positions the edge's static KV buffers hold


def test_a_request_without_max_tokens_fits_the_edges_static_kv(
    make_stack: Callable[..., Stack], compile_backend: str
) -> None:
    stack = make_stack(edge_options={"compile": "auto", "compile_backend": compile_backend, "max_cache_tokens": CACHE})
    assert stack.state.max_positions == CACHE
    body = {"model": MODEL_NAME, "prompt": "to be or not to be", "temperature": 0}
    response = httpx.post(f"{stack.base_url}/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] <= CACHE
    info = httpx.get(f"{stack.base_url.removesuffix('/v1')}/tokenizer_info", timeout=30).json()
    assert info["model_max_length"] == CACHE  # what lm-eval sizes its requests by
