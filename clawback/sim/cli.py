"""`clawback simulate`: run cells (scenario × method × seed), skip finished ones, summarize, plot."""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import shutil
import sys
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import TYPE_CHECKING

from clawback.daemon.config import DEFAULT_MODEL

from .cell_file import CellRecord, ProgressEvent
from .config import METHODS, SimConfig, parse_methods
from .scenarios import SCENARIOS
from .shell_tasks import SHELL

SCENARIO_NAMES = [*SCENARIOS, SHELL]
WORK = ".work"  # under --out: unfinished cells and the shared base evaluations (not results)


if TYPE_CHECKING:
    from .harness import Cell


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("simulate", help="measure personalization: the real loop against a simulated user",
                       description=__doc__)
    p.add_argument("--scenario", default="student",
                   help=f"{', '.join(SCENARIO_NAMES)}, a comma list, or all (default student)")
    p.add_argument("--method", default="all", help=f"{', '.join(METHODS)}, a comma list, or all (default all)")
    p.add_argument("--interactions", type=int, default=48, help="tasks per cell (default 48)")
    p.add_argument("--seeds", type=int, default=3, help="seeds 1..K per scenario and method (default 3)")
    p.add_argument("--first-seed", type=int, default=1, help="start seeds here (default 1)")
    p.add_argument("--out", default="bench/results/simulate", help="output dir (default bench/results/simulate)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="a catalogue name (clawback models list) or a local HF model dir")
    p.add_argument("--batch-size", type=int, default=SimConfig.batch_size)
    p.add_argument("--lr", type=float, default=SimConfig.lr, help="binary/opd/combined (seed keeps its recipe's 1e-5)")
    p.add_argument("--lora-rank", type=int, default=SimConfig.lora_rank)
    p.add_argument("--max-tokens", type=int, default=SimConfig.max_tokens)
    p.add_argument("--temperature", type=float, default=SimConfig.temperature)
    p.add_argument("--eval-tasks", type=int, default=SimConfig.eval_tasks, help="0 = all held-out tasks")
    p.add_argument("--eval-points", type=int, default=SimConfig.eval_points,
                   help="greedy held-out evaluations after the start, evenly spaced (the probe runs on every version)")
    p.add_argument("--kl-coef", type=float, default=SimConfig.kl_coef, help="KL-to-base anchor of the training methods")
    p.add_argument("--threads", type=int, default=SimConfig.threads, help="torch threads (default 1)")
    p.add_argument("--user-llm", help="an OpenAI-compatible base URL whose model plays the user instead of the "
                   "rules (key from $CLAWBACK_USER_LLM_KEY)")
    p.add_argument("--user-llm-model", help="model name at --user-llm (required with it)")
    p.add_argument("--no-gate", action="store_true", help="every trained version goes live (no candidate gate, no live guard)")
    p.add_argument("--plot-only", action="store_true", help="only redraw summary and plot from existing cells")
    p.set_defaults(fn=cmd_simulate)


def _names(text: str, known: Collection[str], what: str) -> list[str]:
    names = list(known) if text.strip() == "all" else [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise ValueError(f"unknown {what} {', '.join(bad) or repr(text)}; choose from {', '.join(known)} or all")
    return names


class Progress:
    """One status line on stderr (redrawn in place on a terminal, a line per change elsewhere)."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.t0 = max(total, 1), 0, time.time()
        self.tty = sys.stderr.isatty()
        self.cell, self.note = "", ""

    def show(self, i: int, n: int) -> None:
        frac = self.done / self.total
        bar = "█" * int(frac * 24) + "·" * (24 - int(frac * 24))
        elapsed = time.time() - self.t0
        eta = f"{elapsed / frac * (1 - frac) / 60:.0f}m left" if frac > 0 else "…"
        line = f"[{bar}] {self.cell} {i}/{n} {self.note} | {elapsed / 60:.1f}m, {eta}"
        print(("\r" + line.ljust(110)) if self.tty else line, end="" if self.tty else "\n", file=sys.stderr, flush=True)

    def end_cell(self) -> None:
        if self.tty:
            print(file=sys.stderr)


async def _run(cell: Cell, cfg: SimConfig, model_dir: Path, work_dir: Path, base_cache: Path,
               on_progress: Callable[[ProgressEvent], None], args: argparse.Namespace) -> CellRecord:
    import os

    from .harness import run_cell
    from .raters import LLMRater
    from .scenarios import scenario
    from .shell import run_shell_cell

    if cell.scenario == SHELL:
        return await run_shell_cell(cell, cfg, model_dir, work_dir, on_progress, base_cache)
    if not args.user_llm:
        return await run_cell(cell, cfg, model_dir, work_dir, on_progress, base_cache=base_cache)
    rater = LLMRater(scenario(cell.scenario), args.user_llm, args.user_llm_model,
                     os.environ.get("CLAWBACK_USER_LLM_KEY"))
    try:
        return await run_cell(cell, cfg, model_dir, work_dir, on_progress, rater, base_cache)
    finally:
        await rater.close()


def _units(cfg: SimConfig, cell: Cell) -> int:
    return cfg.interactions


def _cell_process(cell: Cell, cfg: SimConfig, model_dir: Path, out: Path, args: argparse.Namespace,
                  progress_at: tuple[int, int, float]) -> None:
    """Run one cell and write its file (the body of the per-cell process)."""
    from transformers.utils import logging as hf_logging

    from .results import write_cell

    hf_logging.disable_progress_bar()
    progress = Progress(progress_at[1])
    progress.done, progress.t0, progress.cell = progress_at[0], progress_at[2], cell.key
    n = _units(cfg, cell)

    def on_progress(ev: ProgressEvent) -> None:
        if "score" in ev:
            v = ev.get("version")
            progress.note = f"{'base' if v is None else f'v{v}'} score {ev['score']:.2f}"
        else:
            progress.done += 1
        progress.show(ev["interaction"], n)

    # The cell's data dir and checkpoint (checkpoint.py): a stopped run goes on from there.
    work_dir = out / WORK / cell.scenario / cell.method / f"seed{cell.seed}"
    record = asyncio.run(_run(cell, cfg, model_dir, work_dir, out / WORK / f"base-{cell.scenario}.json", on_progress,
                              args))
    write_cell(out, cell, record)
    shutil.rmtree(work_dir, ignore_errors=True)
    progress.end_cell()


def _check_config(existing: CellRecord, cfg: SimConfig, path: Path) -> None:
    from .results import stamp_of
    from .stamp import code_stamp

    # A key added since the cell ran had its default then, except the gate: cells from before it
    # ran without one.
    was: dict[str, object] = {**SimConfig().as_dict(), "gate": False, **existing["config"]}
    diff = {k: (was[k], v) for k, v in cfg.as_dict().items() if was[k] != v}
    if diff:
        raise ValueError(f"{path} was run with other settings {diff} (was, now): use another --out or delete it")
    # A cell of other code is not this code's result; skipping it would leave a hole in the summary.
    if stamp_of(existing) != code_stamp()["stamp"]:
        raise ValueError(f"{path} was run by other code (stamp {stamp_of(existing)}, now {code_stamp()['stamp']}): "
                         "use another --out or delete it")


def cmd_simulate(args: argparse.Namespace) -> int:
    from clawback.daemon.config import load_settings
    from clawback.daemon.models import resolve_model

    from .harness import Cell
    from .results import cell_path, markdown_table, read_cell, write_summary

    if bool(args.user_llm) != bool(args.user_llm_model):
        raise ValueError("--user-llm and --user-llm-model go together")
    scenarios = _names(args.scenario, SCENARIO_NAMES, "scenario")
    if args.user_llm and SHELL in scenarios:
        raise ValueError("the shell scenario is decided by its checker, not a user: leave out --user-llm")
    methods = parse_methods(args.method)
    if args.seeds < 1:
        raise ValueError("--seeds must be at least 1")
    cfg = SimConfig(interactions=args.interactions, batch_size=args.batch_size, lr=args.lr, lora_rank=args.lora_rank,
                    lora_alpha=2 * args.lora_rank, max_tokens=args.max_tokens, temperature=args.temperature,
                    eval_tasks=args.eval_tasks, eval_points=args.eval_points, kl_coef=args.kl_coef, threads=args.threads,
                    gate=not args.no_gate,
                    user_llm=f"{args.user_llm_model}@{args.user_llm}" if args.user_llm else None)
    out = Path(args.out)
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    # Seeds outermost: a stopped run leaves every method with about the same number of seeds.
    cells = [Cell(s, m, k) for k in seeds for s in scenarios for m in methods]
    if not args.plot_only:
        model_dir = Path(resolve_model(args.model, load_settings().models_dir))
        todo = []
        for cell in cells:
            existing = read_cell(out, cell)
            if existing is None:
                todo.append(cell)
            else:
                _check_config(existing, cfg, cell_path(out, cell))
        print(f"simulate: {len(cells)} cells, {len(cells) - len(todo)} already finished, {len(todo)} to run "
              f"({out})", file=sys.stderr)
        progress = Progress(sum(_units(cfg, c) for c in todo))
        for cell in todo:
            # Each cell runs in a fresh process: two models, an optimizer and the transient
            # full-vocabulary tensors of training are returned to the OS when the cell ends,
            # whatever the allocator kept, so a long grid does not grow.
            ctx = multiprocessing.get_context("spawn")
            child = ctx.Process(target=_cell_process, args=(cell, cfg, model_dir, out, args,
                                                             (progress.done, progress.total, progress.t0)))
            child.start()
            child.join()
            if child.exitcode != 0:
                raise RuntimeError(f"cell {cell.key} failed (exit code {child.exitcode}); its error is above")
            progress.done += _units(cfg, cell)
            record = read_cell(out, cell)
            assert record is not None  # the cell's process wrote it
            met = sum(r["meets"] for r in record["interactions"])
            versions = record.get("versions", {})
            print(f"{cell.key}: score {record['curve'][0]['score']:.3f} -> {record['final_score']:.3f}, "
                  f"{met}/{len(record['interactions'])} replies met the preference with a right answer, "
                  f"{sum(s['outcome'] == 'committed' for s in record['steps'])} steps "
                  f"({len(versions.get('promoted', []))} promoted, {len(versions.get('refused', {}))} refused), "
                  f"{record['wall_s'] / 60:.1f} min",
                  file=sys.stderr, flush=True)
    summary, pngs = write_summary(out, cells)
    print(markdown_table(summary))
    if summary["missing"]:
        print(f"missing cells: {', '.join(summary['missing'])}", file=sys.stderr)
    print(json.dumps({"summary": str(out / "summary.json"), "plots": [str(p) for p in pngs]}))
    return 0
