"""The simulated user: reads a reply, rates it with the scenario's rules, and reacts.

Reaction rule (deterministic given the rating and the user's coin for this interaction):
  rating == 1                  -> 👍
  rating <  thumbs_down_below  -> 👎 and a correction naming what failed
  otherwise                    -> a correction alone, or (coin < move_on) moving on without a word,
                                  so the next task becomes the reply's next state
The coins are drawn up front from the cell's seed, one per interaction, so every method of a cell
meets the same user.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from .scenarios import Rating, Scenario, Task


@dataclass(frozen=True)
class Reaction:
    rating: Rating
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

    def react(self, i: int, reply: str) -> Reaction:
        rating = self.scenario.rate(reply, self.tasks[i])
        if not rating.failed:
            return Reaction(rating, "thumbs_up", None)
        correction = self.scenario.correction(rating)
        if rating.score < self.thumbs_down_below:
            return Reaction(rating, "thumbs_down", correction)
        if self.coins[i] < self.move_on:
            return Reaction(rating, None, None)
        return Reaction(rating, None, correction)
