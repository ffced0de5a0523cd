"""From signals to training samples.

For every main call that got a next state or explicit feedback the store queues a sample in
state `pending_judge` (in the same transaction as the signal, so no signal is lost to a crash).
This pipeline turns it into `ready` or `dropped(reason)`:

- reward: the person's last 👍/👎 (+1/−1) is ground truth; otherwise the newest outcome event's
  credit to the call; otherwise what its tool results state (outcome rules, outcomes.py);
  otherwise the PRM judge's majority vote on the next state; otherwise 0.
- hint (methods opd/combined): distilled by the judge from the person's correction (the raw
  correction is kept, and used as the hint when no judge runs or none of its votes gives one),
  else a failed outcome's text (the tool's error, the environment's words), else distilled
  from the next state.
- teacher logprobs: the stored response ids scored (never re-tokenised) under the teacher
  context, which is the request with the hint appended to the last user message (HINT_FORMAT);
  teacher `self` = the version that served the call, `base` = the frozen base model. Top-K OPD
  also scores the policy's top-K recorded at serve time (every engine can); a sample with a
  teacher that trains token-level records why (`token_level_reason`).
- the student context (`consolidate_notes`): a reply served with preference notes trains in its
  request without them, against the serving version's logprobs there (`_consolidate`); a liked
  one without a hint has the base model given the served request, notes included, as its teacher.

It runs as a bounded pool of asyncio tasks beside the server, never on the serving path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Literal

from clawback.chat import ChatRenderer, ChatRequest, append_text
from clawback.engine import Engine, EngineError, Sampling
from clawback.judge.backends import JudgeBackend
from clawback.judge.prm import Vote, VoteOptions, candidate_hints, judge_hint, judge_prm
from clawback.records import Feedback, JsonObject, JudgedSample, SampleInputs, Version, VoteRecord

from .config import SignalConfig
from .memory import strip
from .outcomes import tool_outcome
from .probes import ends_in_loop
from .store import Store

log = logging.getLogger(__name__)

# How the hint reaches the teacher. "hint" is the OpenClaw-RL wording; "instruction" states the
# correction as an instruction about the reply to write. Placement: appended to the last user
# message ("user") or to the system prompt ("system"). The default, "hint" in the user message, is
# the combination the told model follows most often (bench/in_context_following.py; bench/README.md,
# "In-context following").
HINT_TEMPLATES = {
    "instruction": "When you write your reply, follow this instruction from the user about it: {hint}",
    "hint": "[Hint for a better reply] {hint}",
}
HINT_FORMAT = "\n\n" + HINT_TEMPLATES["hint"]
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
    return "repetition_loop" if ends_in_loop(ids, min_loop_tokens, max_period) else None


def explicit_reward(feedback: Sequence[Feedback]) -> float | None:
    """The last thumbs event wins (a person may change their mind)."""
    thumbs = [f.kind for f in feedback if f.kind in ("thumbs_up", "thumbs_down")]
    if not thumbs:
        return None
    return 1.0 if thumbs[-1] == "thumbs_up" else -1.0


def latest_correction(feedback: Sequence[Feedback]) -> str | None:
    texts = [f.text for f in feedback if f.kind == "correction" and f.text and f.text.strip()]
    return texts[-1].strip() if texts else None


def teacher_messages(messages: list[JsonObject], hint: str, template: str = "hint",
                     placement: str = "user") -> list[JsonObject]:
    """The request with the hint, worded by `template`, in the last user message or the system prompt."""
    return append_text(messages, placement, HINT_TEMPLATES[template].format(hint=hint))


def degenerate(response_ids: list[int], finish_reason: str | None, liked: bool = False) -> str | None:
    """Why a reply cannot be trained on as it is, or None: empty, cut off by the token budget (no
    finished answer), or a repetition loop (see `repetition_loop`). In a reply the person liked, a
    6-token run said three times is a restated phrase: step-by-step work names its quantities again
    ("the total number of pencils in"), and on Qwen2.5-Coder-0.5B the run rule flagged a quarter of
    the liked replies (bench/README.md, "32 sessions of `default_consolidated`"); a liked reply that
    ends in a loop is still dropped (`degenerate_reply`)."""
    if not response_ids:
        return "empty_response"
    if finish_reason == "length":
        return "cut_off"
    return "repetition_loop" if not liked and repetition_loop(response_ids) else None


def repetition_loop(response_ids: list[int], ngram: int = 6, repeats: int = 3) -> tuple[int, int] | None:
    """The loop's first repeat, as (start, end) response positions, or None: of the first
    `ngram`-token run that occurs `repeats` times, its second occurrence (where the reply restarts
    what it already said)."""
    seen: dict[tuple[int, ...], list[int]] = {}
    for i in range(len(response_ids) - ngram + 1):
        at = seen.setdefault(tuple(response_ids[i:i + ngram]), [])
        at.append(i)
        if len(at) >= repeats:
            return at[1], at[1] + ngram
    return None


def _vote_records(kind: Literal["prm", "hint"], backend_name: str, votes: Sequence[Vote]) -> list[VoteRecord]:
    return [VoteRecord(kind=kind, backend=backend_name, prompt_version=v.prompt_version, score=v.score,
                       hint=v.hint, raw=v.raw, error=v.error) for v in votes]


class SamplePipeline:
    def __init__(self, store: Store, engine: Engine, renderer: ChatRenderer, backend: JudgeBackend | None,
                 cfg: SignalConfig, on_ready: Callable[[dict[str, object]], None] = lambda _: None) -> None:
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
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), poll_s)
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
        reward, correction = explicit_reward(inp.feedback), latest_correction(inp.feedback)
        why = degenerate_reply(inp) or degenerate(inp.response_ids,
                                                  inp.finish_reason if self.cfg.drop_cut_replies else None,
                                                  liked=reward == 1.0)
        # A loop the person marked wrong trains against its first repeat (TrainConfig.loop_penalty);
        # a 6-token run said three times in a reply they liked is a restated phrase, not a loop.
        marked_wrong = reward == -1.0 or (correction is not None and reward is None)
        loop = (repetition_loop(inp.response_ids)
                if cfg.train_loops and marked_wrong and why in ("repetition_loop", "cut_off") else None)
        if why is not None and loop is None:
            await self._write(replace(sample, reason=why), votes)
            return
        if loop is not None:
            sample = replace(sample, state="ready", loop_from=loop[0], loop_to=loop[1], reward=reward,
                             reward_source="none" if reward is None else "explicit", correction=correction)
            if await self._write(sample, votes):
                self.on_ready({"call_id": call_id, "session_id": inp.session_id, "reward": reward,
                               "reward_source": sample.reward_source, "hint": False})
            return
        judge_kw: VoteOptions = {"m": cfg.judge_votes, "temperature": cfg.judge_temperature,
                                 "max_tokens": cfg.judge_max_tokens, "timeout_s": cfg.judge_timeout_s,
                                 "retries": cfg.judge_retries, "context": cfg.judge_context}

        # An outcome event's credit, else what the tool results state (outcomes.py); a person's
        # 👍/👎 still decides the reward, and a failure's text is the hint all the same.
        outcome, outcome_source = inp.outcome, "outcome_event"
        if outcome is None and cfg.outcome_rules:
            outcome, outcome_source = tool_outcome(next_state, cfg.outcome_rules, cfg.outcome_success,
                                                   cfg.outcome_failure), "outcome_rule"
        reward_source = "explicit" if reward is not None else "none"
        if reward is None and outcome is not None:
            reward, reward_source = outcome.reward, outcome_source
            sample = replace(sample, outcome=outcome.origin)
        if reward is None and next_state and backend is not None:
            verdict = await judge_prm(backend, messages, response, next_state, **judge_kw)
            votes += _vote_records("prm", backend.name, verdict.votes)
            if verdict.score is None:  # every vote failed
                await self._write(replace(sample, reward_source=reward_source, reason="judge_failed"), votes)
                return
            sample = replace(sample, judge_score=verdict.score)
            reward, reward_source = float(verdict.score), "judge"
        if reward is None and correction is not None and cfg.correction_reward:
            reward, reward_source = cfg.correction_reward, "explicit"  # the typed correction as a rating
        reward = reward or 0.0
        sample = replace(sample, reward=reward, reward_source=reward_source, correction=correction)

        if cfg.method in ("opd", "combined"):
            hint, source = None, None
            hint_evidence = [{"role": "user", "content": correction}] if correction else next_state
            if outcome is not None and outcome.text and not correction:  # what went wrong, as it was said
                hint, source = outcome.text[:MAX_RAW_HINT_CHARS], "outcome"
            elif hint_evidence and backend is not None:
                hv = await judge_hint(backend, messages, response, hint_evidence, **judge_kw)
                votes += _vote_records("hint", backend.name, hv.votes)
                hint, source = hv.hint, ("correction" if correction else "next_state")
                candidates = candidate_hints(hv.votes)
                if len(candidates) > 1 and inp.top_ids:
                    hint = await self._closest_hint(inp, candidates, hint)
            if hint is None and correction:  # the person's own words are the best hint we have
                hint, source = correction[:MAX_RAW_HINT_CHARS], "correction_raw"
            if hint is not None:
                sample = await self._teacher(inp, replace(sample, hint=hint, hint_source=source))

        # A reply the person disliked trains as it was served. Its fault is in what it says, and
        # without the notes every token of it is penalised where the tokens the notes asked for are
        # unlikely, so the penalty pushes them down hardest (a disliked "Great question! …" with a
        # wrong answer lowered the untold opener; bench/README.md, "The notes as the hint"). An
        # unrated reply with no hint has nothing to train on, so it is not scored again.
        unrated_trains = sample.teacher_logprobs is not None or cfg.count_zero_signal
        if cfg.consolidate_notes and inp.request.get("memory_notes") and (reward > 0 or reward == 0 and unrated_trains):
            sample = await self._consolidate(inp, sample)
        has_teacher = sample.teacher_logprobs is not None
        has_signal = {"binary": reward != 0, "opd": has_teacher, "combined": reward != 0 or has_teacher}[cfg.method]
        keep = has_signal or cfg.count_zero_signal
        sample = replace(sample, state="ready" if keep else "dropped",
                         reason=None if keep else sample.reason or "no_signal")
        if await self._write(sample, votes) and keep:
            self.on_ready({"call_id": call_id, "session_id": inp.session_id, "reward": reward,
                           "reward_source": reward_source, "hint": sample.hint is not None,
                           **({"outcome": sample.outcome} if sample.outcome else {})})

    async def _closest_hint(self, inp: SampleInputs, candidates: list[str], default: str | None) -> str | None:
        """Of several judge hints, the one under which the teacher puts the most probability on
        the student's recorded top-K tokens (mean over positions): the hint whose teacher stays
        closest to what the student does, so the distillation signal stays on the student's support."""
        adapter = Version.name_of(inp.adapter_version) if self.cfg.teacher == "self" else None
        best, best_mass = candidates[0], -1.0
        for hint in candidates:
            msgs = teacher_messages(inp.request["messages"], hint, self.cfg.hint_template, self.cfg.hint_placement)
            _, ids = await asyncio.to_thread(self.renderer.render, ChatRequest.model_validate({**inp.request, "messages": msgs}))
            try:
                rows = await self.engine.score_candidates(ids, inp.response_ids, inp.top_ids or [], adapter)
            except EngineError:  # cannot compare (a model server, a version unloaded): the judge's pick
                return default
            mass = sum(sum(math.exp(lp) for lp in row) for row in rows) / max(len(rows), 1)
            if mass > best_mass:
                best, best_mass = hint, mass
        return best

    async def _teacher(self, inp: SampleInputs, sample: JudgedSample) -> JudgedSample:
        """The sample with the teacher logprobs of the exact stored response ids under the hinted
        context and, where the engine can score them, of the policy's recorded top-K at each
        position (top-K OPD); or with the reason there are none.

        The self-teacher is the adapter version that served the call, so the teacher differs from
        the behaviour policy by the hint alone; if that version is no longer loaded the sample has
        no teacher (reason teacher_version_unloaded)."""
        assert sample.hint is not None
        msgs = teacher_messages(inp.request["messages"], sample.hint, self.cfg.hint_template, self.cfg.hint_placement)
        req = ChatRequest.model_validate({**inp.request, "messages": msgs})
        _, prompt_ids = await asyncio.to_thread(self.renderer.render, req)
        if len(prompt_ids) + len(inp.response_ids) > self.engine.info.context_length:
            return replace(sample, reason="teacher_context_too_long")
        adapter = Version.name_of(inp.adapter_version) if self.cfg.teacher == "self" else None
        if adapter is not None and adapter not in self.engine.loaded_versions():
            return replace(sample, reason="teacher_version_unloaded")
        sample = await self._scored_teacher(inp, msgs, prompt_ids, adapter, sample)
        if not self.cfg.positive_evidence:
            return sample
        return await self._evidence(inp, prompt_ids, adapter, sample)

    async def _scored_teacher(self, inp: SampleInputs, msgs: list[JsonObject], prompt_ids: list[int],
                              adapter: str | None, sample: JudgedSample, own_tokens: bool = False) -> JudgedSample:
        """The sample with the teacher context `prompt_ids`: the exact response ids and the
        recorded top-K scored there by `adapter`, or why it trains token-level (`own_tokens`:
        the reply's own tokens only)."""
        logprobs = await self.engine.score(prompt_ids, inp.response_ids, adapter)
        top, token_level = None, None
        if own_tokens:
            token_level = "notes_teacher"
        elif not inp.top_ids:
            token_level = "no_top_k_recorded"
        else:
            try:
                top = await self.engine.score_candidates(prompt_ids, inp.response_ids, inp.top_ids, adapter)
            except EngineError as e:
                log.warning("the teacher's top-K for %s could not be scored: %s", inp.call_id, e)
                token_level = f"candidate_scoring_failed: {e}"[:500]
        return replace(sample, teacher_adapter=inp.adapter_version if adapter else None, teacher_messages=msgs,
                       teacher_prompt_ids=list(prompt_ids), teacher_logprobs=logprobs, teacher_top_logprobs=top,
                       token_level_reason=token_level)

    async def _evidence(self, inp: SampleInputs, prompt_ids: list[int], adapter: str | None,
                        sample: JudgedSample) -> JudgedSample:
        """The teacher's own greedy reply under the hinted context and the serving policy's
        logprobs of it where it trains; none when that reply is degenerate (cut, empty, a loop) or
        the serving version is unloaded. It gets the room the request gave the served reply: a
        reply corrected for stopping short needs more than its own length. Consolidating notes,
        the evidence teaches the weights without them, as a liked reply does, whatever the reply's
        rating: it is written by the liked replies' teacher, the base model (see _consolidate), and
        trains in the request without the notes; otherwise `adapter` writes it, and it trains in the
        original context."""
        policy = Version.name_of(inp.adapter_version)
        if policy is not None and policy not in self.engine.loaded_versions():
            return sample
        writer, context = (None, await self._without_notes(inp, policy)) if self.cfg.consolidate_notes else (adapter, None)
        context = context or inp.prompt_ids
        room = self.engine.info.context_length - max(len(prompt_ids), len(inp.prompt_ids))
        asked = inp.request.get("max_completion_tokens") or inp.request.get("max_tokens")
        budget = min(asked if isinstance(asked, int) else 2 * len(inp.response_ids) + 32, room)
        if budget <= 0:
            return sample
        stops = self.engine.info.eos_token_ids
        sampling = Sampling(temperature=0.0, max_tokens=budget, stop_token_ids=stops)
        tokens = [t async for t in self.engine.generate(prompt_ids, sampling, writer, background=True)]
        ids = [t.id for t in tokens]
        if degenerate(ids, "stop" if ids and ids[-1] in stops else "length") is not None:
            return sample
        return replace(sample, evidence_ids=ids, evidence_teacher_logprobs=[t.logprob for t in tokens],
                       evidence_prompt_ids=None if context == inp.prompt_ids else context,
                       evidence_logprobs=await self.engine.score(context, ids, policy))

    async def _consolidate(self, inp: SampleInputs, sample: JudgedSample) -> JudgedSample:
        """The sample of a reply not disliked, set to train in the request without its preference
        notes (`memory.strip`): the reply the notes led to, its reward and the teacher that saw
        the notes then teach the weights to do without being told what the notes asked for, so a
        note can retire (retirement.py); trained where it was served, a reply's teacher differs
        from its policy by the hint alone, which repeats a note. A liked reply without a hint has the notes
        for one: its teacher is the base model given the request as it was served, so it is
        taught, not only rewarded. The base model whichever version served: training a version
        without the notes moves it with them too (the weights are shared), so as its own teacher
        it would chase its own drift (bench/README.md, "The notes' teacher is the base model").
        It teaches the reply's own tokens, not the top-K: what the notes make a few percent likely
        where the reply did not say it, raised in the bare context, becomes near-certain with the
        notes ("Consolidating the reply's own tokens").
        Not an unrated reply: a version's reply with the notes may have drifted from them ("Four
        updates per batch on top"). The baseline is the serving version's logprobs in the request
        without the notes (sampled token and top-K; without the latter it trains token-level);
        when that version is no longer loaded the sample trains as it was served."""
        adapter = Version.name_of(inp.adapter_version)
        prompt_ids = await self._without_notes(inp, adapter)
        if prompt_ids is None:
            return sample
        if sample.teacher_logprobs is None and (sample.reward or 0) > 0 and self.cfg.method != "binary":
            sample = await self._scored_teacher(inp, inp.request["messages"], inp.prompt_ids, None,
                                                replace(sample, hint_source="notes"), own_tokens=True)
        top, token_level = None, sample.token_level_reason
        if sample.teacher_top_logprobs is not None and inp.top_ids:
            try:
                top = await self.engine.score_candidates(prompt_ids, inp.response_ids, inp.top_ids, adapter)
            except EngineError as e:
                log.warning("the top-K baseline for %s could not be scored: %s", inp.call_id, e)
                token_level = f"candidate_scoring_failed: {e}"[:500]
        return replace(sample, student_prompt_ids=list(prompt_ids), student_top_logprobs=top,
                       token_level_reason=token_level,
                       student_logprobs=await self.engine.score(prompt_ids, inp.response_ids, adapter))

    async def _without_notes(self, inp: SampleInputs, adapter: str | None) -> list[int] | None:
        """The request rendered without its preference notes, to score in with `adapter`; None
        when it has none, that version is unloaded or the notes are not where inject put them."""
        if not inp.request.get("memory_notes"):
            return None
        if adapter is not None and adapter not in self.engine.loaded_versions():
            log.debug("not consolidating %s: %s is unloaded", inp.call_id, adapter)
            return None
        messages = strip(inp.request["messages"], inp.request["memory_notes"])
        req = ChatRequest.model_validate({**inp.request, "messages": messages, "memory_notes": None})
        _, prompt_ids = await asyncio.to_thread(self.renderer.render, req)
        return None if prompt_ids == inp.prompt_ids else list(prompt_ids)

    async def _write(self, sample: JudgedSample, votes: list[VoteRecord]) -> bool:
        return await self.store.write_sample(replace(sample, votes=tuple(votes)))
