"""From signals to training samples.

For every main call that got a next state or explicit feedback the store queues a sample in
state `pending_judge` (in the same transaction as the signal, so no signal is lost to a crash).
This pipeline turns it into `ready` or `dropped(reason)`:

- reward: the person's last 👍/👎 (+1/−1) is ground truth; otherwise the PRM judge's majority
  vote on the next state; otherwise 0.
- hint (methods opd/combined): distilled by the judge from the person's correction (the raw
  correction is kept, and used as the hint when no judge runs or none of its votes gives one),
  else from the next state.
- teacher logprobs: the stored response ids scored (never re-tokenised) under the teacher
  context, which is the request with the hint appended to the last user message (HINT_FORMAT);
  teacher `self` = the current policy (active adapter), `base` = the frozen base model.

It runs as a bounded pool of asyncio tasks beside the server, never on the serving path.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from dataclasses import replace
from typing import Any, Callable, Literal, Sequence

from clawback.chat import ChatRenderer, ChatRequest
from clawback.engine import Engine
from clawback.judge.backends import JudgeBackend
from clawback.judge.prm import Vote, VoteOptions, judge_hint, judge_prm
from clawback.records import Feedback, JudgedSample, SampleInputs, VoteRecord, parse_version

from .config import SignalConfig
from .store import Store

log = logging.getLogger(__name__)

# Appended to the last user message of the request to build the teacher context.
HINT_FORMAT = "\n\n[Hint for a better reply] {hint}"
MAX_RAW_HINT_CHARS = 1000
MAX_ATTEMPTS = 3


def degenerate_reply(inp: SampleInputs, min_loop_tokens: int = 32, max_period: int = 32) -> str | None:
    """Why a reply is no material to learn from, or None: no tokens (the client hung up before
    the first one, or generation failed), no visible content and no tool call, or a repetition
    loop (the reply ends in one short token sequence repeated over at least half of it)."""
    ids = inp.response_ids
    if not ids:
        return "empty_reply"
    if not inp.response_text.strip() and not inp.tool_calls:
        return "no_content"
    n = len(ids)
    if n >= min_loop_tokens:
        for period in range(1, max_period + 1):
            tail = period  # length of the suffix that repeats with this period
            while tail < n and ids[n - 1 - tail] == ids[n - 1 - tail + period]:
                tail += 1
            if tail >= max(n // 2, 4 * period, min_loop_tokens // 2):
                return "repetition_loop"
    return None


def explicit_reward(feedback: Sequence[Feedback]) -> float | None:
    """The last thumbs event wins (a person may change their mind)."""
    thumbs = [f.kind for f in feedback if f.kind in ("thumbs_up", "thumbs_down")]
    if not thumbs:
        return None
    return 1.0 if thumbs[-1] == "thumbs_up" else -1.0


def latest_correction(feedback: Sequence[Feedback]) -> str | None:
    texts = [f.text for f in feedback if f.kind == "correction" and f.text and f.text.strip()]
    return texts[-1].strip() if texts else None


def teacher_messages(messages: list[dict[str, Any]], hint: str) -> list[dict[str, Any]]:
    """The request with the hint appended to its last user message (a new one if there is none)."""
    out = copy.deepcopy(messages)
    suffix = HINT_FORMAT.format(hint=hint)
    for m in reversed(out):
        if m.get("role") == "user":
            if isinstance(m.get("content"), list):
                m["content"].append({"type": "text", "text": suffix.lstrip("\n")})
            else:
                m["content"] = (m.get("content") or "") + suffix
            return out
    out.append({"role": "user", "content": suffix.lstrip("\n")})
    return out


def _vote_records(kind: Literal["prm", "hint"], backend_name: str, votes: Sequence[Vote]) -> list[VoteRecord]:
    return [VoteRecord(kind=kind, backend=backend_name, prompt_version=v.prompt_version, score=v.score,
                       hint=v.hint, raw=v.raw, error=v.error) for v in votes]


class SamplePipeline:
    def __init__(self, store: Store, engine: Engine, renderer: ChatRenderer, backend: JudgeBackend | None,
                 cfg: SignalConfig, on_ready: Callable[[dict[str, Any]], None] = lambda _: None) -> None:
        self.store, self.engine, self.renderer, self.backend, self.cfg = store, engine, renderer, backend, cfg
        self.on_ready = on_ready
        self._wake = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inflight: set[str] = set()
        self._attempts: dict[str, int] = {}
        self._sem = asyncio.Semaphore(cfg.concurrency)

    @property
    def busy(self) -> bool:
        """Some sample is being judged right now."""
        return bool(self._inflight)

    def wake(self) -> None:
        """Thread-safe: new work may be waiting (called from the store's writer thread)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    async def run(self, poll_s: float = 5.0) -> None:
        self._loop = asyncio.get_running_loop()
        tasks: set[asyncio.Task[None]] = set()
        try:
            while True:
                self._wake.clear()
                for call_id, revision in await asyncio.to_thread(self.store.pending_samples, 64):
                    if call_id not in self._inflight:
                        self._inflight.add(call_id)
                        task = asyncio.create_task(self._guarded(call_id, revision))
                        tasks.add(task)
                        task.add_done_callback(tasks.discard)
                try:
                    await asyncio.wait_for(self._wake.wait(), poll_s)
                except asyncio.TimeoutError:
                    pass
        finally:
            for t in tasks:
                t.cancel()

    async def _guarded(self, call_id: str, revision: int) -> None:
        try:
            async with self._sem:
                await self.process(call_id, revision)
            self._attempts.pop(call_id, None)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            n = self._attempts[call_id] = self._attempts.get(call_id, 0) + 1
            log.exception("building the sample for %s failed (attempt %d)", call_id, n)
            if n >= MAX_ATTEMPTS:  # give up with a recorded reason rather than retry forever
                self._attempts.pop(call_id, None)
                await self.store.write_sample(JudgedSample(call_id=call_id, revision=revision, state="dropped",
                                                           reason=f"processing_failed: {e}"[:500]))
        finally:
            self._inflight.discard(call_id)

    async def process(self, call_id: str, revision: int) -> None:
        inp = await asyncio.to_thread(self.store.sample_inputs, call_id)
        if inp is None or inp.state != "pending_judge" or inp.revision != revision:
            return  # already handled, or a newer signal re-queued it
        cfg, backend = self.cfg, self.backend
        messages, response, next_state = inp.request["messages"], inp.response_text, inp.next_state
        votes: list[VoteRecord] = []
        sample = JudgedSample(call_id=call_id, revision=revision, state="dropped", method=cfg.method,
                              teacher=cfg.teacher)
        degenerate = degenerate_reply(inp)
        if degenerate is not None:
            await self._write(replace(sample, reason=degenerate), votes)
            return
        judge_kw: VoteOptions = {"m": cfg.judge_votes, "temperature": cfg.judge_temperature,
                                 "max_tokens": cfg.judge_max_tokens, "timeout_s": cfg.judge_timeout_s,
                                 "retries": cfg.judge_retries, "context": cfg.judge_context}

        reward = explicit_reward(inp.feedback)
        reward_source = "explicit" if reward is not None else "none"
        if reward is None and next_state and backend is not None:
            verdict = await judge_prm(backend, messages, response, next_state, **judge_kw)
            votes += _vote_records("prm", backend.name, verdict.votes)
            if verdict.score is None:  # every vote failed
                await self._write(replace(sample, reward_source=reward_source, reason="judge_failed"), votes)
                return
            sample = replace(sample, judge_score=verdict.score)
            reward, reward_source = float(verdict.score), "judge"
        reward = reward or 0.0
        correction = latest_correction(inp.feedback)
        sample = replace(sample, reward=reward, reward_source=reward_source, correction=correction)

        if cfg.method in ("opd", "combined"):
            hint, source = None, None
            hint_evidence = [{"role": "user", "content": correction}] if correction else next_state
            if hint_evidence and backend is not None:
                hv = await judge_hint(backend, messages, response, hint_evidence, **judge_kw)
                votes += _vote_records("hint", backend.name, hv.votes)
                hint, source = hv.hint, ("correction" if correction else "next_state")
            if hint is None and correction:  # the person's own words are the best hint we have
                hint, source = correction[:MAX_RAW_HINT_CHARS], "correction_raw"
            if hint is not None:
                sample = await self._teacher(inp, replace(sample, hint=hint, hint_source=source))

        has_teacher = sample.teacher_logprobs is not None
        has_signal = {"binary": reward != 0, "opd": has_teacher, "combined": reward != 0 or has_teacher}[cfg.method]
        keep = has_signal or cfg.count_zero_signal
        sample = replace(sample, state="ready" if keep else "dropped",
                         reason=None if keep else sample.reason or "no_signal")
        if await self._write(sample, votes) and keep:
            self.on_ready({"call_id": call_id, "session_id": inp.session_id, "reward": reward,
                           "reward_source": reward_source, "hint": sample.hint is not None})

    async def _teacher(self, inp: SampleInputs, sample: JudgedSample) -> JudgedSample:
        """The sample with the teacher logprobs of the exact stored response ids under the hinted
        context, or with the reason there are none."""
        assert sample.hint is not None
        msgs = teacher_messages(inp.request["messages"], sample.hint)
        req = ChatRequest.model_validate({**inp.request, "messages": msgs})
        _, prompt_ids = await asyncio.to_thread(self.renderer.render, req)
        if len(prompt_ids) + len(inp.response_ids) > self.engine.info.context_length:
            return replace(sample, reason="teacher_context_too_long")
        adapter = self.engine.active_version() if self.cfg.teacher == "self" else None
        logprobs = await self.engine.score(prompt_ids, inp.response_ids, adapter)
        return replace(sample, teacher_adapter=parse_version(adapter), teacher_messages=msgs,
                       teacher_prompt_ids=list(prompt_ids), teacher_logprobs=logprobs)

    async def _write(self, sample: JudgedSample, votes: list[VoteRecord]) -> bool:
        return await self.store.write_sample(replace(sample, votes=tuple(votes)))
