"""The base policy on the shell scenario's held-out tasks: greedy episodes, no training.

Runs the daemon in process (as `clawback simulate` does, method `none`) on a model and plays each
held-out shell task once, greedily, through the exec tool in the sandbox (sim/shell.py): the share
solved, per family, and every command that ran with its result, one JSON line per task as it
finishes (so a stopped run keeps what it measured), then a summary line. No outcome event is sent:
held-out sessions are never trained.

    nice -n 10 .venv/bin/python bench/shell_base.py --model ~/.clawback/models/qwen2.5-coder-0.5b-instruct \
        --out bench/results/shell_base.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

from clawback.sim.config import SimConfig
from clawback.sim.harness import Cell, cell_settings, in_process_daemon
from clawback.sim.sandbox import Sandbox
from clawback.sim.shell import run_episode
from clawback.sim.shell_tasks import EVAL, SHELL
from clawback.sim.stamp import code_stamp


async def measure(model: Path, out: Path, max_tokens: int, threads: int) -> dict:
    cfg = SimConfig(max_tokens=max_tokens, threads=threads)
    sandbox = Sandbox.detect()
    solved: dict[str, list[bool]] = {}
    with tempfile.TemporaryDirectory(prefix="clawback-shell-base-") as d, out.open("w") as f:
        settings = cell_settings(Cell(SHELL, "none", 1), cfg, model, Path(d))
        async with in_process_daemon(settings, model, threads) as (_, client):
            for j, task in enumerate(EVAL):
                started, session = time.time(), f"eval-base-{j}"
                episode = await run_episode(
                    client, sandbox, task, lambda k: {"x-session-id": session, "x-turn-type": "main",
                                                      "x-request-id": f"{session}-{k}", "x-session-done": "true"},
                    temperature=0.0, max_tokens=max_tokens)
                assert episode.verdict is not None
                solved.setdefault(task.family, []).append(episode.verdict.solved)
                f.write(json.dumps({**episode.as_dict(), "seconds": round(time.time() - started, 1)}) + "\n")
                f.flush()
    total = [s for v in solved.values() for s in v]
    return {"model": model.name, "sandbox": sandbox.backend, "code": code_stamp(), "tasks": len(total),
            "solved": sum(total), "rate": sum(total) / len(total),
            "families": {k: f"{sum(v)}/{len(v)}" for k, v in solved.items()}}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, required=True, help="a local HF model dir")
    ap.add_argument("--out", type=Path, default=Path("bench/results/shell_base.jsonl"))
    ap.add_argument("--max-tokens", type=int, default=SimConfig.max_tokens)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    summary = asyncio.run(measure(args.model, args.out, args.max_tokens, args.threads))
    with args.out.open("a") as f:
        f.write(json.dumps(summary) + "\n")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
