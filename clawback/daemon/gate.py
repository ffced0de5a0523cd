"""The candidate gate: every trained version is checked against the live one before it serves.

A version the trainer publishes is a *candidate*: loaded into the engine beside the live version,
nothing routed to it. The gate then decides, in this order (docs/gate.md has every threshold):

1. training health, from the step's own metrics: a non-finite loss or gradient norm, a gradient
   norm above `grad_spike`× the running median of the last healthy steps, a loss above
   `loss_spike`× their median |loss| (and above `loss_floor`). Any of these refuses at once.
2. capability retention: the probe set (probes.py) answered greedily by the candidate and the base
   model; refused when the probes the candidate newly fails outnumber those it newly passes by more
   than chance allows (an exact one-sided sign test on the changed probes, `retention_alpha`) and
   its score is at least `retention_margin` points (of 100) below the base model's.
3. collapse detectors on the same probe replies, and on greedy replies to the person's own
   newest requests (held-out calls first; their prompts as served, preference notes included),
   each against the live version's replies to the same prompts. Repetition, the same reply
   everywhere, empty replies, replies about the conversation, replies that decline the task and,
   where the person's requests offered tools, replies with no call that could run are also held
   to the base model's replies, so that small rises which each pass against live
   cannot add up over versions.
4. preference replay on held-out rated calls (never trained on): the mean per-token logprob
   margin of liked over disliked replies, and the distance to the corrected (hinted) behaviour,
   candidate against live; stored token ids are scored, nothing is generated.
5. the notes still followed: on the newest liked replies served with the person's notes, the
   tokens the notes lead the base model to, scored with the notes by candidate and live. Training
   without the notes (memory consolidation) can teach a version to do something else when told.

Generations run as background work on the serving engine and every scoring pass waits for the
engine to be free of requests, so serving keeps its latency; a request is never refused for it.
Base and live results are cached per version: a candidate costs one probe pass and one replay
pass.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, is_dataclass, replace
from typing import ClassVar

from clawback.chat import ChatRenderer, ChatRequest
from clawback.engine import Engine, Sampling
from clawback.records import JsonObject, ReadySample, Version

from .config import GateConfig
from .memory import strip
from .probes import (
    NOT_ON_OWN_REQUESTS,
    CollapseStats,
    Generation,
    Probe,
    against_live_and_base,
    collapse_stats,
    load_probes,
    passes,
)
from .store import Store
from .store.queries import CallPrompt, HealthPoint, HeldOutCall, NotesCall

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HealthCheck:
    """The step's own numbers, and how many healthy steps they were held to."""

    loss: float | None
    grad_norm: float | None
    history: int


@dataclass(frozen=True)
class RetentionCheck:
    """The probe scores (of 100) and the sign test on the probes whose outcome changed."""

    candidate: float
    base: float
    live: float
    margin: float
    probes: int
    newly_failed: int
    newly_passed: int
    p: float
    alpha: float


@dataclass(frozen=True)
class CollapseCheck:
    """The collapse statistics of the probe replies."""

    candidate: CollapseStats
    live: CollapseStats
    base: CollapseStats


@dataclass(frozen=True)
class OwnRequestsCheck:
    """The collapse statistics of greedy replies to the person's newest requests."""

    OPTIONAL: ClassVar = ("base",)
    calls: int
    candidate: CollapseStats
    live: CollapseStats
    base: CollapseStats | None = None  # None: live is the base model


@dataclass(frozen=True)
class ReplayCheck:
    """The preference replay on held-out calls. `margin`: the liked−disliked margin of candidate
    and live (nats/token), or why there is none; `mean_logprob`: each kind's mean alone, when
    there are too few of one kind for a margin; `teacher_gap`: the distance to the corrected
    behaviour, when there are corrected calls."""

    OPTIONAL: ClassVar = ("mean_logprob", "teacher_gap")
    held_out: int
    margin: str | dict[str, float]
    mean_logprob: dict[str, dict[str, float]] | None = None
    teacher_gap: dict[str, float] | None = None


@dataclass(frozen=True)
class NotesCheck:
    """The notes still followed: on `calls` liked replies served with the person's notes, the
    mean logprob (nats/token) candidate and live give, told, the `tokens` the notes led the base
    model to."""

    calls: int
    tokens: int
    candidate: float
    live: float


@dataclass(frozen=True)
class GateReport:
    """What the gate measured on a candidate: the checks it got to, in order (one that refused
    ends the review), and how long the review took."""

    OPTIONAL: ClassVar = ("health", "retention", "collapse", "collapse_own_requests", "replay", "notes",
                          "newly_failed", "check_seconds", "seconds")
    health: HealthCheck | None = None
    retention: RetentionCheck | None = None
    collapse: CollapseCheck | None = None
    collapse_own_requests: OwnRequestsCheck | None = None
    replay: ReplayCheck | None = None
    notes: NotesCheck | None = None  # None: no liked reply served with notes the person still has
    # What the candidate answered where the base model was right: the replies behind the score.
    newly_failed: dict[str, str] | None = None
    # Where the review's time went: seconds per check (probes, your_requests, replay, notes).
    check_seconds: dict[str, float] | None = None
    seconds: float | None = None

    def json(self) -> JsonObject:
        """As the adapter's `gate` column keeps it and the HTTP API shows it: the checks made."""
        out = _json(self)
        assert isinstance(out, dict)
        return out


class _Stopwatch:
    """Seconds between successive laps, by name."""

    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = round(now - self._last, 3)
        self._last = now


def _json(value: object) -> object:
    """A report's value as JSON: records as objects of their fields in order, less the optional
    ones (`OPTIONAL`) a check did not fill."""
    if is_dataclass(value) and not isinstance(value, type):
        optional = getattr(value, "OPTIONAL", ())
        return {f.name: _json(getattr(value, f.name)) for f in fields(value)
                if f.name not in optional or getattr(value, f.name) is not None}
    if isinstance(value, dict):
        return {k: _json(v) for k, v in value.items()}
    return value


@dataclass(frozen=True)
class Verdict:
    promote: bool
    reasons: tuple[str, ...] = ()
    report: GateReport = field(default_factory=GateReport)

    @property
    def reason(self) -> str:
        return "; ".join(self.reasons)


@dataclass(frozen=True)
class ProbeResult:
    """One version's answers to the probe set."""

    score: float  # points of 100
    failed: list[str]  # the ids of the probes it failed
    stats: CollapseStats
    replies: dict[str, str]  # probe id -> reply


def held_out(prompt_ids: list[int], response_ids: list[int], share: float) -> bool:
    """A fixed share of calls, chosen by a hash of their tokens, prompt and reply: stable across
    restarts, and the same conversation replayed with the same sampling seeds holds out the same
    calls, so two runs of it differ only where their replies do."""
    key = ",".join(map(str, prompt_ids)) + "|" + ",".join(map(str, response_ids))
    return int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF < share


def health_reasons(metrics: Mapping[str, float], history: list[HealthPoint], cfg: GateConfig) -> list[str]:
    """Why a step's own metrics make its version unfit to serve ([] = healthy)."""
    loss, grad = float(metrics.get("loss", 0.0)), float(metrics.get("grad_norm", 0.0))
    bad = [name for name, v in (("loss", loss), ("gradient norm", grad)) if not math.isfinite(v)]
    if bad:
        return [f"training health: non-finite {' and '.join(bad)}"]
    if len(history) < cfg.health_min_steps:
        return []
    reasons = []
    grad_median = statistics.median(h.grad_norm for h in history)
    if grad_median > 0 and grad > cfg.grad_spike * grad_median:
        reasons.append(f"training health: gradient norm {grad:.3g} > {cfg.grad_spike:g}× running median {grad_median:.3g}")
    loss_median = statistics.median(abs(h.loss) for h in history)
    if abs(loss) > max(cfg.loss_spike * loss_median, cfg.loss_floor):
        reasons.append(f"training health: loss {loss:.3g} > {cfg.loss_spike:g}× running median |loss| "
                       f"{loss_median:.3g} (floor {cfg.loss_floor:g})")
    return reasons


async def score_when_quiet(engine: Engine, busy: Callable[[], int], prompt_ids: list[int], response_ids: list[int],
                           version: str | None) -> list[float]:
    """`engine.score`, after waiting (at most 10 s) until no request is being served: each pass
    holds the engine for one forward."""
    for _ in range(200):
        if not busy():
            break
        await asyncio.sleep(0.05)
    return await engine.score(prompt_ids, response_ids, version)


def teacher_gap(logprobs: list[float], teacher_logprobs: list[float]) -> float:
    """Mean per-token |logp_model − logp_teacher| on a stored reply: how far the model is from the
    behaviour the correction asked for (the hinted teacher)."""
    return sum(abs(a - b) for a, b in zip(logprobs, teacher_logprobs)) / len(logprobs)


def retention_test(base_failed: list[str], candidate_failed: list[str]) -> tuple[int, int, float]:
    """The paired test of capability retention: of the probes whose outcome changed between the
    base model and the candidate, `lost` the candidate newly fails and `gained` it newly passes.
    Under "no loss" each changed probe is as likely to go either way, so the one-sided exact sign
    test (McNemar's exact test) gives P(at least `lost` of lost+gained). Probes both pass or both
    fail say nothing about a change. An unchanged model changes no probe (greedy replies): p = 1."""
    base, cand = set(base_failed), set(candidate_failed)
    lost, gained = len(cand - base), len(base - cand)
    n = lost + gained
    p = sum(math.comb(n, k) for k in range(lost, n + 1)) / 2**n
    return lost, gained, p


class CandidateGate:
    def __init__(self, engine: Engine, renderer: ChatRenderer, store: Store, cfg: GateConfig,
                 busy: Callable[[], int] = lambda: 0) -> None:
        self.engine, self.renderer, self.store, self.cfg = engine, renderer, store, cfg
        self.busy = busy  # requests being served right now: scoring waits for 0
        probes = load_probes()
        self.probes: list[Probe] = probes[: cfg.probes] if cfg.probes else probes
        self._probe_cache: dict[str | None, ProbeResult] = {}  # engine version -> probe result
        self._replay_cache: dict[tuple[str | None, str], float] = {}  # (version, call id) -> value
        self._own_cache: dict[tuple[str | None, tuple[int, ...]], Generation] = {}  # (version, prompt) -> reply
        self._notes_led: dict[str, list[int]] = {}  # call id -> reply positions the notes lead the base to
        self._history: list[HealthPoint] | None = None
        self.reviewing: int | None = None
        self.last_review_s: float | None = None
        self.promoted = 0
        self.refused = 0

    def holds_out(self, sample: ReadySample) -> bool:
        """Rated calls (👍/👎 or a correction) in the held-out share are never trained on."""
        rated = sample.reward_source == "explicit" or sample.correction is not None
        return rated and held_out(sample.served_prompt_ids or sample.prompt_ids, sample.response_ids,
                                  self.cfg.held_out_share)

    async def review(self, version: int, live: int | None, metrics: Mapping[str, float]) -> Verdict:
        """Decide whether `v{version}` (loaded, not active) may replace `live` (None = base)."""
        started = time.perf_counter()
        self.reviewing = version
        try:
            verdict = await self._review(version, live, metrics)
        except Exception as e:  # a version the gate could not check does not serve
            log.exception("gate: reviewing v%d failed", version)
            verdict = Verdict(False, (f"gate failed: {type(e).__name__}: {e}"[:500],))
        finally:
            self.reviewing = None
        self.last_review_s = round(time.perf_counter() - started, 3)
        verdict = replace(verdict, report=replace(verdict.report, seconds=self.last_review_s))
        if verdict.promote:
            self.promoted += 1
            cached = set(self._probe_cache) | {v for v, _ in self._replay_cache} | {v for v, _ in self._own_cache}
            self._forget(cached - {None, Version.name_of(version)})
        else:
            self.refused += 1
            self._forget({Version.name_of(version)})
        log.info("gate: v%d %s%s", version, "promoted" if verdict.promote else "refused: ", verdict.reason)
        return verdict

    async def _review(self, version: int, live: int | None, metrics: Mapping[str, float]) -> Verdict:
        cfg = self.cfg
        history = await self._health_history()
        reasons = health_reasons(metrics, history, cfg)
        report = GateReport(health=HealthCheck(metrics.get("loss"), metrics.get("grad_norm"), len(history)))
        if reasons:
            return Verdict(False, tuple(reasons), report)
        cand_name, live_name = Version.name_of(version), Version.name_of(live)
        clock = _Stopwatch()
        base = await self._probe(None)
        cand = await self._probe(cand_name)
        ref = base if live is None else await self._probe(live_name)
        lost, gained, p = retention_test(base.failed, cand.failed)
        drop = base.score - cand.score
        if p < cfg.retention_alpha and drop >= cfg.retention_margin:
            reasons.append(f"retention −{drop:.1f} points ({cand.score:.1f} vs base {base.score:.1f} "
                           f"of 100 on {len(self.probes)} probes: {lost} newly failed, {gained} newly passed, "
                           f"p = {p:.3g} < {cfg.retention_alpha:g})")
        reasons += against_live_and_base(cand.stats, ref.stats, base.stats, cfg, live_name)
        clock.lap("probes")
        held_out = await asyncio.to_thread(self._held_out_calls)  # read once: generated and replayed
        own = await self._own_requests(held_out, cand_name, live_name)
        if own:
            reasons += against_live_and_base(own.candidate, own.live, own.base, cfg, live_name,
                                             "your requests", NOT_ON_OWN_REQUESTS)
        clock.lap("your_requests")
        replay, replay_reasons = await self._replay(held_out, cand_name, live_name)
        clock.lap("replay")
        notes, notes_reasons = await self._notes(cand_name, live_name)
        clock.lap("notes")
        reasons += replay_reasons + notes_reasons
        report = replace(
            report,
            retention=RetentionCheck(cand.score, base.score, ref.score, cfg.retention_margin, len(self.probes), lost,
                                     gained, round(p, 5), cfg.retention_alpha),
            collapse=CollapseCheck(cand.stats, ref.stats, base.stats), collapse_own_requests=own, replay=replay, notes=notes,
            newly_failed={pid: cand.replies[pid] for pid in cand.failed if pid not in base.failed},
            check_seconds=clock.laps)
        if reasons:
            return Verdict(False, tuple(reasons), report)
        history.append(HealthPoint(float(metrics.get("loss", 0.0)), float(metrics.get("grad_norm", 0.0))))
        del history[: -cfg.health_window]
        return Verdict(True, (), report)

    # ---- training health ----

    async def _health_history(self) -> list[HealthPoint]:
        """Loss and gradient norm of the last healthy steps (from the store after a restart)."""
        if self._history is None:
            self._history = await asyncio.to_thread(self.store.healthy_step_metrics, self.cfg.health_window)
        return self._history  # the list itself: a promoted version's step is appended to it

    # ---- probes ----

    async def _probe(self, version: str | None) -> ProbeResult:
        if version not in self._probe_cache:
            gens = await asyncio.gather(*(self._generate(p, version) for p in self.probes))
            failed = [p.id for p, g in zip(self.probes, gens) if not passes(p, g.text)]
            self._probe_cache[version] = ProbeResult(
                100.0 * (1 - len(failed) / len(self.probes)), failed, collapse_stats(list(gens)),
                {p.id: g.text for p, g in zip(self.probes, gens)})
        return self._probe_cache[version]

    async def _generate(self, probe: Probe, version: str | None) -> Generation:
        req = ChatRequest.model_validate({"model": "gate", "messages": [{"role": "user", "content": probe.prompt}],
                                          **({"tools": list(probe.tools)} if probe.tools else {})})
        _, prompt_ids = await asyncio.to_thread(self.renderer.render, req)
        return await self._greedy(prompt_ids, self.cfg.probe_max_tokens, version)

    async def _own_requests(self, held_out: list[HeldOutCall], cand: str, live: str | None) -> OwnRequestsCheck | None:
        """Collapse stats of candidate and live answering the person's newest requests (None: fewer
        than 2 of them): held-out calls' prompts first, then those of the newest other main calls
        with a sample. The set moves on between reviews; a version's greedy reply to a prompt does
        not, so base and live answer only the prompts new since the last review."""
        n = self.cfg.replay_generate
        if not n:
            return None
        prompts = [CallPrompt(i.call_id, i.prompt_ids) for i in held_out[:n]]
        if len(prompts) < n:
            prompts += await asyncio.to_thread(self._recent_prompts, n - len(prompts), {i.call_id for i in held_out},
                                               [p.prompt_ids for p in prompts])
        if len(prompts) < 2:
            return None
        offered = await asyncio.to_thread(self.store.offered_tools, [p.call_id for p in prompts])
        tools = [offered.get(p.call_id, []) for p in prompts]
        keys = {tuple(p.prompt_ids) for p in prompts}  # a reply to a prompt no longer asked is not kept
        self._own_cache = {k: g for k, g in self._own_cache.items() if k[1] in keys}
        stats = []  # no reply text: the report outlives a forget
        for version in (cand, live, None)[: 2 if live is None else 3]:
            gens = await asyncio.gather(*(self._own_reply(p.prompt_ids, version) for p in prompts))
            stats.append(collapse_stats(list(gens), tools))
        return OwnRequestsCheck(len(prompts), *stats)

    async def _own_reply(self, prompt_ids: list[int], version: str | None) -> Generation:
        key = (version, tuple(prompt_ids))
        if key not in self._own_cache:
            self._own_cache[key] = await self._greedy(prompt_ids, self.cfg.replay_generate_tokens, version)
        return self._own_cache[key]

    def _recent_prompts(self, n: int, skip: set[str], seen: list[list[int]]) -> list[CallPrompt]:
        """The newest main calls with a sample (a next state or a rating reached them: the person's
        conversation, not a one-off call such as an evaluation) outside `skip`, each prompt once and
        none in `seen`."""
        limit = min(self.cfg.replay_max_tokens, self.engine.info.context_length) - self.cfg.replay_generate_tokens
        out: list[CallPrompt] = []
        for r in self.store.recent_sampled_prompts(len(skip) + 5 * n):
            # (no ids: a forget took a note out of the request, and its tokens with it)
            if r.prompt_ids and r.call_id not in skip and r.prompt_ids not in seen and len(r.prompt_ids) <= limit:
                seen = [*seen, r.prompt_ids]
                out.append(r)
        return out[:n]

    async def _greedy(self, prompt_ids: list[int], max_tokens: int, version: str | None) -> Generation:
        eos = self.engine.info.eos_token_ids
        sampling = Sampling(temperature=0.0, max_tokens=max_tokens, stop_token_ids=eos)
        ids, logprobs, finish = [], [], "length"
        stream = self.engine.generate(prompt_ids, sampling, version, background=True)
        try:
            async for token in stream:
                if token.id in eos:
                    finish = "stop"
                    break
                ids.append(token.id)
                logprobs.append(token.logprob)
        finally:
            await stream.aclose()
        text = self.renderer.tokenizer.decode(ids, skip_special_tokens=True)
        return Generation(ids, logprobs, text, finish)

    # ---- preference replay ----

    async def _replay(self, items: list[HeldOutCall], cand: str, live: str | None) -> tuple[ReplayCheck, list[str]]:
        """The replay's numbers, and its reasons to refuse."""
        cfg = self.cfg
        rated = [(i, i.reward) for i in items if i.reward in (1.0, -1.0)]
        corrected = [(i, i.teacher_logprobs) for i in items if i.teacher_logprobs is not None]
        reasons: list[str] = []
        margin: str | dict[str, float]
        mean_logprob = gaps = None
        liked = sum(reward > 0 for _, reward in rated)
        means: dict[str, dict[str, float]] = {}  # version -> mean per-token logprob of liked / disliked replies
        for name, version in (("candidate", cand), ("live", live)) if rated else ():
            lp = [await self._mean_logprob(version, i) for i, _ in rated]
            means[name] = {kind: sum(ps) / len(ps) for kind, ps in (
                ("liked", [x for x, (_, reward) in zip(lp, rated) if reward > 0]),
                ("disliked", [x for x, (_, reward) in zip(lp, rated) if reward < 0])) if ps}
        c, l = means.get("candidate", {}), means.get("live", {})
        if not rated:
            margin = "skipped: no rated held-out calls"
        elif min(liked, len(rated) - liked) >= cfg.replay_min_each:
            margin = {name: m["liked"] - m["disliked"] for name, m in means.items()}
            if margin["candidate"] < margin["live"] - cfg.replay_tolerance:
                reasons.append(f"replay: liked−disliked margin {margin['candidate']:+.3f} vs "
                               f"{margin['live']:+.3f} nats/token on {live or 'base'} ({len(rated)} held-out calls)")
        else:  # too few of one kind for a margin: each kind alone must not move the wrong way
            margin = f"one-sided: {liked} liked and {len(rated) - liked} disliked held-out calls, a margin needs {cfg.replay_min_each} each"
            mean_logprob = means
            if "liked" in c and c["liked"] < l["liked"] - cfg.replay_tolerance:
                reasons.append(f"replay: liked replies less likely, {c['liked']:+.3f} vs {l['liked']:+.3f} "
                               f"nats/token on {live or 'base'} ({liked} held-out calls)")
            if "disliked" in c and c["disliked"] > l["disliked"] + cfg.replay_tolerance:
                reasons.append(f"replay: disliked replies more likely, {c['disliked']:+.3f} vs "
                               f"{l['disliked']:+.3f} nats/token on {live or 'base'} ({len(rated) - liked} held-out calls)")
        if corrected:
            gaps = {name: sum([await self._teacher_gap(version, i, teacher) for i, teacher in corrected]) / len(corrected)
                    for name, version in (("candidate", cand), ("live", live))}
            if gaps["candidate"] > gaps["live"] + cfg.replay_tolerance:
                reasons.append(f"replay: further from the corrected behaviour, {gaps['candidate']:.3f} vs "
                               f"{gaps['live']:.3f} nats/token on {live or 'base'} ({len(corrected)} corrected calls)")
        return ReplayCheck(len(items), margin, mean_logprob, gaps), reasons

    def _held_out_calls(self) -> list[HeldOutCall]:
        limit = min(self.cfg.replay_max_tokens, self.engine.info.context_length)
        return [i for i in self.store.held_out_calls(self.cfg.replay_calls)
                if i.response_ids and len(i.prompt_ids) + len(i.response_ids) <= limit]

    async def _score(self, version: str | None, item: HeldOutCall) -> list[float]:
        return await score_when_quiet(self.engine, self.busy, item.prompt_ids, item.response_ids, version)

    async def _mean_logprob(self, version: str | None, item: HeldOutCall) -> float:
        key = (version, "lp:" + item.call_id)
        if key not in self._replay_cache:
            lp = await self._score(version, item)
            self._replay_cache[key] = sum(lp) / len(lp)
        return self._replay_cache[key]

    async def _teacher_gap(self, version: str | None, item: HeldOutCall, teacher: list[float]) -> float:
        key = (version, "gap:" + item.call_id)
        if key not in self._replay_cache:
            self._replay_cache[key] = teacher_gap(await self._score(version, item), teacher)
        return self._replay_cache[key]

    # ---- the notes still followed ----

    async def _notes(self, cand: str, live: str | None) -> tuple[NotesCheck | None, list[str]]:
        """The notes check's numbers (None: nothing to check), and its reason to refuse."""
        if not self.cfg.notes_calls:
            return None, []
        newest = await asyncio.to_thread(self._notes_calls)
        self._notes_led = {c.call_id: self._notes_led[c.call_id] for c in newest if c.call_id in self._notes_led}
        calls = [c for c in newest if await self._led(c)]
        if not calls:
            return None, []
        tokens = sum(len(self._notes_led[c.call_id]) for c in calls)
        sums = [sum([await self._led_sum(version, c) for c in calls]) for version in (cand, live)]
        check = NotesCheck(len(calls), tokens, sums[0] / tokens, sums[1] / tokens)
        if check.candidate >= check.live - self.cfg.notes_tolerance:
            return check, []
        return check, [f"notes: what your notes ask for is less likely when told, {check.candidate:+.3f} vs "
                       f"{check.live:+.3f} nats/token on {live or 'base'} ({tokens} tokens of {len(calls)} liked replies)"]

    def _notes_calls(self) -> list[NotesCall]:
        limit = min(self.cfg.replay_max_tokens, self.engine.info.context_length)
        return [c for c in self.store.liked_calls_with_notes(self.cfg.notes_calls)
                if c.prompt_ids and c.response_ids and len(c.prompt_ids) + len(c.response_ids) <= limit]

    async def _led(self, call: NotesCall) -> list[int]:
        """The reply's positions the notes lead the base model to: at least `notes_lead` nats more
        likely with them than without (once per call: the base model never changes)."""
        if call.call_id not in self._notes_led:
            body = call.request
            bare = ChatRequest.model_validate({**body, "memory_notes": None,
                                               "messages": strip(body["messages"], body["memory_notes"])})
            _, bare_ids = await asyncio.to_thread(self.renderer.render, bare)
            told = await score_when_quiet(self.engine, self.busy, call.prompt_ids, call.response_ids, None)
            untold = await score_when_quiet(self.engine, self.busy, bare_ids, call.response_ids, None)
            self._notes_led[call.call_id] = [i for i, (a, b) in enumerate(zip(told, untold))
                                             if a - b >= self.cfg.notes_lead]
        return self._notes_led[call.call_id]

    async def _led_sum(self, version: str | None, call: NotesCall) -> float:
        """`version`'s summed logprob, told, of the reply's tokens the notes lead to."""
        key = (version, "notes:" + call.call_id)
        if key not in self._replay_cache:
            lp = await score_when_quiet(self.engine, self.busy, call.prompt_ids, call.response_ids, version)
            self._replay_cache[key] = sum(lp[i] for i in self._notes_led[call.call_id])
        return self._replay_cache[key]

    def _forget(self, versions: set[str | None]) -> None:
        for v in versions & set(self._probe_cache):
            del self._probe_cache[v]
        for k in [k for k in self._replay_cache if k[0] in versions]:
            del self._replay_cache[k]
        self._own_cache = {k: g for k, g in self._own_cache.items() if k[0] not in versions}
