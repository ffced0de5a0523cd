"""Where judge votes come from: the daemon's own engine, or any OpenAI-compatible server.

A backend turns chat messages into one reply text. It raises on failure; the caller (prm.py)
turns any failure into a failed vote, so a broken judge never breaks the daemon.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, cast

import httpx
from pydantic import ValidationError

from clawback.chat import ChatRenderer, ChatRequest
from clawback.engine import Engine, Sampling
from clawback.records import JsonObject

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# A judge needs room for a little reasoning and the \boxed{} answer; a prompt leaving less than
# this many tokens of context is refused up front instead of producing a truncated, useless vote.
MIN_ANSWER_TOKENS = 32


class JudgeBackendError(RuntimeError):
    pass


class PromptTooLongError(JudgeBackendError):
    """The judge prompt does not fit the judge model's context; retrying cannot help."""


class JudgeBackend(Protocol):
    name: str  # stored with every verdict, e.g. "engine:SmolLM2-135M-Instruct"

    async def complete(
        self, messages: Sequence[JsonObject], *, temperature: float, max_tokens: int, seed: int | None = None
    ) -> str: ...


class EngineBackend:
    """Judges with a daemon engine's *base* model: adapter None, never the adapter being trained,
    so the reward does not drift with (or get gamed by) the policy it grades."""

    def __init__(self, engine: Engine, renderer: ChatRenderer, tokenizer: PreTrainedTokenizerBase, name: str | None = None) -> None:
        self.engine, self.renderer, self.tokenizer = engine, renderer, tokenizer
        self.name = name or f"engine:{engine.info.name}"

    async def complete(
        self, messages: Sequence[JsonObject], *, temperature: float, max_tokens: int, seed: int | None = None
    ) -> str:
        try:
            req = ChatRequest.model_validate({"model": self.engine.info.name, "messages": list(messages)})
        except ValidationError as e:
            raise JudgeBackendError(f"judge messages are not a valid chat request: {e}") from None
        _, prompt_ids = await asyncio.to_thread(self.renderer.render, req)
        info = self.engine.info
        room = info.context_length - len(prompt_ids)
        if room < min(max_tokens, MIN_ANSWER_TOKENS):
            raise PromptTooLongError(
                f"judge prompt is {len(prompt_ids)} tokens; the judge model {info.name!r} has a context of "
                f"{info.context_length} tokens and needs room to answer"
            )
        eos = set(info.eos_token_ids)
        sampling = Sampling(
            temperature=temperature, top_p=1.0, max_tokens=min(max_tokens, room), seed=seed,
            stop_token_ids=info.eos_token_ids,
        )
        out: list[int] = []
        stream = self.engine.generate(prompt_ids, sampling, None, background=True)
        try:
            async for token in stream:
                if token.id in eos:
                    break
                out.append(token.id)
        finally:
            await stream.aclose()  # also reached when a vote's timeout cancels us: frees the engine slot
        return cast(str, self.tokenizer.decode(out, skip_special_tokens=True))  # one list of ids: one text


class OpenAIBackend:
    """Judges with any OpenAI-compatible server (a second clawback daemon, vLLM, llama.cpp, ...).

    `base_url` is the API root the OpenAI client would take, e.g. `http://127.0.0.1:8000/v1`.
    """

    def __init__(self, base_url: str, api_key: str | None, model: str, timeout_s: float = 120.0) -> None:
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.name = f"openai:{model}"
        # Tagged side so that a clawback daemon serving as judge never trains on judge calls.
        self._headers = {"X-Turn-Type": "side"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._timeout = timeout_s
        self._client: httpx.AsyncClient | None = None  # made on first use, inside the caller's loop

    async def complete(
        self, messages: Sequence[JsonObject], *, temperature: float, max_tokens: int, seed: int | None = None
    ) -> str:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self._timeout, headers=self._headers)
        body: JsonObject = {
            "model": self.model, "messages": list(messages), "temperature": temperature,
            "max_tokens": max_tokens, "stream": False,
        }
        if seed is not None:
            body["seed"] = seed
        try:
            resp = await self._client.post(self.url, json=body)
        except httpx.HTTPError as e:
            raise JudgeBackendError(f"judge server {self.url} unreachable: {type(e).__name__}: {e}") from None
        if resp.status_code != 200:
            message, code = _error_detail(resp)
            error = PromptTooLongError if code == "context_length_exceeded" else JudgeBackendError
            raise error(f"judge server {self.url} answered HTTP {resp.status_code} for model {self.model!r}: {message}")
        try:
            return resp.json()["choices"][0]["message"].get("content") or ""
        except (ValueError, KeyError, IndexError, TypeError):
            raise JudgeBackendError(f"judge server {self.url} sent no chat completion: {resp.text[:200]}") from None

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def __aenter__(self) -> OpenAIBackend:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _error_detail(resp: httpx.Response) -> tuple[str, str | None]:
    """The OpenAI-style error message and code, or the start of the body when it has none."""
    try:
        error = resp.json().get("error")
        if isinstance(error, dict):
            return str(error.get("message")), error.get("code")
        if error:
            return str(error), None
    except ValueError:
        pass
    return resp.text[:200] or resp.reason_phrase, None
