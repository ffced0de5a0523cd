"""The shell scenario: the policy solves small shell tasks through a tool call that runs in a sandbox.

Each task is one session. The task's files are made in a fresh directory (shell_tasks.py); the
policy gets the task with one OpenAI tool, `exec(command)` (OpenClaw's exec tool, less its
options), and every command it calls runs in that directory in the sandbox (sandbox.py). The tool
result comes back as a `tool` message in OpenClaw's exec wording (the output, then "(Command
exited with code N)" on a failure; "Tool NAME not found" for a call of any other tool), so the
daemon stores it as the next state of the call that issued it, and the policy may try again: at
most `MAX_CALLS` tool calls, then one more reply. The checker decides from the directory's final
state or the last command's output, never from the reply's words, and the simulator reports the
verdict to the daemon as an `outcome` event (reward +1 solved, −1 not, the checker's words as its
text) before it ends the session. There is no simulated person: no 👍/👎, no correction.

The held-out tasks are run greedily before the first task and at `eval_points` points after it,
each call a main call that ends its session at once (`x-session-done`): none is paired with a next
state and no outcome is sent for them, so they are never trained.

A cell's record has the fields of the other scenarios' (results.py reads it unchanged): a session
**meets** the scenario when its task is solved, and the held-out score is the share solved.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict

import httpx

from clawback.records import JsonObject

from .cell_file import CellRecord, EpisodeRecord, ProgressEvent, ShellCommand, ShellInteraction
from .checkpoint import Checkpoint, cached_base, fingerprint, new_progress
from .config import SimConfig
from .harness import (
    Cell,
    SimError,
    _request_seed,
    _settle,
    _tally,
    cell_record,
    cell_settings,
    daemon_outcome,
    eval_marks,
    in_process_daemon,
)
from .sandbox import Sandbox, task_directory
from .shell_tasks import EVAL, SHELL, TRAIN, ShellTask, Verdict
from .stamp import code_stamp

MAX_CALLS = 3
EXEC_TOOL = {"type": "function", "function": {
    "name": "exec",
    "description": "Run a shell command in the task directory. Returns its output (stdout and stderr) and, "
                   "when it fails, its exit code.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string", "description": "Shell command to run."}},
                   "required": ["command"]}}}
SYSTEM = ("You are an agent working in a Linux shell. Use the exec tool to run shell commands in {where}, "
          "the task directory, and read their output. Solve the task by running commands (at most "
          f"{MAX_CALLS}); when it is done, say so in one sentence.")


@dataclass
class Episode:
    task: str
    commands: list[ShellCommand] = field(default_factory=list)  # what ran, its exit code, the result text
    replies: list[str] = field(default_factory=list)  # the policy's text of each call
    cut: int = 0  # replies cut by the token budget
    verdict: Verdict | None = None

    def as_dict(self) -> EpisodeRecord:
        assert self.verdict is not None
        return {"task": self.task, "solved": self.verdict.solved, "why": self.verdict.why, "commands": self.commands,
                "replies": self.replies, "cut": self.cut}


async def _complete(client: httpx.AsyncClient, messages: list[JsonObject], headers: dict[str, str],
                    **sampling: float) -> JsonObject:
    """The completion's first choice, as the OpenAI route answers it."""
    r = await client.post("/v1/chat/completions", headers=headers,
                          json={"model": "clawback", "messages": messages, "tools": [EXEC_TOOL], **sampling})
    if r.status_code != 200:
        raise SimError(f"chat completion failed: {r.status_code} {r.text[:500]}")
    return r.json()["choices"][0]


def _command_of(call: JsonObject) -> str | None:
    try:
        args = json.loads(call["function"].get("arguments") or "{}")
    except json.JSONDecodeError:
        return None
    command = args.get("command") if isinstance(args, dict) else None
    return command if isinstance(command, str) and command.strip() else None


async def run_episode(client: httpx.AsyncClient, sandbox: Sandbox, task: ShellTask, headers: Callable[[int], dict[str, str]],
                      **sampling: float) -> Episode:
    """The policy works on the task in a fresh directory until it replies without a tool call or has
    run MAX_CALLS commands (and replied once more); then the checker decides. `headers(k)` gives the
    k-th call's capture headers."""
    episode, last = Episode(task.key), None  # last: the newest command's result
    workdir = task_directory()
    try:
        await asyncio.to_thread(task.make, workdir)
        messages: list[JsonObject] = [{"role": "system", "content": SYSTEM.format(where=sandbox.workdir_name)},
                                          {"role": "user", "content": task.prompt}]
        for k in range(MAX_CALLS + 1):
            choice = await _complete(client, messages, headers(k), **sampling)
            message = choice["message"]
            episode.replies.append(message.get("content") or "")
            episode.cut += choice["finish_reason"] == "length"
            calls = message.get("tool_calls") or []
            if not calls or len(episode.commands) >= MAX_CALLS:
                break
            messages.append({"role": "assistant", "content": message.get("content"), "tool_calls": calls})
            for call in calls:
                command = _command_of(call)
                name = call.get("function", {}).get("name")
                if len(episode.commands) >= MAX_CALLS:
                    text = f"Not run: at most {MAX_CALLS} commands per task."
                elif name != EXEC_TOOL["function"]["name"]:  # as OpenClaw answers a tool it does not have
                    text = f"Tool {name} not found"
                    episode.commands.append({"command": None, "exit_code": None, "result": text})
                elif command is None:
                    text = 'exec needs a non-empty string argument "command".'
                    episode.commands.append({"command": None, "exit_code": None, "result": text})
                else:
                    last = await asyncio.to_thread(sandbox.run, command, workdir)
                    text = last.text()
                    episode.commands.append({"command": command, "exit_code": last.exit_code, "result": text})
                messages.append({"role": "tool", "tool_call_id": call.get("id") or "", "content": text})
        episode.verdict = await asyncio.to_thread(task.check, workdir, last, sandbox)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return episode


async def send_outcome(client: httpx.AsyncClient, session: str, verdict: Verdict) -> None:
    """The checker's verdict as the daemon's `outcome` event for the whole session (docs/protocol.md)."""
    body = {"event_id": str(uuid.uuid4()), "kind": "outcome", "session_id": session,
            "reward": 1.0 if verdict.solved else -1.0, "source": "simulator", "text": verdict.why}
    r = await client.post("/v1/feedback", json=body)
    if r.status_code == 400 and "kind" in r.text:
        raise SimError("the daemon refused the outcome event (kind \"outcome\"): the shell scenario needs a daemon "
                       f"that takes outcome events; it answered {r.status_code} {r.text[:300]}")
    if r.status_code not in (200, 202):
        raise SimError(f"outcome event failed: {r.status_code} {r.text[:500]}")


async def _end_session(client: httpx.AsyncClient, session: str) -> None:
    r = await client.post("/v1/feedback", json={"event_id": str(uuid.uuid4()), "kind": "session_end",
                                                "session_id": session, "source": "simulator"})
    if r.status_code not in (200, 202):
        raise SimError(f"session_end failed: {r.status_code} {r.text[:500]}")


class ShellEvaluation(TypedDict):
    """Greedy episodes on the held-out tasks."""

    solved: float  # the share solved
    families: dict[str, float]  # the share solved per task family
    cut: int
    episodes: list[EpisodeRecord]


async def evaluate(client: httpx.AsyncClient, sandbox: Sandbox, tasks: tuple[ShellTask, ...], max_tokens: int,
                   point: int) -> ShellEvaluation:
    """Greedy episodes on the held-out tasks: the share solved, per family, and what ran."""
    episodes = []
    for j, task in enumerate(tasks):
        session = f"eval-{point}-{j}"
        episodes.append(await run_episode(
            client, sandbox, task, lambda k: {"x-session-id": session, "x-turn-type": "main",
                                              "x-request-id": f"{session}-{k}", "x-session-done": "true"},
            temperature=0.0, max_tokens=max_tokens))
    families: dict[str, list[bool]] = {}
    for task, e in zip(tasks, episodes):
        assert e.verdict is not None
        families.setdefault(task.family, []).append(e.verdict.solved)
    solved = sum(e.verdict.solved for e in episodes if e.verdict) / len(episodes)
    return {"solved": solved, "families": {f: sum(v) / len(v) for f, v in families.items()},
            "cut": sum(e.cut for e in episodes), "episodes": [e.as_dict() for e in episodes]}


def task_order(seed: int, interactions: int) -> list[ShellTask]:
    """The train tasks shuffled by the seed, repeated as often as needed: every method of a seed
    gets the same tasks in the same order."""
    rng, order = random.Random(f"{SHELL}/{seed}"), []
    while len(order) < interactions:
        batch = list(TRAIN)
        rng.shuffle(batch)
        order += batch
    return order[:interactions]


async def run_shell_cell(cell: Cell, cfg: SimConfig, model_dir: Path, work_dir: Path,
                         on_progress: Callable[[ProgressEvent], None] = lambda _: None,
                         base_cache: Path | None = None) -> CellRecord:
    """Run one shell cell in `work_dir`, from its checkpoint where there is one (as
    harness.run_cell); returns its result record (see results.py)."""
    started, code = time.time(), code_stamp()
    sandbox = await asyncio.to_thread(Sandbox.detect)
    user = f"checker ({sandbox.backend} sandbox)"
    eval_tasks = EVAL[: cfg.eval_tasks] if cfg.eval_tasks else EVAL
    ckpt = Checkpoint(work_dir, fingerprint(code["stamp"], cfg.as_dict(), cell.key, model_dir.name, user))
    base_key = fingerprint(code["stamp"], cfg.as_dict(), cell.scenario, model_dir.name, user)
    run = ckpt.restore() or new_progress()
    settings = cell_settings(cell, cfg, model_dir, ckpt.data_dir)
    curve, interactions, evals = run["curve"], run["interactions"], run["evals"]
    marks = eval_marks(cfg)
    async with in_process_daemon(settings, model_dir, cfg.threads) as (state, client):

        async def held_out(i: int) -> ShellEvaluation:
            return await evaluate(client, sandbox, eval_tasks, cfg.max_tokens, i)

        async def score_now(i: int) -> None:
            version = state.adapters.live()
            if i == 0:  # the base model in every cell: computed once per scenario
                result, run["base_eval_from"] = await cached_base(base_cache, base_key, cell.key, held_out)
            else:
                result = await held_out(i)
            curve.append({"interaction": i, "version": version, "score": result["solved"], "meets": result["solved"],
                          "right": result["solved"], "checks": result["families"], "cut": result["cut"],
                          "meta": 0, "repeat": 0})
            evals["before" if i == 0 else "last"] = {"interaction": i, "version": version,
                                                     "episodes": result["episodes"]}
            on_progress({"interaction": i, "version": version, "score": result["solved"]})

        if not curve:
            await score_now(0)
            await asyncio.to_thread(ckpt.save, state.store, settings.db_path, run, 0, started)
        for i, task in enumerate(task_order(cell.seed, cfg.interactions)):
            if i < run["next"]:
                continue
            session = f"sim-{SHELL}-{cell.seed}-{i}"
            episode = await run_episode(
                client, sandbox, task, lambda k: {"x-session-id": session, "x-turn-type": "main",
                                                  "x-request-id": f"task-{i}-{k}"},
                temperature=cfg.temperature, max_tokens=cfg.max_tokens, seed=_request_seed(cell.seed, i))
            assert episode.verdict is not None
            await asyncio.to_thread(state.store.flush)  # the calls are stored before the outcome names them
            await send_outcome(client, session, episode.verdict)
            await _end_session(client, session)
            live_before = state.adapters.live()
            await _settle(state, cfg.batch_size)
            solved = episode.verdict.solved
            row: ShellInteraction = {"i": i, "adapter": live_before, "rating": float(solved), "meets": solved,
                                     "right": solved, "gate": "cut" if episode.cut and not solved else None,
                                     "reaction": "solved" if solved else "failed", **episode.as_dict(),
                                     "reply": episode.replies[-1]}
            interactions.append(row)
            on_progress({"interaction": i + 1})
            if i + 1 in marks:
                await score_now(i + 1)
            await asyncio.to_thread(ckpt.save, state.store, settings.db_path, run, i + 1, started)
        daemon = await daemon_outcome(state)
    return {
        **cell_record(cell, cfg, model_dir, settings, code, started, user, run),
        "eval_tasks": len(eval_tasks), "curve": curve, "probe": [], "final_score": curve[-1]["score"],
        "interactions": interactions, "reactions": _tally(r["reaction"] for r in interactions),
        **daemon, "eval_replies": evals,
    }
