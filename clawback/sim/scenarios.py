"""Scenarios: a hidden preference, the tasks it is tested on, and its rule-based scorer.

A scenario's rating of a reply is the fraction of its checks the reply passes (0..1). Every check
is a plain, documented rule on the reply text, so a score can be recomputed by hand. Each check
also carries what a person says when the reply fails it; the simulated user's correction is built
from the failed checks only, so it states what it wanted, like a person would.

Three gates come before the checks, so that no rule can be passed by accident: a reply that was cut
by the token budget (finish_reason "length"), a reply that talks to the person about their
feedback (apologising, acknowledging, promising to do better, or repeating their request back to
them) and a reply that says the same sentence twice ("Sure!\nSure!\n…", a loop that happened to
end) fail every check. A reply *meets* the scenario when it passes every check **and its answer
is right** (the task's verified answer, every computation it writes out holding; answers.py): a
reply in the wanted form with a wrong answer is no reply a person wants. Sessions until
adaptation count those (sim/results.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace

from clawback.replies import repeats_a_sentence

from .answers import answer_right, arithmetic_holds
from .tasks import EVAL_ANSWERS, EVAL_PROBLEMS, PROBLEMS, STUDENT_ANSWERS


@dataclass(frozen=True)
class Task:
    prompt: str  # the user's message
    numbers: tuple[str, ...]  # numbers a specific reply may refer to
    unit: str
    answer: str  # the verified answer to the task's problem


@dataclass(frozen=True)
class Check:
    name: str
    passes: Callable[[str, Task], bool]
    ask: str  # what the user asks for when a reply fails this check ("don't use bold")


@dataclass(frozen=True)
class Rating:
    score: float  # fraction of checks passed
    failed: tuple[Check, ...]
    gate: str | None = None  # "cut" | "meta" | "repeat": why every check failed at once
    right: bool = True  # the answer is right (answers.py); a cut reply's is not

    @property
    def meets(self) -> bool:
        """The preference, every check of it, with a right answer: a wrong answer never meets."""
        return not self.failed and self.right


def _final_answer_right(reply: str, task: Task) -> bool:
    return answer_right(reply, task.answer, task.prompt)


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    train: tuple[Task, ...]
    eval: tuple[Task, ...]
    checks: tuple[Check, ...]
    complaint: str  # how the correction starts ("That looks AI-written.")
    # The generation-free probe (sim/probe.py): does a first token of the reply, as text, open a
    # reply that meets the preference? None: the scenario's rules are not about the opening.
    good_opener: Callable[[str], bool] | None = None
    # Whether the reply's answer is right, whatever its form: by default its final answer is the
    # task's and every computation it writes out holds (answers.py).
    right: Callable[[str, Task], bool] = _final_answer_right

    def rate(self, reply: str, task: Task, complete: bool = True) -> Rating:
        if not complete:
            gate = "cut"
        elif talks_about_feedback(reply) or echoes(reply, [c.ask for c in self.checks]):
            gate = "meta"
        else:
            gate = "repeat" if repeats_a_sentence(reply) else None
        if gate:  # a cut reply's last number is where the budget ran out, not its answer
            return Rating(0.0, self.checks, gate, right=gate != "cut" and self.right(reply, task))
        failed = tuple(c for c in self.checks if not c.passes(reply, task))
        return Rating(1 - len(failed) / len(self.checks), failed, right=self.right(reply, task))

    def correction(self, rating: Rating) -> str:
        """The user's own words: the complaint, then one request per failed check (a reply that
        was cut off, talked about the feedback or repeated itself is told so first). A reply in
        the wanted form with a wrong answer is called wrong, and no more: the person does not know
        the right answer."""
        asks = [c.ask for c in rating.failed]
        if not asks:
            return "That's not right."
        lead = {"cut": " It was cut off.", "meta": " Just answer, don't talk about my feedback.",
                "repeat": " Don't repeat yourself."}.get(rating.gate or "", "")
        return f"{self.complaint}{lead} Please {_join(asks)}."

    @property
    def preference(self) -> str:
        """Every check's request at once: the hint a person would give up front."""
        return f"Please {_join([c.ask for c in self.checks])}."


def _join(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


# ---------------------------------------------------------------- reply features


def words(text: str) -> list[str]:
    return re.findall(r"[A-Za-z0-9']+", text)


_BOLD = re.compile(r"\*\*[^*\n]+\*\*|__[^_\n]+__")
_HEADER = re.compile(r"^\s{0,3}#{1,6}\s+(?!\d)", re.MULTILINE)  # "#### 7" is an answer label, below
_NUMBERED = re.compile(r"^\s*(?:\d+[.)]|step\s*\d+\s*[:.)])\s*", re.MULTILINE | re.IGNORECASE)
_BULLET = re.compile(r"^\s*[-*•+]\s+", re.MULTILINE)
# Answer-label lines a student would not write: "Final answer: 7", "The answer is: 7", GSM8K's
# "#### 7" (which SmolLM2 often ends with), a LaTeX box.
_AI_PHRASES = re.compile(r"final answer|the answer is:|^\s*#{2,}\s*\d|\\boxed|in conclusion", re.IGNORECASE | re.MULTILINE)
ENCOURAGING = ("great", "good", "nice", "well done", "excellent", "keep it up", "keep up", "keep going",
               "keep practicing", "proud", "awesome", "fantastic", "wonderful", "you're on the right track",
               "good job", "great job", "nice work", "impressive", "brilliant")


# Talking to the person about their feedback instead of doing the task: apologising,
# acknowledging, promising. A reply like "I'm glad you're happy with your student's answer. I'll
# make sure to provide a more accurate..." answers the complaint, not the message.
_META = re.compile(
    r"\b(?:sorry|apologi[sz]e|apologies|feedback|my (?:previous|last|earlier) (?:reply|answer|response|comment)"
    r"|i(?:'ll| will) (?:make sure|keep (?:that|this) in mind|try to|do better)|you(?:'re| are) right"
    r"|thank(?:s| you) for (?:the|your) (?:feedback|correction|hint|note|reminder)"
    r"|glad you(?:'re| are) happy|as you (?:asked|requested)|hint"
    # a promise about the reply's form ("I'll just add the numbers to the end of the sentence.",
    # "I'll make it more concise:") or an acknowledgement ("I'll do that for you.")
    r"|i(?:'ll| will) (?:just |now |also )?(?:add|write|keep|start|use|include|put|make|give|provide|respond|reply)"
    r"\b[^.!?\n:\d]{0,40}\b(?:sentences?|repl(?:y|ies)|responses?|simple|short|brief|clear|concise|plain)"
    r"|i(?:'ll| will) do (?:that|this|so))\b", re.IGNORECASE)


def talks_about_feedback(text: str) -> bool:
    return bool(_META.search(text))


# How many words in a row of the person's own request make a reply an echo of it.
ECHO_WORDS = 5


def echoes(text: str, asks: list[str]) -> bool:
    """Repeats ECHO_WORDS or more words in a row of one of the person's requests ("Sure! I will
    write the work out in plain sentences with the numbers."): it talks about the request."""
    said = " ".join(words(text.lower()))
    for ask in asks:
        w = words(ask.lower())
        if any(f" {' '.join(w[i:i + ECHO_WORDS])} " in f" {said} " for i in range(len(w) - ECHO_WORDS + 1)):
            return True
    return False


def mentions_a_number_of(text: str, task: Task) -> bool:
    """Refers to one of the task's numbers (as a whole number, not inside another)."""
    return any(re.search(rf"(?<![\d.]){re.escape(n)}(?![\d])", text) for n in task.numbers)


def starts_with_sure(text: str) -> bool:
    """Opens with the word "Sure" once ("Sure!", "Sure, ", "Sure thing"): not "Surely not.", not
    "sure sure"."""
    return bool(re.match(r"\s*sure(?![a-z])(?![\s!,.:;]*sure\b)", text, re.IGNORECASE))


def starts_with_great_question(text: str) -> bool:
    """Opens with "Great question" once: not "Great question! Great question!"."""
    return bool(re.match(r"\s*great question\b(?![\s!,.:;]*great question\b)", text, re.IGNORECASE))


def encouraging(text: str) -> bool:
    low = text.lower()
    return any(w in low for w in ENCOURAGING)


# ---------------------------------------------------------------- scenarios


def _student_task(p) -> Task:
    return Task(f"Can you help me with my homework? {p.question}", (p.answer,), p.unit, p.answer)


# A computation written out: numbers joined by an operator, then "=" and a number ("3 x 16 - 9 =
# 39", "25 minutes * 12 days = 300").
_WORKED = re.compile(r"\d[^=\n]*?(?:[-+*/×÷]|\sx\s)[^=\n]*?=\s*\$?\d")


def works_something_out(text: str, task: Task) -> bool:
    """Names the task's answer, or writes a computation out: a result, right or wrong, that a
    person can follow. A bare wrong number ("17", "What fun 9-bit answer.") or a piece of one of
    the question's numbers ("14" for 140) is not one."""
    return mentions_a_number_of(text, task) or bool(_WORKED.search(text))


# Guards the other checks against an empty or evasive reply scoring full marks: some work, and the
# answer or a computation ("So, 11 hens lay 11 eggs." only repeats the question's numbers).
SHOWS_WORK = Check("shows_work", lambda r, t: len(words(r)) >= 12 and works_something_out(r, t),
                   "write the work out in plain sentences with the numbers")

STUDENT_CHECKS = (
    Check("no_bold", lambda r, t: not _BOLD.search(r), "don't use bold"),
    Check("no_headers", lambda r, t: not _HEADER.search(r), "don't use headers"),
    Check("no_numbered_steps", lambda r, t: not _NUMBERED.search(r), "don't use numbered lists or numbered steps"),
    Check("no_bullets", lambda r, t: not _BULLET.search(r), "don't use bullet points"),
    Check("no_ai_phrases", lambda r, t: not _AI_PHRASES.search(r), "don't end with answer labels like 'Final answer:', 'The answer is:' or '#### 7'"),
    # What a tutor does and the base model does not (bench/README.md, "In-context following").
    Check("asks_back", lambda r, t: r.rstrip(" \n*_").endswith("?"),
          "end with a question that checks I understood"),
    SHOWS_WORK,
)


def _answer_numbers(a) -> tuple[str, ...]:
    """Numbers the student wrote that are not in the problem: echoing the problem is not specific."""
    given = set(re.findall(r"\d+", a.problem.question))
    return tuple(n for n in dict.fromkeys(re.findall(r"\d+", a.answer)) if n not in given)


def _teacher_task(a) -> Task:
    prompt = ("I am a math teacher. Write a grading comment for my student's answer.\n"
              f"Problem: {a.problem.question}\nStudent's answer: {a.answer}")
    return Task(prompt, _answer_numbers(a), a.problem.unit, a.problem.answer)


TEACHER_CHECKS = (
    Check("specific", lambda r, t: mentions_a_number_of(r, t),
          "refer to a specific step or number from the student's answer (one they worked out, not one "
          "from the problem)"),
    Check("friendly", lambda r, t: encouraging(r), "be friendly and encouraging (say what they did well)"),
    Check("length", lambda r, t: 15 <= len(words(r)) <= 80, "keep it between 15 and 80 words"),
)


def _split(items, n_eval: int, make) -> tuple[tuple[Task, ...], tuple[Task, ...]]:
    tasks = tuple(make(i) for i in items)
    return tasks[:-n_eval], tasks[-n_eval:]


_student_train, _student_eval = _split(PROBLEMS, EVAL_PROBLEMS, _student_task)
_teacher_train, _teacher_eval = _split(STUDENT_ANSWERS, EVAL_ANSWERS, _teacher_task)

STUDENT = Scenario(
    "student", "homework help that must not look AI-written: no bold, headers, numbered steps, bullets "
    "or 'Final answer'; the work in plain sentences, ending with a question that checks understanding",
    _student_train, _student_eval, STUDENT_CHECKS, "That looks AI-written.",
    good_opener=lambda tok: not re.match(r"\s*(?:#|\*|-|•|\d+[.)]|step\b)", tok, re.IGNORECASE))

TEACHER = Scenario(
    "teacher", "grading comments that are specific (name a number from the answer), friendly "
    "(an encouraging word) and 15-80 words long",
    _teacher_train, _teacher_eval, TEACHER_CHECKS, "That comment is not what I need.",
    good_opener=lambda tok: encouraging(tok.strip()) and len(tok.strip()) > 2,
    # A grading comment has no final answer of its own: what it computes must hold.
    right=lambda r, t: arithmetic_holds(r))

# Candidate preferences for the third scenario, measured by bench/in_context_following.py: the
# rate at which the base model follows each when told in context, against its rate untold.
CANDIDATE_CHECKS = {
    "sure": Check("starts_with_sure", lambda r, t: starts_with_sure(r), "start your reply with 'Sure!'"),
    "short": Check("under_20_words", lambda r, t: 0 < len(words(r)) < 20, "answer in under 20 words"),
    "question": Check("ends_with_question", lambda r, t: r.rstrip().endswith("?"), "end your reply with a question"),
    "lowercase": Check("lowercase_only", lambda r, t: r.strip() != "" and r == r.lower(), "use lowercase letters only"),
    "unit": Check("mentions_unit", lambda r, t: t.unit.lower() in r.lower(), "name the unit of the result"),
}

# The third scenario takes the candidate the model follows best when told (bench/README.md,
# "In-context following": 0.00 untold, 0.88 told), so OPD's teacher really differs from the student.
# Its second request is worded as a person would follow up the opener; on Qwen2.5-Coder-0.5B the
# note in this wording is followed 0.80 told (bench/README.md, "Wordings of the notes").
SURE = Scenario(
    "sure", "homework help that opens with 'Sure!' and shows the work",
    _student_train, _student_eval,
    (CANDIDATE_CHECKS["sure"],
     replace(SHOWS_WORK, ask="then work the problem out in full sentences, showing each calculation "
                                         "and the result")), "Hmm.",
    good_opener=lambda tok: tok.strip().lower().startswith("sure"))

# Another opener, worded as `sure`'s: on Qwen2.5-Coder-0.5B the note is followed 1.00 told, 0.00
# untold (bench/README.md, "note_wordings.py: four more wordings"). What it does not rate: the
# told replies work in numbered steps, not the full sentences the second request asks for.
GREAT = replace(
    SURE, name="great", description="homework help that opens with 'Great question!' and shows the work",
    checks=(Check("starts_with_great", lambda r, t: starts_with_great_question(r),
                  "start your reply with 'Great question!'"),
            replace(SHOWS_WORK, ask="then work it out in full sentences, showing each calculation and the result")),
    good_opener=lambda tok: tok.strip().lower().startswith("great"))

# The fourth takes the next best (bench/README.md, "In-context following": 0.00 untold, 0.75 told
# with the hint in the user message). A short reply must still work something out: "Sure, I can
# help!" and "A bus carries 45 people." are short and answer nothing.
BRIEF = Scenario(
    "brief", "homework help in under 20 words that still works out a result",
    _student_train, _student_eval,
    (CANDIDATE_CHECKS["short"], Check("gives_a_result", works_something_out, "give the number you get")),
    "Hmm.")

# Preferences about the form of the whole reply, beyond its opening.
_ANSWER_LINE = re.compile(r"^\s*answer:\s*\$?\s?\d+(?:,\d{3})*(?:\.\d+)?\s*\.?\s*$", re.IGNORECASE)
_LATEX = re.compile(r"\\[\[\]()]|\\(?:boxed|frac|dfrac|times|div|cdot|text)\b|\$\$|```")


def ends_with_answer_line(text: str) -> bool:
    """The last line is the answer alone: "Answer: 15" (not "Answer: 15 apples", not bold)."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return bool(lines) and bool(_ANSWER_LINE.match(lines[-1]))


def plain_text(text: str) -> bool:
    """No markdown (bold, headers, numbered steps, bullets) and no LaTeX or code blocks."""
    return not any(p.search(text) for p in (_BOLD, _HEADER, _NUMBERED, _BULLET, _LATEX))


ANSWER_LINE = Scenario(
    "answer_line", "homework help whose last line is the answer alone, as 'Answer: <number>'",
    _student_train, _student_eval,
    (Check("answer_line", lambda r, t: ends_with_answer_line(r),
           "put the answer alone on the last line as 'Answer: <number>'"),), "Hmm.")

PLAIN = Scenario(
    "plain", "homework help in plain sentences: no markdown and no LaTeX, the work written out",
    _student_train, _student_eval,
    (Check("plain_text", lambda r, t: plain_text(r),
           "don't use markdown or LaTeX (no lists, headers, bold or math blocks)"),
     SHOWS_WORK), "Hmm.")

SCENARIOS: dict[str, Scenario] = {s.name: s for s in (STUDENT, TEACHER, SURE, GREAT, BRIEF, ANSWER_LINE, PLAIN)}


def scenario(name: str) -> Scenario:
    try:
        return SCENARIOS[name]
    except KeyError:
        raise ValueError(f"unknown scenario {name!r}; choose from {', '.join(sorted(SCENARIOS))}") from None
