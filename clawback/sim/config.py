"""What one simulation run is: a frozen config, and the methods as the daemon's presets.

A method is the daemon's `[train] preset` (or no training), never a code path of its own: `seed`
is the original project's recipe, which the daemon runs with `preset = "seed"` as well. Each cell
runs on a `Settings` built here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, cast

from clawback.trainer.config import TrainConfig

from .cell_file import SimConfigFields

TRAINER = TrainConfig()  # the trainer's defaults, which a run keeps unless it sets its own


@dataclass(frozen=True)
class Method:
    name: str
    preset: str | None = None  # the daemon's [train] preset; None = no training
    keeps_own_lr: bool = False  # the preset's lr is part of the recipe (seed): --lr does not apply
    memory: bool = False  # the person's preference notes in the prompt (the daemon's default is on)
    train: dict[str, float] = field(default_factory=dict)  # more [train] values (TrainConfig fields)
    gated: bool = True  # False: every trained version goes live (the gate and live guard off)
    consolidate: bool = False  # with memory: replies train without the notes (Settings.memory_consolidate)

    @property
    def trains(self) -> bool:
        return self.preset is not None


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("none"),  # the base model throughout: the baseline every curve starts from
    # The daemon's defaults: combined top-K OPD + Binary RL, with preference notes in the prompt.
    Method("default", "combined", memory=True),
    Method("memory", memory=True),  # preference notes only, no training
    # The default recipe plus the teacher's own hinted reply as positive evidence.
    Method("default_evidence", "combined", memory=True, train={"evidence_weight": 1.0}),
    # The default recipe plus training against loops the person marked wrong (loop_penalty).
    Method("default_loops", "combined", memory=True, train={"loop_penalty": 1.0}),
    # The default recipe with four clipped updates per batch instead of one (updates_per_batch).
    Method("default_updates", "combined", memory=True, train={"updates_per_batch": 4}),
    Method("binary", "binary"),
    # Binary RL that reads a correction without a thumb as a 👎 (correction_reward = −1).
    Method("binary_corrections", "binary", train={"correction_reward": -1.0}),
    Method("opd", "opd"),  # top-K OPD (opd_top_k = 4)
    Method("opd_token", "opd", train={"opd_top_k": 0}),  # OPD on the sampled token only
    # Top-K OPD plus the teacher's own hinted reply as positive evidence (advantage 1 per token).
    Method("opd_evidence", "opd", train={"evidence_weight": 1.0}),
    Method("combined", "combined"),  # top-K, without memory
    # The same two without the candidate gate and the live guard: what the gate changes, paired.
    Method("default_ungated", "combined", memory=True, gated=False),
    # The default recipe with note consolidation: replies train without the notes, distilled.
    Method("default_consolidated", "combined", memory=True, consolidate=True),
    # ... with four clipped updates per batch (every sample of it, liked or corrected).
    Method("default_consolidated_updates", "combined", memory=True, consolidate=True, train={"updates_per_batch": 4}),
    # ... with the teacher's own hinted reply to each correction as positive evidence, trained without the notes.
    Method("default_consolidated_evidence", "combined", memory=True, consolidate=True, train={"evidence_weight": 1.0}),
    Method("combined_ungated", "combined", gated=False),
    # The original OpenClaw-RL recipe (daemon/config.py PRESET_SIGNALS and trainer/config.py
    # PRESETS "seed"): combined advantage on the sampled token with its hint wording, teacher = the
    # frozen base model + hint, a judge that sees only the reply and the next state, zero-signal
    # samples counted toward the batch, no importance sampling correction, Adam lr 1e-5, weight
    # decay 0.1, betas (0.9, 0.98).
    Method("seed", "seed", keeps_own_lr=True),
)}


def parse_methods(text: str) -> tuple[str, ...]:
    """'combined', 'binary,combined' or 'all' -> method names, in the order given."""
    names = list(METHODS) if text.strip() == "all" else [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in METHODS]
    if unknown or not names:
        raise ValueError(f"unknown method(s) {', '.join(unknown) or repr(text)}; choose from "
                         f"{', '.join(METHODS)}, a comma list of them, or all")
    return tuple(dict.fromkeys(names))


@dataclass(frozen=True)
class SimConfig:
    interactions: int = 48  # tasks (one session each) the simulated user sends and reacts to per cell
    batch_size: int = 4  # ready samples per training step
    lr: float = TRAINER.lr  # binary/opd/combined; seed keeps its recipe's 1e-5
    lora_rank: int = TRAINER.lora_rank
    lora_alpha: int = TRAINER.lora_alpha
    # Per reply (training and eval): large enough that a finished reply is never cut (a cut reply
    # fails every check; bench/README.md counts the cut ones).
    max_tokens: int = 400
    temperature: float = 0.7  # replies during interactions (sampled with a per-request seed)
    eval_tasks: int = 0  # held-out tasks of the greedy evaluation; 0 = all of the scenario's
    # Greedy evaluation on the held-out tasks before the first interaction and at this many evenly
    # spaced points after it (the last at the end); the generation-free probe runs on every version.
    eval_points: int = 2
    kl_coef: float = TRAINER.kl_coef  # KL-to-base anchor of every training method
    threads: int = 1  # torch threads for the engine and the trainer (they never run at once)
    # The simulated user: 👍 when a reply passes every check; below `thumbs_down_below` 👎 and a
    # correction; in between a correction alone, or, with probability `move_on`, no feedback at all
    # (the next task arrives as the reply's next state).
    thumbs_down_below: float = 0.5
    move_on: float = 0.25
    # Who judges replies: None = the scenario's rules; else "MODEL@URL" of an OpenAI-compatible
    # endpoint playing the user (raters.LLMRater). Part of the config so cells never mix the two.
    user_llm: str | None = None
    # The candidate gate and the live guard (clawback.daemon.gate), as in the daemon: on by default.
    gate: bool = True

    def __post_init__(self) -> None:
        if self.interactions < 1 or self.batch_size < 1 or self.max_tokens < 1:
            raise ValueError("interactions, batch_size and max_tokens must be at least 1")
        if not (self.lr > 0 and 0 <= self.move_on <= 1 and 0 <= self.thumbs_down_below <= 1):
            raise ValueError("need lr > 0 and move_on, thumbs_down_below in [0, 1]")
        if self.temperature < 0 or self.eval_tasks < 0 or self.threads < 0 or self.eval_points < 1:
            raise ValueError("temperature, eval_tasks and threads must not be negative; eval_points >= 1")
        if self.kl_coef < 0:
            raise ValueError("kl_coef must not be negative")

    def settings_for(self, method: Method, seed: int) -> dict[str, Any]:
        """The `Settings` values of one cell besides its paths: the method's preset, the run's sizes.

        Any: `Settings` keyword arguments, each of its own type, its sections given as dicts."""
        train: dict[str, object] = {"enabled": method.trains, "preset": method.preset or "combined",
                                 "batch_size": self.batch_size, "lora_rank": self.lora_rank,
                                 "lora_alpha": self.lora_alpha, "seed": seed, "threads": self.threads,
                                 "kl_coef": self.kl_coef, "drop_cut_replies": True, **method.train}
        if not method.keeps_own_lr:
            train["lr"] = self.lr
        return {"judge": {"backend": "off"}, "train": train, "default_max_tokens": self.max_tokens,
                "torch_threads": self.threads, "memory": method.memory, "memory_consolidate": method.consolidate,
                "gate": {} if self.gate and method.gated else {"enabled": False, "guard_replies": 0}}

    def as_dict(self) -> SimConfigFields:
        return cast(SimConfigFields, dataclasses.asdict(self))
