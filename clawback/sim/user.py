"""The simulated user: sends tasks, and reacts to each reply from its rater's judgement.

Reaction rule (deterministic given the judgement and the user's coin for this interaction):
  meets (score 1, answer right) -> 👍
  answer wrong, or score < thumbs_down_below
                               -> 👎 and the correction (rules: naming what failed)
  otherwise                    -> a correction alone, or (coin < move_on) moving on without a word,
                                  so the next task becomes the reply's next state
The coins are drawn up front from the cell's seed, one per interaction, so every method of a cell
meets the same user.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from .raters import Judgement
from .scenarios import Scenario, Task


@dataclass(frozen=True)
class Reaction:
    judgement: Judgement
    thumbs: str | None  # "thumbs_up" | "thumbs_down" | None
    correction: str | None

    @property
    def kind(self) -> str:
        if self.thumbs == "thumbs_up":
            return "thumbs_up"
        if self.thumbs == "thumbs_down":
            return "thumbs_down+correction"
        return "correction" if self.correction else "moved_on"


class SimulatedUser:
    def __init__(self, scenario: Scenario, seed: int, interactions: int, thumbs_down_below: float,
                 move_on: float) -> None:
        self.scenario = scenario
        self.thumbs_down_below, self.move_on = thumbs_down_below, move_on
        rng = random.Random(f"{scenario.name}/{seed}")
        # The task order: the train tasks shuffled, repeated as often as needed.
        order: list[Task] = []
        while len(order) < interactions:
            batch = list(scenario.train)
            rng.shuffle(batch)
            order += batch
        self.tasks = order[:interactions]
        self.coins = [rng.random() for _ in range(interactions)]

    def react(self, i: int, judgement: Judgement) -> Reaction:
        if judgement.meets:
            return Reaction(judgement, "thumbs_up", None)
        if not judgement.right or judgement.score < self.thumbs_down_below:
            return Reaction(judgement, "thumbs_down", judgement.correction)
        if self.coins[i] < self.move_on:
            return Reaction(judgement, None, None)
        return Reaction(judgement, None, judgement.correction)
