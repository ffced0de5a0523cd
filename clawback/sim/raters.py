"""How the simulated user judges a reply: the scenario's rules (default) or an LLM (--user-llm).

Both give a `Judgement`: a 0..1 score and, for an imperfect reply, the correction the user would
type. The rule-based rater is deterministic and documented in scenarios.py; the LLM rater asks an
OpenAI-compatible endpoint to play the user with the scenario's hidden preference, at
temperature 0, and parses `\\boxed{0..10}` and a `[CORRECTION]...[/CORRECTION]` block. Whether
the answer is right is the scenario's rule for both (answers.py): no rater's opinion makes a
wrong answer meet.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import httpx

from clawback.judge.prm import parse_score

from .scenarios import Scenario, Task


@dataclass(frozen=True)
class Judgement:
    score: float  # 0..1
    correction: str | None  # the user's words when the reply fell short; None when it was perfect
    checks: dict[str, bool] | None = None  # rule-based only: each check's outcome
    gate: str | None = None  # rule-based only: "cut" | "meta" | "repeat" when the reply failed every check at once
    right: bool = True  # the answer is right (the scenario's rule, whoever rates the form)

    @property
    def meets(self) -> bool:
        """The reply gives the person what they want: every check (a 10/10 from the LLM user) and
        a right answer."""
        return self.score >= 1 and self.right


class RuleRater:
    name = "rules"

    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario

    def judge_now(self, reply: str, task: Task, complete: bool = True) -> Judgement:
        rating = self.scenario.rate(reply, task, complete)
        return Judgement(rating.score, None if rating.meets else self.scenario.correction(rating),
                         {c.name: c not in rating.failed for c in self.scenario.checks}, rating.gate, rating.right)

    async def judge(self, reply: str, task: Task, complete: bool = True) -> Judgement:
        return self.judge_now(reply, task, complete)


USER_LLM_SYSTEM = """You play a person using an AI assistant. What you want: {description}.
In your own words: {preference}
You will see the message you sent and the assistant's reply. Rate how well the reply gives you
what you want from 0 (not at all) to 10 (exactly), as \\boxed{{N}}. If it is below 10, then write
the one or two sentences you would send back to say what you wanted, between [CORRECTION] and
[/CORRECTION]."""

_CORRECTION = re.compile(r"\[CORRECTION\](.*?)\[/CORRECTION\]", re.DOTALL)


class LLMRater:
    def __init__(self, scenario: Scenario, url: str, model: str, api_key: str | None = None,
                 timeout_s: float = 120.0, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.scenario, self.model = scenario, model
        self.name = f"llm:{model}@{url}"
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.AsyncClient(base_url=url.rstrip("/"), headers=headers, timeout=timeout_s,
                                        transport=transport)

    async def judge(self, reply: str, task: Task, complete: bool = True) -> Judgement:
        s = self.scenario
        if not complete:  # a cut reply fails, whoever rates it
            return Judgement(0.0, f"{s.complaint} It was cut off. {s.preference}", gate="cut", right=False)
        messages = [{"role": "system", "content": USER_LLM_SYSTEM.format(description=s.description,
                                                                          preference=s.preference)},
                    {"role": "user", "content": f"The message you sent:\n{task.prompt}\n\nThe reply:\n{reply}"}]
        r = await self.client.post("/chat/completions", json={"model": self.model, "messages": messages,
                                                               "temperature": 0, "max_tokens": 400})
        if r.status_code != 200:
            raise RuntimeError(f"user LLM at {self.client.base_url}: {r.status_code} {r.text[:300]}")
        text = r.json()["choices"][0]["message"]["content"] or ""
        score = parse_score(text, allowed=range(11))
        if score is None:
            raise RuntimeError(f"user LLM gave no \\boxed{{0..10}} rating: {text[:300]!r}")
        found = _CORRECTION.findall(text)
        right = s.right(reply, task)  # a verified fact, not the rater's opinion
        correction = (found[-1].strip() if found else "") or (
            None if score == 10 and right else s.preference if score < 10 else "That's not right.")
        return Judgement(score / 10, correction, right=right)

    async def close(self) -> None:
        await self.client.aclose()
