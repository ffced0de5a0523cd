"""One cell: one scenario × method × seed, on the real daemon app driven in-process.

The daemon's own pieces run unchanged: `server.build_state` (engine, store, capture, the sample
pipeline, the adapter manager), `server.daemon_app` and its lifespan (pipeline and training loop
as background tasks), the OpenAI route for replies and POST /v1/feedback for reactions, over
httpx's ASGI transport (no network). Only the trainer's worker runs in a thread instead of a Ray
actor (local_worker.py), handed to `build_state` as the trainer to start.

The user waits for the daemon to settle after each reaction (its sample judged and, when a
batch is full, the step trained and swapped in) before sending the next task, so a cell is
reproducible and its curve does not depend on machine speed.

Each interaction is one session: a task, the policy's first reply, the user's reaction. Whether
that reply meets the scenario (its preference, with a right answer), session by session, gives
sessions to adaptation (results.py). The generation-free probe (probe.py) runs on the base model, on every new version
and whenever the notes change, over all held-out tasks; the held-out tasks (`eval_tasks` of them)
are answered greedily (main calls in one-call sessions that end at once, so they see the
preference notes like any main call and are never trained) before the first interaction and at
`eval_points` evenly spaced points after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypedDict, cast

import httpx

from clawback import __version__
from clawback.daemon.api.state import AppState
from clawback.daemon.config import Settings
from clawback.daemon.server import build_state, daemon_app
from clawback.daemon.store import Store
from clawback.records import JsonObject

from .cell_file import (
    CellHeader,
    CellRecord,
    CodeStamp,
    DaemonOutcome,
    MemoryNote,
    NoteCheck,
    Progress,
    ProgressEvent,
    SampleCounts,
    TrainStepRow,
    Versions,
)
from .checkpoint import Checkpoint, cached_base, fingerprint, new_progress
from .config import METHODS, SimConfig
from .local_worker import in_thread_trainer
from .probe import active_notes, opener_mass
from .raters import Judgement, RuleRater
from .scenarios import Task, scenario
from .stamp import code_stamp
from .user import SimulatedUser

SETTLE_TIMEOUT_S = 1800.0  # a step on a busy 2-core laptop takes seconds; this only catches a hang


@dataclass(frozen=True)
class Cell:
    scenario: str
    method: str
    seed: int

    @property
    def key(self) -> str:
        return f"{self.scenario}/{self.method}/seed{self.seed}"


class SimError(RuntimeError):
    pass


class Rater(Protocol):
    """Who judges replies for the user and for the score (raters.py)."""

    name: str

    async def judge(self, reply: str, task: Task, complete: bool = True) -> Judgement: ...


class Evaluation(TypedDict):
    """The held-out greedy replies at one point, judged."""

    score: float
    meets: float
    right: float
    checks: dict[str, float]  # each check's pass rate
    cut: int
    meta: int
    repeat: int
    replies: list[str]


def _request_seed(seed: int, i: int) -> int:
    return seed * 100_003 + i


async def _chat(client: httpx.AsyncClient, messages: list[JsonObject], headers: dict[str, str],
                **sampling: float) -> tuple[str, bool]:
    """The reply's text and whether it finished (False: the token budget cut it)."""
    r = await client.post("/v1/chat/completions", json={"model": "clawback", "messages": messages, **sampling},
                          headers=headers)
    if r.status_code != 200:
        raise SimError(f"chat completion failed: {r.status_code} {r.text[:500]}")
    choice = r.json()["choices"][0]
    return choice["message"]["content"] or "", choice["finish_reason"] != "length"


async def _feedback(client: httpx.AsyncClient, session: str, target: str, kind: str, text: str | None = None) -> None:
    body = {"event_id": str(uuid.uuid4()), "kind": kind, "session_id": session, "target": target,
            "source": "simulator", **({"text": text} if text else {})}
    r = await client.post("/v1/feedback", json=body)
    if r.status_code not in (200, 202):
        raise SimError(f"feedback {kind} failed: {r.status_code} {r.text[:500]}")


async def evaluate(client: httpx.AsyncClient, rater: Rater, tasks: tuple[Task, ...], max_tokens: int,
                   point: int, turn_type: str = "main") -> Evaluation:
    """Greedy first replies to the held-out tasks, judged: the score, the share that meets the
    scenario, the share whose answer is right, each check's pass rate, how many the budget cut.

    All tasks are asked at once, so the engine decodes them as one batch. `turn_type` "side" asks
    without the preference notes (the daemon injects them into main calls only): what the weights
    alone do."""

    async def one(j: int, task: Task) -> tuple[str, Judgement]:
        reply, complete = await _chat(client, [{"role": "user", "content": task.prompt}],
                                      {"x-session-id": f"eval-{turn_type}-{point}-{j}", "x-turn-type": turn_type,
                                       "x-session-done": "true"},
                                      temperature=0.0, max_tokens=max_tokens)
        return reply, await rater.judge(reply, task, complete)

    replies, judgements = zip(*await asyncio.gather(*(one(j, t) for j, t in enumerate(tasks))), strict=True)
    names = judgements[0].checks or {}
    checks = {name: sum(bool(g.checks and g.checks[name]) for g in judgements) / len(judgements) for name in names}
    n = len(judgements)
    return {"score": sum(g.score for g in judgements) / n, "meets": sum(g.meets for g in judgements) / n,
            "right": sum(g.right for g in judgements) / n, "checks": checks, "cut": sum(g.gate == "cut" for g in judgements),
            "meta": sum(g.gate == "meta" for g in judgements), "repeat": sum(g.gate == "repeat" for g in judgements),
            "replies": list(replies)}


async def _settle(state: AppState, batch_size: int) -> None:
    """Wait until every queued sample is judged and no full batch is waiting to be trained."""
    trainer, deadline = state.trainer, time.monotonic() + SETTLE_TIMEOUT_S
    failures = trainer.failures if trainer is not None else 0
    while time.monotonic() < deadline:
        await asyncio.to_thread(state.store.flush)
        if state.guard is not None:  # decide on a rollback now, not whenever its poll comes round
            await state.guard.check()
        pending = await asyncio.to_thread(state.store.pending_samples, 1)
        if not pending and not state.pipeline.busy:
            if trainer is None:
                return
            if not trainer.busy:
                ready = await asyncio.to_thread(state.store.ready_count)
                if ready < batch_size or trainer.failures > failures:
                    return
        await asyncio.sleep(0.05)
    raise SimError(f"the daemon did not settle within {SETTLE_TIMEOUT_S:.0f}s")


def _train_steps(store: Store) -> list[TrainStepRow]:
    keep = ("loss", "drift", "entropy", "adv", "ratio", "tis", "grad_norm", "reward_mean", "reward_pos",
            "reward_neg", "clip_frac", "response_len", "step_time_s", "samples", "kl", "topk_adv", "topk_clip",
            "evidence_rows", "distill_kl")
    return [{"version": t.version, "parent": t.parent, "samples": t.samples, "outcome": t.outcome, "error": t.error,
             "seconds": t.finished_at - t.started_at, "metrics": {k: t.metrics[k] for k in keep if k in t.metrics}}
            for t in store.train_steps()]


def _note_checks(store: Store) -> list[NoteCheck]:
    """Each preference note checked against each version that went live (daemon/retirement.py)."""
    return [NoteCheck(note_id=None if subject is None else int(subject), **payload)
            for subject, payload in store.event_payloads("memory.checked")]


def _sample_counts(store: Store) -> SampleCounts:
    dropped: dict[str, int] = {}
    states: dict[str, int] = {}
    for r in store.sample_counts():
        if r.state == "dropped":
            dropped[r.reason] = r.samples
        else:
            states[r.state] = states.get(r.state, 0) + r.samples
    return cast(SampleCounts, {"dropped": dropped, **states, "loops": store.loop_sample_count()})


def cell_settings(cell: Cell, cfg: SimConfig, model_dir: Path, data_dir: Path) -> Settings:
    return Settings(data_dir=data_dir, model=str(model_dir), device="cpu", no_auth=True, log_level="warning",
                    session_idle_timeout_s=24 * 3600.0, **cfg.settings_for(METHODS[cell.method], cell.seed))


@contextlib.asynccontextmanager
async def in_process_daemon(settings: Settings, model_dir: Path,
                            threads: int) -> AsyncIterator[tuple[AppState, httpx.AsyncClient]]:
    """The daemon's state, its app with its lifespan running, and a client that calls it in process."""
    state = build_state(settings, in_thread_trainer(str(model_dir), settings.train_config(), threads))
    app = daemon_app(settings, state)
    transport = httpx.ASGITransport(app=app)
    fastapi_app = getattr(app, "app", app)  # daemon_app wraps FastAPI in its auth/counting gate
    async with fastapi_app.router.lifespan_context(fastapi_app), httpx.AsyncClient(
            transport=transport, base_url="http://clawback.sim", timeout=3600) as client:
        yield state, client


async def daemon_outcome(state: AppState) -> DaemonOutcome:
    """What the daemon did in the cell: training steps, samples, notes and their checks, versions."""
    notes = await asyncio.to_thread(state.store.memory_notes, state.adapters.live())
    return {"steps": await asyncio.to_thread(_train_steps, state.store),
            "samples": await asyncio.to_thread(_sample_counts, state.store),
            "versions": _versions([dataclasses.asdict(a) for a in await asyncio.to_thread(state.store.adapters)]),
            "memory_notes": [MemoryNote(note_id=n.note_id, text=n.text, created_at=n.created_at,
                                        retired_by=n.retired_by, retired_at=n.retired_at, active=n.active)
                             for n in notes],
            "memory_checks": await asyncio.to_thread(_note_checks, state.store)}


def cell_record(cell: Cell, cfg: SimConfig, model_dir: Path, settings: Settings, code: CodeStamp,
                started: float, user: str, run: Progress) -> CellHeader:
    """The fields every cell file has, whatever its scenario. `run`: the cell's progress
    (checkpoint.new_progress), for the time spent before a resume and where it resumed."""
    train_cfg = settings.train_config() if METHODS[cell.method].trains else None
    return {"cell": {"scenario": cell.scenario, "method": cell.method, "seed": cell.seed}, "config": cfg.as_dict(), "model": str(model_dir.name), "user": user,
            "code": code, "clawback_version": __version__,
            "settings": settings.model_dump(mode="json", exclude={"data_dir", "model", "config_file"}),
            "train_config": None if train_cfg is None else dataclasses.asdict(train_cfg),
            "wall_s": run["wall_s"] + time.time() - started, "resumed_at": run["resumed_at"],
            "base_eval_from": run["base_eval_from"], "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


async def run_cell(cell: Cell, cfg: SimConfig, model_dir: Path, work_dir: Path,
                   on_progress: Callable[[ProgressEvent], None] = lambda _: None,
                   rater: Rater | None = None, base_cache: Path | None = None) -> CellRecord:
    """Run one cell in `work_dir` (its data dir and checkpoint, checkpoint.py), going on from its
    checkpoint when one was saved by the same code and settings; returns its result record (see
    results.py).

    `rater` judges replies for the user and for the score (default: the scenario's rules).
    `base_cache`: a file where the greedy evaluation before the first interaction is kept for the
    other cells of the scenario. It is the base model with no notes in every cell (the same
    prompts, the same batch, greedy), so it is computed once; a cell records where it came from."""
    started, code = time.time(), code_stamp()  # the code this process imported, before anything runs
    scen = scenario(cell.scenario)
    rater = rater or RuleRater(scen)
    eval_tasks = scen.eval[: cfg.eval_tasks] if cfg.eval_tasks else scen.eval
    ckpt = Checkpoint(work_dir, fingerprint(code["stamp"], cfg.as_dict(), cell.key, model_dir.name, rater.name))
    base_key = fingerprint(code["stamp"], cfg.as_dict(), cell.scenario, model_dir.name, rater.name)
    # The harness's progress: all that a checkpoint saves besides the daemon's own state.
    run = ckpt.restore() or new_progress()
    settings = cell_settings(cell, cfg, model_dir, ckpt.data_dir)
    curve, probes, interactions, evals = run["curve"], run["probes"], run["interactions"], run["evals"]
    marks = eval_marks(cfg)
    async with in_process_daemon(settings, model_dir, cfg.threads) as (state, client):

        async def probe_now(i: int) -> None:
            run["probed_notes"] = await active_notes(state)
            mass = await opener_mass(state, scen, scen.eval)  # one forward pass a task: all of them
            # Without the notes where there are some: the weights alone.
            mass_off = await opener_mass(state, scen, scen.eval, notes=False) if run["probed_notes"] else mass
            probes.append({"interaction": i, "version": state.adapters.live(), "mass": mass, "mass_off": mass_off})

        async def held_out(i: int) -> tuple[Evaluation, Evaluation]:
            """The greedy replies with the notes a main call gets, and without them."""
            result = await evaluate(client, rater, eval_tasks, cfg.max_tokens, i)
            # Without the notes: what training put into the weights. Where no notes are injected
            # the replies are the same, so they are not asked twice.
            if await active_notes(state):
                return result, await evaluate(client, rater, eval_tasks, cfg.max_tokens, i, "side")
            return result, result

        async def score_now(i: int) -> None:
            version = state.adapters.live()
            if i == 0:
                (result, off), run["base_eval_from"] = await cached_base(base_cache, base_key, cell.key, held_out)
            else:
                result, off = await held_out(i)
            curve.append({"interaction": i, "version": version, "score": result["score"], "meets": result["meets"],
                          "right": result["right"], "checks": result["checks"], "cut": result["cut"], "meta": result["meta"],
                          "repeat": result["repeat"], "meets_off": off["meets"], "right_off": off["right"]})
            evals["before" if i == 0 else "last"] = {"interaction": i, "version": version, "replies": result["replies"],
                                                     "replies_off": off["replies"]}
            on_progress({"interaction": i, "version": version, "score": result["score"]})

        if not curve:
            await probe_now(0)
            await score_now(0)
            await asyncio.to_thread(ckpt.save, state.store, settings.db_path, run, 0, started)
        user = SimulatedUser(scen, cell.seed, cfg.interactions, cfg.thumbs_down_below, cfg.move_on)
        session = f"sim-{cell.scenario}-{cell.seed}"
        for i, task in enumerate(user.tasks):
            if i < run["next"]:
                continue
            request_id = f"task-{i}"
            headers = {"x-session-id": session, "x-turn-type": "main", "x-request-id": request_id}
            reply, complete = await _chat(client, [{"role": "user", "content": task.prompt}], headers,
                                          temperature=cfg.temperature, max_tokens=cfg.max_tokens,
                                          seed=_request_seed(cell.seed, i))
            await asyncio.to_thread(state.store.flush)  # the call is stored before it is rated
            reaction = user.react(i, await rater.judge(reply, task, complete))
            if reaction.thumbs:
                await _feedback(client, session, request_id, reaction.thumbs)
            if reaction.correction:
                await _feedback(client, session, request_id, "correction", reaction.correction)
            live_before = state.adapters.live()
            await _settle(state, cfg.batch_size)
            interactions.append({"i": i, "adapter": live_before, "rating": round(reaction.judgement.score, 4),
                                 "meets": reaction.judgement.meets, "right": reaction.judgement.right,
                                 "gate": reaction.judgement.gate,
                                 "reaction": reaction.kind, "reply": reply})
            on_progress({"interaction": i + 1})
            # The probe on every new version or change of the notes (they change the prompt without
            # a new version), and where the greedy evaluation runs.
            if state.adapters.live() != live_before or await active_notes(state) != run["probed_notes"] or i + 1 in marks:
                await probe_now(i + 1)
            if i + 1 in marks:
                await score_now(i + 1)
            await asyncio.to_thread(ckpt.save, state.store, settings.db_path, run, i + 1, started)
        await _feedback(client, session, "last", "session_end")
        await _settle(state, cfg.batch_size)
        daemon = await daemon_outcome(state)
    if curve[-1]["interaction"] != cfg.interactions:  # the curve runs to the end of the cell
        curve.append({**curve[-1], "interaction": cfg.interactions, "carried": True})
    return {
        **cell_record(cell, cfg, model_dir, settings, code, started, rater.name, run),
        "eval_tasks": len(eval_tasks), "curve": curve, "probe": probes, "final_score": curve[-1]["score"],
        "interactions": interactions, "reactions": _tally(r["reaction"] for r in interactions),
        **daemon, "eval_replies": evals,
    }


def eval_marks(cfg: SimConfig) -> list[int]:
    """The interactions after which the held-out tasks are evaluated (the last at the end)."""
    return sorted({round(cfg.interactions * (k + 1) / cfg.eval_points) for k in range(cfg.eval_points)})


def _versions(adapters: list[JsonObject]) -> Versions:
    """Which trained versions went live and which the gate (or the live guard) refused, and why;
    and what the gate measured on each (its report, less the probe reply texts)."""
    return {"promoted": [a["version"] for a in adapters if a["live_at"] is not None],
            "refused": {str(a["version"]): a["reason"] for a in adapters if a["state"] == "refused"},
            "gate_seconds": [a["gate"]["seconds"] for a in adapters if "seconds" in a["gate"]],
            "gate": {str(a["version"]): {k: v for k, v in a["gate"].items() if k != "newly_failed"}
                     for a in adapters if a["gate"]}}


def _tally(items: Iterable[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for x in items:
        out[x] = out.get(x, 0) + 1
    return out
