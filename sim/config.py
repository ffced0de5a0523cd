"""What one simulation run is: a frozen config, and the methods as bundles of settings.

A method is a set of daemon `Settings` values plus a `TrainConfig` preset, never a code path of
its own: `seed` is the original project's recipe expressed as those values.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from clawback.trainer.config import PRESETS, TrainConfig


@dataclass(frozen=True)
class Method:
    name: str
    settings: dict[str, Any] = field(default_factory=dict)  # daemon Settings fields
    train_preset: str | None = None  # clawback.trainer.config.PRESETS name; None = no training
    keeps_own_lr: bool = False  # the preset's lr is part of the recipe (seed): --lr does not apply

    @property
    def trains(self) -> bool:
        return self.train_preset is not None


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("none"),  # the base model throughout: the baseline every curve starts from
    # The daemon's defaults: combined top-K OPD + Binary RL, with preference notes in the prompt.
    Method("default", {"method": "combined", "memory": True}, "combined"),
    Method("memory", {"memory": True}),  # preference notes only, no training
    Method("binary", {"method": "binary"}, "binary"),
    Method("opd", {"method": "opd"}, "opd"),  # top-K OPD (opd_top_k = 4)
    Method("opd_token", {"method": "opd", "opd_top_k": 0}, "opd"),  # OPD on the sampled token only
    # Top-K OPD plus the teacher's own hinted reply as positive evidence (advantage 1 per token).
    Method("opd_evidence", {"method": "opd", "evidence_weight": 1.0}, "opd"),
    Method("combined", {"method": "combined"}, "combined"),  # top-K, without memory
    # The original OpenClaw-RL recipe (reference seed-openclaw-rl.md §2-§3): combined advantage,
    # teacher = the frozen base model + hint, a judge that sees only the reply and the next state,
    # zero-signal samples counted toward the batch, OPD on the sampled token with its hint wording,
    # and the trainer preset "seed" (no importance sampling correction, Adam lr 1e-5, weight decay
    # 0.1, betas (0.9, 0.98)).
    Method("seed", {"method": "combined", "teacher": "base", "judge_context": "response_only",
                    "count_zero_signal": True, "opd_top_k": 0, "hint_template": "hint"}, "seed",
           keeps_own_lr=True),
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
    lr: float = 1e-4  # binary/opd/combined; seed keeps its recipe's 1e-5
    lora_rank: int = 16
    lora_alpha: int = 32
    # Per reply (training and eval): large enough that a finished reply is never cut (a cut reply
    # fails every check; bench/README.md counts the cut ones).
    max_tokens: int = 400
    temperature: float = 0.7  # replies during interactions (sampled with a per-request seed)
    eval_tasks: int = 0  # held-out tasks of the greedy evaluation; 0 = all of the scenario's
    # Greedy evaluation on the held-out tasks before the first interaction and at this many evenly
    # spaced points after it (the last at the end); the generation-free probe runs on every version.
    eval_points: int = 2
    kl_coef: float = 0.0  # KL-to-base anchor of every training method
    threads: int = 1  # torch threads for the engine and the trainer (they never run at once)
    # The simulated user: 👍 when a reply passes every check; below `thumbs_down_below` 👎 and a
    # correction; in between a correction alone, or, with probability `move_on`, no feedback at all
    # (the next task arrives as the reply's next state).
    thumbs_down_below: float = 0.5
    move_on: float = 0.25
    # Who judges replies: None = the scenario's rules; else "MODEL@URL" of an OpenAI-compatible
    # endpoint playing the user (raters.LLMRater). Part of the config so cells never mix the two.
    user_llm: str | None = None

    def __post_init__(self) -> None:
        if self.interactions < 1 or self.batch_size < 1 or self.max_tokens < 1:
            raise ValueError("interactions, batch_size and max_tokens must be at least 1")
        if not (self.lr > 0 and 0 <= self.move_on <= 1 and 0 <= self.thumbs_down_below <= 1):
            raise ValueError("need lr > 0 and move_on, thumbs_down_below in [0, 1]")
        if self.temperature < 0 or self.eval_tasks < 0 or self.threads < 0 or self.eval_points < 1:
            raise ValueError("temperature, eval_tasks and threads must not be negative; eval_points >= 1")
        if self.kl_coef < 0:
            raise ValueError("kl_coef must not be negative")

    def settings_for(self, method: Method) -> dict[str, Any]:
        """Daemon settings of one cell (besides paths): the method's values, the run's sizes."""
        return {"judge": "off", "batch_size": self.batch_size, "lora_rank": self.lora_rank,
                "lora_alpha": self.lora_alpha, "lr": self.lr, "default_max_tokens": self.max_tokens,
                "torch_threads": self.threads, "trainer_threads": self.threads, "memory": False,
                "kl_coef": self.kl_coef, **method.settings}

    def train_config(self, method: Method, seed: int) -> TrainConfig:
        """The trainer's config as the daemon builds it from the cell's settings, on the method's preset."""
        from clawback.daemon.config import Settings
        from clawback.daemon.server import train_config

        settings = Settings(**self.settings_for(method), no_auth=True)
        own = {"lr": PRESETS[method.train_preset].lr} if method.keeps_own_lr else {}
        return train_config(settings, method.train_preset, seed=seed, **own)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
