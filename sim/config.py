"""What one simulation run is: a frozen config, and the methods as the daemon's presets.

A method is the daemon's `[train] preset` (or no training), never a code path of its own: `seed`
is the original project's recipe, which the daemon runs with `preset = "seed"` as well. Each cell
runs on a `Settings` built here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any



@dataclass(frozen=True)
class Method:
    name: str
    preset: str | None = None  # the daemon's [train] preset; None = no training
    keeps_own_lr: bool = False  # the preset's lr is part of the recipe (seed): --lr does not apply

    @property
    def trains(self) -> bool:
        return self.preset is not None


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("none"),  # the base model throughout: the baseline every curve starts from
    Method("binary", "binary"),
    Method("opd", "opd"),
    Method("combined", "combined"),
    # The original OpenClaw-RL recipe (daemon/config.py PRESET_SIGNALS and trainer/config.py
    # PRESETS "seed"): combined advantage, teacher = the frozen base model + hint, a judge that sees
    # only the reply and the next state, zero-signal samples counted toward the batch, no
    # importance sampling correction, Adam lr 1e-5, weight decay 0.1, betas (0.9, 0.98).
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
    interactions: int = 48  # tasks the simulated user sends (and reacts to) per cell
    batch_size: int = 4  # ready samples per training step
    lr: float = 1e-4  # binary/opd/combined; seed keeps its recipe's 1e-5
    lora_rank: int = 16
    lora_alpha: int = 32
    max_tokens: int = 96  # per reply (training and eval)
    temperature: float = 0.7  # replies during interactions (sampled with a per-request seed)
    eval_tasks: int = 0  # held-out tasks scored after every version; 0 = all of the scenario's
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
        if self.temperature < 0 or self.eval_tasks < 0 or self.threads < 0:
            raise ValueError("temperature, eval_tasks and threads must not be negative")

    def settings_for(self, method: Method, seed: int) -> dict[str, Any]:
        """The `Settings` values of one cell besides its paths: the method's preset, the run's sizes."""
        train: dict[str, Any] = {"enabled": method.trains, "preset": method.preset or "combined",
                                 "batch_size": self.batch_size, "lora_rank": self.lora_rank,
                                 "lora_alpha": self.lora_alpha, "seed": seed, "threads": self.threads}
        if not method.keeps_own_lr:
            train["lr"] = self.lr
        return {"judge": {"backend": "off"}, "train": train, "default_max_tokens": self.max_tokens,
                "torch_threads": self.threads}

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
