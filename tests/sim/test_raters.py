"""The LLM user (--user-llm) against a scripted OpenAI-compatible endpoint."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from clawback.sim.raters import LLMRater
from clawback.sim.scenarios import TEACHER


def endpoint(reply: str, seen: list) -> httpx.MockTransport:
    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(200, json={"choices": [{"message": {"role": "assistant", "content": reply}}]})

    return httpx.MockTransport(handle)


def judge(reply: str, seen: list):
    rater = LLMRater(TEACHER, "http://user-llm/v1", "m", transport=endpoint(reply, seen))
    try:
        return asyncio.run(rater.judge("Wrong.", TEACHER.train[0]))
    finally:
        asyncio.run(rater.close())


def test_llm_user_rating_and_correction():
    seen: list = []
    g = judge("Too cold. \\boxed{3}\n[CORRECTION]Be kind and name the step.[/CORRECTION]", seen)
    assert (g.score, g.correction, g.checks) == (0.3, "Be kind and name the step.", None)
    body = seen[0]
    assert body["temperature"] == 0 and "friendly" in body["messages"][0]["content"]
    assert "Wrong." in body["messages"][1]["content"]
    assert judge("\\boxed{10}", []).correction is None
    assert judge("\\boxed{6}", []).correction == TEACHER.preference  # no words: its stated preference


def test_llm_user_without_a_rating_is_an_error():
    with pytest.raises(RuntimeError, match="no .boxed"):
        judge("I think it is fine.", [])
